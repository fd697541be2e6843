"""The package reads bottom-up (docs/design.md §1): a module imports only its own layer and those
below it, and the lower layers never import torch or Accelerate. Read from the source with ``ast``,
every import counted (also those inside functions and under ``TYPE_CHECKING``): a lazy import
upwards is still a dependency upwards.
"""

from __future__ import annotations

import ast
import fnmatch
import itertools
from pathlib import Path

import networkx as nx  # type: ignore[import-untyped]  # a torch dependency
import pytest
from helpers.configs import REPO

PACKAGE = REPO / "linnaeus_accel"

# Layer of each top-level module or package of linnaeus_accel. Inside layer 5 the run directory's
# life sits below the checkpoint room, which sits below the loop that drives both.
LAYERS: dict[str, float] = {
    "json_files": 0,
    "durable_files": 0,
    "digests": 0,  # file digests: a checkpoint's manifest, a pretrained model's weights
    "object_store": 0,  # s3://, gs://, b2://, file:// behind one interface
    "state_fields": 0,  # the field types of every part's saved state
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
    "checkpoint": 5.1,  # everything of a checkpoint: its directory, state, save, resume, bucket
    "training": 5.2,
    "callbacks": 5.2,  # the loop asks them; they are handed the trainer
    "evaluate": 6,
    "cli": 6,
    "cli_arguments": 6,  # --opts taken out of a command line before argparse reads it
    "cli_reference": 6,  # docs/reference/cli.md, from cli's parser
    "config_reference": 6,  # docs/config.md, from the config's models
    "__main__": 6,
    "__init__": 6,
}
NO_TORCH = {"digests", "object_store", "state_fields", "config", "registry", "progress", "schedule"}


def top_of(module: str) -> str:
    """``linnaeus_accel.checkpoint.save.writer`` -> ``checkpoint``."""
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
    assert tops <= set(LAYERS), (
        f"give these a layer in LAYERS and docs/design.md: {sorted(tops - set(LAYERS))}"
    )


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


# -- import circles ------------------------------------------------------------------------------

# The import circles the package still has, each as its two sides (module name patterns): a circle
# is expected when each of its modules is on one of the two sides and both sides are in it. Any
# other circle fails test_no_import_circles.
KNOWN_CIRCLES: list[tuple[str, str]] = []  # none: a circle that comes back fails the test above


def module_name(path: Path, root: Path) -> str:
    """``<root>/checkpoint/save/writer.py`` -> ``linnaeus_accel.checkpoint.save.writer``; a package is its ``__init__``."""
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path = PACKAGE) -> nx.DiGraph:
    """Each module of the package -> the package's modules it imports (every import, as ``imports``)."""
    paths = {module_name(path, root): path for path in sorted(root.rglob("*.py"))}
    graph = nx.DiGraph()
    graph.add_nodes_from(paths)
    for name, path in paths.items():
        for target in imports(path, root):
            while target and target not in paths:  # a name imported from a module: that module
                target = target.rpartition(".")[0]
            if target and target != name:
                graph.add_edge(name, target)
    return graph


def circles(graph: nx.DiGraph) -> list[list[str]]:
    """Every import circle: each largest group of modules that reach each other by imports."""
    return sorted(sorted(group) for group in nx.strongly_connected_components(graph) if len(group) > 1)


def is_known(circle: list[str], known: list[tuple[str, str]]) -> bool:
    for sides in known:
        side = {m: next((i for i, p in enumerate(sides) if fnmatch.fnmatchcase(m, p)), None) for m in circle}
        if set(side.values()) == {0, 1}:
            return True
    return False


def describe(circle: list[str], graph: nx.DiGraph, most: int = 10) -> str:
    """The circle's modules and its circular paths, shortest first."""
    cycles = itertools.islice(nx.simple_cycles(graph.subgraph(circle)), 1000)
    from_first = [cycle[cycle.index(min(cycle)) :] + cycle[: cycle.index(min(cycle))] for cycle in cycles]
    paths = sorted(from_first, key=lambda path: (len(path), path))
    shown = [" -> ".join([*path, path[0]]) for path in paths[:most]]
    more = [f"... and {len(paths) - most} more"] if len(paths) > most else []
    return "\n".join([", ".join(circle) + ":", *(f"  {line}" for line in [*shown, *more])])


def test_no_import_circles() -> None:
    graph = import_graph()
    new = [describe(circle, graph) for circle in circles(graph) if not is_known(circle, KNOWN_CIRCLES)]
    heading = "import circles (open each by moving a type or function where it belongs):"
    assert not new, "\n".join([heading, *new])


def test_every_known_circle_is_still_there() -> None:
    """KNOWN_CIRCLES lists only circles that still exist: one that is gone must not come back."""
    found = circles(import_graph())
    gone = [sides for sides in KNOWN_CIRCLES if not any(is_known(circle, [sides]) for circle in found)]
    assert not gone, f"these circles are gone: remove them from KNOWN_CIRCLES: {gone}"


def test_a_circle_is_caught_and_listed(tmp_path: Path) -> None:
    """The check itself: imports under TYPE_CHECKING and inside functions close circles too; a
    known circle's sides exempt only circles between those two sides."""
    root = tmp_path / "linnaeus_accel"
    (root / "training").mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "callbacks.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .training.trainer import Trainer\n"
    )
    (root / "training" / "__init__.py").write_text("")
    (root / "training" / "trainer.py").write_text("from ..callbacks import Callback\n")
    (root / "training" / "step.py").write_text("def f():\n    from . import loop\n")
    (root / "training" / "loop.py").write_text("from .step import f\n")
    (root / "data.py").write_text("from . import callbacks\n")  # into a circle, not in one
    graph = import_graph(root)
    found = circles(graph)
    assert found == [
        ["linnaeus_accel.callbacks", "linnaeus_accel.training.trainer"],
        ["linnaeus_accel.training.loop", "linnaeus_accel.training.step"],
    ]
    assert describe(found[1], graph) == (
        "linnaeus_accel.training.loop, linnaeus_accel.training.step:\n"
        "  linnaeus_accel.training.loop -> linnaeus_accel.training.step -> linnaeus_accel.training.loop"
    )
    sides = [("linnaeus_accel.callbacks", "linnaeus_accel.training.*")]
    assert [is_known(circle, sides) for circle in found] == [True, False]  # the second: one side only


