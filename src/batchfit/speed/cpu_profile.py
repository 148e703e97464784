"""The roofline's rates for the CPU you are on, measured kind by kind.

CPU profiles (:func:`measure_cpu_profile`) are measured, kind by kind, with
kernels of that kind at training-step shapes, reading inputs that are not in
cache: ``rate_k`` is a curve of FLOP/s against arithmetic intensity (matmul,
convolutions, attention), ``bandwidth_k`` of bytes/s against bytes moved (the
norms, and a step-like chain of elementwise ops for everything else), both
interpolated in log scale; ``latency_k`` is the kind's time at a tiny shape;
``overhead`` the framework's cost per op in a real training step. One flat
roofline (the peak matmul rate and copy bandwidth) under-predicts a small model's
step, because kernels at a model's shapes run far below the peaks: a matmul of few
rows, a convolution with three input channels or a strided backward reaches a
fraction of the peak rate, and batch norm's training forward a fraction of the copy
bandwidth. The measured errors are in ``benchmarks/results/bench_knee_roofline.md``.

Page faults (CPU). glibc serves every allocation of at least 32 MiB (its largest
dynamic mmap threshold) from a fresh mapping and unmaps it on free, so each step
faults those pages in again: an op whose output is that big pays
``page_fault_s_per_byte`` (measured: a clone of 32 MiB against a copy into an
existing tensor; 0.4-0.7 ns per byte here) on top. A small CNN at batch 256, whose
first activations are exactly 32 MiB, ran at 60% of the samples/s it reached at
192; the fault term predicts it within a few percent.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from batchfit.engine.spec import TrainConfig, parse_enum
from batchfit.errors import InvalidInputError
from batchfit.speed.op_costs import (
    _extra_flop_formulas,
    _tensor_bytes,
    constant_costs,
    step_times,
    trace_op_costs,
)
from batchfit.speed.rates import MEMORY_KINDS, Curve, KindRates, OpKind, RooflineProfile
from batchfit.speed.timing import Clock

#: (rows, width) of the linear layers whose three GEMMs (forward, data gradient, weight
#: gradient) make the matmul curve: ~4, 16, 57 and 171 FLOPs per byte.
CPU_MATMUL_SHAPES = ((8, 1024), (1024, 64), (1024, 256), (1024, 1024))
#: (batch, channels in, channels out, height = width, stride) of the 3x3 convolutions behind
#: the convolution curves: an RGB stem, a narrow and a wide layer, at stride 1 and at 2.
CPU_CONV_SHAPES = ((8, 3, 16, 64, 1), (8, 32, 32, 32, 1), (4, 256, 256, 8, 1),
                   (8, 3, 16, 64, 2), (4, 64, 128, 32, 2), (2, 256, 512, 16, 2))
#: (batch, heads, tokens, head size) of the attention points.
CPU_ATTENTION_SHAPES = ((8, 4, 32, 32), (2, 8, 256, 64))
#: Input shapes of the batch-norm (N, C, H, W) and layer-norm (rows, width) points.
CPU_BATCH_NORM_SHAPES = ((8, 128, 8, 8), (16, 64, 32, 32))
CPU_LAYER_NORM_SHAPES = ((256, 256), (4096, 256))
#: glibc's largest dynamic mmap threshold (DEFAULT_MMAP_THRESHOLD_MAX on 64-bit): blocks this
#: big are always mapped afresh and unmapped on free (malloc/malloc.c).
GLIBC_MMAP_THRESHOLD_MAX = 32 << 20
#: Bytes cycled through by the bandwidth curve: well above a CPU's last-level cache.
_COLD_WORKING_SET = 128 << 20


def measure_cpu_profile(*, clock: Clock | str = Clock.WALL,
                        stream_bytes: Sequence[int] = (1 << 16, 1 << 19, 1 << 22, 1 << 24),
                        min_run_s: float = 0.05) -> RooflineProfile:
    """Measure this CPU's roofline, kind by kind, with kernels like a training step's.

    Each kernel is timed by ``torch.utils.benchmark`` (median of 5 blocks, ``min_run_s``
    in all) on copies of its inputs that add up to 64 MiB, so that it reads them from
    memory as an op in a step reads what earlier ops wrote; its work is counted as the
    trace counts an op's (FLOPs by ``FlopCounterMode``, bytes as inputs plus outputs),
    so a rate here is what the prediction divides by. About 60 kernels, timed in
    seconds.

    * matmul: the three GEMMs of a linear layer (forward ``x W^T``, ``g W``, ``g^T x``)
      at :data:`CPU_MATMUL_SHAPES`: FLOP/s against FLOPs per byte (20 GFLOP/s for 8
      rows, 80-120 for 1024);
    * convolutions: forward and backward of the 3x3 layers of :data:`CPU_CONV_SHAPES`,
      at stride 1 and strided as separate kinds, same axes (an RGB stem at 20-40
      GFLOP/s, a wide layer at 60-100; strided backward at 15-25 to 45-75);
    * attention (CPU flash) forward and backward at :data:`CPU_ATTENTION_SHAPES`, same
      axes; batch norm and layer norm, training forward and backward, bytes/s against
      bytes moved (batch norm's forward, which computes the batch statistics, 2 GB/s;
      its backward 6-9);
    * every other op: a step-like chain of elementwise ops (pointwise, broadcast add,
      transposing copy, activation backward, reduction; :func:`_elementwise_chain`) on
      tensors of each of ``stream_bytes``, bytes/s against bytes moved per op: 7-14
      GB/s, where a lone ``torch.add`` on memory it just used streams 14-18;
    * latency per kind: the same kernels at tiny shapes (a convolution 30-45 us, an add
      2-4 us); the curves above are of the work beyond it;
    * page faults: a clone of :data:`GLIBC_MMAP_THRESHOLD_MAX` bytes (a fresh mapping)
      against a copy into an existing tensor, per byte (0.4-0.7 ns); outputs that
      large pay it;
    * per-op overhead: a training step (AdamW, batch 1) of a tiny network of the common
      layer types (:func:`_calibration_model`: convolution, batch norm, pooling, linear,
      a transformer encoder layer, layer norm), minus what the rates above predict for
      its ops, per op: the framework's cost (module code, autograd, the optimizer's
      loop), 12-20 us (a bare stack of linear layers shows ~6 us: its modules run
      less Python per op).

    ``clock`` as in :class:`batchfit.speed.bench.TimingConfig` (``cpu``: one thread,
    thread CPU time).

    Example:
        >>> p = measure_cpu_profile(stream_bytes=(1 << 16, 1 << 20), min_run_s=0.005)
        >>> p.matmul_flops_per_s > 1e8 and p.kinds["conv"].latency_s > 0
        True
    """
    import torch

    clock = parse_enum(Clock, clock, "clock")
    threads = 1 if clock is Clock.CPU else torch.get_num_threads()
    timer = _KernelTimer(threads, time.thread_time if clock is Clock.CPU else None, min_run_s)
    generator = torch.Generator().manual_seed(0)
    kinds = _measure_kinds(timer, generator, stream_bytes)
    fault_s, threshold = _measure_page_faults(timer)
    src = torch.ones((max(stream_bytes) // 4,))
    dst = torch.empty_like(src)
    bandwidth = 2 * src.nbytes / timer.seconds(lambda: dst.copy_(src))
    draft = RooflineProfile(
        name="cpu (measured)", precision="fp32",
        matmul_flops_per_s=max(r for _, r in kinds[OpKind.MATMUL].flops_per_s),
        conv_flops_per_s=max(r for _, r in kinds[OpKind.CONV].flops_per_s),
        vector_flops_per_s=max(r for _, r in kinds[OpKind.MATMUL].flops_per_s),
        memory_bandwidth_bytes_per_s=bandwidth, launch_overhead_s=0.0, async_launch=False,
        kinds=kinds, page_fault_s_per_byte=fault_s, mmap_threshold_bytes=threshold,
        source=(f"measured on this host: matmul, convolution, attention and norm kernels of "
                f"training-step shapes, an elementwise chain, page faults, a tiny network's step; "
                f"{threads} thread(s), {clock.value} clock"))
    return replace(draft, launch_overhead_s=_per_op_overhead_s(timer, draft))


#: Timed blocks per kernel (their median is the kernel's time).
_BLOCKS = 5
#: Latencies and the calibration step are short calls, cheap to time for longer: they set
#: the per-op costs that dominate small batches.
_SHORT_RUNS = 2.0


class _KernelTimer:
    """Median seconds of a call, by torch.utils.benchmark, on the profile's threads and clock."""

    def __init__(self, threads: int, clock: Any, min_run_s: float) -> None:
        import torch

        self.threads, self.clock, self.min_run_s = threads, clock, min_run_s
        #: Memory that cold copies of kernel inputs are placed in (faulted in once, here).
        self.pool = torch.ones(_COLD_WORKING_SET // 2 // 4)

    def seconds(self, fn: Any, scale: float = 1.0) -> float:
        """Median over ``_BLOCKS`` blocks of calls (``scale * min_run_s`` in all), after two
        warm-up calls."""
        import statistics

        from batchfit._logs import without_cuda_home_notice

        with without_cuda_home_notice():
            from torch.utils.benchmark import Timer

        extra = {"timer": self.clock} if self.clock is not None else {}
        timer = Timer(stmt="fn()", globals={"fn": fn}, num_threads=self.threads, **extra)
        once = timer.timeit(1).median  # after two warm-up calls
        number = max(1, round(scale * self.min_run_s / _BLOCKS / max(once, 1e-7)))
        return float(statistics.median(timer.timeit(number).median for _ in range(_BLOCKS)))

    def work(self, call: Any, inputs: tuple) -> tuple[int, int, float]:
        """``(flops, bytes moved, seconds)`` of ``call(*inputs)``, counted as the trace counts
        an op and timed on cold copies of the inputs (see :func:`_cold_calls`)."""
        from torch.utils.flop_counter import FlopCounterMode

        from batchfit.engine import _torch_internals as ti

        with FlopCounterMode(display=False, custom_mapping=_extra_flop_formulas()) as counter:
            out = call(*inputs)
        moved = sum(_tensor_bytes(t) for t in inputs)
        moved += sum(_tensor_bytes(t) for t in ti.iter_tensors(out))
        return (int(counter.get_total_flops()), int(moved),
                self.seconds(_cold_calls(call, inputs, self.pool)))

    def latency(self, kernels: Sequence[tuple[Any, tuple]]) -> float:
        """Mean seconds of tiny kernels (their inputs stay in cache: this is fixed cost)."""
        return sum(self.seconds(lambda call=call, inputs=inputs: call(*inputs), _SHORT_RUNS)
                   for call, inputs in kernels) / len(kernels)


def _cold_calls(call: Any, inputs: tuple, pool: Any) -> Any:
    """``call`` cycling through copies of ``inputs`` laid out in ``pool`` (float32, as big as
    it holds, up to 32 sets), so that each call reads them from memory, as an op in a step
    reads what earlier ops wrote."""
    sizes = [t.numel() for t in inputs]
    copies = max(1, min(32, pool.numel() // max(sum(sizes), 1)))
    sets, offset = [inputs], 0
    for _ in range(copies - 1):
        placed = []
        for tensor, size in zip(inputs, sizes):
            placed.append(pool[offset:offset + size].view(tensor.shape).copy_(tensor))
            offset += size
        sets.append(tuple(placed))
    position = [0]

    def run() -> Any:
        position[0] = (position[0] + 1) % copies
        return call(*sets[position[0]])

    return run


def _rate_point(points: Sequence[tuple[int, int, float]], latency_s: float,
                per_byte: bool = False) -> tuple[float, float]:
    """One curve point from kernels measured together: ``(FLOPs per byte, FLOP/s)`` of the
    work beyond each call's latency, or ``(bytes per call, bytes/s)`` with ``per_byte``."""
    flops = sum(f for f, _, _ in points)
    moved = sum(b for _, b, _ in points)
    seconds = sum(max(t - latency_s, t / 2) for _, _, t in points)
    if per_byte:
        return moved / len(points), moved / seconds
    return flops / moved, flops / seconds


def _measure_kinds(timer: _KernelTimer, generator: Any,
                   stream_bytes: Sequence[int]) -> dict[OpKind, KindRates]:
    kernels = {
        OpKind.MATMUL: _matmul_kernels(generator),
        **_conv_kernels(generator),
        **_attention_kernels(generator),
        **_norm_kernels(generator),
    }
    found = {}
    for kind, (tiny, *groups) in kernels.items():
        latency = timer.latency(tiny)
        per_byte = kind in MEMORY_KINDS
        curve = _curve([_rate_point([timer.work(call, inputs) for call, inputs in group], latency,
                                    per_byte) for group in groups])
        found[kind] = (KindRates(bytes_per_s=curve, latency_s=latency) if per_byte
                       else KindRates(flops_per_s=curve, latency_s=latency))
    found[OpKind.OTHER] = _measure_elementwise(timer, generator, stream_bytes)
    return found


def _curve(points: Sequence[tuple[float, float]]) -> Curve:
    return tuple(sorted(points))


# The kernels of each kind: [tiny group, group, group, ...]: the tiny group gives the
# kind's latency, each other group one curve point; a group is a list of
# (call, input tensors), timed as call(*inputs).
Kernels = list[list[tuple[Any, tuple]]]


def _matmul_kernels(generator: Any) -> Kernels:
    import torch

    def linear(rows: int, width: int) -> list[tuple[Any, tuple]]:
        x, g = (torch.randn(rows, width, generator=generator) for _ in range(2))
        w, b = torch.randn(width, width, generator=generator), torch.randn(width, generator=generator)
        return [(lambda b, x, w: torch.addmm(b, x, w.t()), (b, x, w)), (torch.mm, (g, w)),
                (lambda g, x: torch.mm(g.t(), x), (g, x))]

    return [linear(8, 8)] + [linear(rows, width) for rows, width in CPU_MATMUL_SHAPES]


def _conv_kernels(generator: Any) -> dict[OpKind, Kernels]:
    """Forward and backward of the 3x3 convolutions of :data:`CPU_CONV_SHAPES`, by stride."""
    import torch

    aten = torch.ops.aten

    def layer(batch: int, c_in: int, c_out: int, size: int, stride: int) -> tuple[Any, Any]:
        x = torch.randn(batch, c_in, size, size, generator=generator)
        w = torch.randn(c_out, c_in, 3, 3, generator=generator)
        out_size = (size - 1) // stride + 1
        grad = torch.randn(batch, c_out, out_size, out_size, generator=generator)
        strides = [stride, stride]
        mask = [c_in > 3, True, False]  # a stem's input needs no gradient

        def forward(x: Any, w: Any) -> Any:
            return aten.convolution(x, w, None, strides, [1, 1], [1, 1], False, [0, 0], 1)

        def backward(grad: Any, x: Any, w: Any) -> Any:
            return aten.convolution_backward(grad, x, w, None, strides, [1, 1], [1, 1], False,
                                             [0, 0], 1, mask)

        return [(forward, (x, w))], [(backward, (grad, x, w))]

    found: dict[OpKind, Kernels] = {}
    for stride, (forward_kind, backward_kind) in ((1, (OpKind.CONV, OpKind.CONV_BACKWARD)),
                                                  (2, (OpKind.CONV_STRIDED,
                                                       OpKind.CONV_BACKWARD_STRIDED))):
        layers = [layer(1, 4, 4, 8, stride)] + [layer(*shape) for shape in CPU_CONV_SHAPES
                                                if shape[-1] == stride]
        found[forward_kind] = [forward for forward, _ in layers]
        found[backward_kind] = [backward for _, backward in layers]
    return found


def _attention_kernels(generator: Any) -> dict[OpKind, Kernels]:
    import torch

    aten = torch.ops.aten

    def attention(*shape: int) -> tuple[Any, Any]:
        q, k, v = (torch.randn(*shape, generator=generator) for _ in range(3))
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v)
        grad = torch.randn(out.shape, generator=generator)

        def backward(*args: Any) -> Any:
            return aten._scaled_dot_product_flash_attention_for_cpu_backward(*args, 0.0, False)

        return ([(aten._scaled_dot_product_flash_attention_for_cpu, (q, k, v))],
                [(backward, (grad, q, k, v, out, lse))])

    pairs = [attention(1, 1, 8, 16)] + [attention(*shape) for shape in CPU_ATTENTION_SHAPES]
    return {OpKind.ATTENTION: [f for f, _ in pairs], OpKind.ATTENTION_BACKWARD: [b for _, b in pairs]}


def _norm_kernels(generator: Any) -> dict[OpKind, Kernels]:
    """Training forward and backward of batch norm and layer norm."""
    import torch

    aten = torch.ops.aten

    def batch_norm(*shape: int) -> tuple[Any, Any]:
        x, grad = (torch.randn(*shape, generator=generator) for _ in range(2))
        c = shape[1]
        weight, bias, mean, var = torch.ones(c), torch.zeros(c), torch.zeros(c), torch.ones(c)
        _, saved_mean, saved_invstd = aten.native_batch_norm(x, weight, bias, mean, var, True,
                                                             0.1, 1e-5)

        def forward(x: Any, weight: Any, bias: Any, mean: Any, var: Any) -> Any:
            return aten.native_batch_norm(x, weight, bias, mean, var, True, 0.1, 1e-5)

        def backward(*args: Any) -> Any:
            return aten.native_batch_norm_backward(*args, True, 1e-5, [True, True, True])

        return ([(forward, (x, weight, bias, mean, var))],
                [(backward, (grad, x, weight, mean, var, saved_mean, saved_invstd))])

    def layer_norm(rows: int, width: int) -> tuple[Any, Any]:
        x, grad = (torch.randn(rows, width, generator=generator) for _ in range(2))
        weight, bias = torch.ones(width), torch.zeros(width)
        _, mean, rstd = aten.native_layer_norm(x, [width], weight, bias, 1e-5)

        def backward(grad: Any, x: Any, mean: Any, rstd: Any, weight: Any, bias: Any) -> Any:
            return aten.native_layer_norm_backward(grad, x, [width], mean, rstd, weight, bias,
                                                   [True, True, True])

        return ([(lambda x, w, b: aten.native_layer_norm(x, [width], w, b, 1e-5), (x, weight, bias))],
                [(backward, (grad, x, mean, rstd, weight, bias))])

    batch = [batch_norm(1, 4, 4, 4)] + [batch_norm(*shape) for shape in CPU_BATCH_NORM_SHAPES]
    layer = [layer_norm(4, 16)] + [layer_norm(*shape) for shape in CPU_LAYER_NORM_SHAPES]
    return {OpKind.BATCH_NORM: [f for f, _ in batch], OpKind.BATCH_NORM_BACKWARD: [b for _, b in batch],
            OpKind.LAYER_NORM: [f for f, _ in layer], OpKind.LAYER_NORM_BACKWARD: [b for _, b in layer]}


#: Width of the tensors in the elementwise chain (a layer's feature size).
_CHAIN_WIDTH = 256


def _elementwise_chain(nbytes: int, generator: Any, pool: Any) -> tuple[Any, int, int]:
    """A step-like chain of elementwise ops on tensors of ``nbytes``: ``(run, ops, bytes moved)``.

    Each op reads the previous op's output and writes a buffer of its own, cycling
    through the buffers in ``pool`` (written long ago, so not in cache): a pointwise
    op, a broadcast add (a bias), a transposing copy (heads split or merged), an
    activation's backward (two inputs) and a reduction over the batch (a bias gradient),
    none of which drifts the values into denormals over many runs. Outputs are
    preallocated, so no allocator work or page faults are timed.
    """
    import torch

    rows = max(8, nbytes // 4 // _CHAIN_WIDTH // 8 * 8)
    count = max(10, min(64, pool.numel() // (rows * _CHAIN_WIDTH)))
    if count * rows * _CHAIN_WIDTH > pool.numel():
        pool = torch.empty(count * rows * _CHAIN_WIDTH)
    buffers = list(pool[:count * rows * _CHAIN_WIDTH].view(count, rows, _CHAIN_WIDTH))
    buffers[0].copy_(torch.randn(rows, _CHAIN_WIDTH, generator=generator))
    for buffer in buffers[1:]:
        buffer.copy_(buffers[0])
    bias, reduced = torch.randn(_CHAIN_WIDTH, generator=generator), torch.empty(_CHAIN_WIDTH)
    groups = _CHAIN_WIDTH // 32

    def run() -> None:
        for i in range(count):
            x, out = buffers[i - 1], buffers[i]
            step = i % 5
            if step == 0:
                torch.clamp_min(x, 0.0, out=out)
            elif step == 1:
                torch.add(x, bias, out=out)
            elif step == 2:
                out.view(groups, rows, 32).copy_(x.view(rows, groups, 32).transpose(0, 1))
            elif step == 3:
                torch.ops.aten.threshold_backward.grad_input(x, buffers[i - 2], 0.0, grad_input=out)
            else:
                torch.sum(x, 0, out=reduced)

    tensors_moved = {0: 2, 1: 2, 2: 2, 3: 3, 4: 1}  # inputs + outputs, as the trace counts
    moved = sum(tensors_moved[i % 5] for i in range(count)) * rows * _CHAIN_WIDTH * 4
    return run, count, moved


def _measure_elementwise(timer: _KernelTimer, generator: Any,
                         stream_bytes: Sequence[int]) -> KindRates:
    """Bytes/s of :func:`_elementwise_chain` by bytes moved per op, and an add's latency."""
    import torch

    tiny = torch.ones(16)
    latency = timer.seconds(lambda: torch.add(tiny, tiny), _SHORT_RUNS)
    curve = []
    for nbytes in sorted(stream_bytes):
        run, ops, moved = _elementwise_chain(nbytes, generator, timer.pool)
        seconds = timer.seconds(run)
        curve.append((moved / ops, moved / max(seconds - ops * latency, seconds / 2)))
    return KindRates(bytes_per_s=tuple(curve), latency_s=latency)


def _mmap_threshold() -> int | None:
    """Bytes from which glibc maps every allocation afresh; None off glibc."""
    import os
    import platform

    if platform.libc_ver()[0] != "glibc":
        return None
    pinned = os.environ.get("MALLOC_MMAP_THRESHOLD_", "")
    return int(pinned) if pinned.isdigit() else GLIBC_MMAP_THRESHOLD_MAX


def _measure_page_faults(timer: _KernelTimer) -> tuple[float, int | None]:
    """Seconds per byte of first touching a fresh mapping, and the size that gets one."""
    import torch

    threshold = _mmap_threshold()
    if threshold is None:
        return 0.0, None
    src = torch.ones(max(threshold, GLIBC_MMAP_THRESHOLD_MAX) // 4)
    dst = torch.empty_like(src)
    fresh = timer.seconds(lambda: src.clone())
    reused = timer.seconds(lambda: dst.copy_(src))
    return max(0.0, fresh - reused) / src.nbytes, threshold


#: The calibration network's per-sample input.
_CALIBRATION_INPUT = (3, 8, 8)


def _calibration_model() -> Any:
    """A tiny network of the common layer types, for the framework's cost per op: a
    convolution, batch norm, pooling, linear layers, a transformer encoder layer and
    layer norm; at batch 1 its step is nearly all overhead."""
    from torch import nn

    class Calibration(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                      nn.MaxPool2d(2))
            self.proj = nn.Linear(8, 32)
            self.block = nn.TransformerEncoderLayer(32, 2, 64, dropout=0.0, batch_first=True)
            self.norm = nn.LayerNorm(32)
            self.head = nn.Linear(32, 10)

        def forward(self, x: Any) -> Any:
            tokens = self.stem(x).flatten(2).transpose(1, 2)  # (batch, 16 pixels, 8 channels)
            return self.head(self.norm(self.block(self.proj(tokens))).mean(1))

    return Calibration()


def _per_op_overhead_s(timer: _KernelTimer, profile: RooflineProfile) -> float:
    """Framework seconds per op of an overhead-bound training step (see measure_cpu_profile):
    its time minus what ``profile`` (without overhead) predicts for its ops."""
    import torch

    from batchfit.engine.step import StepRunner, make_batch, normalize_input_spec
    from batchfit.speed.timing import _freeze_learning_rate

    config = TrainConfig(optimizer="adamw")
    rng = torch.get_rng_state()
    try:
        torch.manual_seed(0)
        batch = make_batch(normalize_input_spec(_CALIBRATION_INPUT), 1, None,
                           torch.Generator().manual_seed(0))
        runner = StepRunner(_calibration_model(), config, batch, foreach=False,
                            generator=torch.Generator().manual_seed(0))
        _freeze_learning_rate(runner.optimizer)
        for _ in range(3):
            runner.train_step()
        seconds = timer.seconds(runner.train_step, _SHORT_RUNS)
    finally:
        torch.set_rng_state(rng)
    ops = trace_op_costs(_calibration_model, _CALIBRATION_INPUT, 1, config)
    (predicted,) = step_times(constant_costs(ops, 1), profile, [1])
    return max(0.0, seconds - predicted.step_s) / len(ops)


def fastest_profile(profiles: Sequence[RooflineProfile]) -> RooflineProfile:
    """Profiles measured alike (e.g. in rounds between the steps they are compared with),
    combined kernel by kernel into the fastest: the highest rate and bandwidth of every
    curve point, the lowest latency, overhead and page-fault cost. Load from other
    processes only ever slows a kernel down, so this is the least disturbed profile, as
    :func:`batchfit.speed.bench.bench` keeps a batch's fastest round.

    Example:
        >>> from batchfit.speed.rates import gpu_roofline_profile
        >>> a = gpu_roofline_profile("A100")
        >>> fastest_profile([a, replace(a, launch_overhead_s=7e-6)]).launch_overhead_s
        5e-06
    """
    if not profiles:
        raise InvalidInputError("fastest_profile needs at least one profile")
    first = profiles[0]

    def curve(curves: Sequence[Curve]) -> Curve:
        return tuple((x, max(c[i][1] for c in curves)) for i, (x, _) in enumerate(curves[0]))

    def pick(name: str, best: Any) -> Any:
        return best(getattr(p, name) for p in profiles)

    numbers = {**{name: pick(name, max) for name in (
        "matmul_flops_per_s", "conv_flops_per_s", "vector_flops_per_s",
        "memory_bandwidth_bytes_per_s")},
        **{name: pick(name, min) for name in ("launch_overhead_s", "page_fault_s_per_byte")}}
    kinds = {kind: KindRates(curve([p.kinds[kind].flops_per_s for p in profiles]),
                             curve([p.kinds[kind].bytes_per_s for p in profiles]),
                             min(p.kinds[kind].latency_s for p in profiles))
             for kind in first.kinds}
    return replace(first, **numbers, kinds=kinds,
                   bandwidth_curve=curve([p.bandwidth_curve for p in profiles]),
                   source=f"fastest of {len(profiles)}: {first.source}")




