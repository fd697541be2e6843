"""``TRAIN``, ``DATA``, ``MODEL``, ``TASK`` and ``LOSS`` sections (``ENV``, ``EXPERIMENT``: ``run.py``)."""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, field_validator

from .base import (
    Fraction,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    Problem,
    Section,
    StepsOrOff,
    accepts,
    at_most,
    canonical_metric_name,
)
from .recovery import LossSpikeConfig, RollbackConfig
from .species import H5Config, HybridConfig, MetaConfig, PartialConfig, image_source_problems

MAX_BATCH_SIZE = 2**20
MAX_ACCUMULATION_STEPS = 2**16
MAX_NUM_WORKERS = 128
MAX_SEED = 2**32 - 1
MAX_DIST_TIMEOUT_S = 7 * 24 * 3600

BatchSize = Annotated[
    PositiveInt,
    at_most(
        MAX_BATCH_SIZE,
        "the batch is per process and more samples than that cannot fit in one batch on a device; "
        "reach a larger effective batch with more processes or TRAIN.ACCUMULATION_STEPS",
    ),
]

Seed = Annotated[NonNegativeInt, at_most(MAX_SEED, "numpy and torch take seeds from 0 to 2**32 - 1")]


class EarlyStopConfig(Section):
    """Stopping rules checked at validation points (docs/semantics.md §5); MAX_STEPS is checked every step."""

    ACTIVE: bool = Field(
        False,
        description="Turns early stopping on; off, none of the conditions below (MAX_STEPS included) is "
        "checked, though the best METRIC is still tracked.",
    )
    METRIC: str = Field("val/loss", description="Monitored metric; 'val_loss' is read as 'val/loss'.")
    MODE: Literal["min", "max"] | None = Field(
        None, description="Default: min if METRIC contains 'loss', else max."
    )
    PATIENCE_STEPS: StepsOrOff | None = Field(
        None,
        description="Stop when this many global steps pass without improvement; checked only at "
        "validation points, so it needs SCHEDULE.VALIDATION.",
    )
    MIN_DELTA: NonNegativeFloat = Field(
        0.0, description="An improvement must beat the best by more than this."
    )
    MAX_STEPS: StepsOrOff | None = Field(None, description="Hard cut-off after this many optimizer steps.")
    MAX_LOSS: float | None = Field(
        None,
        description="Stop when the monitored metric exceeds this (a non-finite metric always stops an "
        "active run).",
    )
    MIN_LR: NonNegativeFloat | None = Field(
        None, description="Stop when the LR (group 0) falls below this after warmup."
    )
    MAX_GRAD_NORM: PositiveFloat | None = Field(None, description="Stop when the gradient norm exceeds this.")

    @field_validator("METRIC")
    @classmethod
    def _canonical_metric(cls, value: str) -> str:
        return canonical_metric_name(value)

    def problems(self) -> list[Problem]:
        conditions = ("PATIENCE_STEPS", "MAX_STEPS", "MAX_LOSS", "MIN_LR", "MAX_GRAD_NORM")
        if self.ACTIVE and all(getattr(self, c) is None for c in conditions):
            return [
                Problem(
                    ("ACTIVE",),
                    "{0} is true but no stopping condition is set: set PATIENCE_STEPS (or MAX_STEPS, MAX_LOSS, MIN_LR, MAX_GRAD_NORM)",
                )
            ]
        return []

    @property
    def mode(self) -> Literal["min", "max"]:
        return self.MODE or ("min" if "loss" in self.METRIC else "max")


DEFAULT_EPOCHS = 10


