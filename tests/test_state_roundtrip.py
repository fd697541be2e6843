"""What a callback or a registered part saves comes back exactly as it was: ``tensor_state.split``
and ``join`` are one tested pair (one row per kind of value that JSON cannot hold as is), and a
checkpoint without any tensor is decoded like one with them (a callback keeping ``best = inf``
once got ``{"__float__": "inf"}`` back when no part of the run held a tensor).
"""

from __future__ import annotations

import collections
import enum
import json
import re
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
import torch
from helpers.configs import DEFAULT_CONFIG
from helpers.in_process import reset_accelerate, run_cli
from helpers.runs import assert_resumed_from, committed

from linnaeus_accel import Callback, register_callback
from linnaeus_accel.checkpoint.state import tensor_state


def exact(value: Any) -> Any:
    """``value`` with every type spelled out, as JSON: equal only for the same types and values
    (NaN equal to NaN; 1, 1.0 and True, or a tuple and a list, not equal)."""
    if isinstance(value, torch.Tensor):
        return ["tensor", str(value.dtype), value.tolist()]
    if isinstance(value, np.ndarray):
        return ["ndarray", str(value.dtype), value.tolist()]
    if isinstance(value, dict):
        return [type(value).__name__, [[exact(k), exact(v)] for k, v in value.items()]]
    if isinstance(value, (list, tuple)):
        return [type(value).__name__, [exact(v) for v in value]]
    return [type(value).__name__, repr(value)]


def round_trip(value: Any) -> Any:
    """``value`` saved and read back as a checkpoint does: JSON without NaN tokens, and the tensors
    (none: no tensors file, as in a run without an EMA)."""
    data, tensors = tensor_state.split({"part": value})
    text = json.dumps(data, allow_nan=False)
    return tensor_state.join(json.loads(text), tensors or None)["part"]


ROWS = [
    # (id, value): why it is a row
    ("nan", float("nan")),  # JSON has no NaN: a marker, which must never reach the part
    ("inf", float("inf")),  # a callback's `best = inf` before its first value
    ("-inf", float("-inf")),  # ... or `-inf` when higher is better
    ("minus-zero", -0.0),  # finite, but its sign is the kind of detail a text format loses
    ("tuple", (1, 2)),  # JSON has only lists: a tuple must not come back a list
    ("empty-tuple", ()),  # no items to tell it by
    ("nested-tuple", ((1, "a"), [2, (3,)], {"k": (None,)})),  # tuples in tuples, lists and dicts
    ("int-keys", {1: "a", 2: "b"}),  # JSON keys are strings: {1: ...} must not come back {"1": ...}
    ("mixed-keys", {1: "int", "1": "str", 2.5: "float", None: "none"}),  # one JSON key "1" for two keys
    ("bool-keys", {True: "yes", False: "no"}),  # not 1 and 0
    ("non-finite-key", {float("inf"): "x"}),  # a key that needs the float marker itself
    ("numpy-scalar-key", {np.int64(3): "x"}),  # what iterating a numpy array gives
    ("marker-float", {"__float__": "nan"}),  # the user's own dict that reads as our marker: escaped
    ("marker-tuple", {"__tuple__": [1, 2]}),
    ("marker-items", {"__items__": [[1, "a"]]}),
    ("marker-tensor", {"__tensor__": "x"}),  # no tensors file: must not be looked up in one
    ("marker-scalar", {"__numpy_scalar__": ["<f4", 1.0]}),
    ("marker-among-keys", {"__float__": "nan", "other": 1}),  # two keys: never read as a marker
    ("bool-int-float", [True, 1, 1.0]),  # three values equal in Python, three kinds in JSON
    ("big-int", 2**100 + 1),  # a PCG64 generator's state holds 128-bit integers
    ("np-float32", np.float32(0.1)),  # its dtype kept: not widened to a float64
    ("np-float64", np.float64(0.1)),  # a float subclass: still a numpy scalar
    ("np-float16-nan", np.float16("nan")),  # a numpy NaN: both markers
    ("np-int64", np.int64(-7)),
    ("np-uint64-max", np.uint64(2**64 - 1)),
    ("np-bool", np.bool_(True)),
    ("np-str", np.str_("text")),  # a str subclass: still a numpy scalar
    ("tensor-in-tuple", (torch.arange(3.0), "step")),  # the tensors file and the markers together
    ("numpy-array", np.arange(4, dtype=np.int16)),
]


