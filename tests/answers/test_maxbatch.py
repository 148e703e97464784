"""max_batch_size: exact boundary, confirmed by independent estimates, in few traces."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import batchfit
from batchfit.answers.maxbatch import (
    Constraint,
    _largest_fitting,
    max_batch_size,
    max_seq_len,
)
from batchfit.device.profile import DeviceProfile
from batchfit.errors import DoesNotFitError

MIB = 1 << 20


def cnn():
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                         nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(16, 10))


class BatchDependent(nn.Module):
    """Runs an extra op above batch 40, so traces at 16 and 32 cannot be interpolated."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(256, 256)

    def forward(self, x):
        y = self.lin(x)
        if x.shape[0] > 40:
            y = y * 2
        return y


def _boundary_holds(model, inputs, budget, answer, device, **options):
    at = batchfit.estimate(model, inputs, answer, device=device, **options)
    above = batchfit.estimate(model, inputs, answer + 1, device=device, **options)
    overhead = device.context_bytes + device.workspace_bytes if device.is_cuda else 0
    return at.total_bytes - overhead <= budget < above.total_bytes - overhead


@pytest.mark.parametrize("memory_mib", [40, 97])
def test_cpu_answer_is_the_exact_boundary(memory_mib):
    result = max_batch_size(cnn, (3, 32, 32), device="cpu", memory_bytes=memory_mib * MIB)
    assert _boundary_holds(cnn, (3, 32, 32), memory_mib * MIB, result.max_batch_size,
                           DeviceProfile.cpu())
    assert result.traces <= 6
    assert result.binding_constraint is Constraint.MEMORY


def test_cuda_answer_is_the_exact_boundary_with_reserved_memory():
    t4 = DeviceProfile.cuda(1 << 30, (7, 5), name="small T4")
    result = max_batch_size(cnn, (3, 64, 64), device=t4, precision="amp-fp16")
    assert result.budget_bytes == (1 << 30) - t4.context_bytes - t4.workspace_bytes
    assert _boundary_holds(cnn, (3, 64, 64), result.budget_bytes, result.max_batch_size, t4,
                           precision="amp-fp16")
    assert result.total_bytes_at_max <= 1 << 30 < result.total_bytes_at_next


def test_batch_dependent_structure_falls_back_to_the_solver():
    result = max_batch_size(BatchDependent, (256,), device="cpu", memory_bytes=8 * MIB)
    assert _boundary_holds(BatchDependent, (256,), 8 * MIB, result.max_batch_size,
                           DeviceProfile.cpu())


def test_margin_lowers_the_budget():
    plain = max_batch_size(cnn, (3, 32, 32), device="cpu", memory_bytes=64 * MIB)
    margin = max_batch_size(cnn, (3, 32, 32), device="cpu", memory_bytes=64 * MIB, margin=0.25)
    assert margin.budget_bytes == 48 * MIB
    assert margin.max_batch_size < plain.max_batch_size


def test_nothing_fits_reports_bytes():
    with pytest.raises(DoesNotFitError) as info:
        max_batch_size(cnn, (3, 32, 32), device="cpu", memory_bytes=64 * 1024)
    assert info.value.available_bytes == 64 * 1024
    assert info.value.needed_bytes > 64 * 1024


def test_tiny_model_is_capped():
    result = max_batch_size(lambda: nn.Linear(4, 2), (4,), device="cpu",
                            memory_bytes=1 << 30, max_batch_limit=1000)
    assert result.max_batch_size == 1000
    assert result.binding_constraint is Constraint.LIMIT and "max_batch_limit" in result.note


