"""``OPTIMIZER``: the optimizer built from the config (AdamW or SGD with torch's kernels, or one
registered), which parameters decay (``NO_DECAY`` by kind, composed with
LR_SCHEDULER.PARAMETER_GROUPS, whose LR scales still apply), the Python ``optimizer=`` factory,
``plan``'s line, train's start-up count, and a resumed run that changes the optimizer refused."""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from helpers.configs import DEFAULT_CONFIG
from helpers.in_process import reset_accelerate, run_cli
from torch import nn

from linnaeus_accel import Callback, register_callback, register_optimizer
from linnaeus_accel.checkpoint.resume.config_changes import review_changes
from linnaeus_accel.config import Config, ConfigError, validate_config
from linnaeus_accel.optim.groups import optimizer_line
from linnaeus_accel.optim.registry import build_from_config
from linnaeus_accel.schedule import resolve_plan
from linnaeus_accel.training.start.setup import build_optimizer, default_optimizer, parameter_groups

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")

HEAD = {"LABEL": "head", "MATCH": ["head.*"], "LR_MULTIPLIER": 10.0}


def as_the_trainer_builds(
    optimizer: Any, model: torch.nn.Module, cfg: Config, device: torch.device | None = None
) -> torch.optim.Optimizer:
    """``build_optimizer`` called as ``training/build.py`` calls it: the default from the registry,
    handed the whole config."""
    return build_optimizer(
        optimizer,
        model,
        cfg.OPTIMIZER,
        cfg.LR_SCHEDULER,
        device,
        from_config=partial(build_from_config, config=cfg),
    )


class Tiny(nn.Module):
    """One parameter of every kind NO_DECAY knows."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.body = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)
        self.head = nn.Linear(4, 2)


def config(optimizer: dict[str, Any] | None = None, groups: list[dict[str, Any]] | None = None) -> Config:
    return validate_config(
        {
            "OPTIMIZER": optimizer or {},
            "LR_SCHEDULER": {"PARAMETER_GROUPS": groups or [], "REFERENCE_BS": None, "WARMUP_STEPS": 2},
        }
    )


def layout(model: nn.Module, groups: list[dict[str, Any]]) -> list[tuple[str, int, float | None, list[str]]]:
    """(name, lr_group, weight_decay or None, parameter names) of each group, in order."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [
        (g["name"], g["lr_group"], g.get("weight_decay"), [names[id(p)] for p in g["params"]]) for g in groups
    ]


ALL = ["embed.weight", "body.weight", "body.bias", "norm.weight", "norm.bias", "head.weight", "head.bias"]


@pytest.mark.parametrize(
    ("rule", "exempt"),
    [
        ([], []),
        (["bias"], ["body.bias", "norm.bias", "head.bias"]),
        (["norm"], ["norm.weight", "norm.bias"]),
        (["embedding"], ["embed.weight"]),
        (["ndim<2"], ["body.bias", "norm.weight", "norm.bias", "head.bias"]),
        (
            ["bias", "norm", "embedding"],
            ["embed.weight", "body.bias", "norm.weight", "norm.bias", "head.bias"],
        ),
    ],
)
def test_no_decay_takes_the_parameters_of_each_kind(rule: list[str], exempt: list[str]) -> None:
    model = Tiny()
    cfg = config({"WEIGHT_DECAY": 0.1, "NO_DECAY": rule})
    got = layout(model, parameter_groups(model, cfg.OPTIMIZER, cfg.LR_SCHEDULER))
    decaying = [n for n in ALL if n not in exempt]
    assert got == [("default", 0, 0.1, decaying)] + ([("default", 0, 0.0, exempt)] if exempt else [])


