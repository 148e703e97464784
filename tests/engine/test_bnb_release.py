"""The bitsandbytes release a QLoRA run used (``--bitsandbytes-version``, issue 36).

Before 0.43.2 ``MatMul4Bit.forward`` ended with ``ctx.tensors = (A, B)``: every 4-bit layer's
input stayed alive until the graph was freed, though backward only dequantizes ``B``
(bitsandbytes/autograd/_functions.py at 0.41.0; bitsandbytes#1270 stores ``(None, B)``).
Expected bytes are derived by hand from which of those inputs nothing else keeps.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")

from tests.engine.test_workloads import LAYERS, SPEC, H, I, _cpu, live_before, tiny_llama

from batchfit.engine.spec import TrainConfig
from batchfit.engine.trace import trace_step
from batchfit.engine.tracer import Phase

BATCH, SEQ = 2, SPEC["input_ids"].shape[0]


def _live(version: str | None) -> int:
    config = TrainConfig(lora="r=8,targets=q_proj", quant="nf4", precision="fp32",
                         checkpointing=False, bitsandbytes_version=version)
    return live_before(trace_step(tiny_llama, SPEC, BATCH, config, _cpu()), Phase.BACKWARD)


def test_an_old_release_keeps_each_4bit_input_nothing_else_keeps():
    # Per decoder layer, the 4-bit layers' inputs are: the input norm's output (q, k, v),
    # kept anyway by q's lora_A (no dropout: the same tensor); the attention output (o),
    # kept anyway by SDPA for its backward (the transpose back is a view of it); the
    # post-attention norm's output (gate, up) and SiLU(gate) * up (down), which nothing
    # else keeps: B x S x (H + I) float32 values more with 0.42.
    installed = _live(None)
    assert _live("0.42") - installed == LAYERS * BATCH * SEQ * (H + I) * 4
    assert _live("0.43.2") == installed
