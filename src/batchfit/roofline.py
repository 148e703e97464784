"""Predict step time against batch size without the device: a roofline over the traced ops.

The step (the one :mod:`batchfit.step` defines) runs once on fake tensors, as
:func:`batchfit.trace.trace_step` runs it, under ``torch.utils.flop_counter.
FlopCounterMode``. Every aten op that launches work becomes an :class:`OpCost`:
its FLOPs (the counter's formulas: matmuls, convolutions, attention), the bytes
it moves (its tensor inputs plus its outputs) and, for matmuls and dense
convolutions, the GEMM shapes it runs (convolutions as implicit GEMMs). Views
and bare allocations move nothing and launch nothing; they are skipped.

Time of one op on a :class:`RooflineProfile`::

    compute = flops / rate * quantization      (rate: matmul, conv or vector FLOP/s)
    memory  = bytes / bandwidth
    op      = max(compute, memory) + overhead   (CPU: ops run one after another)
    op      = max(compute, memory, overhead)    (GPU: launches are asynchronous, so the
                                                 host cost hides behind longer kernels)

and the step is the sum over ops. ``overhead`` is a per-op constant: on a GPU
**5 us** (eager PyTorch dispatches a kernel every 5-10 us at best, so short
kernels cannot run faster than that); on the CPU it is measured, with the other
rates, by :func:`measure_cpu_profile` (framework cost per op of a real training
step, a matmul, a convolution, and bandwidth by tensor size).

Tile and wave quantization (GPU). A GEMM of M x N x K (``count`` of them for a
batched GEMM) is cut into output tiles of ``tile = (TM, TN)``; the tiles run in
waves of one tile per SM::

    tiles = count * ceil(M / TM) * ceil(N / TN)
    waves = ceil(tiles / sm_count)
    quantization = waves * sm_count * TM * TN * pad(K) / (count * M * N * K)   (>= 1)

so a GEMM whose last wave is nearly empty costs almost a whole wave more.
Tiles, after NVIDIA's "Matrix Multiplication Background" guide: **256 x 128**
for tensor-core fp16/bf16/fp8 and **128 x 128** for tf32 and fp32; a dimension
smaller than its tile gets the smallest power-of-two tile >= 16 covering it
(:func:`tile_extent`: cuBLAS has skinny kernels, and M = 8 does not fill a
256-row tile). Tensor cores want dimensions that are multiples of 16 bytes: K is
padded to 8 elements for fp16/bf16, 4 for tf32, 16 for fp8 (M and N are
already tile multiples). Rates:
the catalog's peak for the precision in use, times ``DEFAULT_FLOPS_EFFICIENCY``
(0.75: large cuBLAS GEMMs reach 70-90% of the datasheet peak); memory:
datasheet bandwidth times ``DEFAULT_BANDWIDTH_EFFICIENCY`` (0.8). In fp32,
matmuls use the fp32 rate (torch's ``allow_tf32`` is off for matmul) and
convolutions the tf32 rate (cuDNN's is on), where the card has one.

Batch sizes. The per-op costs are affine in the batch size for most models
(M = B x H x W, bytes = a + b x B), so the step is traced at three batch sizes
(4, 5, 8), fitted exactly on the first two and checked on the third; any batch
then costs no trace, which is what lets :func:`predict_throughput` scan every
batch size near the knee for wave boundaries. A model whose costs are not
affine (a B x B similarity matrix) is traced at each requested batch instead.

Known limitations:
    * cuBLAS picks among many tile shapes and split-K for small GEMMs; one tile
      per precision over-predicts small GEMMs. Grouped and depthwise
      convolutions, transposed convolutions and fused attention are not
      quantized.
    * Fused attention (flash, memory-efficient) is traced through its math
      path: FLOPs are right, bytes include the s x s matrix that a fused kernel
      keeps on chip.
    * Bytes count every input and output once; caches (CPU L2/L3, GPU L2) make
      small tensors faster than the bandwidth says.
    * No overlap between ops, no CUDA graphs, no torch.compile fusion.
    * On this CPU the roofline under-predicts step time by a fairly uniform
      factor (kernels at a model's small shapes run well below the
      microbenchmarks: in-step oneDNN convolutions at ~20 GFLOP/s against 55,
      batch norm at ~1 GB/s, hidden copies and fills inside kernels); the
      predicted knee is what to trust (see benchmarks/bench_knee.py).
    * CPU flash attention, which torch has no FLOP formula for, is counted
      with the CUDA kernels' formula.

Example:
    >>> from batchfit.roofline import gemm_waves
    >>> gemm_waves(4096, 4096, sm_count=108, tile=(256, 128))  # 16 x 32 = 512 tiles on 108 SMs
    5
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from batchfit.errors import InvalidInputError
from batchfit.spec import Precision, TrainConfig, make_config, parse_enum
from batchfit.throughput import (
    DEFAULT_MAX_BATCH_LIMIT,
    DEFAULT_TOLERANCE,
    Clock,
    _check_dataset_size,
    _parse_batches,
    batch_grid,
    epoch_seconds,
    find_knee,
)

#: Output tile (M x N) per precision key (see the module docstring).
TILE_BY_PRECISION = {"fp32": (128, 128), "tf32": (128, 128), "fp16": (256, 128),
                     "bf16": (256, 128), "fp8": (256, 128)}
#: Tensor cores want multiples of 16 bytes: elements per precision key.
ALIGNMENT_BY_PRECISION = {"fp32": 1, "tf32": 4, "fp16": 8, "bf16": 8, "fp8": 16}
DEFAULT_FLOPS_EFFICIENCY = 0.75
DEFAULT_BANDWIDTH_EFFICIENCY = 0.8
#: Per-op floor on a GPU: eager PyTorch launches at most one kernel every ~5 us.
DEFAULT_GPU_LAUNCH_S = 5e-6
#: The step is traced at these batch sizes to fit costs affine in the batch (see docstring).
FIT_BATCHES = (4, 5, 8)
#: A batch "falls off a wave boundary" when its samples/s is this much below batch - 1's.
WAVE_DROP = 0.01
#: Batch sizes scanned for wave boundaries around the predicted knee, at most.
MAX_SCAN = 4096


# -- arithmetic (pure; works on ints and on numpy integer arrays) ---------------------------


def ceil_div(a: Any, b: Any) -> Any:
    """``ceil(a / b)`` for positive integers (or integer arrays)."""
    return -(-a // b)


def pad_to(value: Any, multiple: int) -> Any:
    """``value`` rounded up to a multiple of ``multiple``.

    Example:
        >>> pad_to(100, 8), pad_to(96, 8)
        (104, 96)
    """
    return ceil_div(value, multiple) * multiple


def tile_extent(dim: Any, tile_dim: int) -> Any:
    """The tile along one GEMM dimension: ``tile_dim``, or for a smaller dimension the
    smallest power of two >= 16 that covers it (cuBLAS has skinny kernels).

    Example:
        >>> tile_extent(4096, 256), tile_extent(200, 256), tile_extent(8, 256), tile_extent(100, 128)
        (256, 256, 16, 128)
    """
    import numpy as np

    d = np.asarray(dim, dtype=np.int64)
    covering = np.left_shift(1, np.ceil(np.log2(np.maximum(d, 1))).astype(np.int64))
    extent = np.where(d >= tile_dim, tile_dim, np.minimum(np.maximum(covering, 16), tile_dim))
    return int(extent) if extent.ndim == 0 else extent


def gemm_tiles(m: Any, n: Any, tile: tuple[int, int] = (128, 128), count: Any = 1) -> Any:
    """Output tiles of ``count`` GEMMs of M x N (tiles as :func:`tile_extent`).

    Example:
        >>> gemm_tiles(4096, 4096, (256, 128)), gemm_tiles(8, 4096, (256, 128))
        (512, 32)
    """
    return count * ceil_div(m, tile_extent(m, tile[0])) * ceil_div(n, tile_extent(n, tile[1]))


def gemm_waves(m: Any, n: Any, sm_count: int, tile: tuple[int, int] = (128, 128),
               count: Any = 1) -> Any:
    """Waves of one tile per SM: ``ceil(tiles / sm_count)``.

    Example:
        >>> gemm_waves(8192, 8192, 108, (128, 128))  # 64 x 64 = 4096 tiles: 37.9 -> 38 waves
        38
    """
    return ceil_div(gemm_tiles(m, n, tile, count), sm_count)


def gemm_quantization(m: Any, n: Any, k: Any, sm_count: int, tile: tuple[int, int],
                      alignment: int = 1, count: Any = 1) -> Any:
    """Scheduled work over useful work (>= 1): the tile, wave and K-padding waste.

    Example:
        >>> round(gemm_quantization(4096, 4096, 4096, 108, (256, 128), alignment=8), 4)  # 540/512
        1.0547
    """
    tile_area = tile_extent(m, tile[0]) * tile_extent(n, tile[1])
    scheduled = gemm_waves(m, n, sm_count, tile, count) * sm_count * tile_area * pad_to(k, alignment)
    return scheduled / (count * m * n * k)


# -- profiles ------------------------------------------------------------------------------


@dataclass(frozen=True)
class RooflineProfile:
    """The rates a step's time is predicted from.

    Attributes:
        name: display name.
        precision: the catalog precision key of the matmul rate ("fp32", "bf16"...).
        matmul_flops_per_s, conv_flops_per_s, vector_flops_per_s: effective rates for
            matmuls, convolutions and every other op with FLOPs.
        memory_bandwidth_bytes_per_s: effective memory bandwidth.
        launch_overhead_s: per-op overhead (see ``async_launch``).
        async_launch: True (GPU): an op takes at least the overhead; False (CPU): the
            overhead adds to every op.
        sm_count: SMs for wave quantization; None (CPU) for none.
        tile: the GEMM output tile; alignment: K padding in elements.
        bandwidth_curve: ``(bytes moved by one op, bytes/s)`` pairs, ascending; when
            given, an op's bandwidth is interpolated on it (log scale) instead of the
            flat ``memory_bandwidth_bytes_per_s``: on a CPU small tensors stream from
            cache and big fresh outputs pay page faults.
        source: where the numbers come from.
    """

    name: str
    precision: str
    matmul_flops_per_s: float
    conv_flops_per_s: float
    vector_flops_per_s: float
    memory_bandwidth_bytes_per_s: float
    launch_overhead_s: float
    async_launch: bool
    sm_count: int | None = None
    tile: tuple[int, int] | None = None
    alignment: int = 1
    bandwidth_curve: tuple[tuple[int, float], ...] = ()
    source: str = ""

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["tile"] = list(self.tile) if self.tile else None
        data["bandwidth_curve"] = [list(pair) for pair in self.bandwidth_curve]
        return data

    def bandwidth_for(self, bytes_moved: Any) -> Any:
        """Bytes/s for an op moving ``bytes_moved``: the curve, log-interpolated, else flat."""
        import numpy as np

        if not self.bandwidth_curve:
            return self.memory_bandwidth_bytes_per_s
        sizes = np.log2([size for size, _ in self.bandwidth_curve])
        rates = [rate for _, rate in self.bandwidth_curve]
        return np.interp(np.log2(np.maximum(bytes_moved, 1)), sizes, rates)


def _rate_keys(precision: Precision) -> tuple[str, str]:
    """(matmul, convolution) catalog keys for a precision (see the module docstring)."""
    return {
        Precision.FP32: ("fp32", "tf32"),
        Precision.TF32: ("tf32", "tf32"),
        Precision.AMP_FP16: ("fp16", "fp16"),
        Precision.FP16: ("fp16", "fp16"),
        Precision.AMP_BF16: ("bf16", "bf16"),
        Precision.BF16: ("bf16", "bf16"),
    }[precision]


def gpu_roofline_profile(gpu: Any, precision: Precision | str = Precision.FP32, *,
                         flops_efficiency: float = DEFAULT_FLOPS_EFFICIENCY,
                         bandwidth_efficiency: float = DEFAULT_BANDWIDTH_EFFICIENCY,
                         launch_overhead_s: float = DEFAULT_GPU_LAUNCH_S) -> RooflineProfile:
    """The roofline of a catalog GPU for a precision.

    A rate the card lacks (bf16 on a V100) falls back to its fp32 rate.

    Example:
        >>> p = gpu_roofline_profile("A100", "amp-bf16")
        >>> p.sm_count, p.tile, p.alignment, round(p.matmul_flops_per_s / 1e12)
        (108, (256, 128), 8, 234)
    """
    from batchfit.catalog import GPU, find_gpu

    card = gpu if isinstance(gpu, GPU) else find_gpu(str(gpu))
    precision = parse_enum(Precision, precision, "precision")
    for name, value in (("flops_efficiency", flops_efficiency),
                        ("bandwidth_efficiency", bandwidth_efficiency)):
        if not 0 < value <= 1:
            raise InvalidInputError(f"{name} {value} must be in (0, 1]")
    fp32 = card.peak_flops.get("fp32")
    if fp32 is None:
        raise InvalidInputError(f"{card.name} has no fp32 peak rate in the catalog")
    matmul_key, conv_key = _rate_keys(precision)
    used = matmul_key if matmul_key in card.peak_flops else "fp32"

    def rate(key: str) -> float:
        return card.peak_flops.get(key, fp32) * flops_efficiency

    return RooflineProfile(
        name=card.name, precision=used, matmul_flops_per_s=rate(matmul_key),
        conv_flops_per_s=rate(conv_key), vector_flops_per_s=fp32 * flops_efficiency,
        memory_bandwidth_bytes_per_s=card.memory_bandwidth_bytes_per_s * bandwidth_efficiency,
        launch_overhead_s=launch_overhead_s, async_launch=True, sm_count=card.sm_count,
        tile=TILE_BY_PRECISION[used], alignment=ALIGNMENT_BY_PRECISION[used],
        source=f"catalog {card.key}: peak x {flops_efficiency}, bandwidth x {bandwidth_efficiency}")


def measure_cpu_profile(*, clock: Clock | str = Clock.WALL, matmul_size: int = 1024,
                        stream_bytes: Sequence[int] = (1 << 18, 1 << 21, 1 << 24, 1 << 27),
                        min_run_s: float = 0.3) -> RooflineProfile:
    """Measure this CPU's roofline. Takes 5-10 seconds.

    * matmul FLOP/s: ``2 n**3 / t`` for an n x n fp32 matmul (the peak);
    * convolution FLOP/s: forward and backward of a 3x3, 64-channel convolution on
      16 x 64 x 32 x 32 (oneDNN runs convolutions well below the matmul peak);
    * bandwidth: ``dst.copy_(src)`` of the largest ``stream_bytes`` (the peak), and
      a curve of ``torch.add(x, y)`` into a fresh output at each of ``stream_bytes``
      (3 x that many bytes moved per op), cycling through 256 MiB of tensors so
      the inputs come from memory, not cache, as in a real step (here: 16 GB/s
      at 256 KiB, 10-11 GB/s from 16 MiB);
    * per-op overhead: a training step (AdamW) of a deep, narrow MLP (16 layers of
      16 x 16) at batch 1, divided by the ops its trace counts: the framework's
      cost per op in a real step (module calls, autograd, the optimizer's loop):
      11 us here, where one bare ``x + x`` takes 3 us.

    ``clock`` as in :class:`batchfit.throughput.TimingConfig` (``cpu``: one thread,
    thread CPU time).

    Example:
        >>> p = measure_cpu_profile(matmul_size=256, stream_bytes=(1 << 16, 1 << 20), min_run_s=0.02)
        >>> p.matmul_flops_per_s > 1e8 and p.memory_bandwidth_bytes_per_s > 1e8
        True
    """
    import torch
    from torch.utils.benchmark import Timer

    clock = parse_enum(Clock, clock, "clock")
    threads = 1 if clock is Clock.CPU else torch.get_num_threads()
    extra: dict[str, Any] = {"timer": time.thread_time} if clock is Clock.CPU else {}

    def median_s(stmt: str, **names: Any) -> float:
        timer = Timer(stmt=stmt, globals={"torch": torch, **names}, num_threads=threads, **extra)
        return float(timer.adaptive_autorange(threshold=0.03, min_run_time=min_run_s,
                                              max_run_time=10 * min_run_s).median)

    generator = torch.Generator().manual_seed(0)
    a = torch.randn(matmul_size, matmul_size, generator=generator)
    matmul = 2 * matmul_size**3 / median_s("torch.mm(a, a, out=c)", a=a, c=torch.empty_like(a))
    conv = torch.nn.Conv2d(64, 64, 3, padding=1, bias=False)
    image = torch.randn(16, 64, 32, 32, generator=generator, requires_grad=True)
    conv_flops = 3 * 2 * 16 * 32 * 32 * 64 * 64 * 9  # forward, data and weight gradients
    conv_rate = conv_flops / median_s("conv(image).sum().backward()", conv=conv, image=image)
    curve = [(3 * nbytes, 3 * nbytes / median_s("add()", add=_cold_add(nbytes)))
             for nbytes in sorted(stream_bytes)]
    src = torch.ones(max(stream_bytes) // 4)
    bandwidth = 2 * src.nbytes / median_s("dst.copy_(src)", src=src, dst=torch.empty_like(src))
    overhead = _per_op_overhead_s(median_s)
    return RooflineProfile(
        name="cpu (measured)", precision="fp32", matmul_flops_per_s=matmul,
        conv_flops_per_s=conv_rate, vector_flops_per_s=matmul,
        memory_bandwidth_bytes_per_s=bandwidth, launch_overhead_s=overhead, async_launch=False,
        bandwidth_curve=tuple(curve),
        source=f"measured here: {matmul_size}^3 fp32 matmul, 3x3 conv, copy and add of "
               f"{min(stream_bytes) >> 10} KiB-{max(stream_bytes) >> 20} MiB, tiny op; "
               f"{threads} thread(s), {clock.value} clock")


#: Bytes cycled through by the bandwidth curve: well above any CPU's last-level cache.
_COLD_WORKING_SET = 256 << 20


def _cold_add(nbytes: int) -> Any:
    """``torch.add(x, y)`` into a fresh output, over a ring of tensors too big to stay cached."""
    import torch

    count = max(2, _COLD_WORKING_SET // nbytes)
    ring = [torch.ones(max(1, nbytes // 4)) for _ in range(count)]
    position = [0]

    def add() -> Any:
        i = position[0] = (position[0] + 1) % count
        return torch.add(ring[i], ring[i - 1])

    return add


def _calibration_mlp() -> Any:
    from torch import nn

    layers: list[Any] = []
    for _ in range(16):
        layers += [nn.Linear(16, 16), nn.ReLU()]
    return nn.Sequential(*layers)


def _per_op_overhead_s(median_s: Any) -> float:
    """Seconds per traced op of an overhead-bound training step (see measure_cpu_profile)."""
    import torch

    from batchfit.step import StepRunner, make_batch, normalize_input_spec
    from batchfit.throughput import _freeze_learning_rate

    config = TrainConfig(optimizer="adamw")
    rng = torch.get_rng_state()
    try:
        batch = make_batch(normalize_input_spec((16,)), 1, None, torch.Generator().manual_seed(0))
        runner = StepRunner(_calibration_mlp(), config, batch, foreach=False)
        _freeze_learning_rate(runner.optimizer)
        for _ in range(3):
            runner.train_step()
        seconds = median_s("step()", step=runner.train_step)
    finally:
        torch.set_rng_state(rng)
    return seconds / len(trace_op_costs(_calibration_mlp, (16,), 1, config))


# -- tracing the ops ---------------------------------------------------------------------------


@dataclass(frozen=True)
class GemmShape:
    """``count`` GEMMs of M x N x K (output M x N, reduction K)."""

    m: int
    n: int
    k: int
    count: int = 1


@dataclass(frozen=True)
class OpCost:
    """One op of the step: its FLOPs, the bytes it moves and the GEMMs it runs."""

    op: str
    flops: int
    bytes_moved: int
    gemms: tuple[GemmShape, ...] = ()
    convolution: bool = False


def _op_sets() -> tuple[set, set, set]:
    import torch

    aten = torch.ops.aten
    free = {aten._unsafe_view.default, aten.empty.memory_format, aten.empty_strided.default,
            aten.empty_like.default, aten.new_empty.default, aten.new_empty_strided.default,
            aten.lift_fresh.default, aten.detach.default, aten.alias.default}
    matmuls = {aten.mm, aten.addmm, aten.bmm, aten.baddbmm}
    convs = {aten.convolution, aten.convolution_backward}
    return free, matmuls, convs


def _extra_flop_formulas() -> dict[Any, Any]:
    """FLOP formulas torch lacks: CPU flash attention counts as the CUDA kernels do."""
    import torch
    from torch.utils import flop_counter

    aten = torch.ops.aten
    found = {}
    for op, like in (("_scaled_dot_product_flash_attention_for_cpu",
                      aten._scaled_dot_product_flash_attention),
                     ("_scaled_dot_product_flash_attention_for_cpu_backward",
                      aten._scaled_dot_product_flash_attention_backward)):
        packet = getattr(aten, op, None)
        if packet is not None and packet not in flop_counter.flop_registry:
            found[packet] = _raw_formula(flop_counter.flop_registry[like])
    return found


def _raw_formula(formula: Any) -> Any:
    """A registered (already shape-wrapped) formula, marked so the counter does not wrap it again."""
    def count(*args: Any, out_val: Any = None, **kwargs: Any) -> int:
        return formula(*args, out_val=out_val, **kwargs)

    count._get_raw = True  # type: ignore[attr-defined]
    return count


def _tensor_bytes(tensor: Any) -> int:
    nbytes = tensor.numel() * tensor.element_size()
    try:  # an expanded tensor reads its storage, not numel elements
        return min(nbytes, tensor.untyped_storage().nbytes())
    except (RuntimeError, NotImplementedError):
        return nbytes


def _prod(values: Sequence[int]) -> int:
    return math.prod(int(v) for v in values)


def _gemm_shapes(packet: Any, args: tuple, out: Any) -> tuple[GemmShape, ...]:
    """The GEMMs a matmul or a dense convolution runs (implicit GEMM for convolutions)."""
    import torch

    aten = torch.ops.aten
    if packet in (aten.mm, aten.addmm):
        a, b = (args[0], args[1]) if packet is aten.mm else (args[1], args[2])
        return (GemmShape(int(a.shape[0]), int(b.shape[1]), int(a.shape[1])),)
    if packet in (aten.bmm, aten.baddbmm):
        a, b = (args[0], args[1]) if packet is aten.bmm else (args[1], args[2])
        return (GemmShape(int(a.shape[1]), int(b.shape[2]), int(a.shape[2]), int(a.shape[0])),)
    if packet is aten.convolution:
        weight, transposed, groups = args[1], args[6], args[8]
        if transposed or groups != 1:
            return ()
        return (GemmShape(int(out.shape[0]) * _prod(out.shape[2:]), int(weight.shape[0]),
                          _prod(weight.shape[1:])),)
    if packet is aten.convolution_backward:
        grad_out, inp, weight = args[0], args[1], args[2]
        transposed, groups, mask = args[7], args[9], args[10]
        if transposed or groups != 1:
            return ()
        kernel = _prod(weight.shape[2:])
        shapes = []
        if mask[0]:  # data gradient
            shapes.append(GemmShape(int(inp.shape[0]) * _prod(inp.shape[2:]), int(inp.shape[1]),
                                    int(weight.shape[0]) * kernel))
        if mask[1]:  # weight gradient
            shapes.append(GemmShape(int(weight.shape[0]), int(weight.shape[1]) * kernel,
                                    int(grad_out.shape[0]) * _prod(grad_out.shape[2:])))
        return tuple(shapes)
    return ()


class _CostRecorder:
    """Turns each aten op into an :class:`OpCost`; FLOPs are the counter's delta per op."""

    def __init__(self, counter: Any) -> None:
        from batchfit import _torch_internals as ti

        self.counter = counter
        self.ops: list[OpCost] = []
        self.recording = True
        self._flops_seen = 0
        self._free, matmuls, self._convs = _op_sets()
        self._gemm_ops = matmuls | self._convs
        self.interceptor = ti.OpInterceptor(self._on_output, lambda func, exc: None)

    def _on_output(self, func: Any, args: tuple, out: Any) -> None:
        from batchfit import _torch_internals as ti

        total = self.counter.get_total_flops()
        flops, self._flops_seen = total - self._flops_seen, total
        if not self.recording or getattr(func, "is_view", False) or func in self._free:
            return
        outputs = list(ti.iter_tensors(out))
        if not outputs:
            return
        moved = sum(_tensor_bytes(t) for t in ti.iter_tensors(args))
        moved += sum(_tensor_bytes(t) for t in outputs)
        packet = func.overloadpacket
        gemms = _gemm_shapes(packet, args, out) if packet in self._gemm_ops else ()
        self.ops.append(OpCost(str(func), int(flops), int(moved), gemms, packet in self._convs))


def trace_op_costs(model: Any, inputs: Any, batch_size: int, config: TrainConfig | None = None,
                   *, device: Any = None, **options: Any) -> tuple[OpCost, ...]:
    """The ops of one steady-state step at ``batch_size``, traced on fake tensors.

    Training: forward and backward of a step, then an optimizer step whose state
    already exists (the first optimizer step, which creates it, is not recorded).

    Args:
        model: an ``nn.Module`` (never modified) or a factory.
        inputs: the per-sample input spec.
        device: ``"cpu"``, a catalog GPU name or a DeviceProfile: a CUDA target runs
            CUDA's autocast policy and foreach optimizers, as the memory trace does.

    Example:
        >>> import torch
        >>> ops = trace_op_costs(lambda: torch.nn.Linear(64, 32), (64,), 16, mode="infer")
        >>> [(op.op, op.flops, op.gemms[0]) for op in ops if op.gemms]
        [('aten.addmm.default', 65536, GemmShape(m=16, n=32, k=64, count=1))]
    """
    import contextlib

    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from batchfit import _torch_internals as ti
    from batchfit.device import resolve_device
    from batchfit.fake import enable_checkpointing, fake_copy
    from batchfit.spec import Mode
    from batchfit.step import StepRunner, make_batch, normalize_input_spec, torch_dtype

    config = make_config(config, options)
    profile = resolve_device(device)
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise InvalidInputError(f"batch size must be a positive integer, not {batch_size!r}")
    spec = normalize_input_spec(inputs)
    weight = config.precision.weight_dtype
    float_dtype = None if weight == "float32" else torch_dtype(weight)
    amp = config.precision.autocast_dtype
    training = config.mode is Mode.TRAIN
    fake_mode = ti.new_fake_mode()
    with ti.preserved_global_state():
        twin = fake_copy(model, fake_mode, float_dtype=float_dtype,
                         channels_last=config.channels_last)
        if config.checkpointing and training:
            enable_checkpointing(twin)
        generator = torch.Generator().manual_seed(0)
        with fake_mode:
            batch = make_batch(spec, batch_size, float_dtype, generator, config.channels_last)
        emulation: Any = contextlib.nullcontext()
        autocast = None
        if profile.is_cuda:
            from batchfit.cuda_emulation import CudaEmulation

            # sdpa=False: the math path carries attention's FLOPs (see Known limitations)
            emulation = CudaEmulation(profile.compute_capability, sdpa=False,
                                      autocast_dtype=torch_dtype(amp) if amp else None)
            autocast = emulation.autocast_region if amp else None
        elif amp:
            amp_dtype = torch_dtype(amp)
            autocast = lambda: torch.autocast("cpu", dtype=amp_dtype)
        with fake_mode:
            runner = StepRunner(twin, config, batch, autocast=autocast,
                                foreach=profile.is_cuda, generator=generator)
        counter = FlopCounterMode(display=False, custom_mapping=_extra_flop_formulas())
        recorder = _CostRecorder(counter)
        with fake_mode, emulation, counter, recorder.interceptor:
            if training:
                runner.forward_backward()
                recorder.recording = False
                runner.optimizer_step()  # creates the optimizer state
                recorder.recording = True
                runner.optimizer_step()
            else:
                runner.infer_step()
    return tuple(recorder.ops)


# -- costs as functions of the batch size ----------------------------------------------------


@dataclass(frozen=True, eq=False)
class StepCosts:
    """Per-op costs as affine functions of the batch size: ``q(B) = q0 + q1 * B``.

    Arrays (numpy): ``flops`` and ``bytes_moved`` of shape (ops, 2); ``kind`` per
    op (0 other, 1 matmul, 2 convolution); ``gemm_op`` (gemms,) the op each GEMM
    belongs to; ``gemm_dims`` (gemms, 4, 2): M, N, K, count, each affine.
    ``batch_size`` is None when the costs hold at every batch, else the one batch
    they were traced at.
    """

    ops: tuple[str, ...]
    flops: Any
    bytes_moved: Any
    kind: Any
    gemm_op: Any
    gemm_dims: Any
    batch_size: int | None = None

    def at(self, batch_size: int) -> tuple[OpCost, ...]:
        """The :class:`OpCost` s at ``batch_size``."""
        if self.batch_size is not None and batch_size != self.batch_size:
            raise InvalidInputError(f"these costs hold at batch {self.batch_size} only")
        gemms: dict[int, list[GemmShape]] = {}
        for op, dims in zip(self.gemm_op.tolist(), self.gemm_dims.tolist()):
            m, n, k, count = (int(a + b * batch_size) for a, b in dims)
            gemms.setdefault(op, []).append(GemmShape(m, n, k, count))
        return tuple(
            OpCost(name, int(f[0] + f[1] * batch_size), int(b[0] + b[1] * batch_size),
                   tuple(gemms.get(i, ())), bool(kind == 2))
            for i, (name, f, b, kind) in enumerate(
                zip(self.ops, self.flops.tolist(), self.bytes_moved.tolist(), self.kind.tolist())))


def _arrays(ops: Sequence[OpCost]) -> tuple[Any, Any, Any, Any, Any]:
    import numpy as np

    flops = np.array([op.flops for op in ops], dtype=np.int64)
    moved = np.array([op.bytes_moved for op in ops], dtype=np.int64)
    kind = np.array([2 if op.convolution else (1 if op.gemms else 0) for op in ops], dtype=np.int8)
    gemm_op = np.array([i for i, op in enumerate(ops) for _ in op.gemms], dtype=np.int64)
    dims = np.array([[g.m, g.n, g.k, g.count] for op in ops for g in op.gemms],
                    dtype=np.int64).reshape(-1, 4)
    return flops, moved, kind, gemm_op, dims


def constant_costs(ops: Sequence[OpCost], batch_size: int) -> StepCosts:
    """Costs traced at one batch size, valid at that batch only."""
    import numpy as np

    flops, moved, kind, gemm_op, dims = _arrays(ops)
    zero = np.zeros_like
    return StepCosts(tuple(op.op for op in ops), np.stack([flops, zero(flops)], 1),
                     np.stack([moved, zero(moved)], 1), kind, gemm_op,
                     np.stack([dims, zero(dims)], 2), batch_size)


def fit_costs(traces: dict[int, Sequence[OpCost]]) -> StepCosts | None:
    """Affine costs from traces at three batch sizes, the first two consecutive; None if
    the ops differ between traces or a cost is not affine in the batch size."""
    import numpy as np

    (b1, ops1), (b2, ops2), (b3, ops3) = sorted(traces.items())[:3]
    if b2 != b1 + 1:
        raise InvalidInputError("fit_costs needs two consecutive batch sizes first, e.g. 4, 5, 8")
    if not len(ops1) == len(ops2) == len(ops3):
        return None
    if any(len({a.op, b.op, c.op}) != 1 or len({len(a.gemms), len(b.gemms), len(c.gemms)}) != 1
           for a, b, c in zip(ops1, ops2, ops3)):
        return None
    a1, a2, a3 = _arrays(ops1), _arrays(ops2), _arrays(ops3)
    fitted = []
    for q1, q2, q3 in ((a1[0], a2[0], a3[0]), (a1[1], a2[1], a3[1]), (a1[4], a2[4], a3[4])):
        slope = q2 - q1  # integer: b2 - b1 = 1
        intercept = q1 - slope * b1
        if not np.array_equal(intercept + slope * b3, q3):
            return None
        fitted.append(np.stack([intercept, slope], -1))
    flops, moved, dims = fitted
    return StepCosts(tuple(op.op for op in ops1), flops, moved, a1[2], a1[3], dims)


def step_costs(model: Any, inputs: Any, config: TrainConfig, device: Any,
               batch_sizes: Sequence[int] = FIT_BATCHES) -> StepCosts | None:
    """Trace at ``batch_sizes`` (default 4, 5, 8) and fit affine costs (None: not affine)."""
    traces = {b: trace_op_costs(model, inputs, b, config, device=device) for b in batch_sizes}
    return fit_costs(traces)


@dataclass(frozen=True)
class StepTime:
    """Predicted time of one step, and what it is made of (seconds summed over ops)."""

    batch_size: int
    step_s: float
    compute_s: float
    memory_s: float
    overhead_s: float
    gemm_efficiency: float  #: useful / scheduled GEMM work (1.0 without quantization)
    ops: int

    @property
    def samples_per_s(self) -> float:
        return self.batch_size / self.step_s


def _op_rates(costs: StepCosts, profile: RooflineProfile) -> Any:
    import numpy as np

    rates = np.array([profile.vector_flops_per_s, profile.matmul_flops_per_s,
                      profile.conv_flops_per_s])
    return rates[costs.kind.astype(np.int64)]


def step_times(costs: StepCosts, profile: RooflineProfile,
               batch_sizes: Sequence[int]) -> list[StepTime]:
    """Predicted :class:`StepTime` at each batch size (vectorised over batches)."""
    import numpy as np

    found: list[StepTime] = []
    rates = _op_rates(costs, profile)[:, None]
    n_ops = len(costs.ops)
    for start in range(0, len(batch_sizes), 256):
        chunk = np.asarray(batch_sizes[start:start + 256], dtype=np.int64)
        if costs.batch_size is not None and np.any(chunk != costs.batch_size):
            raise InvalidInputError(f"these costs hold at batch {costs.batch_size} only")
        flops = costs.flops[:, :1] + costs.flops[:, 1:] * chunk[None, :]
        moved = costs.bytes_moved[:, :1] + costs.bytes_moved[:, 1:] * chunk[None, :]
        factor, efficiency = _quantization(costs, profile, chunk)
        compute = flops * factor / rates
        memory = moved / profile.bandwidth_for(moved)
        per_op = np.maximum(compute, memory)
        overhead = profile.launch_overhead_s
        per_op = np.maximum(per_op, overhead) if profile.async_launch else per_op + overhead
        for j, b in enumerate(chunk.tolist()):
            found.append(StepTime(b, float(per_op[:, j].sum()), float(compute[:, j].sum()),
                                  float(memory[:, j].sum()), overhead * n_ops,
                                  float(efficiency[j]), n_ops))
    return found


def _quantization(costs: StepCosts, profile: RooflineProfile, chunk: Any) -> tuple[Any, Any]:
    """Per-op factors (ops, batches) scheduled/useful GEMM work, and the overall efficiency."""
    import numpy as np

    n_ops, n_b = len(costs.ops), len(chunk)
    factor = np.ones((n_ops, n_b))
    if profile.sm_count is None or profile.tile is None or len(costs.gemm_op) == 0:
        return factor, np.ones(n_b)
    dims = costs.gemm_dims[:, :, :1] + costs.gemm_dims[:, :, 1:] * chunk[None, None, :]
    m, n, k, count = dims[:, 0], dims[:, 1], dims[:, 2], dims[:, 3]
    useful = (count * m * n * k).astype(np.float64)
    waves = gemm_waves(m, n, profile.sm_count, profile.tile, count)
    tile_work = (tile_extent(m, profile.tile[0]) * tile_extent(n, profile.tile[1])
                 * pad_to(k, profile.alignment))
    scheduled = (waves * profile.sm_count).astype(np.float64) * tile_work
    op_useful = np.zeros((n_ops, n_b))
    op_scheduled = np.zeros((n_ops, n_b))
    np.add.at(op_useful, costs.gemm_op, useful)
    np.add.at(op_scheduled, costs.gemm_op, scheduled)
    has = op_useful > 0
    factor[has] = op_scheduled[has] / op_useful[has]
    total_useful, total_scheduled = useful.sum(0), scheduled.sum(0)
    efficiency = np.where(total_scheduled > 0, total_useful / np.maximum(total_scheduled, 1), 1.0)
    return factor, efficiency


# -- the prediction --------------------------------------------------------------------------


@dataclass(frozen=True)
class PredictedPoint:
    """The predicted step at one batch size."""

    batch_size: int
    step_s: float
    samples_per_s: float
    peak_bytes: int | None
    compute_s: float
    memory_s: float
    overhead_s: float
    gemm_efficiency: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class WaveBoundary:
    """A batch size whose predicted samples/s is ``drop`` below that of ``batch_size - 1``."""

    batch_size: int
    drop: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class ThroughputPrediction:
    """Predicted throughput against batch size on a device you need not have.

    Attributes:
        points: the predicted steps (``peak_bytes`` interpolated between traced batches).
        knee_batch_size, best_batch_size, best_samples_per_s: as for a measured sweep.
        recommended_batch_size: the knee, or, if a batch within 12.5% of it runs
            more than ``WAVE_DROP`` faster per sample, the smallest such batch.
        wave_boundaries: batch sizes in ``scan_range`` that fall off a wave boundary.
        affine: the costs were fitted once for every batch (else traced per point).
    """

    points: tuple[PredictedPoint, ...]
    knee_batch_size: int
    best_batch_size: int
    best_samples_per_s: float
    recommended_batch_size: int
    max_batch_size: int
    memory_bytes: int
    wave_boundaries: tuple[WaveBoundary, ...]
    scan_range: tuple[int, int] | None
    device: Any  # DeviceProfile
    profile: RooflineProfile
    tolerance: float
    affine: bool
    dataset_size: int | None = None
    epoch_s: float | None = None
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "points": [p.to_dict() for p in self.points],
            "knee_batch_size": self.knee_batch_size,
            "best_batch_size": self.best_batch_size,
            "best_samples_per_s": self.best_samples_per_s,
            "recommended_batch_size": self.recommended_batch_size,
            "max_batch_size": self.max_batch_size,
            "memory_bytes": self.memory_bytes,
            "wave_boundaries": [w.to_dict() for w in self.wave_boundaries],
            "scan_range": list(self.scan_range) if self.scan_range else None,
            "device": self.device.to_dict(),
            "roofline": self.profile.to_dict(),
            "tolerance": self.tolerance,
            "affine": self.affine,
            "dataset_size": self.dataset_size,
            "epoch_s": self.epoch_s,
            "predicted": True,
            "note": self.note,
        }