def test_no_decay_composes_with_parameter_groups_whose_lr_scales_still_apply() -> None:
    model = Tiny()
    cfg = config({"WEIGHT_DECAY": 0.1, "NO_DECAY": ["bias", "norm", "embedding"]}, [HEAD])
    groups = parameter_groups(model, cfg.OPTIMIZER, cfg.LR_SCHEDULER)
    # The N+1 LR groups first, as before OPTIMIZER existed; then each one's no-decay parameters.
    assert layout(model, groups) == [
        ("default", 0, 0.1, ["body.weight"]),
        ("head", 1, 0.1, ["head.weight"]),
        ("default", 0, 0.0, ["embed.weight", "body.bias", "norm.weight", "norm.bias"]),
        ("head", 1, 0.0, ["head.bias"]),
    ]
    plan = resolve_plan(cfg, 10, 1, 320)
    for k in (0, 1, 5, 9):
        lrs = [plan.lr(k, g["lr_group"]) for g in groups]
        assert lrs[1] == lrs[3] == pytest.approx(10 * lrs[0])
        assert lrs[2] == lrs[0]
    # WEIGHT_DECAY 0: the decaying groups carry none (the optimizer's own default applies).
    cfg = config({"NO_DECAY": ["bias"]}, [HEAD])
    plain = parameter_groups(model, cfg.OPTIMIZER, cfg.LR_SCHEDULER)
    assert ["weight_decay" in g for g in plain] == [False, False, True, True]


def test_grouping_is_deterministic_skips_frozen_parameters_and_refits_its_state() -> None:
    torch.manual_seed(0)
    model = Tiny()
    model.embed.weight.requires_grad_(False)  # as a LoRA run's base weights
    cfg = config({"WEIGHT_DECAY": 0.1, "NO_DECAY": ["ndim<2"]}, [HEAD])
    first = as_the_trainer_builds(default_optimizer, model, cfg)
    assert "embed.weight" not in {n for g in layout(model, first.param_groups) for n in g[3]}
    for p in model.parameters():
        p.grad = torch.ones_like(p) if p.requires_grad else None
    first.step()
    again = as_the_trainer_builds(default_optimizer, model, cfg)
    assert layout(model, again.param_groups) == layout(model, first.param_groups)
    again.load_state_dict(first.state_dict())  # a resumed run's state fits the groups
    assert [g["weight_decay"] for g in again.param_groups] == [0.1, 0.1, 0.0, 0.0]


def test_defaults_build_what_ran_before_and_an_old_state_loads() -> None:
    model = Tiny()
    optimizer = as_the_trainer_builds(default_optimizer, model, config())
    assert type(optimizer) is torch.optim.AdamW
    (group,) = optimizer.param_groups
    assert (group["lr"], group["weight_decay"], group["betas"], group["eps"]) == (
        0.0,
        0.0,
        (0.9, 0.999),
        1e-8,
    )
    assert (group["foreach"], group["fused"], group["name"], group["lr_group"]) == (None, None, "default", 0)
    # The optimizer state of a checkpoint written before OPTIMIZER existed loads (groups without lr_group:
    # the step then reads group i's LR from curve i, as before).
    old = torch.optim.AdamW(
        [{"params": list(model.parameters()), "name": "default"}], lr=0.0, weight_decay=0.0
    )
    optimizer.load_state_dict(old.state_dict())
    assert "lr_group" not in optimizer.param_groups[0]
    # ... and its stored config, without OPTIMIZER, is no change.
    saved = config().model_dump(mode="json")
    del saved["OPTIMIZER"]
    cfg = config()
    run = cfg.model_dump(mode="json")
    assert review_changes(saved, None, run, resolve_plan(cfg, 10, 1, 320), 5, allow=False) == []
    now = config({"NO_DECAY": ["bias"]})
    with pytest.raises(ConfigError, match=r"OPTIMIZER\.NO_DECAY: was None in the checkpoint"):
        review_changes(
            saved, None, now.model_dump(mode="json"), resolve_plan(now, 10, 1, 320), 5, allow=False
        )


