"""``TASK.DOCUMENT_MASKING``: causal_lm attends within each document of a packed window.

- The position of each token in its document, on a table of windows (EOS at the start, at the end,
  twice in a row, none).
- Under masking, the summed loss of a window of several documents is the sum of the losses of each
  document run alone (positions from 0), for a transformers Llama (sdpa and eager attention) and
  for the nanoGPT example model (its own loss, position_ids in its forward).
- Off, the loss is the one the model gives without the feature, to the byte; on, a model of one's
  own reads nothing back to the host.
- Refusals, each naming the key: another task, the chunked loss, data without an end-of-document
  id, a model whose forward takes no position_ids, batches with an attention_mask.
- A short training run on token files with masking on: it says so at the start and learns.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from helpers.configs import LM_CFG
from helpers.in_process import run_cli, run_here
from helpers.nanogpt import EXAMPLE, ReadBacks, tiny_gpt
from helpers.runs import TrainRun, assert_resumed_from, assert_same_run, committed
from helpers.tokens import TINY_LM, cli_opts, write_sidecar, write_tokens
from torch import Tensor, nn

from linnaeus_accel import load_config
from linnaeus_accel.config import ConfigError
from linnaeus_accel.tasks.causal_lm import CausalLMTask
from linnaeus_accel.tasks.document_masking import document_positions
from linnaeus_accel.training.start.task_checks import probe_problem

EOS = 9


@pytest.mark.parametrize(
    ("ids", "positions"),
    [
        # No EOS: one document, the whole window.
        ([1, 2, 3, 4], [0, 1, 2, 3]),
        # EOS first: it ends a document begun before the window (position 0); the next starts anew.
        ([EOS, 1, 2, 3], [0, 0, 1, 2]),
        # EOS last: it is its document's last position; nothing after it in the window.
        ([1, 2, 3, EOS], [0, 1, 2, 3]),
        # EOS in the middle: the token after it is position 0 of the next document.
        ([1, 2, EOS, 3, 4], [0, 1, 2, 0, 1]),
        # Two EOS in a row: the second is an empty document of its own (position 0).
        ([1, EOS, EOS, 2], [0, 1, 0, 0]),
        # Only EOS: every token is a document of one.
        ([EOS, EOS, EOS], [0, 0, 0]),
    ],
)
def test_positions_restart_after_each_end_of_document(ids: list[int], positions: list[int]) -> None:
    got = document_positions(torch.tensor([ids, ids]), EOS)  # two rows: each row on its own
    assert got.dtype == torch.int64
    assert got.tolist() == [positions, positions]


# Three documents (the first begun before the window, the last cut off by its end) and an
# empty one (two EOS in a row): (start, end) of each, its EOS included.
WINDOW = [3, 4, 5, EOS, 6, 7, EOS, EOS, 1, 2, 8, 3, EOS, 4, 5]
DOCUMENTS = [(0, 4), (4, 7), (7, 8), (8, 13), (13, 15)]


def batch_of(ids: list[int]) -> dict[str, Tensor]:
    tokens = torch.tensor([ids])
    return {"input_ids": tokens, "labels": tokens.clone()}


def alone(start: int, end: int) -> dict[str, Tensor]:
    """A document run on its own: its tokens and, as the target of its last position (its EOS),
    the next document's first token, which the window's EOS position predicts too (the extra
    token is last, so it changes no other prediction of a causal model)."""
    return batch_of(WINDOW[start : end + 1])


def llama(attention: str) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=16,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
        attn_implementation=attention,
    )
    return LlamaForCausalLM(config)


def masked_and_alone(task: CausalLMTask, model: nn.Module) -> tuple[Tensor, Tensor]:
    """The window's summed loss under masking, and the sum over its documents run alone."""
    window = task.loss_sums(model, batch_of(WINDOW))
    task.document_masking = False  # one document per batch: nothing to mask
    documents = sum(task.loss_sums(model, alone(s, e)) for s, e in DOCUMENTS)
    assert isinstance(documents, Tensor)
    return window, documents


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_llama_window_loss_is_the_sum_over_its_documents_alone(attention: str) -> None:
    model = llama(attention)
    window, documents = masked_and_alone(CausalLMTask(document_masking=True, eos_id=EOS), model)
    assert window.item() == pytest.approx(documents.item(), abs=1e-5)
    # Without masking the window's later documents see the earlier ones: the loss differs.
    unmasked = CausalLMTask().loss_sums(model, batch_of(WINDOW))
    assert abs(unmasked.item() - window.item()) > 1e-3