def test_native_depthwise_int32_limit_binds_before_memory():
    # On torch 2.4 a 7x7 depthwise convolution in fp32 runs torch's native kernel (cuDNN
    # takes only fp16 ones there, Convolution.cpp use_cudnn_depthwise), which checks
    # canUse32BitIndexMath(input) and (output): numel < 2**31 - 1. One sample is
    # 64 * 256 * 256 = 2**22 elements, so B <= (2**31 - 2) // 2**22 = 511; at 512 the
    # input has 2**31 = 2,147,483,648 elements. Memory (2 x 16 MiB per sample) would
    # allow about 2,500 samples on the 80 GiB card.
    def depthwise():
        return nn.Sequential(nn.Conv2d(64, 64, 7, padding=3, groups=64))

    gpu = DeviceProfile.cuda(80 << 30, (8, 0))
    result = max_batch_size(depthwise, (64, 256, 256), device=gpu, mode="infer",
                            stack="torch2.4+cu124")
    assert result.binding_constraint is Constraint.INT32_INDEXING
    assert result.max_batch_size == 511
    assert "native depthwise conv2d" in result.note and "aten.convolution.default" in result.note
    assert "2,147,483,648" in result.note and " in 0 " in result.note
    assert "DepthwiseConv2d.cu" in result.note


def test_reflection_padding_int32_limit_binds_before_memory():
    # timm's BlurPool2d pads with F.pad(mode="reflect"): ReflectionPad.cu's
    # reflection_pad2d_out_template checks canUse32BitIndexMath(input). One sample is
    # 64 * 256 * 256 = 2**22 elements, so B <= (2**31 - 2) // 2**22 = 511, whatever the
    # padded output's size; memory (16 MiB in, 16.25 MiB out per sample) allows ~2,500.
    def blur_pad():
        return nn.Sequential(nn.ReflectionPad2d(1))

    gpu = DeviceProfile.cuda(80 << 30, (8, 0))
    result = max_batch_size(blur_pad, (64, 256, 256), device=gpu, mode="infer",
                            stack="torch2.4+cu124")
    assert result.binding_constraint is Constraint.INT32_INDEXING
    assert result.max_batch_size == 511
    assert "reflection padding" in result.note and "aten.reflection_pad2d" in result.note
    assert "ReflectionPad.cu" in result.note


@pytest.mark.parametrize("pool", [nn.AvgPool2d, nn.MaxPool2d])
def test_pooling_output_count_binds_before_memory(pool):
    # AveragePool2d.cu / DilatedMaxPool2d.cu narrow output.numel() to a 32-bit int
    # (safe_downcast, inclusive): 2x2 pooling of 64 x 256 x 256 outputs 2**20 elements per
    # sample, so B <= (2**31 - 1) // 2**20 = 2047. Memory (16 MiB in, 4 MiB out, 8 MiB of
    # int64 indices for max pooling, per sample) would allow about 2,900 samples.
    gpu = DeviceProfile.cuda(80 << 30, (8, 0))
    result = max_batch_size(lambda: nn.Sequential(pool(2)), (64, 256, 256), device=gpu,
                            mode="infer", stack="torch2.4+cu124")
    assert result.binding_constraint is Constraint.INT32_INDEXING
    assert result.max_batch_size == 2047
    assert "safe_downcast" in result.note and "2,147,483,648" in result.note


def test_large_tensors_that_kernels_split_do_not_bind():
    # Nearest upsampling (size_t indices in UpSampleNearest2d.cu) and ReLU (TensorIterator
    # splits into 32-bit pieces) take tensors beyond 2**31 elements (from B = 43), so this
    # is a memory question only: the upsampled and the ReLU output are both alive, 2 x
    # 3 * 4096**2 * 4 B = 384 MiB per sample, against 80 GiB - 512 MiB context - 16.25 MiB
    # cuBLAS workspaces = 81,391.75 MiB (plus one 2 MiB segment for the input):
    # 211 * 384 + 2 = 81,026 fits, 212 * 384 + 2 = 81,410 does not.
    def up():
        return nn.Sequential(nn.Upsample(size=(4096, 4096)), nn.ReLU())

    gpu = DeviceProfile.cuda(80 << 30, (8, 0))
    result = max_batch_size(up, (3, 8, 8), device=gpu, mode="infer")
    assert result.binding_constraint is Constraint.MEMORY
    assert result.max_batch_size == 211
    assert result.estimate_at_max.kernel_limit is None