@pytest.mark.parametrize("implementation", ["fused", "foreach", "for-loop"])
def test_adamw_settings_reach_torch(implementation: str) -> None:
    settings = {"BETAS": [0.9, 0.95], "EPS": 1e-6, "WEIGHT_DECAY": 0.1, "IMPLEMENTATION": implementation}
    optimizer = as_the_trainer_builds(
        default_optimizer, Tiny(), config({**settings, "OPTIONS": {"amsgrad": True}})
    )
    (group,) = optimizer.param_groups
    assert (group["betas"], group["eps"], group["weight_decay"], group["amsgrad"]) == (
        (0.9, 0.95),
        1e-6,
        0.1,
        True,
    )
    assert (bool(group["fused"]), bool(group["foreach"])) == {
        "fused": (True, False),
        "foreach": (False, True),
        "for-loop": (False, False),
    }[implementation]


def test_sgd_with_momentum() -> None:
    cfg = config({"NAME": "sgd", "MOMENTUM": 0.9, "WEIGHT_DECAY": 1e-4, "OPTIONS": {"nesterov": True}})
    optimizer = as_the_trainer_builds(default_optimizer, Tiny(), cfg)
    (group,) = optimizer.param_groups
    assert type(optimizer) is torch.optim.SGD
    assert (group["momentum"], group["nesterov"], group["weight_decay"]) == (0.9, True, 1e-4)


@pytest.mark.parametrize(
    ("optimizer", "keys"),
    [
        ({"NAME": "sgd", "BETAS": [0.9, 0.95], "EPS": 1e-6}, ["OPTIMIZER.BETAS", "OPTIMIZER.EPS"]),
        ({"MOMENTUM": 0.9}, ["OPTIMIZER.MOMENTUM"]),
        ({"BETAS": [0.9]}, ["OPTIMIZER.BETAS"]),
        ({"BETAS": [0.9, 1.0]}, ["OPTIMIZER.BETAS"]),
        ({"WEIGHT_DECAY": -0.1, "EPS": 0.0}, ["OPTIMIZER.WEIGHT_DECAY", "OPTIMIZER.EPS"]),
        ({"NAME": "sgd", "MOMENTUM": 1.0}, ["OPTIMIZER.MOMENTUM"]),
        ({"NO_DECAY": ["bias", "bias"]}, ["OPTIMIZER.NO_DECAY"]),
        ({"NO_DECAY": ["biases"]}, ["OPTIMIZER.NO_DECAY.0"]),
        ({"IMPLEMENTATION": "fast"}, ["OPTIMIZER.IMPLEMENTATION"]),
        ({"OPTIONS": {"lr": 0.1, "betas": [0.9, 0.9]}}, ["OPTIMIZER.OPTIONS.lr", "OPTIMIZER.OPTIONS.betas"]),
        ({"NAME": "mine", "OPTIONS": {"lr": 0.1, "betas": [0.9, 0.9]}}, ["OPTIMIZER.OPTIONS.lr"]),
    ],
)
def test_config_errors_name_the_key(optimizer: dict[str, Any], keys: list[str]) -> None:
    with pytest.raises(ConfigError) as caught:
        config(optimizer)
    assert sorted(key for key, _ in caught.value.problems) == sorted(keys)
    assert all(message for _, message in caught.value.problems)


def test_what_torch_refuses_is_a_config_error_naming_the_key() -> None:
    with pytest.raises(ConfigError, match=r"OPTIMIZER\.OPTIONS: torch.optim.SGD refused it: Nesterov"):
        as_the_trainer_builds(
            default_optimizer, Tiny(), config({"NAME": "sgd", "OPTIONS": {"nesterov": True}})
        )
    with pytest.raises(
        ConfigError, match=r"OPTIMIZER\.NAME: no optimizer named 'adam_w'; known: adamw, muon, sgd"
    ):
        as_the_trainer_builds(default_optimizer, Tiny(), config({"NAME": "adam_w"}))


