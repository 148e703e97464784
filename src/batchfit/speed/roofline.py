"""Predict step time against batch size without the device: a roofline over the traced ops.

The step runs once on fake tensors and every aten op that launches work becomes an
:class:`~batchfit.speed.op_costs.OpCost` (its kind, FLOPs, bytes moved, GEMM shapes and
the bytes it allocates; see :mod:`batchfit.speed.op_costs`).

Time of one op of kind ``k`` on a :class:`~batchfit.speed.rates.RooflineProfile`::

    intensity = flops / bytes                          (FLOPs per byte moved)
    compute   = flops / rate_k(intensity) * quantization
    memory    = bytes / bandwidth_k(bytes)
    work      = max(compute, memory) + latency_k + page faults
    op        = work + overhead            (CPU: ops run one after another)
    op        = max(work, overhead)        (GPU: launches are asynchronous, so the host
                                            cost hides behind longer kernels)

and the step is the sum over ops. The parts: the traced ops and their costs as functions
of the batch size (:mod:`batchfit.speed.op_costs`), the rates of a GPU from the catalog
(:mod:`batchfit.speed.rates`) or of this CPU measured kind by kind
(:mod:`batchfit.speed.cpu_profile`), and tile and wave quantization of GEMMs
(:mod:`batchfit.speed.gemm`). This module predicts the throughput curve, its knee and
its wave boundaries (:func:`predict_throughput`).

Known limitations:
    * cuBLAS picks among many tile shapes and split-K for small GEMMs; one tile
      per precision over-predicts small GEMMs. Grouped and depthwise
      convolutions, transposed convolutions and fused attention are not
      quantized. A GPU profile has no per-kind curves: small or odd-shaped
      kernels run below the flat 75% of peak.
    * Fused attention (flash, memory-efficient, cuDNN) on a GPU target is one
      op per call with torch's FLOP formula (causal masking not discounted) and
      the bytes of its inputs and outputs, timed at the profile's matmul rate.
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
      what it predicts (benchmarks/bench_knee_roofline.py measures one per round of its
      sweep and keeps the fastest of each kernel).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from batchfit.engine.spec import Precision, TrainConfig, make_config
from batchfit.errors import InvalidInputError
from batchfit.speed.bench import (
    DEFAULT_MAX_BATCH_LIMIT,
    _check_dataset_size,
    _parse_batches,
)
from batchfit.speed.knee import DEFAULT_TOLERANCE, batch_grid, epoch_seconds, find_knee
from batchfit.speed.op_costs import (
    StepCosts,
    constant_costs,
    step_times,
    trace_step_and_costs,
    traced_step_costs,
)
from batchfit.speed.rates import RooflineProfile, gpu_roofline_profile

#: A batch "falls off a wave boundary" when its samples/s is this much below batch - 1's.
WAVE_DROP = 0.01
#: Batch sizes scanned for wave boundaries around the predicted knee, at most.
MAX_SCAN = 4096




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
    stack: Any = None  # the Stack the memory was predicted for (batchfit.engine.stack)

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
            "stack": (self.stack.to_dict(self.device.compute_capability)
                      if self.stack is not None else None),
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
    from batchfit.device.catalog import GPU, find_gpu
    from batchfit.device.profile import DeviceProfile, gpu_profile

    if gpu is not None:
        card = gpu if isinstance(gpu, GPU) else find_gpu(str(gpu))
        return gpu_profile(card), profile or gpu_roofline_profile(card, precision)
    if profile is not None:
        return DeviceProfile.cpu(), profile
    raise InvalidInputError(
        "a prediction needs a GPU: pass gpu='A100' (batchfit gpus lists them), "
        "or a RooflineProfile from measure_cpu_profile() for this CPU")


def _peak_interpolator(limit: Any, traces: dict[int, Any]) -> Any:
    """Device bytes at any batch, linear between the batches traced: by the max-batch
    solve, and the passes that gave the op costs (``traces``, their memory traces)."""
    import numpy as np

    from batchfit.answers.estimate import summarize
    from batchfit.answers.maxbatch import budget_bytes_needed

    device = limit.device
    extra = device.context_bytes + device.workspace_bytes if device.is_cuda else 0
    measured = dict(limit.evaluated)
    for batch_size, traced in traces.items():
        measured.setdefault(batch_size, budget_bytes_needed(summarize(traced, device,
                                                                   first_step=False)))
    pairs = sorted(measured.items())
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
        config: a :class:`~batchfit.engine.spec.TrainConfig`, or its fields as ``options``.
        gpu: a catalog GPU name (or :class:`~batchfit.device.catalog.GPU`). Without it, give
            ``profile`` (e.g. :func:`measure_cpu_profile`) and ``memory_bytes``.
        profile: overrides the GPU's :class:`RooflineProfile`.
        memory_bytes: the memory budget (required without ``gpu``).
        batches: ``"auto"``: every power of two and midpoint up to the largest batch that
            fits (:func:`batchfit.speed.knee.batch_grid`); or a list of sizes that fit.

    Raises:
        InvalidInputError: no GPU and no profile, a batch above the maximum, a bad size.

    Example:
        >>> import torch
        >>> mlp = lambda: torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 1024))
        >>> p = predict_throughput(mlp, (1024,), gpu="A100", precision="amp-bf16", max_batch_limit=4096)
        >>> p.max_batch_size, p.knee_batch_size <= p.best_batch_size, bool(p.wave_boundaries)
        (4096, True, True)
    """
    from batchfit.answers.maxbatch import max_batch_size
    from batchfit.speed.knee import _check_tolerance

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
    # one pass per traced step gives its op costs and its memory
    traces, costs = traced_step_costs(model, inputs, config, device)
    if costs is not None:
        times = step_times(costs, roofline, grid)
    else:
        times = []
        for b in grid:
            traces[b], ops = trace_step_and_costs(model, inputs, b, config, device)
            times.append(step_times(constant_costs(ops, b), roofline, [b])[0])
    knee = find_knee(grid, [t.samples_per_s for t in times], tolerance)
    recommended, boundaries, scan = knee.knee_batch_size, (), None
    if costs is not None and roofline.sm_count is not None:
        recommended, boundaries, scan = _scan_waves(costs, roofline, knee.knee_batch_size, maximum)
    peak = _peak_interpolator(limit, traces)
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
        # the device the memory was solved on: the card with the stack's context and the
        # allocator options (what ``max`` reports)
        scan_range=scan, device=limit.device, profile=roofline, tolerance=tolerance,
        affine=costs is not None, dataset_size=dataset_size, epoch_s=epoch,
        note="; ".join(n for n in (limit.note, note) if n), stack=config.resolved_stack)


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