def test_longest_sequence():
    pytest.importorskip("transformers")
    from batchfit import TensorSpec

    gpt2 = tiny_gpt2
    spec = {"input_ids": TensorSpec((128,), "int64", high=500),
            "labels": TensorSpec((128,), "int64", high=500)}
    result = max_seq_len(gpt2, spec, 2, device="cpu", memory_bytes=256 * MIB, max_len=4096,
                         multiple_of=64)
    from batchfit.answers.maxbatch import with_seq_len

    at = batchfit.estimate(gpt2, with_seq_len(spec, result.max_seq_len), 2)
    above = batchfit.estimate(gpt2, with_seq_len(spec, result.max_seq_len + 64), 2)
    assert at.total_bytes <= 256 * MIB < above.total_bytes
    assert result.max_seq_len % 64 == 0


def _tag_with_pid(batch_size):
    import os

    return (batch_size, os.getpid())


#: Run in a fresh interpreter: it needs a process that has not run a backward pass yet.
_POOL_CHECK = """
import json, os, torch
from batchfit.answers import tracepool

def backward_then_tag(batch_size):
    x = torch.ones(3, requires_grad=True)
    (x * batch_size).sum().backward()
    return (batch_size, os.getpid(), x.grad.tolist())

tracepool._can_fork = lambda: True
tracepool._idle_cores = lambda: 2.0
with tracepool.TracePool(backward_then_tag) as pool:
    first = pool.map([16, 32, 48])
    second = pool.map([553, 554])  # after this process ran backward passes
print(json.dumps({"me": os.getpid(), "first": first, "second": second}))
"""


def test_trace_pool_serves_every_pair_from_one_worker_forked_before_any_backward():
    import json
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _POOL_CHECK], capture_output=True,
                          text=True, check=True, timeout=300)
    out = json.loads(done.stdout.strip().splitlines()[-1])
    me, first, second = out["me"], out["first"], out["second"]
    assert first["16"] == [16, me, [16.0] * 3] and first["48"] == [48, me, [48.0] * 3]
    worker = first["32"][1]
    assert worker != me and first["32"] == [32, worker, [32.0] * 3]  # from the worker
    assert second["553"][1] == me and second["554"] == [554, worker, [554.0] * 3]  # same


def test_trace_pool_runs_in_sequence_after_a_backward_in_this_process(monkeypatch):
    import os

    import torch

    from batchfit.answers import tracepool

    torch.ones(2, requires_grad=True).sum().backward()  # a fork now cannot run backward
    monkeypatch.setattr(tracepool, "_can_fork", lambda: True)
    monkeypatch.setattr(tracepool, "_idle_cores", lambda: 2.0)
    traced = []
    with tracepool.TracePool(lambda b: traced.append(b) or (b, os.getpid())) as pool:
        assert pool.map([16, 32]) == {16: (16, os.getpid()), 32: (32, os.getpid())}
    assert traced == [16, 32]  # each traced once, here: the worker declined at once
    with tracepool.TracePool(_tag_with_pid, allowed=False) as pool:
        assert pool.map([16, 32]) == {16: (16, os.getpid()), 32: (32, os.getpid())}


def test_trace_pool_falls_back_when_the_worker_fails(monkeypatch):
    import os

    from batchfit.answers import tracepool

    parent = os.getpid()

    def fails_in_worker(batch_size):
        if os.getpid() != parent:
            raise RuntimeError("worker trouble")
        return batch_size * 10

    monkeypatch.setattr(tracepool, "_can_fork", lambda: True)
    monkeypatch.setattr(tracepool, "_idle_cores", lambda: 2.0)
    with tracepool.TracePool(fails_in_worker) as pool:
        assert pool.map([1, 2]) == {1: 10, 2: 20}
        assert pool._worker is None  # stopped: later pairs run here
        assert pool.map([3, 4]) == {3: 30, 4: 40}


