"""Kernel limit rules: each expected value is read off the rule's source by hand.

aten/src/ATen/native/Convolution.cpp (``use_cudnn_depthwise``,
``check_cudnn_depthwise_workload_with_filter``) decides where a depthwise convolution
runs; aten/src/ATen/native/cuda/DepthwiseConv2d.cu's native kernel requires
``canUse32BitIndexMath`` of input and output (numel and largest offset below 2**31 - 1).
Meta tensors carry the shapes without memory.
"""

from __future__ import annotations

import pytest
import torch

from batchfit.engine.limits import (
    INT32_MAX,
    LimitKind,
    check_op,
    depthwise_backend,
    index_extent,
)
from batchfit.engine.stack import Stack

F16, F32 = torch.float16, torch.float32
TORCH_24 = Stack.parse(stack="torch2.4+cu124")  # cuDNN 9.1.0
TORCH_291_CU128 = Stack.parse(stack="torch2.9.1+cu128")  # cuDNN 9.10.2
TORCH_291_CU130 = Stack.parse(stack="torch2.9.1+cu130")  # cuDNN 9.13.0
TORCH_112 = Stack.parse(stack="torch1.12+cu113")  # cuDNN 8.3.2


def tensor(*shape, dtype=F16, channels_last=False):
    t = torch.empty(*shape, dtype=dtype, device="meta")
    return t.contiguous(memory_format=torch.channels_last) if channels_last else t


def backend(stack, x, kernel, stride=1, dtype=F16, channels_last=False):
    w = tensor(x.shape[1], 1, kernel, kernel, dtype=dtype, channels_last=channels_last)
    return depthwise_backend(stack, x, w, stride=(stride, stride), dilation=(1, 1))


SMALL = (8, 64, 56, 56)  # 1.6 M elements
LARGE = (1024, 96, 192, 128)  # 2,415,919,104 elements > 2**31 - 1


@pytest.mark.parametrize("stack,shape,kernel,stride,dtype,channels_last,expected", [
    # cuDNN >= 8.2 heuristic: every stride-1 square 1/3/5 filter, 7x7 never (filter check)
    (TORCH_24, SMALL, 3, 1, F16, False, "cudnn"),
    (TORCH_24, SMALL, 7, 1, F16, False, "native"),
    # stride 2, 3x3: cuDNN only with >= 512 channels, or >= 256 channels and width >= 28
    (TORCH_24, (768, 128, 150, 150), 3, 2, F16, False, "native"),
    (TORCH_24, (768, 256, 56, 56), 3, 2, F16, False, "cudnn"),
    # the heuristic is for fp16 only: fp32 goes native
    (TORCH_24, SMALL, 3, 1, F32, False, "native"),
    # "always use cudnn_depthwise for channels_last format"
    (TORCH_24, SMALL, 7, 1, F16, True, "cudnn"),
    (TORCH_112, SMALL, 7, 1, F16, True, "cudnn"),
    (TORCH_24, LARGE, 7, 1, F16, True, "cudnn"),
    # torch 2.9: too big for 32-bit indexing -> cuDNN >= 9.3, whatever dtype or filter...
    (TORCH_291_CU128, LARGE, 7, 1, F16, False, "cudnn"),
    (TORCH_291_CU128, LARGE, 7, 1, F32, False, "cudnn"),
    # ... but channels-last with cuDNN > 9.10.0 goes back to the native kernel (#163171)
    (TORCH_291_CU128, LARGE, 7, 1, F16, True, "native"),
    (TORCH_291_CU130, LARGE, 7, 1, F16, True, "native"),
    # below the limit torch 2.9 uses the same heuristics as before
    (TORCH_291_CU130, SMALL, 7, 1, F16, False, "native"),
    (TORCH_291_CU130, SMALL, 7, 1, F16, True, "cudnn"),
])
def test_depthwise_backend_follows_use_cudnn_depthwise(stack, shape, kernel, stride, dtype,
                                                       channels_last, expected):
    x = tensor(*shape, dtype=dtype, channels_last=channels_last)
    assert backend(stack, x, kernel, stride, dtype, channels_last) == expected


def test_cudnn_fixed_in_9_15_takes_large_channels_last_again():
    # torch 2.10+ re-enabled cuDNN for 64-bit channels-last depthwise from cuDNN 9.15 (#168364)
    fixed = Stack(torch_version=(2, 10), cuda_version=(13, 0), cudnn_version=91500)
    x = tensor(*LARGE, channels_last=True)
    assert backend(fixed, x, 7, channels_last=True) == "cudnn"


