"""``TASK.LOSS_CHUNK_TOKENS``: causal_lm's output projection and cross-entropy a chunk of tokens at a time.

- The summed loss and every parameter's gradient equal the plain path's (1e-5) for a tiny
  transformers Llama (tied embedding), a GPT-2 (tied), and models of one's own (tied, and untied
  with a bias): chunks that divide the token count, that do not, and larger than it; targets
  ignored with -100; an attention mask given through. Validation sums agree too.
- Peak memory: one process computing the plain loss and its backward at vocabulary 50,000, 2 x 512
  tokens and hidden 64 grows its peak RSS by about 590 MB, one with chunks of 128 by about 225 MB
  (measured on 2 CPU cores; at 16 x 512 tokens and chunks of 1,024: 4,690 MB against 750 MB).
- Models it cannot run are refused by the check before the first step, in one sentence naming the
  key: no output projection, no way to get the hidden states, logits transformed after the head.
- The config refuses the key with TASK.MODEL_LOSS and outside causal_lm; ``plan`` and ``train``
  say it is on; a CLI run of configs/lm_tiny.yaml logs the plain run's losses.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.configs import LM_CFG, SMALL_LM
from helpers.in_process import run_cli
from helpers.runs import read_metrics
from torch import Tensor, nn

from linnaeus_accel.config import ConfigError, load_config
from linnaeus_accel.tasks.causal_lm import CausalLMTask
from linnaeus_accel.training.start.task_checks import probe_problem

VOCAB = 97
CHUNKS = (7, 16, 1000)  # 3 rows x 16 targets = 48 targets: does not divide, divides, larger


class Own(nn.Module):
    """A model of one's own following the protocol: get_output_embeddings() and return_hidden."""

    def __init__(self, tied: bool = True, bias: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 24)
        self.mix = nn.Linear(24, 24)
        self.head = nn.Linear(24, VOCAB, bias=bias)
        if tied:
            self.head.weight = self.embed.weight

    def get_output_embeddings(self) -> nn.Linear:
        return self.head

    def forward(
        self, input_ids: Tensor, attention_mask: Tensor | None = None, return_hidden: bool = False
    ) -> Tensor:
        hidden = torch.tanh(self.mix(self.embed(input_ids))).cumsum(1)  # each position sees the earlier ones
        return hidden if return_hidden else self.head(hidden)


def llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    options = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}
    return LlamaForCausalLM(
        LlamaConfig(vocab_size=VOCAB, num_key_value_heads=2, tie_word_embeddings=True, **options)
    )


def gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=32, bos_token_id=0, eos_token_id=0
    )
    return GPT2LMHeadModel(config)


