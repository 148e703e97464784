"""The two loss conventions of ``noise_scale`` (``loss_fn(model, batch)`` and
``criterion(output, target)``), told apart by the signature, and the losses and data it
refuses."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from batchfit.errors import InvalidInputError
from batchfit.stats.loss import CriterionLoss, as_model_loss, is_model_loss
from batchfit.stats.measure import noise_scale


class _Holder:
    def loss(self, model, batch):
        return (model(batch[0]) - batch[1]).square().mean()

    def criterion(self, output, target):
        return (output - target).square().mean()


def _by_module(net: nn.Module, batch):
    return (net(batch[0]) - batch[1]).square().mean()


def _typed(first: nn.Linear, second):
    return (first(second[0]) - second[1]).square().mean()


def _star(*args):
    model, batch = args
    return (model(batch[0]) - batch[1]).square().mean()


@pytest.mark.parametrize("loss, model_convention", [
    (nn.MSELoss(), False),
    (nn.CrossEntropyLoss(), False),
    (F.mse_loss, False),                                   # (input, target, ...)
    (lambda out, y: (out - y).square().mean(), False),
    (lambda model, batch: model(batch[0]).mean(), True),
    (lambda m, b: m(b[0]).mean(), True),
    (_by_module, True),
    (_typed, True),                                        # annotated nn.Module subclass
    (_star, True),                                         # *args only: today's convention
    (_Holder().loss, True),                                # bound method: self is dropped
    (_Holder().criterion, False),
    (functools.partial(F.mse_loss, reduction="mean"), False),
    (functools.partial(lambda scale, model, batch: scale * model(batch[0]).mean(), 2.0), True),
])
def test_convention_is_read_from_the_signature(loss, model_convention):
    assert is_model_loss(loss) is model_convention
    wrapped = as_model_loss(loss)
    assert (wrapped is loss) is model_convention
    assert isinstance(wrapped, CriterionLoss) is not model_convention


def test_a_criterion_gets_the_model_output_and_the_last_tensor_as_target():
    model = nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.0, 2.0]]))
    x = torch.tensor([[1.0, 1.0], [0.0, 1.0]])
    y = torch.tensor([[1.0], [0.0]])
    # outputs 3 and 2: squared errors 4 and 4, mean 4
    assert as_model_loss(nn.MSELoss())(model, (x, y)).item() == pytest.approx(4.0)


def test_a_criterion_with_a_batch_that_has_no_target_is_one_clear_error():
    with pytest.raises(InvalidInputError, match="tuple \\(input..., target\\)"):
        as_model_loss(nn.MSELoss())(nn.Linear(2, 1), torch.zeros(3, 2))


def _regression(d: int, sigma: float, n: int):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, d, generator=g)
    w_star = torch.ones(d, 1)
    return x, x @ w_star + sigma * torch.randn(n, 1, generator=g)


def test_noise_scale_of_a_criterion_matches_the_closed_form():
    """Linear regression y = x.w* + e, x ~ N(0, I_d), e ~ N(0, s^2), model y^ = x.w (no
    bias), loss mean (x.w - y)^2 (nn.MSELoss). With delta = w - w*, one example's gradient is
    g = 2 x (x.delta - e), so G = E[g] = 2 delta and |G|^2 = 4 |delta|^2.
    E[g g^T] = 4 (E[x x^T (x.delta)^2] + s^2 I) = 4 (|delta|^2 I + 2 delta delta^T + s^2 I)
    (Isserlis), so tr(Sigma) = tr E[g g^T] - |G|^2 = 4 ((d + 1) |delta|^2 + d s^2) and
    B_simple = tr(Sigma) / |G|^2 = (d + 1) + d s^2 / |delta|^2.
    Here d = 4, w = 0, w* = 1 (|delta|^2 = 4), s = 2: B_simple = 5 + 4 * 4 / 4 = 9."""
    model = nn.Linear(4, 1, bias=False)
    nn.init.zeros_(model.weight)
    data = _regression(4, 2.0, 50_000)
    result = noise_scale(model, nn.MSELoss(), data, batch_small=8, batch_big=128, steps=300)
    assert result.b_simple == pytest.approx(9.0, rel=0.10)
    lam = noise_scale(model, lambda out, y: (out - y).square().mean(), data, batch_small=1,
                      batch_big=128, steps=100)
    assert lam.method == "per-example" and lam.b_simple == pytest.approx(9.0, rel=0.10)


def test_a_nan_loss_is_an_error_with_its_cause():
    x, y = _regression(4, 1.0, 256)
    x[3, 0] = float("nan")
    model = nn.Linear(4, 1)
    with pytest.raises(InvalidInputError, match="the loss is nan"):
        noise_scale(model, nn.MSELoss(), (x, y), batch_small=8, batch_big=256, steps=3)


def test_nan_per_example_gradients_on_every_step_are_an_error():
    x, y = _regression(4, 1.0, 256)
    model = nn.Linear(4, 1)

    def loss(model, batch):  # finite value; d sqrt(|u|)/du at u = 0 is inf * 0 = nan
        out = model(batch[0])
        return (out - batch[1]).square().mean() + (0.0 * out).abs().sqrt().sum()

    with pytest.raises(InvalidInputError, match="non-finite"):
        noise_scale(model, loss, (x, y), batch_small=1, batch_big=16, steps=3)


@pytest.mark.parametrize("data", ["data/train.csv", b"abc"])
def test_a_string_is_not_a_dataset(data):
    with pytest.raises(InvalidInputError, match="not a path or a name"):
        noise_scale(nn.Linear(1, 1), lambda m, b: m(b).mean(), data, batch_small=1,
                    batch_big=2, steps=2)
