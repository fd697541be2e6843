"""Models: a registry by name and the built-in ``digits_mlp``, ``digits_convnet``, ``hf_causal_lm`` and
``hf_sequence_classification`` (from a config or a pretrained directory, optionally with LoRA)."""

from .registry import build_model, register_model

__all__ = ["build_model", "register_model"]
