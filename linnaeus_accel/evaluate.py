"""``linnaeus-accel evaluate``: the configured validation passes on a checkpoint's weights or a
run's final weights, on any number of processes.

Everything but the weights comes from the config, through a ``Trainer`` built from it as ``train``
builds it: the same validation data, batches and sharding across processes, the same task, and the
trainer's own ``run_pass``. The passes are those of the final boundary (what the trainer runs at the
end of a run), so every checkpoint is measured with the same set.

The run directory is read, never changed, except for the result file (by default
``<run dir>/eval/<checkpoint name>.json``): a checkpoint is verified as resume verifies it, a LoRA
adapter's base (``MODEL.OPTIONS.pretrained``) is checked against the digest its checkpoint or
``final/`` records (``check_base``), the bucket is not contacted, no tracker is started, and the
run's lock is not taken (a run may go on training meanwhile).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import broadcast_object_list, find_tied_parameters, set_seed
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present

from . import json_files
from .checkpoint.directory import MARKER, MarkerError, read_marker
from .checkpoint.signing import agree_on_key
from .checkpoint.state.files import STATE_FILE, checkpoint_store, read_json
from .checkpoint.state.frozen_weights import STATE_KEY as FROZEN_KEY
from .checkpoint.state.frozen_weights import WRAPPER_PREFIXES, base_changed, base_source
from .config import Config, ConfigError
from .config.run import EnvConfig
from .models.lora import BASE_RECORD, recorded_base
from .training.end.final_weights import data_records
from .training.validation.passes import run_pass

KEY = "--checkpoint"
TAXONOMY = "taxonomy.json"  # a species run's class indices per rank (data/species)
FINAL_DIR = "final"
EVAL_DIR = "eval"
WEIGHTS = "model.safetensors"  # Accelerate's name for the first model's weights (save_state, save_model)
WEIGHTS_INDEX = "model.safetensors.index.json"  # final/ weights saved in shards
ADAPTER = "adapter_model.safetensors"  # a LoRA run's final/ (peft's layout)


@dataclass(frozen=True)
class Weights:
    """What ``--checkpoint`` names: a committed checkpoint or a run's ``final/`` directory."""

    path: Path
    committed: bool  # a checkpoint with COMMITTED.json (verified before use); else final/
    step: int | None  # its global step (final/: from the run's summary.json, when there is one)
    run_dir: Path

    @property
    def default_out(self) -> Path:
        return self.run_dir / EVAL_DIR / f"{self.path.name}.json"


def locate(path: str | Path) -> Weights:
    """Cheap checks (no file is read but small JSON), on every process; raises ``ConfigError``."""
    path = Path(path)
    if not path.is_dir():
        why = "does not exist" if not path.exists() else "is not a directory"
        raise _refused(f"{path} {why}")
    if (path / MARKER).exists():
        try:
            step = int(read_marker(path)["step"])
        except MarkerError as exc:
            raise _refused(f"{path} is damaged: {exc}") from None
        run_dir = path.parent.parent if path.parent.name == "checkpoints" else path.parent
        return Weights(path, True, step, run_dir)
    # final/, final/ema/ (the ema callback's average, in the same format), final/merged/, or any
    # directory save_pretrained wrote
    final = next((d for d in (path, path.parent) if d.name == FINAL_DIR), None)
    has_weights = any((path / name).is_file() for name in (WEIGHTS, WEIGHTS_INDEX, ADAPTER))
    if final is not None and not has_weights:
        raise _refused(f"{path} holds no {WEIGHTS}: the run did not finish writing its final weights")
    pretrained_layout = any((path / name).is_file() for name in ("config.json", "adapter_config.json"))
    if has_weights and (final is not None or pretrained_layout):
        run_dir = final.parent if final is not None else path.parent
        return Weights(path, False, _summary_step(run_dir) if final is not None else None, run_dir)
    raise _refused(
        f"{path} is not a committed checkpoint (no {MARKER}: its write did not finish, or it is not "
        f"a checkpoint) nor a directory of weights ({WEIGHTS} or {ADAPTER}): pass "
        f"<run dir>/checkpoints/step_XXXXXXXX with {MARKER}, <run dir>/{FINAL_DIR} or <run dir>/{FINAL_DIR}/ema"
    )


def verify(weights: Weights) -> str | None:
    """What makes ``weights`` unusable (None: nothing). A checkpoint: every file against its
    manifest (digests included) and our state, as resume verifies it. Reads everything: main process."""
    if not weights.committed:
        return None
    problem = checkpoint_store(weights.path.parent).verify(weights.path, deep=True)
    if problem is not None:
        return f"{weights.path} is damaged: {problem}"
    listed = {entry["path"] for entry in read_marker(weights.path)["files"]}
    if WEIGHTS not in listed:
        return (
            f"{weights.path} holds no {WEIGHTS} (a checkpoint written under FSDP or DeepSpeed keeps "
            f"the weights in their own format): evaluate the run's {FINAL_DIR}/ instead"
        )
    return None


