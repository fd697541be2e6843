"""``hf_vision``: a transformers vision backbone (built from a config or a local ``save_pretrained``
directory, never downloaded) with a metadata branch and one head per rank, as ``MODEL.TYPE`` builds
it for the hierarchical task."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
import torch.nn.functional as F

import linnaeus_accel.models.vision  # noqa: F401  (registers hf_vision)
from linnaeus_accel.config import Config, ConfigError, validate_config
from linnaeus_accel.models import build_model
from linnaeus_accel.models.vision import HFVisionModel
from linnaeus_accel.schedule import resolve_plan
from linnaeus_accel.training.start.setup import parameter_groups

transformers = pytest.importorskip("transformers")

CONVNEXT = {
    "model_type": "convnext",
    "depths": [1, 1],
    "hidden_sizes": [8, 16],
    "num_stages": 2,
    "image_size": 32,
}
VIT = {
    "model_type": "vit", "hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
    "intermediate_size": 32, "patch_size": 8, "image_size": 32,
}  # fmt: skip
DINOV2 = {
    "model_type": "dinov2", "hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
    "patch_size": 8, "image_size": 32,
}  # fmt: skip
BERT = {"model_type": "bert", "hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2}
VIT_MSN = {**VIT, "model_type": "vit_msn"}
RESNET = {
    "model_type": "resnet",
    "embedding_size": 8,
    "hidden_sizes": [8, 16],
    "depths": [1, 1],
    "layer_type": "basic",
}
CLASSES = (3, 5, 7)


class Photos:
    """What the species dataset declares: ranks coarse to fine, classes per rank, metadata widths."""

    levels = ("family", "genus", "species")
    num_classes = CLASSES
    meta_components = ("SPATIAL", "TEMPORAL")
    meta_dims: ClassVar[dict[str, int] | None] = {"SPATIAL": 3, "TEMPORAL": 2}

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> dict[str, Any]:
        meta = {"SPATIAL": torch.zeros(3), "TEMPORAL": torch.zeros(2)}
        return {"index": index, "image": torch.zeros(3, 32, 32), "meta": meta, "labels": torch.zeros(3)}


class PhotosWithoutWidths(Photos):
    """A dataset that declares its components but not their widths: read from its first sample."""

    meta_dims = None


def config(options: dict[str, Any], **sections: Any) -> Config:
    return validate_config({"MODEL": {"TYPE": "hf_vision", "OPTIONS": options}, **sections})


def build(options: dict[str, Any], dataset: Any = None, seed: int = 0) -> HFVisionModel:
    torch.manual_seed(seed)
    model = build_model(config(options), dataset or Photos())
    assert isinstance(model, HFVisionModel)
    return model


def batch(size: int = 2, image: int = 32, seed: int = 1) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "index": torch.arange(size),
        "image": torch.randn(size, 3, image, image, generator=g),
        "meta": {"SPATIAL": torch.randn(size, 3, generator=g), "TEMPORAL": torch.randn(size, 2, generator=g)},
        "labels": torch.stack([torch.randint(0, n, (size,), generator=g) for n in CLASSES], dim=1),
    }


def backbone_config(model: HFVisionModel) -> Any:
    return model.backbone.config


def problems(exc: pytest.ExceptionInfo[ConfigError]) -> list[tuple[str, str]]:
    return exc.value.problems


@pytest.mark.parametrize(
    ("options", "dataset", "image", "pooling"),
    [
        ({"config": CONVNEXT}, Photos(), 32, "pooler"),  # normalised average of the last stage
        ({"config": VIT}, Photos(), 32, "pooler"),  # ViT's pooler over its CLS token
        ({"config": VIT}, Photos(), 48, "pooler"),  # another image size: positions interpolated
        ({"config": DINOV2}, Photos(), 32, "pooler"),  # normalised CLS token
        ({"config": RESNET}, Photos(), 32, "pooler"),  # [B, C, 1, 1] average, flattened
        ({"config": VIT_MSN}, Photos(), 32, "cls"),  # no pooled output: the CLS token
        ({"config": CONVNEXT, "heads": "conditioned"}, Photos(), 32, "pooler"),
        ({"config": CONVNEXT, "fusion_dim": 24, "meta_hidden": 4}, PhotosWithoutWidths(), 32, "pooler"),
    ],
)
def test_one_logits_tensor_per_rank(options: dict[str, Any], dataset: Any, image: int, pooling: str) -> None:
    model = build(options, dataset)
    logits = model(batch(image=image))
    assert [tuple(t.shape) for t in logits] == [(2, n) for n in CLASSES]
    assert model.pooling == pooling
    assert model.fusion[0].in_features == 16 + options.get("meta_hidden", 64)  # image features + metadata
    assert model.fusion[0].out_features == options.get("fusion_dim", 16)


def test_metadata_changes_the_logits() -> None:
    model = build({"config": CONVNEXT}).eval()
    b = batch()
    masked = {**b, "meta": {name: torch.zeros_like(t) for name, t in b["meta"].items()}}
    assert not torch.equal(model(b)[2], model(masked)[2])


def test_a_missing_component_is_flagged_to_the_model_not_read_as_a_value() -> None:
    """The metadata MLP reads one validity flag per component beside its values: zeroing a
    component switches its flag off, and the flag's weights alone change the logits then."""
    model = build({"config": CONVNEXT}).eval()
    assert model.meta is not None
    first = model.meta[0]
    widths = sum(t[0].numel() for t in batch()["meta"].values())
    assert first.in_features == widths + len(batch()["meta"])  # values, then one flag a component
    b = batch()
    name = next(iter(b["meta"]))
    missing = {**b, "meta": {**b["meta"], name: torch.zeros_like(b["meta"][name])}}
    before = model(missing)[2]
    with torch.no_grad():
        first.weight[:, widths:] = 0.0  # the flags' weights off: a missing value would read as zeros
    assert not torch.equal(before, model(missing)[2])


