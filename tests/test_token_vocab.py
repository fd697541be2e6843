"""Token ids outside the model's vocabulary, as a user meets them.

Every window of a token file is checked as it is read (one reduction a window, on the host, in the
DataLoader worker when there are workers) against the smallest of the data's ``vocab_size`` and the
model's embedding rows: a sidecar that lies, a file without one, a file read with the wrong dtype.

- Found during training: the run stops cleanly, ``summary.json`` says ``failed`` with the message,
  the command exits 1 with one line naming the file, the token's offset, its id and the
  vocabulary (no traceback), and the checkpoint written before the bad window stays committed.
- Found in the first windows, or known from a sidecar before anything runs: exit 2 naming the key,
  nothing written.
"""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers.configs import LM_CFG
from helpers.in_process import run_cli
from helpers.runs import committed, read_summary
from helpers.tokens import TINY_LM, cli_opts, config_of, write_sidecar, write_tokens
from torch.utils.data import DataLoader, Subset

from linnaeus_accel import Trainer, load_config
from linnaeus_accel.config import ConfigError
from linnaeus_accel.data import build_dataset
from linnaeus_accel.data.mixtures.mixture import Mixture, MixtureSource
from linnaeus_accel.data.tokens.files import TokenFiles
from linnaeus_accel.data.tokens.format import TokenOutOfVocab
from linnaeus_accel.data.tokens.vocab import limit_token_ids

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")


SEQ_LEN = 17
TOKENS = 210  # 13 windows of 17 tokens: 12 to train on, 1 held out (VAL_FRACTION 0.1)
# In window 10 alone (tokens 160-176): the 6th batch of 2, read ahead (the loader fetches a batch
# before it yields the one before it) once step 4 has trained and checkpointed.
BAD_AT = 168
BAD_ID = 150
MODEL_VOCAB = 100

# One epoch of 6 steps in order, a committed checkpoint every 2 steps (mid-epoch), metrics each step.
RUN = [
    *TINY_LM,
    "DATA.BATCH_SIZE", "2",
    "DATA.SHUFFLE", "false",
    "TRAIN.TARGET_TOKENS", "null",
    "TRAIN.EPOCHS", "1",
    "SCHEDULE.CHECKPOINT.INTERVAL_EPOCHS", "null",
    "SCHEDULE.CHECKPOINT.INTERVAL_STEPS", "2",
    "SCHEDULE.CHECKPOINT.MID_EPOCH", "true",
    "SCHEDULE.METRICS.STEP_INTERVAL", "1",
]  # fmt: skip


def corpus(path: Path, bad_at: int | None = BAD_AT, n: int = TOKENS) -> Path:
    """``n`` uint16 tokens below ``MODEL_VOCAB``, but ``BAD_ID`` at ``bad_at``."""
    tokens = np.random.default_rng(0).integers(0, MODEL_VOCAB, n)
    if bad_at is not None:
        tokens[bad_at] = BAD_ID
    return write_tokens(path, tokens)


def train(tmp_path: Path, options: dict[str, Any], *more: str) -> tuple[int, str, str, Path]:
    out = tmp_path / "outputs"
    code, stdout, stderr = run_cli(
        "train", "--cfg", LM_CFG, *cli_opts(out, {"seq_len": SEQ_LEN, **options}, *RUN, *more)
    )
    # A stopped run's Trainer is freed by the garbage collector (its parts refer to one another):
    # collected now, the files its datasets opened are not still open in the next test.
    gc.collect()
    return code, stdout, stderr, out / "lm_tiny"


def assert_stopped_at_the_bad_window(code: int, stderr: str, run_dir: Path, path: Path, says: str) -> str:
    """Exit 1 with one line naming the file, the offset, the id and ``says``; summary.json failed
    with that message; the checkpoint of step 4 (before the bad window) committed and kept."""
    assert code == 1, stderr
    assert "Traceback" not in stderr, stderr
    lines = [line for line in stderr.splitlines() if line.startswith("linnaeus-accel: ")]
    assert len(lines) == 1, stderr
    message = lines[0].removeprefix("linnaeus-accel: ")
    assert message.startswith(f"{path}: token {BAD_AT} has id {BAD_ID}, outside the vocabulary of "), message
    assert says in message, message
    assert "IndexError" not in stderr
    recorded = read_summary(run_dir)
    assert recorded["status"] == "failed"
    assert message in recorded["error"]
    assert recorded["global_step"] == 4  # steps 1-4 trained; the bad window was step 6's
    assert "step_00000004" in committed(run_dir)  # the resume point stays
    return message