def check_base(model: nn.Module, weights: Weights, source: str) -> str | None:
    """A LoRA model's frozen base (built from the config) against the digest of the base that
    ``weights`` were trained on: a checkpoint records it as resume checks it, a LoRA ``final/`` in
    ``BASE_RECORD``. An adapter on another base measures another model, so a different digest is
    refused; a ``final/`` written before the record existed gives the warning returned. ``source``:
    where the config's base comes from, for the messages (``frozen_weights.base_source``)."""
    lora = getattr(model, "linnaeus_lora", None)
    if lora is None:
        return None  # weights of the whole model: they do not depend on a base
    if weights.committed:
        state, _ = read_json(weights.path / STATE_FILE)  # verified: readable
        saved = state.get(FROZEN_KEY) if isinstance(state, dict) else None
        recorded = saved.get("digest") if isinstance(saved, dict) else None
        what = f"checkpoint {weights.path.name}"
    elif (weights.path / ADAPTER).is_file():
        try:
            recorded = recorded_base(weights.path)
        except ValueError as exc:
            raise _refused(f"{exc}: restore it, or delete it to evaluate unchecked") from None
        if recorded is None:
            return (
                f"{weights.path} has no {BASE_RECORD} (written before linnaeus-accel recorded the base): "
                f"its numbers are right only if {source} holds the base the adapter was trained on"
            )
        what = f"the adapter in {weights.path}"
    else:
        return None  # a whole model (final/merged): load_weights judges whether it fits
    if recorded is not None and recorded != lora.digest:
        raise base_changed(
            what,
            recorded,
            lora.digest,
            source,
            "Point MODEL.OPTIONS.pretrained at the base the run was trained on, or restore it",
        )
    return None


