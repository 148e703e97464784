"""``noise_scale``: the closed form of linear regression (noise_models.py), the state left
as it was, and bad input (one clear error each)."""

from __future__ import annotations

import copy
import random
import warnings

import numpy as np
import pytest
import torch
from noise_models import half_mse, linear_regression
from torch import nn

from batchfit.errors import InvalidInputError
from batchfit.stats.measure import noise_scale
from batchfit.stats.monitor import NoiseScaleWarning


@pytest.fixture(scope="module")
def problem():
    return linear_regression()


def _measure(problem, method, batch_small, seed, steps):
    return noise_scale(problem.model, half_mse, (problem.x, problem.y), batch_small=batch_small,
                       batch_big=64, steps=steps, method=method, seed=seed)


@pytest.fixture(scope="module")
def estimates(problem):
    """Each method: a 20-step pilot states the steps for a 10% half-width, then a fresh run
    (another seed) of that many steps."""
    found = {}
    for method, batch_small in (("microbatch", 8), ("per-example", 1)):
        pilot = _measure(problem, method, batch_small, seed=1, steps=20)
        found[method] = (pilot.steps_for(0.1), _measure(problem, method, batch_small, seed=2,
                                                        steps=pilot.steps_for(0.1)))
    return found


@pytest.mark.parametrize("method", ["microbatch", "per-example"])
def test_within_10_percent_of_the_closed_form_after_the_stated_steps(problem, estimates, method):
    stated, result = estimates[method]
    assert 20 < stated < 400 and result.steps == stated
    assert result.b_simple == pytest.approx(problem.b_simple, rel=0.10)
    assert result.trace_sigma == pytest.approx(problem.trace_sigma, rel=0.10)
    assert result.grad_sq_norm == pytest.approx(problem.grad_sq_norm, rel=0.15)
    assert result.relative_halfwidth <= 0.12  # about what was asked for: 10% at 95%
    assert result.method == method and result.batch_big == 64
    assert result.batch_small == (1 if method == "per-example" else 8)


def test_methods_agree_within_their_intervals(problem, estimates):
    micro, per_example = estimates["microbatch"][1], estimates["per-example"][1]
    for r in (micro, per_example):
        assert r.ci_low <= problem.b_simple <= r.ci_high
    assert max(micro.ci_low, per_example.ci_low) <= min(micro.ci_high, per_example.ci_high)


def test_batch_small_of_one_uses_per_example_gradients(problem):
    r = noise_scale(problem.model, half_mse, (problem.x, problem.y), batch_small=1,
                    batch_big=16, steps=3)
    assert r.method == "per-example"


class Tiny(nn.Module):
    """Dropout (uses the RNG), a buffer and two layers."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 16)
        self.drop = nn.Dropout(0.2)
        self.b = nn.Linear(16, 3)
        self.register_buffer("scale", torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.drop(torch.tanh(self.a(x)))) * self.scale


class Counting(Tiny):
    """Also updates its buffer in place on every call (as BatchNorm's counters do)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.scale += 0.0
        self.scale.mul_(1.0001)
        return super().forward(x)


def _ce(model: nn.Module, batch) -> torch.Tensor:
    return nn.functional.cross_entropy(model(batch[0]), batch[1])


def _state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    return {"params": {k: v.clone() for k, v in model.state_dict().items()},
            "grads": {k: p.grad.clone() for k, p in model.named_parameters()},
            "training": [m.training for m in model.modules()],
            "optimizer": copy.deepcopy(optimizer.state_dict()),
            "torch_rng": torch.get_rng_state(), "random": random.getstate(),
            "numpy": np.random.get_state()[1].copy()}


@pytest.mark.parametrize("method, batch_small, cls", [("microbatch", 4, Counting),
                                                     ("per-example", 1, Tiny)])
def test_model_optimizer_and_rng_are_left_exactly_as_they_were(method, batch_small, cls):
    torch.manual_seed(0)
    model = cls()
    x, y = torch.randn(256, 6), torch.randint(0, 3, (256,))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    _ce(model, (x[:8], y[:8])).backward()
    optimizer.step()  # optimizer state exists, gradients are set
    model.eval()
    model.b.train()  # a mixed train/eval state to give back
    before = _state(model, optimizer)
    grads = [p.grad for p in model.parameters()]
    result = noise_scale(model, _ce, (x, y), batch_small=batch_small, batch_big=32, steps=3,
                         method=method, optimizer=optimizer)
    assert result.steps == 3
    after = _state(model, optimizer)
    for key in ("params", "grads"):
        assert all(torch.equal(before[key][k], after[key][k]) for k in before[key])
    assert before["training"] == after["training"]
    assert torch.equal(before["torch_rng"], after["torch_rng"])
    assert before["random"] == after["random"]
    assert np.array_equal(before["numpy"], after["numpy"])
    assert str(before["optimizer"]) == str(after["optimizer"])
    assert all(a is b for a, b in zip(grads, [p.grad for p in model.parameters()]))


def test_training_moves_the_weights_during_the_measurement_only(problem):
    model = copy.deepcopy(problem.model)
    before = model.weight.clone()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
    seen = []
    r = noise_scale(model, half_mse, (problem.x, problem.y), steps=30, optimizer=optimizer,
                    on_step=lambda step: seen.append(model.weight.clone()))
    assert torch.equal(model.weight, before)
    assert not torch.equal(seen[0], seen[-1])  # it trained while measuring
    # towards w*: |G|^2 falls, so the noise scale rises above the one at the start
    assert r.b_simple > problem.b_simple


def test_batchnorm_warns():
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 1))
    x, y = torch.randn(128, 4), torch.randn(128, 1)
    with pytest.warns(NoiseScaleWarning, match="BatchNorm"):
        r = noise_scale(model, half_mse, (x, y), batch_small=8, batch_big=32, steps=2)
    assert any("BatchNorm" in n for n in r.notes)


