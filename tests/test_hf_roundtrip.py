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

import pytest
import torch
from helpers.hf import fit, lm_config, load_final, tokenized_lm_config
from helpers.in_process import reset_accelerate
from helpers.tokens import train_tokenizer

from linnaeus_accel.config import Config
from linnaeus_accel.data import build_dataset
from linnaeus_accel.evaluate import evaluate

transformers = pytest.importorskip("transformers")


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
    trainer, summary = fit(config, compiled)
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

    bpe = tmp_path / "tokenizer.json"
    tokenizer = train_tokenizer(bpe, "<|endoftext|>")
    config = tokenized_lm_config(tmp_path, bpe, steps=4)
    fit(config)
    final = config.output_dir / "final"
    loaded = transformers.AutoTokenizer.from_pretrained(final)
    text = "The quick brown fox: Zwölf Boxkämpfer"
    assert loaded(text)["input_ids"] == tokenizer.encode(text).ids
    assert loaded.eos_token == "<|endoftext|>"
    assert load_final(final).config.vocab_size == tokenizer.get_vocab_size()
