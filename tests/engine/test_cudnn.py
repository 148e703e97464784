"""cuDNN benchmark-mode workspaces: expected bytes derived by hand from the model in
batchfit.engine.cudnn (NHWC transposition buffers of 16-bit NCHW convolutions: input +
output forward, grad_output + input backward; one 32-bit piece when torch splits the
batch, split_batch_dim_to_32bit_out in ConvShared.cpp)."""

from __future__ import annotations

import torch
from torch import nn

import batchfit
from batchfit.engine.cudnn import benchmark_workspace_bytes
from batchfit.engine.spec import TrainConfig
from batchfit.engine.trace import trace_step
from batchfit.engine.tracer import EventKind

F16 = torch.float16
CONV = "aten.convolution.default"
CONV_BACKWARD = "aten.convolution_backward.default"


def meta(*shape, dtype=F16, channels_last=False):
    t = torch.empty(*shape, dtype=dtype, device="meta")
    return t.contiguous(memory_format=torch.channels_last) if channels_last else t


def fwd_args(x, w):
    return (x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)


def test_forward_workspace_is_input_plus_output():
    x, w, y = meta(32, 64, 56, 56), meta(128, 64, 3, 3), meta(32, 128, 56, 56)
    expected = 32 * 64 * 56 * 56 * 2 + 32 * 128 * 56 * 56 * 2  # 12,845,056 + 25,690,112 B
    assert benchmark_workspace_bytes(CONV, fwd_args(x, w), [y], (8, 6)) == expected == 38_535_168


def test_no_workspace_where_nothing_is_transposed():
    x, w, y = meta(32, 64, 56, 56), meta(128, 64, 3, 3), meta(32, 128, 56, 56)
    cl = meta(32, 64, 56, 56, channels_last=True)
    assert benchmark_workspace_bytes(CONV, fwd_args(cl, w), [y], (8, 6)) == 0  # NHWC already
    w_cl = meta(128, 64, 3, 3, channels_last=True)  # a channels-last weight makes it NHWC too
    assert benchmark_workspace_bytes(CONV, fwd_args(x, w_cl), [y], (8, 6)) == 0
    x32 = meta(32, 64, 56, 56, dtype=torch.float32)
    assert benchmark_workspace_bytes(CONV, fwd_args(x32, w), [y], (8, 6)) == 0  # not 16-bit
    assert benchmark_workspace_bytes(CONV, fwd_args(x, w), [y], (6, 1)) == 0  # no tensor cores
    assert benchmark_workspace_bytes(CONV, fwd_args(x, w), [y], (8, 6), False) == 0  # native


def test_backward_workspace_is_grad_output_plus_input():
    x, w, g = meta(16, 32, 28, 28), meta(32, 32, 3, 3), meta(16, 32, 28, 28)
    args = (g, x, w, [32], [1, 1], [1, 1], [1, 1], False, [0, 0], 1, [True, True, True])
    assert benchmark_workspace_bytes(CONV_BACKWARD, args, [x, w], (8, 0)) == 2 * 16 * 32 * 28 * 28 * 2


def test_split_batch_gives_one_pieces_workspace():
    # 1024 x 96 x 192 x 128 = 2,415,919,104 elements > 2**31 - 1: torch splits the batch in
    # pieces of 256 M // (96*192*128 = 2,359,296) = 113 samples; the workspace is a piece's.
    x, w, y = meta(1024, 96, 192, 128), meta(96, 96, 3, 3), meta(1024, 96, 192, 128)
    per_sample = 2 * 96 * 192 * 128 * 2
    assert benchmark_workspace_bytes(CONV, fwd_args(x, w), [y], (8, 0)) == 113 * per_sample


def test_the_v8_api_transposes_the_whole_batch():
    # torch >= 2.0 (cuDNN v8 API by default, pytorch/pytorch#91117): Conv_v8.cpp runs the
    # whole tensors (no split_batch_dim_to_32bit_out), so all 1024 samples' input + output.
    from batchfit.engine.stack import Stack

    x, w, y = meta(1024, 96, 192, 128), meta(96, 96, 3, 3), meta(1024, 96, 192, 128)
    per_sample = 2 * 96 * 192 * 128 * 2
    assert benchmark_workspace_bytes(CONV, fwd_args(x, w), [y], (8, 0),
                                     splits_batch=False) == 1024 * per_sample
    assert not Stack.parse(torch_version="2.0", cuda_version="11.8").cudnn_splits_batch
    assert Stack.parse(torch_version="1.13", cuda_version="11.7").cudnn_splits_batch