class TrainConfig(Section):
    """How long to train: EPOCHS, STEPS or TARGET_TOKENS (one of them; none means EPOCHS: 10)."""

    EPOCHS: PositiveInt | None = Field(
        None,
        description=f"Training epochs; total steps = EPOCHS x optimizer steps per epoch "
        f"(default {DEFAULT_EPOCHS} when neither STEPS nor TARGET_TOKENS is set).",
    )
    STEPS: PositiveInt | None = Field(
        None,
        description="Train for exactly this many optimizer steps (T = STEPS) instead of EPOCHS. Epochs "
        "are still passes over the data: they end where the data ends (a stream without __len__ "
        "included), and the last one may be partial.",
    )
    TARGET_TOKENS: PositiveInt | None = Field(
        None,
        description="Train on this many target tokens instead of EPOCHS, resolved once to "
        "T = ceil(TARGET_TOKENS / tokens per global step); the final epoch may be partial. Needs a "
        "training dataset whose every sample holds the same number of target tokens (packed "
        "fixed-length sequences).",
    )
    ACCUMULATION_STEPS: Annotated[
        NonNegativeInt,
        at_most(
            MAX_ACCUMULATION_STEPS,
            "more micro-batches than that in one optimizer step is not a usable run; raise "
            "DATA.BATCH_SIZE or the number of processes instead",
        ),
    ] = Field(1, description="Micro-batches per optimizer step (0 is read as 1).")
    CLIP_GRAD: PositiveFloat | None = Field(
        5.0,
        description="Max gradient norm (null: no clipping). The default 5.0 is linnaeus'; transformers' Trainer, "
        "torchtitan and nanoGPT clip at 1.0 (configs/lm_tiny.yaml does too).",
    )
    AUTO_RESUME: bool = Field(
        True, description="Resume from the newest complete checkpoint in the output directory."
    )
    NONFINITE: Literal["stop", "skip", "rollback"] = Field(
        "stop",
        description="When the training loss or gradient norm is NaN/inf: stop ends the run with status "
        "failed (the last good checkpoint stays the resume point); skip drops that optimizer step, counts "
        "it in train/nonfinite_skipped and goes on (costs one host sync per step); rollback reloads the "
        "newest checkpoint from before the window it was found in and skips that data (TRAIN.ROLLBACK; "
        "found at the next metric record or checkpoint: no host sync on other steps).",
    )
    LOSS_SPIKE: LossSpikeConfig = Field(default_factory=LossSpikeConfig)
    ROLLBACK: RollbackConfig = Field(default_factory=RollbackConfig)
    EARLY_STOP: EarlyStopConfig = Field(default_factory=EarlyStopConfig)

    @field_validator("STEPS", "TARGET_TOKENS", mode="before")
    @classmethod
    def _whole_number(cls, value: Any) -> Any:
        # Budgets are written 2.5e9 or 1e5; YAML reads that as a float, which is fine when it is whole.
        if isinstance(value, float) and math.isfinite(value) and value.is_integer():
            return int(value)
        return value

    def problems(self) -> list[Problem]:
        given = tuple(k for k in ("EPOCHS", "STEPS", "TARGET_TOKENS") if getattr(self, k) is not None)
        if len(given) > 1:
            return [
                Problem(
                    given,
                    " and ".join(f"{{{i}}}" for i in range(len(given)))
                    + " are set together: a run's length is given once, in epochs, optimizer steps or "
                    "target tokens, so keep exactly one (unset the others with null)",
                )
            ]
        return []

    @property
    def epochs(self) -> int | None:
        """Epochs of an EPOCHS run (DEFAULT_EPOCHS when no length is set); None for a STEPS or
        TARGET_TOKENS run, whose epoch count depends on the data (see ``resolve_plan``)."""
        if self.EPOCHS is not None:
            return self.EPOCHS
        return None if self.STEPS is not None or self.TARGET_TOKENS is not None else DEFAULT_EPOCHS

    @property
    def length_key(self) -> str:
        """The key that sets the run's length (TRAIN.EPOCHS when none is set: its default)."""
        if self.STEPS is not None:
            return "TRAIN.STEPS"
        return "TRAIN.TARGET_TOKENS" if self.TARGET_TOKENS is not None else "TRAIN.EPOCHS"

    @property
    def accumulation(self) -> int:
        return max(1, self.ACCUMULATION_STEPS)


class DatasetConfig(Section):
    """The dataset to train and validate on."""

    NAME: str = Field("digits", description="A registered dataset (see linnaeus_accel.data.registry).")
    VAL_FRACTION: Fraction = Field(
        0.2, description="Share held out for validation when the dataset has no split."
    )
    OPTIONS: dict[str, Any] = Field(
        default_factory=dict, description="Extra keyword arguments for the dataset builder."
    )


