"""Bad pretrained directories and changed bases end in one sentence and exit 2, never a traceback
or a wrong number with exit 0.

- ``MODEL.OPTIONS.pretrained`` pointing at a damaged copy of a ``save_pretrained`` directory (a
  truncated config.json, a half-size model.safetensors, a model_type transformers does not know):
  ``train`` names the key, the file and what is wrong, without transformers' "pip install --upgrade"
  advice.
- ``evaluate`` of a LoRA checkpoint or ``final/`` with a base whose weights differ from those the
  adapter was trained on (one tensor changed) is refused naming ``MODEL.OPTIONS.pretrained``; a
  ``final/`` written before it recorded its base is evaluated with a warning.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO, reset_accelerate, run_cli

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")

FT_CFG = str(REPO / "configs" / "lm_finetune.yaml")
BASE = {
    "vocab_size": 257, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
    "num_attention_heads": 2, "max_position_embeddings": 129, "tie_word_embeddings": True,
}  # fmt: skip
WEIGHTS = "model.safetensors"


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny llama as save_pretrained writes it."""
    torch.manual_seed(0)
    directory = tmp_path_factory.mktemp("base") / "base"
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**BASE)).save_pretrained(directory)
    return directory


def opts(base: Path, out: Path, *more: str) -> list[str]:
    """configs/lm_finetune.yaml from ``base``: 4 steps of 4 sequences, no final/merged."""
    return [
        "MODEL.OPTIONS.pretrained", str(base), "DATA.BATCH_SIZE", "4", "TRAIN.TARGET_TOKENS", str(4 * 4 * 128),
        "MODEL.OPTIONS.lora.merge", "false", "ENV.OUTPUT.BASE_DIR", str(out), *more,
    ]  # fmt: skip


def assert_refused(rc: int, out: str, err: str, *parts: str) -> None:
    assert rc == 2, out + err
    assert "Traceback" not in err, err
    assert "pip install --upgrade" not in err, err
    for part in ("MODEL.OPTIONS.pretrained", *parts):
        assert part in err, err


# -- item 2: damaged pretrained directories ---------------------------------------------------------
def truncate_config(directory: Path) -> None:
    text = (directory / "config.json").read_text()
    (directory / "config.json").write_text(text[: len(text) // 2])


def halve_weights(directory: Path) -> None:
    data = (directory / WEIGHTS).read_bytes()
    (directory / WEIGHTS).write_bytes(data[: len(data) // 2])


def unknown_model_type(directory: Path) -> None:
    fields = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**fields, "model_type": "foo"}, indent=2))


@pytest.mark.parametrize(
    ("damage", "what"),
    [
        (truncate_config, ["config.json is not valid JSON (line ", "damaged or truncated"]),
        (halve_weights, [f"{WEIGHTS} is truncated or unreadable", "copy it again"]),
        (unknown_model_type, ["model_type 'foo' in ", "config.json is not one transformers", "correct it"]),
    ],
)
def test_a_damaged_pretrained_directory_exits_2_naming_the_key_and_the_file(
    tmp_path: Path, base: Path, damage: object, what: list[str]
) -> None:
    copy = shutil.copytree(base, tmp_path / "copy")
    damage(copy)  # type: ignore[operator]
    rc, out, err = run_cli("train", "--cfg", FT_CFG, "--opts", *opts(copy, tmp_path / "out"))
    assert_refused(rc, out, err, str(copy), *what)
    assert err.count("\n") == 2, err  # "invalid config (1 problem):" and the one line
    assert not (tmp_path / "out").exists()  # refused before the run directory is made


# -- item 9: evaluate against a changed base ----------------------------------------------------------
@pytest.fixture(scope="module")
def lora_run(base: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 4-step LoRA run from ``base``, checkpointed every 2 steps; its run directory."""
    out = tmp_path_factory.mktemp("lora")
    more = ["SCHEDULE.CHECKPOINT.INTERVAL_STEPS", "2", "SCHEDULE.CHECKPOINT.INTERVAL_EPOCHS", "null"]
    reset_accelerate()  # a module fixture runs before the test's fresh_accelerate_state
    try:
        rc, out_, err = run_cli("train", "--cfg", FT_CFG, "--opts", *opts(base, out, *more))
    finally:
        reset_accelerate()
    assert rc == 0, out_ + err
    return out / "lm_finetune"


@pytest.fixture(scope="module")
def changed_base(base: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``base`` with one tensor changed."""
    from safetensors.torch import load_file, save_file

    directory = Path(shutil.copytree(base, tmp_path_factory.mktemp("changed") / "base"))
    state = load_file(directory / WEIGHTS)
    name = next(n for n in state if n.endswith("mlp.down_proj.weight"))
    state[name] = state[name] + 0.5
    save_file(state, directory / WEIGHTS, metadata={"format": "pt"})
    return directory


def evaluate(run_dir: Path, weights: Path, base: Path, tmp_path: Path) -> tuple[int, str, str]:
    return run_cli(
        "evaluate", "--cfg", FT_CFG, "--checkpoint", str(weights), "--out", str(tmp_path / "eval.json"),
        "--opts", *opts(base, run_dir.parent),
    )  # fmt: skip


def test_evaluate_of_a_lora_checkpoint_refuses_a_changed_base(
    tmp_path: Path, lora_run: Path, base: Path, changed_base: Path
) -> None:
    checkpoint = sorted((lora_run / "checkpoints").glob("step_*"))[0]
    rc, out, err = evaluate(lora_run, checkpoint, base, tmp_path)
    assert rc == 0, out + err
    rc, out, err = evaluate(lora_run, checkpoint, changed_base, tmp_path)
    assert_refused(
        rc, out, err, f"not those checkpoint {checkpoint.name} was trained on", "found digest",
        "recorded", str(changed_base), "changed",
    )  # fmt: skip


def test_evaluate_of_a_lora_final_refuses_a_changed_base(
    tmp_path: Path, lora_run: Path, base: Path, changed_base: Path
) -> None:
    final = lora_run / "final"
    assert (final / "base_weights.json").is_file()
    rc, out, err = evaluate(lora_run, final, base, tmp_path)
    assert rc == 0, out + err
    assert "warning" not in err, err
    (tmp_path / "eval.json").unlink()
    rc, out, err = evaluate(lora_run, final, changed_base, tmp_path)
    assert_refused(rc, out, err, f"the adapter in {final} was trained on", str(changed_base))
    assert not (tmp_path / "eval.json").exists()


def test_evaluate_of_a_lora_final_without_a_base_record_warns(
    tmp_path: Path, lora_run: Path, base: Path
) -> None:
    """A final/ written before the record existed: evaluated, with a warning saying what is unchecked."""
    final = Path(shutil.copytree(lora_run / "final", tmp_path / "run" / "final"))
    (final / "base_weights.json").unlink()
    rc, out, err = evaluate(lora_run, final, base, tmp_path)
    assert rc == 0, out + err
    assert f"warning: {final} has no base_weights.json" in err, err
    assert "val/loss" in out
