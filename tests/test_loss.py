"""GradNorm on a tiny real shared-trunk model (the hierarchical loss itself: tests/test_tasks.py)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import torch
from torch import Tensor, nn

from linnaeus_accel.tasks.hierarchical import level_loss_sums
from linnaeus_accel.training.step.gradnorm import GradNorm


def level_means(logits: list[Tensor], labels: Tensor) -> Tensor:
    """Per-level mean cross-entropy over the labelled samples (the hierarchical task's losses)."""
    return level_loss_sums(logits, labels) / (labels >= 0).sum(0).clamp_min(1)


# -- GradNorm -----------------------------------------------------------------------------------


class TwoHeads(nn.Module):
    def __init__(self, scale: tuple[float, float] = (1.0, 1.0)) -> None:
        super().__init__()
        self.trunk = nn.Linear(8, 16)
        self.heads = nn.ModuleList([nn.Linear(16, 3), nn.Linear(16, 3)])
        self.scale = scale

    def forward(self, x: Tensor) -> list[Tensor]:
        h = torch.relu(self.trunk(x))
        return [s * head(h) for s, head in zip(self.scale, self.heads, strict=True)]


def _data(seed: int, n: int = 64) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=gen)
    easy = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()  # a function of x: learnt fast
    hard = torch.randint(0, 3, (n,), generator=gen)  # random: learnt only by memorising, slowly
    return x, torch.stack([easy, hard], 1)


def _setup(seed: int = 0, scale: tuple[float, float] = (1.0, 1.0)) -> tuple[TwoHeads, Tensor, Tensor]:
    torch.manual_seed(seed)
    model = TwoHeads(scale)
    x, labels = _data(seed)
    return model, x, labels


def _per_level(model: TwoHeads, x: Tensor, labels: Tensor) -> Tensor:
    return level_means(model(x), labels)


def _assert_valid(w: Tensor, n: int) -> None:
    assert bool((w > 0).all())
    torch.testing.assert_close(w.sum(), torch.tensor(float(n)))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_slower_task_gains_weight_during_training(seed: int) -> None:
    model, x, labels = _setup(seed)
    gn = GradNorm(2, alpha=1.5)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for _ in range(40):
        per = level_means(model(x), labels)
        metrics = gn.update(per, list(model.trunk.parameters()))
        _assert_valid(metrics["weights"], 2)
        opt.zero_grad()
        (gn.weights * per).sum().backward()
        opt.step()
    ratios = metrics["inverse_rates"]
    assert ratios[1] > ratios[0]  # the random-label level trains slower ...
    assert gn.weights[1] > gn.weights[0] + 0.3  # ... and so gets the larger weight


def test_weights_stay_positive_and_sum_to_number_of_tasks_even_with_a_huge_lr() -> None:
    model, x, labels = _setup()
    per = _per_level(model, x, labels)
    gn = GradNorm(2, alpha=0.0, lr=5.0)  # steps far larger than the weights themselves
    for _ in range(5):
        _assert_valid(gn.update(per, list(model.trunk.parameters()))["weights"], 2)
    assert float(gn.weights.min()) >= gn.min_weight * 0.5


def test_update_leaves_parameter_grads_untouched() -> None:
    model, x, labels = _setup()
    preset = torch.full_like(model.trunk.weight, 7.0)
    model.trunk.weight.grad = preset.clone()
    per = _per_level(model, x, labels)
    # heads[0].weight is reached by task 0 only: an unused input for task 1 counts as zero gradient.
    gn = GradNorm(2)
    metrics = gn.update(per, [*model.trunk.parameters(), model.heads[0].get_parameter("weight")])
    assert torch.equal(model.trunk.weight.grad, preset)
    assert model.trunk.bias.grad is None
    assert all(p.grad is None for p in model.heads.parameters())
    assert bool(torch.isfinite(metrics["grad_norms"]).all())
    torch.autograd.backward(per.sum())  # the graph was retained for the caller's backward


def _fresh_with_initial_losses(per: Tensor, alpha: float) -> GradNorm:
    gn = GradNorm(2, alpha=alpha)
    gn.load_state_dict({"initial_losses": per.detach().tolist()})
    return gn


def test_update_applies_the_reduced_weight_gradient() -> None:
    model, x, labels = _setup(scale=(1.0, 4.0))  # unequal grad norms: a non-trivial update
    per = _per_level(model, x, labels)
    shared = list(model.trunk.parameters())
    local = _fresh_with_initial_losses(per, alpha=0.0)
    g_local = local.update(per, shared)["weight_grad"]
    other = -3.0 * g_local  # the "other process": the average is then exactly -g_local
    calls: list[Tensor] = []

    def reduce_mean(t: Tensor) -> Tensor:
        calls.append(t.clone())
        return (t + other) / 2

    reduced = _fresh_with_initial_losses(per, alpha=0.0)
    metrics = reduced.update(per, shared, reduce_mean)
    assert len(calls) == 1  # L(0) was already known: only the weight gradient is reduced
    torch.testing.assert_close(calls[0], g_local)
    torch.testing.assert_close(metrics["weight_grad"], -g_local)
    # Adam's first step is lr * sign(grad): the reduced gradient moves the weights the other way.
    torch.testing.assert_close(reduced.weights - 1, -(local.weights - 1))
    assert not torch.allclose(reduced.weights, local.weights)


