"""The stack: versions parsed as users type them, and what each version decides.

Expected values are the documented facts: lazy module loading from CUDA 11.7 with
torch 1.13 (pytorch/pytorch#86509) and by default from CUDA 12.2; zero_grad(set_to_none)
and foreach optimizers by default from torch 2.0; the cuDNN of each official wheel.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import batchfit
from batchfit.engine.stack import EAGER_CONTEXT_BYTES, LAZY_CONTEXT_BYTES, Stack, cudnn_label
from batchfit.errors import InvalidInputError

MIB = 1 << 20


@pytest.mark.parametrize("kwargs,expected", [
    ({"torch_version": "1.12", "cuda_version": "11.3"}, ((1, 12), (11, 3), 8302)),
    ({"torch_version": "1.10.2+cu113"}, ((1, 10), (11, 3), 8200)),
    ({"stack": "torch2.4+cu124"}, ((2, 4), (12, 4), 90100)),
    ({"stack": "2.9.1/12.8"}, ((2, 9), (12, 8), 91002)),
    ({"torch_version": "2.9.1", "cuda_version": "cu130"}, ((2, 9), (13, 0), 91300)),
    # cuDNN 9.15.1.9 in the 2.10 CUDA 13 wheels (pytorch/pytorch#171189, #173677); 2.11,
    # not in the table, takes the nearest older release's (the stack the GPU kit runs)
    ({"stack": "torch2.10+cu130"}, ((2, 10), (13, 0), 91501)),
    ({"stack": "torch2.11+cu130"}, ((2, 11), (13, 0), 91501)),
    ({"stack": "torch2.10+cu128"}, ((2, 10), (12, 8), 91002)),
])
def test_versions_parse(kwargs, expected):
    stack = Stack.parse(**kwargs)
    assert (stack.torch_version, stack.cuda_version, stack.cudnn_version) == expected


def test_installed_stack_is_this_torch():
    stack = Stack.installed()
    major, minor = (int(v) for v in torch.__version__.split(".")[:2])
    assert stack.torch_version == (major, minor)
    if torch.version.cuda:
        assert stack.cuda_version == tuple(int(v) for v in torch.version.cuda.split(".")[:2])
    assert stack.cudnn_version == (torch.backends.cudnn.version() or 0)


@pytest.mark.parametrize("kwargs,fragment", [
    ({"torch_version": "3.1"}, "unknown torch_version 3.1"),
    ({"torch_version": "0.4"}, "unknown torch_version 0.4"),
    ({"torch_version": "latest"}, "malformed torch_version"),
    ({"cuda_version": "11.4"}, "unknown cuda_version 11.4"),
    ({"stack": "torch2.4"}, "malformed stack"),
    ({"stack": "torch2.4+cu124", "cuda_version": "12.4"}, "not both"),
])
def test_bad_versions_are_one_line(kwargs, fragment):
    with pytest.raises(InvalidInputError, match=fragment.replace("+", r"\+")) as info:
        Stack.parse(**kwargs)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("stack,lazy", [
    ("torch1.10+cu113", False),  # CUDA 11.3: no lazy loading at all
    ("torch1.12+cu116", False),  # CUDA 11.6 either
    ("torch1.13+cu117", True),  # torch 1.13 sets CUDA_MODULE_LOADING=LAZY on CUDA 11.7
    ("torch2.0+cu117", True),
    ("torch2.4+cu124", True),  # CUDA >= 12.2: the driver's default
])
def test_lazy_loading_and_context(stack, lazy):
    s = Stack.parse(stack=stack)
    assert s.lazy_module_loading is lazy
    assert s.context_bytes() == (512 if lazy else 1343) * MIB


def test_the_eager_context_is_the_cards_architectures():
    # Eager loading loads the kernels built for the device's architecture. On an RTX 3090
    # (8.6) pytorch/pytorch#55277 measured 1,687 MiB used after torch.Tensor(1).cuda(),
    # of which the tensor's segment is the caching allocator's smallest, 2 MiB: 1,685 MiB.
    # With no measurement for the architecture (an A100, 8.0), the V100's 1,343 MiB.
    # Lazy loading does not depend on the card.
    old = Stack.parse(stack="torch1.12+cu113")
    assert old.context_bytes((8, 6)) == 1685 * MIB
    assert old.context_bytes((8, 0)) == old.context_bytes() == 1343 * MIB
    assert Stack.parse(stack="torch2.4+cu124").context_bytes((8, 6)) == 512 * MIB
    assert old.to_dict((8, 6))["context_bytes"] == 1685 * MIB


def test_a_3090_profile_takes_its_eager_context_from_the_stack():
    eager = batchfit.estimate(linear, (1024,), 64, device="RTX 3090", stack="torch1.10+cu113")
    lazy = batchfit.estimate(linear, (1024,), 64, device="RTX 3090", stack="torch2.4+cu124")
    assert eager.device.context_bytes == 1685 * MIB
    assert lazy.device.context_bytes == 512 * MIB


@pytest.mark.parametrize("stack,after_2_0", [("torch1.12+cu113", False), ("torch2.0+cu118", True)])
def test_torch_2_0_defaults(stack, after_2_0):
    s = Stack.parse(stack=stack)
    assert s.zero_grad_sets_none is after_2_0
    assert s.foreach_default is after_2_0
    assert s.has_sdpa is after_2_0


def test_cudnn_labels():
    assert cudnn_label(8302) == "8.3.2" and cudnn_label(90100) == "9.1.0"
    assert cudnn_label(91002) == "9.10.2" and cudnn_label(7605) == "7.6.5"


def linear():
    return nn.Linear(1024, 1024)


def test_old_stack_keeps_gradients_and_loads_kernels_eagerly():
    # Linear(1024, 1024), SGD, fp32, batch 64 on an A100 profile. On torch 1.12 zero_grad()
    # zeroes in place, so the fp32 weight and bias gradients (1024*1024*4 + 1024*4 bytes,
    # rounded to 512 B: 4 MiB + 4 KiB) are alive during forward; torch 2.x frees them first.
    # The context is the stack's: 1,343 MiB eager against 512 MiB lazy.
    old = batchfit.estimate(linear, (1024,), 64, optimizer="sgd", device="A100",
                            stack="torch1.12+cu113")
    new = batchfit.estimate(linear, (1024,), 64, optimizer="sgd", device="A100",
                            stack="torch2.4+cu124")
    assert old.device.context_bytes == EAGER_CONTEXT_BYTES
    assert new.device.context_bytes == LAZY_CONTEXT_BYTES
    grads = batchfit.Category.GRADIENTS
    assert old.by_category[grads] == 4 * MIB + 4096
    assert old.peak_allocated_bytes - new.peak_allocated_bytes >= 0
    # an explicit context wins over the stack's
    profile = batchfit.DeviceProfile.cuda(80 << 30, (8, 0), context_bytes=100 * MIB)
    pinned = batchfit.estimate(linear, (1024,), 64, optimizer="sgd", device=profile,
                               stack="torch1.12+cu113")
    assert pinned.device.context_bytes == 100 * MIB


def _allocations(grad_mode) -> list[int]:
    """Sizes of the allocations a real CPU forward makes, from the profiler's memory events."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 3), nn.BatchNorm2d(16), nn.ReLU(), nn.Flatten(),
                          nn.Linear(16 * 30 * 30, 10)).eval()
    x = torch.randn(4, 3, 32, 32)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                profile_memory=True) as prof, grad_mode():
        model(x).sum()
    return [e.nbytes() for e in prof.profiler.kineto_results.events() if e.nbytes() > 0]