def test_with_the_chunked_loss_the_masked_loss_and_gradients_are_the_same() -> None:
    """Both on (the pretraining recipe): the chunked loss calls the model with the same positions."""
    model = llama("sdpa")
    plain = CausalLMTask(document_masking=True, eos_id=EOS)
    chunked = CausalLMTask(document_masking=True, eos_id=EOS)
    chunked.loss_chunk_tokens = 4  # 14 targets: 4 chunks, the last partial
    losses, grads = [], []
    for task in (plain, chunked):
        model.zero_grad()
        loss = task.loss_sums(model, batch_of(WINDOW)).sum()
        loss.backward()
        losses.append(loss.item())
        grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(*grads, strict=True))
    _, documents = masked_and_alone(CausalLMTask(document_masking=True, eos_id=EOS), model)
    assert losses[1] == pytest.approx(documents.item(), abs=1e-5)


def test_nanogpt_window_loss_is_the_sum_over_its_documents_alone() -> None:
    model = tiny_gpt()
    task = CausalLMTask(model_loss=True, ignore_index=EXAMPLE.IGNORE, document_masking=True, eos_id=EOS)
    window, documents = masked_and_alone(task, model)
    assert window.item() == pytest.approx(documents.item(), abs=1e-5)
    unmasked = CausalLMTask(model_loss=True, ignore_index=EXAMPLE.IGNORE).loss_sums(model, batch_of(WINDOW))
    assert abs(unmasked.item() - window.item()) > 1e-3


def test_masking_reads_nothing_back_to_the_host_for_a_model_of_ones_own() -> None:
    """The positions and the nanoGPT model's block-causal mask are device ops only (a transformers
    model reads its positions back once per forward, to find the documents: the guide says so)."""
    gpt, task = (
        tiny_gpt(),
        CausalLMTask(model_loss=True, ignore_index=EXAMPLE.IGNORE, document_masking=True, eos_id=EOS),
    )
    task.loss_sums(gpt, batch_of(WINDOW))  # the first call reads the forward's signature
    with ReadBacks() as reads:
        task.loss_sums(gpt, batch_of(WINDOW)).sum().backward()  # type: ignore[no-untyped-call]
    assert reads.found == []


def test_off_the_loss_is_the_models_own_to_the_byte() -> None:
    batch = batch_of(WINDOW)
    model = llama("sdpa")
    logits = model(batch["input_ids"]).logits[:, :-1]
    plain = F.cross_entropy(
        logits.reshape(-1, 16).float(), batch["labels"][:, 1:].reshape(-1), reduction="sum"
    )
    assert torch.equal(CausalLMTask(eos_id=EOS).loss_sums(model, batch)[0], plain)

    gpt = tiny_gpt()
    inputs, targets = batch["input_ids"][:, :-1], batch["labels"][:, 1:]
    own = gpt(inputs, targets)[1] * targets.numel()
    task = CausalLMTask(model_loss=True, ignore_index=EXAMPLE.IGNORE, eos_id=EOS)
    assert torch.equal(task.loss_sums(gpt, batch)[0], own)


