"""Per-op knowledge: outputs whose real size differs from what the fake kernel reports.

Some meta kernels return an empty placeholder for a buffer the real kernel
fills, typically a workspace saved for backward. Each entry is a small function,
registered for one op, that returns ``{output index: real nbytes}``.

``aten.mkldnn_rnn_layer`` (CPU LSTM/GRU through oneDNN): the meta kernel returns
an empty workspace, while oneDNN's training workspace holds the gates and states
of every time step (12.5 MB for one 128-unit LSTM layer at seq 50, batch 32).
oneDNN gives no formula we can call, so the real kernel is run on small real
tensors at a quarter and a half of the batch and the size is extrapolated
linearly in the batch (exact to the page for batch >= 8 in our checks). For
CUDA targets the same size stands in for cuDNN's RNN reserve space, whose size
cuDNN computes internally.

A second registry holds **in-op scratch** on the CPU: memory a kernel allocates
through the CPU allocator and frees before it returns, which no tensor-level trace
sees. oneDNN convolutions are the big case: forward computes into a blocked-format
buffer and reorders it into the plain output (one output's worth, plus the weight
in blocked format); backward reorders its inputs (measured: 2x the input for a
32->32 3x3 convolution). Scratch is affine in the batch from batch 2 on (batch 1
takes other kernels), so each distinct convolution is run for real at batch 2 and
4 under the profiler's allocator events, and the in-op peak beyond its outputs is
extrapolated (exact to 0.1% at batch 8 and 60 in our checks). The tracer adds it
as a temporary allocated and freed right after the op's outputs. CPU targets only:
cuDNN's workspaces follow other rules (DeviceProfile.workspace_bytes).

A third registry holds the **dense copies a kernel makes of a strided input**, on CPU
and CUDA targets alike: read from the kernel's source (``input.expect_contiguous()``),
not measured. LayerNorm over a permuted activation (ConvNeXt's channels-last norm on an
NCHW tensor) copies its input inside the call, one more input's worth at that op (the profiler's
memory events of a real CPU step show it; ``benchmarks/accuracy_cpu.py``). The tracer adds each copy
as a temporary alive for the call.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch

from batchfit.engine._torch_internals import no_dispatch_modes

SizeFix = Callable[[tuple, dict], dict[int, int]]
ScratchFix = Callable[[tuple], int]
_REGISTRY: dict[Any, SizeFix] = {}
_SCRATCH: dict[Any, ScratchFix] = {}
_CACHE: dict[tuple, int] = {}


def register_size_fix(op: Any) -> Callable[[SizeFix], SizeFix]:
    def wrap(fn: SizeFix) -> SizeFix:
        _REGISTRY[op] = fn
        return fn
    return wrap


def size_fix_for(op: Any) -> SizeFix | None:
    return _REGISTRY.get(op)


def register_scratch(op: Any) -> Callable[[ScratchFix], ScratchFix]:
    def wrap(fn: ScratchFix) -> ScratchFix:
        _SCRATCH[op] = fn
        return fn
    return wrap


def scratch_for(op: Any) -> ScratchFix | None:
    """The CPU in-op scratch function of ``op`` (``args -> bytes``), if it has one."""
    return _SCRATCH.get(op)


def _rnn_workspace_bytes(args: tuple, batch: int) -> int:
    """The real oneDNN workspace of ``mkldnn_rnn_layer`` at ``batch`` (cached)."""
    (inp, w0, w1, w2, w3, hx, cx, reverse, batch_sizes, mode, hidden, layers, has_biases,
     bidirectional, batch_first, train) = args
    shape = list(inp.shape)
    batch_dim = 1  # the layer always gets (seq, batch, features); batch_first is for the output
    key = (tuple(shape), tuple(w0.shape), tuple(w1.shape), inp.dtype, mode, hidden,
           bidirectional, bool(train), batch)
    if key not in _CACHE:
        shape[batch_dim] = batch
        # grad mode stays on: without it the kernel keeps no workspace
        with no_dispatch_modes():
            def real(t: torch.Tensor, dims: list[int] | None = None) -> torch.Tensor:
                return torch.zeros(dims if dims is not None else list(t.shape), dtype=t.dtype)

            state = [batch, hidden]
            out = torch.ops.aten.mkldnn_rnn_layer(
                real(inp, shape), real(w0), real(w1), real(w2), real(w3), real(hx, state),
                real(cx, state), reverse, batch_sizes, mode, hidden, layers, has_biases,
                bidirectional, batch_first, train)
        _CACHE[key] = out[3].untyped_storage().nbytes()
    return _CACHE[key]


@register_size_fix(torch.ops.aten.mkldnn_rnn_layer.default)
def _mkldnn_rnn_layer(args: tuple, kwargs: dict) -> dict[int, int]:
    if not args[-1]:  # not training: no workspace is kept
        return {}
    batch = args[5].shape[0]  # hx: (batch, hidden)
    small, large = max(1, batch // 4), max(2, batch // 2)
    if batch <= 2:
        return {3: _rnn_workspace_bytes(args, batch)}
    at_small, at_large = _rnn_workspace_bytes(args, small), _rnn_workspace_bytes(args, large)
    slope = (at_large - at_small) / (large - small)
    return {3: int(round(at_large + slope * (batch - large)))}


# -- CPU in-op scratch -------------------------------------------------------------------

#: Batches the scratch is measured at (batch 1 takes other oneDNN kernels).
_SCRATCH_BATCHES = (2, 4)


def _real_like(tensor: torch.Tensor, batch: int | None = None,
               shape: tuple[int, ...] | None = None) -> torch.Tensor:
    """A real zero tensor with ``tensor``'s dtype and dimension order (the order of its
    strides: channels-last, a transposed view), at another batch or another shape."""
    sizes = list(shape if shape is not None else tensor.shape)
    if batch is not None:
        sizes[0] = batch
    strides = tensor.stride() if tensor.dim() else ()
    if tensor.dim() < 2 or 0 in strides:  # vectors and broadcast views: the plain layout
        return torch.zeros(sizes, dtype=tensor.dtype)
    order = sorted(range(tensor.dim()), key=lambda d: (-strides[d], -tensor.shape[d], d))
    base = torch.zeros([sizes[d] for d in order], dtype=tensor.dtype)
    return base.permute([order.index(d) for d in range(tensor.dim())])


@contextlib.contextmanager
def _native_stderr_silenced() -> Iterator[None]:
    """Send file descriptor 2 to /dev/null: kineto prints a line to it on every profiler
    start and stop (and an error about GPUs on a machine without one), which would land
    in the user's terminal once per calibrated op."""
    sys.stderr.flush()
    saved = os.dup(2)
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


