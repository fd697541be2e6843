"""The package reads bottom-up (DESIGN's layers): a module imports only its own layer and those
below it, and the lower layers never import torch or Accelerate. Read from the source with ``ast``,
every import counted (also those inside functions and under ``TYPE_CHECKING``): a lazy import
upwards is still a dependency upwards.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "linnaeus_accel"

# Layer of each top-level module or package of linnaeus_accel. Inside layer 5 the run directory's
# life sits below the checkpoint and resume machinery, which sits below the loop that drives both.
LAYERS: dict[str, float] = {
    "checkpoint": 0,
    "json_files": 0,
    "durable_files": 0,
    "config": 1,
    "registry": 1,
    "progress": 2,
    "schedule": 2,
    "data": 3,
    "models": 3,
    "optim": 3,  # beside models: the optimizer built for them (a registry, the parameter groups)
    "distributed": 3,
    "tasks": 4,
    "process": 4.5,  # the process's life: signals, the launcher, failures, fault points
    "run_directory": 5.0,
    "state": 5.05,  # the run's state as data
    "save": 5.1,  # writing it into checkpoints
    "resume": 5.1,  # reading it back
    "training": 5.2,
    "callbacks": 5.2,  # the loop asks them; they are handed the trainer
    "evaluate": 6,
    "cli": 6,
    "__main__": 6,
    "__init__": 6,
}
NO_TORCH = {"checkpoint", "config", "registry", "progress", "schedule"}


def top_of(module: str) -> str:
    """``linnaeus_accel.save.writer`` -> ``save``."""
    return module.split(".")[1] if module.count(".") else "__init__"


def imports(path: Path, root: Path) -> list[str]:
    """Every module ``path`` (in the package at ``root``) imports, absolute (relative imports resolved)."""
    package = list(path.relative_to(root.parent).parts[:-1])
    found: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                found.append(node.module or "")
                continue
            base = package[: len(package) - (node.level - 1)]
            target = ".".join([*base, *([node.module] if node.module else [])])
            if node.module is None:  # from . import x: x may be a module of that package
                found += [f"{target}.{alias.name}" for alias in node.names]
            else:
                found.append(target)
    return found


def sources() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_every_module_has_a_layer() -> None:
    tops = {path.relative_to(PACKAGE).parts[0].removesuffix(".py") for path in sources()}
    assert tops <= set(LAYERS), f"give these a layer in LAYERS and DESIGN: {sorted(tops - set(LAYERS))}"


def upward_imports(path: Path, root: Path = PACKAGE) -> list[str]:
    own = path.relative_to(root).parts[0].removesuffix(".py")
    upward = []
    for target in imports(path, root):
        if target.startswith("linnaeus_accel"):
            top = top_of(target) if target != "linnaeus_accel" else "__init__"
            if top in LAYERS and LAYERS[top] > LAYERS[own]:
                upward.append(f"{target} (layer {LAYERS[top]} > {LAYERS[own]})")
        elif own in NO_TORCH and target.split(".")[0] in ("torch", "accelerate"):
            upward.append(f"{target} (layer {LAYERS[own]} never imports torch or accelerate)")
    return upward


@pytest.mark.parametrize("path", sources(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_only_its_layer_and_below(path: Path) -> None:
    upward = upward_imports(path)
    assert not upward, f"{path.relative_to(PACKAGE)} imports above its layer: {upward}"


def test_a_module_importing_upwards_is_caught(tmp_path: Path) -> None:
    """The check itself: a schedule module importing the trainer (relative, inside a function)
    and torch is caught; importing config and its own package is not."""
    root = tmp_path / "linnaeus_accel"
    (root / "schedule").mkdir(parents=True)
    probe = root / "schedule" / "probe.py"
    probe.write_text(
        "from ..config import Config\nfrom . import events\n"
        "def f():\n    from ..training.trainer import Trainer\n    import torch\n"
    )
    assert upward_imports(probe, root) == [
        "linnaeus_accel.training.trainer (layer 5.2 > 2)",
        "torch (layer 2 never imports torch or accelerate)",
    ]
