"""``lm_samples``: what a causal LM writes, at its interval (default every tenth of the run).

From each of ``prompts`` it generates ``max_new_tokens`` tokens, greedily (``temperature: 0``) or by
sampling with a generator seeded by ``(seed, step, prompt)``, so a resumed run writes the same text
at the same steps. Prompts are encoded as the training data is: UTF-8 bytes by default, or the
``tokenizer.json`` given. The text goes to ``metrics.jsonl`` (``<name>/<i>``: the prompt and its
continuation; ``name`` defaults to ``samples``), the console, TensorBoard (text) and W&B (a table
``<name>/table`` of step, prompt and continuation). Two ``lm_samples`` callbacks need two names: at
a step they share, one's text would replace the other's in TensorBoard and W&B.

Generation re-runs the model over the whole context for each new token (no KV cache: any model that
maps ``input_ids`` to logits works), in eval mode and without gradients, keeping the last
``context`` tokens (default: the training windows' length when the data declares one). Every
process generates (a sharded model's forward is collective); the main process logs.
"""

from __future__ import annotations

from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch

from ..config import ConfigError
from ..config.callbacks import LmSamplesOptions
from ..data.tokens.packing import BYTE_EOS, decode_bytes, encode_bytes
from ..tasks.base import logits_of
from . import Callback, RunContext, register_callback


@register_callback("lm_samples")
class LmSamples(Callback):
    Options = LmSamplesOptions
    interval = MappingProxyType({"INTERVAL_FRACTION": 0.1})  # a config's INTERVAL_* replaces it

    def __init__(
        self,
        prompts: list[str],
        max_new_tokens: int = 32,
        temperature: float = 0.0,
        seed: int = 0,
        tokenizer: str | None = None,
        context: int | None = None,
        name: str = "samples",
    ) -> None:
        o = LmSamplesOptions.model_validate(
            {
                "prompts": prompts,
                "max_new_tokens": max_new_tokens,
                "temperature": temperature,
                "seed": seed,
                "tokenizer": tokenizer,
                "context": context,
                "name": name,
            }
        )
        self.options = o
        self._tokenizer: Any = None
        if o.tokenizer is not None:
            from ..data.tokenize.command import load_tokenizer

            self._tokenizer = load_tokenizer(Path(o.tokenizer))

    def encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text).ids) if self._tokenizer is not None else encode_bytes(text)

    def decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids) if self._tokenizer is not None else decode_bytes(ids)

    def on_setup(self, run: RunContext) -> None:
        others = [c for c in run.callbacks if isinstance(c, LmSamples) and c is not self]
        if any(c.options.name == self.options.name for c in others):
            raise ConfigError(
                [
                    (
                        "CALLBACKS",
                        f"two lm_samples callbacks log under the same name {self.options.name!r}: "
                        "give each its own OPTIONS.name",
                    )
                ]
            )
        window = getattr(run.train_dataset, "tokens_per_sample", None)
        self.context = self.options.context or (window + 1 if isinstance(window, int) else None)

    @torch.no_grad()
    def generate(self, model: torch.nn.Module, prompt: list[int], step: int, index: int) -> list[int]:
        o, device = self.options, next(model.parameters()).device
        ids = torch.tensor([prompt or [BYTE_EOS]], device=device)
        generator = torch.Generator(device=device).manual_seed(hash((o.seed, step, index)) & (2**63 - 1))
        out: list[int] = []
        for _ in range(o.max_new_tokens):
            window = ids if self.context is None else ids[:, -self.context :]
            logits = logits_of(model(window))[0, -1].float()
            if o.temperature == 0:
                token = int(logits.argmax())
            else:
                probs = torch.softmax(logits / o.temperature, dim=-1)
                token = int(torch.multinomial(probs, 1, generator=generator))
            out.append(token)
            ids = torch.cat([ids, torch.tensor([[token]], device=device)], dim=1)
        return out

    def on_step_end(self, run: RunContext, step: int) -> None:
        model = run.model
        was_training = model.training
        model.eval()
        try:
            rows = []
            for i, text in enumerate(self.options.prompts):
                continuation = self.decode(self.generate(model, self.encode(text), step, i))
                rows.append((text, continuation))
        finally:
            model.train(was_training)
        run.log(
            {
                f"{self.options.name}/{i}": prompt + continuation
                for i, (prompt, continuation) in enumerate(rows)
            },
            step,
        )
        for prompt, continuation in rows:
            run.say(f"step {step} sample: {prompt!r} -> {continuation!r}")
        if run.is_main_process:
            wandb = next((t for t in run.accelerator.trackers if t.name == "wandb"), None)
            if wandb is not None:
                wandb.log_table(
                    f"{self.options.name}/table",
                    columns=["step", "prompt", "continuation"],
                    data=[[step, p, c] for p, c in rows],
                    step=step,
                )