@pytest.mark.parametrize("value", [value for _, value in ROWS], ids=[name for name, _ in ROWS])
def test_each_kind_of_value_comes_back_as_it_was_saved(value: Any) -> None:
    assert exact(round_trip(value)) == exact(value)


class Stage(enum.IntEnum):
    TRAIN = 1


Pair = collections.namedtuple("Pair", "a b")


@pytest.mark.parametrize(
    ("value", "back"),
    [
        # A subclass comes back as what it subclasses, equal to what was saved:
        (collections.OrderedDict(a=1), {"a": 1}),  # what module.state_dict() returns
        (Stage.TRAIN, 1),
        (Pair(1, 2), (1, 2)),
        (torch.Size([2, 3]), (2, 3)),  # a tensor's shape
    ],
    ids=["ordered-dict", "int-enum", "namedtuple", "torch-size"],
)
def test_a_subclass_comes_back_as_what_it_subclasses(value: Any, back: Any) -> None:
    got = round_trip(value)
    assert exact(got) == exact(back)
    assert got == value


cyclic: list[Any] = []
cyclic.append(cyclic)


@pytest.mark.parametrize(
    ("value", "said"),
    [
        # Refused before the first step (Trainer._check_state_is_data), each saying where and why:
        (b"\x00", r"callbacks\.mine\.x is a builtins\.bytes: .* np\.frombuffer"),  # no bytes in JSON
        (bytearray(b"\x00"), r"callbacks\.mine\.x is a builtins\.bytearray"),
        ({1, 2}, r"callbacks\.mine\.x is a builtins\.set"),  # no order to save it in
        (1j, r"callbacks\.mine\.x is a builtins\.complex"),
        (np.complex64(1j), r"callbacks\.mine\.x is a numpy complex64 scalar"),
        (np.datetime64("2020-01-01"), r"callbacks\.mine\.x is a numpy datetime64\[D\] scalar"),
        ({(1, 2): "a"}, r"callbacks\.mine\.x has a key of type tuple"),
        (torch.nn.Linear(1, 1), r"callbacks\.mine\.x is a torch\.nn\.modules\.linear\.Linear"),
        (cyclic, r"recursion"),  # a state that holds itself: refused, not a crash
    ],
    ids=[
        "bytes",
        "bytearray",
        "set",
        "complex",
        "np-complex",
        "np-datetime",
        "tuple-key",
        "module",
        "cyclic",
    ],
)
def test_what_a_checkpoint_cannot_hold_is_refused_naming_where(value: Any, said: str) -> None:
    problem = tensor_state.unsavable({"callbacks": {"mine": {"x": value}}})
    assert problem is not None
    name, why = problem
    assert name == "callbacks"
    assert re.search(said, why), why


def test_join_refuses_what_split_cannot_have_written() -> None:
    """A damaged trainer_state.json: an error the resume reports as the checkpoint's, not a part
    loaded with a wrong value."""
    with pytest.raises(ValueError, match="not one split writes"):
        tensor_state.join({"__numpy_scalar__": ["|O", 1]})
    with pytest.raises(KeyError):
        tensor_state.join({"__tensor__": "missing"})


# -- through a checkpoint: a run that crashed, resumed ---------------------------------------------
KEPT = {
    "best": float("inf"),
    "worst": float("-inf"),
    "last": float("nan"),
    "pair": (1, 2),
    "nested": ((1, "a"), [2, (3,)]),
    "by_step": {1: "a", 6: "b"},
    "mixed": {1: "int", "1": "str"},
    "looks_like_ours": {"__float__": "nan"},
    "scale": np.float32(0.1),
}
ROUNDTRIP_OUT = "roundtrip_state.json"


