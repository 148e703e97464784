"""Tests of the real-step measurement (the reference every CPU prediction is checked against).

Expected peaks are derived by hand in comments from what each op allocates, never
copied from the code's output. Both instruments must give the hand-derived number.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from batchfit.engine.spec import TrainConfig
from batchfit.errors import InvalidInputError, ModelSpecError
from batchfit.realrun.measure import MeasuredStep, MeasureMethod, measure_step

METHODS = ["profiler", "tracker"]
F32 = 4

# nn.Linear(1024, 1024) at batch 16:
W = 1024 * 1024 * F32            # weight:          4,194,304
BIAS = 1024 * F32                # bias:                4,096
PARAMS = W + BIAS                # 4,198,400
X = 16 * 1024 * F32              # the input batch:    65,536 (the output is the same size)
SCALAR = F32                     # a 0-d fp32 tensor


def linear() -> nn.Module:
    return nn.Linear(1024, 1024)


@pytest.mark.parametrize("method", METHODS)
def test_linear_sgd_step_matches_hand_count(method: str) -> None:
    # Steady step (step 2) of Linear(1024, 1024), plain SGD, B=16, default loss
    # (2-D output -> cross-entropy against random targets):
    #   live between steps: params + grads of step 1 + input   (SGD keeps no state)
    #   zero_grad(set_to_none) frees the grads          -> PARAMS + X
    #   forward: addmm output (X); log_softmax output (X, saved for backward);
    #     targets, the loss and nll's total_weight are a few bytes. `del output`
    #     drops the addmm output: addmm saves its inputs, not its result.
    #   backward: ones for the loss (SCALAR); nll_loss_backward -> X;
    #     log_softmax_backward -> X (log_softmax's saved output and nll's grad are
    #     released as their nodes finish); AddmmBackward: grad W = grad^T @ x (W) while
    #     grad_output (X) is alive, then the bias grad = grad_output.sum(0) (BIAS).
    #   peak, at the bias grad: PARAMS + X (input) + X (grad_output) + W + BIAS
    #                           + loss + its seed gradient (2 scalars)
    expected = PARAMS + X + X + W + BIAS + 2 * SCALAR            # 8,527,880
    run = measure_step(linear, (1024,), 16, TrainConfig(optimizer="sgd"), method=method)
    assert run.method is MeasureMethod(method)
    assert run.baseline_bytes == PARAMS + PARAMS + X              # 8,462,336
    assert run.peak_bytes == expected
    # Step 1 starts without grads and ends like step 2 (no optimizer state to create).
    assert run.first_step_peak_bytes == expected


@pytest.mark.parametrize("method", METHODS)
def test_linear_momentum_first_step_differs(method: str) -> None:
    # SGD with momentum keeps one buffer per parameter (PARAMS bytes), created in step 1
    # as clone(grad); the for-loop update (buf.mul_().add_(grad); p.add_(buf)) is in place.
    #   step 1: backward peak as above (8,527,880); then in the optimizer
    #     params + grads + input + new buffers = 3 * PARAMS + X = 12,660,736  <- peak
    #   step 2: backward peak with the buffers alive: 8,527,880 + PARAMS = 12,726,280
    backward_peak = PARAMS + X + X + W + BIAS + 2 * SCALAR
    run = measure_step(linear, (1024,), 16, TrainConfig(optimizer="momentum"), method=method)
    assert run.first_step_peak_bytes == 3 * PARAMS + X
    assert run.peak_bytes == backward_peak + PARAMS
    assert run.baseline_bytes == 3 * PARAMS + X


@pytest.mark.parametrize("method", METHODS)
def test_linear_inference_is_params_input_output(method: str) -> None:
    # eval + no_grad: the output (X) is the only new tensor.
    run = measure_step(linear, (1024,), 16, TrainConfig(mode="infer"), steps=1, method=method)
    assert run.peak_bytes == run.first_step_peak_bytes == PARAMS + X + X
    assert run.baseline_bytes == PARAMS + X


def test_pure_bf16_halves_params_and_input() -> None:
    # precision="bf16": the weights and the float input are bfloat16 (2 bytes each).
    run = measure_step(linear, (1024,), 16, TrainConfig(mode="infer", precision="bf16"),
                       steps=1, method="tracker")
    assert run.baseline_bytes == PARAMS // 2 + X // 2
    assert run.peak_bytes == PARAMS // 2 + X // 2 + X // 2


class TinyCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16),
                                      nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


@pytest.mark.slow
def test_instruments_agree_and_count_optimizer_state() -> None:
    config = TrainConfig(optimizer="adamw")
    runs = {m: measure_step(TinyCNN, (3, 32, 32), 8, config, method=m) for m in METHODS}
    profiled, tracked = runs["profiler"], runs["tracker"]
    # Between steps: params, BatchNorm buffers, grads, AdamW's exp_avg and exp_avg_sq
    # (one each per param) and its 0-d fp32 `step` per param, plus the input.
    model = TinyCNN()
    params = sum(p.numel() * F32 for p in model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    n_params = len(list(model.parameters()))
    inputs = 8 * 3 * 32 * 32 * F32
    expected_baseline = 4 * params + n_params * SCALAR + buffers + inputs
    assert tracked.baseline_bytes == profiled.baseline_bytes == expected_baseline
    # The profiler also sees what kernels allocate and free inside; never less.
    assert profiled.peak_bytes >= tracked.peak_bytes > tracked.baseline_bytes
    assert profiled.peak_bytes <= tracked.peak_bytes * 1.05


@pytest.mark.slow
def test_measuring_leaves_global_state_alone() -> None:
    torch.manual_seed(1234)
    state = torch.get_rng_state()
    expected_next = torch.rand(4)
    torch.set_rng_state(state)
    dtype, grad = torch.get_default_dtype(), torch.is_grad_enabled()
    for method in METHODS:
        measure_step(TinyCNN, (3, 16, 16), 2, TrainConfig(optimizer="adamw"), method=method)
        measure_step(TinyCNN, (3, 16, 16), 2, TrainConfig(mode="infer"), method=method)
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(torch.rand(4), expected_next)
    assert torch.get_default_dtype() == dtype and torch.is_grad_enabled() == grad


def test_result_is_a_frozen_record_with_json() -> None:
    run = measure_step(linear, (1024,), 2, TrainConfig(mode="infer"), method="tracker")
    assert isinstance(run, MeasuredStep)
    data = run.to_dict()
    assert data["method"] == "tracker" and data["peak_bytes"] == run.peak_bytes
    with pytest.raises(AttributeError):
        run.peak_bytes = 0  # type: ignore[misc]


@pytest.mark.parametrize("kwargs, match", [
    ({"steps": 1}, "steps must be"),
    ({"method": "rss"}, "measurement method"),
])
def test_bad_options_are_rejected(kwargs: dict, match: str) -> None:
    with pytest.raises(InvalidInputError, match=match):
        measure_step(linear, (1024,), 2, TrainConfig(), **kwargs)


def test_module_instead_of_factory_is_rejected() -> None:
    with pytest.raises(InvalidInputError, match="factory"):
        measure_step(nn.Linear(4, 4), (4,), 2, TrainConfig())  # type: ignore[arg-type]


def test_factory_returning_a_non_module_is_rejected() -> None:
    with pytest.raises(ModelSpecError, match="not a torch.nn.Module"):
        measure_step(lambda: 42, (4,), 2, TrainConfig(mode="infer"))  # type: ignore[arg-type]