def _in_op_scratch(run: Callable[[], Any]) -> int:
    """Peak CPU allocator bytes inside ``run()`` beyond the outputs it returns."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with _native_stderr_silenced(), \
            profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = run()
    changes = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                     if e.nbytes() != 0 and e.device_type() == DeviceType.CPU)
    live = peak = 0
    for _, nbytes in changes:
        live += nbytes
        peak = max(peak, live)
    outputs = {id(t.untyped_storage()): t.untyped_storage().nbytes()
               for t in (out if isinstance(out, (tuple, list)) else (out,))
               if isinstance(t, torch.Tensor)}
    return max(0, peak - sum(outputs.values()))


def _signature(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return (tuple(value.shape), value.dtype, value.stride() if value.dim() else ())
    return tuple(value) if isinstance(value, list) else value


def _measured_scratch(op: Any, args: tuple, shapes: dict[int, tuple[int, ...]]) -> int:
    """Scratch of ``op`` run for real on zero tensors laid out as ``args``, the tensor
    arguments listed in ``shapes`` at those shapes (cached per signature)."""
    key = (op, tuple(_signature(a) for a in args), tuple(sorted(shapes.items())))
    if key not in _CACHE:
        with no_dispatch_modes():
            real = [(_real_like(a, shape=shapes.get(i)) if isinstance(a, torch.Tensor) else a)
                    for i, a in enumerate(args)]
            _CACHE[key] = _in_op_scratch(lambda: op(*real))
    return _CACHE[key]


def _batch_scaled_scratch(op: Any, args: tuple, batched: tuple[int, ...]) -> int:
    """Scratch of ``op(*args)`` at the batch of ``args[batched[0]]``, from real runs at
    :data:`_SCRATCH_BATCHES` extrapolated linearly (cached per signature)."""
    batch = args[batched[0]].shape[0]

    def measured(at: int) -> int:
        return _measured_scratch(op, args, {i: (at, *args[i].shape[1:]) for i in batched})

    small, large = _SCRATCH_BATCHES
    if batch <= large:
        return measured(batch)
    at_small, at_large = measured(small), measured(large)
    return max(0, round(at_large + (at_large - at_small) / (large - small) * (batch - large)))


@register_scratch(torch.ops.aten.convolution.default)
def _convolution_scratch(args: tuple) -> int:
    if args[0].dim() < 3 or args[0].shape[0] < 1:
        return 0
    return _batch_scaled_scratch(torch.ops.aten.convolution.default, args, (0,))


@register_scratch(torch.ops.aten.convolution_backward.default)
def _convolution_backward_scratch(args: tuple) -> int:
    if args[1].dim() < 3 or args[1].shape[0] < 1:
        return 0
    return _batch_scaled_scratch(torch.ops.aten.convolution_backward.default, args, (0, 1))


@register_scratch(torch.ops.aten.max_pool2d_with_indices_backward.default)
def _max_pool2d_backward_scratch(args: tuple) -> int:
    """Pooling backward makes the gradient contiguous in the input's memory format inside
    the kernel when the two differ: a channels-last input (Keras's layers on the torch
    backend pool a permuted NHWC tensor, which is channels-last to torch) with a
    contiguous gradient, or the reverse. Measured: 1.5x the input for a 2x2 max pool
    (921,600 B input, 1,382,400 B scratch), 1x for average pooling, 0 when the formats
    match. Measured per signature at batch 2 and 4 like a convolution."""
    return _batch_scaled_scratch(torch.ops.aten.max_pool2d_with_indices_backward.default,
                                 args, (0, 1, 7))


@register_scratch(torch.ops.aten.avg_pool2d_backward.default)
def _avg_pool2d_backward_scratch(args: tuple) -> int:
    """See :func:`_max_pool2d_backward_scratch`."""
    return _batch_scaled_scratch(torch.ops.aten.avg_pool2d_backward.default, args, (0, 1))


#: A 16-bit matmul with at most this many multiply-adds is measured at its own shape.
_MATMUL_EXACT_MACS = 1 << 30
#: A larger one is measured with K and N cut to this, and at most 2 matrices...
_MATMUL_DIM_CAP = 1024
#: ...and M (the rows, the dimension the batch grows) cut to this: past one block of rows
#: oneDNN's packing buffers stay flat, but the block is the CPU's. On a Xeon with AMX
#: (``amx_bf16``), (M x 1024) @ (1024 x 512) in bf16 takes 1,053,696 B at M = 512 and
#: 1,024 and 2,107,008 B at every M from 1,536 to 8,192 (another kernel), so a cut at
#: 1,024 rows measured half of what the full matmul allocates.
_MATMUL_ROWS_CAP = 2048


def _matmul_scratch(op: Any, args: tuple, a_index: int) -> int:
    """What a bf16 or fp16 CPU matmul allocates inside the kernel, as oneDNN's kernels do.

    It depends on the instruction set oneDNN finds. Without native bf16 (no
    ``avx512_bf16``) a bf16 matmul accumulates into an fp32 buffer of the output's size:
    M*N*4 bytes, measured on the machine batchfit's earlier fixed formula came from. With
    native bf16 (a Xeon with ``avx512_bf16``, where this was written; AMD EPYCs with it
    failed the same test) oneDNN's brgemm kernels need only packing buffers:
    they grow with M up to one block of rows (256 here) and then stay flat, e.g. 68-198
    KiB for (M x 256) @ (256 x 1024) at M = 2..8192 on 2 threads, 99 KiB on one; an fp16
    matmul takes yet other kernels (788 KiB at 1024 x 256 x 1024). A fixed formula is
    wrong on one kind of CPU or the other (the bf16 MLP of tests/answers/
    test_accuracy_small.py was +4.6% here with M*N*4), so each distinct matmul runs for
    real under the profiler's allocator events, in the layout it has in the trace (a
    transposed operand stays transposed): at its own shape up to
    :data:`_MATMUL_EXACT_MACS` multiply-adds (a millisecond or two), else with K and N
    cut to :data:`_MATMUL_DIM_CAP`, M to :data:`_MATMUL_ROWS_CAP` and the batch of a
    ``bmm`` to 2. A cut measurement
    that holds an output-sized fp32 buffer (at least 0.9 * M * N * 4 bytes) is scaled
    to the real output; a smaller one is a packing buffer and is taken as it is (flat
    beyond one block). The buffers are per matmul, not per matrix of a batch: a ``bmm``
    of 2 or 64 matrices measured the same (42 KiB here).
    """
    a, b = args[a_index], args[a_index + 1]
    if a.dtype not in (torch.bfloat16, torch.float16) or b.dtype is not a.dtype:
        return 0
    m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
    count = a.shape[0] if a.dim() == 3 else 1
    if count * m * k * n <= _MATMUL_EXACT_MACS:
        return _measured_scratch(op, args, {})
    cap = _MATMUL_DIM_CAP
    mc, kc, nc = min(m, _MATMUL_ROWS_CAP), min(k, cap), min(n, cap)
    lead = (min(count, 2),) if a.dim() == 3 else ()
    shapes = {a_index: (*lead, mc, kc), a_index + 1: (*lead, kc, nc)}
    if a_index == 1 and isinstance(args[0], torch.Tensor):  # addmm's bias: (N,) or (M, N)
        bias = args[0]
        shapes[0] = (nc,) if bias.dim() == 1 else (mc if bias.shape[0] == m else 1, nc)
    measured = _measured_scratch(op, args, shapes)
    if measured >= 0.9 * mc * nc * 4:
        return round(measured * (m * n) / (mc * nc))
    return measured


@register_scratch(torch.ops.aten.mm.default)
def _mm_scratch(args: tuple) -> int:
    return _matmul_scratch(torch.ops.aten.mm.default, args, 0)


@register_scratch(torch.ops.aten.addmm.default)
def _addmm_scratch(args: tuple) -> int:
    return _matmul_scratch(torch.ops.aten.addmm.default, args, 1)


@register_scratch(torch.ops.aten.bmm.default)
def _bmm_scratch(args: tuple) -> int:
    return _matmul_scratch(torch.ops.aten.bmm.default, args, 0)


# -- copies a kernel makes of its inputs ---------------------------------------------------

#: ``copies(args) -> (before, after)``: bytes of the dense copies a kernel makes of
#: strided inputs inside the call, ``before`` it allocates its outputs and ``after``.
InputCopies = Callable[[tuple], tuple[int, int]]


def _dense_copy_bytes(tensor: Any) -> int:
    """The bytes ``tensor.contiguous()`` allocates: 0 for a contiguous tensor, which it
    returns as it is (``expect_contiguous`` borrows it), else a dense copy."""
    if not isinstance(tensor, torch.Tensor) or tensor.is_contiguous():
        return 0
    return tensor.numel() * tensor.element_size()


def _layer_norm_copies(args: tuple) -> tuple[int, int]:
    # layer_norm_cuda (aten/src/ATen/native/cuda/layer_norm_kernel.cu) and layer_norm_cpu
    # (aten/src/ATen/native/layer_norm.cpp): ``auto X = input.expect_contiguous();``, then
    # ``Y = at::native::empty_like(*X, ...)``: a strided input (ConvNeXt's NCHW activation
    # permuted to NHWC) is copied before the output is allocated and dies with the call.
    return _dense_copy_bytes(args[0]), 0


def _layer_norm_backward_copies(args: tuple) -> tuple[int, int]:
    # layer_norm_backward_cuda / layer_norm_backward_cpu: ``input.expect_contiguous()``
    # before dX, dgamma and dbeta are allocated; the kernel then runs on
    # ``dY.contiguous()`` (LayerNormBackwardKernelImpl). args: (grad_out, input, ...).
    return _dense_copy_bytes(args[1]), _dense_copy_bytes(args[0])


def _softmax_copies(args: tuple) -> tuple[int, int]:
    # softmax_cuda_out / log_softmax_cuda_out (aten/src/ATen/native/cuda/SoftMax.cu) and
    # softmax_cpu_out / log_softmax_cpu_out (SoftMax.cpp) are structured kernels: the
    # output is allocated first, then ``host_softmax`` (CPU: the kernel) runs on
    # ``input_.contiguous()``. args: (input, dim, half_to_float).
    return 0, _dense_copy_bytes(args[0])


def _softmax_backward_copies(args: tuple) -> tuple[int, int]:
    # softmax_backward_cuda_out / ..._cpu_out: grad_input is allocated first, then the
    # kernel runs on ``grad_.contiguous()`` and ``output_.contiguous()``.
    # args: (grad_output, output, dim, input_dtype).
    return 0, _dense_copy_bytes(args[0]) + _dense_copy_bytes(args[1])


_INPUT_COPIES: dict[Any, InputCopies] = {
    torch.ops.aten.native_layer_norm.default: _layer_norm_copies,
    torch.ops.aten.native_layer_norm_backward.default: _layer_norm_backward_copies,
    torch.ops.aten._softmax.default: _softmax_copies,
    torch.ops.aten._log_softmax.default: _softmax_copies,
    torch.ops.aten._softmax_backward_data.default: _softmax_backward_copies,
    torch.ops.aten._log_softmax_backward_data.default: _softmax_backward_copies,
}


def _softmax_backward_cuda_copies(args: tuple) -> tuple[int, int]:
    # softmax_backward_cuda_out (aten/src/ATen/native/cuda/SoftMax.cu) differs from the CPU
    # kernel: after the structured kernel has allocated grad_input it computes
    # ``Tensor tmp = grad * output;`` and runs ``host_softmax_backward(tmp, output, ...)``,
    # which takes ``tmp.contiguous()`` (tmp is dense: no copy) and ``output_.contiguous()``.
    # tmp has grad's elements in the promoted dtype of grad and output (float32 for
    # eager attention's ``softmax(..., dtype=torch.float32)``) and dies with the call.
    # log_softmax_backward_cuda_out passes grad straight through: no such temporary.
    grad, output = args[0], args[1]
    tmp_bytes = grad.numel() * torch.empty(
        (), dtype=torch.promote_types(grad.dtype, output.dtype)).element_size()
    return 0, tmp_bytes + _dense_copy_bytes(output)


#: Rules of kernels whose CUDA implementation allocates otherwise than the CPU one; they
#: replace the shared rule of ``_INPUT_COPIES`` on a CUDA target.
_CUDA_INPUT_COPIES: dict[Any, InputCopies] = {
    torch.ops.aten._softmax_backward_data.default: _softmax_backward_cuda_copies,
}


_CUDA_RULE_NAMES = frozenset(str(op) for op in _CUDA_INPUT_COPIES)


def input_copies_for(op: Any, cuda: bool = False) -> InputCopies | None:
    """The rule for the input copies and in-call temporaries ``op``'s kernel makes (on a
    CUDA target when ``cuda``, else on the CPU), or None."""
    if cuda and op in _CUDA_INPUT_COPIES:
        return _CUDA_INPUT_COPIES[op]
    return _INPUT_COPIES.get(op)


def input_copy_op(op: str, cuda: bool = False) -> str:
    """The op name a trace gives the input copy a kernel makes (these rules, and the
    convolution's in :func:`batchfit.engine.cudnn.input_copy_bytes`), e.g.
    ``contiguous input copy (aten.convolution.default)``; for a kernel whose CUDA rule
    also counts temporaries that are no copy (softmax backward's ``grad * output``), on a
    CUDA target: ``kernel temporaries (aten._softmax_backward_data.default)``."""
    if cuda and op in _CUDA_RULE_NAMES:
        return f"kernel temporaries ({op})"
    return f"contiguous input copy ({op})"


# -- decompositions run in the trace ------------------------------------------------------

#: ``decompose(args, kwargs, device) -> output``: an op the trace runs as the sub-ops its
#: kernel executes on the target, so their allocations (a dequantized weight that lives
#: only inside the kernel) are recorded. ``device`` is the target's DeviceProfile.
Decomposition = Callable[[tuple, dict, Any], Any]
_DECOMPOSE: dict[Any, Decomposition] = {}


def register_decomposition(op: Any, decompose: Decomposition) -> None:
    """Trace ``op`` as ``decompose`` (see :data:`Decomposition`)."""
    _DECOMPOSE[op] = decompose


def decomposition_for(op: Any) -> Decomposition | None:
    return _DECOMPOSE.get(op)


def _safe_softmax(args: tuple, kwargs: dict, device: Any) -> Any:
    """``_safe_softmax`` as its composite runs on every device (CompositeExplicitAutograd,
    no CUDA kernel of its own; torch >= 2.5, the math attention path's softmax): the
    softmax, a boolean ``self.isneginf()``, its ``all`` over each row, and ``where`` written
    into the softmax output, which zeroes fully masked rows. Measured with the profiler's
    memory events on the installed torch (tests/engine/test_kernels.py): the softmax
    output, the boolean and the row mask are allocated, the ``where`` nothing. The boolean
    (a quarter of a float32 ``seq x seq`` matrix) lives until the op returns, beside its
    result: what a trace of the op as one call misses."""
    self_, dim = args[0], args[1]
    dtype = args[2] if len(args) > 2 else kwargs.get("dtype")
    out = torch.softmax(self_, dim, dtype=dtype)
    masked = self_.isneginf()
    masked_rows = masked.all(dim, keepdim=True)
    zero = torch.scalar_tensor(0.0, dtype=out.dtype, device=out.device)
    torch.where(masked_rows, zero, out, out=out)
    del masked, masked_rows, zero  # the C++ locals, alive until the return
    return out


if hasattr(torch.ops.aten, "_safe_softmax"):  # torch >= 2.5
    register_decomposition(torch.ops.aten._safe_softmax.default, _safe_softmax)


#: Set while library code runs that reads tensor values only as scalars that set no shape
#: (see :meth:`batchfit.engine.tracer.Tracer._shortcut`).
_SCALAR_READS: contextvars.ContextVar[bool] = contextvars.ContextVar("batchfit_scalar_reads",
                                                                    default=False)


def scalar_reads_allowed() -> bool:
    return _SCALAR_READS.get()


@contextlib.contextmanager
def scalar_reads() -> Iterator[None]:
    """Within the block, a fake trace answers ``.item()`` with 1 and ``torch.equal`` with
    True instead of failing: for code whose value reads set scalars only."""
    token = _SCALAR_READS.set(True)
    try:
        yield
    finally:
        _SCALAR_READS.reset(token)


#: Custom ops known to allocate exactly their outputs (read from their kernels' sources), so
#: the trace need not warn that only their outputs are traced.
_OUTPUTS_ONLY: set[str] = set()


def register_outputs_only(*ops: str) -> None:
    """Declare custom ops (``namespace.op.overload`` strings) that allocate only their
    outputs on the target."""
    _OUTPUTS_ONLY.update(ops)


def is_outputs_only(op: str) -> bool:
    return op in _OUTPUTS_ONLY
