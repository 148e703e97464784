"""Predict step time against batch size without the device: a roofline over the traced ops.

The step (the one :mod:`batchfit.step` defines) runs once on fake tensors, as
:func:`batchfit.trace.trace_step` runs it, under ``torch.utils.flop_counter.
FlopCounterMode``. Every aten op that launches work becomes an :class:`OpCost`:
its kind (:class:`OpKind`: matmul; convolution forward or backward, at stride 1
or strided; fused attention, batch norm and layer norm, forward or backward;
other), its FLOPs (the counter's formulas), the bytes it moves (its tensor
inputs plus its outputs), the GEMM shapes it runs (convolutions as implicit
GEMMs) and the bytes of each output it allocates. Views and bare allocations
move nothing and launch nothing; they are skipped.

Time of one op of kind ``k`` on a :class:`RooflineProfile`::

    intensity = flops / bytes                          (FLOPs per byte moved)
    compute   = flops / rate_k(intensity) * quantization
    memory    = bytes / bandwidth_k(bytes)
    work      = max(compute, memory) + latency_k + page faults
    op        = work + overhead            (CPU: ops run one after another)
    op        = max(work, overhead)        (GPU: launches are asynchronous, so the host
                                            cost hides behind longer kernels)

and the step is the sum over ops.

GPU profiles (:func:`gpu_roofline_profile`): every kind runs at a flat rate, the
catalog's peak for the precision in use times ``DEFAULT_FLOPS_EFFICIENCY`` (0.75:
large cuBLAS GEMMs reach 70-90% of the datasheet peak; the matmul rate for
matmuls and attention, the conv rate for convolutions), memory at the datasheet
bandwidth times ``DEFAULT_BANDWIDTH_EFFICIENCY`` (0.8); no latency or page
faults; ``overhead`` is **5 us** (eager PyTorch dispatches a kernel every 5-10
us at best, so short kernels cannot run faster than that). In fp32, matmuls use
the fp32 rate (torch's ``allow_tf32`` is off for matmul) and convolutions the
tf32 rate (cuDNN's is on), where the card has one.

CPU profiles (:func:`measure_cpu_profile`) are measured, kind by kind, with
kernels of that kind at training-step shapes, reading inputs that are not in
cache: ``rate_k`` is a curve of FLOP/s against arithmetic intensity (matmul,
convolutions, attention), ``bandwidth_k`` of bytes/s against bytes moved (the
norms, and a step-like chain of elementwise ops for everything else), both
interpolated in log scale; ``latency_k`` is the kind's time at a tiny shape;
``overhead`` the framework's cost per op in a real training step. One flat
roofline (the peak matmul rate and copy bandwidth) under-predicted every step of
three small models here, by a median 39%, because kernels at a model's shapes
run far below the peaks: in one profile, matmuls ran at 20 GFLOP/s (8 rows) to
90 (1024 x 1024), 3x3 convolutions at 17-30 (an RGB stem) to 55-80, their
strided backward at 11-18 to 37-43; batch norm's training forward moved 2 GB/s,
elementwise ops 7-10 GB/s, a plain copy 10-18. Per kind, the median error over
the same 52 points is 10% and 16% in two runs (benchmarks/bench_knee.py).

Page faults (CPU). glibc serves every allocation of at least 32 MiB (its largest
dynamic mmap threshold) from a fresh mapping and unmaps it on free, so each step
faults those pages in again: an op whose output is that big pays
``page_fault_s_per_byte`` (measured: a clone of 32 MiB against a copy into an
existing tensor; 0.4-0.7 ns per byte here) on top. A small CNN at batch 256, whose
first activations are exactly 32 MiB, ran at 60% of the samples/s it reached at
192; the fault term predicts it within a few percent.

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
already tile multiples).

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
      quantized. A GPU profile has no per-kind curves: small or odd-shaped
      kernels run below the flat 75% of peak.
    * Fused attention (flash, memory-efficient) is traced through its math
      path on a GPU target: FLOPs are right, bytes include the s x s matrix
      that a fused kernel keeps on chip.
    * CPU rates are curves over one feature (intensity, or bytes): two
      convolutions of the same intensity but other channel counts can run 1.3x
      apart. Grouped, depthwise and 1x1 convolutions are timed on the 3x3
      curves.
    * Caches: the CPU's elementwise and norm rates are measured on inputs that
      are not in cache, as most of a step's are; an optimizer whose tensors stay
      in cache from one of its ops to the next (a small MLP's 4 MiB weights)
      runs up to ~1.5x faster than predicted.
    * Page faults are modelled for glibc's mapped blocks only: heap memory that
      glibc trims and the next step faults in again (tens of MiB per step for a
      CNN at batch 48-192 here, none for a transformer) is not.
    * No overlap between ops, no CUDA graphs, no torch.compile fusion.
    * CPU flash attention, which torch has no FLOP formula for, is counted
      with the CUDA kernels' formula (the profile's attention rates are counted
      the same way, so they cancel).
    * A CPU profile is a snapshot: on a shared machine measure it alongside
      what it predicts (benchmarks/bench_knee.py measures one per round of its
      sweep and keeps the fastest of each kernel).

Example:
    >>> from batchfit.roofline import gemm_waves
    >>> gemm_waves(4096, 4096, sm_count=108, tile=(256, 128))  # 16 x 32 = 512 tiles on 108 SMs
    5
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from enum import StrEnum
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


# -- kinds of op ---------------------------------------------------------------------------


class OpKind(StrEnum):
    """The kind of kernel an op runs: a profile can give each kind its own rates.

    Forward and backward kernels of a layer differ (batch norm's forward, which
    computes the batch statistics, runs at half the bytes/s of its backward here), and
    so do strided convolutions (oneDNN runs a stride-2 3x3 layer at about half the
    FLOP/s of a stride-1 one, forward and backward).
    """

    MATMUL = "matmul"
    CONV = "conv"
    CONV_STRIDED = "conv_strided"
    CONV_BACKWARD = "conv_backward"
    CONV_BACKWARD_STRIDED = "conv_backward_strided"
    ATTENTION = "attention"  #: fused scaled-dot-product attention (CPU flash)
    ATTENTION_BACKWARD = "attention_backward"
    BATCH_NORM = "batch_norm"
    BATCH_NORM_BACKWARD = "batch_norm_backward"
    LAYER_NORM = "layer_norm"
    LAYER_NORM_BACKWARD = "layer_norm_backward"
    OTHER = "other"  #: elementwise ops, reductions, copies, the optimizer's updates


#: Position of each kind in :attr:`StepCosts.kind`.
OP_KINDS = tuple(OpKind)
#: Kinds whose time is their bytes (no FLOPs counted), and the convolution kinds.
MEMORY_KINDS = (OpKind.BATCH_NORM, OpKind.BATCH_NORM_BACKWARD, OpKind.LAYER_NORM,
                OpKind.LAYER_NORM_BACKWARD, OpKind.OTHER)
CONV_KINDS = (OpKind.CONV, OpKind.CONV_STRIDED, OpKind.CONV_BACKWARD,
              OpKind.CONV_BACKWARD_STRIDED)
_KIND_BY_OP = {
    **dict.fromkeys(("mm", "addmm", "bmm", "baddbmm"), OpKind.MATMUL),
    "convolution": OpKind.CONV,
    "convolution_backward": OpKind.CONV_BACKWARD,
    **dict.fromkeys(("_scaled_dot_product_flash_attention_for_cpu",
                     "_scaled_dot_product_flash_attention",
                     "_scaled_dot_product_efficient_attention"), OpKind.ATTENTION),
    **dict.fromkeys(("_scaled_dot_product_flash_attention_for_cpu_backward",
                     "_scaled_dot_product_flash_attention_backward",
                     "_scaled_dot_product_efficient_attention_backward"), OpKind.ATTENTION_BACKWARD),
    **dict.fromkeys(("native_batch_norm", "_native_batch_norm_legit",
                     "_native_batch_norm_legit_no_training",
                     "_native_batch_norm_legit_functional"), OpKind.BATCH_NORM),
    "native_batch_norm_backward": OpKind.BATCH_NORM_BACKWARD,
    "native_layer_norm": OpKind.LAYER_NORM,
    "native_layer_norm_backward": OpKind.LAYER_NORM_BACKWARD,
}
_STRIDED = {OpKind.CONV: OpKind.CONV_STRIDED, OpKind.CONV_BACKWARD: OpKind.CONV_BACKWARD_STRIDED}


def op_kind(op: str, strided: bool = False) -> OpKind:
    """The kind of an op named as the trace names it (``"aten.mm.default"``); ``strided``:
    a convolution with a stride above 1.

    Example:
        >>> op_kind("aten.addmm.default"), op_kind("aten.add.Tensor")
        (<OpKind.MATMUL: 'matmul'>, <OpKind.OTHER: 'other'>)
        >>> op_kind("aten.convolution_backward.default", strided=True).value
        'conv_backward_strided'
    """
    parts = op.split(".")
    kind = _KIND_BY_OP.get(parts[1] if len(parts) > 1 else op, OpKind.OTHER)
    return _STRIDED.get(kind, kind) if strided else kind


# -- profiles ------------------------------------------------------------------------------

Curve = tuple[tuple[float, float], ...]


def interpolate(curve: Curve, x: Any) -> Any:
    """``curve`` (``(x, y)`` pairs, x ascending) at ``x``: linear in log2(x), clamped at the ends.

    Example:
        >>> float(interpolate(((1.0, 10.0), (4.0, 30.0)), 2.0)), float(interpolate(((1.0, 10.0), (4.0, 30.0)), 64.0))
        (20.0, 30.0)
    """
    import numpy as np

    xs = np.log2([max(a, 1e-30) for a, _ in curve])
    return np.interp(np.log2(np.maximum(x, 1e-30)), xs, [b for _, b in curve])


@dataclass(frozen=True)
class KindRates:
    """Measured rates of one :class:`OpKind` (a CPU profile has them; a GPU profile does not).

    Attributes:
        flops_per_s: ``(FLOPs per byte moved, FLOP/s)`` pairs, ascending: the compute
            ceiling as a function of the op's arithmetic intensity (oneDNN and MKL run a
            skinny GEMM or a 3-channel convolution far below their peak).
        bytes_per_s: ``(bytes moved, bytes/s)`` pairs, ascending: the memory ceiling by
            the op's size (batch norm runs well below a plain copy).
        latency_s: seconds per call on top of the work (primitive lookup, reorders, setup).
    """

    flops_per_s: Curve = ()
    bytes_per_s: Curve = ()
    latency_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"flops_per_s": [list(p) for p in self.flops_per_s],
                "bytes_per_s": [list(p) for p in self.bytes_per_s], "latency_s": self.latency_s}


@dataclass(frozen=True)
class RooflineProfile:
    """The rates a step's time is predicted from.

    Attributes:
        name: display name.
        precision: the catalog precision key of the matmul rate ("fp32", "bf16"...).
        matmul_flops_per_s, conv_flops_per_s, vector_flops_per_s: flat rates for
            matmuls (and fused attention), convolutions, and every other op with FLOPs.
        memory_bandwidth_bytes_per_s: flat memory bandwidth.
        launch_overhead_s: per-op overhead (see ``async_launch``).
        async_launch: True (GPU): an op takes at least the overhead; False (CPU): the
            overhead adds to every op.
        sm_count: SMs for wave quantization; None (CPU) for none.
        tile: the GEMM output tile; alignment: K padding in elements.
        bandwidth_curve: ``(bytes moved by one op, bytes/s)`` pairs, ascending; when
            given, an op's bandwidth is interpolated on it (log scale) instead of the
            flat ``memory_bandwidth_bytes_per_s``.
        kinds: :class:`KindRates` by :class:`OpKind`; a kind's curves, where given,
            replace the flat rate and the bandwidth curve for ops of that kind.
        page_fault_s_per_byte, mmap_threshold_bytes: a fresh output of at least
            ``mmap_threshold_bytes`` costs ``page_fault_s_per_byte`` per byte on top (glibc
            maps such blocks afresh on every allocation and unmaps them on free, so
            every step faults their pages in again). None: no such cost.
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
    bandwidth_curve: Curve = ()
    kinds: Mapping[OpKind, KindRates] = field(default_factory=dict)
    page_fault_s_per_byte: float = 0.0
    mmap_threshold_bytes: int | None = None
    source: str = ""

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["tile"] = list(self.tile) if self.tile else None
        data["bandwidth_curve"] = [list(pair) for pair in self.bandwidth_curve]
        data["kinds"] = {kind.value: rates.to_dict() for kind, rates in self.kinds.items()}
        return data

    def bandwidth_for(self, bytes_moved: Any, kind: OpKind = OpKind.OTHER) -> Any:
        """Bytes/s for an op of ``kind`` moving ``bytes_moved``: its kind's curve, the
        bandwidth curve, else the flat bandwidth (curves log-interpolated)."""
        rates = self.kinds.get(kind)
        if rates is not None and rates.bytes_per_s:
            return interpolate(rates.bytes_per_s, bytes_moved)
        if self.bandwidth_curve:
            return interpolate(self.bandwidth_curve, bytes_moved)
        return self.memory_bandwidth_bytes_per_s

    def flops_rate_for(self, intensity: Any, kind: OpKind) -> Any:
        """FLOP/s for an op of ``kind`` at ``intensity`` FLOPs per byte: its kind's curve,
        else the flat rate (matmul for matmuls and attention, conv for convolutions)."""
        rates = self.kinds.get(kind)
        if rates is not None and rates.flops_per_s:
            return interpolate(rates.flops_per_s, intensity)
        if kind in (OpKind.MATMUL, OpKind.ATTENTION, OpKind.ATTENTION_BACKWARD):
            return self.matmul_flops_per_s
        if kind in CONV_KINDS:
            return self.conv_flops_per_s
        return self.vector_flops_per_s

    def latency_for(self, kind: OpKind) -> float:
        rates = self.kinds.get(kind)
        return rates.latency_s if rates is not None else 0.0


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
    so a rate here is what the prediction divides by. About 60 kernels: 10-20 seconds
    on this (shared, 2-core) machine. Numbers below are from profiles measured here.

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

    ``clock`` as in :class:`batchfit.throughput.TimingConfig` (``cpu``: one thread,
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
        source=(f"measured here: matmul, convolution, attention and norm kernels of "
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

        from batchfit import _torch_internals as ti

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

    from batchfit.step import StepRunner, make_batch, normalize_input_spec
    from batchfit.throughput import _freeze_learning_rate

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
    :func:`batchfit.throughput.bench` keeps a batch's fastest round.

    Example:
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
    """One op of the step: its FLOPs, the bytes it moves, the GEMMs it runs and the bytes
    of each output it allocates (in-place results and views allocate nothing)."""

    op: str
    flops: int
    bytes_moved: int
    gemms: tuple[GemmShape, ...] = ()
    allocated: tuple[int, ...] = ()
    kind: OpKind | None = None  #: None: from the op's name (:func:`op_kind`)

    def __post_init__(self) -> None:
        if self.kind is None:
            object.__setattr__(self, "kind", op_kind(self.op))


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
        self._free, matmuls, convs = _op_sets()
        self._gemm_ops = matmuls | convs
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
        inputs = list(ti.iter_tensors(args))
        moved = sum(_tensor_bytes(t) for t in inputs) + sum(_tensor_bytes(t) for t in outputs)
        packet = func.overloadpacket
        gemms = _gemm_shapes(packet, args, out) if packet in self._gemm_ops else ()
        self.ops.append(OpCost(str(func), int(flops), int(moved), gemms,
                               _allocated_bytes(inputs, outputs),
                               op_kind(str(func), _strided(packet, args))))


def _strided(packet: Any, args: tuple) -> bool:
    """A convolution (forward or backward) with a stride above 1."""
    import torch

    aten = torch.ops.aten
    position = {aten.convolution: 3, aten.convolution_backward: 4}.get(packet)
    if position is None or len(args) <= position:
        return False
    return any(int(step) > 1 for step in args[position])


def _allocated_bytes(inputs: list, outputs: list) -> tuple[int, ...]:
    """Storage bytes of each output that is not the storage of an input (nor a repeat)."""
    from batchfit import _torch_internals as ti

    seen = {key[0] for key in map(ti.storage_key, inputs) if key is not None}
    found = []
    for tensor in outputs:
        key = ti.storage_key(tensor)
        if key is None or key[0] in seen:
            continue
        seen.add(key[0])
        found.append(int(key[1].nbytes()))
    return tuple(found)


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

    Arrays (numpy): ``flops`` and ``bytes_moved`` of shape (ops, 2); ``kind`` per op
    (an index into :data:`OP_KINDS`); ``gemm_op`` (gemms,) the op each GEMM belongs
    to; ``gemm_dims`` (gemms, 4, 2): M, N, K, count, each affine; ``alloc_op``
    (allocations,) the op each allocated output belongs to; ``alloc_bytes``
    (allocations, 2) its bytes. ``batch_size`` is None when the costs hold at every
    batch, else the one batch they were traced at.
    """

    ops: tuple[str, ...]
    flops: Any
    bytes_moved: Any
    kind: Any
    gemm_op: Any
    gemm_dims: Any
    alloc_op: Any
    alloc_bytes: Any
    batch_size: int | None = None

    def at(self, batch_size: int) -> tuple[OpCost, ...]:
        """The :class:`OpCost` s at ``batch_size``."""
        if self.batch_size is not None and batch_size != self.batch_size:
            raise InvalidInputError(f"these costs hold at batch {self.batch_size} only")
        gemms: dict[int, list[GemmShape]] = {}
        for op, dims in zip(self.gemm_op.tolist(), self.gemm_dims.tolist()):
            m, n, k, count = (int(a + b * batch_size) for a, b in dims)
            gemms.setdefault(op, []).append(GemmShape(m, n, k, count))
        allocated: dict[int, list[int]] = {}
        for op, (a, b) in zip(self.alloc_op.tolist(), self.alloc_bytes.tolist()):
            allocated.setdefault(op, []).append(int(a + b * batch_size))
        return tuple(
            OpCost(name, int(f[0] + f[1] * batch_size), int(b[0] + b[1] * batch_size),
                   tuple(gemms.get(i, ())), tuple(allocated.get(i, ())), OP_KINDS[kind])
            for i, (name, f, b, kind) in enumerate(
                zip(self.ops, self.flops.tolist(), self.bytes_moved.tolist(), self.kind.tolist())))


def _arrays(ops: Sequence[OpCost]) -> dict[str, Any]:
    import numpy as np

    return {
        "flops": np.array([op.flops for op in ops], dtype=np.int64),
        "bytes_moved": np.array([op.bytes_moved for op in ops], dtype=np.int64),
        "kind": np.array([OP_KINDS.index(op.kind) for op in ops], dtype=np.int8),
        "gemm_op": np.array([i for i, op in enumerate(ops) for _ in op.gemms], dtype=np.int64),
        "gemm_dims": np.array([[g.m, g.n, g.k, g.count] for op in ops for g in op.gemms],
                              dtype=np.int64).reshape(-1, 4),
        "alloc_op": np.array([i for i, op in enumerate(ops) for _ in op.allocated], dtype=np.int64),
        "alloc_bytes": np.array([n for op in ops for n in op.allocated], dtype=np.int64),
    }


#: The per-op quantities that are affine in the batch size.
_AFFINE = ("flops", "bytes_moved", "gemm_dims", "alloc_bytes")


def constant_costs(ops: Sequence[OpCost], batch_size: int) -> StepCosts:
    """Costs traced at one batch size, valid at that batch only."""
    import numpy as np

    arrays = _arrays(ops)
    for name in _AFFINE:
        arrays[name] = np.stack([arrays[name], np.zeros_like(arrays[name])], -1)
    return StepCosts(tuple(op.op for op in ops), batch_size=batch_size, **arrays)


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
           or len({len(a.allocated), len(b.allocated), len(c.allocated)}) != 1
           for a, b, c in zip(ops1, ops2, ops3)):
        return None
    a1, a2, a3 = _arrays(ops1), _arrays(ops2), _arrays(ops3)
    for name in _AFFINE:
        slope = a2[name] - a1[name]  # integer: b2 - b1 = 1
        intercept = a1[name] - slope * b1
        if not np.array_equal(intercept + slope * b3, a3[name]):
            return None
        a1[name] = np.stack([intercept, slope], -1)
    return StepCosts(tuple(op.op for op in ops1), **a1)


def step_costs(model: Any, inputs: Any, config: TrainConfig, device: Any,
               batch_sizes: Sequence[int] = FIT_BATCHES) -> StepCosts | None:
    """Trace at ``batch_sizes`` (default 4, 5, 8) and fit affine costs (None: not affine)."""
    traces = {b: trace_op_costs(model, inputs, b, config, device=device) for b in batch_sizes}
    return fit_costs(traces)


@dataclass(frozen=True)
class StepTime:
    """Predicted time of one step, and what it is made of (seconds summed over ops).

    ``overhead_s`` is the per-op framework overhead plus each kind's fixed latency;
    ``page_fault_s`` the cost of faulting in fresh mappings (CPU).
    """

    batch_size: int
    step_s: float
    compute_s: float
    memory_s: float
    overhead_s: float
    gemm_efficiency: float  #: useful / scheduled GEMM work (1.0 without quantization)
    ops: int
    page_fault_s: float = 0.0

    @property
    def samples_per_s(self) -> float:
        return self.batch_size / self.step_s


def _kind_rates(costs: StepCosts, profile: RooflineProfile, flops: Any,
                moved: Any) -> tuple[Any, Any, Any]:
    """FLOP/s and bytes/s per (op, batch), and latency per op, from each op's kind."""
    import numpy as np

    kinds = costs.kind.astype(np.int64)
    rate = np.empty(flops.shape)
    bandwidth = np.empty(flops.shape)
    latency = np.zeros(len(kinds))
    intensity = flops / np.maximum(moved, 1)
    for index in np.unique(kinds).tolist():
        kind, rows = OP_KINDS[index], kinds == index
        rate[rows] = profile.flops_rate_for(intensity[rows], kind)
        bandwidth[rows] = profile.bandwidth_for(moved[rows], kind)
        latency[rows] = profile.latency_for(kind)
    return rate, bandwidth, latency


def _page_faults(costs: StepCosts, profile: RooflineProfile, chunk: Any) -> Any:
    """Seconds per (op, batch) spent faulting in outputs of at least the mmap threshold."""
    import numpy as np

    found = np.zeros((len(costs.ops), len(chunk)))
    threshold = profile.mmap_threshold_bytes
    if threshold is None or not profile.page_fault_s_per_byte or len(costs.alloc_op) == 0:
        return found
    sizes = costs.alloc_bytes[:, :1] + costs.alloc_bytes[:, 1:] * chunk[None, :]
    np.add.at(found, costs.alloc_op, np.where(sizes >= threshold, sizes, 0)
              * profile.page_fault_s_per_byte)
    return found


def step_times(costs: StepCosts, profile: RooflineProfile,
               batch_sizes: Sequence[int]) -> list[StepTime]:
    """Predicted :class:`StepTime` at each batch size (vectorised over batches)."""
    import numpy as np

    found: list[StepTime] = []
    n_ops = len(costs.ops)
    for start in range(0, len(batch_sizes), 256):
        chunk = np.asarray(batch_sizes[start:start + 256], dtype=np.int64)
        if costs.batch_size is not None and np.any(chunk != costs.batch_size):
            raise InvalidInputError(f"these costs hold at batch {costs.batch_size} only")
        flops = costs.flops[:, :1] + costs.flops[:, 1:] * chunk[None, :]
        moved = costs.bytes_moved[:, :1] + costs.bytes_moved[:, 1:] * chunk[None, :]
        factor, efficiency = _quantization(costs, profile, chunk)
        rates, bandwidth, latency = _kind_rates(costs, profile, flops, moved)
        compute = flops * factor / rates
        memory = moved / bandwidth
        faults = _page_faults(costs, profile, chunk)
        per_op = np.maximum(compute, memory) + latency[:, None] + faults
        overhead = profile.launch_overhead_s
        per_op = np.maximum(per_op, overhead) if profile.async_launch else per_op + overhead
        for j, b in enumerate(chunk.tolist()):
            found.append(StepTime(b, float(per_op[:, j].sum()), float(compute[:, j].sum()),
                                  float(memory[:, j].sum()), overhead * n_ops + float(latency.sum()),
                                  float(efficiency[j]), n_ops, float(faults[:, j].sum())))
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
    page_fault_s: float = 0.0

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
                                  t.compute_s, t.memory_s, t.overhead_s, t.gemm_efficiency,
                                  t.page_fault_s)
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
