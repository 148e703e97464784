"""Hard limits of CUDA kernels that are not memory: 32-bit indexing and grid dimensions.

A batch can fail on a big card long before memory runs out, but only where a kernel
refuses its tensor. Most do not: TensorIterator splits elementwise and reduction work
into 32-bit pieces (``with_32bit_indexing`` in aten/src/ATen/TensorIterator.cpp),
cuBLAS takes 64-bit offsets, cuDNN convolutions are split along the batch by torch
(``split_batch_dim_to_32bit_out`` in aten/src/ATen/native/cudnn/ConvShared.cpp), and
cuDNN batch norm is used only below 2^31-1 elements, the native kernel above
(``_select_batch_norm_backend`` in aten/src/ATen/native/Normalization.cpp). So a
rule here is per kernel, read from the kernel's source, and checked on the arguments of
each traced op with the stack that will run it (:mod:`batchfit.engine.stack`):

* **Native depthwise convolution** (``conv_depthwise2d_forward_out`` and the backward
  kernels in aten/src/ATen/native/cuda/DepthwiseConv2d.cu) checks
  ``canUse32BitIndexMath(input) && canUse32BitIndexMath(output)``: at 2^31-1 elements
  (or offsets) it raises. Which depthwise convolutions reach it is
  ``ConvParams::use_cudnn_depthwise`` in aten/src/ATen/native/Convolution.cpp, by
  version: channels-last inputs always go to cuDNN; contiguous fp16 ones go to cuDNN
  when ``check_cudnn_depthwise_workload_with_filter`` says so (every stride-1 1/3/5
  square filter; stride 2 only with many channels); from torch 2.9 a tensor too big for
  32-bit indexing goes to cuDNN >= 9.3 (pytorch/pytorch#153101, #163171), except
  channels-last ones on cuDNN 9.10-9.14, whose 64-bit depthwise kernels were broken and
  are sent back to the native kernel (#163171; re-enabled for cuDNN 9.15 in torch 2.10,
  #168364).
* **Reflection padding** (``F.pad(mode="reflect")``, as in timm's BlurPool2d):
  aten/src/ATen/native/cuda/ReflectionPad.cu checks ``canUse32BitIndexMath(input)`` in
  the 1-D and 2-D forward kernels ("input tensor must fit into 32-bit index math"), and
  the input and grad_output in their backward; the output is not checked. The 3-D
  kernels index with 64-bit accessors and have no rule.
* **2-D pooling forward** (aten/src/ATen/native/cuda/AveragePool2d.cu and
  DilatedMaxPool2d.cu): ``safe_downcast<int32_t, int64_t>(output.numel())`` raises
  "integer out of range" when the output has more than 2^31 - 1 elements (the limit is
  inclusive); the backward kernels count in 64 bits.
* **Fused attention grids** (recorded by :mod:`batchfit.engine.cuda_emulation`): flash
  attention launches ``(query blocks, batch, heads)`` and memory-efficient attention
  ``(query blocks, heads, batch)``; CUDA caps grid y and z at 65,535
  (pytorch/pytorch#146704, #142228).

Each check returns a :class:`KernelLimit`: how much of its limit one launch used.
The trace keeps the launch nearest its limit; :mod:`batchfit.answers.maxbatch` lowers
the answer when it passes and names the op, the kernel and the size.

Example:
    >>> import torch
    >>> from batchfit.engine.limits import depthwise_backend
    >>> from batchfit.engine.stack import Stack
    >>> x = torch.empty(2, 64, 56, 56, dtype=torch.float16, device="meta")
    >>> w = torch.empty(64, 1, 7, 7, dtype=torch.float16, device="meta")
    >>> depthwise_backend(Stack.parse(stack="2.4/12.4"), x, w, stride=(1, 1), dilation=(1, 1))
    'native'
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Callable

import torch

#: ``std::numeric_limits<int32_t>::max()``: canUse32BitIndexMath's bound (numel and offsets).
INT32_MAX = 2**31 - 1
#: CUDA's limit on a kernel's grid y and z dimensions (CUDA C Programming Guide, Table
#: "Technical specifications per compute capability").
GRID_YZ_MAX = 65535

_DEPTHWISE_SOURCE = ("aten/src/ATen/native/cuda/DepthwiseConv2d.cu: "
                     "TORCH_CHECK(canUse32BitIndexMath(input) && canUse32BitIndexMath(output))")


class LimitKind(StrEnum):
    INT32_INDEXING = "int32_indexing"
    GRID_DIM = "grid_dim"


@dataclass(frozen=True)
class KernelLimit:
    """One kernel launch against its hard limit; it runs while ``measure <= limit``.

    Attributes:
        kind: what is limited (32-bit indexing of a tensor, a grid dimension).
        measure: the launch's elements (or largest offset + 1), or its grid extent.
        limit: the most the kernel accepts.
        op: the aten op traced (``aten.convolution.default``).
        kernel: the CUDA kernel the target runs for it.
        module: the module that ran it ("" for the root).
        source: the file and check the rule comes from.
    """

    kind: LimitKind
    measure: int
    limit: int
    op: str
    kernel: str
    module: str = ""
    source: str = ""

    @property
    def ratio(self) -> float:
        return self.measure / self.limit

    @property
    def exceeded(self) -> bool:
        return self.measure > self.limit

    def describe(self) -> str:
        """One clause for a note: what the kernel got and why it refuses more."""
        where = self.module or "<root>"
        if self.kind is LimitKind.GRID_DIM:
            return (f"{self.kernel} in {where} launches a grid dimension of {self.measure:,} "
                    f"(CUDA allows {self.limit:,})")
        return (f"{self.kernel} ({self.op}) in {where} gets a tensor of {self.measure:,} "
                f"elements; it indexes with 32-bit integers (at most {self.limit:,})")


def worst(a: KernelLimit | None, b: KernelLimit | None) -> KernelLimit | None:
    """The one nearer its limit."""
    if a is None:
        return b
    if b is None:
        return a
    return b if b.ratio > a.ratio else a


def index_extent(tensor: torch.Tensor) -> int:
    """What ``canUse32BitIndexMath`` compares with its limit: max(numel, largest offset + 1)
    (aten/src/ATen/native/IndexingUtils.cpp: offsets from positive strides)."""
    numel = tensor.numel()
    if numel == 0:
        return 0
    offset = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride())
                 if size > 0)
    return max(numel, offset + 1)


def suggests_channels_last(tensor: torch.Tensor) -> bool:
    """``tensor.suggest_memory_format() == ChannelsLast`` for a 4-D tensor: torch's
    ``is_channels_last_strides_2d_s4`` (c10/core/MemoryFormat.h), which looks at the
    order of the strides, not at exact channels-last contiguity (a channel slice of an
    NHWC tensor, permuted to NCHW, still suggests channels-last)."""
    if tensor.dim() != 4:
        return False
    sizes, strides = tensor.shape, tensor.stride()
    if strides[1] == 0:
        return False
    smallest = 0
    for d in (1, 3, 2, 0):
        if sizes[d] == 0 or strides[d] < smallest:
            return False
        if d == 0 and smallest == strides[1]:
            return False
        smallest = strides[d] * (sizes[d] if sizes[d] > 1 else 1)
    return True


def _cudnn_workload_ok(input_shape: tuple[int, ...], stride: int, weight_shape: tuple[int, ...]
                       ) -> bool:
    """``check_cudnn_depthwise_workload_with_filter`` (Convolution.cpp, cuDNN >= 8.2)."""
    if input_shape[2] == 1 and stride == 1:  # 1-D convolution
        return True
    if weight_shape[2] != weight_shape[3]:  # only square filters
        return False
    filt = weight_shape[3]
    if filt not in (1, 3, 5):
        return False
    width = input_shape[3]
    if width < 7:
        return False
    if stride == 1:
        return True
    if stride != 2:
        return False
    channels, batch = input_shape[1], input_shape[0]
    if batch == 1:
        return (filt == 1 and width <= 28) or filt in (3, 5)
    if filt == 1 and batch <= 16 and channels >= 128 and width <= 7:
        return True
    return filt in (3, 5) and (channels >= 512 or (channels >= 256 and width >= 28))


def depthwise_backend(stack: Any, input: torch.Tensor, weight: torch.Tensor, *,
                      stride: tuple[int, ...], dilation: tuple[int, ...]) -> str:
    """``"cudnn"`` or ``"native"``: where ``ConvParams::use_cudnn_depthwise`` (Convolution.cpp)
    sends a depthwise convolution on ``stack`` (see the module docstring for versions)."""
    channels_last = suggests_channels_last(input) or suggests_channels_last(weight)
    cudnn = stack.cudnn_version
    large = max(index_extent(input), index_extent(weight)) >= INT32_MAX
    if large and stack.torch_version >= (2, 9):
        broken = cudnn > 91000 and (cudnn < 91500 or stack.torch_version < (2, 10))
        if channels_last and broken:
            return "native"
        return "cudnn" if cudnn >= 90300 else "native"
    if channels_last:  # "always use cudnn_depthwise for channels_last format"
        return "cudnn"
    if cudnn < 8200:
        return "native"  # older heuristics (cuDNN 7.6): not among the stacks modelled
    dims = input.dim() == 4
    half = input.dtype is torch.float16 and weight.dtype is torch.float16
    square_stride = len(stride) == 2 and (stride[0] == stride[1] or input.shape[2] == 1)
    dilated = any(d != 1 for d in dilation)
    if dims and half and square_stride and not dilated and input.shape[1] >= 32:
        return "cudnn" if _cudnn_workload_ok(tuple(input.shape), stride[-1],
                                             tuple(weight.shape)) else "native"
    return "native"


def _is_depthwise(input: torch.Tensor, weight: torch.Tensor, transposed: bool, groups: int) -> bool:
    """``ConvParams::is_depthwise``: groups == input channels > 1, output a multiple."""
    return (not transposed and input.dim() in (4, 5) and groups > 1
            and input.shape[1] == groups and weight.shape[0] % input.shape[1] == 0)


def _conv_params(args: tuple) -> tuple[tuple[int, ...], tuple[int, ...], bool, int]:
    """(stride, dilation, transposed, groups) of ``aten.convolution`` arguments."""
    return tuple(args[3]), tuple(args[5]), bool(args[6]), int(args[8])


def _convolution(args: tuple, outputs: list[torch.Tensor], stack: Any) -> KernelLimit | None:
    input, weight = args[0], args[1]
    stride, dilation, transposed, groups = _conv_params(args)
    if not _is_depthwise(input, weight, transposed, groups) or input.dim() != 4:
        return None
    if depthwise_backend(stack, input, weight, stride=stride, dilation=dilation) != "native":
        return None
    # The routing above reads the input as given (``use_cudnn_depthwise(input, weight)``),
    # but the native kernel is handed ``input.contiguous()`` (Convolution.cpp ``_convolution``:
    # ``case ConvBackend::CudaDepthwise2d: at::_conv_depthwise2d(input.contiguous(), ...)``)
    # and allocates a contiguous output: its canUse32BitIndexMath sees their element counts,
    # not the offsets of a strided view (MambaOut's channel slice of an NHWC tensor spans
    # all of fc1's channels).
    measure = max([input.numel()] + [o.numel() for o in outputs[:1]])
    return KernelLimit(LimitKind.INT32_INDEXING, measure, INT32_MAX - 1, "aten.convolution.default",
                       "native depthwise conv2d (conv_depthwise2d_forward_out)",
                       source=_DEPTHWISE_SOURCE)


def _convolution_backward(args: tuple, outputs: list[torch.Tensor], stack: Any
                          ) -> KernelLimit | None:
    grad_output, input, weight = args[0], args[1], args[2]
    stride, dilation, transposed, groups = tuple(args[4]), tuple(args[6]), bool(args[7]), int(args[9])
    if not _is_depthwise(input, weight, transposed, groups) or input.dim() != 4:
        return None
    if depthwise_backend(stack, input, weight, stride=stride, dilation=dilation) != "native":
        return None
    measure = max(index_extent(grad_output), index_extent(input))
    return KernelLimit(LimitKind.INT32_INDEXING, measure, INT32_MAX - 1,
                       "aten.convolution_backward.default",
                       "native depthwise conv2d backward (conv_depthwise2d_backward_out, "
                       "conv_depthwise2d_grad_weight_out)", source=_DEPTHWISE_SOURCE)


_REFLECTION_PAD_SOURCE = ("aten/src/ATen/native/cuda/ReflectionPad.cu: reflection_pad1d_out_cuda, "
                          "reflection_pad2d_out_template: TORCH_CHECK(canUse32BitIndexMath(input), "
                          "\"input tensor must fit into 32-bit index math\"); the backward also "
                          "checks grad_output")


def _reflection_pad(op: str) -> Callable[[tuple, list[torch.Tensor], Any], KernelLimit | None]:
    """``F.pad(mode="reflect")`` (timm's BlurPool2d anti-aliasing): the forward kernel checks
    its input only (the output may pass 2^31 - 1 elements); the backward checks the input
    and grad_output (args: ``(grad_output, input, padding)``)."""
    backward = op.endswith("_backward.default")

    def rule(args: tuple, outputs: list[torch.Tensor], stack: Any) -> KernelLimit | None:
        tensors = (args[0], args[1]) if backward else (args[0],)
        return KernelLimit(LimitKind.INT32_INDEXING, max(index_extent(t) for t in tensors),
                           INT32_MAX - 1, op,
                           "reflection padding" + (" backward" if backward else ""),
                           source=_REFLECTION_PAD_SOURCE)

    return rule


_POOL_SOURCES = {
    "aten.avg_pool2d.default": ("avg_pool2d (avg_pool2d_out_cuda_frame)",
                                "aten/src/ATen/native/cuda/AveragePool2d.cu, avg_pool2d_out_cuda: "
                                "const auto count = safe_downcast<int32_t, int64_t>(output.numel())"),
    "aten.max_pool2d_with_indices.default": (
        "max_pool2d (max_pool_forward_nchw / _nhwc)",
        "aten/src/ATen/native/cuda/DilatedMaxPool2d.cu, max_pool2d_with_indices_out_cuda: "
        "const int count = safe_downcast<int, int64_t>(output.numel())"),
}


def _pool_forward(op: str) -> Callable[[tuple, list[torch.Tensor], Any], KernelLimit | None]:
    """2-D average and max pooling forward: the output's element count is narrowed to a
    32-bit int with ``safe_downcast``, which raises "integer out of range" above
    2^31 - 1 (in either memory format; both backward kernels count in 64 bits in
    current torch)."""
    kernel, source = _POOL_SOURCES[op]

    def rule(args: tuple, outputs: list[torch.Tensor], stack: Any) -> KernelLimit | None:
        if not outputs:
            return None
        return KernelLimit(LimitKind.INT32_INDEXING, outputs[0].numel(), INT32_MAX, op, kernel,
                           source=source)

    return rule


#: Rules by aten op: ``rule(args, outputs, stack) -> KernelLimit | None``. ``canUse32BitIndexMath``
#: fails at ``>= INT32_MAX``, so the largest accepted measure is INT32_MAX - 1.
RULES: dict[str, Callable[[tuple, list[torch.Tensor], Any], KernelLimit | None]] = {
    "aten.convolution.default": _convolution,
    "aten.convolution_backward.default": _convolution_backward,
    # reflection_pad3d indexes with PackedTensorAccessor64: no rule
    **{op: _reflection_pad(op) for op in (
        "aten.reflection_pad1d.default", "aten.reflection_pad2d.default",
        "aten.reflection_pad1d_backward.default", "aten.reflection_pad2d_backward.default")},
    **{op: _pool_forward(op) for op in _POOL_SOURCES},
}


def check_op(op: str, args: tuple, outputs: list[torch.Tensor], stack: Any,
             module: str = "") -> KernelLimit | None:
    """The kernel limit this call of ``op`` used, or None when its kernel has none here."""
    rule = RULES.get(op)
    if rule is None:
        return None
    found = rule(args, outputs, stack)
    if found is None or not module:
        return found
    return KernelLimit(found.kind, found.measure, found.limit, found.op, found.kernel, module,
                       found.source)


def attention_grid(extent: int, backend: str, module: str) -> KernelLimit:
    """A fused attention launch's largest grid y/z extent (batch or heads)."""
    return KernelLimit(LimitKind.GRID_DIM, extent, GRID_YZ_MAX,
                       "aten.scaled_dot_product_attention",
                       f"scaled_dot_product_attention ({backend})", module,
                       "flash: grid (query blocks, batch, heads); memory-efficient: "
                       "(query blocks, heads, batch); CUDA caps grid y/z at 65,535 "
                       "(pytorch/pytorch#146704)")
