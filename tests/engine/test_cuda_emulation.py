"""Tests of the CUDA emulation: autocast policy, its weight cache, checkpointing, SDPA.

Expected dtypes come from two independent places: CUDA's op lists as written in
``aten/src/ATen/autocast_mode.h`` (by hand, in the tests below), and torch's own
CUDA autocast kernels, which run here on *fake CUDA tensors*: with CUDA autocast
switched on at the C++ level (``torch.set_autocast_enabled("cuda", True)``; the
Python context manager refuses without a GPU) the real ``AutocastCUDA`` wrappers
cast fake CUDA tensors exactly as they would cast real ones. That oracle covers
forward dtypes and the dtypes/shapes autograd saves; backward on fake CUDA
tensors needs a GPU, so backward is checked by hand.
"""

from __future__ import annotations

import contextlib
import doctest
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from batchfit.engine.autocast import CUDA_AUTOCAST_POLICY, CastPolicy
from batchfit.engine.cuda_emulation import CudaEmulation
from batchfit.engine.sdpa import SdpaBackend, SdpaProblem, choose_sdpa_backend

F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
LOW = [F16, BF16]


# -- helpers ----------------------------------------------------------------------------


@contextlib.contextmanager
def real_cuda_autocast(dtype):
    """CUDA autocast at the C++ level: what ``torch.autocast("cuda")`` does on a GPU."""
    state = (torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"))
    torch.set_autocast_enabled("cuda", True)
    torch.set_autocast_dtype("cuda", dtype)
    try:
        yield
    finally:
        torch.set_autocast_enabled("cuda", state[0])
        torch.set_autocast_dtype("cuda", state[1])


class Maker:
    """Creates tensors on one device, deterministic shapes, values irrelevant."""

    def __init__(self, device, low=F16):
        self.device = device
        self.low = low  # the autocast dtype of the run

    def __call__(self, *shape, dtype=F32, grad=False):
        return torch.randn(*shape, device=self.device, dtype=dtype).requires_grad_(grad)

    def ints(self, *shape, high=4):
        return torch.randint(0, high, shape, device=self.device)


def saved_signature(fn):
    """Run ``fn`` and return (result, sorted (dtype, shape) of every tensor autograd saves)."""
    saved = []

    def pack(t):
        saved.append((str(t.dtype), tuple(t.shape)))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = fn()
    return result, sorted(saved)


def dtypes_of(result):
    if isinstance(result, torch.Tensor):
        return result.dtype
    return tuple(dtypes_of(r) for r in result if isinstance(r, torch.Tensor | tuple | list))


def run_oracle(case, dtype):
    """``case`` under real CUDA autocast on fake CUDA tensors."""
    with FakeTensorMode(), real_cuda_autocast(dtype):
        torch.manual_seed(0)
        return saved_signature(lambda: case(Maker("cuda", dtype)))


def run_emulated(case, dtype, compute_capability=(8, 0), fake=True):
    """``case`` under the emulation, on fake (or real) CPU tensors."""
    mode = FakeTensorMode() if fake else contextlib.nullcontext()
    emu = CudaEmulation(compute_capability, autocast_dtype=dtype)
    with mode, emu, emu.autocast_region():
        torch.manual_seed(0)
        return saved_signature(lambda: case(Maker("cpu", dtype)))


class OpCounter(TorchDispatchMode):
    """Records (op, input dtypes and shapes) of every aten op below autograd."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        self.calls.append((func, [(t.dtype, tuple(t.shape)) for t in tensors]))
        return func(*args, **(kwargs or {}))

    def count(self, func, shape=None):
        return sum(1 for f, ins in self.calls
                   if f is func and (shape is None or (ins and ins[0][1] == shape)))


# -- the op lists -------------------------------------------------------------------------


def test_every_op_torch_registers_for_cuda_autocast_has_a_policy():
    registered = {
        name.split("::")[1].split(".")[0]
        for name in torch._C._dispatch_get_all_op_names()
        if name.startswith("aten::")
        and torch._C._dispatch_has_kernel_for_dispatch_key(name, "AutocastCUDA")
    }
    assert registered, "no AutocastCUDA kernels found"
    assert registered <= set(CUDA_AUTOCAST_POLICY), registered - set(CUDA_AUTOCAST_POLICY)


def test_policy_table_matches_the_documented_lists():
    # autocast_mode.h: a sample of each list, by hand
    for name in ("linear", "matmul", "conv2d", "bmm", "baddbmm", "addmm", "einsum", "prelu",
                 "scaled_dot_product_attention", "lstm_cell", "_cudnn_rnn"):
        assert CUDA_AUTOCAST_POLICY[name] is CastPolicy.LOWER_PRECISION
    for name in ("exp", "pow", "layer_norm", "group_norm", "mse_loss", "nll_loss",
                 "binary_cross_entropy_with_logits", "kl_div", "logsumexp", "upsample_nearest2d"):
        assert CUDA_AUTOCAST_POLICY[name] is CastPolicy.FP32
    for name in ("softmax", "log_softmax", "sum", "prod", "cumsum", "linalg_vector_norm"):
        assert CUDA_AUTOCAST_POLICY[name] is CastPolicy.FP32_SET_OPT_DTYPE
    for name in ("addcmul", "addcdiv", "atan2", "bilinear", "cross", "dot", "index_put",
                 "scatter_add", "tensordot"):
        assert CUDA_AUTOCAST_POLICY[name] is CastPolicy.PROMOTE
    for name in ("cat", "stack", "relu", "add", "batch_norm", "gelu", "embedding"):
        assert name not in CUDA_AUTOCAST_POLICY
    assert CUDA_AUTOCAST_POLICY["binary_cross_entropy"] is CastPolicy.BANNED


# -- forward dtypes, against the documented lists ---------------------------------------

LOWER_CASES = {
    "linear": lambda m: F.linear(m(4, 8), m(16, 8), m(16)),
    "matmul": lambda m: torch.matmul(m(4, 8), m(8, 3)),
    "@": lambda m: m(4, 8) @ m(8, 3),
    "conv2d": lambda m: F.conv2d(m(2, 3, 8, 8), m(4, 3, 3, 3), m(4)),
    "bmm": lambda m: torch.bmm(m(2, 4, 8), m(2, 8, 3)),
    "baddbmm": lambda m: torch.baddbmm(m(2, 4, 3), m(2, 4, 8), m(2, 8, 3)),
}
FP32_CASES = {
    "layer_norm": lambda m, d: F.layer_norm(m(4, 8, dtype=d), (8,)),
    "softmax": lambda m, d: F.softmax(m(4, 8, dtype=d), dim=-1),
    "log_softmax": lambda m, d: F.log_softmax(m(4, 8, dtype=d), dim=-1),
    "exp": lambda m, d: torch.exp(m(4, 8, dtype=d)),
    "pow": lambda m, d: m(4, 8, dtype=d) ** 2,
    "mse_loss": lambda m, d: F.mse_loss(m(4, 8, dtype=d), m(4, 8, dtype=d)),
    "cross_entropy": lambda m, d: F.cross_entropy(m(4, 8, dtype=d), m.ints(4, high=8)),
}


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("name", sorted(LOWER_CASES))
def test_lower_precision_ops_run_in_the_autocast_dtype(name, dtype):
    (out, _), = [run_emulated(LOWER_CASES[name], dtype)]
    assert out.dtype == dtype


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("name", sorted(FP32_CASES))
def test_fp32_ops_given_low_precision_inputs_return_fp32(name, dtype):
    out, _ = run_emulated(lambda m: FP32_CASES[name](m, dtype), dtype)
    assert out.dtype == F32


@pytest.mark.parametrize("dtype", LOW)
def test_promote_ops_run_in_the_widest_input_dtype(dtype):
    out, _ = run_emulated(lambda m: torch.addcmul(m(4), m(4, dtype=dtype), m(4, dtype=dtype)),
                          dtype)
    assert out.dtype == F32
    out, _ = run_emulated(lambda m: torch.addcmul(*(m(4, dtype=dtype) for _ in range(3))), dtype)
    assert out.dtype == dtype


@pytest.mark.parametrize("dtype", LOW)
def test_unlisted_ops_keep_their_input_dtype(dtype):
    out, _ = run_emulated(lambda m: (F.relu(m(4, dtype=dtype)), m(4, dtype=dtype) + m(4, dtype=dtype),
                                     m(4, dtype=dtype).mean(), m(4) + 1), dtype)
    assert dtypes_of(out) == (dtype, dtype, dtype, F32)


@pytest.mark.parametrize("dtype", LOW)
def test_fp64_and_integer_inputs_are_left_alone(dtype):
    out, _ = run_emulated(lambda m: (F.linear(m(4, 8, dtype=F64), m(3, 8, dtype=F64)),
                                     torch.exp(m(4, dtype=F64)),
                                     torch.sum(m.ints(4, 4)),
                                     torch.matmul(m.ints(2, 2), m.ints(2, 2))), dtype)
    assert dtypes_of(out) == (F64, F64, torch.int64, torch.int64)


def test_casting_to_the_same_dtype_copies_nothing():
    counter = OpCounter()

    def case(m):
        x, w = m(4, 8, dtype=F16), m(3, 8, dtype=F16)
        with counter:
            return F.linear(x, w), F.layer_norm(m(4, 8), (8,))

    run_emulated(case, F16)
    assert counter.count(torch.ops.aten._to_copy.default) == 0


def test_binary_cross_entropy_is_banned_as_on_cuda():
    def case(m):
        return F.binary_cross_entropy(torch.sigmoid(m(4)), m(4).clamp(0, 1))

    with pytest.raises(RuntimeError, match="unsafe to autocast"):
        run_oracle(case, F16)
    with pytest.raises(RuntimeError, match="unsafe to autocast"):
        run_emulated(case, F16)


def test_real_cpu_tensors_are_emulated_too():
    out, _ = run_emulated(lambda m: (F.linear(m(4, 8), m(3, 8)),
                                     F.cross_entropy(m(4, 8), m.ints(4, high=8))), F16, fake=False)
    assert dtypes_of(out) == (F16, F32)


# -- forward dtypes and saved tensors, against torch's own CUDA autocast ----------------


def _mha(m):
    x = m(2, 5, 8)
    return F.multi_head_attention_forward(
        x.transpose(0, 1), x.transpose(0, 1), x.transpose(0, 1), 8, 2,
        m(24, 8, grad=True), m(24, grad=True), None, None, False, 0.0,
        m(8, 8, grad=True), m(8, grad=True), need_weights=True)


def _linear_twice(m):
    weight = m(8, 8, grad=True)
    return F.linear(F.linear(m(4, 8), weight).relu(), weight)


ORACLE_CASES = {
    "linear": lambda m: F.linear(m(4, 8, grad=True), m(16, 8, grad=True), m(16, grad=True)),
    "linear_twice": lambda m: _linear_twice(m),
    "matmul": lambda m: m(4, 8, grad=True) @ m(8, 3, grad=True),
    "einsum": lambda m: torch.einsum("bi,bj->bij", m(2, 3, grad=True), m(2, 4)),
    "conv2d": lambda m: F.conv2d(m(2, 3, 8, 8, grad=True), m(4, 3, 3, 3, grad=True)),
    "conv_transpose2d": lambda m: F.conv_transpose2d(m(2, 3, 8, 8), m(3, 4, 3, 3, grad=True)),
    "addbmm": lambda m: torch.addbmm(m(4, 3), m(2, 4, 8), m(2, 8, 3)),
    "prelu": lambda m: F.prelu(m(2, 3, 4), m(3, grad=True)),
    "layer_norm": lambda m: F.layer_norm(F.linear(m(4, 8), m(8, 8, grad=True)), (8,),
                                         m(8, grad=True), m(8, grad=True)),
    "group_norm": lambda m: F.group_norm(m(2, 4, 5, dtype=F16, grad=True), 2),
    "rms_norm": lambda m: (F.rms_norm(m(4, 8, dtype=F16, grad=True), (8,), m(8, grad=True)),
                           F.rms_norm(m(2, 4, 8, dtype=m.low, grad=True), (4, 8))),
    "batch_norm": lambda m: F.batch_norm(m(2, 3, 4, 4, dtype=F16, grad=True), m(3), m(3),
                                         m(3, grad=True), m(3, grad=True), training=True),
    "softmax": lambda m: F.softmax(m(4, 8, dtype=F16, grad=True), -1),
    "softmax_explicit_dtype": lambda m: F.softmax(m(4, 8, dtype=F16), -1, dtype=F16),
    "log_softmax": lambda m: F.log_softmax(m(4, 8, dtype=F16, grad=True), -1),
    "softmin": lambda m: F.softmin(m(4, 8, dtype=F16), -1),
    "sum": lambda m: (m(4, 8, dtype=F16).sum(), m(4, 8, dtype=F16).sum(-1, dtype=F16),
                      torch.sum(m(4, 8, dtype=F16), 0)),
    "cumsum_prod": lambda m: (torch.cumsum(m(4, dtype=F16), 0), m(4, dtype=F16).prod()),
    "norms": lambda m: (m(4, 8, dtype=F16).norm(), torch.norm(m(4, 8, dtype=F16), dim=1),
                        torch.linalg.vector_norm(m(4, dtype=F16)),
                        F.normalize(m(4, 8, dtype=F16), dim=1)),
    "exp_log": lambda m: (torch.exp(m(4, dtype=F16)), m(4, dtype=F16).log(),
                          torch.rsqrt(m(4, dtype=F16)), 1 / m(4, dtype=F16)),
    "pow": lambda m: (m(4, dtype=F16) ** 2, 2 ** m(4, dtype=F16),
                      torch.pow(m(4, dtype=F16), m(4, dtype=F16))),
    "losses": lambda m: (F.mse_loss(m(4, dtype=F16), m(4, dtype=F16)),
                         F.l1_loss(m(4, dtype=F16), m(4)),
                         F.smooth_l1_loss(m(4, dtype=F16), m(4, dtype=F16)),
                         F.kl_div(m(4, dtype=F16), m(4, dtype=F16), reduction="batchmean"),
                         F.binary_cross_entropy_with_logits(m(4, dtype=F16), m(4, dtype=F16)),
                         F.nll_loss(m(4, 3, dtype=F16), m.ints(4, high=3))),
    "cross_entropy": lambda m: F.cross_entropy(F.linear(m(4, 8), m(6, 8, grad=True)),
                                               m.ints(4, high=6)),
    "cross_entropy_3d": lambda m: F.cross_entropy(m(2, 6, 5, dtype=F16, grad=True),
                                                  m.ints(2, 5, high=6)),
    "cross_entropy_smoothing": lambda m: F.cross_entropy(
        m(4, 6, dtype=F16, grad=True), m.ints(4, high=6), label_smoothing=0.1),
    "cross_entropy_probs": lambda m: F.cross_entropy(
        m(4, 6, dtype=F16, grad=True), m(4, 6).softmax(-1), label_smoothing=0.1),
    "cross_entropy_weighted": lambda m: F.cross_entropy(
        m(4, 6, dtype=F16, grad=True), m.ints(4, high=6), weight=m(6).abs(), reduction="sum"),
    "interpolate": lambda m: (F.interpolate(m(1, 2, 4, 4, dtype=F16), scale_factor=2),
                              F.interpolate(m(1, 2, 4, 4, dtype=F16), scale_factor=2,
                                            mode="bilinear")),
    "distances": lambda m: (F.cosine_similarity(m(4, 8, dtype=F16), m(4, 8, dtype=F16)),
                            F.pairwise_distance(m(4, 8, dtype=F16), m(4, 8, dtype=F16)),
                            torch.cdist(m(4, 8, dtype=F16), m(3, 8, dtype=F16)),
                            torch.logsumexp(m(4, 8, dtype=F16), 1)),
    "promote": lambda m: (torch.addcmul(m(4), m(4, dtype=m.low), m(4, dtype=m.low)),
                          torch.addcmul(*(m(4, dtype=m.low) for _ in range(3))),
                          torch.atan2(m(4, dtype=m.low), m(4)),
                          torch.cat([m(4, dtype=m.low), m(4)]),
                          torch.stack([m(4, dtype=m.low), m(4, dtype=m.low)]),
                          torch.dot(m(4, dtype=m.low), m(4))),
    "unlisted": lambda m: (F.gelu(m(4, dtype=F16)), F.relu(m(4)), m(4, dtype=F16) * m(4),
                           F.embedding(m.ints(3), m(4, 5, grad=True)), F.dropout(m(4, dtype=F16)),
                           F.silu(m(4, dtype=F16)), m(2, 4, dtype=F16).mean(-1)),
    "double_and_int": lambda m: (F.linear(m(4, 8, dtype=F64), m(3, 8, dtype=F64)),
                                 torch.exp(m(4, dtype=F64)), torch.sum(m.ints(4)),
                                 torch.mm(m(2, 2, dtype=F64), m(2, 2))),
    "lstm_cell": lambda m: torch.lstm_cell(m(2, 4), (m(2, 3), m(2, 3)), m(12, 4, grad=True),
                                           m(12, 3, grad=True), m(12), m(12)),
    "multi_head_attention": _mha,
}


# Saved tensors that differ by the device's kernel, not by autocast.
KERNEL_DIFFERENCES = {
    "batch_norm": "cuDNN saves float32 statistics and a reserve; the CPU kernel saves the "
                  "statistics in the input dtype (per channel, a few bytes)",
    "lstm_cell": "CUDA runs the fused _thnn_fused_lstm_cell (saves its gates workspace); "
                 "on the CPU lstm_cell decomposes",
}


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("name", sorted(ORACLE_CASES))
def test_emulation_matches_cuda_autocast_on_fake_cuda_tensors(name, dtype):
    case = ORACLE_CASES[name]
    expected, expected_saved = run_oracle(case, dtype)
    actual, actual_saved = run_emulated(case, dtype)
    assert dtypes_of(actual) == dtypes_of(expected)
    if name not in KERNEL_DIFFERENCES:
        assert actual_saved == expected_saved


@pytest.mark.parametrize("weight", [True, False])
def test_fused_rms_norm_computes_the_same_values_and_grads(weight):
    torch.manual_seed(0)
    x = torch.randn(3, 5, 8, requires_grad=True)
    w = torch.randn(8, requires_grad=True) if weight else None
    grad = torch.randn(3, 5, 8)
    expected = F.rms_norm(x, (8,), w, 1e-5)
    expected_grads = torch.autograd.grad(expected, [t for t in (x, w) if t is not None], grad)
    with CudaEmulation((8, 0)):
        out, saved = saved_signature(lambda: F.rms_norm(x, (8,), w, 1e-5))
        grads = torch.autograd.grad(out, [t for t in (x, w) if t is not None], grad)
    torch.testing.assert_close(out, expected)
    for actual, wanted in zip(grads, expected_grads):
        torch.testing.assert_close(actual, wanted)
    # _fused_rms_norm saves input, weight and rstd only
    assert saved == sorted([("torch.float32", (3, 5, 8)), ("torch.float32", (3, 5, 1))]
                           + ([("torch.float32", (8,))] if weight else []))


def test_cross_entropy_saves_both_the_half_and_the_float_log_probs():
    # Worked out from LossNLL.cpp: log_softmax(x, dtype=x.dtype) stays fp16 and is saved
    # by its backward; nll_loss (fp32 list) casts it to an fp32 copy that it saves too.
    _, saved = run_emulated(lambda m: F.cross_entropy(m(4, 6, dtype=F16, grad=True),
                                                      m.ints(4, high=6)), F16)
    assert ("torch.float16", (4, 6)) in saved
    assert ("torch.float32", (4, 6)) in saved


# -- the weight-cast cache ----------------------------------------------------------------


class LinearTwice(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(self.lin(x).relu())


@pytest.mark.parametrize("fake", [True, False])
def test_a_parameter_is_cast_once_per_region_and_released_at_its_exit(fake):
    mode = FakeTensorMode() if fake else contextlib.nullcontext()
    with mode:
        model, x = LinearTwice(), torch.randn(4, 8)
    counter = OpCounter()
    with mode, CudaEmulation((8, 0), autocast_dtype=F16) as emu:
        with emu.autocast_region(), counter:
            _, saved = saved_signature(lambda: model(x))
            held = emu.cached_copies
        after = emu.cached_copies
    copy = torch.ops.aten._to_copy.default
    assert counter.count(copy, (8, 8)) == 1  # the weight, once for two uses
    assert counter.count(copy, (8,)) == 1  # the bias
    assert counter.count(copy, (4, 8)) == 1  # the input; the second call's input is fp16
    assert (held, after) == (2, 0)
    # autograd saves the fp16 copies (and fp16 activations), not the fp32 weight
    assert all(dtype == "torch.float16" for dtype, shape in saved if len(shape) > 1), saved


def test_cache_holds_copies_for_the_whole_region_even_without_autograd():
    fake = FakeTensorMode()
    with fake:
        model, x = nn.Linear(8, 8), torch.randn(4, 8)
    with fake, CudaEmulation((8, 0), autocast_dtype=F16) as emu:
        with torch.no_grad(), emu.autocast_region():
            model(x)
            assert emu.cached_copies == 2  # nothing saved them, the cache holds them
        assert emu.cached_copies == 0


def test_nested_regions_share_one_cache_released_by_the_outermost():
    model, x = nn.Linear(8, 8), torch.randn(4, 8)
    with CudaEmulation((8, 0), autocast_dtype=BF16) as emu:
        with emu.autocast_region():
            model(x)
            with emu.autocast_region():
                model(x)
                assert emu.cached_copies == 2
            assert emu.cached_copies == 2
        assert emu.cached_copies == 0


def test_no_cache_when_autocast_caching_is_disabled():
    model, x = nn.Linear(8, 8), torch.randn(4, 8)
    counter = OpCounter()
    emu = CudaEmulation((8, 0), autocast_dtype=F16)
    no_cache = torch.autocast("cpu", dtype=F16, cache_enabled=False)
    with emu, emu.autocast_region(), no_cache, counter:
        model(x)
        model(x)
    assert counter.count(torch.ops.aten._to_copy.default, (8, 8)) == 2


# -- backward and checkpointing -----------------------------------------------------------


def test_backward_runs_without_casting_and_fp32_parameters_get_fp32_grads():
    model, x = LinearTwice(), torch.randn(4, 8)
    hook_dtypes = []
    with CudaEmulation((8, 0), autocast_dtype=F16) as emu:
        with emu.autocast_region():
            hidden = model.lin(x)
            hidden.register_hook(lambda g: hook_dtypes.append(torch.exp(g).dtype))
            loss = model.lin(hidden.relu()).float().sum()
        loss.backward()
    assert hook_dtypes == [F16]  # exp is on the fp32 list: no autocast in backward
    assert model.lin.weight.grad.dtype == F32 and model.lin.bias.grad.dtype == F32


@pytest.mark.parametrize("use_reentrant", [False, True])
@pytest.mark.parametrize("fake", [True, False])
def test_checkpoint_recomputation_runs_under_the_emulated_policy(use_reentrant, fake):
    mode = FakeTensorMode() if fake else contextlib.nullcontext()
    with mode:
        block = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.LayerNorm(8))
        x = torch.randn(4, 8, requires_grad=True)
    seen = []
    block[0].register_forward_hook(lambda mod, args, out: seen.append(out.dtype))
    counter = OpCounter()
    with mode, CudaEmulation((8, 0), autocast_dtype=F16) as emu:
        with emu.autocast_region():
            loss = checkpoint(block, x, use_reentrant=use_reentrant).sum()
        with counter:
            loss.backward()
        assert emu.cached_copies == 0
    assert seen == [F16, F16]  # forward, then recomputation in backward
    recomputed = [ins for f, ins in counter.calls if f is torch.ops.aten.addmm.default]
    assert recomputed and all(dtype == F16 for ins in recomputed for dtype, _ in ins)
    norms = [ins for f, ins in counter.calls if f is torch.ops.aten.native_layer_norm.default]
    assert norms and all(ins[0][0] == F32 for ins in norms)  # the fp32 list, recomputed
    assert block[0].weight.grad.dtype == F32 and x.grad.dtype == F32


def test_model_code_that_disables_autocast_locally_is_honoured():
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    with CudaEmulation((8, 0), autocast_dtype=F16) as emu, emu.autocast_region():
        inside = F.linear(x, w).dtype
        with torch.autocast(x.device.type, enabled=False):
            disabled = F.linear(x, w).dtype
        assert torch.is_autocast_enabled("cuda")  # what model code asking CUDA sees
    assert (inside, disabled) == (F16, F32)


# -- Python and C++ composites ----------------------------------------------------------


def test_python_composites_are_emulated_inside():
    mha = nn.MultiheadAttention(8, 2, batch_first=True)
    x = torch.randn(2, 5, 8)
    with CudaEmulation((8, 0), autocast_dtype=F16) as emu, emu.autocast_region():
        out, weights = mha(x, x, x)
        fast, _ = mha(x, x, x, need_weights=False)
    assert (out.dtype, weights.dtype, fast.dtype) == (F16, F32, F16)
    assert emu.sdpa_backends == {SdpaBackend.FLASH: 1}
    assert emu.unsupported == []


def test_opaque_composites_reaching_listed_ops_are_reported():
    x = torch.randn(3, 5)
    with CudaEmulation((8, 0), autocast_dtype=F16) as emu:
        torch.cov(x)
        assert emu.unsupported == []  # outside a region nothing is cast anyway
        with emu.autocast_region():
            torch.cov(x)
            F.dropout(x), torch.flatten(x), F.batch_norm(x, None, None, training=True)
    assert len(emu.unsupported) == 1 and emu.unsupported[0].startswith("aten::cov")


# -- state restoration and misuse ---------------------------------------------------------


def test_state_is_restored_after_an_error():
    state = (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"),
             torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"))
    emu = CudaEmulation((8, 0), autocast_dtype=F16)
    with pytest.raises(ZeroDivisionError), emu, emu.autocast_region():
        F.linear(torch.randn(2, 2), torch.randn(2, 2))
        raise ZeroDivisionError
    assert torch._C._len_torch_function_stack() == 0
    assert emu.cached_copies == 0
    assert state == (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"),
                     torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"))


def test_misuse_is_refused_with_a_fix():
    emu = CudaEmulation((8, 0), autocast_dtype=F16)
    with pytest.raises(RuntimeError, match="enter the CudaEmulation"), emu.autocast_region():
        pass
    with pytest.raises(ValueError, match="autocast_dtype"):
        CudaEmulation((8, 0), autocast_dtype=F32)
    with pytest.raises(ValueError, match="compute_capability"):
        CudaEmulation("8.0")
    with emu, pytest.raises(RuntimeError, match="already active"):
        emu.__enter__()


def test_no_autocast_dtype_means_no_casting():
    with CudaEmulation((8, 0)) as emu, emu.autocast_region():
        out = F.linear(torch.randn(2, 4), torch.randn(3, 4))
    assert out.dtype == F32


# -- SDPA kernel choice -------------------------------------------------------------------


def problem(**fields):
    return SdpaProblem(**{"dtype": F16, "head_dim": 64, "batch_size": 2, "num_heads": 12,
                          "seq_len_q": 1024, **fields})


@pytest.mark.parametrize("cc, fields, expected", [
    ((8, 0), {}, SdpaBackend.FLASH),  # A100
    ((7, 0), {}, SdpaBackend.EFFICIENT),  # V100: flash needs sm80
    ((7, 5), {}, SdpaBackend.EFFICIENT),  # T4
    ((8, 0), {"dtype": F32}, SdpaBackend.EFFICIENT),  # flash is fp16/bf16 only
    ((8, 0), {"head_dim": 512}, SdpaBackend.EFFICIENT),  # flash stops at 256
    ((8, 0), {"has_mask": True}, SdpaBackend.EFFICIENT),  # flash takes no mask
    ((8, 0), {"has_mask": True, "is_causal": False, "dropout_p": 0.1}, SdpaBackend.EFFICIENT),
    ((8, 0), {"is_causal": True, "dropout_p": 0.1}, SdpaBackend.FLASH),
    ((7, 5), {"dtype": BF16}, SdpaBackend.MATH),  # efficient needs sm80 for bf16
    ((8, 0), {"dtype": F64}, SdpaBackend.MATH),
    ((6, 0), {}, SdpaBackend.EFFICIENT),  # P100
    ((3, 7), {}, SdpaBackend.MATH),  # K80: below sm50
    ((12, 0), {}, SdpaBackend.FLASH),
    ((8, 6), {"head_dim": 200}, SdpaBackend.EFFICIENT),  # sm86 cannot train (192, 224]
    ((8, 6), {"head_dim": 200, "requires_grad": False}, SdpaBackend.FLASH),
    ((8, 6), {"head_dim": 256, "dropout_p": 0.1}, SdpaBackend.EFFICIENT),
    ((8, 6), {"head_dim": 256}, SdpaBackend.FLASH),
    ((8, 0), {"head_dim": 60}, SdpaBackend.FLASH),  # flash pads the head dim itself
    ((7, 5), {"head_dim": 60}, SdpaBackend.MATH),  # efficient: fp16 needs a multiple of 8
    ((8, 0), {"head_dim": 60, "dtype": F32}, SdpaBackend.EFFICIENT),  # fp32: multiple of 4
    ((8, 0), {"dtype": F32, "storage_offsets": (2, 0, 0)}, SdpaBackend.MATH),  # misaligned
    ((7, 0), {"dtype": F32, "storage_offsets": (2, 0, 0)}, SdpaBackend.EFFICIENT),  # < sm80
    ((8, 0), {"num_kv_heads": 4}, SdpaBackend.MATH),  # different heads without enable_gqa
    ((8, 0), {"num_kv_heads": 4, "enable_gqa": True}, SdpaBackend.FLASH),
    ((8, 0), {"num_kv_heads": 5, "enable_gqa": True}, SdpaBackend.MATH),  # 12 % 5
    ((8, 0), {"is_causal": True, "seq_len_kv": 512}, SdpaBackend.EFFICIENT),  # non-square
    ((8, 0), {"layout_ok": False}, SdpaBackend.MATH),  # 3-D or strided last dim
    ((8, 0), {"head_dim_v": 32}, SdpaBackend.EFFICIENT),  # flash needs equal head dims
])
def test_choose_sdpa_backend(cc, fields, expected):
    assert choose_sdpa_backend(cc, problem(**fields)) is expected


@pytest.mark.parametrize("cc, cudnn, fields, expected", [
    ((9, 0), 92400, {}, SdpaBackend.CUDNN),  # H100 with the cuDNN of torch 2.14 wheels
    ((10, 0), 92400, {}, SdpaBackend.CUDNN),  # B200
    ((9, 0), 91000, {}, SdpaBackend.FLASH),  # cuDNN <= 9.15.0 is not preferred
    ((8, 0), 92400, {}, SdpaBackend.FLASH),  # preferred on sm90/sm10x only
    ((9, 0), 92400, {"head_dim": 256}, SdpaBackend.CUDNN),  # d256 with cuDNN > 9.22
    ((9, 0), 92400, {"head_dim": 200}, SdpaBackend.FLASH),  # no backward for d200
    ((9, 0), 92400, {"dropout_p": 0.1}, SdpaBackend.FLASH),  # not a multiple of 1/16
    ((9, 0), 92400, {"dropout_p": 0.125}, SdpaBackend.CUDNN),
    ((9, 0), 92400, {"has_mask": True, "mask_requires_grad": True}, SdpaBackend.EFFICIENT),
    ((9, 0), 92400, {"dtype": F32}, SdpaBackend.EFFICIENT),
])
def test_choose_sdpa_backend_with_cudnn(cc, cudnn, fields, expected):
    assert choose_sdpa_backend(cc, problem(**fields), cudnn_version=cudnn) is expected


def test_problem_from_tensors():
    q = torch.randn(2, 5, 12, 64).transpose(1, 2)  # (B, H, S, D) view of (B, S, H, D)
    kv = torch.randn(2, 4, 5, 64)
    p = SdpaProblem.from_tensors(q, kv, kv, attn_mask=torch.ones(5, 5, dtype=torch.bool),
                                 enable_gqa=True)
    assert (p.batch_size, p.num_heads, p.num_kv_heads, p.seq_len_q, p.seq_len_kv) == (2, 12, 4,
                                                                                      5, 5)
    assert p.has_mask and p.enable_gqa and p.layout_ok and not p.requires_grad
    assert not SdpaProblem.from_tensors(q[:1, 0], kv[:1, 0], kv[:1, 0]).layout_ok  # 3-D


# -- SDPA substitution ----------------------------------------------------------------------

GPT2 = {"batch": 2, "heads": 12, "seq": 1024, "head_dim": 64}


def _gpt2_attention_saved(compute_capability, dtype=F16, sdpa=True):
    b, h, s, d = GPT2.values()
    with FakeTensorMode():
        q, k, v = (torch.empty(b, s, h, d, dtype=dtype, requires_grad=True).transpose(1, 2)
                   for _ in range(3))
        with CudaEmulation(compute_capability, autocast_dtype=F16, sdpa=sdpa) as emu:
            out, saved = saved_signature(
                lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    return out, saved, emu.sdpa_backends


def test_flash_substitution_saves_no_seq_by_seq_matrix():
    b, h, s, d = GPT2.values()
    out, saved, backends = _gpt2_attention_saved((8, 0))
    assert backends == {SdpaBackend.FLASH: 1}
    assert not [shape for _, shape in saved if shape[-2:] == (s, s)]
    # what flash saves: q, k, v, out and a float32 log-sum-exp per query row
    assert sorted(saved) == sorted([("torch.float16", (b, h, s, d))] * 4
                                   + [("torch.float32", (b, h, s))])
    assert out.dtype == F16 and out.shape == (b, h, s, d)
    assert out.transpose(1, 2).is_contiguous()  # (B, S, H, D) underneath, as flash writes it


def test_math_path_saves_the_seq_by_seq_matrix():
    s = GPT2["seq"]
    _, saved, backends = _gpt2_attention_saved((7, 5), dtype=BF16)  # T4 has no bf16 kernel
    assert backends == {SdpaBackend.MATH: 1}
    assert [shape for _, shape in saved if shape[-2:] == (s, s)]


class Allocations(TorchDispatchMode):
    """Records (dtype, shape) of every tensor an aten op returns, and in ``refs`` a weak
    reference to it (dead once the tensor is freed)."""

    def __init__(self):
        super().__init__()
        self.made = []
        self.refs = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else (out,):
            if isinstance(t, torch.Tensor):
                self.made.append((t.dtype, tuple(t.shape)))
                self.refs.append(weakref.ref(t))
        return out


def test_flash_backward_allocates_what_flash_attention_2_allocates():
    # flash_api.cpp mha_bwd, by hand for B=2, H=4, S=200, D=40: dq, dk, dv like q;
    # softmax_d (B, H, round128(S)) and dq_accum (B, round128(S), H, round32(D)) in fp32.
    b, h, s, d = 2, 4, 200, 40
    allocations = Allocations()
    with FakeTensorMode():
        q, k, v = (torch.empty(b, h, s, d, dtype=F16, requires_grad=True) for _ in range(3))
        with CudaEmulation((8, 0)) as emu:
            out = F.scaled_dot_product_attention(q, k, v)
        grad = torch.empty_like(out)
        with allocations:
            out.backward(grad)
    assert emu.sdpa_backends == {SdpaBackend.FLASH: 1}
    assert (F32, (b, h, 256)) in allocations.made
    assert (F32, (b, 256, h, 64)) in allocations.made
    assert allocations.made.count((F16, (b, h, s, d))) >= 3
    assert not [shape for _, shape in allocations.made if shape[-2:] == (s, s)]
    assert q.grad.shape == q.shape and q.grad.dtype == F16


@pytest.mark.parametrize("cc, kwargs, backend", [
    ((8, 0), {"is_causal": True}, SdpaBackend.EFFICIENT),  # fp32 -> efficient
    ((8, 0), {"attn_mask": "bool"}, SdpaBackend.EFFICIENT),
    ((8, 0), {"attn_mask": "float"}, SdpaBackend.EFFICIENT),
    ((8, 0), {"enable_gqa": True}, SdpaBackend.EFFICIENT),
    ((7, 5), {}, SdpaBackend.EFFICIENT),
    ((3, 7), {}, SdpaBackend.MATH),
])
def test_substituted_attention_computes_the_same_values_and_grads(cc, kwargs, backend):
    torch.manual_seed(0)
    kv_heads = 2 if kwargs.get("enable_gqa") else 4
    q = torch.randn(2, 4, 6, 8, requires_grad=True)
    k, v = (torch.randn(2, kv_heads, 6, 8, requires_grad=True) for _ in range(2))
    mask = kwargs.get("attn_mask")
    if mask == "bool":
        kwargs = {**kwargs, "attn_mask": torch.rand(6, 6) > 0.3}
        kwargs["attn_mask"][:, 0] = True
    elif mask == "float":
        kwargs = {**kwargs, "attn_mask": torch.randn(2, 1, 6, 6)}
    grad = torch.randn(2, 4, 6, 8)
    expected = F.scaled_dot_product_attention(q, k, v, **kwargs)  # torch's CPU kernels
    expected_grads = torch.autograd.grad(expected, (q, k, v), grad)
    with CudaEmulation(cc) as emu:
        out = F.scaled_dot_product_attention(q, k, v, **kwargs)
        grads = torch.autograd.grad(out, (q, k, v), grad)
    assert emu.sdpa_backends == {backend: 1}
    torch.testing.assert_close(out, expected)
    for actual, wanted in zip(grads, expected_grads):
        torch.testing.assert_close(actual, wanted)


def test_efficient_attention_saves_the_mask_as_a_padded_bias():
    # preprocess_mask: expanded to (B, H, Sq, Skv); rows not a multiple of 16 are padded
    with FakeTensorMode():
        q = torch.empty(2, 4, 20, 8, requires_grad=True)
        mask = torch.ones(20, 20, dtype=torch.bool)
        with CudaEmulation((8, 0)):
            _, saved = saved_signature(
                lambda: F.scaled_dot_product_attention(q, q, q, attn_mask=mask))
    assert ("torch.float32", (2, 4, 20, 20)) in saved  # the bias, a view of (2, 4, 20, 32)
    assert ("torch.float32", (2, 4, 32)) in saved  # log-sum-exp rounded up to 32 rows


@pytest.mark.parametrize("dtype, head_dim, cc, accumulates", [
    (F16, 256, (8, 0), True),  # past 128: the 32x128_gmem kernel, float accumulator
    (BF16, 160, (8, 0), True),
    (F16, 256, (7, 5), True),  # the sm75 list ends with the same gmem kernel
    (F16, 128, (8, 0), False),  # 64x128_rf keeps the output in registers
    (F16, 64, (8, 0), False),  # 64x64_rf
    (F32, 256, (8, 0), False),  # float output: output_accum_t is output_t
])
def test_efficient_forward_allocates_a_float_accumulator_past_head_dim_128(
        dtype, head_dim, cc, accumulates):
    # attention.cu _efficient_attention_forward: with a mask flash is out, so the
    # memory-efficient kernel runs; for B=2, H=4, S=64 it allocates the output (B, S, H, D)
    # and, where kNeedsOutputAccumulatorBuffer, at::empty({B, M, H, Kv}, float) = (2, 64,
    # 4, D) float32, a local freed when the call returns. The output stays alive.
    b, h, s = 2, 4, 64
    made = Allocations()
    with FakeTensorMode():
        q = torch.empty(b, h, s, head_dim, dtype=dtype)
        mask = torch.ones(s, s, dtype=torch.bool)
        with CudaEmulation(cc) as emu, made:
            out = F.scaled_dot_product_attention(q, q, q, attn_mask=mask)
    assert emu.sdpa_backends == {SdpaBackend.EFFICIENT: 1}
    float_bshd = [ref for made_as, ref in zip(made.made, made.refs)
                  if made_as == (F32, (b, s, h, head_dim))]
    # a float32 input's output has that shape too, and stays alive
    assert len(float_bshd) == int(accumulates) + int(dtype is F32)
    assert sum(ref() is None for ref in float_bshd) == int(accumulates)  # freed on return
    assert out.shape == (b, h, s, head_dim) and out.dtype == dtype


def test_fp16_softmax_to_fp32_reads_half_without_a_float_copy_on_fake_tensors():
    counter = OpCounter()
    with FakeTensorMode():
        x = torch.empty(4, 8, dtype=F16)
        with CudaEmulation((8, 0)), counter:
            outs = (F.softmax(x, -1, dtype=F32), x.log_softmax(dim=-1, dtype=F32),
                    torch.softmax(x, -1, F32))
    assert [out.dtype for out in outs] == [F32] * 3
    assert counter.count(torch.ops.aten._to_copy.default) == 0


def test_docstring_examples_run():
    import batchfit.engine.autocast
    import batchfit.engine.cuda_emulation
    import batchfit.engine.sdpa

    results = [doctest.testmod(module) for module in
               (batchfit.engine.autocast, batchfit.engine.cuda_emulation, batchfit.engine.sdpa)]
    result = doctest.TestResults(sum(r.failed for r in results), sum(r.attempted for r in results))
    assert result.attempted >= 3 and result.failed == 0


def test_a_fused_attention_kernels_outputs_are_named_while_allocated():
    # A selective checkpointing policy sees the emulated kernel's outputs as two new_empty
    # calls; emulated_attention_kernel() names the kernel then, and only then.
    from batchfit.engine.sdpa import _FusedAttention, emulated_attention_kernel

    seen = []

    class Spy(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append((func, emulated_attention_kernel()))
            return func(*args, **(kwargs or {}))

    with FakeTensorMode():
        q, k, v = (torch.empty(1, 2, 8, 16, dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        with Spy():
            out = _FusedAttention.apply(q, k, v, None, True, None, False, SdpaBackend.FLASH)
            out.sum().backward()
    named = [func for func, kernel in seen  # (prim.device: new_empty asks the device)
             if kernel is SdpaBackend.FLASH and func is not torch.ops.prim.device.default]
    assert named == [torch.ops.aten.new_empty.default] * 2  # the output and its log-sum-exp
    assert sum(kernel is None for _, kernel in seen) > 3  # backward's ops are not named
    assert emulated_attention_kernel() is None
