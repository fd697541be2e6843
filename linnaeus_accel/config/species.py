"""linnaeus' own DATA keys for species photos: ``DATA.TASK_KEYS_H5``, ``DATA.PARTIAL``,
``DATA.IMG_SIZE``, ``DATA.META``, ``DATA.H5`` and ``DATA.HYBRID``, with linnaeus' names and
defaults, so that a linnaeus config's DATA section reads unchanged. ``DATA.H5.LABELS_PATH`` selects
the ``linnaeus_h5`` dataset (``data/species/``), whose photos come from a folder (``DATA.HYBRID``)
or as pixels from ``images.h5`` (``DATA.H5.IMAGES_PATH``), one or the other (``image_source_problems``).
What linnaeus offers and this version does not read yet (separate train and validation files,
column subsets, out-of-region masking) is refused by name rather than ignored."""

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
    """linnaeus' labels.h5, and images.h5 when the photos are stored as pixels."""

    LABELS_PATH: str | None = Field(
        None, description="labels.h5: one row per photo; setting it selects the linnaeus_h5 dataset."
    )
    TRAIN_LABELS_PATH: str | None = Field(None, description="Not read yet: one LABELS_PATH is split.")
    VAL_LABELS_PATH: str | None = Field(None, description="Not read yet: one LABELS_PATH is split.")
    IMAGES_PATH: str | None = Field(
        None,
        description="images.h5: the photos as uint8 pixels (rows, height, width, 3), row i that of LABELS_PATH's "
        "row i; read when DATA.HYBRID.USE_HYBRID is false (else give null).",
    )
    TRAIN_IMAGES_PATH: str | None = Field(None, description="Not read yet: one IMAGES_PATH is split.")
    VAL_IMAGES_PATH: str | None = Field(None, description="Not read yet: one IMAGES_PATH is split.")
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
        if self.IMAGES_PATH is not None and self.LABELS_PATH is None:
            problems.append(
                Problem(
                    ("IMAGES_PATH", "LABELS_PATH"),
                    "{0} holds the pixels of the rows of {1}, which is not set: set {1} to its labels.h5",
                )
            )
        for key in ("TRAIN_IMAGES_PATH", "VAL_IMAGES_PATH"):
            if getattr(self, key) is not None:
                problems.append(
                    Problem(
                        (key,),
                        "{0} is not read yet: give one IMAGES_PATH beside LABELS_PATH, split by "
                        "TRAIN_VAL_SPLIT_RATIO",
                    )
                )
        return problems


class HybridConfig(Section):
    """Photos as files in a folder, named by labels.h5's img_identifiers."""

    USE_HYBRID: bool = Field(
        False, description="Read the photos from IMAGES_DIR; false: from DATA.H5.IMAGES_PATH's pixels."
    )
    IMAGES_DIR: str = Field("", description="The folder of the photos (read with USE_HYBRID true).")
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


def image_source_problems(h5: H5Config, hybrid: HybridConfig) -> list[Problem]:
    """With ``H5.LABELS_PATH`` set, the photos come from exactly one place: a folder (``USE_HYBRID``
    true and ``IMAGES_DIR``) or ``images.h5`` (``IMAGES_PATH``, ``USE_HYBRID`` false). The keys are
    relative to the DATA section, whose validator calls this."""
    if h5.LABELS_PATH is None:
        return []
    if hybrid.USE_HYBRID and h5.IMAGES_PATH is not None:
        return [
            Problem(
                ("HYBRID.USE_HYBRID", "H5.IMAGES_PATH"),
                "{0} true reads the photos from a folder and {1} names their pixels in images.h5: keep one "
                "(set {0} false to read {1}, or {1} to null to read the folder)",
            )
        ]
    if hybrid.USE_HYBRID and not hybrid.IMAGES_DIR:
        return [
            Problem(
                ("HYBRID.USE_HYBRID", "HYBRID.IMAGES_DIR"),
                "{0} true reads the photos from a folder and {1} is empty: set {1} to the folder of the photos",
            )
        ]
    if not hybrid.USE_HYBRID and h5.IMAGES_PATH is None:
        return [
            Problem(
                ("HYBRID.USE_HYBRID", "HYBRID.IMAGES_DIR", "H5.IMAGES_PATH"),
                "the photos of DATA.H5.LABELS_PATH are read from a folder or from images.h5: set {0} true "
                "and {1} to the folder, or {2} to images.h5",
            )
        ]
    return []