def test_channels_last_gives_the_same_logits() -> None:
    plain = build({"config": CONVNEXT}).eval()
    last = build({"config": CONVNEXT, "channels_last": True}).eval()
    conv = last.backbone.embeddings.patch_embeddings.weight
    assert conv.is_contiguous(memory_format=torch.channels_last)
    assert not conv.is_contiguous()
    b = batch()
    for ours, theirs in zip(plain(b), last(b), strict=True):
        torch.testing.assert_close(ours, theirs)


def save_convnext(directory: Path, classifier: bool = False) -> Any:
    torch.manual_seed(5)
    fields = {k: v for k, v in CONVNEXT.items() if k != "model_type"}
    hf_config = transformers.ConvNextConfig(**fields, num_labels=4)
    model = (transformers.ConvNextForImageClassification if classifier else transformers.ConvNextModel)(
        hf_config
    )
    model.save_pretrained(directory)
    return model.convnext if classifier else model


@pytest.mark.parametrize("classifier", [False, True])  # a backbone; an image classifier's backbone
def test_pretrained_directory_gives_its_weights(tmp_path: Path, classifier: bool) -> None:
    saved = save_convnext(tmp_path / "convnext", classifier)
    model = build({"pretrained": str(tmp_path / "convnext")})
    loaded = model.backbone.state_dict()
    assert loaded.keys() == saved.state_dict().keys()
    assert all(torch.equal(loaded[k], t) for k, t in saved.state_dict().items())
    assert [tuple(t.shape) for t in model(batch())] == [(2, n) for n in CLASSES]


def test_pretrained_directory_without_weights_is_refused(tmp_path: Path) -> None:
    save_convnext(tmp_path / "convnext")
    (tmp_path / "convnext" / "model.safetensors").unlink()
    with pytest.raises(ConfigError) as exc:
        build({"pretrained": str(tmp_path / "convnext")})
    assert problems(exc) == [
        (
            "MODEL.OPTIONS.pretrained",
            f"{tmp_path / 'convnext'} holds no weights (model.safetensors or pytorch_model.bin)",
        )
    ]


