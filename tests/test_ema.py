"""The built-in ``ema`` callback: the average equals the formula applied to the weights of every
step, bit for bit; ``final/ema/`` is read by ``evaluate`` and gives the ``val_ema/`` numbers the run
logged; bad options are refused. On 2 processes, preempted and rerun, the average and its metrics
are byte-identical to an uninterrupted run's: ``test_resume.py`` (its 2-process runs use ema).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from helpers.configs import DEFAULT_CONFIG
from helpers.in_process import reset_accelerate, run_cli
from helpers.processes import AFTER_FIRST_COMMIT
from helpers.runs import TrainRun
from safetensors.torch import load_file

from linnaeus_accel import Callback, register_callback
from linnaeus_accel.callbacks.ema import EMA

pytestmark = pytest.mark.slow

NAME = "digits_default"
DECAY = 0.8


@register_callback("test_weights_recorder")
class WeightsRecorder(Callback):
    """Every step's weights (after the step), and the weights the run starts from."""

    recorded: ClassVar[list[dict[str, torch.Tensor]]] = []

    def on_setup(self, trainer: Any) -> None:
        type(self).recorded = [self._weights(trainer)]

    def on_step_end(self, trainer: Any, step: int) -> None:
        type(self).recorded.append(self._weights(trainer))

    @staticmethod
    def _weights(trainer: Any) -> dict[str, torch.Tensor]:
        model = trainer.accelerator.unwrap_model(trainer.model)
        return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_the_average_is_the_formula_over_every_step_and_evaluate_reads_it(tmp_path: Path) -> None:
    opts = [
        "ENV.OUTPUT.BASE_DIR", str(tmp_path), "TRAIN.EPOCHS", "2", "DATA.BATCH_SIZE", "256",
        "CALLBACKS", f"[{{NAME: ema, OPTIONS: {{decay: {DECAY}, warmup: true, validate: true}}}}, {{NAME: test_weights_recorder}}]",
    ]  # fmt: skip
    reset_accelerate()
    try:
        rc, out, err = run_cli("train", "--cfg", str(DEFAULT_CONFIG), "--opts", *opts)
    finally:
        reset_accelerate()
    assert rc == 0, out + err
    run = tmp_path / NAME
    steps = WeightsRecorder.recorded
    assert len(steps) == 1 + 12  # the start, then 2 epochs of 6 steps
    expected = {k: v.clone() for k, v in steps[0].items()}
    for n, weights in enumerate(steps[1:]):
        decay = min(DECAY, (1 + n) / (10 + n))  # warmup
        for k, v in weights.items():
            if v.is_floating_point():
                expected[k].lerp_(v, 1.0 - decay)
    average = load_file(run / "final" / "ema" / "model.safetensors")
    assert average.keys() == expected.keys()
    for k in average:
        assert torch.equal(average[k], expected[k]), k
    first = next(iter(average))
    assert not torch.equal(average[first], steps[-1][first])  # an average, not the last weights

    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    ema_records = [r for r in records if "val_ema/loss" in r]
    assert [r["global_step"] for r in ema_records] == [6, 12]  # after each epoch's validation
    assert "val_ema/chain_acc" in out.split("epoch 2: val/loss")[1]  # on the epoch's validation line
    reset_accelerate()
    try:
        rc, out, err = run_cli(
            "evaluate",
            "--cfg",
            str(DEFAULT_CONFIG),
            "--checkpoint",
            str(run / "final" / "ema"),
            "--opts",
            *opts,
        )
    finally:
        reset_accelerate()
    assert rc == 0, out + err
    evaluated = json.loads(next((run / "eval").glob("*.json")).read_text())
    assert evaluated["metrics"]["val/loss"] == ema_records[-1]["val_ema/loss"]


def test_bad_options_are_refused() -> None:
    with pytest.raises(Exception, match="decay"):
        EMA(decay=1.0)
    reset_accelerate()
    try:
        rc, out, err = run_cli(
            "train",
            "--cfg",
            str(DEFAULT_CONFIG),
            "--opts",
            "CALLBACKS",
            "[{NAME: ema, OPTIONS: {decay: 2, tau: 1}}]",
        )
    finally:
        reset_accelerate()
    assert rc == 2, out + err
    assert "CALLBACKS.0.OPTIONS.decay" in err
    assert "CALLBACKS.0.OPTIONS.tau" in err


def test_ema_added_to_a_run_under_way_starts_from_the_resumed_weights(tmp_path: Path) -> None:
    """Its average is registered state saved by name (not by position, as Accelerate's pickles
    were): a callback added when a run resumes starts fresh, from the weights trained so far."""
    from safetensors.torch import load_file

    opts = ["TRAIN.EPOCHS", "2", "DATA.BATCH_SIZE", "256", "SCHEDULE.CHECKPOINT.INTERVAL_EPOCHS", "1"]
    run = TrainRun(tmp_path, opts)
    # after the checkpoint of step 6 (the kill waits for its background commit)
    assert run.run(kill_at="optimizer_step:9", extra_env=AFTER_FIRST_COMMIT).returncode != 0
    with_ema = TrainRun(tmp_path, [*opts, "CALLBACKS", "[{NAME: ema}]"])
    resumed = with_ema.run()
    assert resumed.returncode == 0, resumed.tail()
    assert "callback ema has no state in the checkpoint: it starts fresh" in resumed.output
    at_6 = load_file(run.dir / "checkpoints" / "step_00000006" / "model.safetensors")
    final, ema = (
        load_file(run.dir / "final" / "model.safetensors"),
        load_file(run.dir / "final" / "ema" / "model.safetensors"),
    )
    for name, weights in at_6.items():
        moved = (final[name] - weights).abs().max()
        # decay 0.999 over 6 updates from the step-6 weights: about 0.6% of the way to the final ones.
        assert (ema[name] - weights).abs().max() < 0.05 * moved, name
