"""A finished run's directory given another config or another model: refused in one sentence, not
"nothing to do". A sweep through ``--opts`` or a notebook cell rerun with a new learning rate would
otherwise get the old run's summary back, looking fresh.

What the finished run trained with is its resolved config (``assets/config.yaml``, written at every
start) and, for the model, the weights' shapes in ``final/model.safetensors``. Keys that change only
where a run writes, how it waits or reports (``ENV``, trackers, ``TRAIN.AUTO_RESUME``, workers) may
differ: a rerun on another machine still has nothing to do. The run's length is judged before this
(a longer one trains on, a shorter one is refused).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from torch import nn

from .config_changes import differing_keys

# Keys (or prefixes ending in ".") a rerun of a finished run may change: none of them changes what
# the run trains. The length keys are judged before (``run_directory.outputs.claim_output_dir``).
OPERATIONAL = (
    "ENV.",
    "TRAIN.AUTO_RESUME",
    "TRAIN.EPOCHS",
    "TRAIN.STEPS",
    "TRAIN.TARGET_TOKENS",
    "EXPERIMENT.NAME",
    "EXPERIMENT.WANDB.",
    "EXPERIMENT.TRACKERS",
    "EXPERIMENT.TAGS",
    "EXPERIMENT.NOTES",
    "DATA.NUM_WORKERS",
    "TASK.FLOPS_PER_TOKEN",
    "TASK.FLOPS_PER_SAMPLE",
)
_SHOWN = 5  # differing keys quoted with their values


def _operational(key: str) -> bool:
    return any(key == p or (p.endswith(".") and key.startswith(p)) for p in OPERATIONAL)


def changed_keys(out: Path, run_config: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    """key -> (the finished run's value, this config's) for each key that would train another run.
    ``run_config``: this run's config as JSON data (``Config.model_dump(mode="json")``)."""
    try:
        saved = yaml.safe_load((out / "assets" / "config.yaml").read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        return {}  # a run from before configs were kept, or an unreadable one: not judged
    if not isinstance(saved, dict):
        return {}
    changed = differing_keys(saved, run_config)
    return {key: values for key, values in changed.items() if not _operational(key)}


def _shapes(model: nn.Module) -> set[tuple[int, ...]]:
    return {tuple(t.shape) for t in model.state_dict().values() if hasattr(t, "shape")}


def model_difference(out: Path, model: nn.Module) -> str | None:
    """How ``model``'s weights differ in shape from the finished run's ``final/`` (None: the same,
    or nothing to compare with: sharded or missing weights)."""
    path = out / "final" / "model.safetensors"
    if not path.is_file():
        return None
    try:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as weights:
            saved = {tuple(weights.get_slice(name).get_shape()) for name in weights.keys()}  # noqa: SIM118
    except Exception:  # not ours to judge: a file another tool wrote
        return None
    # As sets: a model's tied weights (an LM head sharing its embedding) are saved once.
    given = _shapes(model)
    if saved == given:
        return None
    shown = ", ".join(str(list(shape)) for shape in sorted(given - saved)[:3])
    return f"the model given has weights of shapes the finished run's final/ does not ({shown})"


def finished_problem(
    out: Path, run_config: Mapping[str, Any], finished: dict[str, Any], model: nn.Module
) -> tuple[str, str] | None:
    """Main process, a finished run in ``out`` (the run directory): the refusal (key, sentence) when
    this config (``run_config``: as JSON data, ``Config.model_dump(mode="json")``) or model would
    train another run, else None ("nothing to do" follows)."""
    changed = changed_keys(out, run_config)
    differences = [f"{key}: {old!r} -> {new!r}" for key, (old, new) in list(changed.items())[:_SHOWN]]
    if len(changed) > _SHOWN:
        differences.append(f"and {len(changed) - _SHOWN} more")
    if (shapes := model_difference(out, model)) is not None:
        differences.append(shapes)
    if not differences:
        return None
    status = str(finished.get("status", "finished")).replace("_", " ")
    key = ", ".join(changed) if changed else "model"
    return (
        key,
        f"differs from the run {status} at step {finished.get('global_step')} in {out} "
        f"({'; '.join(differences)}), so rerunning it would train nothing: pass --overwrite (overwrite=True) "
        "to train it again from scratch with these settings, choose another EXPERIMENT.NAME to keep both "
        "runs, or, to train this run on, ask for more steps (TRAIN.EPOCHS, TRAIN.STEPS or "
        "TRAIN.TARGET_TOKENS) with --allow-config-change",
    )
