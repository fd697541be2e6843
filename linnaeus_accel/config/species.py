"""linnaeus' own DATA keys for species photos: ``DATA.TASK_KEYS_H5``, ``DATA.PARTIAL``,
``DATA.IMG_SIZE``, ``DATA.META``, ``DATA.H5`` and ``DATA.HYBRID``, with linnaeus' names and
defaults, so that a linnaeus config's DATA section reads unchanged. ``DATA.H5.LABELS_PATH`` selects
the ``linnaeus_h5`` dataset (``data/species/``). What linnaeus offers and this version does not
read yet (pixels in ``images.h5``, separate train and validation label files, column subsets,
out-of-region masking) is refused by name rather than ignored."""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from .base import Fraction, NonNegativeInt, PositiveInt, Problem, Section

# linnaeus' defaults of its three components: a config that sets one field of one keeps the rest.
COMPONENT_DEFAULTS: dict[str, dict[str, Any]] = {
    "TEMPORAL": {"ENABLED": True, "SOURCE": "temporal", "DIM": 2, "IDX": 0},
    "SPATIAL": {"ENABLED": True, "SOURCE": "spatial", "DIM": 3, "IDX": 1},
    "ELEVATION": {"ENABLED": False, "SOURCE": "elevation_broadrange_2", "DIM": 10, "IDX": 2},
}


class MetaComponentConfig(Section):
    """One metadata component: a float dataset of labels.h5 (``SOURCE``), ``DIM`` wide."""

    ENABLED: bool = Field(True, description="Feed this component to the model.")
    SOURCE: str = Field(description="The labels.h5 dataset holding it (e.g. spatial, temporal).")
    COLUMNS: list[NonNegativeInt] = Field(
        default_factory=list, description="Columns of SOURCE to use; empty: all (the only choice read yet)."
    )
    DIM: PositiveInt = Field(description="Its width: the columns SOURCE holds.")
    IDX: NonNegativeInt = Field(description="Its place when the components are concatenated (ascending).")
    ALLOW_MISSING: bool = Field(
        True,
        description="A row without this component (all zeros; for elevation, sin/cos of 0 m) trains with "
        "it missing; false: such a row is an error naming it.",
    )
    OOR_MASK: bool = Field(False, description="linnaeus' out-of-region masking: not read yet (keep false).")

    def problems(self) -> list[Problem]:
        problems = []
        if self.COLUMNS:
            problems.append(Problem(("COLUMNS",), "{0} is not read yet: leave it empty to use every column"))
        if self.OOR_MASK:
            problems.append(
                Problem(("OOR_MASK",), "{0} (out-of-region masking) is not read yet: set it to false")
            )
        return problems


class MetaConfig(Section):
    """The metadata components fed with each photo (where, when, how high)."""

    ACTIVE: bool = Field(True, description="Feed metadata at all; false: photos alone.")
    COMPONENTS: dict[str, MetaComponentConfig] = Field(
        default_factory=lambda: {k: MetaComponentConfig(**v) for k, v in COMPONENT_DEFAULTS.items()},
        description="By name (TEMPORAL, SPATIAL, ELEVATION or your own): ENABLED, SOURCE, DIM, IDX, "
        "ALLOW_MISSING. linnaeus' three keep their defaults for the fields a config leaves out; "
        "SCHEDULE.META_MASKING names components by these names.",
    )

    @model_validator(mode="before")
    @classmethod
    def _linnaeus_defaults(cls, data: Any) -> Any:
        if not isinstance(data, dict) or not isinstance(data.get("COMPONENTS"), dict):
            return data
        given = data["COMPONENTS"]
        merged = {k: {**v} for k, v in COMPONENT_DEFAULTS.items()}
        for name, fields in given.items():
            merged[name] = {**merged.get(name, {}), **fields} if isinstance(fields, dict) else fields
        return {**data, "COMPONENTS": merged}

    def problems(self) -> list[Problem]:
        enabled = sorted((c.IDX, name) for name, c in self.COMPONENTS.items() if c.ENABLED)
        seen: dict[int, str] = {}
        problems = []
        for idx, name in enabled:
            if idx in seen:
                problems.append(
                    Problem(
                        (f"COMPONENTS.{seen[idx]}.IDX", f"COMPONENTS.{name}.IDX"),
                        "{0} and {1} are both " + str(idx) + ": give each enabled component its own place",
                    )
                )
            seen.setdefault(idx, name)
        return problems


class PartialConfig(Section):
    """Observations identified only to a coarser rank."""

    LEVELS: bool = Field(
        False,
        description="True: a rank without a label is null there (masked from that rank's loss; class 0 keeps "
        "linnaeus' layout); false: such rows are dropped.",
    )


class H5Config(Section):
    """linnaeus' labels.h5 (and images.h5, not read yet)."""

    LABELS_PATH: str | None = Field(
        None, description="labels.h5: one row per photo; setting it selects the linnaeus_h5 dataset."
    )
    TRAIN_LABELS_PATH: str | None = Field(None, description="Not read yet: one LABELS_PATH is split.")
    VAL_LABELS_PATH: str | None = Field(None, description="Not read yet: one LABELS_PATH is split.")
    IMAGES_PATH: str | None = Field(None, description="Pixels in images.h5: not read yet (use DATA.HYBRID).")
    TRAIN_IMAGES_PATH: str | None = Field(None, description="Not read yet (use DATA.HYBRID).")
    VAL_IMAGES_PATH: str | None = Field(None, description="Not read yet (use DATA.HYBRID).")
    TRAIN_VAL_SPLIT_RATIO: Fraction = Field(
        0.9, description="Share of the rows trained on; the rest validate."
    )
    TRAIN_VAL_SPLIT_SEED: NonNegativeInt = Field(
        42, description="Seeds the split, the same on every process and in every run."
    )

    def problems(self) -> list[Problem]:
        problems = []
        for key in ("TRAIN_LABELS_PATH", "VAL_LABELS_PATH"):
            if getattr(self, key) is not None:
                problems.append(
                    Problem(
                        (key,),
                        "{0} is not read yet: give one LABELS_PATH, split by TRAIN_VAL_SPLIT_RATIO",
                    )
                )
        for key in ("IMAGES_PATH", "TRAIN_IMAGES_PATH", "VAL_IMAGES_PATH"):
            if getattr(self, key) is not None:
                problems.append(
                    Problem(
                        (key,),
                        "{0} (pixels in images.h5) is not read yet: put the photos in a folder and set "
                        "DATA.HYBRID.USE_HYBRID true and DATA.HYBRID.IMAGES_DIR",
                    )
                )
        return problems


class HybridConfig(Section):
    """Photos as files in a folder, named by labels.h5's img_identifiers."""

    USE_HYBRID: bool = Field(False, description="Read the photos from IMAGES_DIR (the one way read yet).")
    IMAGES_DIR: str = Field("", description="The folder of the photos.")
    FILE_EXTENSION: str = Field(".jpg", description="Appended to an identifier that has none.")
    ALLOW_MISSING_IMAGES: bool = Field(
        False, description="Not read yet: every photo must be there (a missing one is named before training)."
    )

    def problems(self) -> list[Problem]:
        if self.ALLOW_MISSING_IMAGES:
            return [
                Problem(
                    ("ALLOW_MISSING_IMAGES",),
                    "{0} is not read yet: every photo must be in IMAGES_DIR (a missing one is named, file "
                    "and row, before training); drop its rows from the labels",
                )
            ]
        return []