def test_first_update_records_the_process_averaged_initial_losses() -> None:
    model, x, labels = _setup()
    per = _per_level(model, x, labels)
    other = torch.tensor([3.0, 5.0])
    gn = GradNorm(2)
    gn.update(per, list(model.trunk.parameters()), lambda t: (t + other) / 2)
    assert gn.initial_losses is not None
    torch.testing.assert_close(gn.initial_losses, (per.detach() + other) / 2)


def test_state_dict_json_round_trip_reproduces_the_next_update() -> None:
    model, x, labels = _setup()
    shared = list(model.trunk.parameters())
    gn = GradNorm(2, alpha=1.5)
    for seed in range(3):
        gn.update(_per_level(model, *_data(seed + 10)), shared)
    restored = GradNorm(2, alpha=1.5)
    restored.load_state_dict(json.loads(json.dumps(gn.state_dict())))
    per = _per_level(model, x, labels)
    want, got = gn.update(per, shared), restored.update(per, shared)
    for key in want:
        assert torch.equal(got[key], want[key]), key
    assert restored.state_dict() == gn.state_dict()


def test_load_state_dict_tolerates_missing_keys_and_rejects_bad_ones() -> None:
    gn = GradNorm(2)
    gn.load_state_dict({"weights": [0.5, 1.5]})  # an older or partial checkpoint
    assert gn.weights.tolist() == [0.5, 1.5]
    assert gn.initial_losses is None
    assert gn.step == 0
    gn.load_state_dict({})
    assert gn.weights.tolist() == [0.5, 1.5]
    with pytest.raises(ValueError, match="tasks"):
        gn.load_state_dict({"num_tasks": 3})
    with pytest.raises(ValueError, match="positive"):
        gn.load_state_dict({"weights": [0.0, 2.0]})
    with pytest.raises(ValueError, match="version"):
        gn.load_state_dict({"version": 99})


def test_alpha_zero_targets_the_mean_norm_and_equalises() -> None:
    model, x, labels = _setup(scale=(1.0, 5.0))  # task 1's gradients are much larger
    per = _per_level(model, x, labels)
    gn = GradNorm(2, alpha=0.0)
    first = gn.update(per, list(model.trunk.parameters()))
    norms = first["grad_norms"]
    torch.testing.assert_close(first["targets"], norms.mean().expand(2))
    assert norms[1] > norms[0]
    assert gn.weights[1] < gn.weights[0]  # the larger norm is weighted down
    gap = (norms[1] - norms[0]).abs()
    for _ in range(10):
        last = gn.update(per, list(model.trunk.parameters()))
    assert (last["grad_norms"][1] - last["grad_norms"][0]).abs() < gap


def test_non_finite_losses_leave_the_weights_finite() -> None:
    model, x, labels = _setup()
    shared = list(model.trunk.parameters())
    gn = GradNorm(2)
    gn.update(_per_level(model, x, labels), shared)
    before = gn.weights
    overflow = _per_level(model, x, labels) * torch.tensor([1.0, float("inf")])  # as fp16 could
    metrics = gn.update(overflow, shared)
    assert torch.equal(metrics["weight_grad"], torch.zeros(2))
    assert bool(torch.isfinite(gn.weights).all())
    torch.testing.assert_close(gn.weights, before, atol=0.05, rtol=0)  # only Adam momentum moved it


def test_constructor_validation() -> None:
    with pytest.raises(ValueError, match="positive"):
        GradNorm(2, initial_weights=[0.0, 1.0])
    torch.testing.assert_close(GradNorm(2, initial_weights=[1.0, 3.0]).weights, torch.tensor([0.5, 1.5]))
    model, x, labels = _setup()
    with pytest.raises(ValueError, match="graph"):
        GradNorm(2).update(_per_level(model, x, labels).detach(), list(model.trunk.parameters()))


# -- no host reads in the per-step path ---------------------------------------------------------


@contextmanager
def _no_host_reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    def refuse(name: str) -> Callable[..., object]:
        def method(*_: object, **__: object) -> object:
            raise AssertionError(f"host read: Tensor.{name}")

        return method

    with monkeypatch.context() as m:
        for name in ("item", "tolist", "numpy", "__bool__", "__float__", "__int__", "__index__"):
            m.setattr(torch.Tensor, name, refuse(name))
        yield


def test_forward_and_update_read_nothing_on_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    model, x, labels = _setup()
    gn = GradNorm(2, initial_weights=[1.0, 2.0])
    labels[0, 1] = -1
    for _ in range(2):  # the first update (recording L(0)) and a later one
        with _no_host_reads(monkeypatch):
            per = level_means(model(x), labels)
            gn.update(per, list(model.trunk.parameters()), lambda t: t * 1.0)
            (gn.weights * per).sum().backward()
