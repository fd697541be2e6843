"""``hf_causal_lm`` and ``hf_sequence_classification``: transformers models, built from a config or
loaded from a local ``save_pretrained`` directory. Nothing is ever downloaded.

``MODEL.OPTIONS``:

- without ``pretrained``: the config's fields (``hidden_size``, ``num_hidden_layers``, ...) plus
  ``model_type`` (default ``llama``), randomly initialised (``AutoModel*.from_config``).
  ``vocab_size`` defaults to the dataset's; a classifier's ``num_labels`` to the dataset's
  ``num_classes``.
- ``pretrained: DIR``: the directory's model, its other options overriding its config where the
  weights still fit (``pretrained.py``).
- ``gradient_checkpointing: true``: the model's own activation checkpointing (less memory, about
  a third more compute per step).
- ``lora: {...}``: only a LoRA adapter trains (``lora.py``, through peft).

A causal LM's special token ids are the data's (``special_ids``): ``eos_token_id`` its
end-of-document id (256 for bytes), ``bos_token_id`` its tokenizer's (none for bytes), and
``pad_token_id`` its tokenizer's where it has one; in ``config.json`` and ``generation_config.json``
alike, so ``generate()`` stops where a document ends. An option that contradicts them is an error.

Any other key is a config field; a private one (``_name_or_path``) or an argument of
``from_pretrained`` (``cache_dir``, ``revision``...) is an error naming the key to use, since
transformers would keep it silently and train random weights.

The model is the transformers model itself: ``model(input_ids, attention_mask=...)`` returns an
output with ``logits`` (``[B, L, vocab_size]``; ``[B, num_labels]`` for a classifier, which reads
the last token that is not ``pad_token_id``, default the config's ``eos_token_id``, else 0).
transformers is imported only when such a model is built, so ``plan`` stays fast without it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from torch import nn

from ..config import Config, ConfigError
from ..data.tokens.packing import BYTE_EOS, BYTE_VOCAB_SIZE
from .pretrained import config_fields, load_pretrained, model_directory
from .registry import register_model

OPTIONS_KEY = "MODEL.OPTIONS"
DEFAULT_MODEL_TYPE = "llama"
BUILD_OPTIONS = ("pretrained", "gradient_checkpointing", "lora")
# Keys that mean "load these weights" elsewhere; here they would be kept silently as config fields.
MISPLACED = {
    "_name_or_path": "pretrained",
    "name_or_path": "pretrained",
    "pretrained_model_name_or_path": "pretrained",
    "model_name_or_path": "pretrained",
    "from_pretrained": "pretrained",
    "torch_dtype": "dtype",
}
# A tokenizer's beginning-of-text and padding tokens, by the names tokenizers give them (its
# end-of-document token is the data's: tokenize's --eos-token or EOS_CANDIDATES).
BOS_CANDIDATES = ("<s>", "<|begin_of_text|>", "<bos>", "<|startoftext|>")
PAD_CANDIDATES = ("<pad>", "<|pad|>", "[PAD]", "<|padding|>")
# from_pretrained's own arguments: linnaeus-accel reads local directories only.
LOADING_ONLY = {
    "cache_dir", "force_download", "local_files_only", "token", "revision", "use_safetensors",
    "weights_only", "ignore_mismatched_sizes", "device_map", "max_memory", "trust_remote_code",
    "low_cpu_mem_usage", "quantization_config", "subfolder", "variant", "offload_folder",
}  # fmt: skip


def _reason(exc: BaseException) -> str:
    """transformers' message on one line, cut short (some list every known class)."""
    text = " ".join(str(exc).split())
    return text if len(text) <= 300 else text[:297] + "..."


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


def _import_transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise ConfigError(
            [("MODEL.TYPE", "hf_causal_lm needs transformers: pip install 'linnaeus-accel[lm]'")]
        ) from None
    return transformers


def misplaced_options(options: dict[str, Any]) -> list[tuple[str, str]]:
    """Keys transformers would take without a word and that would not do what they say."""
    problems = []
    for name in options:
        key = f"{OPTIONS_KEY}.{name}"
        if name in MISPLACED:
            problems.append((key, f"is not read here: use {OPTIONS_KEY}.{MISPLACED[name]}"))
        elif name in LOADING_ONLY:
            problems.append(
                (
                    key,
                    f"is an argument of from_pretrained, not a model option: models are built offline, or loaded from a local directory with {OPTIONS_KEY}.pretrained",
                )
            )
        elif str(name).startswith("_"):
            problems.append((key, "is a private field of transformers' config, not an option: leave it out"))
    return problems