def test_pretrained_overrides_that_change_its_weights_are_refused(tmp_path: Path) -> None:
    save_convnext(tmp_path / "convnext")
    with pytest.raises(ConfigError) as exc:
        build({"pretrained": str(tmp_path / "convnext"), "config": {"hidden_sizes": [8, 32]}})
    assert problems(exc) == [
        (
            "MODEL.OPTIONS.config.hidden_sizes",
            f"cannot be [8, 32] with the pretrained weights of {tmp_path / 'convnext'} (its value [8, 16]): it "
            "changes the shape of its weights; leave it out",
        )
    ]
    # one that keeps them is taken
    model = build({"pretrained": str(tmp_path / "convnext"), "config": {"drop_path_rate": 0.1}})
    assert backbone_config(model).drop_path_rate == 0.1


def test_frozen_backbone_is_unchanged_by_training() -> None:
    model = build({"config": RESNET, "freeze_backbone": True})
    before = {k: t.clone() for k, t in model.state_dict().items()}
    # Every parameter handed to the optimizer, with weight decay: the frozen ones have no gradient.
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    model.train()
    assert not model.backbone.training  # its batch norms keep their statistics
    for step in range(3):
        b = batch(size=4, seed=step)
        loss = sum(F.cross_entropy(lg, b["labels"][:, i]) for i, lg in enumerate(model(b)))
        optimizer.zero_grad()
        loss.backward()  # type: ignore[union-attr]
        optimizer.step()
    after = model.state_dict()
    backbone = [k for k in after if k.startswith("backbone.")]
    assert any("running_mean" in k for k in backbone)  # the buffers are checked too
    assert all(torch.equal(before[k], after[k]) for k in backbone)
    assert all(not p.requires_grad for p in model.backbone.parameters())
    assert not torch.equal(before["heads.2.weight"], after["heads.2.weight"])
    assert not torch.equal(before["fusion.0.weight"], after["fusion.0.weight"])


def test_conditioned_heads_read_the_parent_rank() -> None:
    independent = build({"config": CONVNEXT}).eval()
    conditioned = build({"config": CONVNEXT, "heads": "conditioned"}).eval()
    # The shared part (backbone, metadata, fusion, heads) the same: only the parent terms differ.
    missing, unexpected = conditioned.load_state_dict(independent.state_dict(), strict=False)
    assert sorted(missing) == ["parents.0.weight", "parents.1.weight"]
    assert not unexpected
    b = batch()
    plain, informed = independent(b), conditioned(b)
    assert torch.equal(plain[0], informed[0])  # the coarsest rank has no parent
    assert not torch.allclose(plain[1], informed[1])
    assert not torch.allclose(plain[2], informed[2])

    # Another parent head: the child's logits follow in the conditioned model only.
    change = torch.randn(
        conditioned.get_parameter("heads.1.weight").shape, generator=torch.Generator().manual_seed(3)
    )
    with torch.no_grad():
        for model in (independent, conditioned):
            model.get_parameter("heads.1.weight").add_(change)
    assert torch.equal(independent(b)[2], plain[2])
    assert not torch.allclose(conditioned(b)[2], informed[2])

    with torch.no_grad():  # without its parent term a conditioned head is an independent one
        for name, parameter in conditioned.named_parameters():
            if name.startswith("parents."):
                parameter.zero_()
    assert torch.allclose(conditioned(b)[2], independent(b)[2])


def test_backbone_gets_its_own_lr_group() -> None:
    groups = [{"LABEL": "backbone", "MATCH": ["backbone.*"], "LR_MULTIPLIER": 0.1}]
    cfg = config(
        {"config": CONVNEXT},
        LR_SCHEDULER={"PARAMETER_GROUPS": groups, "REFERENCE_BS": None, "BASE_LR": 1.0},
        TRAIN={"EPOCHS": 1},
    )
    model = build_model(cfg, Photos())
    built = {g["name"]: g for g in parameter_groups(model, cfg.OPTIMIZER, cfg.LR_SCHEDULER)}
    ids = {name: {id(p) for p in g["params"]} for name, g in built.items()}
    assert ids["backbone"] == {id(p) for p in model.get_submodule("backbone").parameters()}
    assert ids["default"] == {id(p) for n, p in model.named_parameters() if not n.startswith("backbone.")}
    plan = resolve_plan(cfg, 10, 1)
    assert plan.lr(0, built["backbone"]["lr_group"]) == pytest.approx(0.1 * plan.lr(0, 0))


