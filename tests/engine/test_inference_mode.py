"""Inference under ``torch.inference_mode()``: autocast keeps no weight copies from torch 2.11.

The source: ``cached_cast`` in aten/src/ATen/autocast_mode.cpp keeps one low-precision copy
of each fp32 weight for the autocast region, unless ``c10::InferenceMode::is_enabled()``
(pytorch/pytorch#165068, merged 2025-12-10; torch 2.9.1 predates it). Then each op casts
its weights afresh and the copy dies with the op.

Expected values by hand, for four bias-free ``Linear(1024, 1024)`` layers in fp32 (4 MiB
each) at batch 4: the fp16 copy of a weight is 1024 x 1024 x 2 B = 2 MiB. Under ``no_grad``
all four copies are alive at the last layer (8 MiB); under inference mode one at a time
(2 MiB), so the step's peak is 3 x 2 MiB = 6 MiB lower. The activations (4 x 1024 x 2 B)
are 8 KiB and do not move the difference.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

import batchfit
from batchfit.cli.app import app
from batchfit.device.profile import DeviceProfile
from batchfit.device.timeline import peak_live_bytes
from batchfit.engine.spec import TrainConfig
from batchfit.engine.stack import Stack
from batchfit.engine.trace import trace_step
from batchfit.engine.tracer import Category, EventKind
from batchfit.errors import InvalidInputError
from batchfit.realrun.measure import measure_step

MIB = 1 << 20
A100 = DeviceProfile.cuda(80 << 30, (8, 0), name="A100")
INSTALLED_SKIPS_CACHE = not Stack.installed().autocast_caches_in_inference_mode


def four_linears() -> nn.Module:
    return nn.Sequential(*[nn.Linear(1024, 1024, bias=False) for _ in range(4)])


def test_the_stack_says_when_the_cache_is_skipped():
    assert Stack.parse(stack="torch2.9+cu128").autocast_caches_in_inference_mode
    assert Stack.parse(stack="torch2.10+cu128").autocast_caches_in_inference_mode
    assert not Stack.parse(stack="torch2.11+cu128").autocast_caches_in_inference_mode


@pytest.mark.skipif(not INSTALLED_SKIPS_CACHE, reason="the installed torch predates #165068")
def test_installed_torch_casts_weights_per_op_under_inference_mode():
    # The source behaviour itself, on real CPU autocast: three calls of one bias-free
    # Linear cast the input each time; the weight once under no_grad (cached), three
    # times under inference mode.
    layer = nn.Linear(16, 16, bias=False)
    x = torch.randn(2, 16)

    def casts(grad_mode) -> int:
        profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        with grad_mode(), torch.autocast("cpu", dtype=torch.bfloat16), profiler as p:
            for _ in range(3):
                layer(x)
        return sum(e.count for e in p.key_averages() if e.key == "aten::_to_copy")

    assert casts(torch.no_grad) == 3 + 1
    assert casts(torch.inference_mode) == 3 + 3


@pytest.mark.parametrize("inference_mode,stack,held", [
    (False, "torch2.11+cu128", 4 * 2 * MIB),  # no_grad: every copy for the region
    (True, "torch2.9+cu128", 4 * 2 * MIB),    # inference mode before #165068: the same
    (True, "torch2.11+cu128", 2 * MIB),       # inference mode after it: one at a time
])
def test_emulated_weight_copies_follow_the_stack(inference_mode, stack, held):
    config = TrainConfig(mode="infer", precision="amp-fp16", inference_mode=inference_mode,
                         stack=stack)
    trace = trace_step(four_linears, (1024,), 4, config, A100)
    casts = [e for e in trace.steady_events if e.kind is EventKind.ALLOC and e.nbytes == 2 * MIB]
    assert len(casts) == 4  # four casts either way; what differs is how long they live
    copies = [e for e in trace.steady_events if e.category is Category.AUTOCAST_COPIES]
    assert peak_live_bytes(copies) == held


def test_emulated_peak_drops_by_three_copies():
    def peak(inference_mode):
        return batchfit.estimate(four_linears, (1024,), 4, mode="infer", precision="amp-fp16",
                                 inference_mode=inference_mode, stack="torch2.11+cu128",
                                 device=A100).peak_allocated_bytes

    assert peak(False) - peak(True) == 3 * 2 * MIB


@pytest.mark.skipif(not INSTALLED_SKIPS_CACHE, reason="the installed torch predates #165068")
def test_cpu_prediction_matches_a_real_inference_mode_step():
    # bf16 autocast on this CPU: the prediction against the profiler's allocator events of
    # a real step run under torch.inference_mode(), and the real runs' difference against
    # the hand count (three bf16 copies of 2 MiB fewer at the peak).
    def config(inference_mode):
        return TrainConfig(mode="infer", precision="amp-bf16", inference_mode=inference_mode)

    real = {im: measure_step(four_linears, (1024,), 4, config(im)).peak_bytes
            for im in (False, True)}
    assert real[False] - real[True] == 3 * 2 * MIB
    predicted = batchfit.estimate(four_linears, (1024,), 4, config=config(True),
                                  device="cpu").peak_allocated_bytes
    assert abs(predicted - real[True]) <= 0.02 * real[True]


def test_a_training_step_cannot_run_in_inference_mode():
    with pytest.raises(InvalidInputError, match="inference_mode=True goes with mode='infer'"):
        TrainConfig(mode="train", inference_mode=True)


def test_cli_inference_mode():
    runner = CliRunner()
    bad = runner.invoke(app, ["estimate", "timm:resnet18", "-b", "8", "--gpu", "A100 80GB",
                              "--inference-mode"])
    assert bad.exit_code == 2
    assert bad.output.strip().count("\n") == 0 and "--mode infer" in bad.output

    def copies(*flags):
        result = runner.invoke(app, ["estimate", "timm:vit_tiny_patch16_224", "-b", "8",
                                     "--gpu", "A100 80GB", "--mode", "infer", "--precision",
                                     "amp-fp16", "--torch-version", "2.11", "--json", *flags])
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout)["by_category"].get("autocast_copies", 0)

    # ViT-Tiny (width 192, MLP 768, 12 blocks) peaks in the last block's MLP, after its fc1
    # and before its fc2. Under no_grad every fp16 copy made so far is alive there, each
    # rounded up to the allocator's 512 B: per block the weights qkv 192x576, proj 192x192,
    # fc1 192x768 (2 B each: 221,184 + 73,728 + 294,912 B) and their biases (1,536 + 512 +
    # 1,536 B), 12 blocks; the patch convolution 192x3x16x16 (294,912 B) and its bias
    # (512 B); the last fc2 (768x192, 294,912 B; bias 512 B) for 11 blocks only; the head
    # not yet. Under inference mode on torch 2.11 no copy outlives its op.
    per_block = 221_184 + 73_728 + 294_912 + 1_536 + 512 + 1_536
    fc2 = 294_912 + 512
    assert copies() == 12 * per_block + 11 * fc2 + 294_912 + 512
    assert copies("--inference-mode") == 0


def test_the_flop_trace_sees_the_same_ops_in_inference_mode():
    # Under a real torch.inference_mode() a dispatch mode receives composite ops whole
    # (aten.linear instead of the autocast casts and aten.addmm), which the FLOP and byte
    # rules do not know: the trace runs the step under no_grad, so both modes give the
    # ops of a bf16-autocast Linear-ReLU-Linear: 3 + 2 casts, two addmm, one relu.
    from batchfit.speed.op_costs import trace_op_costs

    def ops(inference_mode):
        config = TrainConfig(mode="infer", precision="amp-bf16", inference_mode=inference_mode)
        return [o.op for o in trace_op_costs(lambda: nn.Sequential(
            nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10)), (64,), 8, config)]

    expected = ["aten._to_copy.default"] * 3 + ["aten.addmm.default", "aten.relu.default"] + \
        ["aten._to_copy.default"] * 2 + ["aten.addmm.default"]
    assert ops(False) == expected
    assert ops(True) == expected


def test_the_tracker_refuses_an_inference_mode_step():
    # Its dispatch mode would receive composite ops whole under inference mode and miss
    # the tensors made inside them; the profiler (above) sees every allocation.
    with pytest.raises(InvalidInputError, match="method='profiler'"):
        measure_step(four_linears, (1024,), 4,
                     TrainConfig(mode="infer", precision="amp-bf16", inference_mode=True),
                     method="tracker")


@pytest.mark.slow
def test_real_runs_are_the_users_inference_mode_step(tmp_path):
    # bench and search run real steps: under --inference-mode they must run the user's
    # torch.inference_mode(), not the trace's no_grad. This model refuses a real forward
    # outside inference mode (the fake trace is exempt), so each command succeeds only
    # if its real steps run in inference mode.
    path = tmp_path / "strict.py"
    path.write_text(
        "import torch\n"
        "from torch import nn\n"
        "from torch._subclasses.fake_tensor import is_fake\n"
        "class Strict(nn.Linear):\n"
        "    def forward(self, x):\n"
        "        if not is_fake(x) and not torch.is_inference_mode_enabled():\n"
        "            raise RuntimeError('not in inference mode')\n"
        "        return super().forward(x)\n"
        "def strict():\n"
        "    return Strict(64, 8)\n")
    runner = CliRunner()
    common = ["--device", "cpu", "--mode", "infer", "--input", "64", "--json"]
    bench = ["bench", f"{path}:strict", "--memory", "64MiB", "--batches", "4,8", *common]
    search = ["search", f"{path}:strict", "--memory-cap", "64MiB", "--boundary-runs", "1",
              *common]
    for args in (bench, search):
        assert runner.invoke(app, [*args, "--inference-mode"]).exit_code == 0
        under_no_grad = runner.invoke(app, args)
        assert under_no_grad.exit_code != 0 and "not in inference mode" in under_no_grad.output