def build_transformers_model(
    model_options: dict[str, Any],
    auto_name: str,
    defaults: dict[str, Any],
    pretrained_defaults: dict[str, Any] | None = None,
) -> nn.Module:
    """The model ``auto_name`` (an ``AutoModelFor*`` class) that ``model_options`` (``MODEL.OPTIONS``)
    describe (see the module docstring). ``defaults``: config fields taken from the data unless given;
    ``pretrained_defaults``: those that override a pretrained directory's config unless given."""
    transformers = _import_transformers()
    options = dict(model_options)
    built = {name: options.pop(name) for name in BUILD_OPTIONS if name in options}
    problems = misplaced_options(options)
    if problems:
        raise ConfigError(problems)
    auto_class = getattr(transformers, auto_name)
    if built.get("pretrained") is not None:
        directory = model_directory(built["pretrained"], f"{OPTIONS_KEY}.pretrained")
        overrides = {**(pretrained_defaults or {}), **options}
        model: nn.Module = load_pretrained(auto_class, directory, overrides, OPTIONS_KEY)
    else:
        model = _from_config(transformers, auto_class, options, defaults)
    if built.get("gradient_checkpointing", False) is True:
        _enable_activation_checkpointing(model)
        model.config.use_cache = False  # type: ignore[union-attr]  # a cache is of no use in training
    elif built.get("gradient_checkpointing", False) is not False:
        raise ConfigError([(f"{OPTIONS_KEY}.gradient_checkpointing", "must be true or false")])
    if built.get("lora") is not None:
        from .lora import with_lora

        model = with_lora(model, built["lora"], f"{OPTIONS_KEY}.lora")
    return model


def _enable_activation_checkpointing(model: Any) -> None:
    """The model's own activation checkpointing (named gradient checkpointing before transformers 5)."""
    kwargs = {"use_reentrant": False}  # the variant torch recommends; works with frozen inputs (LoRA)
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def _from_config(
    transformers: Any, auto_class: Any, options: dict[str, Any], defaults: dict[str, Any]
) -> nn.Module:
    model_type = options.pop("model_type", DEFAULT_MODEL_TYPE)
    if model_type not in transformers.CONFIG_MAPPING:
        raise ConfigError(
            [(OPTIONS_KEY, f"model_type {model_type!r} is not a transformers model type (e.g. llama, gpt2)")]
        )
    config_class = transformers.CONFIG_MAPPING[model_type]
    known = config_fields(config_class)
    unknown = sorted(set(options) - known) if known is not None else []
    if unknown:
        raise ConfigError(
            [(OPTIONS_KEY, f"{config_class.__name__} ({model_type}) has no field {', '.join(unknown)}")]
        )
    bad = _bad_counts(options)
    if bad:
        raise ConfigError(bad)
    options = {**defaults, **options}  # from the data: not the user's to misspell
    try:
        # Any exception here is transformers rejecting a value the user wrote (its validators
        # raise ValueError, TypeError or huggingface_hub's StrictDataclassError).
        hf_config = transformers.AutoConfig.for_model(model_type, **options)
    except Exception as exc:
        raise ConfigError([(OPTIONS_KEY, f"transformers rejects the options: {_reason(exc)}")]) from None
    try:
        # from_config is unannotated in transformers; it returns a PreTrainedModel (an nn.Module).
        model: nn.Module = auto_class.from_config(hf_config)
    # ValueError, TypeError: no such head for this type, or inconsistent sizes; the others:
    # torch failing on sizes transformers let through (a zero dimension, more memory than there is).
    except (ValueError, TypeError, RuntimeError, ArithmeticError, MemoryError) as exc:
        what = "a causal LM" if "CausalLM" in auto_class.__name__ else "a sequence classifier"
        raise ConfigError(
            [(OPTIONS_KEY, f"transformers cannot build {what} from them: {_reason(exc)}")]
        ) from None
    return model


def _data_field(dataset: Any, attribute: str, option: str) -> dict[str, Any]:
    value = getattr(dataset, attribute, None)
    if not isinstance(value, int):
        raise ConfigError(
            [(OPTIONS_KEY, f"set {option}: the dataset does not declare an integer {attribute}")]
        )
    return {option: value}


@dataclass(frozen=True)
class SpecialIds:
    """A causal LM's special token ids as the run's data has them."""

    eos: int  # the data's end-of-document id
    bos: int | None  # its tokenizer's beginning-of-text id; None: it has none (bytes have none)
    pad: int | None  # its tokenizer's padding id; None: it has none (the model's own stays)
    known: bool = True  # False: a tokenizer not at hand (moved, or a mixture's): the model's bos stays

    def config_fields(self) -> dict[str, int | None]:
        """The config fields the data decides."""
        fields: dict[str, int | None] = {"eos_token_id": self.eos}
        if self.known:
            fields["bos_token_id"] = self.bos
        return fields | ({"pad_token_id": self.pad} if self.pad is not None else {})


