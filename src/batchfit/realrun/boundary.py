"""The boundary search's decisions, torch-free: which batch size to try next.

A search is a list of :class:`Outcome` (batch size, fits, measured usage), and one loop
(:func:`search_boundary`) asks a few small strategy functions, in order, for the next
batch size:

1. ``_verify_step``: a failure in a process that had already failed once (in-process
   trials, where freed memory can stay fragmented) is re-run at once in a clean state;
   that run replaces it. So every failure the search acts on is a clean one.
2. ``_seed_step``: the first trial, which must fit and measure the usage the prediction
   cannot see. On the CPU, when the prediction is the line through its traces at batch
   16 and 32 (:mod:`batchfit.realrun.search`), at batch 16: the trace there is exact for live tensors, so the
   trial measures only what is missing (the runtime's overhead, 5-30 MiB, nearly
   independent of the batch), and it costs a fraction of a trial at the boundary.
   Otherwise *below* the prediction by ``approach`` of the limit in bytes
   (``approach * limit / bytes_per_sample`` samples), so that it most likely fits. The
   CPU default, 25%, covers the process memory the prediction does not see (malloc's
   caching, oneDNN's primitive caches; ``benchmarks/max_vs_true_cpu.py``); CUDA's, 5%, a
   prediction that models the caching allocator.
3. ``_schedule_step``: a bisection when the bracket has not halved in two trials, so a
   misleading model still converges in O(log range) trials.
4. ``_model_step``: the affine usage model. Each fitting trial measures ``used_bytes``,
   the peak of what the limit applies to; with the per-sample slope (measured between
   two fitting trials, else the prediction's) the model solves for the largest batch
   within the limit, and proposes it (clipped into the open bracket). When k model
   steps in a row moved the same end of the bracket, the next candidate is pushed
   2**(k-1) - 1 further (galloping), so a biased model still converges.
5. ``_gallop_step``: no model (no usage measured): double from the largest fit, halve
   from the smallest failure.
6. ``_bisect_step``: both ends known, no model.

With a prediction whose error the seed's margin covers, a search takes three trials
(the seed below the boundary, the model's answer, and the answer + 1, the only one
that fails); two when the seed is already the answer.

Recommended batch size: the allocator's own overhead at the maximum (CUDA: reserved
minus allocated; CPU: the data segment's growth minus the live tensors' growth) is
the part of the memory that varies from run to run (allocation order, input shapes,
kernel choice). The recommendation keeps that much free again, and never less than
``min_headroom`` (5%) of the limit: the largest batch whose modelled usage is within
``limit - max(overhead, min_headroom * limit)``. Without a measured limit it is
``floor(max * (1 - min_headroom))``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from fractions import Fraction

from batchfit.errors import InvalidInputError

#: The largest batch a search will try (tiny models fit absurd batches).
DEFAULT_MAX_BATCH_LIMIT = 1 << 16


@dataclass(frozen=True)
class Outcome:
    """One trial as the search sees it.

    Attributes:
        batch_size: the batch size tried.
        fits: it ran.
        used_bytes: the measured peak of what the limit applies to (fitting trials).
    """

    batch_size: int
    fits: bool
    used_bytes: int | None = None


@dataclass(frozen=True)
class SearchPlan:
    """What the search knows before the first trial.

    Attributes:
        predicted: the analytic prediction of the largest batch (>= 1).
        limit_bytes: the limit ``used_bytes`` is compared with (None: no usage model).
        bytes_per_sample: the prediction's per-sample growth near the boundary.
        max_batch_size: never try beyond this.
        isolated: each trial runs in a fresh process, so every failure is the truth.
        approach: the seed's margin below the prediction: ``approach * limit_bytes`` worth
            of samples when both the limit and the slope are known, else the fraction
            ``approach`` of the prediction.
        slope_margin: inflate the predicted slope by this fraction, so the model
            approaches from below (for in-process trials, where failures are costly).
        seed: the first trial's batch size, when the prediction knows a better one than
            ``approach`` gives (the CPU's: the first batch its usage line was traced at).
    """

    predicted: int
    limit_bytes: int | None = None
    bytes_per_sample: float | None = None
    max_batch_size: int = DEFAULT_MAX_BATCH_LIMIT
    isolated: bool = True
    approach: float = 0.1
    slope_margin: float = 0.0
    seed: int | None = None


@dataclass
class SearchLog:
    """The outcomes so far and what they imply."""

    plan: SearchPlan
    outcomes: list[Outcome] = field(default_factory=list)
    trusted: set[int] = field(default_factory=set)  # batch sizes whose failure is settled
    widths: list[float] = field(default_factory=list)  # bracket width after each trial
    moves: list[str] = field(default_factory=list)  # "lower" or "upper", per trial
    strategies: list[str] = field(default_factory=list)  # which strategy chose each trial

    @property
    def lower(self) -> int:
        """The largest batch size that fitted (0 if none)."""
        return max((o.batch_size for o in self.outcomes if o.fits), default=0)

    @property
    def upper(self) -> int | None:
        """The smallest batch size above ``lower`` that failed (None if none)."""
        lower = self.lower
        return min((o.batch_size for o in self.outcomes if not o.fits and o.batch_size > lower),
                   default=None)

    @property
    def failures(self) -> int:
        return sum(not o.fits for o in self.outcomes)

    @property
    def finished(self) -> bool:
        upper = self.upper
        if self.lower >= self.plan.max_batch_size:
            return True
        return upper == self.lower + 1 and upper in self.trusted

    def record(self, outcome: Outcome, *, verification: bool = False,
               strategy: str = "") -> None:
        earlier_failure = self.failures > 0
        self.outcomes.append(outcome)
        if not outcome.fits and (self.plan.isolated or verification or not earlier_failure):
            self.trusted.add(outcome.batch_size)
        if outcome.fits:  # a fit above a trusted failure overrules it (flaky device)
            self.trusted -= {b for b in self.trusted if b <= outcome.batch_size}
        self.moves.append("lower" if outcome.fits else "upper")
        self.strategies.append(strategy)
        upper = self.upper
        self.widths.append(math.inf if upper is None else upper - self.lower)

    def model_streak(self) -> int:
        """How many model steps in a row, the latest trials, moved the same end."""
        count = 0
        for move, strategy in zip(reversed(self.moves), reversed(self.strategies)):
            if move != self.moves[-1] or strategy != "model":
                break
            count += 1
        return count


Strategy = Callable[[SearchLog], "int | None"]


def _verify_step(log: SearchLog) -> int | None:
    """Re-run, in a clean state, a failure that followed another failure in one process."""
    last = log.outcomes[-1] if log.outcomes else None
    if last is not None and not last.fits and last.batch_size not in log.trusted:
        return last.batch_size
    return None


def _seed_step(log: SearchLog) -> int | None:
    if log.outcomes:
        return None
    plan = log.plan
    if plan.seed is not None:
        return _clamp(plan.seed, 1, plan.max_batch_size)
    if plan.limit_bytes and plan.bytes_per_sample:
        seed = plan.predicted - math.ceil(plan.approach * plan.limit_bytes
                                          / plan.bytes_per_sample)
    else:
        seed = math.floor(plan.predicted * (1 - plan.approach))
    return _clamp(seed, 1, plan.max_batch_size)


def _schedule_step(log: SearchLog) -> int | None:
    """Bisect when the closed bracket has not halved over the last two trials."""
    upper = log.upper
    if upper is None or log.lower == 0 or len(log.widths) < 3:
        return None
    if math.isinf(log.widths[-3]) or log.widths[-1] <= log.widths[-3] / 2:
        return None
    return (log.lower + upper) // 2


def _slope(log: SearchLog) -> Fraction | None:
    """Bytes per sample: measured between the two farthest fitting trials, else predicted.
    Exact arithmetic, so an exactly affine usage lands exactly on its boundary."""
    measured = sorted((o.batch_size, o.used_bytes) for o in log.outcomes
                      if o.fits and o.used_bytes is not None)
    if len(measured) >= 2:
        (b0, u0), (b1, u1) = measured[0], measured[-1]
        if b1 - b0 >= 2 and u1 > u0:
            return Fraction(u1 - u0, b1 - b0)
    plan = log.plan
    if plan.bytes_per_sample and plan.bytes_per_sample > 0:
        return Fraction(plan.bytes_per_sample) * (1 + Fraction(plan.slope_margin))
    return None


def model_batch(log: SearchLog) -> Fraction | None:
    """The batch size at which the affine usage model reaches the limit (fractional)."""
    limit = log.plan.limit_bytes
    anchors = [o for o in log.outcomes if o.fits and o.used_bytes is not None]
    slope = _slope(log)
    if limit is None or not anchors or slope is None:
        return None
    anchor = max(anchors, key=lambda o: o.batch_size)
    return anchor.batch_size + (limit - anchor.used_bytes) / slope


def _model_step(log: SearchLog) -> int | None:
    solved = model_batch(log)
    if solved is None:
        return None
    candidate = math.floor(solved)
    push = 2 ** log.model_streak() // 2 - 1 if log.model_streak() else 0  # 0, 0, 1, 3, 7...
    candidate += push if log.moves[-1] == "lower" else -push
    return _inside(log, candidate)


def _gallop_step(log: SearchLog) -> int | None:
    upper, lower = log.upper, log.lower
    if upper is None:
        return _clamp(max(2 * lower, lower + 1), 1, log.plan.max_batch_size)
    if lower == 0:
        return max(1, upper // 2)
    return None


def _bisect_step(log: SearchLog) -> int:
    upper = log.upper
    return (log.lower + upper) // 2 if upper is not None else log.lower + 1


#: The order in which strategies are asked; the first that answers wins.
STRATEGIES: tuple[Strategy, ...] = (_verify_step, _seed_step, _schedule_step, _model_step,
                                     _gallop_step, _bisect_step)


def _clamp(value: int, low: int, high: int) -> int:
    return max(low, min(high, value))


def _inside(log: SearchLog, candidate: int) -> int:
    """``candidate`` moved into the open bracket (lower, upper), within the plan's limit."""
    upper = log.upper
    high = (upper - 1) if upper is not None else log.plan.max_batch_size
    return _clamp(candidate, log.lower + 1, max(log.lower + 1, high))


def next_step(log: SearchLog) -> tuple[int, str] | None:
    """The next batch size to try and the strategy's name, or None when settled."""
    if log.finished or (log.upper == 1 and 1 in log.trusted):
        return None
    for strategy in STRATEGIES:
        candidate = strategy(log)
        if candidate is not None:
            return candidate, strategy.__name__.strip("_").removesuffix("_step")
    raise AssertionError("the bisection step always answers")  # pragma: no cover


def search_boundary(evaluate: Callable[[int], Outcome], plan: SearchPlan, *,
                    verify: Callable[[int], Outcome] | None = None,
                    max_trials: int = 64) -> SearchLog:
    """Run the search loop with ``evaluate(batch_size) -> Outcome`` as the device.

    ``verify`` re-runs a suspect failure in a clean state (a fresh process, or after the
    allocator gave everything back); by default ``evaluate`` does. Returns the log;
    ``log.lower`` is the answer (0: nothing fits).

    Example:
        >>> log = search_boundary(lambda b: Outcome(b, b <= 500, 1000 + 10 * b),
        ...                       SearchPlan(predicted=520, limit_bytes=6000, bytes_per_sample=10))
        >>> log.lower, [o.batch_size for o in log.outcomes]
        (500, [460, 500, 501])
    """
    if plan.predicted < 1 or plan.max_batch_size < 1:
        raise InvalidInputError("the prediction and the batch limit must be at least 1")
    if not 0 <= plan.approach < 1:
        raise InvalidInputError(f"approach {plan.approach} must be a fraction in [0, 1)")
    log = SearchLog(plan)
    while (step := next_step(log)) is not None:
        batch, strategy = step
        if len(log.outcomes) >= max_trials:
            raise RuntimeError(f"no boundary after {max_trials} trials: the device is too "
                               "flaky to give a largest batch")
        verification = strategy == "verify"
        run = verify if verification and verify is not None else evaluate
        log.record(run(batch), verification=verification, strategy=strategy)
    return log


def recommended_batch(log: SearchLog, overhead_bytes: int | None, min_headroom: float) -> int:
    """The largest batch leaving ``max(overhead, min_headroom * limit)`` of the limit free
    (see the module docstring); never above the maximum, never below 1."""
    answer = log.lower
    limit = log.plan.limit_bytes
    at_max = next((o for o in log.outcomes if o.fits and o.batch_size == answer), None)
    slope = _slope(log)
    if answer < 1:
        return 0
    if limit is None or at_max is None or at_max.used_bytes is None or not slope:
        return max(1, math.floor(answer * (1 - min_headroom)))
    headroom = max(overhead_bytes or 0, min_headroom * limit)
    excess = at_max.used_bytes - (limit - headroom)
    if excess <= 0:
        return answer
    return max(1, answer - math.ceil(excess / slope))