@pytest.mark.parametrize(
    ("name", "options", "problems"),
    [
        (
            "adamw",
            {"amsgrad": "no", "maximize": 1},
            {
                "amsgrad": "must be true or false (torch.optim.AdamW's amsgrad is a flag, and torch would read "
                "'no' as true), got 'no'",
                "maximize": "must be true or false (torch.optim.AdamW's maximize is a flag, and torch would read "
                "1 as true), got 1",
            },
        ),
        (
            "sgd",
            {"dampening": True, "differentiable": False},
            {"dampening": "must be a number (torch.optim.SGD's dampening), got True"},
        ),
        (
            "sgd",
            {"dampening": "0.1"},
            {"dampening": "must be a number (torch.optim.SGD's dampening), got '0.1'"},
        ),
        (
            "sgd",
            {"amsgrad": True},
            {
                "amsgrad": "torch.optim.SGD has no option 'amsgrad' (given True): OPTIONS takes dampening, nesterov"
            },
        ),
    ],
)
def test_options_are_checked_against_the_optimizer_signature(
    name: str, options: dict[str, Any], problems: dict[str, str]
) -> None:
    """torch takes an option's value as it is: amsgrad 'no' turned amsgrad on."""
    with pytest.raises(ConfigError) as caught:
        as_the_trainer_builds(default_optimizer, Tiny(), config({"NAME": name, "OPTIONS": options}))
    assert [key for key, _ in caught.value.problems] == [f"OPTIMIZER.OPTIONS.{key}" for key in problems]
    for (_, message), expected in zip(caught.value.problems, problems.values(), strict=True):
        assert message.startswith(expected)


def fast_train(tmp_path: Path, *opts: str) -> tuple[int, str, str]:
    return run_cli(
        "train", "--cfg", str(DEFAULT_CONFIG), "--opts", "ENV.OUTPUT.BASE_DIR", str(tmp_path),
        "TRAIN.STEPS", "2", "TRAIN.EPOCHS", "null", "DATA.BATCH_SIZE", "256",
        "SCHEDULE.VALIDATION.FINAL_EPOCH.EXHAUSTIVE_PARTIAL_META_VALIDATION", "false", *opts,
    )  # fmt: skip


def config_problems(err: str) -> list[str]:
    """The problem lines of train's refusal (after its 'invalid config' line)."""
    head, *lines = err.strip().splitlines()
    assert head.startswith("linnaeus-accel: invalid config"), err
    return [line.strip() for line in lines]


@register_callback("test_amsgrad_recorder")
class AmsgradRecorder(Callback):
    """Whether the optimizer stepped with amsgrad (its groups say so and it keeps the max)."""

    seen: ClassVar[list[tuple[bool, bool]]] = []

    def on_fit_end(self, trainer: Any, summary: dict[str, Any]) -> None:
        states = trainer.optimizer.state.values()
        groups = trainer.optimizer.param_groups
        type(self).seen = [(all(g["amsgrad"] for g in groups), all("max_exp_avg_sq" in s for s in states))]


def test_a_flag_given_as_a_string_is_refused_at_start_and_a_true_one_trains(tmp_path: Path) -> None:
    rc, out, err = fast_train(tmp_path, "OPTIMIZER.OPTIONS", "{amsgrad: 'no'}")
    assert rc == 2, out + err
    assert config_problems(err) == [
        "OPTIMIZER.OPTIONS.amsgrad: must be true or false (torch.optim.AdamW's amsgrad is a flag, and torch "
        "would read 'no' as true), got 'no'"
    ]
    assert list(tmp_path.iterdir()) == []  # refused before anything trained or was written
    reset_accelerate()
    opts = ["OPTIMIZER.OPTIONS", "{amsgrad: true}", "CALLBACKS", "[{NAME: test_amsgrad_recorder}]"]
    rc, out, err = fast_train(tmp_path, *opts)
    assert rc == 0, out + err
    assert AmsgradRecorder.seen == [(True, True)]