def test_auto_falls_back_to_micro_batches_when_torch_func_cannot_run_the_model():
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 1))
    x, y = torch.randn(128, 4), torch.randn(128, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NoiseScaleWarning)
        with pytest.raises(InvalidInputError, match="per-example gradients"):
            noise_scale(model, half_mse, (x, y), batch_small=1, batch_big=8, steps=2,
                        method="per-example")
        # BatchNorm in training mode cannot see one example: micro-batches of one cannot
        # either, so the fallback is exercised with a model that fails in vmap otherwise
        r = noise_scale(_ItemModel(), half_mse, (x, y), batch_small=1, batch_big=8, steps=2)
    assert r.method == "microbatch" and any("torch.func" in n for n in r.notes)


class _ItemModel(nn.Module):
    """Reads a tensor's value in Python (``.item()``): fine eagerly, not under vmap."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * (1.0 if x.abs().max().item() >= 0 else 2.0)


@pytest.mark.parametrize("kwargs, match", [
    ({"batch_small": 64, "batch_big": 64}, "smaller than the big batch"),
    ({"batch_small": 128, "batch_big": 64}, "smaller than the big batch"),
    ({"batch_big": 256}, "fewer than the big batch"),
    ({"loss_fn": lambda m, b: (m(b[0]) - b[1]).square()}, "not a scalar"),
    ({"loss_fn": lambda m, b: m(b[0]).sum().detach()}, "does not depend"),
    ({"loss_fn": lambda m, b: 1.0}, "not a tensor"),
    ({"batch_small": 5}, "multiple of 5"),
    ({"steps": 1}, "steps"),
    ({"method": "ghost"}, "unknown method"),
    ({"method": "ddp"}, "DistributedDataParallel"),
    ({"ema_decay": 1.5}, "ema_decay"),
    ({"data": iter([1, 2])}, "cannot draw random batches"),
    ({"data": (torch.randn(100, 4), torch.randn(99, 1))}, "share their first"),
])
def test_bad_input_is_one_clear_error(kwargs, match):
    args = {"model": nn.Linear(4, 1), "loss_fn": half_mse,
            "data": (torch.randn(100, 4), torch.randn(100, 1)), "batch_small": 8,
            "batch_big": 64, "steps": 3, **kwargs}
    with pytest.raises(InvalidInputError, match=match):
        noise_scale(args.pop("model"), args.pop("loss_fn"), args.pop("data"), **args)


def test_no_trainable_parameters_is_one_clear_error():
    model = nn.Linear(4, 1).requires_grad_(False)
    with pytest.raises(InvalidInputError, match="no trainable parameter"):
        noise_scale(model, half_mse, (torch.randn(100, 4), torch.randn(100, 1)))


def test_map_style_dataset_and_loader_are_collated_their_way():
    class Pairs(torch.utils.data.Dataset):
        def __init__(self) -> None:
            self.x, self.y = torch.randn(200, 4), torch.randn(200, 1)

        def __len__(self) -> int:
            return 200

        def __getitem__(self, i: int) -> dict:
            return {"inputs": self.x[i], "target": self.y[i]}

    def loss(model: nn.Module, batch: dict) -> torch.Tensor:
        return 0.5 * (model(batch["inputs"]) - batch["target"]).square().mean()

    collated = []

    def collate(items: list) -> dict:
        collated.append(len(items))
        return torch.utils.data.default_collate(items)

    loader = torch.utils.data.DataLoader(Pairs(), batch_size=3, collate_fn=collate)
    r = noise_scale(nn.Linear(4, 1), loss, loader, batch_small=4, batch_big=16, steps=2)
    assert r.steps == 2 and set(collated) == {4} and len(collated) == 8
    assert r.dataset_size == 200
