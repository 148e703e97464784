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
    # M = 2048 and scaled if it is an fp32 output buffer, taken as is if a packing one (on
    # a Xeon with AMX the packing buffer doubles between M = 1024 and 1536)
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


def test_layer_norm_copies_a_strided_input_by_hand() -> None:
    # layer_norm_cuda / layer_norm_cpu: ``input.expect_contiguous()`` before the output.
    # A (2, 16, 8, 8) fp32 activation permuted to NHWC is not contiguous: its dense copy
    # is 2*16*8*8*4 = 8,192 B; the same tensor made contiguous is passed as it is.
    forward = kernels.input_copies_for(torch.ops.aten.native_layer_norm.default)
    permuted = torch.empty(2, 16, 8, 8, device="meta").permute(0, 2, 3, 1)
    assert forward((permuted, [16], None, None, 1e-5)) == (8192, 0)
    assert forward((permuted.contiguous(), [16], None, None, 1e-5)) == (0, 0)
    # backward: ``input.expect_contiguous()`` before dX/dgamma/dbeta, then the kernel on
    # ``dY.contiguous()``; a (2, 8, 8, 16) fp16 dY transposed is 2*8*8*16*2 = 4,096 B
    backward = kernels.input_copies_for(torch.ops.aten.native_layer_norm_backward.default)
    grad = torch.empty(2, 8, 16, 8, dtype=torch.float16, device="meta").transpose(2, 3)
    assert backward((grad, permuted, [16], None, None, None, None, [True] * 3)) == (8192, 4096)
    assert backward((grad.contiguous(), permuted.contiguous(), [16], None, None, None, None,
                     [True] * 3)) == (0, 0)
    assert kernels.input_copies_for(torch.ops.aten.gelu.default) is None  # TensorIterator


def test_softmax_copies_a_strided_input_after_its_output_by_hand() -> None:
    # softmax_cuda_out / softmax_cpu_out are structured: the output exists, then the
    # kernel runs on ``input_.contiguous()``. A (2, 16, 8, 8) fp16 tensor permuted to NHWC
    # copies 2*16*8*8*2 = 4,096 B after the output; backward copies grad and output when
    # strided (the output here is the forward's contiguous one: no copy).
    permuted = torch.empty(2, 16, 8, 8, dtype=torch.float16, device="meta").permute(0, 2, 3, 1)
    for op in (torch.ops.aten._softmax.default, torch.ops.aten._log_softmax.default):
        assert kernels.input_copies_for(op)((permuted, -1, False)) == (0, 4096)
        assert kernels.input_copies_for(op)((permuted.contiguous(), -1, False)) == (0, 0)
    output = torch.empty(2, 8, 8, 16, dtype=torch.float16, device="meta")
    for op in (torch.ops.aten._softmax_backward_data.default,
               torch.ops.aten._log_softmax_backward_data.default):
        assert kernels.input_copies_for(op)((permuted, output, -1, torch.float16)) == (0, 4096)
        assert kernels.input_copies_for(op)((permuted, permuted, -1, torch.float16)) == (0, 8192)


