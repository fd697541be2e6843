"""``hf_vision``: a transformers vision backbone with a metadata branch and one head per rank, for
the ``hierarchical`` task on species photos. ``forward(batch)`` reads ``batch["image"]``
(``[B, 3, H, W]``) and ``batch["meta"]`` and returns one logits tensor per rank, coarse to fine.

``MODEL.OPTIONS``:

- ``config``: the backbone's transformers config, ``model_type`` (``convnext``, ``dinov2``, ``vit``,
  ``resnet``, ``swin``...) and its fields, randomly initialised through ``AutoModel``; with
  ``pretrained``, fields that override the directory's config where its weights still fit.
- ``pretrained``: a local ``save_pretrained`` directory, read offline (``pretrained.py``); one
  written from an image classifier (``ConvNextForImageClassification``) gives its backbone.
- ``freeze_backbone`` (default false): the backbone's parameters do not train and it stays in eval
  mode, so its norm statistics stay those it was trained with while the rest of the model trains.
- ``meta_hidden`` (default 64): the width of the metadata MLP.
- ``fusion_dim`` (default the image features' width): the width the heads read.
- ``heads``: ``independent`` (default), one linear per rank over the fused features, or
  ``conditioned``: each finer rank's head also reads the softmax of its parent rank's logits.
- ``channels_last`` (default false): the backbone's 4-D weights and each batch's images in
  channels-last memory order, which a convolutional backbone (ConvNeXt, ResNet) runs faster in on a
  GPU in bf16; a ViT gains nothing (its only 4-D weight is the patch embedding).

The image features are the backbone's pooled output where its model has one, else its last
hidden state pooled as ``CLS_FIRST`` says. The metadata components (the dataset's
``meta_components``, in its order) are concatenated and go through a small MLP; the two are fused by
concatenation followed by a linear layer, GELU and LayerNorm. Concatenation is what linnaeus' own
metadata adapter did; a gated fusion can come later. A masked or missing component arrives as
zeros (the dataset and the task's masking write zeros; no real value encodes to zeros), and the
metadata MLP reads, beside the values, one validity flag per component (1 where any of its values
is non-zero), as linnaeus' datasets hand a validity mask to its model: a missing place is then never
read as a place at the origin of the encoding.

Parameter names start with ``backbone.``, ``meta.``, ``fusion.``, ``heads.`` and ``parents.``
(a conditioned head's parent term), so ``LR_SCHEDULER.PARAMETER_GROUPS`` can give the backbone its
own learning rate with ``MATCH: ['backbone.*']``. linnaeus' own mFormer models are not built here.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ..config import Config, ConfigError
from .hf import BUILD_OPTIONS, build_transformers_model
from .pretrained import PRETRAINED_KEY
from .registry import register_model

KEY = "MODEL.OPTIONS"
CONFIG_KEY = f"{KEY}.config"
OPTIONS = ("config", "pretrained", "freeze_backbone", "meta_hidden", "fusion_dim", "heads", "channels_last")
HEADS = ("independent", "conditioned")
# A width past this is a typo or a value meant for another model.
MAX_WIDTH = 65536
# Families whose AutoModel has no pooled output but puts a CLS token first: that token (the one
# their pretraining shaped as the image's summary). Every other family without a pooled output
# (I-JEPA, a convolutional feature map) is averaged over its tokens or positions. Those with one:
# ConvNeXt and Swin (averaged, normalised), ResNet (averaged), ViT (tanh of a linear over CLS),
# DINOv2 (normalised CLS), CLIP and SigLIP vision towers.
CLS_FIRST = frozenset({"vit_mae", "vit_msn"})
LINNAEUS_MODEL = re.compile("mformer", re.IGNORECASE)
VISION_EXAMPLES = "e.g. convnext, dinov2, vit, resnet"


@dataclass(frozen=True)
class VisionOptions:
    """``MODEL.OPTIONS`` of ``hf_vision``, checked (see the module docstring)."""

    config: dict[str, Any]
    pretrained: str | None
    freeze_backbone: bool
    meta_hidden: int
    fusion_dim: int | None
    heads: str
    channels_last: bool = False


def _refusal(key: str, message: str) -> ConfigError:
    return ConfigError([(key, message)])


def _linnaeus_names(options: Mapping[str, Any]) -> list[tuple[str, str]]:
    """Where ``options`` name a linnaeus model (``mFormerV1``...), with what to use instead."""
    named = [(f"{KEY}.{k}", v) for k, v in options.items() if k != "pretrained"]
    config = options.get("config")
    if isinstance(config, Mapping):
        named.append((f"{CONFIG_KEY}.model_type", config.get("model_type")))
    problems = []
    for key, value in named:
        for text in (key.rsplit(".", 1)[-1], value):
            if isinstance(text, str) and LINNAEUS_MODEL.search(text):
                problems.append(
                    (
                        key,
                        f"{text!r} is a linnaeus model, which is not built here: use MODEL.TYPE hf_vision with "
                        f"{CONFIG_KEY} of a ConvNeXt or DINOv2 (model_type convnext or dinov2 and its fields) or "
                        f"{PRETRAINED_KEY} (a local save_pretrained directory of one)",
                    )
                )
                break
    return problems


def _width(options: Mapping[str, Any], name: str, default: int | None) -> tuple[int | None, str | None]:
    value = options.get(name, default)
    if value is None and default is None:
        return None, None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_WIDTH:
        return None, f"must be an integer from 1 to {MAX_WIDTH} (got {value!r})"
    return value, None


def parse_options(options: Mapping[str, Any]) -> VisionOptions:
    """``options`` (``MODEL.OPTIONS``) checked; every problem at once, each named by its full key."""
    problems = _linnaeus_names(options)
    if problems:
        raise ConfigError(problems)
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        problems.append((KEY, f"hf_vision takes {', '.join(OPTIONS)}, not {', '.join(map(str, unknown))}"))
    config, pretrained = options.get("config"), options.get("pretrained")
    if config is not None and not isinstance(config, Mapping):
        problems.append((CONFIG_KEY, f"must be a mapping of transformers config fields (got {config!r})"))
        config = None
    config = dict(config or {})
    if pretrained is None and "model_type" not in config:
        what = f"set {CONFIG_KEY} (model_type and its fields, {VISION_EXAMPLES}) to build a backbone"
        problems.append((KEY, f"{what}, or {PRETRAINED_KEY} to load one"))
    # A backbone in another dtype than its heads could not feed them.
    dtype = "is not read by hf_vision: it trains in float32 (mixed precision is Accelerate's)"
    problems += [(f"{CONFIG_KEY}.{name}", dtype) for name in ("dtype", "torch_dtype") if name in config]
    # hf.py's builder would take these as its own options, not as config fields.
    where = f"is not a config field (a directory is {KEY}.pretrained; hf_vision takes no gradient_checkpointing or lora)"
    problems += [(f"{CONFIG_KEY}.{name}", where) for name in BUILD_OPTIONS if name in config]
    flags = {name: options.get(name, False) for name in ("freeze_backbone", "channels_last")}
    for name, flag in flags.items():
        if not isinstance(flag, bool):
            problems.append((f"{KEY}.{name}", f"must be true or false (got {flag!r})"))
    meta_hidden, problem = _width(options, "meta_hidden", 64)
    if problem:
        problems.append((f"{KEY}.meta_hidden", problem))
    fusion_dim, problem = _width(options, "fusion_dim", None)
    if problem:
        problems.append((f"{KEY}.fusion_dim", problem))
    heads = options.get("heads", "independent")
    if heads not in HEADS:
        problems.append((f"{KEY}.heads", f"must be {' or '.join(HEADS)} (got {heads!r})"))
    if problems:
        raise ConfigError(problems)
    return VisionOptions(
        config,
        pretrained,
        flags["freeze_backbone"],
        meta_hidden or 64,
        fusion_dim,
        heads,
        flags["channels_last"],
    )


def _under_config(key: str) -> str:
    """hf.py's helpers name a field ``MODEL.OPTIONS.<field>``; here fields sit under ``config``."""
    if key == PRETRAINED_KEY or not key.startswith(KEY):
        return key
    return CONFIG_KEY + key[len(KEY) :]