def special_ids(dataset: Any) -> SpecialIds | None:
    """The special ids of ``dataset``'s tokens: its ``eos_id`` and the ``tokenizer_file``'s
    special tokens (``BOS_CANDIDATES``, ``PAD_CANDIDATES``); None for data that declares no
    end-of-document id. The one place a run's special ids come from (the model built for the data,
    and ``final/``)."""
    eos = getattr(dataset, "eos_id", None)
    if not isinstance(eos, int) or isinstance(eos, bool):
        return None
    path = getattr(dataset, "tokenizer_file", None)
    if not isinstance(path, str):  # bytes (documents separated by EOS alone), or no tokenizer at hand
        is_bytes = eos == BYTE_EOS and getattr(dataset, "vocab_size", None) == BYTE_VOCAB_SIZE
        return SpecialIds(eos, None, None, known=is_bytes)
    try:
        from tokenizers import Tokenizer

        special = {
            t.content: i for i, t in Tokenizer.from_file(path).get_added_tokens_decoder().items() if t.special
        }
    except Exception:  # no tokenizers, or a file gone or unreadable (a bare Exception): eos alone
        return SpecialIds(eos, None, None, known=False)

    def first(names: tuple[str, ...]) -> int | None:
        return next((special[n] for n in names if n in special), None)

    return SpecialIds(eos, first(BOS_CANDIDATES), first(PAD_CANDIDATES))


def set_special_ids(model: Any, ids: SpecialIds) -> None:
    """``ids`` in ``model``'s config and generation config (a peft model's: its base model's)."""
    base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    generation = getattr(base, "generation_config", None)
    for target in (getattr(base, "config", None), generation):
        if target is not None:
            for name, value in ids.config_fields().items():
                setattr(target, name, value)
    if generation is not None and generation.pad_token_id is None:
        # generate() pads the rows of a batch that have ended with pad_token_id, taking eos (with a
        # warning) when there is none; said here, it is what generate does, without the warning.
        # Not in config.json: there transformers makes pad_token_id the embedding's padding_idx,
        # whose row never learns, and the end-of-document token must.
        generation.pad_token_id = ids.eos


def _special_id_conflicts(options: dict[str, Any], ids: SpecialIds) -> list[tuple[str, str]]:
    said = {
        "eos_token_id": f"the data ends its documents with {ids.eos}",
        "bos_token_id": f"the data's tokenizer begins text with {ids.bos}"
        if ids.bos is not None
        else "the data's tokens have no beginning-of-text token",
        "pad_token_id": f"the data's tokenizer pads with {ids.pad}",
    }
    return [
        (f"{OPTIONS_KEY}.{name}", f"is {options[name]!r} but {said[name]}: leave it out")
        for name, value in ids.config_fields().items()
        if name in options and options[name] != value
    ]


@register_model("hf_causal_lm")
def build_hf_causal_lm(config: Config, dataset: Any) -> nn.Module:
    options = config.MODEL.OPTIONS
    needs_vocab = "vocab_size" not in options and options.get("pretrained") is None
    defaults = _data_field(dataset, "vocab_size", "vocab_size") if needs_vocab else {}
    ids = special_ids(dataset)
    if ids is not None:
        conflicts = _special_id_conflicts(options, ids)
        if conflicts:
            raise ConfigError(conflicts)
        if options.get("pretrained") is None:
            defaults |= ids.config_fields()  # built with them (a pad id is the embedding's padding_idx)
    model = build_transformers_model(options, "AutoModelForCausalLM", defaults)
    if ids is not None:
        set_special_ids(model, ids)  # a pretrained model's, and every generation config
    return model


@register_model("hf_sequence_classification")
def build_hf_sequence_classification(config: Config, dataset: Any) -> nn.Module:
    """A transformers sequence classifier for the ``classification`` task (TASK.INPUT_KEY
    ``input_ids``); ``num_labels`` defaults to the dataset's ``num_classes`` (also over a
    pretrained model's, whose new head then starts from random weights)."""
    options = config.MODEL.OPTIONS
    labels: dict[str, Any] = {}
    if "num_labels" not in options and getattr(dataset, "num_classes", None) is not None:
        labels = _data_field(dataset, "num_classes", "num_labels")
    defaults = dict(labels)
    if options.get("pretrained") is None:
        if "vocab_size" not in options:
            defaults |= _data_field(dataset, "vocab_size", "vocab_size")
        if "pad_token_id" not in options:
            defaults["pad_token_id"] = options.get("eos_token_id", 0)
    model = build_transformers_model(options, "AutoModelForSequenceClassification", defaults, labels)
    hf_config: Any = getattr(model, "config")  # noqa: B009  (a transformers config: untyped)
    if hf_config.pad_token_id is None:  # batches of more than one sequence need it
        hf_config.pad_token_id = hf_config.eos_token_id if isinstance(hf_config.eos_token_id, int) else 0
    return model
