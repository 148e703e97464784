"""The measured sweep's results: each batch's point (measured, out of memory, or not run
and why) and the sweep's answer (:func:`batchfit.speed.bench.bench` fills them).

Frozen dataclasses with units in their field names and ``to_dict()`` for JSON; no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from batchfit.engine.spec import Mode
from batchfit.speed.knee import AlignmentVerdict, KneeStability
from batchfit.speed.timing import TimingConfig


class PointStatus(StrEnum):
    """What became of one batch size in a sweep. Only ``out_of_memory`` and
    ``predicted_not_to_fit`` say the batch does not fit; a batch skipped for the time
    budget was never run and says nothing about memory."""

    MEASURED = "measured"  #: it ran and was timed
    OUT_OF_MEMORY = "out_of_memory"  #: it ran and ran out of memory (``error`` says how)
    PREDICTED_NOT_TO_FIT = "predicted_not_to_fit"  #: never run: a trace says it does not fit
    SKIPPED_TIME_BUDGET = "skipped_time_budget"  #: never run: it would end past the time budget


@dataclass(frozen=True)
class ThroughputPoint:
    """One batch size: measured, out of memory, or not run (and why).

    Attributes:
        batch_size: the batch size.
        status: a :class:`PointStatus`.
        step_s: median seconds per steady-state step (None unless it ran); of the
            fastest measurement when the batch was measured more than once.
        step_iqr_s: interquartile range of the step time.
        samples_per_s: ``batch_size / step_s``.
        peak_bytes: predicted device bytes of the step (from a trace; None when skipped
            for the time budget before a trace was needed).
        measured_peak_bytes: ``torch.cuda.max_memory_reserved`` on CUDA, else None.
        repeats: timed blocks behind the median; ``steps``: timed steps in all.
        error: why it did not run, or the first line of the out-of-memory error.
        seconds: wall time spent on this point (building the batch, warm-up, timing).
        step_low_s, step_high_s: the step times its measurements span: the interquartile
            interval (median -/+ IQR / 2) of each measurement, joined over its repeated
            measurements (a batch the knee rests on is measured several times).
    """

    batch_size: int
    status: PointStatus
    step_s: float | None
    step_iqr_s: float | None
    samples_per_s: float | None
    peak_bytes: int | None
    measured_peak_bytes: int | None = None
    repeats: int = 0
    steps: int = 0
    error: str = ""
    seconds: float = 0.0
    step_low_s: float | None = None
    step_high_s: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "status", PointStatus(self.status))
        if self.step_s is not None and self.step_low_s is None:
            half = (self.step_iqr_s or 0.0) / 2
            object.__setattr__(self, "step_low_s", max(self.step_s - half, 0.0))
            object.__setattr__(self, "step_high_s", self.step_s + half)

    @property
    def measured(self) -> bool:
        return self.status is PointStatus.MEASURED

    @property
    def fits(self) -> bool | None:
        """True when measured, False when it ran out of memory or was predicted not to fit,
        None when it was skipped for the time budget (not known)."""
        if self.status is PointStatus.SKIPPED_TIME_BUDGET:
            return None
        return self.measured

    @property
    def spread(self) -> float | None:
        """IQR / median of the step time."""
        if not self.step_s or self.step_iqr_s is None:
            return None
        return self.step_iqr_s / self.step_s

    @property
    def samples_per_s_range(self) -> tuple[float, float] | None:
        """The throughput its step times span: ``(low, high)`` samples/s."""
        if not self.measured or not self.step_high_s:
            return None
        low_s = self.step_low_s or self.step_s
        return self.batch_size / self.step_high_s, self.batch_size / low_s

    def to_dict(self) -> dict[str, Any]:
        return {"batch_size": self.batch_size, "status": self.status.value, "fits": self.fits,
                "step_s": self.step_s, "step_iqr_s": self.step_iqr_s,
                "step_low_s": self.step_low_s, "step_high_s": self.step_high_s,
                "samples_per_s": self.samples_per_s,
                "peak_bytes": self.peak_bytes, "measured_peak_bytes": self.measured_peak_bytes,
                "repeats": self.repeats, "steps": self.steps, "error": self.error,
                "seconds": self.seconds}


@dataclass(frozen=True)
class AlignmentResult:
    """The alignment analysis: interleaved measurements around the knee, and the verdict."""

    points: tuple[ThroughputPoint, ...]
    verdict: AlignmentVerdict
    noise: float  #: median IQR / median of the candidates' step times

    def to_dict(self) -> dict[str, Any]:
        return {"points": [p.to_dict() for p in self.points], "noise": self.noise,
                **self.verdict.to_dict()}


@dataclass(frozen=True)
class BenchResult:
    """A measured throughput sweep.

    Attributes:
        points: every batch size tried, ascending.
        knee_batch_size, best_batch_size, best_samples_per_s: see :func:`find_knee`.
        recommended_batch_size: the knee, or the fastest aligned neighbour of it.
        max_batch_size: the largest batch predicted to fit (training or inference).
        memory_bytes: the device memory (or CPU budget) the prediction used.
        memory_left_bytes: ``memory_bytes`` minus the predicted peak at the recommended batch.
        epoch_s: seconds per epoch of ``dataset_size`` samples at the recommended batch.
        elapsed_s: wall time of the whole call; ``measure_s``: of the measured steps alone.
        time_budget_s: the time budget the sweep kept to (None: none).
        memory_source: where ``memory_bytes`` came from: ``given``, ``device`` (the card's)
            or ``available`` (the CPU's available memory, when no budget was given).
        note: what bounded the sweep beyond memory (the time budget), and the solver's note.
        stability: whether the knee stands out of the timing noise, or which measured
            batches a rerun could recommend instead (:func:`~batchfit.speed.knee.knee_stability`).
    """

    points: tuple[ThroughputPoint, ...]
    knee_batch_size: int
    best_batch_size: int
    best_samples_per_s: float
    recommended_batch_size: int
    max_batch_size: int
    memory_bytes: int
    memory_left_bytes: int | None
    mode: Mode
    device: Any  # DeviceProfile
    torch_device: str
    tolerance: float
    timing: TimingConfig
    num_threads: int
    dataset_size: int | None = None
    epoch_s: float | None = None
    alignment: AlignmentResult | None = None
    elapsed_s: float = 0.0
    measure_s: float = 0.0
    note: str = ""
    time_budget_s: float | None = None
    memory_source: str = "given"
    stability: KneeStability | None = None

    def point(self, batch_size: int) -> ThroughputPoint | None:
        """The measurement of ``batch_size`` that fit (the alignment analysis's, if any)."""
        return _find_point(batch_size, self.points, self.alignment)

    def to_dict(self) -> dict[str, Any]:
        return {
            "points": [p.to_dict() for p in self.points],
            "knee_batch_size": self.knee_batch_size,
            "best_batch_size": self.best_batch_size,
            "best_samples_per_s": self.best_samples_per_s,
            "recommended_batch_size": self.recommended_batch_size,
            "max_batch_size": self.max_batch_size,
            "memory_bytes": self.memory_bytes,
            "memory_left_bytes": self.memory_left_bytes,
            "mode": self.mode.value,
            "device": {"torch_device": self.torch_device, **self.device.to_dict()},
            "tolerance": self.tolerance,
            "timing": self.timing.to_dict(),
            "num_threads": self.num_threads,
            "dataset_size": self.dataset_size,
            "epoch_s": self.epoch_s,
            "alignment": self.alignment.to_dict() if self.alignment else None,
            "elapsed_s": self.elapsed_s,
            "measure_s": self.measure_s,
            "note": self.note,
            "time_budget_s": self.time_budget_s,
            "memory_source": self.memory_source,
            "stability": self.stability.to_dict() if self.stability else None,
        }


def _find_point(batch_size: int, points: tuple[ThroughputPoint, ...],
                alignment: AlignmentResult | None) -> ThroughputPoint | None:
    """Prefer the alignment analysis's measurement: interleaved, so less exposed to drift."""
    for p in (alignment.points if alignment else ()) + points:
        if p.batch_size == batch_size and p.measured:
            return p
    return None
