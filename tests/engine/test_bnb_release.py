"""The bitsandbytes release a QLoRA run used (``--quant nf4,bnb=0.42``, issue 36).

Before 0.43.2 ``MatMul4Bit.forward`` ended with ``ctx.tensors = (A, B)``: every 4-bit layer's
input stayed alive until the graph was freed, though backward only dequantizes ``B``
(bitsandbytes/autograd/_functions.py at 0.41.0; bitsandbytes#1270 stores ``(None, B)``).
Expected bytes are derived by hand from which of those inputs nothing else keeps.
"""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")

from tests.cli.test_cli_llm import TINY
from tests.engine.test_workloads import LAYERS, SPEC, H, I, _cpu, tiny_llama

from batchfit.cli import app
from batchfit.engine.spec import TrainConfig
from batchfit.engine.trace import trace_step
from batchfit.engine.tracer import EventKind, Phase
from batchfit.engine.workloads.spec import parse_quant
from batchfit.errors import InvalidInputError

BATCH, SEQ = 2, SPEC["input_ids"].shape[0]


def _live_when_backward_starts(trace) -> int:
    """Bytes alive after forward and loss, from the steady step's events."""
    live: dict[int, int] = {}
    for event in trace.steady_events:
        if event.phase is Phase.BACKWARD:
            break
        if event.kind is EventKind.ALLOC:
            live[event.key] = event.nbytes
        elif event.kind is EventKind.FREE:
            live.pop(event.key, None)
    return sum(live.values())


def _live(quant: str) -> int:
    config = TrainConfig(lora="r=8,targets=q_proj", quant=quant, precision="fp32",
                         checkpointing=False)
    return _live_when_backward_starts(trace_step(tiny_llama, SPEC, BATCH, config, _cpu()))


def test_an_old_release_keeps_each_4bit_input_nothing_else_keeps():
    # Per decoder layer, the 4-bit layers' inputs are: the input norm's output (q, k, v),
    # kept anyway by q's lora_A (no dropout: the same tensor); the attention output (o),
    # kept anyway by SDPA for its backward (the transpose back is a view of it); the
    # post-attention norm's output (gate, up) and SiLU(gate) * up (down), which nothing
    # else keeps: B x S x (H + I) float32 values more with 0.42.
    installed = _live("nf4")
    assert _live("nf4,bnb=0.42") - installed == LAYERS * BATCH * SEQ * (H + I) * 4
    assert _live("nf4,bnb=0.43.2") == installed


@pytest.mark.parametrize("text, version, keeps", [
    ("nf4,bnb=0.42", (0, 42, 0), True),
    ("nf4-dq, bitsandbytes=0.43.1", (0, 43, 1), True),
    ("nf4,bnb=0.43.2", (0, 43, 2), False),
    ("int8,bnb=0.41", (0, 41, 0), False),  # LLM.int8 has its own autograd function
    ("nf4", None, False),
])
def test_the_release_follows_the_method(text, version, keeps):
    quant = parse_quant(text)
    assert (quant.bnb_version, quant.keeps_matmul_input) == (version, keeps)
    assert TrainConfig(lora="r=8", quant=text).quant.bnb_version == version


@pytest.mark.parametrize("text, fragment", [
    ("nf4,bnb=latest", "malformed bitsandbytes release 'latest'"),
    ("nf4,torch=2.1", "quant item 'torch=2.1': only the bitsandbytes release"),
])
def test_a_bad_release_is_refused(text, fragment):
    with pytest.raises(InvalidInputError, match=fragment):
        parse_quant(text)


def test_the_cli_refuses_a_bad_release_in_one_line():
    result = CliRunner().invoke(app, ["estimate", *TINY, "-b", "2", "--lora", "r=8",
                                      "--quant", "nf4,bnb=x"])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "malformed bitsandbytes release 'x'" in lines[0]