@contextlib.contextmanager
def _config_keys() -> Iterator[None]:
    try:
        yield
    except ConfigError as exc:
        # The shared helpers describe a failed build by the heads they know; here it is a backbone.
        raise ConfigError(
            [
                (_under_config(k), m.replace("a sequence classifier", "a vision backbone"))
                for k, m in exc.problems
            ]
        ) from None
    # transformers builds some configs it accepted into index errors (ConvNeXt with fewer
    # hidden_sizes than stages): the user's values, not a bug of ours.
    except (IndexError, KeyError, AttributeError, ValueError, TypeError, RuntimeError) as exc:
        reason = f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
        raise _refusal(
            CONFIG_KEY, f"transformers cannot build a vision backbone from it ({reason})"
        ) from None


def build_backbone(options: VisionOptions) -> nn.Module:
    """The transformers ``AutoModel`` that ``options`` describe, from a config or a directory."""
    try:
        import transformers
    except ImportError:
        raise _refusal("MODEL.TYPE", "hf_vision needs transformers: pip install transformers") from None
    fields = dict(options.config)
    model_type = fields.get("model_type")
    if options.pretrained is None and model_type not in transformers.CONFIG_MAPPING:
        what = f"{model_type!r} is not a transformers model type ({VISION_EXAMPLES})"
        raise _refusal(f"{CONFIG_KEY}.model_type", what)
    if options.pretrained is not None:
        fields["pretrained"] = options.pretrained
    with _config_keys():
        backbone = build_transformers_model(fields, "AutoModel", {})
    mask_ratio = getattr(backbone.config, "mask_ratio", 0.0)
    if mask_ratio:
        hidden = f"is {mask_ratio}: the backbone would hide that share of every photo's patches"
        raise _refusal(f"{CONFIG_KEY}.mask_ratio", f"{hidden}, in validation too; set it to 0")
    return backbone


