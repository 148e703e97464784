"""Estimates for CUDA targets: optimizer implementation, autocast copies, attention kernels."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import batchfit
from batchfit.device.profile import DeviceProfile
from batchfit.engine.spec import TrainConfig
from batchfit.engine.trace import trace_step
from batchfit.engine.tracer import Category, EventKind, Phase

MIB = 1 << 20
A100 = DeviceProfile.cuda(80 << 30, (8, 0), name="A100")
T4 = DeviceProfile.cuda(16 << 30, (7, 5), name="T4")


def two_linears():
    return nn.Sequential(nn.Linear(1024, 1024, bias=False), nn.Linear(1024, 1024, bias=False))


def four_linears():
    return nn.Sequential(*[nn.Linear(1024, 1024, bias=False) for _ in range(4)])


def _optimizer_temporaries(device) -> int:
    """Most bytes live at once during the steady optimizer step beyond the step's state."""
    est = batchfit.estimate(four_linears, (1024,), 1, optimizer="adamw", device=device,
                            loss_fn=lambda out, batch: out.sum())
    timeline = est.timeline
    start = timeline.phases.index(Phase.OPTIMIZER)
    base = timeline.allocated_bytes[start - 1]
    return max(timeline.allocated_bytes[start:]) - base


def test_foreach_adamw_allocates_whole_group_temporaries():
    # Four 4 MiB weights. CUDA's foreach AdamW makes sqrt(exp_avg_sq) for the whole group
    # at once (4 x 4 MiB); the CPU for-loop works one parameter at a time: the previous
    # denominator (still referenced), sqrt and the division: at most 3 x 4 MiB, whatever
    # the number of parameters.
    foreach = _optimizer_temporaries(A100)
    forloop = _optimizer_temporaries(DeviceProfile.cpu())
    assert foreach >= 4 * 4 * MIB
    assert forloop <= 3 * 4 * MIB


def test_autocast_weight_copies_are_traced_once_per_weight():
    # amp-fp16: each fp32 1024x1024 weight gets one fp16 copy (2 MiB) for the region.
    trace = trace_step(two_linears, (1024,), 4, TrainConfig(precision="amp-fp16"), A100)
    copies = [e for e in trace.steady_events
              if e.kind is EventKind.ALLOC and e.category is Category.AUTOCAST_COPIES]
    assert sorted(e.nbytes for e in copies) == [2 * MIB, 2 * MIB]


class CausalAttention(nn.Module):
    def __init__(self, dim: int = 512, heads: int = 8):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, s, d))


def test_attention_kernel_follows_the_target():
    # bf16 autocast, 8 heads, seq 1024, batch 2, head dim 64. An A100 runs flash attention,
    # which saves no s x s matrix: the math path's softmax output would be one tensor of
    # 2 x 8 x 1024 x 1024 x 2 B = 32 MiB. A T4 has no bf16 at all, and a bf16 step there is
    # refused (its math-path choice for bf16 is checked in test_cuda_emulation).
    from batchfit.errors import InvalidInputError

    trace = trace_step(CausalAttention, (1024, 512), 2,
                       TrainConfig(precision=batchfit.Precision.AMP_BF16), A100)
    assert max(e.nbytes for e in trace.steady_events) < 32 * MIB
    with pytest.raises(InvalidInputError, match="compute capability 7.5"):
        batchfit.estimate(CausalAttention, (1024, 512), 2, precision="amp-bf16", device=T4)


def test_reserved_at_least_allocated_and_context_added():
    est = batchfit.estimate(two_linears, (1024,), 8, device=A100)
    assert est.peak_reserved_bytes >= est.peak_allocated_bytes
    assert est.total_bytes == est.peak_reserved_bytes + A100.context_bytes
    assert sum(est.by_category.values()) == est.total_bytes
    assert est.peak_reserved_bytes % (2 * MIB) == 0  # segments are 2 MiB multiples
    assert torch.get_default_dtype() == torch.float32
