"""torchtune's QLoRA model build on the GPU (issue 36): the temporaries of torchao's ``to_nf4``
and ``get_original_weight`` as their sources allocate them, what the caching allocator keeps of
one quantized linear's build, and the build ahead of the traced step.

Expected values are worked out by hand from torchao's nf4tensor.py (v0.1 and the chunked
releases, cited in src/batchfit/engine/workloads/torchtune_build.py) and from the allocator
rules of c10/cuda/CUDACachingAllocator.cpp that batchfit.device.allocator implements:
requests of at most 1 MiB use the small pool; 1-10 MiB get a 20 MiB segment; from 10 MiB a
segment of the size rounded to 2 MiB; best fit in (size, address) order; a large block splits
when more than 1 MiB would remain.
"""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from batchfit.device.allocator import CachingAllocator
from batchfit.engine.tracer import Category, EventKind, Phase, Tracer
from batchfit.engine.workloads.torchtune_build import (
    CHUNK_SIZE,
    BuildStep,
    _record_linear,
    dequantize_steps,
    to_nf4_steps,
)
from batchfit.errors import InvalidInputError

MiB = 2**20


def _peak(steps) -> tuple[int, int]:
    """(most bytes of temporaries alive at once, bytes left alive at the end)."""
    live: dict[str, int] = {}
    peak = 0
    for step in steps:
        if step.step is BuildStep.ALLOC:
            live[step.name] = step.nbytes
            peak = max(peak, sum(live.values()))
        elif step.step is BuildStep.FREE:
            del live[step.name]
    return peak, sum(live.values())


def test_torchao_01_compares_every_value_with_the_16_levels_at_once():
    n = 64 * 256 * 4  # 65,536 bf16 values: 1,024 blocks of 64
    steps = to_nf4_steps(n, 2, chunked=False)
    # at ``diff = (value - nf4).abs()``: the block maxima (2 B per block), ``scaled_blocks``
    # (2 B per value) and the two (n, 16) bf16 tensors (32 B per value each)
    assert _peak(steps) == (1024 * 2 + n * 2 + 2 * n * 32, 0)
    assert [s.step for s in steps].count(BuildStep.KEEP_SCALERS) == 1
    assert [s.step for s in steps].count(BuildStep.KEEP_DATA) == 1