def load_weights(model: nn.Module, directory: Path) -> None:
    """Load ``model.safetensors`` (or the shards its index names) into ``model`` (unwrapped),
    whichever number of processes wrote it; every parameter and buffer must be there (tied ones
    are saved once)."""
    if (directory / ADAPTER).is_file():
        _load_adapter(model, directory)
        return
    index = directory / WEIGHTS_INDEX
    try:
        if index.is_file():
            shards = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
            state: dict[str, torch.Tensor] = {}
            for shard in shards:
                state.update(load_file(str(directory / shard)))
        else:
            state = load_file(str(directory / WEIGHTS))
    except (OSError, ValueError, KeyError, SafetensorError) as exc:
        raise _refused(f"cannot read the weights in {directory}: {type(exc).__name__}: {exc}") from None
    for prefix in WRAPPER_PREFIXES:
        consume_prefix_in_state_dict_if_present(state, prefix)
    own = model.state_dict()
    tied = {name for group in find_tied_parameters(model) if set(group) & state.keys() for name in group}
    # A LoRA run's checkpoint holds what trains; its frozen base is the config's (verified by digest).
    frozen = {n for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    frozen = frozen if getattr(model, "linnaeus_lora", None) is not None else set()
    unfit = [
        ("missing", [name for name in own if name not in state and name not in tied | frozen]),
        ("unexpected", [name for name in state if name not in own]),
        (
            "other shapes",
            [
                f"{name} {tuple(tensor.shape)} (the model's: {tuple(own[name].shape)})"
                for name, tensor in state.items()
                if name in own and tensor.shape != own[name].shape
            ],
        ),
    ]
    shown = [f"{what}: {', '.join(names[:3])}" for what, names in unfit if names]
    if shown:
        raise ConfigError(
            [
                (
                    "MODEL",
                    f"the weights in {directory} do not fit the model this config builds "
                    f"({'; '.join(shown)}): use the run's own config",
                )
            ]
        )
    model.load_state_dict(state, strict=False)  # strict but for the tied names saved once


def _load_adapter(model: nn.Module, directory: Path) -> None:
    """A LoRA adapter as peft wrote it, into the run's LoRA model (its base from the config)."""
    if getattr(model, "linnaeus_lora", None) is None:
        raise ConfigError(
            [
                (
                    "MODEL.OPTIONS.lora",
                    f"{directory} holds a LoRA adapter ({ADAPTER}) but this config builds no LoRA model: use the run's own config",
                )
            ]
        )
    from peft import set_peft_model_state_dict

    try:
        adapter = load_file(str(directory / ADAPTER))
    except (OSError, SafetensorError) as exc:
        raise _refused(f"cannot read the adapter in {directory}: {type(exc).__name__}: {exc}") from None
    result = set_peft_model_state_dict(model, adapter)
    unexpected = list(getattr(result, "unexpected_keys", []))
    if unexpected:
        raise ConfigError(
            [
                (
                    "MODEL.OPTIONS.lora",
                    f"the adapter in {directory} does not fit this config's LoRA model (unexpected: {', '.join(unexpected[:3])}): use the run's own config",
                )
            ]
        )


def evaluate(config: Config, checkpoint: str | Path, out: str | Path | None = None) -> dict[str, Any]:
    """Run the final boundary's validation passes on the weights at ``checkpoint``; every process
    takes part. Returns the result (also written to ``out``, by the main process) and prints one
    line per pass on the main process. Raises ``ConfigError`` for anything refused."""
    from .data import build_dataset, dataset_problems
    from .models import build_model
    from .training.trainer import Trainer

    weights = locate(checkpoint)
    target = Path(out) if out is not None else weights.default_out
    train_data, val_data = build_dataset(config, "train"), build_dataset(config, "val")
    problems = dataset_problems(config.SCHEDULE, train_data)
    if problems:
        raise ConfigError(problems)
    if (problem := records_problem(weights, data_records(train_data))) is not None:
        raise _refused(problem)
    set_seed(config.EXPERIMENT.SEED)
    offline = config.model_copy(update={"ENV": _without_bucket(config.ENV)})
    trainer = Trainer(offline, build_model(config, train_data), train_data, val_data)
    acc = trainer.accelerator
    agree_on_key()  # its signature is checked below: a key empty or set on one process only is refused
    if trainer.val_batches is None:
        raise ConfigError([("DATA", "the configured dataset has no validation split to evaluate on")])
    final = trainer.ops.final_point()
    passes = trainer.task.validation_passes(trainer.ops.at(final), final.epoch, True)
    if not passes:
        raise ConfigError(
            [("SCHEDULE.VALIDATION", "no validation pass is configured: set an INTERVAL_* to validate")]
        )
    problem = verify(weights) if acc.is_main_process else None
    problem = broadcast_object_list([problem], from_process=0)[0]
    if problem is not None:
        raise _refused(problem)
    warning = check_base(
        acc.unwrap_model(trainer.model), weights, base_source(config.MODEL, config.EXPERIMENT.SEED)
    )
    if warning is not None and acc.is_main_process:
        print(f"warning: {warning}", file=sys.stderr)
    load_weights(acc.unwrap_model(trainer.model), weights.path)
    by_pass = {
        vpass.prefix: run_pass(acc, trainer.model, trainer.val_batches, trainer.task, vpass)
        for vpass in passes
    }
    result = {
        "checkpoint": str(weights.path.resolve()),
        "global_step": weights.step,
        "num_processes": acc.num_processes,
        "metrics": {k: v for metrics in by_pass.values() for k, v in metrics.items()},
        "passes": by_pass,
    }
    if acc.is_main_process:
        step = f"step {weights.step}" if weights.step is not None else "final weights"
        print(f"evaluating {weights.path} ({step}) on {acc.num_processes} process(es)")
        for prefix, metrics in by_pass.items():
            print(f"{prefix}: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
        json_files.write_json(target, result)
        print(f"wrote {target}")
    acc.wait_for_everyone()
    acc.end_training()
    return result


def records_problem(weights: Weights, records: dict[str, dict[str, Any]]) -> str | None:
    """Why the data's records (a species dataset's ``taxonomy.json``) contradict those the weights
    were trained with, kept beside them in ``final/`` or in the run's ``assets/``: class indices
    that mean other taxa make every metric wrong. None when they agree or none was kept."""
    for name in sorted(records):
        if name != TAXONOMY:
            continue  # the preprocessing may change on purpose (another crop to compare)
        kept = next(
            (p for p in (weights.path / name, weights.run_dir / "assets" / name) if p.is_file()), None
        )
        if kept is None:
            continue
        trained = json.loads(kept.read_text(encoding="utf-8"))
        for then, now in zip(trained.get("ranks", []), records[name].get("ranks", []), strict=False):
            if then.get("ids") != now.get("ids"):
                gone = sorted(set(then.get("ids", [])) - set(now.get("ids", [])))[:3]
                new = sorted(set(now.get("ids", [])) - set(then.get("ids", [])))[:3]
                return (
                    f"{weights.path} was trained with another taxonomy ({kept}): at {then.get('name')} it "
                    f"has taxa this config's labels lack ({', '.join(map(str, gone)) or 'none'}) or lacks taxa "
                    f"they have ({', '.join(map(str, new)) or 'none'}), so its class indices mean other taxa; "
                    "evaluate with the labels the run trained on"
                )
    return None


def _refused(message: str) -> ConfigError:
    return ConfigError([(KEY, message)], source="arguments")


def _without_bucket(env: EnvConfig) -> EnvConfig:
    """ENV with ENV.OUTPUT.BUCKET off: evaluating reads local weights and uploads nothing."""
    output = env.OUTPUT
    bucket = output.BUCKET.model_copy(update={"ENABLED": False})
    return env.model_copy(update={"OUTPUT": output.model_copy(update={"BUCKET": bucket})})


def _summary_step(run_dir: Path) -> int | None:
    """The final step from the run's summary.json, read only (a corrupt one is not moved aside here)."""
    try:
        step = json.loads((run_dir / "summary.json").read_bytes())["global_step"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return step if type(step) is int else None