def test_inference_mode_and_no_grad_allocate_the_same():
    # Without autocast (for its weight cache see test_inference_mode.py): neither saves
    # anything for backward; inference mode only skips version counters and view tracking
    # on the host. A real forward allocates the same sizes under each.
    with_no_grad = _allocations(torch.no_grad)
    assert with_no_grad and _allocations(torch.inference_mode) == with_no_grad


def test_old_stack_attention_runs_the_math_path():
    # torch < 2.0 has no fused attention: sdpa on fp16 is CUDA's math path, which saves
    # the (B, heads, seq, seq) attention weights; torch 2.4 on an sm80 card picks flash.
    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = nn.Linear(64, 192)

        def forward(self, x):
            b, n, _ = x.shape
            q, k, v = self.qkv(x).reshape(b, n, 3, 4, 16).permute(2, 0, 3, 1, 4)
            return nn.functional.scaled_dot_product_attention(q, k, v).sum()

    def run(stack):
        return batchfit.estimate(Attention, (512, 64), 8, optimizer="sgd", precision="amp-fp16",
                                 device="A100", stack=stack)

    old, new = run("torch1.12+cu113"), run("torch2.4+cu124")
    saved = 8 * 4 * 512 * 512 * 2  # fp16 attention weights of one call, 16 MiB
    assert old.peak_allocated_bytes - new.peak_allocated_bytes >= saved


