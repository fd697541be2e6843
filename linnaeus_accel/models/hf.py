"""``hf_causal_lm``: a randomly initialised causal language model built from a transformers config.

``MODEL.OPTIONS`` are the config's fields (``hidden_size``, ``num_hidden_layers``, ...) plus
``model_type`` (default ``llama``); ``vocab_size`` defaults to the dataset's. The model is built with
``AutoModelForCausalLM.from_config``: never ``from_pretrained``, so nothing is downloaded. It is the
transformers model itself: ``model(input_ids, attention_mask=...)`` returns an output whose
``logits`` are ``[B, L, vocab_size]``.

transformers is imported only when this model is built, so ``plan`` stays fast without it.
"""

from __future__ import annotations

import inspect
import re
from typing import Any

from torch import nn

from ..config import Config, ConfigError
from .registry import register_model

OPTIONS_KEY = "MODEL.OPTIONS"
DEFAULT_MODEL_TYPE = "llama"


def _reason(exc: BaseException) -> str:
    """transformers' message on one line, cut short (some list every known class)."""
    text = " ".join(str(exc).split())
    return text if len(text) <= 300 else text[:297] + "..."


def _known_fields(config_class: Any, base_class: Any) -> set[str] | None:
    """The options a config class reads (None: cannot tell). transformers keeps unknown keyword
    arguments as plain attributes without a word, so a misspelt option would silently leave the
    default in place."""
    try:
        defaults = config_class().to_dict()
    except Exception:  # a composite config with required parts: let transformers judge the options
        return None
    fields = set(defaults) | set(getattr(config_class, "attribute_map", {}))
    for cls in (config_class, base_class):
        fields |= {
            name
            for name, p in inspect.signature(cls.__init__).parameters.items()
            if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
        }
    fields |= {"attn_implementation", "torch_dtype", "dtype"}  # read from **kwargs by the base class
    return fields - {"self", "model_type"}


# Sizes (hidden_size, n_embd, num_attention_heads, ...) must be >= 1; other counts (layers,
# experts, ...) may be 0.
_SIZE_NAME = re.compile(r"(_size$|_heads?$|^n_embd$|^n_head$|^n_inner$)")
_COUNT_NAME = re.compile(r"(^num_|^n_|_layers?$|_embeddings$|_positions$)")


def _bad_counts(options: dict[str, Any]) -> list[tuple[str, str]]:
    """Sizes and counts given as integers below their minimum: transformers takes them without a
    word and torch then fails deep inside the model's construction with a traceback."""
    problems = []
    for name, value in options.items():
        if not isinstance(value, int) or isinstance(value, bool):
            continue  # other types are for transformers to judge
        low = 1 if _SIZE_NAME.search(str(name)) else 0 if _COUNT_NAME.search(str(name)) else None
        if low is not None and value < low:
            what = "a size" if low else "a count"
            problems.append((f"{OPTIONS_KEY}.{name}", f"is {what}, so it must be >= {low} (got {value})"))
    return problems


@register_model("hf_causal_lm")
def build_hf_causal_lm(config: Config, dataset: Any) -> nn.Module:
    try:
        import transformers
    except ImportError:
        raise ConfigError(
            [("MODEL.TYPE", "hf_causal_lm needs transformers: pip install 'linnaeus-accel[lm]'")]
        ) from None

    options = dict(config.MODEL.OPTIONS)
    model_type = options.pop("model_type", DEFAULT_MODEL_TYPE)
    if model_type not in transformers.CONFIG_MAPPING:
        raise ConfigError(
            [(OPTIONS_KEY, f"model_type {model_type!r} is not a transformers model type (e.g. llama, gpt2)")]
        )
    config_class = transformers.CONFIG_MAPPING[model_type]
    known = _known_fields(config_class, transformers.PretrainedConfig)
    unknown = sorted(set(options) - known) if known is not None else []
    if unknown:
        raise ConfigError(
            [(OPTIONS_KEY, f"{config_class.__name__} ({model_type}) has no field {', '.join(unknown)}")]
        )
    bad = _bad_counts(options)
    if bad:
        raise ConfigError(bad)
    if "vocab_size" not in options:
        vocab_size = getattr(dataset, "vocab_size", None)
        if not isinstance(vocab_size, int):
            raise ConfigError(
                [(OPTIONS_KEY, "set vocab_size: the dataset does not declare an integer vocab_size")]
            )
        options["vocab_size"] = vocab_size

    try:
        # Any exception here is transformers rejecting a value the user wrote (its validators
        # raise ValueError, TypeError or huggingface_hub's StrictDataclassError).
        hf_config = transformers.AutoConfig.for_model(model_type, **options)
    except Exception as exc:
        raise ConfigError([(OPTIONS_KEY, f"transformers rejects the options: {_reason(exc)}")]) from None
    try:
        # from_config is unannotated in transformers; it returns a PreTrainedModel (an nn.Module).
        model: nn.Module = transformers.AutoModelForCausalLM.from_config(hf_config)  # type: ignore[no-untyped-call]
    # ValueError, TypeError: no causal-LM head for this type, or inconsistent sizes; the others:
    # torch failing on sizes transformers let through (a zero dimension, more memory than there is).
    except (ValueError, TypeError, RuntimeError, ArithmeticError, MemoryError) as exc:
        raise ConfigError(
            [(OPTIONS_KEY, f"transformers cannot build a causal LM from them: {_reason(exc)}")]
        ) from None
    return model