def test_trace_allocates_the_workspace_at_the_convolution():
    # One 3x3 convolution, batch 8, 64 channels at 56x56, amp-fp16 inference on an A100:
    # the fp16 input copy and the fp16 output are 8*64*56*56*2 = 3,211,264 B each.
    def conv():
        return nn.Sequential(nn.Conv2d(64, 64, 3, padding=1))

    device = batchfit.DeviceProfile.cuda(80 << 30, (8, 0))
    on = TrainConfig(mode="infer", precision="amp-fp16", cudnn_benchmark=True)
    off = TrainConfig(mode="infer", precision="amp-fp16")
    found = [e for e in trace_step(conv, (64, 56, 56), 8, on, device).steady_events
             if e.op == f"cudnn workspace ({CONV})"]
    assert [e.kind for e in found] == [EventKind.ALLOC, EventKind.FREE]
    assert found[0].nbytes == 2 * 3_211_264 and found[0].module == "0"
    assert not [e for e in trace_step(conv, (64, 56, 56), 8, off, device).steady_events
                if e.op.startswith("cudnn workspace")]


def test_only_convolutions_get_a_workspace_in_a_training_step_with_other_limited_ops():
    # Pooling and reflection padding have kernel-limit rules too; in benchmark mode only the
    # convolutions get a workspace (poolformer's AvgPool2d once crashed the trace here).
    # Forward: 8*16*32*32*2 = 262,144 B in and out; backward: grad_output + input, the same.
    def net():
        return nn.Sequential(nn.Conv2d(16, 16, 3, padding=1), nn.AvgPool2d(3, 1, 1),
                             nn.MaxPool2d(3, 1, 1), nn.ReflectionPad2d(1))

    device = batchfit.DeviceProfile.cuda(24 << 30, (8, 6))
    config = TrainConfig(mode="train", precision="amp-fp16", optimizer="sgd",
                         cudnn_benchmark=True, stack="torch1.10+cu113")
    found = [e for e in trace_step(net, (16, 32, 32), 8, config, device).steady_events
             if e.op.startswith("cudnn workspace") and e.kind is EventKind.ALLOC]
    assert [(e.op, e.nbytes) for e in found] == [
        (f"cudnn workspace ({CONV})", 2 * 262_144), (f"cudnn workspace ({CONV_BACKWARD})", 2 * 262_144)]


def test_a_convolution_copies_an_input_not_dense_in_its_backends_format():
    # Convolution.cpp _convolution: the backend gets input.contiguous(backend_memory_format)
    # (cuDNN: channels-last when input or weight suggests it) or input.contiguous()
    # (native depthwise).
    from batchfit.engine.cudnn import input_copy_bytes
    from batchfit.engine.stack import Stack

    torch24 = Stack.parse(stack="torch2.4+cu124")
    w = meta(8, 8, 3, 3)
    # dense NCHW or exact channels-last: passed as they are
    assert input_copy_bytes(CONV, fwd_args(meta(2, 8, 4, 4), w), torch24) == 0
    assert input_copy_bytes(CONV, fwd_args(meta(2, 8, 4, 4, channels_last=True),
                                           meta(8, 8, 3, 3, channels_last=True)), torch24) == 0
    # a channels-last weight makes cuDNN run channels-last: an NCHW input is copied,
    # 2*8*4*4 elements * 2 B = 512 B
    assert input_copy_bytes(CONV, fwd_args(meta(2, 8, 4, 4),
                                           meta(8, 8, 3, 3, channels_last=True)), torch24) == 512
    # MambaOut's gated conv input: the last 8 of 24 channels of an NHWC tensor, permuted;
    # ordered like channels-last (so cuDNN), but not dense: copied, 2*8*4*4*2 = 512 B
    sliced = torch.empty(2, 4, 4, 24, dtype=F16, device="meta")[..., 16:].permute(0, 3, 1, 2)
    dw = meta(8, 1, 7, 7)
    args = (sliced, dw, None, [1, 1], [3, 3], [1, 1], False, [0, 0], 8)
    assert input_copy_bytes(CONV, args, torch24) == 512
    # the same slice too big for 32-bit indexing on torch 2.9 + cuDNN 9.13 runs natively
    # (limits.depthwise_backend) on input.contiguous(): 65*384*128*128 elements * 2 B
    big = torch.empty(65, 128, 128, 2048, dtype=F16, device="meta")[..., 2048 - 384:]
    big_args = (big.permute(0, 3, 1, 2), meta(384, 1, 7, 7)) + args[2:8] + (384,)
    assert input_copy_bytes(CONV, big_args, Stack.parse(stack="torch2.9.1+cu130")) == \
        65 * 384 * 128 * 128 * 2 == 817_889_280


