"""The rates a roofline runs on: kinds of op, and a device's rates per kind.

GPU profiles (:func:`gpu_roofline_profile`): every kind runs at a flat rate, the
catalog's peak for the precision in use times ``DEFAULT_FLOPS_EFFICIENCY`` (0.75:
large cuBLAS GEMMs reach 70-90% of the datasheet peak; the matmul rate for
matmuls and attention, the conv rate for convolutions), memory at the datasheet
bandwidth times ``DEFAULT_BANDWIDTH_EFFICIENCY`` (0.8); no latency or page
faults; ``overhead`` is **5 us** (eager PyTorch dispatches a kernel every 5-10
us at best, so short kernels cannot run faster than that). In fp32, matmuls use
the fp32 rate (torch's ``allow_tf32`` is off for matmul) and convolutions the
tf32 rate (cuDNN's is on), where the card has one.

CPU profiles are measured on the host that runs batchfit (:mod:`batchfit.speed.cpu_profile`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any

from batchfit.engine.spec import Precision, parse_enum
from batchfit.errors import InvalidInputError
from batchfit.speed.gemm import ALIGNMENT_BY_PRECISION, TILE_BY_PRECISION

DEFAULT_FLOPS_EFFICIENCY = 0.75
DEFAULT_BANDWIDTH_EFFICIENCY = 0.8
#: Per-op floor on a GPU: eager PyTorch launches at most one kernel every ~5 us.
DEFAULT_GPU_LAUNCH_S = 5e-6


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
                     "_scaled_dot_product_efficient_attention",
                     "_scaled_dot_product_cudnn_attention"), OpKind.ATTENTION),
    **dict.fromkeys(("_scaled_dot_product_flash_attention_for_cpu_backward",
                     "_scaled_dot_product_flash_attention_backward",
                     "_scaled_dot_product_efficient_attention_backward",
                     "_scaled_dot_product_cudnn_attention_backward"), OpKind.ATTENTION_BACKWARD),
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
    from batchfit.device.catalog import GPU, find_gpu

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