class DataConfig(Section):
    """Batches and data loading."""

    BATCH_SIZE: BatchSize = Field(64, description="Per-process training batch size.")
    BATCH_SIZE_VAL: BatchSize | None = Field(
        None, description="Per-process validation batch size; default BATCH_SIZE."
    )
    DROP_LAST: bool = Field(False, description="Drop the last incomplete batch of each epoch.")
    SHUFFLE: bool = Field(
        True,
        description="Shuffle the training samples every epoch, in an order seeded by (EXPERIMENT.SEED, epoch) "
        "that is the same on any number of processes; false: the dataset's own order every epoch (a stream's "
        "shards as listed). Both resume exactly. Validation data is never shuffled.",
    )
    NUM_WORKERS: Annotated[
        NonNegativeInt,
        at_most(
            MAX_NUM_WORKERS,
            "every worker is a separate process (per training process) holding its own copy of the "
            "dataset; past a few per CPU core they only cost memory and start-up time",
        ),
    ] = Field(
        0, description="DataLoader worker processes (per training process; 0: load in the main process)."
    )
    DATASET: DatasetConfig = Field(default_factory=DatasetConfig)
    # linnaeus' species data (config/species.py): read when H5.LABELS_PATH is set.
    TASK_KEYS_H5: list[str] = Field(
        default_factory=lambda: ["taxa_L10", "taxa_L20", "taxa_L30", "taxa_L40"],
        description="The ranks trained on, as labels.h5 names them, finest first (species, genus, family, "
        "order): one head and one loss per rank.",
    )
    PARTIAL: PartialConfig = Field(default_factory=PartialConfig)
    IMG_SIZE: PositiveInt = Field(
        224, description="The photos' square side in pixels, as the model sees them."
    )
    META: MetaConfig = Field(default_factory=MetaConfig)
    H5: H5Config = Field(default_factory=H5Config)
    HYBRID: HybridConfig = Field(default_factory=HybridConfig)

    def problems(self) -> list[Problem]:
        if self.H5.LABELS_PATH is None:
            return []
        problems = []
        if self.DATASET.NAME not in ("digits", "linnaeus_h5"):
            problems.append(
                Problem(
                    ("H5.LABELS_PATH", "DATASET.NAME"),
                    "{0} selects linnaeus' species data and {1} names another dataset: keep one",
                )
            )
        problems += image_source_problems(self.H5, self.HYBRID)
        if not self.TASK_KEYS_H5:
            problems.append(Problem(("TASK_KEYS_H5",), "{0} is empty: list the ranks to train, finest first"))
        return problems


class ModelConfig(Section):
    """The model to build, when the Trainer is not handed one."""

    TYPE: str = Field("digits_mlp", description="A registered model (see linnaeus_accel.models.registry).")
    NAME: str | None = Field(
        None,
        description="linnaeus' model name, kept as a label; linnaeus' own architectures (mFormerV0, "
        "mFormerV1...) are not built here: TYPE hf_vision takes a transformers backbone instead.",
    )
    IMG_SIZE: PositiveInt | None = Field(
        None,
        description="linnaeus' model input side; if set, it must equal DATA.IMG_SIZE (the photos' side).",
    )
    OPTIONS: dict[str, Any] = Field(
        default_factory=dict, description="Extra keyword arguments for the model builder."
    )
    INIT_FROM: str | None = Field(
        None,
        description="Start from these weights (any model): a checkpoint directory "
        "(<run>/checkpoints/step_N), a final/ or save_pretrained directory, or a .safetensors file; "
        "read as safetensors only. Loaded into the built model before the first step, strictly (every "
        "key of the model and of the file, with the same shapes, unless INIT_IGNORE names it); the "
        "optimizer, LR schedule and data order start afresh. A resumed run takes the checkpoint's "
        "weights instead.",
    )
    INIT_IGNORE: list[str] = Field(
        default_factory=list,
        description="With INIT_FROM: fnmatch patterns on parameter and buffer names (model.state_dict() "
        "keys): the model's keys they match are left as built (a new head), the file's are not read.",
    )

    def problems(self) -> list[Problem]:
        problems: list[Problem] = []
        if self.NAME is not None and "mformer" in self.NAME.lower():
            problems.append(
                Problem(
                    ("NAME", "TYPE"),
                    "{0} names one of linnaeus' own architectures, which are not built here: set {1} to "
                    "hf_vision with OPTIONS.config (e.g. {{model_type: convnext, ...}}) or OPTIONS.pretrained "
                    "(a save_pretrained directory of a ConvNeXt, ViT or DINOv2), and unset {0}",
                )
            )
        if self.INIT_FROM is not None and self.OPTIONS.get("pretrained") is not None:
            problems.append(
                Problem(
                    ("INIT_FROM", "OPTIONS.pretrained"),
                    "{0} and {1} are set together: two sources of the same weights; keep {1} to take "
                    "the directory's architecture and weights, or {0} to load weights into the model "
                    "MODEL.OPTIONS builds",
                )
            )
        if self.INIT_FROM is not None and not self.INIT_FROM.strip():
            problems.append(Problem(("INIT_FROM",), "{0} is empty: give a path, or null to start as built"))
        if self.INIT_IGNORE and self.INIT_FROM is None:
            problems.append(
                Problem(
                    ("INIT_IGNORE", "INIT_FROM"),
                    "{0} names weights not to load, and {1} is not set: nothing is loaded; leave {0} out",
                )
            )
        if any(not pattern.strip() for pattern in self.INIT_IGNORE):
            problems.append(Problem(("INIT_IGNORE",), "{0} holds an empty pattern"))
        return problems