def test_chunked_to_nf4_holds_one_chunk_of_comparisons():
    n = 2 * CHUNK_SIZE + 64 * 256  # two full chunks and a 16,384-value rest
    steps = to_nf4_steps(n, 2, chunked=True)
    # block maxima (2 B per block), ``scaled_blocks`` (2 B per value), the uint8 buffer
    # (1 B per value), and one full chunk's two (CHUNK, 16) bf16 tensors
    assert _peak(steps) == ((n // 64) * 2 + n * 3 + 2 * CHUNK_SIZE * 32, 0)
    chunks = {s.nbytes // 32 for s in steps
              if s.step is BuildStep.ALLOC and s.name.endswith("value - nf4")}
    assert chunks == {CHUNK_SIZE, 64 * 256}  # every full chunk is the same: one stands for all


def test_get_original_weight_leaves_the_bf16_weight():
    n = 64 * 256 * 4
    # at ``torch.stack``: first/second elements as int64 (n/2 x 8 B each), the two
    # dequantized halves and the two scaled halves (n/2 x 2 B each), the scalers
    # (2 B per block) and the stacked weight (n x 2 B), which stays
    assert _peak(dequantize_steps(n, 2)) == (2 * n * 4 + 4 * n + n // 64 * 2 + 2 * n, 2 * n)


def _segments(chunked: bool) -> list[tuple[int, int]]:
    """The large-pool segments (MiB, live MiB) after one 4096 x 4096 linear's build, its
    packed data (8 MiB) and fp32 absmax (1 MiB) kept."""
    tracer = Tracer()

    def keep(step):
        size = 8 * MiB if step is BuildStep.KEEP_DATA else MiB
        tracer.transient(size, Category.PARAMETERS, "kept")

    _record_linear(tracer, "q_proj", keep, 4096 * 4096, chunked)
    allocator, handles = CachingAllocator(), {}
    for event in tracer.events:
        if event.kind is EventKind.ALLOC:
            handles[event.key] = allocator.malloc(event.nbytes)
        else:
            allocator.free(handles.pop(event.key))
    return [(s.size_bytes // MiB, sum(b.size_bytes for b in s.blocks if b.allocated) // MiB)
            for s in allocator.segments() if not s.is_small_pool]


def test_torchao_01_build_of_one_linear_keeps_two_512_mib_segments():
    # n = 16 Mi values. The bf16 weight (32 MiB) and the first absmax copy (32 MiB) get
    # their own segments; the 2 MiB int64 block indices a 20 MiB one, reused. ``value -
    # nf4`` and ``diff`` (512 MiB each) get two more; once ``value - nf4`` is freed, the
    # minima (32 MiB), indices (128 MiB) and the two 64 MiB int64 packing steps are split
    # from its segment; the kept 8 MiB packed data takes the smallest free block that
    # fits, the 20 MiB segment's. All else is freed, nothing is returned to the driver.
    assert _segments(chunked=False) == [(32, 0), (32, 0), (20, 8), (512, 0), (512, 0)]


def test_chunked_build_of_one_linear_keeps_32_mib_chunk_segments():
    # As above up to ``scaled_blocks``; the 16 MiB uint8 buffer splits the 20 MiB segment;
    # a chunk's two 32 MiB comparisons get two segments, its 8 MiB indices split the first
    # of them once the first is freed (the 2 MiB minima fit the 20 MiB segment's 4 MiB
    # rest; the 1 MiB uint8 copy is small-pool); ``<< 4`` (8 MiB) and then the kept 8 MiB
    # data split that first 32 MiB segment.
    assert _segments(chunked=True) == [(32, 0), (32, 0), (20, 0), (32, 8), (32, 0)]


transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")

from tests.engine.test_workloads import SPEC, H, I, _gpu, tiny_llama  # noqa: E402

from batchfit.engine.spec import TrainConfig  # noqa: E402
from batchfit.engine.trace import trace_step  # noqa: E402


def _setup(version: str | None):
    config = TrainConfig(lora="r=8,targets=all-linear", quant="nf4", recipe="torchtune",
                         torchtune_version=version)
    trace = trace_step(tiny_llama, SPEC, 2, config, _gpu())
    return [e for e in trace.steady_events if e.phase is Phase.SETUP]


def _live_by_category(events) -> dict[Category, int]:
    live: dict[int, tuple[Category, int]] = {}
    for e in events:
        if e.kind is EventKind.ALLOC:
            live[e.key] = (e.category, e.nbytes)
        elif e.kind is EventKind.FREE:
            live.pop(e.key, None)
    totals: dict[Category, int] = {}
    for category, nbytes in live.values():
        totals[category] = totals.get(category, 0) + nbytes
    return totals


@pytest.mark.parametrize("version", [None, "0.5", "0.1"])
def test_the_build_leaves_only_the_model(version):
    setup = _setup(version)
    temporaries = [e for e in setup if e.category is Category.TEMPORARIES]
    # the largest temporary: the (n, 16) bf16 comparison of an I x H MLP weight, which is
    # below one chunk in this model, so every release makes it whole
    assert max(e.nbytes for e in temporaries) == I * H * 16 * 2
    left = _live_by_category(setup)
    assert Category.TEMPORARIES not in left
    plain = _live_by_category(e for e in trace_step(
        tiny_llama, SPEC, 2, TrainConfig(lora="r=8,targets=all-linear", quant="nf4",
                                         recipe="torchtune", precision="bf16"),
        _cpu_target()).steady_events if e.phase is Phase.SETUP)
    assert left == plain  # the same parameters, buffers and inputs as a trace without a build
    copies = any(e.op.startswith("clone ") for e in setup)
    assert copies is (version in ("0.5", "0.1"))  # deep copies of one layer until 0.6


def _cpu_target():
    from tests.engine.test_workloads import _cpu

    return _cpu()


@pytest.mark.parametrize("words, fragment", [
    (dict(lora="r=8", quant="nf4", torchtune_version="0.1"), "add recipe='torchtune'"),
    (dict(lora="r=8", recipe="torchtune", torchtune_version="0.1"), "and quant='nf4'"),
    (dict(lora="r=8", quant="nf4", recipe="torchtune", torchtune_version="latest"),
     "malformed torchtune_version"),
])
def test_the_release_needs_torchtunes_qlora_build(words, fragment):
    with pytest.raises(InvalidInputError, match=fragment):
        TrainConfig(**words)


def test_cli_refuses_a_release_without_the_recipe_in_one_line():
    from batchfit.cli import app
    from tests.cli.test_cli_llm import TINY

    result = CliRunner().invoke(app, ["estimate", *TINY, "-b", "2", "--lora", "r=8", "--quant",
                                      "nf4", "--torchtune-version", "0.1"])
    assert result.exit_code == 2, result.output
    assert "--torchtune-version models torchtune's QLoRA model build: add --recipe torchtune" \
        in result.output
    assert len([line for line in result.output.splitlines() if line.strip()]) == 1


def test_the_answer_peaks_in_the_build_of_a_small_model():
    import batchfit

    # the tiny model's step holds well under a MiB of activations at 2 x 64 tokens, while
    # quantizing an I x H weight holds two 4 MiB (n, 16) comparisons: the reserved peak is
    # the build's, which the steady step's answer now carries
    config = TrainConfig(lora="r=8,targets=all-linear", quant="nf4", recipe="torchtune")
    result = batchfit.estimate(tiny_llama, SPEC, 2, config, device=_gpu())
    assert result.peak_phase is Phase.SETUP and result.peak_op.startswith("to_nf4 ")
    assert result.peak_allocated_bytes >= 2 * I * H * 16 * 2


def test_chunked_steps_follow_the_installed_torchao():
    torchao = pytest.importorskip("torchao.quantization")
    import torch

    # an independent run: the installed torchao's own to_nf4 on a real CPU weight, its
    # storages recorded by batchfit's tracer. Its temporaries (the storages it frees) must
    # be the modelled ones, in order; what it keeps is the NF4 tensor.
    weight = torch.randn(256, 256, dtype=torch.bfloat16)
    tracer = Tracer()
    with tracer:
        kept = torchao.to_nf4(weight)
    freed = {e.key for e in tracer.events if e.kind is EventKind.FREE}
    real = [e.nbytes for e in tracer.events if e.kind is EventKind.ALLOC and e.key in freed]
    modelled = [s.nbytes for s in to_nf4_steps(256 * 256, 2, chunked=True)
                if s.step is BuildStep.ALLOC]
    assert real == modelled
    assert kept.quantized_data.numel() == 256 * 256 // 2


SMALL_LLAMA = ["hf:meta-llama/Llama-2-7b-hf", "--seq-len", "64",
               *[item for kv in ("num_hidden_layers=2", "hidden_size=256", "intermediate_size=512",
                                 "num_attention_heads=4", "num_key_value_heads=4",
                                 "vocab_size=1000") for item in ("--model-kwargs", kv)]]


def test_cli_json_carries_the_build_as_the_peak():
    import json

    from batchfit.cli import app

    result = CliRunner().invoke(app, ["estimate", *SMALL_LLAMA, "-b", "2", "--gpu", "RTX 4090",
                                      "--lora", "r=8,targets=all-linear", "--quant", "nf4",
                                      "--recipe", "torchtune", "--torchtune-version", "0.1",
                                      "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    # each 512 x 256 MLP weight's two (n, 16) bf16 comparisons are 4 MiB each, more than
    # this step's activations: the peak is torchao 0.1's quantization in the build
    assert data["peak_phase"] == "setup" and data["peak_op"].startswith(("to_nf4 ", "clone "))
    assert data["peak_allocated_bytes"] >= 2 * 512 * 256 * 16 * 2


def test_cli_refuses_a_weight_torchao_cannot_quantize():
    from batchfit.cli import app
    from tests.cli.test_cli_llm import TINY  # 64-wide projections: 4,096 values each

    result = CliRunner().invoke(app, ["estimate", *TINY, "-b", "2", "--gpu", "RTX 4090",
                                      "--lora", "r=8", "--quant", "nf4", "--recipe", "torchtune"])
    assert result.exit_code == 2, result.output
    assert "multiple of 16,384 values" in result.output and "Traceback" not in result.output
    assert len([line for line in result.output.splitlines() if line.strip()]) == 1


@pytest.mark.parametrize("version, freed_op", [
    # torchtune 0.1's inplace_copy gives the parameter the new NF4 tensors and drops its own
    # (torchtune/utils/_register_nf4_dispatch_ops.py at 0914d5cfb)
    ("0.1", ""),
    # torchao's copy_ copies the new tensors into the parameter's, then drops the new ones
    (None, "to_nf4"),
])
def test_the_load_drops_one_set_of_nf4_tensors(version, freed_op):
    setup = _setup(version)
    freed = {e.key for e in setup if e.kind is EventKind.FREE}
    parameters = [e for e in setup if e.kind is EventKind.ALLOC
                  and e.category is Category.PARAMETERS and e.key in freed]
    assert parameters and {e.op.split(" ")[0] for e in parameters} == {freed_op}
