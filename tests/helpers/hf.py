"""Hugging Face models: configs/lm_tiny.yaml with a small model, trained in this process;
``final/`` read back by transformers; a small pretrained llama to fine-tune. The test modules
that use these skip themselves without transformers (``pytest.importorskip``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from helpers.configs import LM_CFG, REPO, SMALL_LM
from helpers.in_process import reset_accelerate, run_cli
from helpers.tokens import SENTENCES
from linnaeus_accel import Trainer
from linnaeus_accel.config import Config, load_config
from linnaeus_accel.data import build_dataset
from linnaeus_accel.models import build_model

FT_CFG = str(REPO / "configs" / "lm_finetune.yaml")
# The pretrained base: a llama small enough to save and load in a moment.
BASE: dict[str, Any] = {
    "vocab_size": 257, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
    "num_attention_heads": 2, "max_position_embeddings": 129, "tie_word_embeddings": True,
}  # fmt: skip


def lm_config(tmp_path: Path, *opts: str, steps: int = 20) -> Config:
    """configs/lm_tiny.yaml with ``SMALL_LM``'s model, ``steps`` steps of 8 sequences, into ``tmp_path``."""
    return load_config(
        LM_CFG,
        [*SMALL_LM, "TRAIN.TARGET_TOKENS", str(steps * 8 * 128), "ENV.OUTPUT.BASE_DIR", str(tmp_path), *opts],
    )


def tokenized_lm_config(tmp_path: Path, tokenizer: Path, steps: int) -> Config:
    """``lm_config`` training on ``SENTENCES`` (x 40), tokenized by ``linnaeus-accel tokenize
    --tokenizer tokenizer`` into windows of 17 tokens."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(SENTENCES * 40) + "\n", encoding="utf-8")
    tokens = tmp_path / "tokens.bin"
    rc, out, err = run_cli("tokenize", str(corpus), "--tokenizer", str(tokenizer), "--output", str(tokens))
    assert rc == 0, out + err
    options = '{paths: ["' + str(tokens) + '"], seq_len: 17}'
    return lm_config(
        tmp_path, "DATA.DATASET.NAME", "token_files", "DATA.DATASET.OPTIONS", options, steps=steps
    )


def fit(config: Config, compiled: bool = False) -> tuple[Trainer, dict[str, Any]]:
    """The config's run, trained in this process: the Trainer and its summary. ``compiled``:
    through torch.compile (its eager backend: the same wrapping, compiled fast)."""
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
    import transformers

    loaded: Any = transformers.AutoModelForCausalLM.from_pretrained(final, output_loading_info=True)
    model, info = loaded
    assert {k: v for k, v in info.items() if v} == {}, info
    return model.eval()


def save_base(directory: Path, seed: int = 0) -> Path:
    """A small llama as save_pretrained writes it (random weights from ``seed``)."""
    import transformers

    torch.manual_seed(seed)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**BASE)).save_pretrained(directory)
    return directory


def ft_opts(base: Path, tmp_path: Path, steps: int, *more: str) -> list[str]:
    """configs/lm_finetune.yaml from ``base``, ``steps`` steps of 8 sequences, into ``tmp_path``."""
    return [
        "MODEL.OPTIONS.pretrained", str(base), "DATA.BATCH_SIZE", "8",
        "TRAIN.TARGET_TOKENS", str(steps * 8 * 128), "ENV.OUTPUT.BASE_DIR", str(tmp_path), *more,
    ]  # fmt: skip


def ft_config(base: Path, tmp_path: Path, steps: int, *more: str) -> Config:
    return load_config(FT_CFG, ft_opts(base, tmp_path, steps, *more))