def find_wave_boundaries(batch_sizes: Sequence[int], samples_per_s: Sequence[float],
                         drop: float = WAVE_DROP) -> tuple[WaveBoundary, ...]:
    """Batches whose samples/s is more than ``drop`` below the previous (consecutive) batch's.

    Example:
        >>> find_wave_boundaries([6, 7, 8, 9], [60.0, 70.0, 80.0, 60.0])
        (WaveBoundary(batch_size=9, drop=0.25),)
    """
    found = []
    pairs = list(zip(batch_sizes, samples_per_s))
    for (b0, r0), (b1, r1) in itertools.pairwise(pairs):
        if b1 == b0 + 1 and r1 < r0 * (1 - drop):
            found.append(WaveBoundary(b1, 1 - r1 / r0))
    return tuple(found)


def _resolve_target(gpu: Any, profile: RooflineProfile | None, precision: Precision) -> tuple[Any, RooflineProfile]:
    from batchfit.catalog import GPU, find_gpu
    from batchfit.device import DeviceProfile, gpu_profile

    if gpu is not None:
        card = gpu if isinstance(gpu, GPU) else find_gpu(str(gpu))
        return gpu_profile(card), profile or gpu_roofline_profile(card, precision)
    if profile is not None:
        return DeviceProfile.cpu(), profile
    raise InvalidInputError(
        "a prediction needs a GPU: pass gpu='A100' (batchfit gpus lists them), "
        "or a RooflineProfile from measure_cpu_profile() for this CPU")