# -- where the rank is asked -----------------------------------------------------------------------

# The modules that ask which process they run on (docs/design.md, "Processes"). Everything else
# writes through ``run_outputs`` (a silent stand-in on the other processes) or asks one of these.
RANK_AWARE = {
    "callbacks/__init__.py": "the docs of ``run.is_main_process`` for callbacks",
    "callbacks/context.py": "``RunContext.is_main_process``, for callbacks",
    "callbacks/lm_samples.py": "a callback printing its samples once",
    "checkpoint/bucket/from_bucket.py": "one process per machine fetches the bucket's checkpoint",
    "checkpoint/manager.py": "the main process chooses and verifies a checkpoint, then broadcasts it",
    "checkpoint/resume/reader.py": "the main process verifies, every process loads",
    "checkpoint/save/failures.py": "a failed write: the main process removes it, all agree",
    "checkpoint/save/writer.py": "every process stages, the main process commits and uploads",
    "distributed.py": "linnaeus' rank-aware helpers",
    "evaluate.py": "the main process verifies the weights and writes the results",
    "process/preemption.py": "one line per machine when Ctrl-C asks for a clean stop",
    "run_directory/outputs.py": "``run_outputs``: the real outputs on the main process, a stand-in elsewhere",
    "run_directory/shared_storage.py": "whether every machine sees the run directory",
    "training/build.py": "the callbacks told of commits on the main process (it commits)",
    "training/end/final_weights.py": "the main process writes final/",
    "training/end/run_end.py": "the main process writes the summary and uploads what the bucket lacks",
    "training/trainer.py": "the main process claims the run directory, every process hears the answer",
}


def test_the_rank_is_asked_only_where_listed() -> None:
    asking = {
        str(path.relative_to(PACKAGE))
        for path in sources()
        if "is_main_process" in (text := path.read_text(encoding="utf-8")) or "is_local_main_process" in text
    }
    assert asking - set(RANK_AWARE) == set(), (
        "a new module asks for the rank: use run_outputs, or list it here"
    )
    assert set(RANK_AWARE) - asking == set(), "these no longer ask for the rank: remove them from RANK_AWARE"


# -- what a component is handed ------------------------------------------------------------------

# The functions handed the whole ``Config`` (docs/design.md, rule 3): where a run is built, and the
# documented extension points (a registered builder or a task's hook may read any section). Every
# other part takes the sections it reads.
WHOLE_CONFIG = {
    # where a run, a plan or an evaluation is built
    "training/trainer.py:__init__",
    "training/build.py:build_run",
    "schedule/plan.py:resolve_plan",
    "schedule/report/settings.py:report_settings",
    "evaluate.py:evaluate",
    "cli.py:plan_for",
    "cli.py:muon_split_lines",  # builds the dataset and the model to show the split
    # the public dispatchers and the registered builders
    "data/registry.py:build_dataset",
    "models/registry.py:build_model",
    "optim/registry.py:build_from_config",
    "data/digits.py:build_digits",
    "data/digits.py:build_digits_images",
    "data/hf/dataset.py:build_hf_dataset",
    "data/mixtures/mixture.py:build_mixture",
    "data/text.py:build_python_docs",
    "data/tokens/files.py:build_token_files",
    "data/species/build.py:build_linnaeus_h5",
    "data/species/build.py:build_image_table",
    "models/digits.py:build_digits_mlp",
    "models/digits.py:build_digits_convnet",
    "models/hf.py:build_hf_causal_lm",
    "models/hf.py:build_hf_sequence_classification",
    "models/vision.py:build_hf_vision",
    "optim/builtin.py:adamw",
    "optim/builtin.py:sgd",
    "optim/muon.py:muon",
    # a task's hook
    "tasks/base.py:config_problems",
    "tasks/causal_lm.py:config_problems",
    "tasks/classification.py:config_problems",
    "tasks/hierarchical.py:config_problems",
}


def _functions(path: Path) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def test_the_whole_config_only_where_a_run_is_built_or_extended() -> None:
    handed = set()
    for path in sources():
        for function in _functions(path):
            arguments = function.args
            for argument in [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs]:
                written = ast.unparse(argument.annotation).strip("'\"") if argument.annotation else ""
                if written in ("Config", "Config | None"):
                    handed.add(f"{path.relative_to(PACKAGE)}:{function.name}")
    assert handed - WHOLE_CONFIG == set(), "hand these the sections they read, not the whole Config"
    assert WHOLE_CONFIG - handed == set(), (
        "these no longer take the whole Config: remove them from WHOLE_CONFIG"
    )


def test_each_counter_has_one_writer() -> None:
    """``global_step``, ``samples_seen`` and ``tokens_seen`` are written in ``progress.py`` only."""
    counters = {"global_step", "samples_seen", "tokens_seen"}
    writers = set()
    for path in sources():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
                for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    if isinstance(target, ast.Attribute) and target.attr in counters:
                        writers.add(f"{path.relative_to(PACKAGE)}:{target.attr}")
    assert writers <= {f"progress.py:{name}" for name in counters}, writers