def conv_args(x, kernel, stride=1, groups=None):
    w = tensor(x.shape[1], 1, kernel, kernel, dtype=x.dtype)
    return (x, w, None, [stride, stride], [kernel // 2] * 2, [1, 1], False, [0, 0],
            groups or x.shape[1])


def test_native_depthwise_measures_its_largest_tensor():
    # xception41's stride-2 depthwise at batch 768, 299 px: input 768 x 128 x 150 x 150 =
    # 2,211,840,000 elements; torch 2.4 runs it natively (128 channels < 256), whose
    # canUse32BitIndexMath check allows at most 2**31 - 2.
    x = tensor(768, 128, 150, 150)
    out = tensor(768, 128, 75, 75)
    hit = check_op("aten.convolution.default", conv_args(x, 3, stride=2), [out], TORCH_24, "blk")
    assert hit is not None and hit.kind is LimitKind.INT32_INDEXING
    assert hit.measure == 768 * 128 * 150 * 150 == 2_211_840_000
    assert hit.limit == INT32_MAX - 1 == 2_147_483_646
    assert hit.exceeded and hit.module == "blk"
    assert "native depthwise" in hit.kernel and "DepthwiseConv2d.cu" in hit.source
    # the same layer on torch 2.9 goes to cuDNN, which torch splits along the batch
    assert check_op("aten.convolution.default", conv_args(x, 3, stride=2), [out],
                    TORCH_291_CU128) is None


def test_native_depthwise_measures_the_contiguous_copy_it_is_handed_not_the_view():
    # MambaOut's gated conv: a channel slice of fc1's NHWC output, permuted to NCHW.
    # fc1 output 65 x 128 x 128 x 2048 fp16; the conv takes its last 384 channels:
    # numel 65 * 384 * 128 * 128 = 408,944,640, but its largest offset is
    # 64*128*128*2048 + 127*128*2048 + 127*2048 + 383 = 2,147,483,648 + 33,292,288
    # + 260,096 + 383 = 2,181,036,415 >= 2**31 - 1.
    fc1 = torch.empty(65, 128, 128, 2048, dtype=F16, device="meta")
    x = fc1[..., 2048 - 384:].permute(0, 3, 1, 2)
    assert x.numel() == 408_944_640
    assert index_extent(x) == 2_181_036_416 > INT32_MAX
    # routing reads the view (use_cudnn_depthwise(input, weight)): too big for 32-bit
    # indexing, channels-last, cuDNN 9.13 -> the native kernel (#163171) ...
    w = tensor(384, 1, 7, 7)
    assert depthwise_backend(TORCH_291_CU130, x, w, stride=(1, 1), dilation=(1, 1)) == "native"
    # ... which gets input.contiguous() (Convolution.cpp _convolution) and a contiguous
    # output: 408,944,640 elements each, within 32-bit indexing.
    out = tensor(65, 384, 128, 128)
    args = (x, w, None, [1, 1], [3, 3], [1, 1], False, [0, 0], 384)
    hit = check_op("aten.convolution.default", args, [out], TORCH_291_CU130)
    assert hit is not None and hit.measure == 408_944_640 and not hit.exceeded
    # 6 times the batch: 2,453,667,840 elements in the copy -> the kernel refuses it
    big = torch.empty(390, 128, 128, 2048, dtype=F16, device="meta")[..., 2048 - 384:]
    big = big.permute(0, 3, 1, 2)
    hit = check_op("aten.convolution.default", (big,) + args[1:], [tensor(390, 384, 128, 128)],
                   TORCH_291_CU130)
    assert hit is not None and hit.measure == 390 * 384 * 128 * 128 == 2_453_667_840


def test_ordinary_convolutions_have_no_rule():
    # groups=1: cuDNN with torch's split_batch_dim_to_32bit_out (ConvShared.cpp)
    x = tensor(*LARGE)
    w = tensor(96, 96, 3, 3)
    args = (x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)
    assert check_op("aten.convolution.default", args, [tensor(*LARGE)], TORCH_24) is None


def test_native_depthwise_backward_is_checked_too():
    # conv_depthwise2d_backward_out checks grad_input and grad_output; grad_weight_out
    # checks input and grad_output: the measure is the larger of grad_output and input.
    x = tensor(600, 64, 256, 256, dtype=F32)  # 2,516,582,400 elements
    w = tensor(64, 1, 7, 7, dtype=F32)
    args = (x, x, w, [64], [1, 1], [3, 3], [1, 1], False, [0, 0], 64, [True, True, False])
    hit = check_op("aten.convolution_backward.default", args, [x], TORCH_24)
    assert hit is not None and hit.measure == 600 * 64 * 256 * 256


def test_channels_last_is_read_from_the_stride_order():
    from batchfit.engine.limits import suggests_channels_last

    # exact NHWC: yes; plain NCHW: no
    assert suggests_channels_last(tensor(2, 8, 4, 4, channels_last=True))
    assert not suggests_channels_last(tensor(2, 8, 4, 4))
    # a channel slice of an NHWC tensor permuted to NCHW (MambaOut's gated conv input):
    # strides (4*4*24, 1, 4*24, 24) are not exactly channels-last but ordered like it
    nhwc = torch.empty(2, 4, 4, 24, device="meta")
    sliced = nhwc[..., 16:].permute(0, 3, 1, 2)
    assert sliced.stride() == (384, 1, 96, 24)
    assert suggests_channels_last(sliced)
    # N111 tensors fall back to NCHW (the ambiguous case in MemoryFormat.h)
    assert not suggests_channels_last(tensor(4, 1, 1, 1))


def test_index_extent_counts_the_largest_offset():
    # a transposed view of a (4, 6) tensor: numel 24, largest offset (6-1)*1 + (4-1)*6 = 23
    t = torch.empty(4, 6, device="meta").t()
    assert index_extent(t) == 24
    # an expanded (stride 0) view: numel 1000 but every offset is 0
    e = torch.empty(1, device="meta").expand(1000)
    assert index_extent(e) == 1000
    # a strided slice: numel 3, offsets 0, 10, 20 -> extent 21
    s = torch.empty(30, device="meta")[::10]
    assert index_extent(s) == 21


def test_reflection_pad_checks_its_input_not_its_output():
    # ReflectionPad.cu, reflection_pad2d_out_template: TORCH_CHECK(canUse32BitIndexMath(input_)).
    # 511 samples of 64 x 256 x 256 = 511 * 2**22 = 2,143,289,344 elements: accepted, although
    # the padded output (511 x 64 x 258 x 258 = 2,176,909,056) passes 2**31 - 1.
    x = tensor(511, 64, 256, 256, dtype=F32)
    out = tensor(511, 64, 258, 258, dtype=F32)
    found = check_op("aten.reflection_pad2d.default", (x, [1, 1, 1, 1]), [out], TORCH_24)
    assert found.measure == 511 * 2**22 and not found.exceeded
    assert "ReflectionPad.cu" in found.source
    # 512 samples: 2**31 elements, refused
    x = tensor(512, 64, 256, 256, dtype=F32)
    assert check_op("aten.reflection_pad2d.default", (x, [1, 1, 1, 1]), [], TORCH_24).exceeded


def test_reflection_pad_backward_checks_grad_output_too():
    # reflection_pad2d_backward_out_template checks input and grad_output: the padded
    # grad_output of 505 samples is 505 * 64 * 258**2 = 2,151,348,480 > 2**31 - 1 while the
    # input (505 * 2**22 = 2,118,123,520) is below.
    grad_out = tensor(505, 64, 258, 258, dtype=F32)
    x = tensor(505, 64, 256, 256, dtype=F32)
    found = check_op("aten.reflection_pad2d_backward.default", (grad_out, x, [1, 1, 1, 1]),
                     [x], TORCH_24)
    assert found.measure == 505 * 64 * 258 * 258 and found.exceeded
    assert found.kernel == "reflection padding backward"


def test_3d_reflection_padding_has_no_rule():
    # reflection_pad3d_out_kernel takes PackedTensorAccessor64 (64-bit indices)
    x = tensor(512, 64, 16, 256, 256, dtype=F32)
    assert check_op("aten.reflection_pad3d.default", (x, [1] * 6), [], TORCH_24) is None


@pytest.mark.parametrize("op", ["aten.avg_pool2d.default", "aten.max_pool2d_with_indices.default"])
def test_pooling_forward_narrows_its_output_count_to_int32(op):
    # AveragePool2d.cu: safe_downcast<int32_t, int64_t>(output.numel()); DilatedMaxPool2d.cu:
    # safe_downcast<int, int64_t>(output.numel()). safe_downcast accepts v <= INT32_MAX.
    # 2x2 pooling of 64 x 256 x 256 gives 64 x 128 x 128 = 2**20 elements per sample:
    # 2047 samples = 2,146,435,072 pass, 2048 = 2**31 do not (the input, 2**33, is not counted).
    for batch, refused in ((2047, False), (2048, True)):
        x = tensor(batch, 64, 256, 256)
        out = tensor(batch, 64, 128, 128)
        found = check_op(op, (x, [2, 2], [2, 2]), [out], TORCH_24)
        assert found.measure == batch * 2**20 and found.limit == INT32_MAX
        assert found.exceeded is refused