def _peak_interpolator(limit: Any) -> Any:
    """Device bytes at any batch, linear between the batches the max-batch solve traced."""
    import numpy as np

    device = limit.device
    extra = device.context_bytes + device.workspace_bytes if device.is_cuda else 0
    pairs = sorted(limit.evaluated)
    xs = np.array([b for b, _ in pairs], dtype=np.float64)
    ys = np.array([v for _, v in pairs], dtype=np.float64)
    return lambda b: round(float(np.interp(b, xs, ys))) + extra


def predict_throughput(model: Any, inputs: Any, config: TrainConfig | None = None, *,
                       gpu: Any = None, profile: RooflineProfile | None = None,
                       memory_bytes: int | None = None, batches: Sequence[int] | str = "auto",
                       tolerance: float = DEFAULT_TOLERANCE, dataset_size: int | None = None,
                       margin: float = 0.0, max_batch_limit: int = DEFAULT_MAX_BATCH_LIMIT,
                       **options: Any) -> ThroughputPrediction:
    """Predict step time and throughput against batch size from a roofline, without the device.

    Args:
        model: an ``nn.Module`` or a factory.
        inputs: the per-sample input spec.
        config: a :class:`~batchfit.spec.TrainConfig`, or its fields as ``options``.
        gpu: a catalog GPU name (or :class:`~batchfit.catalog.GPU`). Without it, give
            ``profile`` (e.g. :func:`measure_cpu_profile`) and ``memory_bytes``.
        profile: overrides the GPU's :class:`RooflineProfile`.
        memory_bytes: the memory budget (required without ``gpu``).
        batches: ``"auto"``: every power of two and midpoint up to the largest batch that
            fits (:func:`batchfit.throughput.batch_grid`); or a list of sizes that fit.

    Raises:
        InvalidInputError: no GPU and no profile, a batch above the maximum, a bad size.

    Example:
        >>> import torch
        >>> mlp = lambda: torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 1024))
        >>> p = predict_throughput(mlp, (1024,), gpu="A100", precision="amp-bf16", max_batch_limit=4096)
        >>> p.max_batch_size, p.knee_batch_size <= p.best_batch_size, bool(p.wave_boundaries)
        (4096, True, True)
    """
    from batchfit.maxbatch import max_batch_size
    from batchfit.throughput import _check_tolerance

    config = make_config(config, options)
    _check_tolerance(tolerance)
    _check_dataset_size(dataset_size)
    requested = _parse_batches(batches)
    device, roofline = _resolve_target(gpu, profile, config.precision)
    limit = max_batch_size(model, inputs, config, device=device, memory_bytes=memory_bytes,
                           margin=margin, max_batch_limit=max_batch_limit)
    maximum = limit.max_batch_size
    if requested is not None and requested[-1] > maximum:
        over = ", ".join(str(b) for b in requested if b > maximum)
        raise InvalidInputError(
            f"batch sizes {over} are above the largest that fits ({maximum} on {device.name})")
    grid = list(requested) if requested is not None else list(batch_grid(maximum))
    costs = step_costs(model, inputs, config, device)
    if costs is not None:
        times = step_times(costs, roofline, grid)
    else:
        times = [step_times(constant_costs(trace_op_costs(model, inputs, b, config, device=device), b),
                            roofline, [b])[0] for b in grid]
    knee = find_knee(grid, [t.samples_per_s for t in times], tolerance)
    recommended, boundaries, scan = knee.knee_batch_size, (), None
    if costs is not None and roofline.sm_count is not None:
        recommended, boundaries, scan = _scan_waves(costs, roofline, knee.knee_batch_size, maximum)
    peak = _peak_interpolator(limit)
    points = tuple(PredictedPoint(t.batch_size, t.step_s, t.samples_per_s, peak(t.batch_size),
                                  t.compute_s, t.memory_s, t.overhead_s, t.gemm_efficiency)
                   for t in times)
    epoch = None
    if dataset_size is not None:
        at = step_times(costs, roofline, [recommended])[0] if costs is not None else next(
            (t for t in times if t.batch_size == recommended), None)
        epoch = epoch_seconds(dataset_size, recommended, at.step_s) if at is not None else None
    note = "" if costs is not None else "costs are not affine in the batch: traced per batch"
    return ThroughputPrediction(
        points=points, knee_batch_size=knee.knee_batch_size, best_batch_size=knee.best_batch_size,
        best_samples_per_s=knee.best_samples_per_s, recommended_batch_size=recommended,
        max_batch_size=maximum, memory_bytes=limit.memory_bytes, wave_boundaries=boundaries,
        scan_range=scan, device=device, profile=roofline, tolerance=tolerance,
        affine=costs is not None, dataset_size=dataset_size, epoch_s=epoch,
        note="; ".join(n for n in (limit.note, note) if n))


def _scan_waves(costs: StepCosts, profile: RooflineProfile, knee: int,
                maximum: int) -> tuple[int, tuple[WaveBoundary, ...], tuple[int, int]]:
    """Every batch from knee/2 to 2 x knee: wave boundaries, and the recommended batch."""
    low = max(1, knee // 2)
    high = min(maximum, max(2 * knee, low + 1), low + MAX_SCAN - 1)
    batches = list(range(low, high + 1))
    rates = [t.samples_per_s for t in step_times(costs, profile, batches)]
    boundaries = find_wave_boundaries(batches, rates)
    window = {b: r for b, r in zip(batches, rates) if abs(b - knee) <= knee // 8}
    recommended = knee
    if knee in window:
        top = max(window.values())
        if window[knee] < top * (1 - WAVE_DROP):
            recommended = min(b for b, r in window.items() if r >= top * (1 - WAVE_DROP))
    return recommended, boundaries, (low, high)