#: The trace pool forced on, counting its forks, pairs and stopped workers, for a script
#: run in a fresh interpreter (no backward yet) by :func:`_in_fresh_interpreter`.
_FORCED_POOL = """
import json, sys
sys.path.insert(0, sys.argv[1])
from batchfit import TensorSpec
from batchfit.answers import tracepool
from batchfit.device.profile import DeviceProfile
from batchfit.answers.maxbatch import max_batch_size, max_seq_len
from test_maxbatch import cnn, tiny_gpt2

tracepool._can_fork = lambda: True
tracepool._idle_cores = lambda: 2.0
forks, pairs, stops = [], [], []
fork, pair = tracepool._Worker.fork, tracepool.TracePool._pair
stop = tracepool.TracePool._stop_worker
tracepool._Worker.fork = classmethod(lambda cls, trace: forks.append(1) or fork(trace))
tracepool.TracePool._pair = lambda self, a, b: pairs.append((a, b)) or pair(self, a, b)
tracepool.TracePool._stop_worker = lambda self: stops.append(1) or stop(self)
"""

_PARALLEL_MAX = _FORCED_POOL + """
result = max_batch_size(cnn, (3, 64, 64), device=DeviceProfile.cuda(1 << 30, (7, 5)))
print(json.dumps({"answer": result.max_batch_size, "evaluated": result.evaluated,
                  "forks": len(forks), "stops": len(stops)}))
"""


def _in_fresh_interpreter(code: str, *arguments: str) -> dict:
    """Run ``code`` (tests' folder first on its argv) and read the JSON it prints last."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    done = subprocess.run([sys.executable, "-c", code, str(Path(__file__).parent), *arguments],
                          capture_output=True, text=True, check=True, timeout=300)
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_parallel_and_sequential_traces_give_the_same_answer(monkeypatch):
    from batchfit.answers import tracepool

    parallel = _in_fresh_interpreter(_PARALLEL_MAX)
    # one worker, forked before the first backward, traced one of each pair (the second
    # pair follows that process's backward passes on fake CUDA tensors): none failed
    assert parallel["forks"] == 1 and parallel["stops"] == 0
    monkeypatch.setattr(tracepool, "_can_fork", lambda: False)
    sequential = max_batch_size(cnn, (3, 64, 64), device=DeviceProfile.cuda(1 << 30, (7, 5)))
    assert parallel["answer"] == sequential.max_batch_size and sequential.traces == 4
    assert [tuple(e) for e in parallel["evaluated"]] == list(sequential.evaluated)


def tiny_gpt2():
    import transformers

    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=500,
                                  n_positions=4096)
    return transformers.GPT2LMHeadModel(cfg)


#: ``max_seq_len`` on a CUDA profile with the trace pool forced on.
_PARALLEL_SEQ = _FORCED_POOL + """
spec = {"input_ids": TensorSpec((128,), "int64", high=500),
        "labels": TensorSpec((128,), "int64", high=500)}