class NoPositions(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(16, 16)

    def forward(self, input_ids: Tensor) -> Tensor:
        out: Tensor = self.embedding(input_ids)
        return out


def test_a_model_without_position_ids_is_refused_before_the_first_step() -> None:
    task = CausalLMTask(document_masking=True, eos_id=EOS)
    problem = probe_problem(task, NoPositions(), batch_of(WINDOW), torch.device("cpu"))
    assert problem is not None
    assert "TASK.DOCUMENT_MASKING" in problem
    assert "NoPositions.forward takes no position_ids" in problem
    assert "turn TASK.DOCUMENT_MASKING off" in problem
    # Without masking the same model trains.
    assert probe_problem(CausalLMTask(), NoPositions(), batch_of(WINDOW), torch.device("cpu")) is None


def test_padded_batches_are_refused() -> None:
    batch: dict[str, Any] = {**batch_of(WINDOW), "attention_mask": torch.ones(1, len(WINDOW))}
    problem = CausalLMTask(document_masking=True, eos_id=EOS).batch_problem(batch)
    assert problem is not None
    assert "TASK.DOCUMENT_MASKING is for packed windows" in problem


def test_config_refuses_it_where_it_would_do_nothing() -> None:
    with pytest.raises(ConfigError, match=r"TASK\.DOCUMENT_MASKING .* TASK\.NAME is classification"):
        load_config({"TASK": {"NAME": "classification", "DOCUMENT_MASKING": True}})
    # With the chunked loss it is allowed: the chunked loss's call of the model gets the positions.
    load_config({"TASK": {"NAME": "causal_lm", "DOCUMENT_MASKING": True, "LOSS_CHUNK_TOKENS": 64}})


def token_file(path: Path, sidecar: bool) -> str:
    """Byte-level documents (ids < 256) each ended by the end-of-document id 256."""
    documents = [[(7 * d + k) % 256 for k in range(5 + 3 * (d % 7))] for d in range(120)]
    tokens = [t for document in documents for t in (*document, 256)]
    write_tokens(path, tokens)
    if sidecar:
        write_sidecar(path, "uint16", len(tokens), 256)
    return str(path)


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_data_without_an_end_of_document_id_is_refused(tmp_path: Path) -> None:
    options = {"paths": [token_file(tmp_path / "a.bin", sidecar=False)], "seq_len": 17, "dtype": "uint16"}
    more = ["TASK.DOCUMENT_MASKING", "true", "MODEL.OPTIONS.vocab_size", "257", *TINY_LM]
    code, _, stderr = run_cli("train", "--cfg", LM_CFG, *cli_opts(tmp_path / "out", options, *more))
    assert code == 2, stderr
    assert "TASK.DOCUMENT_MASKING: needs the end-of-document id" in stderr
    assert "linnaeus-accel tokenize" in stderr
    assert "Traceback" not in stderr


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_a_short_run_with_masking_says_so_and_learns(tmp_path: Path) -> None:
    options = {"paths": [token_file(tmp_path / "a.bin", sidecar=True)], "seq_len": 17}
    more = [
        *("TASK.DOCUMENT_MASKING", "true", "TRAIN.TARGET_TOKENS", "null", "TRAIN.STEPS", "30"),
        *("DATA.BATCH_SIZE", "8", "SCHEDULE.METRICS.STEP_INTERVAL", "1"),
        *("EXPERIMENT.NAME", "masked", "ENV.PROGRESS_BAR", "false", *TINY_LM),
    ]
    code, stdout, stderr = run_cli("train", "--cfg", LM_CFG, *cli_opts(tmp_path / "out", options, *more))
    assert code == 0, stderr[-3000:]
    assert "Document masking: on" in stdout + stderr
    code, planned, stderr = run_cli("plan", "--cfg", LM_CFG, *cli_opts(tmp_path / "plan", options, *more))
    assert code == 0, stderr
    assert "Document masking: on: attention within each document" in planned
    lines = (tmp_path / "out" / "masked" / "metrics.jsonl").read_text().splitlines()
    losses = [r["train/loss"] for r in map(json.loads, lines) if "train/loss" in r]
    assert len(losses) == 30
    assert losses[-1] < losses[0] - 0.3  # it learns (from ln 257)


@pytest.mark.slow
def test_both_on_killed_then_resumed_ends_byte_identical(tmp_path: Path) -> None:
    """Document masking with the chunked loss (the pretraining recipe's pair) on a tiny Llama over
    token files: killed with SIGKILL between checkpoints, then rerun by the same command: the same
    weights and metrics, to the byte, as the run never killed."""
    options = {"paths": [token_file(tmp_path / "a.bin", sidecar=True)], "seq_len": 17}
    opts = [
        *("DATA.DATASET.NAME", "token_files", "DATA.DATASET.OPTIONS", json.dumps(options)),
        *("TASK.DOCUMENT_MASKING", "true", "TASK.LOSS_CHUNK_TOKENS", "24"),  # 8 x 16 targets: 6 chunks
        *("TRAIN.TARGET_TOKENS", "null", "TRAIN.STEPS", "12", "DATA.BATCH_SIZE", "8"),
        *("SCHEDULE.CHECKPOINT.INTERVAL_EPOCHS", "null", "SCHEDULE.CHECKPOINT.INTERVAL_STEPS", "4"),
        *("SCHEDULE.CHECKPOINT.MID_EPOCH", "true", "SCHEDULE.CHECKPOINT.KEEP_LAST_N", "2"),
        *("SCHEDULE.METRICS.STEP_INTERVAL", "1"),
        *("ENV.PROGRESS_BAR", "false", *TINY_LM),
    ]
    (tmp_path / "ref").mkdir()
    (tmp_path / "killed").mkdir()
    # Trained here (a process of its own would spend seconds importing torch): the killed run is one.
    reference = run_here(TrainRun(tmp_path / "ref", opts, cfg=LM_CFG)).check_ok()
    run = TrainRun(tmp_path / "killed", opts, cfg=LM_CFG)
    run.run(kill_at="optimizer_step:10").check_killed()
    # Step 8's checkpoint commits in the background while steps 9 and 10 train: on a loaded machine
    # the kill can come first, and the newest committed checkpoint is then step 4's.
    newest = int(committed(run.dir)[-1].removeprefix("step_"))
    assert newest in (4, 8), committed(run.dir)
    resumed = run.run()
    assert_resumed_from(resumed.output, newest)
    assert_same_run(resumed, reference)
