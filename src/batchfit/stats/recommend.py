"""The batch that reaches a target loss soonest: noise scale x throughput (no torch here).

McCandlish et al. 2018 ("An Empirical Model of Large-Batch Training", arXiv:1812.06162,
sections 2.2-2.3): with the learning rate tuned for each batch size, the optimizer steps
and the examples needed to reach a given loss trade off as

    S(B) = S_min (1 + B_noise / B)        E(B) = E_min (1 + B / B_noise)

so a batch well below ``B_noise`` wastes steps, and one well above it wastes examples
(at ``B = B_noise`` it needs twice the minimum). With ``step_time(B)`` measured by
:func:`batchfit.bench` (or predicted by :func:`batchfit.predict_throughput`), the time to
the target is proportional to

    T(B) = (1 + B_noise / B) * step_time(B)

(in units of ``S_min``, which this does not know: only ratios between batches are
claimed). :func:`recommend_batch_size` minimises ``T`` over batches that fit in memory, on the
batch grid of ``bench`` (powers of two and midpoints) plus the measured batches, with step
times interpolated linearly between measured batches and never extrapolated.

Learning rate for a move from batch ``B0`` to ``B1`` (each rule with its source):

* SGD (with or without momentum): the linear rule ``x B1/B0`` (Goyal et al. 2017,
  "Accurate, Large Minibatch SGD", arXiv:1706.02677, with their gradual warm-up); noise-aware:
  ``x (1 + B_noise/B0) / (1 + B_noise/B1)``, from the optimal step size
  ``eps_opt(B) = eps_max / (1 + B_noise/B)`` (McCandlish et al. 2018, section 2.2), the same
  ratio as AdaScale's gain (Johnson et al. 2020, ICML). The two agree while ``B1 << B_noise``;
  past it the linear rule overshoots.
* Adam-type (Adam, AdamW, RMSprop, Adagrad, Adafactor, LAMB): the square-root rule
  ``x sqrt(B1/B0)`` (Malladi et al. 2022, "On the SDEs and Scaling Rules for Adaptive
  Gradient Algorithms", NeurIPS); noise-aware: the square root of the ratio above, as
  Pollux scales Adam (Qiao et al. 2021, OSDI, "AdamScale" in AdaptDL).

What this is not: ``B_simple`` is a proxy for the critical batch. It takes the Hessian as a
multiple of the identity (the paper's ``B_noise = tr(HΣ)/GᵀHG`` weighs directions by
curvature), it grows as the loss falls (so the best batch grows during training: measure
again later), and for Adam-type optimizers the critical batch can be larger than
``B_simple`` (preconditioning; Zhang et al. 2019, NeurIPS, "Which Algorithmic Choices
Matter at Which Batch Sizes?"). The step count model assumes the learning rate is re-tuned
(or scaled as above) for each batch size.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from batchfit.engine.spec import parse_enum
from batchfit.errors import InvalidInputError

#: What every recommendation says about itself.
PROXY_CAVEAT = (
    "B_simple is a proxy for the critical batch: it assumes a Hessian proportional to the "
    "identity, it grows as the loss falls (the best batch grows during training: measure "
    "again later), and for Adam-type optimizers the critical batch can be larger than "
    "B_simple suggests. Steps-to-target assumes the learning rate is re-tuned (or scaled as "
    "shown) for each batch.")

_CITATIONS = {
    "linear": "Goyal et al. 2017, Accurate, Large Minibatch SGD (arXiv:1706.02677)",
    "sqrt": "Malladi et al. 2022, On the SDEs and Scaling Rules for Adaptive Gradient "
            "Algorithms (NeurIPS)",
    "noise-sgd": "McCandlish et al. 2018, sec. 2.2: eps_opt(B) = eps_max / (1 + B_noise/B) "
                 "(= AdaScale's gain, Johnson et al. 2020)",
    "noise-adam": "the square root of the noise-aware SGD ratio, as Pollux scales Adam "
                  "(Qiao et al. 2021, OSDI)",
}

_ADAPTIVE = {"adam", "adamw", "rmsprop", "adagrad", "adafactor", "lamb", "adamax", "nadam",
             "radam", "lion", "adam-type"}
_SGD = {"sgd", "momentum", "nesterov"}


class OptimizerFamily(StrEnum):
    """Which learning-rate rule applies."""

    SGD = "sgd"
    ADAM = "adam"  #: Adam-type (adaptive) optimizers

    @classmethod
    def of(cls, optimizer: Any) -> OptimizerFamily:
        """The family of an optimizer name (``"adamw"``), class or instance."""
        if isinstance(optimizer, OptimizerFamily):
            return optimizer
        name = optimizer if isinstance(optimizer, str) else (
            optimizer.__name__ if isinstance(optimizer, type) else type(optimizer).__name__)
        key = name.strip().lower().replace("_", "-")
        if key in _SGD:
            return cls.SGD
        if key in _ADAPTIVE or key.startswith("adam"):
            return cls.ADAM
        raise InvalidInputError(
            f"unknown optimizer {name!r} for the learning-rate rule: say sgd (SGD, momentum, "
            "Nesterov) or adam (Adam, AdamW, RMSprop, Adagrad, Adafactor, LAMB)")


@dataclass(frozen=True)
class CurvePoint:
    """A step time at one batch size (measured or predicted)."""

    batch_size: int
    step_s: float
    peak_bytes: int | None = None


@dataclass(frozen=True)
class BatchOption:
    """One candidate batch in the recommendation table.

    Attributes:
        steps_factor: ``S/S_min = 1 + B_noise/B``.
        samples_factor: ``E/E_min = 1 + B/B_noise``.
        time_factor: ``T(B) = steps_factor * step_s`` (seconds per ``S_min`` step).
        relative_time: ``T(B) / min T``.
        measured: the step time was measured (or predicted) at this batch, not interpolated.
    """

    batch_size: int
    step_s: float
    samples_per_s: float
    steps_factor: float
    samples_factor: float
    time_factor: float
    relative_time: float
    peak_bytes: int | None
    measured: bool

    def to_dict(self) -> dict[str, Any]:
        return {"batch_size": self.batch_size, "step_s": self.step_s,
                "samples_per_s": self.samples_per_s, "steps_factor": self.steps_factor,
                "samples_factor": self.samples_factor, "time_factor": self.time_factor,
                "relative_time": self.relative_time, "peak_bytes": self.peak_bytes,
                "measured": self.measured}


@dataclass(frozen=True)
class LearningRateChange:
    """The learning-rate multiplier for moving from one batch size to another."""

    from_batch_size: int
    to_batch_size: int
    family: OptimizerFamily
    rule: str  #: "linear" or "sqrt"
    factor: float
    citation: str
    noise_aware_factor: float
    noise_aware_citation: str

    @property
    def text(self) -> str:
        if self.from_batch_size == self.to_batch_size:
            return f"batch {self.from_batch_size} stays: keep the learning rate"
        return (f"batch {self.from_batch_size} -> {self.to_batch_size}: multiply the learning "
                f"rate by {self.noise_aware_factor:.3g} (noise-aware; the {self.rule} rule says "
                f"{self.factor:.3g})")

    def to_dict(self) -> dict[str, Any]:
        return {"from_batch_size": self.from_batch_size, "to_batch_size": self.to_batch_size,
                "family": self.family.value, "rule": self.rule, "factor": self.factor,
                "citation": self.citation, "noise_aware_factor": self.noise_aware_factor,
                "noise_aware_citation": self.noise_aware_citation, "text": self.text}


def learning_rate_change(from_batch_size: int, to_batch_size: int, b_noise: float,
                         optimizer: Any = "sgd") -> LearningRateChange:
    """The learning-rate multiplier from ``from_batch_size`` to ``to_batch_size``.

    Example:
        >>> change = learning_rate_change(32, 128, b_noise=64.0, optimizer="sgd")
        >>> change.factor, change.noise_aware_factor  # 128/32; (1 + 64/32) / (1 + 64/128)
        (4.0, 2.0)
        >>> round(learning_rate_change(32, 128, 64.0, "adamw").noise_aware_factor, 4)
        1.4142
    """
    family = OptimizerFamily.of(optimizer)
    ratio = to_batch_size / from_batch_size
    noise_ratio = ((1 + b_noise / from_batch_size) / (1 + b_noise / to_batch_size)
                   if math.isfinite(b_noise) else ratio)
    if family is OptimizerFamily.SGD:
        return LearningRateChange(from_batch_size, to_batch_size, family, "linear", ratio,
                                  _CITATIONS["linear"], noise_ratio, _CITATIONS["noise-sgd"])
    return LearningRateChange(from_batch_size, to_batch_size, family, "sqrt", math.sqrt(ratio),
                              _CITATIONS["sqrt"], math.sqrt(noise_ratio), _CITATIONS["noise-adam"])


@dataclass(frozen=True)
class Recommendation:
    """The batch size that minimises time to a target loss, and what it rests on.

    Attributes:
        recommended_batch_size: argmin of ``T(B)`` among the options that fit.
        range_batch_sizes: the argmins at the two ends of the noise scale's interval
            (the recommendation's own uncertainty).
        b_noise: the noise scale used (``B_simple``), with ``b_noise_ci``.
        samples_2x_batch_size: the batch where the samples overhead reaches 2x
            (``B = B_noise``, rounded), and ``samples_2x_fits`` whether it fits.
        max_batch_size: the memory limit (largest batch that fits).
        current_batch_size, speedup_vs_current: ``T(current)/T(recommended)``
            (None when the current batch is outside the curve).
        options: the table, ascending.
        learning_rate: the change from the current batch to the recommended one.
        caveat: what the estimate is and is not (always present).
    """

    recommended_batch_size: int
    range_batch_sizes: tuple[int, int]
    b_noise: float
    b_noise_ci: tuple[float, float]
    samples_2x_batch_size: int | None
    samples_2x_fits: bool
    max_batch_size: int
    current_batch_size: int
    speedup_vs_current: float | None
    options: tuple[BatchOption, ...]
    learning_rate: LearningRateChange
    caveat: str = PROXY_CAVEAT

    def option(self, batch_size: int) -> BatchOption | None:
        return next((o for o in self.options if o.batch_size == batch_size), None)

    def to_dict(self) -> dict[str, Any]:
        finite = lambda v: v if v is not None and math.isfinite(v) else None
        return {
            "recommended_batch_size": self.recommended_batch_size,
            "range_batch_sizes": list(self.range_batch_sizes),
            "b_noise": finite(self.b_noise),
            "b_noise_ci": [finite(v) for v in self.b_noise_ci],
            "samples_2x_batch_size": self.samples_2x_batch_size,
            "samples_2x_fits": self.samples_2x_fits,
            "max_batch_size": self.max_batch_size,
            "current_batch_size": self.current_batch_size,
            "speedup_vs_current": self.speedup_vs_current,
            "options": [o.to_dict() for o in self.options],
            "learning_rate": self.learning_rate.to_dict(),
            "caveat": self.caveat,
        }


def curve_points(result: Any) -> tuple[list[CurvePoint], int]:
    """The fitting points and the memory limit of a :class:`~batchfit.speed.bench.BenchResult`
    or a :class:`~batchfit.speed.roofline.ThroughputPrediction` (duck-typed)."""
    points = [CurvePoint(p.batch_size, p.step_s, p.peak_bytes) for p in result.points
              if getattr(p, "fits", True) and p.step_s]
    failed = [p.batch_size for p in result.points if not getattr(p, "fits", True)]
    limit = min([result.max_batch_size] + [b - 1 for b in failed])
    return points, limit


def _interpolate(points: Sequence[CurvePoint], batch_size: int) -> tuple[float, int | None, bool]:
    """Step time and peak at ``batch_size``, linear between the neighbouring points."""
    for p in points:
        if p.batch_size == batch_size:
            return p.step_s, p.peak_bytes, True
    upper = next(i for i, p in enumerate(points) if p.batch_size > batch_size)
    lo, hi = points[upper - 1], points[upper]
    w = (batch_size - lo.batch_size) / (hi.batch_size - lo.batch_size)
    peak = (round(lo.peak_bytes + w * (hi.peak_bytes - lo.peak_bytes))
            if lo.peak_bytes is not None and hi.peak_bytes is not None else None)
    return lo.step_s + w * (hi.step_s - lo.step_s), peak, False


def _grid(low: int, high: int) -> set[int]:
    from batchfit.speed.knee import batch_grid

    return {b for b in batch_grid(high) if b >= low}


def _argmin_time(points: Sequence[CurvePoint], candidates: Sequence[int], b_noise: float) -> int:
    def time_factor(b: int) -> float:
        return (1 + b_noise / b) * _interpolate(points, b)[0]

    return min(candidates, key=lambda b: (time_factor(b), b))


def _check_points(points: Sequence[CurvePoint], max_batch_size: int) -> list[CurvePoint]:
    usable = sorted({p.batch_size: p for p in points
                     if p.batch_size <= max_batch_size and p.step_s > 0}.values(),
                    key=lambda p: p.batch_size)
    if not usable:
        raise InvalidInputError(
            "no throughput point at a batch that fits: measure (bench) or predict the step time "
            "at one or more batch sizes up to the memory limit")
    return usable


def recommend_batch_size(b_noise: Any, points: Sequence[CurvePoint | tuple[int, float]], *,
              max_batch_size: int, current_batch_size: int, optimizer: Any = "sgd",
              b_noise_ci: tuple[float, float] | None = None) -> Recommendation:
    """Combine a noise scale with a step-time curve: the batch that reaches a loss soonest.

    Args:
        b_noise: ``B_simple`` (a number or a :class:`~batchfit.stats.estimator.NoiseScale`,
            whose interval is then used for ``b_noise_ci``).
        points: step times (``CurvePoint`` or ``(batch_size, step_s)``), measured or
            predicted; batches above ``max_batch_size`` are ignored.
        max_batch_size: the memory limit.
        current_batch_size: the batch you train with now (for the speed-up and the
            learning-rate change).
        optimizer: ``"sgd"`` or ``"adam"`` (or an optimizer name, class or instance).
        b_noise_ci: the noise scale's interval, for ``range_batch_sizes``.

    Example:
        >>> pts = [(8, 0.010), (16, 0.012), (32, 0.016), (64, 0.024), (128, 0.040)]
        >>> r = recommend_batch_size(32.0, pts, max_batch_size=128, current_batch_size=8)
        >>> r.recommended_batch_size  # T = (1 + 32/B) step(B): 0.050 at 8, 0.0327 at 24, 0.032
        32
        >>> round(r.speedup_vs_current, 4), r.samples_2x_batch_size  # 0.050 / 0.032
        (1.5625, 32)
    """
    if hasattr(b_noise, "b_simple"):
        if b_noise_ci is None:
            b_noise_ci = (b_noise.ci_low, b_noise.ci_high)
        b_noise = b_noise.b_simple
    b_noise = float(b_noise)
    if not (b_noise > 0):
        raise InvalidInputError(f"the noise scale must be positive, not {b_noise!r}")
    for name, value in (("max_batch_size", max_batch_size),
                        ("current_batch_size", current_batch_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidInputError(f"{name} must be a positive integer, not {value!r}")
    usable = _check_points([p if isinstance(p, CurvePoint) else CurvePoint(int(p[0]), float(p[1]))
                            for p in points], max_batch_size)
    low, high = usable[0].batch_size, usable[-1].batch_size
    candidates = sorted(_grid(low, high) | {p.batch_size for p in usable})
    best = _argmin_time(usable, candidates, b_noise)
    ci = b_noise_ci if b_noise_ci is not None else (b_noise, b_noise)
    ends = [_argmin_time(usable, candidates, v) if v > 0 else low for v in ci]
    ends = [high if not math.isfinite(v) else e for v, e in zip(ci, ends)]
    options = []
    for b in candidates:
        step_s, peak, measured = _interpolate(usable, b)
        options.append((b, step_s, peak, measured, (1 + b_noise / b) * step_s))
    best_time = min(o[4] for o in options)
    table = tuple(BatchOption(b, step_s, b / step_s, 1 + b_noise / b, 1 + b / b_noise, t,
                              t / best_time, peak, measured)
                  for b, step_s, peak, measured, t in options)
    speedup = None
    if low <= current_batch_size <= high:
        current_t = (1 + b_noise / current_batch_size) * _interpolate(usable, current_batch_size)[0]
        speedup = current_t / best_time
    two_x = round(b_noise) if math.isfinite(b_noise) else None
    return Recommendation(
        recommended_batch_size=best, range_batch_sizes=(min(ends), max(ends)),
        b_noise=b_noise, b_noise_ci=(float(ci[0]), float(ci[1])),
        samples_2x_batch_size=two_x,
        samples_2x_fits=two_x is not None and two_x <= max_batch_size,
        max_batch_size=max_batch_size, current_batch_size=current_batch_size,
        speedup_vs_current=speedup, options=table,
        learning_rate=learning_rate_change(current_batch_size, best, b_noise, optimizer))


def parse_family(value: Any) -> OptimizerFamily:
    """An :class:`OptimizerFamily` from a CLI string (``sgd``, ``adam`` or an optimizer name)."""
    try:
        return parse_enum(OptimizerFamily, value, "optimizer family")
    except InvalidInputError:
        return OptimizerFamily.of(value)