def test_torch_1_10_softmax_keeps_its_input():
    # torch < 1.11 saved softmax's input for backward (#64000, fixed by #65242): the fp16
    # logits of q @ k.T (batch 8, 4 heads, 256 x 256: 8*4*256*256*2 = 4 MiB) stay alive
    # until softmax's backward; from 1.11 nothing refers to them after softmax, so they
    # die in forward. The fp32 softmax output is saved on both.
    from batchfit.engine.spec import TrainConfig
    from batchfit.engine.trace import trace_step
    from batchfit.engine.tracer import EventKind, Phase

    class Scores(nn.Module):
        def __init__(self):
            super().__init__()
            self.q = nn.Linear(32, 32)

        def forward(self, x):
            b, n, _ = x.shape
            q = self.q(x).reshape(b, n, 4, 8).transpose(1, 2)
            return (q @ q.transpose(-2, -1)).softmax(dim=-1).sum()

    def logits_freed_in(stack):
        config = TrainConfig(optimizer="sgd", precision="amp-fp16", stack=stack,
                             grads_to_none=True)
        device = batchfit.DeviceProfile.cuda(80 << 30, (8, 0))
        events = trace_step(Scores, (256, 32), 8, config, device).first_events
        logits = [e for e in events if e.kind is EventKind.ALLOC and e.op == "aten.bmm.default"
                  and e.nbytes == 8 * 4 * 256 * 256 * 2]
        assert len(logits) == 1
        return [e.phase for e in events if e.kind is EventKind.FREE and e.key == logits[0].key]

    assert logits_freed_in("torch1.10+cu113") == [Phase.BACKWARD]
    assert logits_freed_in("torch1.12+cu113") == [Phase.FORWARD]


def test_math_attention_upcasts_from_torch_2_5():
    # pytorch/pytorch#128922 (after the 2.4 branch) casts the math path's fp16/bf16 q, k, v
    # to float32; #135964 (torch 2.5) added the switch that turns it off.
    assert not Stack.parse(stack="torch2.4+cu124").math_sdpa_upcasts
    assert not Stack.parse(stack="torch1.12+cu113").math_sdpa_upcasts
    assert Stack.parse(stack="torch2.5+cu124").math_sdpa_upcasts
    assert Stack.parse(stack="torch2.9.1+cu128").math_sdpa_upcasts


class _ThreeDimAttention(nn.Module):
    """SAM ViT's call: 3-D q, k, v ((batch x heads), tokens, head_dim), which no fused
    kernel takes (check_tensor_shapes wants 4-D), so CUDA runs the math path."""

    def __init__(self, masked: bool = False):
        super().__init__()
        self.masked = masked

    def forward(self, x):
        mask = None
        if self.masked:  # an fp16 additive bias broadcast over the batch: 2 MiB
            mask = torch.zeros(x.size(1), x.size(1), dtype=torch.float16, device=x.device)
        return nn.functional.scaled_dot_product_attention(x, x, x, attn_mask=mask)


def _attention_peak(stack: str, masked: bool = False) -> int:
    from batchfit.device.timeline import peak_live_bytes
    from batchfit.engine.spec import TrainConfig
    from batchfit.engine.trace import trace_step

    config = TrainConfig(mode="infer", precision="amp-fp16", stack=stack)
    device = batchfit.DeviceProfile.cuda(24 << 30, (8, 6))
    trace = trace_step(lambda: _ThreeDimAttention(masked), (1024, 8), 8, config, device)
    return peak_live_bytes(trace.steady_events)


def test_math_attention_before_2_5_runs_in_half_precision():
    # Inference, fp16 autocast, batch 8 of 1024 tokens x 8. At softmax, torch 2.4's math
    # path holds: the fp32 input (8*1024*8*4 = 256 KiB), autocast's fp16 copies of q, k
    # and v (3 x 128 KiB), q * sqrt(scale) (128 KiB; k.T * sqrt(scale) died with the
    # matmul), the fp16 scores and their softmax (8*1024*1024*2 = 16 MiB each).
    KIB = 1024
    assert _attention_peak("torch2.4+cu124") == 256 * KIB + 3 * 128 * KIB + 128 * KIB + 32 * MIB
    # the mask is added in place (attn.add_): only the 2 MiB bias itself is more
    assert _attention_peak("torch2.4+cu124", masked=True) == _attention_peak("torch2.4+cu124") + 2 * MIB
    # From 2.5 (the installed torch's kernel) q, k and v are cast to float32 (3 x 256 KiB)
    # and q * sqrt(scale) is float32 (256 KiB); the scores are float32 (32 MiB), and
    # _safe_softmax holds its softmax (32 MiB, its result), the boolean `isneginf` (8 MiB),
    # its `all` over each row (8 KiB) and a 0-d zero (4 B) (test_kernels.py measures them).
    upcast = 256 * KIB + 3 * 128 * KIB + 3 * 256 * KIB + 256 * KIB
    assert _attention_peak("torch2.5+cu124") == upcast + 2 * 32 * MIB + 8 * MIB + 8 * KIB + 4
