"""configs/gpt2_124m.yaml, the GPT-2 small pretraining recipe: planned at full size (0.5M tokens a
step, both document masking and the chunked loss on), trained at tiny size on token files, and
document masking exact for GPT-2 (a window's loss is the sum over its documents run alone)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.configs import REPO
from helpers.in_process import run_cli
from helpers.runs import read_metrics
from helpers.tokens import write_sidecar, write_tokens

from linnaeus_accel.tasks.causal_lm import CausalLMTask

RECIPE = str(REPO / "configs" / "gpt2_124m.yaml")
EOS = 256
TINY = [
    *("DATA.BATCH_SIZE", "4", "DATA.NUM_WORKERS", "0", "DATA.DATASET.OPTIONS.seq_len", "33"),
    *("MODEL.OPTIONS.vocab_size", "320", "MODEL.OPTIONS.n_positions", "33", "MODEL.OPTIONS.n_embd", "32"),
    *("MODEL.OPTIONS.n_layer", "2", "MODEL.OPTIONS.n_head", "2", "TASK.LOSS_CHUNK_TOKENS", "48"),
    *("TRAIN.ACCUMULATION_STEPS", "2", "TRAIN.TARGET_TOKENS", "null", "TRAIN.STEPS", "6"),
    *("LR_SCHEDULER.WARMUP_STEPS", "2", "OPTIMIZER.IMPLEMENTATION", "auto"),  # fused: CUDA only
    *("SCHEDULE.VALIDATION.INTERVAL_STEPS", "3", "SCHEDULE.CHECKPOINT.INTERVAL_STEPS", "3"),
    *("SCHEDULE.METRICS.STEP_INTERVAL", "1", "ENV.PROGRESS_BAR", "false"),
]


def corpus(path: Path, documents: int) -> str:
    """Byte-level documents, each ended by the end-of-document id 256, with their sidecar; every
    other one longer than a window (whose positions then run to the window's end)."""
    docs = [[(7 * d + k) % 256 for k in range(5 + 3 * (d % 7) if d % 2 else 100)] for d in range(documents)]
    tokens = [t for doc in docs for t in (*doc, EOS)]
    write_tokens(path, tokens)
    write_sidecar(path, "uint16", len(tokens), EOS)
    return str(path)


def test_the_recipe_plans_half_a_million_tokens_a_step_with_masking_and_the_chunked_loss(
    tmp_path: Path,
) -> None:
    # Enough windows of 1,025 tokens for one step of 8 micro-batches of 64: documents of 50 tokens.
    tokens = np.arange(600_000, dtype=np.uint16) % 256
    tokens[49::50] = EOS
    data = str(write_tokens(tmp_path / "train.bin", tokens))
    write_sidecar(tmp_path / "train.bin", "uint16", len(tokens), EOS)
    opts = ["DATA.DATASET.OPTIONS.paths", f"[{data}]", "ENV.OUTPUT.BASE_DIR", str(tmp_path / "out")]
    code, out, err = run_cli("plan", "--cfg", RECIPE, "--opts", *opts)
    assert code == 0, err[-3000:]
    assert "524288 target tokens per step" in out.replace(",", ""), out
    assert "Document masking: on" in out
    assert "Chunked loss:    output projection and cross-entropy 8192 tokens at a time" in out
    assert "betas (0.9, 0.95)" in out
    assert "fused" in out


def test_the_recipe_trains_at_tiny_size(tmp_path: Path) -> None:
    data = corpus(tmp_path / "train.bin", 4000)
    out = tmp_path / "out"
    opts = ["DATA.DATASET.OPTIONS.paths", f"[{data}]", "ENV.OUTPUT.BASE_DIR", str(out), *TINY]
    code, _, err = run_cli("train", "--cfg", RECIPE, "--opts", *opts)
    assert code == 0, err[-3000:]
    losses = [r["train/loss"] for r in read_metrics(out / "gpt2_124m") if "train/loss" in r]
    assert len(losses) == 6
    assert (out / "gpt2_124m" / "final").is_dir()


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_gpt2_window_loss_is_the_sum_over_its_documents_alone(attention: str) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    # No dropout (the recipe's too): the window and its documents alone see the same network.
    config = GPT2Config(
        vocab_size=300,
        n_positions=32,
        n_embd=16,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    config._attn_implementation = attention
    model = GPT2LMHeadModel(config)
    window = [3, 4, 5, EOS, 6, 7, EOS, EOS, 1, 2, 8, 3, EOS, 4, 5]
    documents = [(0, 4), (4, 7), (7, 8), (8, 13), (13, 15)]

    def batch(ids: list[int]) -> dict[str, torch.Tensor]:
        tokens = torch.tensor([ids])
        return {"input_ids": tokens, "labels": tokens.clone()}

    masked = CausalLMTask(document_masking=True, eos_id=EOS).loss_sums(model, batch(window))
    plain = CausalLMTask()
    alone = sum(plain.loss_sums(model, batch(window[s : e + 1])) for s, e in documents)
    assert isinstance(alone, torch.Tensor)
    assert masked.item() == pytest.approx(alone.item(), abs=1e-5)
    assert abs(plain.loss_sums(model, batch(window)).item() - masked.item()) > 1e-3  # it can fail


def test_accelerates_float8_recipe_converts_no_layer_of_transformers_gpt2() -> None:
    """What `--mixed_precision fp8 --fp8_backend ao` would make of the recipe's model: Accelerate's
    torchao recipe converts each `nn.Linear` but the first and the last, and transformers' GPT-2
    projects with its own `Conv1D`, its one `nn.Linear` being the LM head. So Float8 changes nothing
    for this recipe (docs/guides/pretraining.md says so); a Llama's projections it does convert."""
    from accelerate.utils.ao import filter_linear_layers, find_first_last_linear_layers
    from transformers import AutoConfig, AutoModelForCausalLM

    def converted(model: torch.nn.Module) -> list[str]:
        """The layers ``convert_model_to_fp8_ao`` hands torchao, by its own filter."""
        kept = list(find_first_last_linear_layers(model))
        return [
            name
            for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear) and filter_linear_layers(module, name, kept)
        ]

    small = {"vocab_size": 320, "n_positions": 33, "n_embd": 32, "n_layer": 2, "n_head": 2}
    gpt2 = AutoModelForCausalLM.from_config(AutoConfig.for_model("gpt2", **small))
    assert [n for n, m in gpt2.named_modules() if isinstance(m, torch.nn.Linear)] == ["lm_head"]
    assert converted(gpt2) == []
    sizes = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2}
    llama = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", vocab_size=320, **sizes))
    # q, k, v, o, gate, up and down of each layer, the first of them (and the LM head) kept
    assert len(converted(llama)) == 2 * 7 - 1