def _image_size(hf_config: Any) -> tuple[int, int]:
    """The size the backbone was built for (224 where its config does not say)."""
    size = getattr(hf_config, "image_size", 224)
    if isinstance(size, int):
        return size, size
    if isinstance(size, Sequence) and len(size) == 2 and all(isinstance(s, int) for s in size):
        return int(size[0]), int(size[1])
    return 224, 224


def pool(output: Any, pooling: str) -> Tensor:
    """``[B, width]`` image features from a backbone's output."""
    if pooling == "pooler":
        pooled: Tensor = output.pooler_output
        return pooled.flatten(1)  # ResNet's is [B, C, 1, 1]
    hidden: Tensor = output.last_hidden_state
    if hidden.dim() == 4:  # a convolutional feature map [B, C, H, W]
        return hidden.mean(dim=(2, 3))
    return hidden[:, 0] if pooling == "cls" else hidden.mean(dim=1)


def probe_features(backbone: nn.Module) -> tuple[int, str]:
    """(width, pooling) of the backbone's image features: one image through a copy on the meta
    device (no memory, no compute), else through the backbone itself in eval mode, leaving its
    training mode and the random state as they were. A backbone that cannot embed images alone is
    a ConfigError."""
    from transformers import AutoModel

    auto: Any = AutoModel  # from_config is unannotated
    hf_config: Any = getattr(backbone, "config")  # noqa: B009  (a transformers config: untyped)
    channels = getattr(hf_config, "num_channels", 3)
    shape = (1, channels if isinstance(channels, int) else 3, *_image_size(hf_config))
    try:
        with torch.device("meta"):
            output = auto.from_config(hf_config)(pixel_values=torch.empty(shape))
    except Exception:  # an operation without a meta kernel: run the real backbone once
        training = backbone.training
        backbone.eval()
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=[]):
                output = backbone(pixel_values=torch.zeros(shape))
        except Exception as exc:
            reason = f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
            what = f"{type(backbone).__name__} cannot embed a {list(shape)} image by itself ({reason})"
            raise _refusal(CONFIG_KEY, f"{what}: use a vision model ({VISION_EXAMPLES})") from None
        finally:
            backbone.train(training)
    if getattr(output, "pooler_output", None) is None and getattr(output, "last_hidden_state", None) is None:
        raise _refusal(
            CONFIG_KEY, f"{type(backbone).__name__} returns no image features: use {VISION_EXAMPLES}"
        )
    if getattr(output, "pooler_output", None) is not None:
        pooling = "pooler"
    else:  # CLS_FIRST says which families have a CLS token to read
        first = hf_config.model_type in CLS_FIRST and output.last_hidden_state.dim() == 3
        pooling = "cls" if first else "mean"
    return int(pool(output, pooling).shape[1]), pooling