def test_trace_holds_the_layer_norm_copy_with_the_output_then_frees_it() -> None:
    # ConvNeXt's block order: an NCHW activation permuted to NHWC into LayerNorm(16), at
    # batch 4 of (16, 8, 8) fp32: the copy and the output are 4*8*8*16*4 = 16,384 B each;
    # the copy is allocated first (the kernel copies, then allocates Y) and dies with the call.
    from torch import nn

    from batchfit import DeviceProfile, TrainConfig
    from batchfit.engine.trace import trace_step
    from batchfit.engine.tracer import EventKind

    class Norm(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln = nn.LayerNorm(16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.ln(x.permute(0, 2, 3, 1))

    events = trace_step(Norm, (16, 8, 8), 4, TrainConfig(mode="infer"),
                        DeviceProfile.cpu()).steady_events
    at_norm = [(e.kind, e.nbytes, e.op) for e in events if e.module == "ln" and e.nbytes == 16384]
    copy = "contiguous input copy (aten.native_layer_norm.default)"
    assert at_norm[:3] == [(EventKind.ALLOC, 16384, copy),
                       (EventKind.ALLOC, 16384, "aten.native_layer_norm.default"),
                       (EventKind.FREE, 16384, copy)]


def test_safe_softmax_is_traced_as_the_real_composite_allocates() -> None:
    # _safe_softmax (the math attention path's softmax from torch 2.5) is one op to a fake
    # trace, a composite on a device: the same op on real CPU tensors, under the profiler's
    # memory events, gives the sizes the trace must record. By hand, for (4, 256, 256) fp32:
    # the softmax output 1 MiB, isneginf's boolean 256 KiB, its all() over rows 1 KiB and a
    # 0-d zero 4 B; where() writes into the softmax output.
    from torch import nn

    from batchfit import DeviceProfile, TrainConfig
    from batchfit.device.timeline import peak_live_bytes
    from batchfit.engine.trace import trace_step
    from batchfit.engine.tracer import EventKind

    x = torch.randn(4, 256, 256)
    x[0, 3] = float("-inf")  # one fully masked row: zeros, not NaN
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                profile_memory=True) as prof:
        real = torch.ops.aten._safe_softmax(x, -1)
    measured = sorted(e.nbytes() for e in prof.profiler.kineto_results.events()
                      if e.nbytes() > 0)
    assert measured == [4, 1024, 256 * 1024, 1 << 20]
    assert real[0, 3].abs().sum() == 0

    class SafeSoftmax(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.ops.aten._safe_softmax(x, -1)

    events = trace_step(SafeSoftmax, (256, 256), 4, TrainConfig(mode="infer"),
                        DeviceProfile.cpu()).steady_events
    traced = sorted(e.nbytes for e in events
                    if e.kind is EventKind.ALLOC and e.category.value != "inputs")
    assert traced == measured
    # the input (1 MiB), the softmax output and the boolean at once, with the row mask
    assert peak_live_bytes(events) == (1 << 20) * 2 + 256 * 1024 + 1024 + 4


def test_cuda_softmax_backward_holds_grad_times_output_by_hand() -> None:
    # softmax_backward_cuda_out (aten/src/ATen/native/cuda/SoftMax.cu): ``Tensor tmp = grad *
    # output;`` after grad_input is allocated, alive for the call. Eager attention's
    # ``softmax(scores, dtype=torch.float32)`` over (2, 4, 64, 64): grad and output are
    # float32, so tmp is 2*4*64*64*4 = 131,072 B; fp16 grad and output: 65,536 B. The CPU
    # kernel (softmax_backward_cpu_out) has no such temporary, nor has log-softmax's.
    op = torch.ops.aten._softmax_backward_data.default
    f32 = torch.empty(2, 4, 64, 64, device="meta")
    f16 = f32.to(torch.float16)
    assert kernels.input_copies_for(op, cuda=True)((f32, f32, -1, torch.float16)) == (0, 131072)
    assert kernels.input_copies_for(op, cuda=True)((f16, f16, -1, torch.float16)) == (0, 65536)
    assert kernels.input_copies_for(op)((f32, f32, -1, torch.float16)) == (0, 0)
    log_op = torch.ops.aten._log_softmax_backward_data.default
    assert kernels.input_copies_for(log_op, cuda=True)((f32, f32, -1, torch.float32)) == (0, 0)
    # a strided output is still copied (``output_.contiguous()``), on top of tmp
    strided = torch.empty(2, 4, 64, 64, device="meta").transpose(-1, -2)
    assert kernels.input_copies_for(op, cuda=True)((f32, strided, -1, torch.float32)) == (
        0, 2 * 131072)


def test_trace_for_a_gpu_holds_softmax_backwards_temporary_with_its_output() -> None:
    # Attention weights (4 heads of 64 x 64) per sample at batch 2, float32 on a T4: the
    # softmax backward's grad_input is 2*4*64*64*4 = 131,072 B and, on a CUDA target only,
    # ``tmp = grad * output`` of the same size is allocated after it and freed with the call.
    from torch import nn

    from batchfit import DeviceProfile, TrainConfig
    from batchfit.device.profile import resolve_device
    from batchfit.engine.trace import trace_step
    from batchfit.engine.tracer import EventKind

    class Scores(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.ones(()))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.softmax(x * self.scale, dim=-1)

    def at_backward(device: DeviceProfile) -> list[tuple[EventKind, str]]:
        events = trace_step(Scores, (4, 64, 64), 2, TrainConfig(optimizer="sgd"),
                            device).steady_events
        return [(e.kind, e.op) for e in events if e.nbytes == 131072
                and "softmax_backward" in e.op]

    tmp = "kernel temporaries (aten._softmax_backward_data.default)"
    assert at_backward(resolve_device("T4"))[:3] == [
        (EventKind.ALLOC, "aten._softmax_backward_data.default"),
        (EventKind.ALLOC, tmp), (EventKind.FREE, tmp)]
    # on the CPU: the gradient only (grad and output are dense: no copies either)
    assert [op for _, op in at_backward(DeviceProfile.cpu())] == [
        "aten._softmax_backward_data.default"]
