"""CUDA's autocast state in a checkpoint recomputation under the emulation (issue 36).

torch.utils.checkpoint restores the autocast state of its arguments' device only, the CPU
a fake trace runs on; the emulation's CPU autocast stands for CUDA's, so code that asks
``torch.is_autocast_enabled()`` (CUDA's state) must see it enabled in the recomputation
too. peft's bitsandbytes LoRA layers ask (``requires_conversion = not
torch.is_autocast_enabled()``): before, a QLoRA step with LoRA dropout, amp and
(non-reentrant) checkpointing failed with a CheckpointError, the dropout's input cast to
float32 in the recomputation but bf16 in forward.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")

from tests.engine.test_workloads import LAYERS, SPEC, _gpu, tiny_llama

from batchfit.engine.cuda_emulation import CudaEmulation
from batchfit.engine.spec import TrainConfig
from batchfit.engine.trace import trace_step
from batchfit.engine.tracer import EventKind, Phase


def test_cuda_autocast_follows_the_cpu_stand_in_outside_a_region():
    original = torch.is_autocast_enabled
    with CudaEmulation((8, 0), autocast_dtype=torch.bfloat16):
        assert not torch.is_autocast_enabled()
        with torch.autocast("cpu", dtype=torch.bfloat16):  # as a recomputation enters it
            assert torch.is_autocast_enabled() and torch.is_autocast_enabled("cuda")
        assert not torch.is_autocast_enabled("cuda")
    assert torch.is_autocast_enabled is original


def _dropout_masks(trace, phase: Phase) -> Counter:
    """The LoRA dropouts' masks (``empty_like(input).bernoulli_``: the input's dtype)."""
    return Counter((e.module, e.nbytes) for e in trace.steady_events
                   if e.kind is EventKind.ALLOC and e.phase is phase
                   and "lora_dropout" in e.module and e.op == "aten.empty_like.default")


def test_qlora_with_dropout_recomputes_as_its_forward():
    config = TrainConfig(lora="r=8,dropout=0.1,targets=all-linear", quant="nf4",
                         precision="amp-bf16", checkpointing=True)
    trace = trace_step(tiny_llama, SPEC, 2, config, _gpu())
    forward = _dropout_masks(trace, Phase.FORWARD)
    # one LoRA dropout per adapted layer (7 a decoder layer), each recomputed once in
    # backward on an input of the forward's dtype, so with the forward's bytes
    assert sum(forward.values()) == 7 * LAYERS
    assert _dropout_masks(trace, Phase.BACKWARD) == forward