LINNAEUS = (
    "is a linnaeus model, which is not built here: use MODEL.TYPE hf_vision with MODEL.OPTIONS.config of a "
    "ConvNeXt or DINOv2 (model_type convnext or dinov2 and its fields) or MODEL.OPTIONS.pretrained (a local "
    "save_pretrained directory of one)"
)


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        # linnaeus' own models, however spelt
        (
            {"config": {"model_type": "mFormerV1"}},
            [("MODEL.OPTIONS.config.model_type", f"'mFormerV1' {LINNAEUS}")],
        ),
        (
            {"name": "mformerV1_sm", "config": CONVNEXT},
            [("MODEL.OPTIONS.name", f"'mformerV1_sm' {LINNAEUS}")],
        ),
        # an unknown option
        (
            {"config": CONVNEXT, "dropout": 0.1},
            [
                (
                    "MODEL.OPTIONS",
                    "hf_vision takes config, pretrained, freeze_backbone, meta_hidden, fusion_dim, heads, channels_last, not dropout",
                )
            ],
        ),
        # neither a config nor a directory
        (
            {},
            [
                (
                    "MODEL.OPTIONS",
                    "set MODEL.OPTIONS.config (model_type and its fields, e.g. convnext, dinov2, vit, resnet) to "
                    "build a backbone, or MODEL.OPTIONS.pretrained to load one",
                )
            ],
        ),
        # bad values, all reported at once
        (
            {
                "config": CONVNEXT,
                "heads": "gated",
                "meta_hidden": 0,
                "freeze_backbone": "yes",
                "channels_last": 1,
            },
            [
                ("MODEL.OPTIONS.freeze_backbone", "must be true or false (got 'yes')"),
                ("MODEL.OPTIONS.channels_last", "must be true or false (got 1)"),
                ("MODEL.OPTIONS.meta_hidden", "must be an integer from 1 to 65536 (got 0)"),
                ("MODEL.OPTIONS.heads", "must be independent or conditioned (got 'gated')"),
            ],
        ),
        # a directory given as a config field
        (
            {"config": {**CONVNEXT, "pretrained": "convnext"}},
            [
                (
                    "MODEL.OPTIONS.config.pretrained",
                    "is not a config field (a directory is MODEL.OPTIONS.pretrained; hf_vision takes no "
                    "gradient_checkpointing or lora)",
                )
            ],
        ),
        # a misspelt config field, named where it is
        (
            {"config": {**CONVNEXT, "depth": [1]}},
            [("MODEL.OPTIONS.config", "ConvNextConfig (convnext) has no field depth")],
        ),
        # a masked autoencoder would hide most of every photo, in validation too
        (
            {"config": {**VIT, "model_type": "vit_mae"}},
            [
                (
                    "MODEL.OPTIONS.config.mask_ratio",
                    "is 0.75: the backbone would hide that share of every photo's patches, in validation too; "
                    "set it to 0",
                )
            ],
        ),
        # a model type that is no transformers model
        (
            {"config": {"model_type": "convnxt"}},
            [
                (
                    "MODEL.OPTIONS.config.model_type",
                    "'convnxt' is not a transformers model type (e.g. convnext, dinov2, vit, resnet)",
                )
            ],
        ),
    ],
)
def test_refused_options(options: dict[str, Any], expected: list[tuple[str, str]]) -> None:
    with pytest.raises(ConfigError) as exc:
        build(options)
    assert problems(exc) == expected


@pytest.mark.parametrize(
    ("fields", "start"),
    [
        # a text model: no image features
        ({**BERT}, "BertModel cannot embed a [1, 3, 224, 224] image by itself"),
        # sizes transformers accepts and cannot build
        (
            {**CONVNEXT, "hidden_sizes": [8]},
            "transformers cannot build a vision backbone from it (IndexError",
        ),
    ],
)
def test_backbones_that_cannot_embed_photos_are_refused(fields: dict[str, Any], start: str) -> None:
    with pytest.raises(ConfigError) as exc:
        build({"config": fields})
    [(key, message)] = problems(exc)
    assert key == "MODEL.OPTIONS.config"
    assert message.startswith(start), message