def batch(mask: bool = False) -> dict[str, Tensor]:
    ids = torch.randint(0, VOCAB, (3, 17), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[0, 4:9] = -100  # a prompt
    labels[2, 12:] = -100  # right padding
    out = {"input_ids": ids, "labels": labels}
    if mask:
        out["attention_mask"] = (labels != -100).long().clamp_min(torch.arange(17) < 12)
    return out


def task(chunk: int) -> CausalLMTask:
    t = CausalLMTask()
    t.loss_chunk_tokens = chunk
    return t


def loss_and_grads(model: nn.Module, chunk: int, b: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
    model.zero_grad()
    loss = task(chunk).loss_sums(model, b)[0]
    loss.backward()  # type: ignore[no-untyped-call]
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def relative_error(got: Tensor, expected: Tensor) -> float:
    """The difference's norm over the expected tensor's: float32 summation order moves single
    entries near 0 by more than 1e-5 of themselves, never the whole."""
    return float((got - expected).norm() / expected.norm())


@pytest.mark.parametrize(
    "build",
    [llama, gpt2, Own, lambda: Own(tied=False, bias=True)],
    ids=["llama", "gpt2", "own", "own-untied"],
)
def test_loss_and_gradients_equal_the_plain_path(build: Any) -> None:
    torch.manual_seed(0)
    model = build().eval()  # no dropout: the two paths see the same network
    b = batch(mask=not isinstance(model, Own))
    plain, plain_grads = loss_and_grads(model, 0, b)
    head = model.get_output_embeddings()
    assert plain_grads, "the plain path gave gradients"
    assert head.weight.grad is not None
    for chunk in CHUNKS:
        loss, grads = loss_and_grads(model, chunk, b)
        torch.testing.assert_close(loss, plain, rtol=1e-5, atol=0)
        assert grads.keys() == plain_grads.keys()
        for name, grad in grads.items():
            assert relative_error(grad, plain_grads[name]) < 1e-5, (name, chunk)


def test_tied_weight_gets_the_projection_gradient_and_the_embedding_gradient() -> None:
    torch.manual_seed(0)
    model = Own(tied=True)
    assert model.head.weight is model.embed.weight
    _, tied = loss_and_grads(model, 7, batch())
    # The same weight untied: its two gradients add up to the tied one.
    untied = Own(tied=False)
    untied.load_state_dict({**model.state_dict(), "head.weight": model.embed.weight.detach().clone()})
    _, apart = loss_and_grads(untied, 7, batch())
    assert relative_error(tied["embed.weight"], apart["embed.weight"] + apart["head.weight"]) < 1e-5


def test_validation_sums_equal_the_plain_path() -> None:
    torch.manual_seed(0)
    model, b = llama().eval(), batch(mask=True)
    with torch.no_grad():
        plain = task(0).validation_step(model, b, None, _standard_pass())
        chunked = task(5).validation_step(model, b, None, _standard_pass())
    torch.testing.assert_close(chunked, plain, rtol=1e-5, atol=0)


def _standard_pass() -> Any:
    from linnaeus_accel.tasks.base import STANDARD_PASS

    return STANDARD_PASS


class NoHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Embedding(VOCAB, 8), nn.Linear(8, VOCAB))

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        return self.net(input_ids)  # type: ignore[no-any-return]


class NoHidden(NoHead):
    def get_output_embeddings(self) -> nn.Module:
        return self.net[1]


def softcapped() -> nn.Module:
    from transformers import Gemma2Config, Gemma2ForCausalLM

    options = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2}
    return Gemma2ForCausalLM(Gemma2Config(vocab_size=VOCAB, num_key_value_heads=1, head_dim=16, **options))


@pytest.mark.parametrize(
    ("build", "why"),
    [
        (NoHead, "an nn.Linear from get_output_embeddings(), and NoHead's is missing"),
        (NoHidden, "forward(input_ids, return_hidden=True), and NoHidden's forward takes no return_hidden"),
        (softcapped, "Gemma2ForCausalLM also transforms them (final_logit_softcapping)"),
    ],
)
def test_models_it_cannot_run_are_refused_before_the_first_step(build: Any, why: str) -> None:
    problem = probe_problem(task(8), build(), batch(), torch.device("cpu"))
    assert problem is not None
    assert "TASK.LOSS_CHUNK_TOKENS" in problem
    assert why in problem
    assert "set TASK.LOSS_CHUNK_TOKENS to 0" in problem
    assert probe_problem(task(0), build(), batch(), torch.device("cpu")) is None  # the plain path runs it


def test_config_refuses_it_where_the_task_does_not_compute_the_loss() -> None:
    assert (
        load_config({"TASK": {"NAME": "causal_lm", "LOSS_CHUNK_TOKENS": 4096}}).TASK.LOSS_CHUNK_TOKENS == 4096
    )
    with pytest.raises(
        ConfigError,
        match=r"TASK\.LOSS_CHUNK_TOKENS .*TASK\.MODEL_LOSS is on .*set TASK\.LOSS_CHUNK_TOKENS to 0",
    ):
        load_config({"TASK": {"NAME": "causal_lm", "MODEL_LOSS": True, "LOSS_CHUNK_TOKENS": 4096}})
    with pytest.raises(ConfigError, match=r"TASK\.LOSS_CHUNK_TOKENS .*TASK\.NAME is classification"):
        load_config({"TASK": {"NAME": "classification", "LOSS_CHUNK_TOKENS": 4096}})
    with pytest.raises(ConfigError, match=r"TASK\.LOSS_CHUNK_TOKENS"):
        load_config({"TASK": {"NAME": "causal_lm", "LOSS_CHUNK_TOKENS": -1}})


