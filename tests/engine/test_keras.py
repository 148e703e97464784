"""Keras 3 models (torch backend): the prediction of Keras's own training step against the
same step run for real by ``model.fit`` on the CPU, measured by the profiler's allocator
events (:func:`batchfit.realrun.measure.measure_keras_fit`, independent of the trace: a
real fit on real tensors). Target: within 2%, as for torch models.

The reference batches are made here by hand for each model (not by batchfit): what ``fit``
gets is what a user would pass it.
"""

from __future__ import annotations

import pytest
import torch

keras = pytest.importorskip("keras")  # optional (the GPU machine lacks it): skip, not error

import batchfit
import keras_models
from batchfit import Category, TensorSpec
from batchfit.engine import keras_step
from batchfit.errors import InvalidInputError
from batchfit.realrun.measure import measure_keras_fit

TOLERANCE = 0.02


def _labels(batch: int, classes: int) -> torch.Tensor:
    return torch.randint(0, classes, (batch,), generator=torch.Generator().manual_seed(1))


def _data(name: str, batch: int) -> tuple:
    g = torch.Generator().manual_seed(0)
    if name == "sequential_cnn":
        return torch.randn(batch, 32, 32, 3, generator=g), _labels(batch, 10)
    if name == "two_inputs":
        x = [torch.randn(batch, 24, 24, 3, generator=g), torch.randn(batch, 12, generator=g)]
        return x, torch.softmax(torch.randn(batch, 5, generator=g), dim=1)
    if name == "subclassed":
        return torch.randn(batch, 64, generator=g), _labels(batch, 10)
    return torch.randn(batch, 32, 32, 3, generator=g), _labels(batch, 10)  # mixed_bfloat16_cnn


def _build(name: str):
    def build():
        built = getattr(keras_models, name)()
        return built[0] if isinstance(built, tuple) else built
    return build


CASES = {  # model -> (batch size, input spec for the prediction: None = read from the model)
    "sequential_cnn": (32, None),
    "two_inputs": (32, None),
    "subclassed": (64, TensorSpec((64,))),
    "mixed_bfloat16_cnn": (16, None),
}


@pytest.mark.parametrize("name", list(CASES))
def test_keras_prediction_matches_real_fit(name: str) -> None:
    batch, spec = CASES[name]
    predicted = batchfit.estimate(_build(name), spec, batch, device="cpu")
    x, y = _data(name, batch)
    measured = measure_keras_fit(_build(name), x, y, steps=2)
    error = (predicted.peak_allocated_bytes - measured.peak_bytes) / measured.peak_bytes
    assert abs(error) <= TOLERANCE, (
        f"{name}: predicted {predicted.peak_allocated_bytes:,} B, measured "
        f"{measured.peak_bytes:,} B ({error:+.2%})")


def test_keras_steady_step_keeps_last_steps_gradients_through_forward() -> None:
    # Keras's train_step calls zero_grad() after the forward pass: the steady step starts
    # with the previous step's gradients alive (the first step has none), and they are
    # freed before the loss. The sequential CNN's trainable weights, by hand: conv_a
    # 3*3*3*16+16, BN 2*16, conv 3*3*16*32+32, dense (13*13*32)*64+64, dense 64*10+10.
    from batchfit.device.profile import DeviceProfile
    from batchfit.engine.spec import TrainConfig
    from batchfit.engine.trace import trace_step
    from batchfit.engine.tracer import EventKind, Phase

    weights = 448 + 32 + 4640 + (13 * 13 * 32) * 64 + 64 + 650
    trace = trace_step(keras_models.sequential_cnn, TensorSpec((32, 32, 3)), 4, TrainConfig(),
                       DeviceProfile.cpu())
    assert trace.trainable_parameter_count == weights

    def gradients(events, phase, kind=EventKind.ALLOC):
        return sum(e.nbytes for e in events if e.phase is phase and e.kind is kind
                   and e.category is Category.GRADIENTS)

    assert gradients(trace.steady_events, Phase.SETUP) == weights * 4
    assert gradients(trace.first_events, Phase.SETUP) == 0
    assert gradients(trace.steady_events, Phase.ZERO_GRAD, EventKind.FREE) == weights * 4