gpu = DeviceProfile.cuda(int(sys.argv[2]), (8, 0))
result = max_seq_len(tiny_gpt2, spec, 2, device=gpu, max_len=4096, multiple_of=64)
print(json.dumps({"answer": result.max_seq_len, "capped": result.capped, "pairs": pairs,
                  "stops": len(stops)}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("memory_mib", [700, 4096])
def test_sequence_search_traces_its_first_lengths_in_pairs(memory_mib, monkeypatch):
    # The solver's first lengths (64; its probes 1024 and 2048; and 4096, the cap) are
    # traced two at a time; the answer is the one found one trace at a time.
    from batchfit import TensorSpec
    from batchfit.answers import tracepool

    pytest.importorskip("transformers")
    parallel = _in_fresh_interpreter(_PARALLEL_SEQ, str(memory_mib * MIB))
    assert parallel["pairs"][:2] == [[64, 1024], [2048, 4096]] and parallel["stops"] == 0
    monkeypatch.setattr(tracepool, "_can_fork", lambda: False)
    spec = {"input_ids": TensorSpec((128,), "int64", high=500),
            "labels": TensorSpec((128,), "int64", high=500)}
    sequential = max_seq_len(tiny_gpt2, spec, 2, device=DeviceProfile.cuda(memory_mib * MIB,
                                                                           (8, 0)),
                             max_len=4096, multiple_of=64)
    assert parallel["answer"] == sequential.max_seq_len
    assert parallel["capped"] == sequential.capped == (memory_mib == 4096)


class WindowAttention(nn.Module):
    """Swin-style attention over 64 windows of 4 tokens per sample: the fused kernels see
    a batch of 64 * B windows, so at B = 1024 a grid dimension reaches 65,536."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(16, 48)

    def forward(self, x):  # x: (B, 64, 4, 16)
        b = x.shape[0]
        q, k, v = self.qkv(x).reshape(b * 64, 4, 3, 2, 8).permute(2, 0, 3, 1, 4)
        out = nn.functional.scaled_dot_product_attention(q, k, v)
        return out.transpose(1, 2).reshape(b, 64, 4, 16)


def test_grid_dimension_limit_binds_before_memory():
    # Memory would allow far more than 1024 samples (a few KiB each on an 80 GB card);
    # flash attention launches (blocks, 64 * B, 2): 64 * B <= 65,535 gives B <= 1023.
    result = max_batch_size(WindowAttention, (64, 4, 16), device="A100-80GB",
                            precision="amp-fp16", mode="infer")
    assert result.binding_constraint is Constraint.GRID_DIM
    assert result.max_batch_size == 65535 // 64 == 1023
    assert "65,536" in result.note and "<root>" in result.note
    assert "scaled_dot_product_attention (flash)" in result.note
    assert result.to_dict()["binding_constraint"] == "grid_dim"


class BiasedWindowAttention(WindowAttention):
    """The same with a relative-position bias (maxxvit's): a mask rules flash out, so
    memory-efficient attention runs, on a grid of (query blocks, heads, 64 * B)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("bias", torch.zeros(1, 2, 4, 4))

    def forward(self, x):  # x: (B, 64, 4, 16)
        b = x.shape[0]
        q, k, v = self.qkv(x).reshape(b * 64, 4, 3, 2, 8).permute(2, 0, 3, 1, 4)
        out = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=self.bias.to(q.dtype))
        return out.transpose(1, 2).reshape(b, 64, 4, 16)


@pytest.mark.parametrize(("stack", "mode", "expected"), [
    ("torch2.4+cu124", "infer", 1023),   # one launch: 64 * B <= 65,535
    ("torch2.9+cu128", "infer", 1500),   # pieces of 65,535 (#154029): the cap binds
    ("torch2.9+cu128", "train", 1023),   # backward is not cut into pieces
])
def test_efficient_attention_runs_a_large_batch_in_pieces_from_torch_2_8(stack, mode, expected):
    result = max_batch_size(BiasedWindowAttention, (64, 4, 16), device="A100-80GB",
                            precision="amp-fp16", mode=mode, stack=stack, max_batch_limit=1500)
    assert result.max_batch_size == expected
    if expected == 1023:
        assert result.binding_constraint is Constraint.GRID_DIM
        assert "scaled_dot_product_attention (efficient)" in result.note
    else:
        assert result.binding_constraint is Constraint.LIMIT


def test_efficient_attention_pieces_and_their_concatenation_are_alive_together():
    # B = 1025: 65,600 windows of 4 tokens x 2 heads x 8 dims in fp16, 128 B each: pieces
    # of 65,535 and 65 windows (8,388,480 B and 8,320 B), concatenated into 8,396,800 B;
    # the pieces die after the concatenation.
    from batchfit import TrainConfig
    from batchfit.engine.trace import trace_step
    from batchfit.engine.tracer import EventKind

    config = TrainConfig(mode="infer", precision="amp-fp16", stack="torch2.9+cu128")
    device = DeviceProfile.cuda(80 << 30, (8, 0)).for_stack(config.resolved_stack)
    traced = trace_step(BiasedWindowAttention, (64, 4, 16), 1025, config, device)
    assert traced.kernel_limit.measure == 65535
    events = traced.steady_events
    outputs = [e for e in events if e.op in ("aten.new_empty.default", "aten.cat.default")
               and e.nbytes > 4096]
    assert [(e.nbytes, e.op) for e in outputs] == [
        (8_388_480, "aten.new_empty.default"), (8_320, "aten.new_empty.default"),
        (8_396_800, "aten.cat.default")]
    first_piece, whole = events.index(outputs[0]), events.index(outputs[2])
    freed = next(i for i, e in enumerate(events)
                 if e.kind is EventKind.FREE and e.key == outputs[0].key)
    assert first_piece < whole < freed


@settings(max_examples=300, deadline=None)
@given(answer=st.integers(32, 5000), guess=st.integers(-100, 10_000), limit=st.integers(32, 6000))
def test_largest_fitting_finds_the_last_fitting_batch_from_any_guess(answer, guess, limit):
    # fits(b) is "b <= answer": the search must return min(answer, limit), whatever the
    # guess, and a guess k samples off costs about 2*log2(k) + 2 calls, not a full bisection.
    calls = []

    def fits(b):
        assert 32 <= b <= limit, b   # never outside [low, high]
        calls.append(b)
        return b <= answer

    found = _largest_fitting(fits, 32, limit, guess)
    assert found == min(answer, limit)
    off = abs(min(max(guess, 33), limit) - found) + 1
    assert len(calls) <= 2 * math.log2(off) + 3


def test_largest_fitting_with_a_close_guess_takes_few_calls():
    # The answer is 553; a guess of 552 brackets it in 552 (fits), 553 (fits), 555 (fails)
    # and one bisection step at 554: four calls.
    calls = []
    assert _largest_fitting(lambda b: calls.append(b) or b <= 553, 32, 65536, 552) == 553
    assert calls == [552, 553, 555, 554]


def test_interpolated_answer_needs_no_more_than_four_traces():
    # 16 and 32 to fit the line, then B* and B*+1 to confirm it. A wrong interpolated
    # answer fails its confirmation and falls back to the solver, which costs more traces.
    t4 = DeviceProfile.cuda(1 << 30, (7, 5), name="small T4")
    result = max_batch_size(cnn, (3, 64, 64), device=t4, precision="amp-fp16")
    assert result.traces == 4
    assert sorted(b for b, _ in result.evaluated)[:2] == [16, 32]


@pytest.mark.parametrize("memory_mib, below", [(636, 16), (815, 32)])
def test_answers_below_the_traced_sizes_are_interpolated_too(memory_mib, below):
    # ~10 MiB per sample at 256x256: a card too small for batch 16 (or 32). The events
    # interpolated from 16 and 32 find the answer below them, and B*, B*+1 confirm it as
    # a pair: 4 traces. (The solver alone traced the probes, then one size at a time.)
    gpu = DeviceProfile.cuda(memory_mib * MIB, (7, 5))
    result = max_batch_size(cnn, (3, 256, 256), device=gpu, precision="amp-fp16")
    assert 1 < result.max_batch_size < below
    assert _boundary_holds(cnn, (3, 256, 256), result.budget_bytes, result.max_batch_size,
                           gpu, precision="amp-fp16")
    assert result.traces == 4


@pytest.mark.parametrize("memory_mib, answer", [(570, 0), (600, 1), (640, 2), (760, None)])
def test_a_small_answer_is_settled_by_the_first_pair(memory_mib, answer):
    # fit_batches=(1, 2) (the CLI's choice for LLM workloads): batches 1 and 2 are traced
    # first; 1 fitting and 2 not is the answer in those 2 traces; when 2 fits, the step
    # is interpolated from 2 and 3; the answer is the one the default search confirms.
    # At 512x512 batch 1 needs 63.75 MiB and batch 2 103.75 MiB beyond 528.25 MiB of
    # context and workspace.
    gpu = DeviceProfile.cuda(memory_mib * MIB, (7, 5))
    inputs = (3, 512, 512)
    run = lambda **kw: max_batch_size(cnn, inputs, device=gpu, precision="amp-fp16", **kw)
    if answer == 0:
        with pytest.raises(DoesNotFitError):
            run(fit_batches=(1, 2))
        return
    first_pair, default = run(fit_batches=(1, 2)), run()
    assert first_pair.max_batch_size == default.max_batch_size
    assert first_pair.total_bytes_at_max == default.total_bytes_at_max
    assert [b for b, _ in first_pair.evaluated][:2] == [1, 2]
    if answer is not None:
        assert first_pair.max_batch_size == answer
    if answer == 1:
        assert first_pair.traces == 2
    assert _boundary_holds(cnn, inputs, first_pair.budget_bytes, first_pair.max_batch_size, gpu,
                           precision="amp-fp16")


def test_nothing_fits_a_card_smaller_than_batch_one():
    gpu = DeviceProfile.cuda(540 * MIB, (7, 5))  # batch 1 needs 552 MiB in all
    with pytest.raises(DoesNotFitError) as info:
        max_batch_size(cnn, (3, 256, 256), device=gpu, precision="amp-fp16")
    assert info.value.needed_bytes > info.value.available_bytes


@pytest.mark.parametrize("cuda", [True, False])
def test_one_replay_answers_what_the_least_capacity_search_answers(cuda):
    # fits_within is the solver's yes/no question in one replay; needed_bytes finds the
    # least capacity by bisection over ~10 replays. They must agree on each side of it.
    from batchfit.device.timeline import fits_within, needed_bytes
    from batchfit.engine.spec import make_config
    from batchfit.engine.trace import trace_step

    device = DeviceProfile.cuda(1 << 30, (7, 5)) if cuda else DeviceProfile.cpu()
    events = trace_step(cnn, (3, 64, 64), 24, make_config(None, {}), device).steady_events
    needed = needed_bytes(events, device)
    step = 2 * MIB if cuda else 1
    for limit in (needed - step, needed - 1, needed, needed + 1, needed + step):
        assert fits_within(events, device, limit) is (needed <= limit), limit


def test_the_longest_sequence_on_a_card_without_a_cuda_total_says_so():
    # max --seq-len has no estimate of its own to carry warnings: the result says it
    pytest.importorskip("transformers")
    from batchfit import TensorSpec
    from batchfit.device.catalog import find_gpu
    from batchfit.device.profile import gpu_profile

    spec = {"input_ids": TensorSpec((128,), "int64", high=500),
            "labels": TensorSpec((128,), "int64", high=500)}
    h800 = max_seq_len(tiny_gpt2, spec, 2, device=gpu_profile(find_gpu("H800")), max_len=256,
                       multiple_of=64)
    assert h800.warnings and "marketed 80.00 GiB" in h800.warnings[0]
    assert h800.to_dict()["warnings"] == list(h800.warnings)
    h100 = max_seq_len(tiny_gpt2, spec, 2, device=gpu_profile(find_gpu("H100 SXM")),
                       max_len=256, multiple_of=64)
    assert h100.warnings == ()