def test_an_option_that_fails_the_first_step_is_refused_at_start(tmp_path: Path) -> None:
    """torch builds AdamW with differentiable: true, whose step then runs with autograd on and
    fails on the in-place update of a leaf: that was a traceback at the first step."""
    rc, out, err = fast_train(tmp_path, "OPTIMIZER.OPTIONS", "{differentiable: true}")
    assert rc == 2, out + err
    (problem,) = config_problems(err)
    assert problem.startswith(
        "OPTIMIZER.OPTIONS: torch.optim.AdamW accepts these settings but fails at its first step on "
    )
    assert problem.endswith(
        ": a leaf Variable that requires grad is being used in an in-place operation: remove or change the "
        "option that asks for it"
    )
    assert list(tmp_path.iterdir()) == []


def test_the_first_step_is_tried_on_the_device_the_run_trains_on() -> None:
    """capturable needs the parameters on an accelerator: refused for a CPU run, taken for a GPU's."""
    cfg = config({"OPTIONS": {"capturable": True}})
    with pytest.raises(
        ConfigError, match=r"\n  OPTIMIZER\.OPTIONS: .* first step on cpu: .*supported devices"
    ):
        as_the_trainer_builds(default_optimizer, Tiny(), cfg, torch.device("cpu"))
    if torch.cuda.is_available():
        optimizer = as_the_trainer_builds(default_optimizer, Tiny(), cfg, torch.device("cuda"))
        assert optimizer.defaults["capturable"] is True


@register_optimizer("test_signed_sgd")
def signed_sgd(groups: list[dict[str, Any]], cfg: Config) -> torch.optim.Optimizer:
    return torch.optim.SGD(groups, lr=0.0, weight_decay=cfg.OPTIMIZER.WEIGHT_DECAY, **cfg.OPTIMIZER.OPTIONS)


def test_a_registered_optimizer_gets_the_groups_and_the_config() -> None:
    model = Tiny()
    cfg = config({"NAME": "test_signed_sgd", "NO_DECAY": ["bias"], "OPTIONS": {"dampening": 0.5}})
    optimizer = as_the_trainer_builds(default_optimizer, model, cfg)
    assert type(optimizer) is torch.optim.SGD
    assert [(g["name"], g["weight_decay"], g["dampening"]) for g in optimizer.param_groups] == [
        ("default", 0.0, 0.5),
        ("default", 0.0, 0.5),
    ]


def test_the_python_factory_still_works() -> None:
    model = Tiny()
    seen: list[list[list[str]]] = []

    def factory(groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
        seen.append([sorted(g) for g in groups])  # the keys it is given (torch adds its own)
        return torch.optim.AdamW(groups, lr=0.0, weight_decay=0.05)

    # Without OPTIMIZER: the groups as before (plus lr_group), the factory's own weight decay.
    optimizer = as_the_trainer_builds(factory, model, config(groups=[HEAD]))
    assert seen[-1] == [["lr_group", "name", "params"]] * 2
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.05, 0.05]
    # NO_DECAY reaches it through the groups; WEIGHT_DECAY too, when set.
    optimizer = as_the_trainer_builds(factory, model, config({"NO_DECAY": ["bias", "norm"]}))
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.05, 0.0]
    optimizer = as_the_trainer_builds(
        factory, model, config({"NO_DECAY": ["bias", "norm"], "WEIGHT_DECAY": 0.2})
    )
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.2, 0.0]
    assert "on 64 of 78 trained parameters" in optimizer_line(optimizer)
    # What a factory or a built optimizer would not read is refused, naming the key.
    with pytest.raises(
        ConfigError, match=r"OPTIMIZER\.NAME: is 'sgd' but the Trainer was given an optimizer factory"
    ):
        as_the_trainer_builds(factory, model, config({"NAME": "sgd"}))
    built = torch.optim.AdamW(model.parameters())
    with pytest.raises(
        ConfigError,
        match=r"OPTIMIZER\.NO_DECAY: is \['bias'\] but the Trainer was given an optimizer already built",
    ):
        as_the_trainer_builds(built, model, config({"NO_DECAY": ["bias"]}))
    assert as_the_trainer_builds(built, model, config()) is built


