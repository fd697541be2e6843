"""Models: a registry by name and the built-in ``digits_mlp``, ``digits_convnet`` and ``hf_causal_lm``."""

from .registry import build_model, register_model

__all__ = ["build_model", "register_model"]
