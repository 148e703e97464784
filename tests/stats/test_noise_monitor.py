"""The training hooks: each step's parts against a hand computation from the micro-batches'
own gradients (``torch.autograd.grad`` of each micro-batch's mean loss), whatever the loop
does to the gradients after backward (AMP scaling, clipping, a different loss scale)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from batchfit.errors import InvalidInputError
from batchfit.stats.estimator import two_batch_estimates
from batchfit.stats.monitor import NoiseScaleMonitor

MICRO, SIZE, STEPS = 4, 6, 3


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 2))


def _batches(step: int, sizes=(SIZE,) * MICRO) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(step)
    return [(torch.randn(n, 5, generator=g), torch.randn(n, 2, generator=g)) for n in sizes]


def _mse(model: nn.Module, batch) -> torch.Tensor:
    return (model(batch[0]) - batch[1]).square().mean()


def _expected(model: nn.Module, step: int) -> tuple[float, float]:
    """(|G|^2, tr Σ) of one step from each micro-batch's own gradient, by hand."""
    params = list(model.parameters())
    grads = []
    for batch in _batches(step):
        grads.append(torch.cat([g.flatten() for g in torch.autograd.grad(_mse(model, batch),
                                                                          params)]))
    small = sum(float(g.square().sum()) for g in grads) / len(grads)
    big = float(torch.stack(grads).mean(0).square().sum())
    return two_batch_estimates(small, big, SIZE, SIZE * MICRO)


def _run(monitor: NoiseScaleMonitor, model: nn.Module, *, scaler=None, optimizer=None,
         clip: float | None = None, divide: bool = True) -> None:
    for step in range(STEPS):
        for batch in _batches(step):
            loss = _mse(model, batch) / (MICRO if divide else 1)
            (scaler.scale(loss) if scaler is not None else loss).backward()
        if clip is not None:
            if scaler is not None:
                scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        monitor.step()
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        model.zero_grad(set_to_none=True)


def _check(monitor: NoiseScaleMonitor, model: nn.Module) -> None:
    history = monitor.result().history
    assert len(history) == STEPS
    for step, sample in enumerate(history):
        g2, trace = _expected(model, step)
        assert sample.grad_sq_norm == pytest.approx(g2, rel=1e-4)
        assert sample.trace_sigma == pytest.approx(trace, rel=1e-4)


@pytest.fixture(params=["every backward", "the last backward"])
def hooks(request):
    """Read the accumulated gradient after every backward, or (told the number of
    micro-batches per step) after the last one only."""
    return {"accumulation_steps": MICRO if request.param == "the last backward" else None}


def test_each_step_matches_the_micro_batches_own_gradients(hooks):
    model = _model()
    with NoiseScaleMonitor(model, keep_history=True, **hooks) as monitor:  # batch from forward
        _run(monitor, model)
    _check(monitor, model)
    r = monitor.result()
    assert (r.batch_small, r.batch_big, r.steps, r.method) == (SIZE, SIZE * MICRO, STEPS,
                                                                "microbatch")
    assert set(monitor.metrics()) >= {"b_simple", "grad_sq_norm", "trace_sigma"}


def test_amp_scale_is_undone_with_the_scale_of_each_backward(hooks):
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # the weights stay put
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12, growth_interval=1)
    with NoiseScaleMonitor(model, grad_scaler=scaler, keep_history=True, **hooks) as monitor:
        _run(monitor, model, scaler=scaler, optimizer=optimizer)
    assert scaler.get_scale() == 2.0 ** 15  # it doubled after each of the 3 steps
    _check(monitor, model)


def test_measured_before_clipping(hooks):
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    with NoiseScaleMonitor(model, grad_scaler=scaler, keep_history=True, **hooks) as monitor:
        _run(monitor, model, scaler=scaler, optimizer=optimizer, clip=1e-4)
    _check(monitor, model)


def test_a_loop_that_sums_micro_batch_losses_says_so_with_loss_scale():
    model = _model()
    with NoiseScaleMonitor(model, loss_scale=1.0, accumulation_steps=MICRO,
                           keep_history=True) as monitor:
        _run(monitor, model, divide=False)
    _check(monitor, model)


def test_one_gradient_per_step_on_one_process_is_a_clear_error():
    model = _model()
    monitor = NoiseScaleMonitor(model)
    _mse(model, _batches(0)[0]).backward()
    with pytest.raises(InvalidInputError, match="two or more"):
        monitor.step()
    monitor.close()


def test_a_short_micro_batch_skips_the_step():
    model = _model()
    with NoiseScaleMonitor(model) as monitor:
        for batch in _batches(0, sizes=(SIZE, SIZE, 3)):
            (_mse(model, batch) / 3).backward()
        assert monitor.step()
    r = monitor.result()
    assert (r.steps, r.skipped_steps) == (0, 1) and any("skipped" in n for n in r.notes)


def test_every_n_steps_and_close():
    model = _model()
    monitor = NoiseScaleMonitor(model, every=2, batch_size=SIZE)
    measured = []
    for step in range(4):
        for batch in _batches(step):
            (_mse(model, batch) / MICRO).backward()
        measured.append(monitor.step())
        model.zero_grad()
    assert measured == [True, False, True, False]
    assert monitor.result().steps == 2
    monitor.close()
    for batch in _batches(0):
        _mse(model, batch).backward()  # no hooks left: nothing recorded
    assert not monitor._micro and monitor.result().steps == 2


def test_bad_arguments():
    with pytest.raises(InvalidInputError, match="no trainable parameter"):
        NoiseScaleMonitor(nn.Linear(2, 2).requires_grad_(False))
    with pytest.raises(InvalidInputError, match="every"):
        NoiseScaleMonitor(nn.Linear(2, 2), every=0)

    class FullyShardedDataParallel(nn.Module):  # what torch's FSDP wrapper is called
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.Linear(2, 2)

    with pytest.raises(InvalidInputError, match="shards the gradients"):
        NoiseScaleMonitor(FullyShardedDataParallel())
