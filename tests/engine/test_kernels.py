"""In-op scratch of CPU kernels (batchfit.engine.kernels), checked against the profiler's
allocator events of the same op run for real at the full shape, on whatever CPU runs the
test: what oneDNN allocates inside a kernel depends on the instruction set it finds."""

from __future__ import annotations

import pytest
import torch

from batchfit.engine import kernels


def real_scratch(op, *args) -> int:
    return kernels._in_op_scratch(lambda: op(*args))


def test_real_like_keeps_the_dimension_order() -> None:
    channels_last = torch.empty(4, 3, 5, 6).contiguous(memory_format=torch.channels_last)
    twin = kernels._real_like(channels_last, batch=2)
    assert twin.shape == (2, 3, 5, 6)
    assert twin.is_contiguous(memory_format=torch.channels_last)
    transposed = torch.empty(7, 9).t()  # (9, 7) with strides (1, 9)
    twin = kernels._real_like(transposed, shape=(4, 3))
    assert twin.shape == (4, 3) and twin.stride() == (1, 4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_small_16_bit_matmul_scratch_is_the_real_kernels(dtype) -> None:
    a, b = torch.randn(300, 256, dtype=dtype), torch.randn(256, 512, dtype=dtype)
    bias = torch.randn(512, dtype=dtype)
    mm, addmm = torch.ops.aten.mm.default, torch.ops.aten.addmm.default
    assert kernels.scratch_for(mm)((a, b)) == real_scratch(mm, a, b)
    assert kernels.scratch_for(addmm)((bias, a, b)) == real_scratch(addmm, bias, a, b)


def test_transposed_operand_is_measured_transposed() -> None:
    # the weight gradient of a linear layer: grad_output.t() @ input
    grad = torch.randn(512, 384, dtype=torch.bfloat16)
    inputs = torch.randn(512, 256, dtype=torch.bfloat16)
    mm = torch.ops.aten.mm.default
    assert kernels.scratch_for(mm)((grad.t(), inputs)) == real_scratch(mm, grad.t(), inputs)


def test_large_bf16_matmul_is_measured_cut_and_holds_at_full_size() -> None:
    # 4096 x 1024 @ 1024 x 512 = 2^31 multiply-adds: above the exact limit, so measured at
    # M = 1024 and scaled if it is an fp32 output buffer, taken as is if a packing one
    m, k, n = 4096, 1024, 512
    assert m * k * n > kernels._MATMUL_EXACT_MACS
    a, b = torch.randn(m, k, dtype=torch.bfloat16), torch.randn(k, n, dtype=torch.bfloat16)
    mm = torch.ops.aten.mm.default
    predicted, measured = kernels.scratch_for(mm)((a, b)), real_scratch(mm, a, b)
    assert abs(predicted - measured) <= max(0.05 * measured, 64 << 10), (predicted, measured)


def test_fp32_matmul_has_no_scratch_entry() -> None:
    a, b = torch.randn(64, 64), torch.randn(64, 64)
    assert kernels.scratch_for(torch.ops.aten.mm.default)((a, b)) == 0


@pytest.mark.parametrize("pool", ["max", "avg"])
@pytest.mark.parametrize("input_format", [torch.contiguous_format, torch.channels_last])
def test_pooling_backward_scratch_matches_the_real_kernel(pool, input_format) -> None:
    # a gradient in the other memory format than the input is copied inside the kernel;
    # the prediction at batch 12 is extrapolated from real runs at batch 2 and 4
    import torch.nn.functional as F

    x = torch.randn(12, 16, 30, 30).contiguous(memory_format=input_format)
    grad = torch.randn(12, 16, 15, 15)  # contiguous (NCHW) in both cases
    if pool == "max":
        _, indices = F.max_pool2d(x, 2, return_indices=True)
        op = torch.ops.aten.max_pool2d_with_indices_backward.default
        args = (grad, x, [2, 2], [2, 2], [0, 0], [1, 1], False, indices)
    else:
        op = torch.ops.aten.avg_pool2d_backward.default
        args = (grad, x, [2, 2], [2, 2], [0, 0], False, True, None)
    measured = real_scratch(op, *args)
    assert kernels.scratch_for(op)(args) == pytest.approx(measured, rel=0.01, abs=4096)
    if input_format is torch.channels_last:
        assert measured >= x.numel() * 4  # the mismatched case copies at least the input
