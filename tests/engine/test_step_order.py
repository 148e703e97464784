"""``TrainConfig.zero_grad_after_forward``: Lightning's automatic optimization order.

Lightning's ``Closure.closure`` (lightning/pytorch/loops/optimization/automatic.py) runs
``training_step``, then ``zero_grad``, then ``backward``: the previous step's gradients
are live through the forward. Two ``Linear(64, 64)``, SGD without momentum (no state),
fp32: parameters and gradients are 2 x (64 x 64 + 64) x 4 = 33,280 bytes each.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from batchfit.device.profile import DeviceProfile
from batchfit.engine.spec import TrainConfig
from batchfit.engine.trace import trace_step
from batchfit.engine.tracer import Category, EventKind, Phase

PARAM_BYTES = 2 * (64 * 64 + 64) * 4


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))


def _live_by_phase(after_forward: bool) -> tuple[list[Phase], dict[Phase, int], int]:
    config = TrainConfig(optimizer="sgd", zero_grad_after_forward=after_forward)
    events = trace_step(_model, (64,), 4, config, DeviceProfile.cpu(kernel_scratch=False)
                        ).steady_events
    order: list[Phase] = []
    grads_freed: dict[Phase, int] = {}
    live = forward_start = 0
    for event in events:
        if event.phase not in order:
            order.append(event.phase)
            if event.phase is Phase.FORWARD:
                forward_start = live
        if event.kind is EventKind.ALLOC:
            live += event.nbytes
        elif event.kind is EventKind.FREE:
            live -= event.nbytes
            if event.category is Category.GRADIENTS:
                grads_freed[event.phase] = grads_freed.get(event.phase, 0) + event.nbytes
    return order, grads_freed, forward_start


@pytest.mark.parametrize("after_forward", [False, True])
def test_the_previous_gradients_live_through_the_forward(after_forward: bool) -> None:
    order, grads_freed, forward_start = _live_by_phase(after_forward)
    inputs = 4 * 64 * 4
    if after_forward:
        assert order.index(Phase.ZERO_GRAD) > order.index(Phase.LOSS)
        assert order.index(Phase.ZERO_GRAD) < order.index(Phase.BACKWARD)
        assert forward_start == 2 * PARAM_BYTES + inputs  # parameters and last gradients
        assert grads_freed == {Phase.ZERO_GRAD: PARAM_BYTES}
    else:  # zero_grad(set_to_none=True) first: the step starts without gradients
        assert forward_start == PARAM_BYTES + inputs
        assert grads_freed == {}


def test_the_runner_zeroes_between_loss_and_backward() -> None:
    from batchfit.engine.step import StepRunner

    phases: list[str] = []
    model = _model()
    batch = ((torch.randn(4, 64),), {})
    config = TrainConfig(optimizer="sgd", zero_grad_after_forward=True,
                         loss_fn=lambda output, batch: output.sum())
    runner = StepRunner(model, config, batch, on_phase=phases.append)
    runner.train_step()
    assert phases == ["forward", "loss", "zero_grad", "backward", "optimizer"]
