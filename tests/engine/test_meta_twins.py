"""Decomposed ops of a CUDA-target trace run on meta twins (``_torch_internals.MetaTwins``).

The oracle is torch's own fake path on *fake CUDA tensors*: FakeTensorMode runs the
op's decomposition with CUDA semantics there. The twins are given fake CPU tensors,
as a trace gives them (the CUDA emulation traces on the CPU), and must answer what the
CUDA oracle answers: sizes, strides, dtypes, storage offsets, storage sizes and which
outputs share a storage.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from batchfit.device.profile import resolve_device
from batchfit.engine import _torch_internals as ti
from batchfit.engine import tracer as tracer_module
from batchfit.engine.spec import TrainConfig
from batchfit.engine.trace import trace_step
from batchfit.engine.tracer import Category, EventKind

aten = torch.ops.aten
F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32


class Make:
    """Tensors of the current fake mode on one device (values never matter)."""

    def __init__(self, device: str) -> None:
        self.device = device

    def __call__(self, *shape, dtype=F32, channels_last=False):
        t = torch.empty(*shape, dtype=dtype, device=self.device)
        return t.contiguous(memory_format=torch.channels_last) if channels_last else t

    def ints(self, *shape):
        return torch.zeros(*shape, dtype=torch.long, device=self.device)


def _bn_backward(m, training, mask):
    x = m(4, 6, 5, 5, dtype=F16, channels_last=True)
    return ((m(4, 6, 5, 5, dtype=F16, channels_last=True), x, m(6), m(6), m(6), m(6), m(6),
             training, 1e-5, mask), {})


#: (op, builder of (args, kwargs)); every op of ``meta_twin_ops()`` appears at least once.
CASES = {
    "bn_train_amp": (aten.native_batch_norm.default, lambda m: (
        (m(4, 6, 5, 5, dtype=F16), m(6), m(6), m(6), m(6), True, 0.1, 1e-5), {})),
    "bn_train_channels_last": (aten.native_batch_norm.default, lambda m: (
        (m(4, 6, 5, 5, channels_last=True), m(6), m(6), m(6), m(6), True, 0.1, 1e-5), {})),
    "bn_eval": (aten.native_batch_norm.default, lambda m: (
        (m(4, 6, 5, 5), m(6), m(6), m(6), m(6), False, 0.1, 1e-5), {})),
    "bn_1d_no_affine": (aten.native_batch_norm.default, lambda m: (
        (m(8, 6, dtype=BF16), None, None, m(6), m(6), True, 0.1, 1e-5), {})),
    "bn_backward": (aten.native_batch_norm_backward.default,
                    lambda m: _bn_backward(m, True, [True, True, True])),
    "bn_backward_input_only": (aten.native_batch_norm_backward.default,
                               lambda m: _bn_backward(m, True, [True, False, False])),
    "bn_backward_eval": (aten.native_batch_norm_backward.default,
                         lambda m: _bn_backward(m, False, [True, True, True])),
    "bn_legit_no_training": (aten._native_batch_norm_legit_no_training.default, lambda m: (
        (m(4, 6, 5, 5, dtype=F16), m(6), m(6), m(6), m(6), 0.1, 1e-5), {})),
    "cudnn_bn": (aten.cudnn_batch_norm.default, lambda m: (
        (m(4, 6, 5, 5, dtype=F16), m(6), m(6), m(6), m(6), True, 0.1, 1e-5), {})),
    "cudnn_bn_backward": (aten.cudnn_batch_norm_backward.default, lambda m: (
        (m(4, 6, 5, 5), m(4, 6, 5, 5), m(6), m(6), m(6), m(6), m(6), 1e-5,
         m(0, dtype=torch.uint8)), {})),
    "layer_norm_backward": (aten.native_layer_norm_backward.default, lambda m: (
        (m(3, 5, 8, dtype=BF16), m(3, 5, 8, dtype=BF16), [8], m(3, 5, 1), m(3, 5, 1),
         m(8), m(8), [True, True, True]), {})),
    "group_norm_backward": (aten.native_group_norm_backward.default, lambda m: (
        (m(2, 4, 6, dtype=F16), m(2, 4, 6, dtype=F16), m(2, 2), m(2, 2), m(4), 2, 4, 6, 2,
         [True, True, True]), {})),
    "threshold_backward": (aten.threshold_backward.default, lambda m: (
        (m(4, 6, 5, 5, dtype=F16, channels_last=True), m(4, 6, 5, 5, dtype=F16,
                                                          channels_last=True), 0), {})),
    "gelu_backward_tanh": (aten.gelu_backward.default, lambda m: (
        (m(3, 8, dtype=BF16), m(3, 8, dtype=BF16)), {"approximate": "tanh"})),
    "silu_backward": (aten.silu_backward.default, lambda m: ((m(3, 8), m(3, 8)), {})),
    "sigmoid_backward": (aten.sigmoid_backward.default, lambda m: ((m(3, 8), m(3, 8)), {})),
    "tanh_backward": (aten.tanh_backward.default, lambda m: (
        (m(3, 8, dtype=F16), m(3, 8, dtype=F16)), {})),
    "hardswish_backward": (aten.hardswish_backward.default, lambda m: (
        (m(3, 8), m(3, 8)), {})),
    "hardsigmoid_backward": (aten.hardsigmoid_backward.default, lambda m: (
        (m(3, 8), m(3, 8)), {})),
    "leaky_relu_backward": (aten.leaky_relu_backward.default, lambda m: (
        (m(3, 8), m(3, 8), 0.01, False), {})),
    "elu_backward": (aten.elu_backward.default, lambda m: (
        (m(3, 8), 1.0, 1.0, 1.0, False, m(3, 8)), {})),
    "mish_backward": (aten.mish_backward.default, lambda m: ((m(3, 8), m(3, 8)), {})),
    "softmax_backward": (aten._softmax_backward_data.default, lambda m: (
        (m(2, 3, 8, dtype=F16), m(2, 3, 8, dtype=F16), -1, F16), {})),
    "log_softmax_backward": (aten._log_softmax_backward_data.default, lambda m: (
        (m(4, 8), m(4, 8), 1, F16), {})),
    "log_softmax_half_to_float": (aten._log_softmax.default, lambda m: (
        (m(4, 8, dtype=F16), 1, True), {})),
    "addmm": (aten.addmm.default, lambda m: ((m(6, dtype=F16), m(4, 5, dtype=F16),
                                              m(5, 6, dtype=F16)), {})),
    "addmm_scaled_transposed": (aten.addmm.default, lambda m: (
        (m(4, 6), m(4, 5), m(6, 5).t()), {"beta": 0.5, "alpha": 2})),
    "nll_loss": (aten.nll_loss_forward.default, lambda m: (
        (m(4, 7), m.ints(4), None, 1, -100), {})),
    "nll_loss_backward": (aten.nll_loss_backward.default, lambda m: (
        (m(()), m(4, 7), m.ints(4), None, 1, -100, m(())), {})),
    "mse_loss": (aten.mse_loss.default, lambda m: ((m(4, 3), m(4, 3), 1), {})),
    "mse_loss_none": (aten.mse_loss.default, lambda m: ((m(4, 3), m(4, 3), 0), {})),
    "mse_loss_backward": (aten.mse_loss_backward.default, lambda m: (
        (m(()), m(4, 3), m(4, 3), 1), {})),
    "to_copy_autocast": (aten._to_copy.default, lambda m: ((m(6, 5),), {"dtype": F16})),
    "to_copy_channels_last_preserved": (aten._to_copy.default, lambda m: (
        (m(2, 3, 4, 4, channels_last=True),), {"dtype": BF16})),
    "to_copy_memory_format": (aten._to_copy.default, lambda m: (
        (m(2, 3, 4, 4),), {"memory_format": torch.channels_last})),
}


def layout(outputs):
    """(size, stride, dtype, storage offset, storage bytes, storage index) per output."""
    outputs = (outputs,) if isinstance(outputs, torch.Tensor) else outputs
    storages: dict[int, int] = {}
    rows = []
    for t in outputs:
        if t is None:
            rows.append(None)
            continue
        key = t.untyped_storage()._cdata
        storages.setdefault(key, len(storages))
        rows.append((tuple(t.shape), t.stride(), t.dtype, t.storage_offset(),
                     t.untyped_storage().nbytes(), storages[key]))
    return rows


def run_case(name):
    func, build = CASES[name]
    with ti.new_fake_mode():
        args, kwargs = build(Make("cuda"))
        expected = func(*args, **kwargs)
    with ti.new_fake_mode() as mode:
        args, kwargs = build(Make("cpu"))
        actual = ti.MetaTwins()(func, args, kwargs)
    return expected, actual, mode


def test_every_op_has_a_case():
    assert {func for func, _ in CASES.values()} == set(ti.meta_twin_ops())


@pytest.mark.parametrize("func", sorted(ti.meta_twin_ops(), key=str), ids=str)
def test_ops_return_fresh_tensors_and_mutate_nothing(func):
    """What the twins rely on: a rebuilt output can alias nothing that was passed in."""
    assert all(arg.alias_info is None for arg in func._schema.arguments)
    assert all(ret.alias_info is None for ret in func._schema.returns)


@pytest.mark.parametrize("name", sorted(CASES))
def test_twins_answer_what_the_fake_path_answers_on_fake_cuda_tensors(name):
    expected, actual, mode = run_case(name)
    assert actual is not ti.RUN
    assert layout(actual) == layout(expected)
    outputs = (actual,) if isinstance(actual, torch.Tensor) else actual
    for t in outputs:
        if t is not None:  # fake tensors of the trace's mode, on the trace's device
            assert t.fake_mode is mode and t.device == torch.device("cpu")
            assert not t.requires_grad


def test_batch_norm_saves_float32_statistics_of_the_channels_as_cuda_does():
    """By hand: CUDA's batch_norm keeps its saved mean and inverse std in the
    accumulate type (float32 for fp16 input), one per channel, in eval too
    (``batch_norm_cuda`` in ``aten/src/ATen/native/cuda/Normalization.cu``); the CPU
    kernel keeps them in the input dtype, and none in eval."""
    for training in (True, False):
        with ti.new_fake_mode():
            m = Make("cpu")
            args = (m(4, 6, 5, 5, dtype=F16), m(6), m(6), m(6), m(6), training, 0.1, 1e-5)
            out, mean, invstd = ti.MetaTwins()(aten.native_batch_norm.default, args, {})
            cpu_mean = aten.native_batch_norm.default(*args)[1]
        assert out.dtype == F16 and out.shape == (4, 6, 5, 5)
        assert (mean.dtype, tuple(mean.shape), tuple(invstd.shape)) == (F32, (6,), (6,))
        assert tuple(cpu_mean.shape) == ((6,) if training else (0,))
        assert cpu_mean.dtype == F16


def test_a_repeated_signature_rebuilds_from_the_recipe_with_fresh_storages():
    twins = ti.MetaTwins()
    with ti.new_fake_mode():
        m = Make("cpu")
        args = (m(4, 6, 5, 5, dtype=F16), m(6), m(6), m(6), m(6), True, 0.1, 1e-5)
        first = twins(aten.native_batch_norm.default, args, {})
        second = twins(aten.native_batch_norm.default, args, {})
    assert len(twins._recipes) == 1
    assert layout(first) == layout(second)
    assert {t.untyped_storage()._cdata for t in first}.isdisjoint(
        t.untyped_storage()._cdata for t in second)


def test_the_recipe_cache_is_bounded():
    twins = ti.MetaTwins(limit=2)
    with ti.new_fake_mode():
        m = Make("cpu")
        for n in range(1, 6):
            twins(aten.threshold_backward.default, (m(n, 3), m(n, 3), 0), {})
            assert len(twins._recipes) <= 2


def test_anything_unexpected_runs_the_op_as_before():
    twins = ti.MetaTwins()
    with ti.new_fake_mode():
        m = Make("cpu")
        x = m(4, 3)
        assert twins(aten.mm.default, (x, m(3, 2)), {}) is ti.RUN  # not a listed op
        assert twins(aten._to_copy.default, (x,), {"device": torch.device("cpu")}) is ti.RUN
        assert twins(aten.addmm.default, (m(2), x, m(5, 2)), {}) is ti.RUN  # fails on meta
        with ti.new_fake_mode():  # a tensor of another fake mode
            other = Make("cpu")(4, 3)
        assert twins(aten.mse_loss.default, (x, other, 1), {}) is ti.RUN
        with ti.no_dispatch_modes():
            real, meta = torch.zeros(4, 3), torch.zeros(4, 3, device="meta")
        assert twins(aten.mse_loss.default, (x, real, 1), {}) is ti.RUN
        assert twins(aten.mse_loss.default, (x, meta, 1), {}) is ti.RUN
        assert twins(aten.mse_loss.default, (x, x, 1), {}) is not ti.RUN


def test_recipes_keep_storage_sharing_and_refuse_aliases():
    def two_views(x):
        whole = torch.empty(2, 8, device=x.device)
        return whole[0], whole[1, 2:]

    with ti.new_fake_mode() as mode:
        x = Make("cpu")(3)
        recipe = ti._meta_recipe(two_views, (x,), {})
        first, second = ti._rebuild(recipe, mode, torch.device("cpu"))
        assert ti._meta_recipe(aten.alias.default, (x,), {}) is False
    assert recipe[1] == (64,)  # one storage of 2 x 8 float32
    assert first.untyped_storage()._cdata == second.untyped_storage()._cdata
    assert (tuple(second.shape), second.storage_offset()) == ((6,), 10)


# -- whole traces --------------------------------------------------------------------------


class TinyTransformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(16, 32)
        self.norm = nn.LayerNorm(32)
        self.attn = nn.MultiheadAttention(32, 4, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32), nn.SiLU())
        self.head = nn.Linear(32, 10)

    def forward(self, x):
        h = self.norm(self.embed(x))
        h = h + self.attn(h, h, h, need_weights=False)[0]
        h = h + self.mlp(h)
        return self.head(torch.tanh(h).mean(1))


def tiny_cnn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                         nn.Conv2d(16, 8, 3), nn.BatchNorm2d(8), nn.Hardswish(),
                         nn.Flatten(), nn.Linear(8 * 6 * 6, 10))


def events(model, shape, precision, device, monkeypatch, twins, mode="train"):
    monkeypatch.setattr(tracer_module, "META_TWINS", ti.MetaTwins() if twins else None)
    config = TrainConfig(precision=precision, optimizer="adamw", mode=mode)
    traced = trace_step(model, shape, 4, config, resolve_device(device))
    return [(e.kind, e.nbytes, e.category, e.op, e.phase, e.module)
            for e in traced.steady_events]


@pytest.mark.parametrize("precision", ["fp32", "amp-fp16", "amp-bf16"])
def test_a_trace_without_batch_norm_is_unchanged_event_for_event(precision, monkeypatch):
    torch.manual_seed(0)
    model = TinyTransformer()
    with_twins = events(model, (5, 16), precision, "A100-80GB", monkeypatch, True)
    without = events(model, (5, 16), precision, "A100-80GB", monkeypatch, False)
    assert with_twins == without
    assert any(e[3] == "aten.native_layer_norm_backward.default" for e in with_twins)


@pytest.mark.parametrize("mode", ["train", "infer"])
def test_a_batch_norm_trace_differs_only_by_the_saved_statistics(mode, monkeypatch):
    """amp-fp16 on an A100: each BatchNorm's saved mean and inverse std are C float32
    (4 C bytes, CUDA) where the fake CPU kernel saved C fp16 in training (2 C bytes)
    and nothing in eval. Everything else is the same event for event."""
    model = tiny_cnn()
    twins = events(model, (3, 8, 8), "amp-fp16", "A100-80GB", monkeypatch, True, mode)
    fake = events(model, (3, 8, 8), "amp-fp16", "A100-80GB", monkeypatch, False, mode)
    assert len(twins) == len(fake)
    differing = [(a, b) for a, b in zip(twins, fake) if a != b]
    channels = {16: 0, 8: 0}
    for a, b in differing:
        assert a[0] is b[0] and a[2:] == b[2:] and a[2] is Category.ACTIVATIONS
        channels_here = a[1] // 4
        assert b[1] == (2 * channels_here if mode == "train" else 0)
        channels[channels_here] += a[0] is EventKind.ALLOC
    # two statistics per BatchNorm; the trace holds one step (allocations counted once)
    assert channels == {16: 2, 8: 2}


def test_cpu_targets_keep_the_cpu_kernels_statistics(monkeypatch):
    """A CPU target never uses the twins: in eval the CPU batch norm saves nothing."""
    bn_allocs = [e for e in events(tiny_cnn(), (3, 8, 8), "fp32", "cpu", monkeypatch, True,
                                   "infer")
                 if e[0] is EventKind.ALLOC and e[3] == "aten.native_batch_norm.default"]
    assert sorted(e[1] for e in bn_allocs) == [0, 0, 0, 0, 4 * (4 * 8 * 6 * 6),
                                              4 * (4 * 16 * 8 * 8)]