def test_plan_prints_the_optimizer() -> None:
    common = ["plan", "--cfg", str(DEFAULT_CONFIG), "--dataset-size", "1000"]
    rc, out, err = run_cli(*common)
    assert rc == 0, err
    assert "Optimizer: adamw, betas (0.9, 0.999), eps 1e-08, torch's default kernels; weight decay 0\n" in out
    opts = ["OPTIMIZER.NAME", "sgd", "OPTIMIZER.MOMENTUM", "0.9", "OPTIMIZER.WEIGHT_DECAY", "0.1"]
    rc, out, err = run_cli(*common, "--opts", *opts, "OPTIMIZER.NO_DECAY", "[bias, norm]")
    assert rc == 0, err
    assert (
        "Optimizer: sgd, momentum 0.9, torch's default kernels; weight decay 0.1, none on bias, norm "
        "parameters (groups of their own, at their LR group's LR)\n"
    ) in out


@register_callback("test_optimizer_recorder")
class OptimizerRecorder(Callback):
    """The optimizer's groups after the last step, and the plan's LR of each."""

    groups: ClassVar[list[tuple[Any, ...]]] = []

    def on_fit_end(self, trainer: Any, summary: dict[str, Any]) -> None:
        last = summary["global_step"] - 1
        type(self).groups = [
            (
                g["name"],
                g["lr_group"],
                g["weight_decay"],
                g["fused"],
                g["lr"],
                trainer.plan.lr(last, g["lr_group"]),
            )
            for g in trainer.optimizer.param_groups
        ]


def test_train_builds_it_counts_what_decays_and_refuses_a_changed_one_on_resume(tmp_path: Path) -> None:
    opts = [
        "ENV.OUTPUT.BASE_DIR", str(tmp_path), "TRAIN.STEPS", "2", "TRAIN.EPOCHS", "null",
        "DATA.BATCH_SIZE", "256", "SCHEDULE.VALIDATION.FINAL_EPOCH.EXHAUSTIVE_PARTIAL_META_VALIDATION", "false",
        "LR_SCHEDULER.PARAMETER_GROUPS", "[{LABEL: heads, MATCH: ['heads.*'], LR_MULTIPLIER: 10}]",
        "OPTIMIZER.NO_DECAY", "[bias]", "OPTIMIZER.IMPLEMENTATION", "fused",
        "CALLBACKS", "[{NAME: test_optimizer_recorder}]",
    ]  # fmt: skip
    rc, out, err = run_cli(
        "train", "--cfg", str(DEFAULT_CONFIG), "--opts", *opts, "OPTIMIZER.WEIGHT_DECAY", "0.1"
    )
    assert rc == 0, out + err
    assert (
        "Optimizer: adamw, betas (0.9, 0.999), eps 1e-08, fused kernels; weight decay 0.1, none on bias"
        in out
    )
    # digits_mlp: 121,357 parameters, 653 of them biases
    assert (
        "Optimizer built: AdamW (fused), 4 parameter groups; weight decay 0.1 on 120,704 of 121,357 trained "
        "parameters (99.5%)"
    ) in out
    groups = OptimizerRecorder.groups
    assert [g[:4] for g in groups] == [
        ("default", 0, 0.1, True),
        ("heads", 1, 0.1, True),
        ("default", 0, 0.0, True),
        ("heads", 1, 0.0, True),
    ]
    assert [g[4] for g in groups] == [g[5] for g in groups]  # each group at its LR group's LR
    assert groups[3][4] == pytest.approx(10 * groups[2][4])

    checkpoint = next((tmp_path / "digits_default" / "checkpoints").iterdir())
    reset_accelerate()
    rc, out, err = run_cli(
        "train", "--cfg", str(DEFAULT_CONFIG), "--resume", str(checkpoint), "--opts", *opts,
        "EXPERIMENT.NAME", "resumed", "OPTIMIZER.WEIGHT_DECAY", "0.2",
    )  # fmt: skip
    assert rc == 2, out + err
    assert "OPTIMIZER.WEIGHT_DECAY: was 0.1 in the checkpoint, is 0.2 now" in err

    # With --allow-config-change the new weight decay is what trains (torch's load_state_dict
    # would have put the checkpoint's 0.1 back into the groups), the moments are the checkpoint's.
    reset_accelerate()
    rc, out, err = run_cli(
        "train", "--cfg", str(DEFAULT_CONFIG), "--resume", str(checkpoint), "--allow-config-change",
        "--opts", *opts, "EXPERIMENT.NAME", "resumed", "OPTIMIZER.WEIGHT_DECAY", "0.2", "TRAIN.STEPS", "3",
    )  # fmt: skip
    assert rc == 0, out + err
    assert "config changed since the checkpoint, applied: OPTIMIZER.WEIGHT_DECAY: 0.1 -> 0.2" in out
    assert [g[:4] for g in OptimizerRecorder.groups] == [
        ("default", 0, 0.2, True),
        ("heads", 1, 0.2, True),
        ("default", 0, 0.0, True),
        ("heads", 1, 0.0, True),
    ]

    # Another NO_DECAY regroups the parameters: the saved state cannot follow, flag or not.
    reset_accelerate()
    rc, out, err = run_cli(
        "train", "--cfg", str(DEFAULT_CONFIG), "--resume", str(checkpoint), "--allow-config-change",
        "--opts", *opts, "EXPERIMENT.NAME", "regrouped", "OPTIMIZER.NO_DECAY", "[bias, ndim<2]",
        "OPTIMIZER.WEIGHT_DECAY", "0.1",
    )  # fmt: skip
    assert rc == 2, out + err
    assert "OPTIMIZER.NO_DECAY: was ['bias'] in the checkpoint, is ['bias', 'ndim<2'] now" in err
    assert "kept per parameter group, in order, and cannot follow" in err


