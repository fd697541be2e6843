"""The Hugging Face round trip: a causal-LM run's ``final/`` is a transformers model directory.

``AutoModelForCausalLM.from_pretrained(final)`` loads every tensor (the tied ``lm_head`` tied back,
nothing missing or unexpected) and gives the trained model's logits; ``linnaeus-accel evaluate`` on
it gives the run's last validation loss; the same for a compiled model. The run's tokenizer.json
goes beside the weights and ``AutoTokenizer`` reads it. On 2 processes: ``test_lm.py``'s reference
run checks its ``final/`` the same way.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import REPO, reset_accelerate
from test_lm import SMALL_LM

from linnaeus_accel import Trainer
from linnaeus_accel.config import Config, load_config
from linnaeus_accel.data import build_dataset
from linnaeus_accel.evaluate import evaluate
from linnaeus_accel.models import build_model

transformers = pytest.importorskip("transformers")

LM_CFG = str(REPO / "configs" / "lm_tiny.yaml")


def lm_config(tmp_path: Path, *opts: str, steps: int = 20) -> Config:
    return load_config(
        LM_CFG,
        [*SMALL_LM, "TRAIN.TARGET_TOKENS", str(steps * 8 * 128), "ENV.OUTPUT.BASE_DIR", str(tmp_path), *opts],
    )


def train(config: Config, compiled: bool = False) -> tuple[Trainer, dict[str, Any]]:
    """``compiled``: through torch.compile (its eager backend: the same wrapping, compiled fast)."""
    from accelerate import Accelerator

    reset_accelerate()
    accelerator = Accelerator(dynamo_backend="eager") if compiled else None
    train_data, val_data = build_dataset(config, "train"), build_dataset(config, "val")
    trainer = Trainer(config, build_model(config, train_data), train_data, val_data, accelerator=accelerator)
    try:
        return trainer, trainer.fit()
    finally:
        reset_accelerate()


def load_final(final: Path) -> Any:
    """The model transformers loads from ``final``; nothing missing, unexpected or mismatched."""
    model, info = transformers.AutoModelForCausalLM.from_pretrained(final, output_loading_info=True)
    assert {k: v for k, v in info.items() if v} == {}, info
    return model.eval()


def some_windows(config: Config) -> torch.Tensor:
    val = build_dataset(config, "val")
    return torch.stack([val[i]["input_ids"] for i in range(4)])


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_final_is_a_transformers_model_with_the_trained_weights(
    tmp_path: Path, compiled: bool, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{}")  # the working directory's: not the run's tokenizer
    config = lm_config(tmp_path, "ENV.PROGRESS_BAR", "false")
    trainer, summary = train(config, compiled)
    # The console of a token task reads in tokens/s.
    assert re.search(
        r"^epoch 1 step 5/20: loss [\d.]+, lr \S+, tokens/s [\d,]+, ", capsys.readouterr().out, re.M
    )
    final = config.output_dir / "final"
    assert {p.name for p in final.iterdir()} == {"config.json", "generation_config.json", "model.safetensors"}
    loaded = load_final(final)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight  # tied back, not a copy
    assert compiled == (type(trainer.model).__name__ == "OptimizedModule")
    trained = trainer.accelerator.unwrap_model(trainer.model, keep_torch_compile=False).eval()
    windows = some_windows(config)
    with torch.no_grad():
        assert torch.equal(loaded(windows).logits, trained(windows).logits)
    reset_accelerate()
    try:
        result = evaluate(config, final, out=tmp_path / "eval.json")
    finally:
        reset_accelerate()
    assert result["metrics"]["val/loss"] == summary["last_validation"]["val/loss"]


def test_the_runs_tokenizer_goes_beside_the_weights(tmp_path: Path) -> None:
    """Token files written by ``tokenize --tokenizer tokenizer.json``: final/ holds that tokenizer
    as transformers reads it, with the run's end-of-document token as its eos_token."""
    from conftest import run_cli
    from test_tokenize import SENTENCES, train_tokenizer

    bpe = tmp_path / "tokenizer.json"
    tokenizer = train_tokenizer(bpe, "<|endoftext|>")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(SENTENCES * 40) + "\n", encoding="utf-8")
    rc, out, err = run_cli(
        "tokenize", str(corpus), "--tokenizer", str(bpe), "--output", str(tmp_path / "tokens.bin")
    )
    assert rc == 0, out + err
    options = '{paths: ["' + str(tmp_path / "tokens.bin") + '"], seq_len: 17}'
    config = lm_config(tmp_path, "DATA.DATASET.NAME", "token_files", "DATA.DATASET.OPTIONS", options, steps=4)
    train(config)
    final = config.output_dir / "final"
    loaded = transformers.AutoTokenizer.from_pretrained(final)
    text = "The quick brown fox: Zwölf Boxkämpfer"
    assert loaded(text)["input_ids"] == tokenizer.encode(text).ids
    assert loaded.eos_token == "<|endoftext|>"
    assert load_final(final).config.vocab_size == tokenizer.get_vocab_size()