def test_plan_says_the_chunked_loss_is_on() -> None:
    rc, out, err = run_cli("plan", "--cfg", LM_CFG, "--opts", "TASK.LOSS_CHUNK_TOKENS", "2048")
    assert rc == 0, err
    assert "Chunked loss:    output projection and cross-entropy 2048 tokens at a time" in out
    rc, out, err = run_cli("plan", "--cfg", LM_CFG)
    assert rc == 0, err
    assert "Chunked loss" not in out


PEAK = """
import sys
import torch
from torch import nn
from linnaeus_accel.tasks.causal_lm import CausalLMTask

class Own(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50_000, 64)
        self.head = nn.Linear(64, 50_000, bias=False)
        self.head.weight = self.embed.weight
    def get_output_embeddings(self):
        return self.head
    def forward(self, input_ids, attention_mask=None, return_hidden=False):
        hidden = torch.tanh(self.embed(input_ids))
        return hidden if return_hidden else self.head(hidden)

model, task = Own(), CausalLMTask()
task.loss_chunk_tokens = int(sys.argv[1])
ids = torch.randint(0, 50_000, (2, 512), generator=torch.Generator().manual_seed(0))
def status(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))

# The peak from here on (writing 5 to clear_refs resets VmHWM to the current RSS): a peak reached
# while importing (which varies with what is cached) is not counted.
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
before = status("VmRSS")
task.loss_sums(model, {"input_ids": ids, "labels": ids}).sum().backward()
print((status("VmHWM") - before) / 1024)
"""


def peak_growth_mb(chunk: int) -> float:
    # glibc keeps freed large blocks in its heap once its mmap threshold has grown, so the peak RSS
    # would count every chunk's logits ever allocated; a fixed threshold maps and unmaps each, and
    # the peak is that of the tensors alive at once.
    # A clean environment: only what the measurement needs (the same in every pytest worker).
    keep = ("PATH", "HOME", "TMPDIR", "LANG")
    env = {k: v for k, v in os.environ.items() if k in keep}
    env.update(MALLOC_MMAP_THRESHOLD_="131072", OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, "-c", PEAK, str(chunk)], capture_output=True, text=True, check=True, env=env
    )
    return float(done.stdout.split()[-1])


def test_peak_memory_is_a_fraction_of_the_plain_path() -> None:
    plain, chunked = peak_growth_mb(0), peak_growth_mb(128)
    # The plain logits alone, float32: 1,022 x 50,000 x 4 bytes = 204 MB, and the backward holds
    # more such tensors; chunks of 128 tokens hold 26 MB each.
    assert plain > 400, plain
    assert chunked < plain / 2, (plain, chunked)


def lm_run(out: Path, chunk: int) -> list[float]:
    opts = [
        *SMALL_LM,
        "ENV.OUTPUT.BASE_DIR",
        str(out),
        "EXPERIMENT.NAME",
        f"chunk{chunk}",
        "TRAIN.STEPS",
        "3",
    ]
    opts += ["TRAIN.TARGET_TOKENS", "null", "SCHEDULE.METRICS.STEP_INTERVAL", "1"]
    rc, stdout, err = run_cli("train", "--cfg", LM_CFG, "--opts", *opts, "TASK.LOSS_CHUNK_TOKENS", str(chunk))
    assert rc == 0, err[-3000:]
    assert ("Chunked loss:" in stdout) == (chunk > 0)
    return [r["train/loss"] for r in read_metrics(out / f"chunk{chunk}") if "train/loss" in r]


def test_training_run_logs_the_plain_path_losses(tmp_path: Path) -> None:
    """configs/lm_tiny.yaml through the CLI: the Trainer's steps (the check before the first step,
    Accelerate's wrapping, the optimizer updating the tied embedding) give the same losses."""
    plain, chunked = lm_run(tmp_path, 0), lm_run(tmp_path, 100)  # 8 x 128 targets: 11 chunks, one partial
    assert len(plain) == 3
    assert chunked == pytest.approx(plain, rel=1e-5)