def test_keras_layer_names_in_the_breakdown() -> None:
    est = batchfit.estimate(keras_models.sequential_cnn, None, 64, device="cpu")
    modules = {m.module for m in est.top_modules}
    assert "conv_a" in modules  # the user's own name
    assert modules & {"batch_normalization", "max_pooling2d", "conv2d"}  # Keras's names,
    # numbered as in a fresh process however many models this process built before


def test_keras_mixed_float16_is_keras_casts_not_torch_autocast() -> None:
    # amp-fp16 on a Keras model means its mixed_float16 policy: float32 variables, a
    # float16 cast of each kernel where a layer reads it (kept for backward), and a
    # LossScaleOptimizer. At batch 2048 the peak is in the forward pass, where the second
    # layer's float16 kernel (512*512*2 bytes) is alive, kept for its input gradient (the
    # first layer's is not: its input needs no gradient). On a CUDA target Keras takes
    # its GPU path: on "cpu" its matmul computes float16 in float32 (an fp32 copy of
    # each operand), which would double these activations.
    def build():
        model = keras.Sequential([keras.Input((512,)), keras.layers.Dense(512),
                                  keras.layers.Dense(512), keras.layers.Dense(10)])
        model.compile(optimizer="sgd", loss="mse")
        return model

    est = batchfit.estimate(build, None, 2048, device="RTX 3090", precision="amp-fp16")
    assert est.by_category.get(Category.AUTOCAST_COPIES, 0) >= 512 * 512 * 2
    # activations at the peak (the second layer's bias add): the input's float16 cast, the
    # first layer's output, the second layer's matmul output and its sum with the bias,
    # each 2048*512 float16; no float32 copies
    assert est.by_category[Category.ACTIVATIONS] == 4 * 2048 * 512 * 2
    fp32 = batchfit.estimate(build, None, 2048, device="RTX 3090")
    assert fp32.by_category.get(Category.AUTOCAST_COPIES, 0) == 0


def test_users_keras_model_is_never_changed() -> None:
    model = keras_models.sequential_cnn()
    before = [v.numpy().copy() for v in model.variables]
    names = [layer.name for layer in model.layers]
    batchfit.estimate(model, None, 16, device="cpu")
    assert [layer.name for layer in model.layers] == names
    assert all((a == v.numpy()).all() for a, v in zip(before, model.variables))
    assert not model.optimizer.built  # batchfit traced a copy, not this model


def test_uncompiled_keras_model_takes_the_optimizer_option() -> None:
    est = batchfit.estimate(keras_models.uncompiled, None, 4, device="cpu", optimizer="momentum")
    # SGD with momentum: one float32 slot per weight: (16*8+8 + 8*4+4) * 4 bytes
    assert est.by_category[Category.OPTIMIZER_STATE] >= (16 * 8 + 8 + 8 * 4 + 4) * 4


def test_keras_model_with_a_torch_optimizer_is_refused() -> None:
    with pytest.raises(InvalidInputError, match="Keras optimizer"):
        batchfit.estimate(keras_models.uncompiled, None, 4, optimizer=torch.optim.SGD)


def test_input_spec_read_from_the_keras_model() -> None:
    assert keras_step.input_spec(keras_models.two_inputs()) == (
        TensorSpec((24, 24, 3)), TensorSpec((12,)))


class _GradModeProbe(keras.layers.Layer):
    """Records, at each call, whether torch's inference mode and grad mode are on."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[bool, bool]] = []

    def call(self, x):
        self.seen.append((torch.is_inference_mode_enabled(), torch.is_grad_enabled()))
        return x


@pytest.mark.parametrize("inference_mode", [False, True])
def test_keras_inference_step_runs_under_the_users_grad_mode(inference_mode: bool) -> None:
    # A real inference run (bench, search) runs what the user's loop runs:
    # torch.inference_mode() with TrainConfig.inference_mode, no_grad otherwise; a trace
    # (mark_phases) always no_grad.
    from batchfit.engine.spec import Mode

    probe = _GradModeProbe()
    model = keras.Sequential([keras.Input((4,)), probe, keras.layers.Dense(2)])
    config = batchfit.TrainConfig(mode=Mode.INFER, inference_mode=inference_mode)
    batch = (torch.randn(3, 4), None)
    keras_step.KerasStepRunner(model, config, batch).infer_step()
    keras_step.KerasStepRunner(model, config, batch, mark_phases=True).infer_step()
    assert probe.seen[-2:] == [(inference_mode, False), (False, False)]