@accepts("number in [0, 1)")
def _check_label_smoothing(value: float) -> float:
    if not math.isfinite(value) or not 0.0 <= value < 1.0:
        raise ValueError(f"must be in [0, 1): 1 would make every target uniform (got {value})")
    return value


class TaskConfig(Section):
    """What is trained: the task turns a micro-batch into a loss and counts samples and tokens."""

    NAME: str = Field(
        "hierarchical",
        description="hierarchical (linnaeus: one logits tensor per label level, metadata masking, "
        "mixup), classification (one integer label per sample), causal_lm (next-token prediction, "
        "counted in tokens), or a task registered with linnaeus_accel.tasks.register_task.",
    )
    LABEL_SMOOTHING: Annotated[float, AfterValidator(_check_label_smoothing)] = Field(
        0.0, description="classification: cross-entropy label smoothing, in [0, 1)."
    )
    INPUT_KEY: str = Field(
        "image",
        description="classification: the batch key holding the model's input (batches may also be "
        "(input, label) pairs).",
    )
    FLOPS_PER_TOKEN: PositiveFloat | None = Field(
        None,
        description="Model FLOPs per target token (forward + backward), for MFU; causal_lm default: "
        "6 x trainable parameters.",
    )
    FLOPS_PER_SAMPLE: PositiveFloat | None = Field(
        None,
        description="Model FLOPs per sample (forward + backward), for MFU, for tasks that do not count tokens.",
    )
    MODEL_LOSS: bool = Field(
        False,
        description="causal_lm: the model computes its own loss, as nanoGPT's and minGPT's do: each "
        "window of seq_len tokens is split into inputs (its first seq_len - 1) and targets (its last "
        "seq_len - 1), the model is called as model(inputs, targets) and returns (logits, loss) (or "
        "the loss, or an object with .loss), the loss being the mean over its targets; the step's "
        "loss stays the mean over every target token.",
    )
    MODEL_IGNORE_INDEX: int = Field(
        -100,
        description="causal_lm with MODEL_LOSS: the target value the model's loss ignores (its "
        "cross-entropy's ignore_index: -1 for nanoGPT and minGPT, -100 for PyTorch's default); "
        "targets without a label (padding, even-batch repeats) are given to the model as this value.",
    )
    LOSS_CHUNK_TOKENS: NonNegativeInt = Field(
        0,
        description="causal_lm: compute the output projection and the cross-entropy this many (flattened) "
        "tokens at a time, so that the [batch, length, vocab] logits and their gradient never exist whole "
        "(the loss and gradients are the plain path's); 0 is off. The model exposes its output nn.Linear "
        "as get_output_embeddings() and its final hidden states through logits_to_keep (transformers) or "
        "forward(..., return_hidden=True): docs/guides/pretraining.md, Chunked loss.",
    )
    DOCUMENT_MASKING: bool = Field(
        False,
        description="causal_lm: attention within each document of a packed window: the documents end at "
        "the end-of-document id (the data's eos_id: a token file's sidecar, hf_dataset's tokenizer), "
        "positions restart at 0 after it, and the model is given them as position_ids (transformers "
        "models build the block-causal mask from them; a model of one's own takes position_ids=None); "
        "every target still counts: docs/guides/pretraining.md, Document masking.",
    )

    def problems(self) -> list[Problem]:
        problems: list[Problem] = []
        if self.FLOPS_PER_TOKEN is not None and self.FLOPS_PER_SAMPLE is not None:
            problems.append(
                Problem(
                    ("FLOPS_PER_TOKEN", "FLOPS_PER_SAMPLE"),
                    "{0} and {1} are set together: MFU is counted from one of them, so keep "
                    "FLOPS_PER_TOKEN for tasks that count tokens and FLOPS_PER_SAMPLE otherwise",
                )
            )
        if self.MODEL_LOSS and self.NAME in ("hierarchical", "classification"):
            problems.append(
                Problem(
                    ("MODEL_LOSS", "NAME"), f"{{0}} is for causal_lm, and {{1}} is {self.NAME}: turn it off"
                )
            )
        if self.LOSS_CHUNK_TOKENS and (self.MODEL_LOSS or self.NAME in ("hierarchical", "classification")):
            other = "{1} is on (the model computes its own)" if self.MODEL_LOSS else f"{{1}} is {self.NAME}"
            problems.append(
                Problem(
                    ("LOSS_CHUNK_TOKENS", "MODEL_LOSS" if self.MODEL_LOSS else "NAME"),
                    "{0} chunks the loss causal_lm computes, and " + other + ": set {0} to 0",
                )
            )
        if self.DOCUMENT_MASKING and self.NAME in ("hierarchical", "classification"):
            problems.append(
                Problem(
                    ("DOCUMENT_MASKING", "NAME"),
                    "{0} masks attention between the documents of causal_lm's packed windows, and "
                    f"{{1}} is {self.NAME}, whose samples are not packed documents: turn {{0}} off",
                )
            )
        if self.MODEL_IGNORE_INDEX != -100 and not self.MODEL_LOSS:
            problems.append(
                Problem(
                    ("MODEL_IGNORE_INDEX", "MODEL_LOSS"),
                    "{0} is the value a model's own loss ignores, and {1} is off (the task computes the "
                    "loss, ignoring -100): set {1} to true, or leave {0} out",
                )
            )
        return problems


