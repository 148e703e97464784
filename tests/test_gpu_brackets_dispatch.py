"""``benchmarks/gpu_brackets_dispatch.py``: a forward on fake CUDA tensors under torch's
own CUDA autocast, the reference the engine's emulated inference trace is set against.

The first tests derive the fake run's peak by hand (so the storage counting itself is
checked); the last sets the engine's trace of hand-built layers whose CUDA behaviour the
engine emulates (autocast's fp32 norms, a permuted LayerNorm)
against torch's real CUDA dispatch of the same forward.

The fake run cannot see what a kernel allocates inside itself (the engine adds those
below the dispatcher, and ``engine_forward_peak`` leaves them out), nor, without a GPU,
cuDNN's choice of channels-last outputs.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
dispatch = pytest.importorskip("gpu_brackets_dispatch")


def _fake_cuda_available() -> bool:
    from torch._subclasses.fake_tensor import FakeTensorMode

    try:
        with FakeTensorMode():
            torch.empty(1, device="cuda")
    except Exception:  # noqa: BLE001 - a torch build without CUDA
        return False
    return True


pytestmark = pytest.mark.skipif(not _fake_cuda_available(),
                                reason="this torch build makes no fake CUDA tensors")


def test_linear_under_autocast_counts_every_cast_by_hand() -> None:
    # Linear(16, 32) on a (4, 16) fp32 input under fp16 autocast, no_grad. Alive at the
    # matmul: the fp32 weight (32*16*4 = 2048 B) and bias (128 B), the input (4*16*4 =
    # 256 B), autocast's fp16 copies of the input (128 B), weight (1024 B, cached for
    # the region) and bias (64 B), and the fp16 output (4*32*2 = 256 B): 3,904 B.
    peak, attention = dispatch.fake_cuda_forward_peak(
        nn.Linear(16, 32), (4, 16), autocast_dtype=torch.float16)
    assert peak == 3904
    assert not attention


def test_without_autocast_nothing_is_cast() -> None:
    # fp32 throughout: weight 2048 + bias 128 + input 256 + output (4*32*4) 512 = 2,944 B
    peak, _ = dispatch.fake_cuda_forward_peak(nn.Linear(16, 32), (4, 16))
    assert peak == 2944


def test_the_callers_state_is_restored() -> None:
    dispatch.fake_cuda_forward_peak(nn.Linear(4, 4), (2, 4), autocast_dtype=torch.float16)
    assert not torch.is_autocast_enabled("cuda")
    assert torch.get_autocast_dtype("cuda") == torch.float16  # torch's default


def test_attention_calls_are_reported() -> None:
    class Attention(nn.Module):
        def forward(self, x):
            q = x.view(x.shape[0], 1, 8, 4)
            return nn.functional.scaled_dot_product_attention(q, q, q)

    assert dispatch.fake_cuda_forward_peak(Attention(), (2, 32))[1]


class NormBlock(nn.Module):
    """What the dev set's misses run at their peaks: a ConvNeXt block (a permuted
    LayerNorm, fp32 under autocast), a BiT pre-activation (GroupNorm, fp32) and a gated
    MLP with a LayerNorm on its fp16 hidden (EVA02)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv_dw = nn.Conv2d(16, 16, 7, padding=3, groups=16)
        self.norm = nn.LayerNorm(16)
        self.gn = nn.GroupNorm(4, 16)
        self.conv = nn.Conv2d(16, 32, 1)
        self.fc_gate, self.fc_x = nn.Linear(32, 64), nn.Linear(32, 64)
        self.hidden_norm, self.fc2 = nn.LayerNorm(64), nn.Linear(64, 32)

    def forward(self, x):
        shortcut = x
        x = self.conv_dw(x).permute(0, 2, 3, 1)
        x = self.norm(x).permute(0, 3, 1, 2) + shortcut
        x = self.conv(torch.relu(self.gn(x)))
        tokens = x.flatten(2).transpose(1, 2)
        gate = self.fc_gate(tokens)
        hidden = nn.functional.silu(gate) * self.fc_x(tokens)
        return self.fc2(self.hidden_norm(hidden))


def test_engine_trace_equals_torchs_cuda_dispatch() -> None:
    # NCHW: without a GPU torch's _select_conv_backend picks no cuDNN for fake CUDA
    # tensors either, so neither side can show cuDNN's channels-last output for an NCHW
    # input with a channels-last weight (cudnn_conv_suggest_memory_format). no_grad:
    # under inference_mode the fake run dispatches aten.layer_norm whole and never makes
    # the mean and rstd that native_layer_norm allocates on a GPU (the engine counts them).
    import batchfit
    from batchfit.device.profile import DeviceProfile
    from batchfit.engine.trace import trace_step

    config = batchfit.TrainConfig(mode="infer", precision="amp-fp16")
    device = DeviceProfile.cuda(24 << 30, (8, 9))
    trace = trace_step(NormBlock, (16, 12, 12), 6, config, device)
    engine = dispatch.engine_forward_peak(list(trace.steady_events))
    cuda, _ = dispatch.fake_cuda_forward_peak(
        NormBlock().eval(), (6, 16, 12, 12), autocast_dtype=torch.float16)
    assert engine == cuda
