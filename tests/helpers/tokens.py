"""Token data: token files and their sidecars as ``linnaeus-accel tokenize`` writes them, a tiny
byte-level BPE tokenizer, and the configs that train on token files."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from linnaeus_accel.config import Config, validate_config
from linnaeus_accel.data.tokens.format import TokenSidecar, sidecar_path

if TYPE_CHECKING:
    from tokenizers import Tokenizer

OPTIONS = "DATA.DATASET.OPTIONS"
SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Pack my box with five dozen liquor jugs!",
    "Zwölf Boxkämpfer jagen Viktor quer über den großen Sylter Deich.",
]
# configs/lm_tiny.yaml's model at its smallest, for windows of up to 33 tokens.
TINY_LM = [
    "MODEL.OPTIONS.hidden_size", "16",
    "MODEL.OPTIONS.intermediate_size", "32",
    "MODEL.OPTIONS.num_hidden_layers", "1",
    "MODEL.OPTIONS.num_attention_heads", "2",
    "MODEL.OPTIONS.max_position_embeddings", "33",
]  # fmt: skip


def train_tokenizer(path: Path, special: str) -> Tokenizer:
    """A tiny byte-level BPE whose decode gives back its input exactly, saved to ``path``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=[special],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(SENTENCES * 20, trainer)
    tokenizer.save(str(path))
    return tokenizer


def write_tokens(path: Path, tokens: Sequence[int] | np.ndarray[Any, Any], dtype: str = "uint16") -> Path:
    """Raw little-endian tokens (``.bin``) or a ``.npy`` of ``dtype``."""
    array = np.asarray(tokens).astype(np.dtype(dtype).newbyteorder("<"))
    if path.suffix == ".npy":
        np.save(path, array)
    else:
        array.tofile(path)
    return path


def write_sidecar(path: Path, dtype: str, num_tokens: int, max_token_id: int, vocab_size: int = 257) -> None:
    """A sidecar as ``tokenize`` writes it (byte-level unless ``vocab_size`` says otherwise)."""
    sidecar = TokenSidecar(
        dtype=dtype,
        num_tokens=num_tokens,
        num_documents=1,
        vocab_size=vocab_size,
        eos_id=vocab_size - 1,
        max_token_id=max_token_id,
        tokenizer={"type": "bytes"},
    )
    sidecar_path(path).write_text(sidecar.to_json(), encoding="utf-8")


def config_of(options: dict[str, Any], val_fraction: float = 0.1) -> Config:
    """The default config reading ``token_files`` with these options."""
    dataset = {"NAME": "token_files", "OPTIONS": options, "VAL_FRACTION": val_fraction}
    return validate_config({"DATA": {"DATASET": dataset}, "EXPERIMENT": {"SEED": 0}})


def cli_opts(out: Path, options: dict[str, Any], *more: str) -> list[str]:
    """``--opts`` training ``configs/lm_tiny.yaml`` on token files into ``out``: OPTIONS as one
    YAML value (JSON is YAML), merged into the config's."""
    return [
        "--opts",
        "ENV.OUTPUT.BASE_DIR", str(out),
        "DATA.DATASET.NAME", "token_files",
        OPTIONS, json.dumps(options),
        *more,
    ]  # fmt: skip