class HFVisionModel(nn.Module):
    """A backbone, a metadata MLP, a fusion layer and one head per rank (coarse to fine).

    ``feature_dim``: the width of ``pool(backbone(...), pooling)``; ``meta_dims``: each metadata
    component's width, in the dataset's order (empty: no metadata branch); ``num_classes``: per rank,
    coarse to fine."""

    def __init__(
        self,
        backbone: nn.Module,
        feature_dim: int,
        pooling: str,
        meta_dims: Mapping[str, int],
        num_classes: Sequence[int],
        *,
        meta_hidden: int = 64,
        fusion_dim: int | None = None,
        heads: str = "independent",
        freeze_backbone: bool = False,
        channels_last: bool = False,
    ) -> None:
        super().__init__()
        self.backbone = backbone
        self.pooling = pooling
        self.meta_names = list(meta_dims)
        self.freeze_backbone = freeze_backbone
        self.memory_format = torch.channels_last if channels_last else torch.contiguous_format
        hf_config = getattr(backbone, "config", None)
        self.native_size = _image_size(hf_config)
        # ViT-like models take another image size only when told to interpolate their positions.
        self.interpolates = "interpolate_pos_encoding" in inspect.signature(backbone.forward).parameters
        width = fusion_dim or feature_dim
        self.meta: nn.Module | None = None
        if meta_dims:
            self.meta = nn.Sequential(
                nn.Linear(sum(meta_dims.values()) + len(meta_dims), meta_hidden),  # values, one flag each
                nn.GELU(),
                nn.Linear(meta_hidden, meta_hidden),
            )
        fused_in = feature_dim + (meta_hidden if meta_dims else 0)
        self.fusion = nn.Sequential(nn.Linear(fused_in, width), nn.GELU(), nn.LayerNorm(width))
        self.heads = nn.ModuleList(nn.Linear(width, n) for n in num_classes)
        # A conditioned finer head adds a linear map of its parent's class probabilities: the same
        # as one linear over [fused, softmax(parent)], kept apart so the parent's part is named.
        self.parents: nn.ModuleList | None = None
        if heads == "conditioned":
            self.parents = nn.ModuleList(
                nn.Linear(parent, child, bias=False) for parent, child in itertools.pairwise(num_classes)
            )
        if freeze_backbone:
            backbone.requires_grad_(False)
            backbone.eval()
        if channels_last:
            # torch's stub of Module.to lacks memory_format, which it takes.
            backbone.to(memory_format=torch.channels_last)  # type: ignore[call-overload]

    def train(self, mode: bool = True) -> HFVisionModel:
        super().train(mode)
        if self.freeze_backbone:
            self.backbone.eval()  # its batch-norm statistics stay the pretrained ones
        return self

    def shared_parameters(self) -> list[nn.Parameter]:
        """The last layer every head reads from: what GradNorm balances the ranks' gradients on."""
        return list(self.fusion.parameters())

    def image_features(self, image: Tensor) -> Tensor:
        kwargs = {}
        if self.interpolates and tuple(image.shape[-2:]) != self.native_size:
            kwargs["interpolate_pos_encoding"] = True
        image = image.contiguous(memory_format=self.memory_format)  # a no-op in the default order
        with torch.no_grad() if self.freeze_backbone else contextlib.nullcontext():
            return pool(self.backbone(pixel_values=image, **kwargs), self.pooling)

    def forward(self, batch: Mapping[str, Any]) -> list[Tensor]:
        features = self.image_features(batch["image"])
        if self.meta is not None:
            meta = batch["meta"]
            parts = [meta[name].reshape(len(features), -1) for name in self.meta_names]
            valid = [(part != 0).any(dim=1, keepdim=True) for part in parts]
            values = torch.cat([*parts, *valid], dim=1).to(features.dtype)
            features = torch.cat([features, self.meta(values)], dim=1)
        fused = self.fusion(features)
        logits = [self.heads[0](fused)]
        for rank in range(1, len(self.heads)):
            out = self.heads[rank](fused)
            if self.parents is not None:
                parent = torch.softmax(logits[-1], dim=1).to(out.dtype)
                out = out + self.parents[rank - 1](parent)
            logits.append(out)
        return logits


