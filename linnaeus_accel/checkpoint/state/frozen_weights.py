"""Checkpoints of a model whose base is frozen (a LoRA adapter of ``MODEL.OPTIONS.lora``, or any peft
model given to the Trainer): only what trains.

A LoRA run's base weights never change, and a resume rebuilds them exactly (from
``MODEL.OPTIONS.pretrained``, or from the seed), so a checkpoint need not store or hash them: on a
7B model that is the difference between gigabytes and megabytes per checkpoint. Accelerate's save
hook drops the frozen parameters from the weights it writes (``save_state`` and the ASYNC host
snapshot alike) and the optimizer holds no state for them. What the checkpoint records instead is
the digest of the frozen weights the run was built with; before anything is loaded at resume,
Accelerate's load hook compares it with the rebuilt model's, and a different base (the pretrained
directory changed, another seed) is refused naming ``MODEL.OPTIONS.pretrained``, since training an
adapter on another base would silently be another run. The trainable weights are then loaded with
``strict=False`` (the frozen ones are not in the file), after checking that every one of them is.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from accelerate import Accelerator
from accelerate.utils import DistributedType
from safetensors import safe_open

from ...config import ConfigError
from ...config.sections import ModelConfig
from ...models.lora import LoraRun, frozen_digest, is_peft_model
from .files import STATE_FILE, read_json

WRAPPER_PREFIXES = ("module.", "_orig_mod.")
STATE_KEY = "frozen_weights"
WEIGHTS = "model.safetensors"


def own_name(key: str) -> str:
    """A state-dict key without what DDP and torch.compile put in front of it."""
    while key.startswith(WRAPPER_PREFIXES):
        key = key.split(".", 1)[1]
    return key


class FrozenWeights:
    """See the module docstring. ``digest``: of the frozen weights the model was built with."""

    def __init__(
        self, accelerator: Accelerator, model: Any, digest: str, source: str, load_options: dict[str, Any]
    ) -> None:
        """``load_options``: the keyword arguments the run's checkpoints are loaded with."""
        self.digest, self.source = digest, source
        named = list(model.named_parameters(remove_duplicate=False))  # tied names too
        self.frozen = {name for name, p in named if not p.requires_grad}
        self.trainable = {name for name, p in named if p.requires_grad}
        accelerator.register_save_state_pre_hook(self._drop_frozen)
        accelerator.register_load_state_pre_hook(self._check_before_load)
        load_options["strict"] = False  # the frozen weights are not in the file

    def _drop_frozen(self, models: list[Any], weights: list[dict[str, Any]], output_dir: str) -> None:
        for state in weights[:1]:  # the run's model is Accelerate's first
            for key in [k for k in state if own_name(k) in self.frozen]:
                del state[key]

    def _check_before_load(self, models: list[Any], input_dir: str) -> None:
        directory = Path(input_dir)
        state, _ = read_json(directory / STATE_FILE)
        saved = state.get(STATE_KEY) if isinstance(state, dict) else None
        if isinstance(saved, dict) and saved.get("digest") != self.digest:
            raise base_changed(
                f"checkpoint {directory.name}",
                saved.get("digest"),
                self.digest,
                self.source,
                "Restore it, or start a new run (another EXPERIMENT.NAME)",
            )
        if (directory / WEIGHTS).is_file():
            with safe_open(str(directory / WEIGHTS), framework="pt") as weights:
                present = {own_name(key) for key in weights.keys()}  # noqa: SIM118  (not a dict)
            missing = sorted(self.trainable - present)
            if missing:
                raise ConfigError(
                    [
                        (
                            "MODEL.OPTIONS.lora",
                            f"checkpoint {directory.name} lacks trained weights {', '.join(missing[:3])}: it is not of this model",
                        )
                    ]
                )

    def state_dict(self) -> dict[str, Any]:
        return {"version": 1, "digest": self.digest, "frozen_parameters": len(self.frozen)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Checked before the weights were loaded (``_check_before_load``)."""


def base_changed(what: str, recorded: Any, found: str, source: str, fix: str) -> ConfigError:
    """The error for weights trained on a base other than the one this config builds."""
    return ConfigError(
        [
            (
                "MODEL.OPTIONS.pretrained",
                f"the frozen base weights are not those {what} was trained on (found digest "
                f"{found[:12]}, recorded {str(recorded)[:12]}): {source} does not hold that base (it "
                f"changed, or is another one). {fix}",
            )
        ]
    )


def base_source(model_config: ModelConfig, seed: int) -> str:
    """Where the LoRA base of the MODEL section ``model_config`` comes from, for messages (``seed``:
    EXPERIMENT.SEED, which builds a base that is not pretrained)."""
    pretrained = model_config.OPTIONS.get("pretrained")
    if pretrained:
        return f"the pretrained directory {pretrained}"
    return f"the base model built from the config and seed {seed}"


def frozen_weights_for(
    accelerator: Accelerator, model_config: ModelConfig, seed: int, load_options: dict[str, Any]
) -> FrozenWeights | None:
    """The run's ``FrozenWeights`` when its model is a LoRA model (``models.lora``), else None
    (``model_config``, ``seed``: the MODEL section and EXPERIMENT.SEED, see ``base_source``)."""
    model = accelerator.unwrap_model(accelerator._models[0]) if accelerator._models else None
    lora = getattr(model, "linnaeus_lora", None)
    if lora is None and model is not None and is_peft_model(model):  # a PeftModel given in Python
        lora = LoraRun(frozen_digest(model), merge=False)
        model.linnaeus_lora = lora  # its final/ then records the base too
    if lora is None:
        return None
    if accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED):
        raise ConfigError(
            [
                (
                    "MODEL.OPTIONS.lora",
                    f"LoRA is not supported under {accelerator.distributed_type.value} yet: train the adapter with DDP (one process per GPU; the frozen base is not sharded)",
                )
            ]
        )
    return FrozenWeights(accelerator, model, lora.digest, base_source(model_config, seed), load_options)