class GradNormConfig(Section):
    """GradNorm: per-component loss weights adjusted during training to balance gradient norms."""

    GRADNORM_ENABLED: bool = Field(
        False,
        description="Adjust the loss components' weights (starting from LOSS.TASK_WEIGHTS) with GradNorm at "
        "optimizer steps k >= GRADNORM_WARMUP_STEPS with k % UPDATE_INTERVAL == 0. Needs a task with at "
        "least 2 loss components; not under FSDP or DeepSpeed.",
    )
    GRADNORM_WARMUP_STEPS: NonNegativeInt = Field(0, description="No weight update before this global step.")
    UPDATE_INTERVAL: PositiveInt = Field(1, description="Update task weights every N global steps.")
    ALPHA: NonNegativeFloat = Field(1.5, description="GradNorm asymmetry.")


class GradWeightingConfig(Section):
    """Loss-weighting methods."""

    TASK: GradNormConfig = Field(default_factory=GradNormConfig)


class LossConfig(Section):
    """How the task's loss components (e.g. one per label level) are weighted."""

    TASK_WEIGHTS: list[NonNegativeFloat] | None = Field(
        None, description="Per-level loss weights; default equal."
    )
    GRAD_WEIGHTING: GradWeightingConfig = Field(default_factory=GradWeightingConfig)

    def problems(self) -> list[Problem]:
        weights = self.TASK_WEIGHTS
        if not weights:  # unset, or empty: the length is checked against the task's components
            return []
        if self.GRAD_WEIGHTING.TASK.GRADNORM_ENABLED and min(weights) <= 0:
            return [
                Problem(
                    ("TASK_WEIGHTS", "GRAD_WEIGHTING.TASK.GRADNORM_ENABLED"),
                    f"{{0}} ({weights}) has a weight of 0 while {{1}} is true: GradNorm rescales the "
                    "weights multiplicatively, so each must be > 0",
                )
            ]
        if sum(weights) <= 0:
            return [Problem(("TASK_WEIGHTS",), "{0} are all 0: nothing would be trained; give a weight > 0")]
        return []
