"""``examples/quickstart.ipynb`` runs headless, top to bottom, in a real Jupyter kernel (nbclient),
as a user running it would: any cell that raises fails the test. Its run writes only to a
temporary directory, and what the notebook shows (the plan's summary, the schedule plot, the loss
plot) is there in the executed cells' outputs."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import nbformat
import pytest
from helpers.configs import REPO
from nbclient import NotebookClient

NOTEBOOK = REPO / "examples" / "quickstart.ipynb"


def outputs_of(cell: Any) -> tuple[str, set[str]]:
    """(the text a cell printed or returned, the MIME types of its rich outputs)."""
    text, kinds = [], set()
    for out in cell.get("outputs", []):
        if out["output_type"] == "stream":
            text.append(out["text"])
        elif out["output_type"] in ("execute_result", "display_data"):
            kinds.update(out["data"])
            text.append(out["data"].get("text/plain", ""))
    return "".join(text), kinds


def test_the_committed_notebook_holds_no_outputs() -> None:
    # Executed by the test below, committed clean: the repository stays small and diffs readable.
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code
    assert all(not c.outputs and c.execution_count is None for c in code)


@pytest.mark.slow
def test_quickstart_notebook_runs_headless(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    outputs = tmp_path / "outputs"
    monkeypatch.setenv("QUICKSTART_OUTPUT_DIR", str(outputs))  # read by the notebook's first cell
    nb = nbformat.read(NOTEBOOK, as_version=4)
    n_cells = len(nb.cells)
    # One more cell, for this test only: the kernel must run this interpreter (the venv's).
    nb.cells.append(nbformat.v4.new_code_cell("import sys; print(sys.executable)"))
    # jupyter_client starts the "python3" kernel with sys.executable; the working directory is a
    # temporary one, so that nothing the notebook does lands in the repository.
    client = NotebookClient(
        nb, kernel_name="python3", timeout=300, resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()  # raises CellExecutionError, naming the cell, if any cell fails

    printed, _ = outputs_of(nb.cells[-1])
    assert Path(printed.strip()) == Path(sys.executable)
    shown = [outputs_of(c) for c in nb.cells[:n_cells] if c.cell_type == "code"]
    text = "".join(t for t, _ in shown)
    assert "Schedule summary" in text
    assert "completed at step 90 of 90" in text
    images = [kinds for _, kinds in shown if "image/png" in kinds]
    assert len(images) == 2, "the schedule plot and the loss plot are shown inline"

    run = outputs / "quickstart"
    summary = json.loads((run / "summary.json").read_text(encoding="utf-8"))
    assert summary["status"] == "completed"
    assert summary["global_step"] == 90  # 1500 samples / batch 50 = 30 steps x 3 epochs
    assert summary["last_validation"]["val/acc"] > 0.7
    lines = (run / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    losses = [r["train/loss"] for r in map(json.loads, lines) if "train/loss" in r]
    assert len(losses) == 18  # every 5 steps
    assert losses[-1] < losses[0]
    assert (run / "assets" / "schedule.png").read_bytes().startswith(b"\x89PNG")
    assert not (REPO / "outputs" / "quickstart").exists()
