"""The sweep's decisions, torch-free: the knee, the batch grid, the next batch to measure,
and whether alignment matters.

Pure functions over measured (batch size, samples/s) pairs, used by the measured sweep
(:mod:`batchfit.speed.bench`) and the roofline prediction
(:mod:`batchfit.speed.roofline`). The knee is the smallest measured batch whose
throughput is within ``tolerance`` (5% by default) of the best measured throughput
(:func:`find_knee`); the auto planner (:func:`next_auto_batch`) picks batches on a grid
of powers of two and their midpoints (:func:`batch_grid`); :func:`deciding_batches` are
the batches a knee rests on, measured again before acting on it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from batchfit.errors import InvalidInputError

#: A batch is "at the knee" when its throughput is within this fraction of the best.
DEFAULT_TOLERANCE = 0.05
#: At most this many batch sizes are measured by ``batches="auto"``.
DEFAULT_MAX_POINTS = 8
#: Alignment differences below this fraction (or twice the noise) count as no difference.
ALIGNMENT_THRESHOLD = 0.02


@dataclass(frozen=True)
class Knee:
    """The knee of a throughput curve (see :func:`find_knee`)."""

    knee_batch_size: int
    best_batch_size: int
    best_samples_per_s: float
    threshold_samples_per_s: float
    tolerance: float

    def to_dict(self) -> dict[str, Any]:
        return {"knee_batch_size": self.knee_batch_size, "best_batch_size": self.best_batch_size,
                "best_samples_per_s": self.best_samples_per_s,
                "threshold_samples_per_s": self.threshold_samples_per_s,
                "tolerance": self.tolerance}


@dataclass(frozen=True)
class AlignmentVerdict:
    """Whether alignment matters around a batch size, in numbers and in words."""

    base_batch_size: int
    best_batch_size: int
    recommended_batch_size: int
    matters: bool
    spread: float  #: (fastest / slowest) - 1 over the candidates, per sample
    gain: float  #: (best / base) - 1, per sample
    margin: float  #: the difference that counts: max(threshold, 2 x noise)
    text: str

    def to_dict(self) -> dict[str, Any]:
        return {"base_batch_size": self.base_batch_size, "best_batch_size": self.best_batch_size,
                "recommended_batch_size": self.recommended_batch_size, "matters": self.matters,
                "spread": self.spread, "gain": self.gain, "margin": self.margin, "text": self.text}



@dataclass(frozen=True)
class KneeStability:
    """Whether the knee stands out of the timing noise (see :func:`knee_stability`).

    Attributes:
        knee_batch_size: the knee of the measured rates.
        candidate_batch_sizes: the measured batches a rerun could find as the knee, given
            each one's throughput range; the knee is one of them.
        tied_with_best: the measured batches whose throughput range overlaps the best's
            (indistinguishable from the best).
        within_noise: more than one candidate: the choice among them is within noise.
        max_spread: the widest throughput range among the measured batches, as
            ``high / low - 1``.
        text: the same in words.
    """

    knee_batch_size: int
    candidate_batch_sizes: tuple[int, ...]
    tied_with_best: tuple[int, ...]
    within_noise: bool
    max_spread: float
    text: str

    def to_dict(self) -> dict[str, Any]:
        return {"knee_batch_size": self.knee_batch_size,
                "candidate_batch_sizes": list(self.candidate_batch_sizes),
                "tied_with_best": list(self.tied_with_best), "within_noise": self.within_noise,
                "max_spread": self.max_spread, "text": self.text}


def knee_stability(samples_per_s: Mapping[int, float], ranges: Mapping[int, tuple[float, float]],
                   tolerance: float = DEFAULT_TOLERANCE) -> KneeStability:
    """Which measured batches a rerun could find as the knee, given the timing spread.

    Each batch's throughput is known only within ``(low, high)`` samples/s (from its step
    times' spread). On a rerun the best throughput lies between ``max(low)`` and
    ``max(high)``, so the knee's threshold lies between ``(1 - tolerance)`` times each. A
    batch can be the knee when its ``high`` reaches the lowest threshold and every smaller
    batch's ``low`` stays under the highest (none of them is surely past it). One candidate:
    the knee stands out of the noise; several: the output says the difference is within
    noise. The knee (of ``samples_per_s``, each inside its range) is always a candidate.

    Args:
        samples_per_s: the throughput counted for each measured batch size.
        ranges: ``(low, high)`` samples/s by measured batch size, around ``samples_per_s``.
        tolerance: the knee's tolerance, as for :func:`find_knee`.

    Example:
        >>> rates = {8: 51.0, 16: 82.0, 32: 96.0, 64: 100.0}  # knee 32 (96 >= 95)
        >>> ranges = {8: (50, 52), 16: (80, 84), 32: (94, 98), 64: (99, 101)}
        >>> knee_stability(rates, ranges).candidate_batch_sizes  # 32 may fall under 95% of 64
        (32, 64)
        >>> knee_stability(rates, {**ranges, 32: (96, 97)}).candidate_batch_sizes
        (32,)
    """
    _check_tolerance(tolerance)
    if set(ranges) != set(samples_per_s):
        raise InvalidInputError("give a throughput range for each measured batch size")
    for b, (low, high) in ranges.items():
        if not 0 < low <= high:
            raise InvalidInputError(f"throughput range {(low, high)!r} at batch {b} must be "
                                    "positive and ordered (low, high)")
    knee = find_knee(list(samples_per_s), list(samples_per_s.values()), tolerance)
    sizes = sorted(ranges)
    lowest_threshold = (1 - tolerance) * max(low for low, _ in ranges.values())
    highest_threshold = (1 - tolerance) * max(high for _, high in ranges.values())
    candidates = []
    for i, b in enumerate(sizes):
        surely_past = any(ranges[c][0] >= highest_threshold for c in sizes[:i])
        if surely_past:
            break
        if ranges[b][1] >= lowest_threshold:
            candidates.append(b)
    best_low = ranges[knee.best_batch_size][0]
    tied = tuple(b for b in sizes if ranges[b][1] >= best_low)
    spread = max(high / low - 1 for low, high in ranges.values())
    if len(candidates) > 1:
        text = (f"The recommendation is within noise: batches {', '.join(map(str, candidates))} "
                f"are all within {tolerance:.0%} of the best throughput given the timing spread "
                f"(up to {spread:.1%}); a rerun may pick another of them.")
    else:
        text = (f"The knee {knee.knee_batch_size} stands out of the timing noise (spread up to "
                f"{spread:.1%}).")
    return KneeStability(knee.knee_batch_size, tuple(candidates), tied, len(candidates) > 1,
                         spread, text)


def _check_tolerance(tolerance: float) -> None:
    if not isinstance(tolerance, (int, float)) or not 0 <= tolerance < 1:
        raise InvalidInputError(f"tolerance {tolerance!r} must be a fraction in [0, 1), e.g. 0.05")


def find_knee(batch_sizes: Sequence[int], samples_per_s: Sequence[float],
              tolerance: float = DEFAULT_TOLERANCE) -> Knee:
    """The smallest batch whose throughput is within ``tolerance`` of the best.

    Args:
        batch_sizes: the batch sizes, any order, each once.
        samples_per_s: the throughput at each.
        tolerance: a fraction: 0.05 accepts 95% of the best throughput.

    Raises:
        InvalidInputError: no points, mismatched lengths, or a bad value.

    Example:
        >>> find_knee([1, 2, 4, 8, 16], [10, 18, 30, 38, 39]).knee_batch_size
        8
    """
    _check_tolerance(tolerance)
    if len(batch_sizes) != len(samples_per_s):
        raise InvalidInputError(
            f"{len(batch_sizes)} batch sizes but {len(samples_per_s)} throughputs: give one each")
    if not batch_sizes:
        raise InvalidInputError("no throughput points: measure at least one batch size")
    pairs = sorted(zip(batch_sizes, samples_per_s))
    for b, rate in pairs:
        if not isinstance(b, int) or b < 1:
            raise InvalidInputError(f"batch size {b!r} must be a positive integer")
        if not (isinstance(rate, (int, float)) and math.isfinite(rate) and rate > 0):
            raise InvalidInputError(f"throughput {rate!r} at batch {b} must be a positive number")
    if len({b for b, _ in pairs}) != len(pairs):
        raise InvalidInputError("a batch size appears twice: give each once")
    best_b, best = max(pairs, key=lambda p: (p[1], -p[0]))
    threshold = (1 - tolerance) * best
    knee = next(b for b, rate in pairs if rate >= threshold)
    return Knee(knee, best_b, float(best), float(threshold), float(tolerance))


def batch_grid(max_batch_size: int) -> tuple[int, ...]:
    """Every power of two and the midpoint after it, up to ``max_batch_size``, plus it.

    Example:
        >>> batch_grid(40)
        (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 40)
    """
    if not isinstance(max_batch_size, int) or max_batch_size < 1:
        raise InvalidInputError(f"max batch size must be a positive integer, not {max_batch_size!r}")
    values = {max_batch_size}
    power = 1
    while power <= max_batch_size:
        values.add(power)
        if power >= 2 and power + power // 2 <= max_batch_size:
            values.add(power + power // 2)
        power *= 2
    return tuple(sorted(values))


def _coarse_indices(length: int, max_points: int) -> list[int]:
    """Evenly spread grid indices: at least 4, as many as keep coarse + bisection points fewest.

    Bisecting a gap of ``g`` grid steps down to one step costs ``ceil(log2(g))`` points.
    """
    if length <= 4:
        return list(range(length))
    best: tuple[int, int] | None = None  # (total points, coarse points)
    for count in range(4, min(length, max_points) + 1):
        widest = math.ceil((length - 1) / (count - 1))
        total = count + math.ceil(math.log2(widest))
        if total <= max_points and (best is None or total <= best[0]):
            best = (total, count)
    count = best[1] if best is not None else max(2, min(max_points, length))
    return sorted({round(i * (length - 1) / (count - 1)) for i in range(count)})


def next_auto_batch(measured: Mapping[int, float], max_batch_size: int, *,
                    tolerance: float = DEFAULT_TOLERANCE,
                    max_points: int = DEFAULT_MAX_POINTS) -> int | None:
    """The next batch ``batches="auto"`` measures, or None when the knee is pinned down.

    Three stages, each a bisection in steps of :func:`batch_grid`:

    1. log-spaced grid points from 1 to ``max_batch_size``;
    2. the peak: while the best measured batch lies inside the range, the grid points
       between it and its measured neighbours (the larger gap first), since
       throughput can fall past a peak (caches, waves) and the knee is measured
       against the best;
    3. the knee: the grid points between it and the measured batch below it.

    Args:
        measured: samples/s by batch size, for the batches measured so far that fit.
        max_batch_size: the largest batch that may be run.

    Example:
        >>> rate = lambda b: b / (1 + b / 16)  # saturates at 16; 95% of rate(1024) from b = 230
        >>> seen = {}
        >>> while (b := next_auto_batch(seen, 1024)) is not None:
        ...     seen[b] = rate(b)
        >>> len(seen) <= 8, find_knee(list(seen), list(seen.values())).knee_batch_size
        (True, 256)
    """
    if len(measured) >= max_points:
        return None
    grid = batch_grid(max_batch_size)
    for index in _coarse_indices(len(grid), max_points):
        if grid[index] not in measured:
            return grid[index]
    usable = {b: r for b, r in measured.items() if b <= max_batch_size}
    knee = find_knee(list(usable), list(usable.values()), tolerance)
    best = knee.best_batch_size
    lower = max((b for b in usable if b < best), default=None)
    upper = min((b for b in usable if b > best), default=None)
    if upper is not None:  # an interior best: the peak may lie on either side of it
        sides = [_unmeasured(grid, measured, best, upper)]
        if lower is not None:
            sides.append(_unmeasured(grid, measured, lower, best))
        widest = max(sides, key=len)
        if widest:
            return widest[len(widest) // 2]
    below = max((b for b in usable if b < knee.knee_batch_size), default=None)
    if below is None:
        return None
    between = _unmeasured(grid, measured, below, knee.knee_batch_size)
    return between[len(between) // 2] if between else None


def _unmeasured(grid: Sequence[int], measured: Mapping[int, float], low: int,
                high: int) -> list[int]:
    return [b for b in grid if low < b < high and b not in measured]


def alignment_candidates(batch_size: int, max_batch_size: int) -> tuple[int, ...]:
    """``batch_size``, its neighbours B-1 and B+1, the nearest multiple of 8 and power of two.

    Ties go up; a candidate above ``max_batch_size`` is replaced by the one below.

    Example:
        >>> alignment_candidates(100, 1000), alignment_candidates(128, 128)
        ((99, 100, 101, 104, 128), (127, 128))
    """
    if not 1 <= batch_size <= max_batch_size:
        raise InvalidInputError(f"batch {batch_size} is outside 1..{max_batch_size}")

    def nearest(lower: int, upper: int) -> int:
        if lower < 1 or (upper <= max_batch_size and upper - batch_size <= batch_size - lower):
            return upper if upper <= max_batch_size else lower
        return lower

    lower8 = batch_size // 8 * 8
    eight = batch_size if lower8 == batch_size else nearest(lower8, lower8 + 8)
    power = 1 << (batch_size.bit_length() - 1)
    two = batch_size if power == batch_size else nearest(power, power * 2)
    found = {batch_size - 1, batch_size, batch_size + 1, eight, two}
    return tuple(sorted(b for b in found if 1 <= b <= max_batch_size))


def judge_alignment(base: int, samples_per_s: Mapping[int, float], noise: float = 0.0, *,
                    threshold: float = ALIGNMENT_THRESHOLD) -> AlignmentVerdict:
    """Does alignment matter around ``base``? Say it in numbers and in plain words.

    A difference counts when it exceeds ``max(threshold, 2 * noise)``. The
    recommendation moves from ``base`` to the fastest candidate only then.

    Example:
        >>> v = judge_alignment(127, {127: 90.0, 128: 100.0, 129: 91.0}, noise=0.01)
        >>> v.matters, v.recommended_batch_size, round(v.gain, 3)
        (True, 128, 0.111)
    """
    if base not in samples_per_s:
        raise InvalidInputError(f"the base batch {base} has no measurement")
    rates = dict(sorted(samples_per_s.items()))
    best = max(rates, key=lambda b: (rates[b], -abs(b - base)))
    worst = min(rates, key=lambda b: rates[b])
    spread = rates[best] / rates[worst] - 1
    gain = rates[best] / rates[base] - 1
    margin = max(threshold, 2 * noise)
    matters = spread > margin
    recommended = best if gain > margin else base
    names = ", ".join(str(b) for b in rates)
    if not matters:
        text = (f"Alignment does not matter here: batches {names} run within {spread:.1%} of each "
                f"other per sample, inside the margin of {margin:.1%}. Keep {base}.")
    elif recommended != base:
        text = (f"Alignment matters here: batch {best} runs {gain:.1%} more samples/s than {base} "
                f"({rates[best]:.4g} vs {rates[base]:.4g}); the candidates differ by up to "
                f"{spread:.1%}, above the margin of {margin:.1%}. Use {best}.")
    else:
        text = (f"Alignment matters here: batches {names} differ by up to {spread:.1%} per sample "
                f"(slowest: {worst}), and {base} is already the fastest within {margin:.1%}. "
                f"Keep {base}.")
    return AlignmentVerdict(base, best, recommended, matters, spread, gain, margin, text)


def epoch_seconds(dataset_size: int, batch_size: int, step_s: float) -> float:
    """Seconds per epoch: ``ceil(dataset_size / batch_size)`` steps of ``step_s``.

    Example:
        >>> epoch_seconds(1000, 64, 0.5)
        8.0
    """
    return math.ceil(dataset_size / batch_size) * step_s


def _peak_batches(samples_per_s: Mapping[int, float]) -> tuple[int, ...]:
    """The best batch and the measured batch above it, if the best is not the largest."""
    if not samples_per_s:
        return ()
    best = max(samples_per_s, key=lambda b: (samples_per_s[b], -b))
    above = [b for b in samples_per_s if b > best]
    return (best, min(above)) if above else ()


def deciding_batches(samples_per_s: Mapping[int, float],
                     tolerance: float = DEFAULT_TOLERANCE) -> tuple[int, ...]:
    """The batches a knee rests on: the knee, the largest measured batch below it, the best
    and, if throughput falls past the best, the measured batch above it.

    Example:
        >>> deciding_batches({8: 50.0, 16: 80.0, 32: 97.0, 64: 100.0})  # knee 32 (>= 95)
        (16, 32, 64)
        >>> deciding_batches({8: 50.0, 16: 80.0, 32: 100.0, 64: 70.0})  # a peak at 32
        (16, 32, 64)
    """
    knee = find_knee(list(samples_per_s), list(samples_per_s.values()), tolerance)
    below = [b for b in samples_per_s if b < knee.knee_batch_size]
    found = {knee.knee_batch_size, knee.best_batch_size, *_peak_batches(samples_per_s)}
    if below:
        found.add(max(below))
    return tuple(sorted(found))