HEADS = {"LABEL": "heads", "MATCH": ["heads.*"], "LR_MULTIPLIER": 10}


@pytest.mark.parametrize(
    ("before", "after", "group_keys", "regrouped"),
    [
        # a hyperparameter: put back into every group after loading
        ({"WEIGHT_DECAY": 0.1}, {"WEIGHT_DECAY": 0.2}, ["weight_decay"], []),
        ({}, {"BETAS": [0.9, 0.95]}, ["betas"], []),
        ({}, {"IMPLEMENTATION": "fused"}, ["foreach", "fused"], []),
        # an option of the optimizer's own: its group key
        ({}, {"OPTIONS": {"amsgrad": True}}, ["amsgrad"], []),
        # unchanged: nothing put back (an optimizer's learned group values resume as saved)
        ({"WEIGHT_DECAY": 0.1}, {"WEIGHT_DECAY": 0.1}, [], []),
        # other parameters in other groups: cannot resume
        ({}, {"NO_DECAY": ["bias"]}, [], ["OPTIMIZER.NO_DECAY"]),
        ({}, {"NAME": "sgd"}, [], ["OPTIMIZER.NAME"]),
    ],
)
def test_what_a_resume_puts_back_or_refuses(
    before: dict[str, Any], after: dict[str, Any], group_keys: list[str], regrouped: list[str]
) -> None:
    from linnaeus_accel.checkpoint.resume.optimizer import changed_group_keys, regrouping_problems

    saved, run = config(before).model_dump(mode="json"), config(after).model_dump(mode="json")
    assert changed_group_keys(saved, run) == group_keys
    assert [key for key, _ in regrouping_problems(saved, run)] == regrouped


def test_lr_groups_regroup_when_they_match_other_parameters() -> None:
    from linnaeus_accel.checkpoint.resume.optimizer import regrouping_problems

    saved = config(groups=[HEADS]).model_dump(mode="json")
    same_members = config(groups=[{**HEADS, "LR_MULTIPLIER": 5}]).model_dump(mode="json")
    assert regrouping_problems(saved, same_members) == []
    other_members = config(groups=[{**HEADS, "MATCH": ["heads.0.*"]}]).model_dump(mode="json")
    moved = regrouping_problems(saved, other_members)
    assert [key for key, _ in moved] == ["LR_SCHEDULER.PARAMETER_GROUPS"]