def test_trace_allocates_the_input_copy_at_the_convolution():
    # fc (16 -> 48 features) on 8 x 4 x 4 positions, its last 16 channels permuted to NCHW
    # into a 7x7 depthwise conv: the fp16 copy is 8*16*4*4*2 = 4,096 B, with or without
    # the cuDNN benchmark.
    class Gated(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(16, 48)
            self.conv = nn.Conv2d(16, 16, 7, padding=3, groups=16)

        def forward(self, x):
            return self.conv(self.fc(x)[..., 32:].permute(0, 3, 1, 2))

    device = batchfit.DeviceProfile.cuda(24 << 30, (8, 9))
    config = TrainConfig(mode="infer", precision="amp-fp16", stack="torch2.4+cu124")
    events = trace_step(Gated, (4, 4, 16), 8, config, device).steady_events
    found = [e for e in events if e.op == "contiguous input copy (aten.convolution.default)"]
    assert [(e.kind, e.nbytes, e.module) for e in found] == [
        (EventKind.ALLOC, 4096, "conv"), (EventKind.FREE, 4096, "conv")]
    # _convolution copies the input before the backend allocates the output (4,096 B)
    # and drops the copy when it returns
    conv = [(e.kind, e.op) for e in events if e.module == "conv" and e.nbytes == 4096]
    assert conv[:3] == [(EventKind.ALLOC, "contiguous input copy (aten.convolution.default)"),
                        (EventKind.ALLOC, "aten.convolution.default"),
                        (EventKind.FREE, "contiguous input copy (aten.convolution.default)")]


class _SearchNet(nn.Module):
    """c1 and c2 share one shape (one entry of torch's benchmark cache); dw is a 7x7
    depthwise convolution on 16 channels, which torch runs natively in NCHW
    (Convolution.cpp ``use_cudnn_depthwise``: fewer than 32 channels) and on cuDNN in
    channels-last ("always use cudnn_depthwise for channels_last format")."""

    def __init__(self):
        super().__init__()
        self.c0 = nn.Conv2d(3, 16, 3, padding=1)
        self.c1 = nn.Conv2d(16, 16, 3, padding=1)
        self.c2 = nn.Conv2d(16, 16, 3, padding=1)
        self.dw = nn.Conv2d(16, 16, 7, padding=3, groups=16)

    def forward(self, x):
        return self.dw(self.c2(self.c1(self.c0(x))))


def _searches(config):
    device = batchfit.DeviceProfile.cuda(24 << 30, (8, 9))
    events = trace_step(_SearchNet, (3, 32, 32), 8, config, device).steady_events
    return events, [e for e in events if e.kind is EventKind.EMPTY_CACHE]


def test_each_cudnn_convolution_marks_the_search_that_empties_the_cache():
    # Conv_v8.cpp run_single_conv (torch >= 2.0): with benchmark on, a shape not in the
    # benchmark cache is searched, then emptyCache(), then the kept plan's workspace.
    config = TrainConfig(mode="infer", precision="amp-fp16", cudnn_benchmark=True,
                         stack="torch2.4+cu124")
    events, marks = _searches(config)
    assert [(e.module, e.op, e.nbytes) for e in marks] == [
        (m, f"cudnn benchmark search ({CONV})", 0) for m in ("c0", "c1", "c2")]
    assert marks[1].key == marks[2].key != marks[0].key  # c1 and c2: one cache entry
    assert all(e.key < -1 for e in marks)  # never a storage's key
    # the mark comes after the convolution's output and just before its workspace
    for mark in marks:
        at = events.index(mark)
        assert events[at - 1].op == CONV and events[at - 1].kind is EventKind.ALLOC
        assert events[at + 1].op == f"cudnn workspace ({CONV})"


def test_channels_last_convolutions_are_searched_without_a_workspace():
    # NHWC needs no transposition (no workspace modelled), but cuDNN still searches each
    # shape, the depthwise one included (cuDNN in channels-last): four marks, two keys
    # shared by c1 and c2.
    config = TrainConfig(mode="infer", precision="amp-fp16", cudnn_benchmark=True,
                         channels_last=True, stack="torch2.4+cu124")
    events, marks = _searches(config)
    assert [e.module for e in marks] == ["c0", "c1", "c2", "dw"]
    assert len({e.key for e in marks}) == 3
    assert not [e for e in events if e.op.startswith("cudnn workspace")]


def test_no_search_marks_without_benchmark_or_on_the_v7_path():
    # Benchmark off: heuristics, no search. torch < 2.0 (Conv_v7.cpp findAlgorithms)
    # empties the cache while its search workspace is still held (pytorch/pytorch#50190),
    # which is not modelled, so no marks there either; the workspaces stay.
    off = TrainConfig(mode="infer", precision="amp-fp16", stack="torch2.4+cu124")
    v7 = TrainConfig(mode="infer", precision="amp-fp16", cudnn_benchmark=True,
                     stack="torch1.12+cu113")
    assert not _searches(off)[1]
    events, marks = _searches(v7)
    assert not marks
    assert len([e for e in events if e.op == f"cudnn workspace ({CONV})"]) == 6