def dataset_shape(dataset: Any) -> tuple[list[int], dict[str, int]]:
    """(classes per rank coarse to fine, width per metadata component in the dataset's order), as
    ``dataset`` declares them: ``levels``, ``num_classes`` (per level, or by level name),
    ``meta_components`` and ``meta_dims`` (else the widths of ``dataset[0]["meta"]``)."""
    levels = list(getattr(dataset, "levels", None) or ())
    declared = getattr(dataset, "num_classes", None)
    counts: list[Any] = []
    if isinstance(declared, Mapping):
        counts = [declared.get(level) for level in levels]
    elif isinstance(declared, Sequence) and not isinstance(declared, str):
        counts = list(declared)
    if not levels or len(counts) != len(levels) or not all(_is_count(n) for n in counts):
        need = "hf_vision needs a dataset that declares levels (coarse to fine) and num_classes (a count >= 1"
        raise _refusal(
            "MODEL.TYPE",
            f"{need} per level), as the species dataset does; this one declares levels {levels!r} and "
            f"num_classes {declared!r}",
        )
    components = list(getattr(dataset, "meta_components", None) or ())
    if not components:
        return counts, {}
    widths = getattr(dataset, "meta_dims", None)
    if widths is None:
        meta = dataset[0]["meta"]
        widths = {name: torch.as_tensor(meta[name]).numel() for name in components if name in meta}
    missing = [name for name in components if not _is_count(widths.get(name))]
    if missing:
        raise _refusal(
            "MODEL.TYPE",
            f"the dataset declares metadata components {components} but no width >= 1 for "
            f"{', '.join(missing)} (its meta_dims, or its first sample's meta, lack them)",
        )
    return counts, {name: int(widths[name]) for name in components}


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


@register_model("hf_vision")
def build_hf_vision(config: Config, dataset: Any) -> HFVisionModel:
    options = parse_options(config.MODEL.OPTIONS)
    num_classes, meta_dims = dataset_shape(dataset)
    backbone = build_backbone(options)
    feature_dim, pooling = probe_features(backbone)
    return HFVisionModel(
        backbone,
        feature_dim,
        pooling,
        meta_dims,
        num_classes,
        meta_hidden=options.meta_hidden,
        fusion_dim=options.fusion_dim,
        heads=options.heads,
        freeze_backbone=options.freeze_backbone,
        channels_last=options.channels_last,
    )