def test_file_without_sidecar_or_vocab_size_stops_at_the_models_vocabulary(tmp_path: Path) -> None:
    """No sidecar and no DATA.DATASET.OPTIONS.vocab_size: only the model knows its vocabulary
    (before: an IndexError from F.embedding, a device-side assert on a GPU)."""
    path = corpus(tmp_path / "tokens.bin")
    options = {"paths": str(path), "dtype": "uint16"}
    code, _, stderr, run_dir = train(tmp_path, options, "MODEL.OPTIONS.vocab_size", str(MODEL_VOCAB))
    message = assert_stopped_at_the_bad_window(
        code, stderr, run_dir, path, f"of {MODEL_VOCAB} (the model's input embedding rows)"
    )
    assert "read as uint16 (the dtype option)" in message
    assert "MODEL.OPTIONS.vocab_size" in message  # one of the fixes


def test_vocab_size_option_stops_the_run_cleanly(tmp_path: Path) -> None:
    """DATA.DATASET.OPTIONS.vocab_size given (before: the right message, as a traceback)."""
    path = corpus(tmp_path / "tokens.bin")
    options = {"paths": str(path), "dtype": "uint16", "vocab_size": MODEL_VOCAB}
    code, _, stderr, run_dir = train(tmp_path, options)
    assert_stopped_at_the_bad_window(code, stderr, run_dir, path, f"of {MODEL_VOCAB} (the data's vocab_size)")


def test_a_window_read_in_a_dataloader_worker_arrives_whole(tmp_path: Path) -> None:
    """The training process rebuilds a worker's exception from its class and the worker's
    traceback text: it is still a TokenOutOfVocab (what the Trainer stops on), with the message
    alone."""
    path = corpus(tmp_path / "tokens.bin")
    dataset = TokenFiles.from_paths([path], SEQ_LEN, dtype="uint16", vocab_size=MODEL_VOCAB)
    batches = iter(DataLoader(dataset, batch_size=2, num_workers=1))
    for _ in range(5):  # windows 0-9
        next(batches)
    with pytest.raises(TokenOutOfVocab) as stopped:
        next(batches)
    message = str(stopped.value)
    assert message.startswith(f"{path}: token {BAD_AT} has id {BAD_ID}, outside the vocabulary of 100"), (
        message
    )
    assert "\n" not in message
    assert "Traceback" not in message
    # The loader goes on (window 12 is left); at its end its worker stops, not when the garbage
    # collector finds the loader (held by the exception's traceback, that takes 5 s).
    assert [len(batch["input_ids"]) for batch in batches] == [1]


def test_sidecar_whose_max_token_id_lies_is_not_trusted(tmp_path: Path) -> None:
    """The sidecar says no id reaches 100 (before: trusted, then an IndexError)."""
    path = corpus(tmp_path / "tokens.bin")
    write_sidecar(path, "uint16", TOKENS, max_token_id=MODEL_VOCAB - 1, vocab_size=MODEL_VOCAB)
    code, _, stderr, run_dir = train(tmp_path, {"paths": str(path)})
    message = assert_stopped_at_the_bad_window(
        code, stderr, run_dir, path, f"of {MODEL_VOCAB} (the data's vocab_size)"
    )
    assert f"its sidecar says its largest id is {MODEL_VOCAB - 1}" in message


