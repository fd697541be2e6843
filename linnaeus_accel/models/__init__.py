"""Models: a registry by name and the built-in ``digits_mlp``."""

from .registry import build_model, register_model

__all__ = ["build_model", "register_model"]