class _Kept:
    """A part registered with ``register_state``: KEPT, and a tensor if asked for."""

    def __init__(self, tensor: bool) -> None:
        self.state = {**KEPT, "weights": torch.arange(3.0)} if tensor else dict(KEPT)
        self.got: Any = None

    def state_dict(self) -> dict[str, Any]:
        return self.state

    def load_state_dict(self, state: Any) -> None:
        self.got = state


@register_callback("test_roundtrip_state")
class RoundtripState(Callback):
    """Keeps KEPT as its own state and in a registered part; at the end of the run writes what
    each got back on resume (``exact``) to ``roundtrip_state.json``."""

    fail_at: ClassVar[int | None] = None  # a step whose end raises: the run fails there, as a crash

    def __init__(self, tensor: bool = False) -> None:
        self.part = _Kept(tensor)
        self.got: Any = None

    def on_setup(self, trainer: Any) -> None:
        trainer.register_state("kept", self.part)

    def on_step_end(self, trainer: Any, step: int) -> None:
        if step == self.fail_at:
            raise RuntimeError(f"crashed at step {step}")

    def state_dict(self) -> dict[str, Any]:
        return dict(KEPT)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.got = state

    def on_fit_end(self, trainer: Any, summary: dict[str, Any]) -> None:
        if trainer.is_main_process:
            got = {"callback": exact(self.got), "registered": exact(self.part.got)}
            (trainer.config.output_dir / ROUNDTRIP_OUT).write_text(json.dumps(got))


# 6 steps an epoch, a checkpoint at the end of each.
OPTS = ["TRAIN.EPOCHS", "2", "DATA.BATCH_SIZE", "256", "SCHEDULE.CHECKPOINT.INTERVAL_EPOCHS", "1"]


def train(*args: str) -> tuple[int, str]:
    """``linnaeus-accel train`` in this process: its exit status and console."""
    reset_accelerate()
    try:
        rc, out, err = run_cli("train", "--cfg", str(DEFAULT_CONFIG), *args)
    finally:
        reset_accelerate()
    return rc, out + err


@pytest.mark.parametrize("tensor", [False, True], ids=["no-tensors", "with-a-tensor"])
def test_a_callbacks_state_comes_back_as_it_was_after_a_crash_and_resume(
    tmp_path: Path, tensor: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NaN, infinities, tuples, int keys, a dict that reads as a marker and a numpy float32, in a
    callback's state and in a registered part: equal and of the same types after the run crashed
    (in this process: a third of the cost of a killed subprocess, the checkpoint read from disk
    all the same) and resumed, whether the checkpoint holds a tensors file or not."""
    callbacks = f"[{{NAME: test_roundtrip_state, OPTIONS: {{tensor: {str(tensor).lower()}}}}}]"
    opts = ["--opts", "ENV.OUTPUT.BASE_DIR", str(tmp_path), "EXPERIMENT.NAME", "run", *OPTS]
    opts += ["CALLBACKS", callbacks]
    run = tmp_path / "run"
    monkeypatch.setattr(RoundtripState, "fail_at", 9)  # after the checkpoint of step 6
    with pytest.raises(RuntimeError, match="crashed at step 9"):
        train(*opts)
    assert committed(run) == ["step_00000006"]
    assert (run / "checkpoints" / "step_00000006" / "trainer_state.safetensors").is_file() == tensor
    monkeypatch.setattr(RoundtripState, "fail_at", None)
    rc, out = train(*opts)
    assert rc == 0, out
    assert_resumed_from(out, 6)
    got = json.loads((run / ROUNDTRIP_OUT).read_text())
    want = json.loads(json.dumps(exact(KEPT)))
    assert got["callback"] == want
    registered = {**KEPT, "weights": torch.arange(3.0)} if tensor else KEPT
    assert got["registered"] == json.loads(json.dumps(exact(registered)))
