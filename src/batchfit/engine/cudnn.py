"""cuDNN convolution workspaces with ``torch.backends.cudnn.benchmark = True``.

What torch does (aten/src/ATen/native/cudnn/Conv_v7.cpp, Conv_v8.cpp). With benchmark on,
the first call of each convolution shape times cuDNN's algorithms: v7's
``getMaxWorkspaceSize`` and v8's ``get_available_workspace`` give the search at most the
largest block the caching allocator could hand out (``cacheInfo``: free device memory or
the largest cached block), v8 halving it until the allocation succeeds; the fastest
algorithm is kept per shape (``BenchmarkCache``). Every later call allocates that
algorithm's workspace through the caching allocator and frees it when the call
returns; when that allocation runs out of memory torch catches the error and falls
back to another algorithm (``try_all`` in v7, ``run_single_conv``/``try_plans`` in v8).
So the search never fails a step by itself; the workspace of the kept algorithm is a
transient that every step allocates at every convolution.

The model adopted for that workspace. cuDNN's fastest convolutions on tensor-core GPUs
(sm70 and newer) in 16-bit precision work in NHWC; for tensors in PyTorch's default
NCHW layout cuDNN transposes the input to NHWC and the output back (the
``nchwToNhwcKernel``/``nhwcToNchwKernel`` launches in the profiles of
pytorch/pytorch#13412; NVIDIA's channels-last guidance: "the NCHW tensor must be
transposed to NHWC before the convolution and transposed back after"). The transposed
copies live in the workspace for the call: we model the workspace of a benchmarked
16-bit NCHW convolution as the bytes of its input plus its output (forward), and of
its ``grad_output`` plus its input (backward: the data gradient transposes
``grad_output`` and writes ``grad_input``; the filter gradient transposes ``input`` and
``grad_output``; the two run one after the other, so the larger pair counts). Where
torch splits the batch into 32-bit pieces (``split_batch_dim_to_32bit_out`` in
ConvShared.cpp: at most 256 M elements per piece forward, 128 M for the data gradient,
512 M for the filter gradient) the workspace is one piece's. Only the cuDNN v7 path
splits (torch < 2.0); the v8 API, torch's default from 2.0, runs the whole tensors
(``Stack.cudnn_splits_batch``). Channels-last tensors
(input or weight: ``cudnn_conv_suggest_memory_format`` then runs the convolution in NHWC)
need no transposition and get no workspace here; neither do convolutions torch runs
outside cuDNN (native depthwise, :mod:`batchfit.engine.limits`) nor fp32 ones.

With benchmark off, cuDNN's heuristics choose (``cudnnGetConvolution*Algorithm_v7``,
v8 heuristics mode); their workspaces are not modelled (as before this module).

Whatever the benchmark setting, a convolution copies an input that is not dense in the
memory format its backend runs in (:func:`input_copy_bytes`, ``input.contiguous(...)`` in
Convolution.cpp ``_convolution``): a transient of the input's size, op
``contiguous input copy (aten.convolution.default)``.

The search itself, on torch >= 2.0 (:attr:`batchfit.engine.stack.Stack.
cudnn_search_empties_cache`), ends with ``emptyCache()``: every cached segment with no
live block goes back to the driver before the kept plan's workspace is allocated. It
runs at the first call of each convolution shape in the process (``BenchmarkCache``,
keyed by :func:`search_key`), on every convolution torch sends to cuDNN (channels-last,
float32 and depthwise ones included, whatever their workspace here). The trace marks
every such call with an ``EMPTY_CACHE`` event just before the workspace; the replay
empties its cache at the first mark of each key in the first step it runs, and the
loop's later steps have none (the algorithm is cached).

The workspace enters the allocator replay as one allocation freed right away, placed
after the convolution's outputs (torch allocates the output, then the workspace inside
the call), tagged ``temporaries`` with the op ``cudnn workspace (<op>)``. The replay
treats it as torch does: an allocation that may fail (:func:`batchfit.device.timeline.
is_fallible`): when the caching allocator cannot give it, the call falls back to an
algorithm without a workspace and the step goes on. So a workspace costs memory only
while there is room for it, and through the cached blocks it leaves behind.

Example:
    >>> import torch
    >>> from batchfit.engine.cudnn import benchmark_workspace_bytes
    >>> x = torch.empty(64, 64, 56, 56, dtype=torch.float16, device="meta")
    >>> w = torch.empty(64, 64, 3, 3, dtype=torch.float16, device="meta")
    >>> y = torch.empty(64, 64, 56, 56, dtype=torch.float16, device="meta")
    >>> benchmark_workspace_bytes("aten.convolution.default", (x, w), [y], (8, 0)) // 2**20
    49
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

#: ``max_worksize`` of split_batch_dim_to_32bit_out calls in ConvShared.cpp (elements).
_SPLIT_ELEMENTS = {"forward": 1024 * 1024 * 256, "backward_input": 1024 * 1024 * 128,
                   "backward_weight": 1024 * 1024 * 512}
_INT_MAX = 2**31 - 1
_HALF = (torch.float16, torch.bfloat16)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _channels_last(tensor: torch.Tensor) -> bool:
    from batchfit.engine.limits import suggests_channels_last

    return suggests_channels_last(tensor)


def _piece_fraction(a: torch.Tensor, b: torch.Tensor, max_elements: int) -> float:
    """The share of the batch in one 32-bit piece (1.0 when torch does not split)."""
    na, nb = a.numel(), b.numel()
    if na <= _INT_MAX and nb <= _INT_MAX:
        return 1.0
    n = a.shape[0]
    inner = max(na, nb) // n
    split = max(max_elements // inner, 1)
    return min(split, n) / n


def benchmark_workspace_bytes(op: str, args: tuple, outputs: list[torch.Tensor],
                              compute_capability: tuple[int, int],
                              routed_to_cudnn: bool = True, splits_batch: bool = True) -> int:
    """The transient workspace of one benchmarked cuDNN convolution call (see above).

    Args:
        op: the aten op (``aten.convolution.default`` or ``...convolution_backward.default``).
        args: the op's positional arguments (input, weight, ...; backward: grad_output,
            input, weight, ...).
        outputs: its output tensors.
        compute_capability: the target GPU's, e.g. ``(8, 6)``.
        routed_to_cudnn: False when torch runs the convolution natively (depthwise).
        splits_batch: torch splits tensors past 2**31 - 1 elements into batch pieces (the
            cuDNN v7 path, torch < 2.0: :attr:`batchfit.engine.stack.Stack.cudnn_splits_batch`);
            the v8 path transposes the whole tensors.
    """
    if not routed_to_cudnn or compute_capability < (7, 0):
        return 0
    if op == "aten.convolution.default":
        x, w = args[0], args[1]
        transposed = bool(args[6]) if len(args) > 6 else False
        y = outputs[0] if outputs else None
        if (y is None or transposed or x.dim() != 4 or x.dtype not in _HALF
                or _channels_last(x) or _channels_last(w)):
            return 0
        fraction = _piece_fraction(x, y, _SPLIT_ELEMENTS["forward"]) if splits_batch else 1.0
        return int((_nbytes(x) + _nbytes(y)) * fraction)
    if op == "aten.convolution_backward.default":
        grad_output, x, w = args[0], args[1], args[2]
        transposed = bool(args[7]) if len(args) > 7 else False
        if (transposed or x.dim() != 4 or x.dtype not in _HALF or _channels_last(x)
                or _channels_last(w)):
            return 0
        fraction = min(_piece_fraction(x, grad_output, _SPLIT_ELEMENTS["backward_input"]),
                       _piece_fraction(x, grad_output, _SPLIT_ELEMENTS["backward_weight"])
                       ) if splits_batch else 1.0
        return int((_nbytes(grad_output) + _nbytes(x)) * fraction)
    return 0


def input_copy_bytes(op: str, args: tuple, stack: Any) -> int:
    """The bytes of the copy a CUDA convolution makes of an input that is not dense in
    the memory format its backend runs in (0 for an input that is).

    aten/src/ATen/native/Convolution.cpp ``_convolution`` hands the backend
    ``input.contiguous(backend_memory_format)`` (cuDNN: ``case ConvBackend::Cudnn``,
    ``backend_memory_format = cudnn_conv_suggest_memory_format(input, weight)``, channels-
    last when the input or the weight suggests it) or ``input.contiguous()`` (native
    depthwise: ``case ConvBackend::CudaDepthwise2d``). For a strided view, such as a
    channel slice of an NHWC tensor permuted to NCHW (MambaOut's gated convolution),
    that is a new tensor of the input's size, alive for the call. Dense inputs (NCHW, or
    exact channels-last) are passed as they are. Forward, 4-D inputs only.
    """
    if op != "aten.convolution.default" or args[0].dim() != 4:
        return 0
    x, w = args[0], args[1]
    if is_routed_to_cudnn(op, args, stack) and (_channels_last(x) or _channels_last(w)):
        memory_format = torch.channels_last
    else:
        memory_format = torch.contiguous_format
    return 0 if x.is_contiguous(memory_format=memory_format) else _nbytes(x)


def search_key(op: str, args: tuple) -> int:
    """A key equal for two convolution calls that share one entry of torch's benchmark
    cache, and so one algorithm search (Conv_v8.cpp ``setCacheKey``: the operation, the
    input's and weight's sizes, strides and dtype, padding, stride, dilation, groups).
    Negative, so it never equals a storage's key in a trace."""
    tensors = tuple((tuple(t.shape), tuple(t.stride()), str(t.dtype)) for t in args
                    if isinstance(t, torch.Tensor))
    rest = tuple(tuple(a) if isinstance(a, (list, tuple)) else a for a in args
                 if not isinstance(a, torch.Tensor) and a is not None)
    digest = hashlib.blake2b(repr((op, tensors, rest)).encode(), digest_size=6).digest()
    return -2 - int.from_bytes(digest, "big")


def is_routed_to_cudnn(op: str, args: tuple, stack: Any) -> bool:
    """Whether torch sends this convolution to cuDNN on ``stack`` (depthwise ones may run
    natively, :func:`batchfit.engine.limits.depthwise_backend`)."""
    from batchfit.engine.limits import _is_depthwise, depthwise_backend

    if op == "aten.convolution.default":
        x, w = args[0], args[1]
        stride, dilation, transposed, groups = tuple(args[3]), tuple(args[5]), bool(args[6]), int(args[8])
    else:
        x, w = args[1], args[2]
        stride, dilation, transposed, groups = tuple(args[4]), tuple(args[6]), bool(args[7]), int(args[9])
    if _is_depthwise(x, w, transposed, groups) and x.dim() == 4:
        return depthwise_backend(stack, x, w, stride=stride, dilation=dilation) == "cudnn"
    return True