def test_uint16_file_whose_sidecar_says_uint32_names_the_file_and_dtype(tmp_path: Path) -> None:
    """Read as uint32, every token pairs two uint16 ids (before: exit 2 naming TASK.NAME and an
    IndexError). The first window is bad: refused before training, nothing written."""
    path = corpus(tmp_path / "tokens.bin", bad_at=None)
    write_sidecar(path, "uint32", TOKENS // 2, max_token_id=MODEL_VOCAB - 1, vocab_size=MODEL_VOCAB)
    code, _, stderr, run_dir = train(tmp_path, {"paths": str(path)})
    assert code == 2, stderr
    for wrong in ("Traceback", "IndexError", "TASK.NAME"):
        assert wrong not in stderr, stderr
    assert f"DATA.DATASET: {path}: token 0 has id " in stderr, stderr
    assert f"read as uint32 (its sidecar, {path}.json)" in stderr
    assert "a uint16 file read as uint32" in stderr
    assert not run_dir.parent.exists()


def test_size_not_a_multiple_of_the_sidecars_dtype_names_the_file_and_dtype(tmp_path: Path) -> None:
    path = corpus(tmp_path / "tokens.bin", bad_at=None, n=TOKENS + 1)  # an odd count of uint16 tokens
    write_sidecar(path, "uint32", TOKENS // 2, max_token_id=MODEL_VOCAB - 1, vocab_size=MODEL_VOCAB)
    code, _, stderr, run_dir = train(tmp_path, {"paths": str(path)})
    assert code == 2, stderr
    assert "Traceback" not in stderr
    assert (
        f"DATA.DATASET.OPTIONS.paths: token_files: {path} is {2 * TOKENS + 2} bytes, not a multiple of 4 (uint32 tokens"
        in stderr
    )
    assert f"its sidecar, {path}.json, says uint32" in stderr
    assert not run_dir.parent.exists()


def test_sidecar_max_token_id_past_the_models_embedding_is_refused_at_start(tmp_path: Path) -> None:
    """Known before any window is read: the model's embedding (MODEL.OPTIONS.vocab_size) against
    the sidecar's largest id, exit 2 naming the key; nothing written."""
    path = corpus(tmp_path / "tokens.bin", bad_at=None)
    write_sidecar(path, "uint16", TOKENS, max_token_id=MODEL_VOCAB - 1, vocab_size=MODEL_VOCAB)
    code, _, stderr, run_dir = train(tmp_path, {"paths": str(path)}, "MODEL.OPTIONS.vocab_size", "64")
    assert code == 2, stderr
    assert (
        f"MODEL.OPTIONS.vocab_size: is 64, but the training data holds token id {MODEL_VOCAB - 1}" in stderr
    )
    assert "Traceback" not in stderr
    assert not run_dir.parent.exists()


def test_every_window_is_checked_against_the_limit_given(tmp_path: Path) -> None:
    """The dataset alone: a sidecar's max_token_id does not skip the check, a model's limit below
    the data's vocab_size tightens it, and a negative id is always out."""
    path = corpus(tmp_path / "tokens.bin", bad_at=None)
    write_sidecar(path, "uint16", TOKENS, max_token_id=MODEL_VOCAB - 1, vocab_size=MODEL_VOCAB)
    dataset = build_dataset(config_of({"paths": str(path), "seq_len": SEQ_LEN}), "train")
    first = dataset[0]["input_ids"]
    assert limit_token_ids(dataset, int(first.max()), "the model's input embedding rows") == [dataset]
    with pytest.raises(TokenOutOfVocab) as stopped:
        dataset[0]
    top = int(first.argmax())
    assert str(stopped.value).startswith(
        f"{path}: token {top} has id {int(first.max())}, outside the vocabulary of {int(first.max())} "
        "(the model's input embedding rows)"
    )

    signed = write_tokens(tmp_path / "signed.npy", [5] * 40 + [-3] + [5] * 40, "int32")
    dataset = build_dataset(config_of({"paths": str(signed), "seq_len": SEQ_LEN}), "train")
    dataset[1]
    with pytest.raises(TokenOutOfVocab, match=r"token 40 has id -3: a token id is never negative"):
        dataset[2]


def test_token_files_in_a_mixture_take_the_models_limit(tmp_path: Path) -> None:
    a = TokenFiles.from_paths([corpus(tmp_path / "a.bin", bad_at=None)], SEQ_LEN, dtype="uint16")
    b = TokenFiles.from_paths([corpus(tmp_path / "b.bin", bad_at=20)], SEQ_LEN, dtype="uint16")
    mixture = Mixture([MixtureSource("a", a, 1.0), MixtureSource("b", Subset(b, range(3)), 1.0)])
    assert limit_token_ids(mixture, MODEL_VOCAB, "the model's input embedding rows") == [a, b]
    mixture[len(a)]  # b's window 0
    with pytest.raises(TokenOutOfVocab, match=f"token 20 has id {BAD_ID}, outside the vocabulary of 100"):
        mixture[len(a) + 1]


def test_a_model_built_in_python_smaller_than_the_sidecars_ids_is_refused(tmp_path: Path) -> None:
    """No MODEL.OPTIONS.vocab_size to name: the model's embedding against the sidecar, before the
    model runs (its first windows hold ids past it), keyed MODEL."""
    from transformers import LlamaConfig, LlamaForCausalLM

    path = corpus(tmp_path / "tokens.bin", bad_at=None)
    write_sidecar(path, "uint16", TOKENS, max_token_id=MODEL_VOCAB - 1, vocab_size=MODEL_VOCAB)
    config = load_config(LM_CFG, cli_opts(tmp_path / "outputs", {"paths": str(path), "seq_len": SEQ_LEN})[1:])
    sizes = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2}
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, **sizes))
    with pytest.raises(ConfigError) as refused:
        Trainer(config, model, build_dataset(config, "train"), build_dataset(config, "val"))
    assert refused.value.problems == [
        (
            "MODEL",
            f"the model's input embedding rows are 64, but the training data holds token id {MODEL_VOCAB - 1} "
            f"(in {path}): the model would have no output for ids 64 to {MODEL_VOCAB - 1}; give it at least "
            f"{MODEL_VOCAB} (MODEL.OPTIONS.vocab_size for hf_causal_lm)",
        )
    ]
    assert not (tmp_path / "outputs").exists()


def test_worker_message_is_unwrapped() -> None:
    """A DataLoader worker's exception is rebuilt in the main process from its class and the
    worker's traceback text: the message alone is kept."""
    wrapped = (
        "Caught TokenOutOfVocab in DataLoader worker process 0.\nOriginal Traceback (most recent call last):\n"
        '  File "x.py", line 1, in <module>\n'
        "linnaeus_accel.data.tokens.format.TokenOutOfVocab: a.bin: token 3 has id 9, outside ...\n"
    )
    assert str(TokenOutOfVocab(wrapped)) == "a.bin: token 3 has id 9, outside ..."
    assert str(TokenOutOfVocab("plain")) == "plain"
