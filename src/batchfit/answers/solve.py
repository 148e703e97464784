"""Solve for the largest batch size (or sequence length) whose peak fits a budget.

The input is ``peak(x)``: the device bytes one step needs at batch size (or
sequence length) ``x``. Each call is a trace (about 1 s), so the solver calls
it as few times as it can and never twice for the same ``x``.

How it searches (one loop, one small function per strategy):

1. ``peak(smallest)``; over the budget means :class:`NothingFits`.
2. Probes at moderate sizes (default batch 16 and 32: per-sample tensors already
   dominate there, so a line through them extrapolates far better than one through
   B=1 and 2; the docs' accuracy notes give the measurement).
3. Model steps: fit a max of polynomial pieces (a flat piece at
   ``peak(smallest)`` and a line, or for sequence length a quadratic, through
   the evaluated points nearest the budget: the two ends of the bracket once a
   size over budget is known, else the largest size that fits and points well
   below it) and solve it for the budget. The model says "g fits, g+1 does
   not": evaluate g, then g+1, then stop. An exactly affine peak takes five
   calls: smallest, two probes, g, g+1.
4. Guards, so that a wrong model (allocator steps, non-affine pieces) still
   converges in O(log range) calls: when the same end of the bracket moves k
   times in a row the model's candidate is pushed 2**(k-1) - 1 further towards
   the other end (galloping), and when the search falls behind a schedule of
   one halving of the bracket (or doubling of the fitting size, before any
   size over budget is known) per call plus a few calls of slack, it takes a
   bisection (or doubling) step instead of the model's.
5. Confirmation: the answer ``x`` has been evaluated with ``peak(x) <= budget``
   and so has ``x + 1`` with ``peak(x + 1) > budget``, unless ``x`` is the cap.

Assumptions and known limitations:
    - ``peak`` is taken to be monotone non-decreasing. Allocator rounding makes
      it a staircase, which is fine. If it is not monotone, the answer is still
      a *local* boundary, ``peak(x) <= budget < peak(x + 1)``, and it lies below
      the smallest evaluated size that did not fit: a larger size that fits may
      exist above it. ``monotone`` in the result is False when the evaluated
      points showed a decrease.
    - Calls: an exactly affine peak takes at most 5. When the model is useless
      (a pure staircase), each phase costs at most its bisection count plus
      ``_SLACK_STEPS`` and a few, about ``2 * log2(range) + 15`` calls in all.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from fractions import Fraction
from typing import Any

from batchfit.errors import DoesNotFitError, InvalidInputError

PeakFn = Callable[[int], int]
"""Batch size (or sequence length) -> peak device bytes. Expensive: one trace."""

Piece = tuple[float, ...]
"""Polynomial coefficients in bytes, lowest order first: (intercept, slope, ...)."""

_Poly = tuple[Fraction, ...]   # a Piece in exact arithmetic, for fitting

_SLACK_STEPS = 3
"""Calls the model may spend beyond one halving per call before bisection takes over."""


class NothingFits(DoesNotFitError):
    """Even the smallest batch size (or sequence length) needs more than the budget.

    Attributes:
        needed_bytes: peak at the smallest size.
        budget_bytes: the budget (also ``available_bytes``, as in the base class).
        smallest: the smallest size that was tried.
    """

    def __init__(self, needed_bytes: int, budget_bytes: int, *, smallest: int = 1,
                 axis: str = "batch size"):
        super().__init__(
            f"{axis} {smallest} already needs {format_size(needed_bytes)}, over the budget "
            f"of {format_size(budget_bytes)}: use a larger device, lower precision, "
            "activation checkpointing or a smaller model",
            needed_bytes, budget_bytes)
        self.budget_bytes = budget_bytes
        self.smallest = smallest
        self.axis = axis

    def to_dict(self) -> dict[str, object]:
        """The base verdict, with the answer (0: none fits) under the axis's own key and
        the budget as ``budget_bytes`` (the step alone, as in the answers' JSON)."""
        answer = "max_seq_len" if self.axis == "sequence length" else "max_batch_size"
        return {**super().to_dict(), answer: 0, "budget_bytes": self.budget_bytes,
                "smallest": self.smallest}


@dataclass(frozen=True)
class SolveResult:
    """The largest batch size whose peak fits the budget, and the evidence for it.

    Attributes:
        max_batch_size: largest batch size B with peak(B) <= budget.
        bytes_at_max: peak(max_batch_size), evaluated.
        bytes_at_next: peak(max_batch_size + 1), evaluated; None when capped.
        evaluations: how many times peak() was called (each batch size once).
        evaluated: (batch_size, bytes) in call order.
        capped: True when the answer is ``max_batch_limit`` (it may fit more).
        pieces: the model behind the first guess, as (intercept_bytes,
            bytes_per_sample) pieces whose max is the predicted peak; empty when
            the probes alone settled the answer.
        monotone: False when the evaluated peaks decreased somewhere; the
            answer is then a local boundary (see the module docstring).
    """

    max_batch_size: int
    bytes_at_max: int
    bytes_at_next: int | None
    evaluations: int
    evaluated: tuple[tuple[int, int], ...]
    capped: bool
    pieces: tuple[Piece, ...]
    monotone: bool = True

    def to_dict(self) -> dict[str, Any]:
        return _result_dict(self)


@dataclass(frozen=True)
class SeqLenResult:
    """The longest sequence length whose peak fits the budget, and the evidence for it.

    Attributes:
        max_seq_len: longest length L (a multiple of ``multiple_of``) with peak(L) <= budget.
        bytes_at_max: peak(max_seq_len), evaluated.
        bytes_at_next: peak(max_seq_len + multiple_of), evaluated; None when capped.
        evaluations: how many times peak() was called (each length once).
        evaluated: (seq_len, bytes) in call order.
        capped: True when the answer is the largest allowed length.
        pieces: the model behind the first guess, as (bytes, bytes per token,
            bytes per token squared) pieces whose max is the predicted peak.
        monotone: as in :class:`SolveResult`.
    """

    max_seq_len: int
    bytes_at_max: int
    bytes_at_next: int | None
    evaluations: int
    evaluated: tuple[tuple[int, int], ...]
    capped: bool
    pieces: tuple[Piece, ...]
    monotone: bool = True

    def to_dict(self) -> dict[str, Any]:
        return _result_dict(self)


def solve_max_batch(peak: PeakFn, budget_bytes: int, *, max_batch_limit: int = 1 << 20,
                    probe_batches: Sequence[int] = (16, 32), min_batch: int = 1) -> SolveResult:
    """Find the largest batch size whose peak fits ``budget_bytes``, with few calls to ``peak``.

    Args:
        peak: batch size -> peak device bytes (one trace per call).
        budget_bytes: device bytes available to the step.
        max_batch_limit: never try beyond this; the answer is capped here.
        probe_batches: moderate batch sizes evaluated first to fit the model;
            sizes outside (min_batch, max_batch_limit] are skipped.
        min_batch: smallest batch size considered.

    Returns:
        The largest fitting batch size, with peak evaluated there and at the next size.

    Raises:
        NothingFits: ``peak(min_batch) > budget_bytes``.
        InvalidInputError: a bad budget, limit or probe, or ``peak`` returned a
            negative or non-integer value.

    Example:
        >>> mib = 2**20
        >>> result = solve_max_batch(lambda b: 500 * mib + 80 * mib * b, 16 * 1024 * mib)
        >>> result.max_batch_size, result.evaluations   # (16384 - 500) / 80 = 198.55
        (198, 5)
    """
    _check_int("budget_bytes", budget_bytes, 0)
    _check_int("min_batch", min_batch, 1)
    _check_int("max_batch_limit", max_batch_limit, min_batch)
    for probe in probe_batches:
        _check_int("probe_batches item", probe, 1)
    search = _solve(peak, budget_bytes, min_batch, max_batch_limit, probe_batches,
                    degree=1, axis="batch size")
    at_next = search.cache.get(search.lo + 1) if not search.capped else None
    return SolveResult(
        max_batch_size=search.lo, bytes_at_max=search.cache[search.lo], bytes_at_next=at_next,
        evaluations=len(search.cache), evaluated=tuple(search.cache.items()),
        capped=search.capped, pieces=search.first_pieces, monotone=search.monotone())


def solve_max_seq_len(peak_of_len: PeakFn, budget_bytes: int, *, max_len: int,
                      multiple_of: int = 1, min_len: int | None = None,
                      probe_lens: Sequence[int] | None = None) -> SeqLenResult:
    """Find the longest sequence length (at a fixed batch) whose peak fits ``budget_bytes``.

    The peak can grow quadratically in the length (a materialised attention
    matrix), so the model is a quadratic through three evaluated lengths, not a
    line; the search and its guards are those of :func:`solve_max_batch`.

    Args:
        peak_of_len: sequence length -> peak device bytes (one trace per call).
        budget_bytes: device bytes available to the step.
        max_len: longest length allowed (the model's context, say).
        multiple_of: only lengths that are multiples of this are tried and returned.
        min_len: shortest length considered; default ``multiple_of``.
        probe_lens: lengths evaluated first to fit the model; default a quarter
            and a half of ``max_len``.

    Returns:
        The longest fitting length, with peak evaluated there and at the next multiple.

    Raises:
        NothingFits: ``peak_of_len(min_len) > budget_bytes``.
        InvalidInputError: bad lengths or budget, or ``min_len`` above ``max_len``.

    Example:
        >>> peak = lambda n: 1000 + 3 * n + n * n        # bytes
        >>> solve_max_seq_len(peak, 100_000, max_len=4096, multiple_of=8).max_seq_len
        312
    """
    _check_int("budget_bytes", budget_bytes, 0)
    _check_int("multiple_of", multiple_of, 1)
    _check_int("max_len", max_len, multiple_of)
    lower = 1 if min_len is None else -(-_check_int("min_len", min_len, 1) // multiple_of)
    upper = max_len // multiple_of
    if lower > upper:
        raise InvalidInputError(
            f"min_len {min_len} is above max_len {max_len} (as multiples of {multiple_of})")
    if probe_lens is None:
        probes: Sequence[int] = _default_probe_units(upper)
    else:
        probes = [_check_int("probe_lens item", n, 1) // multiple_of for n in probe_lens]
    search = _solve(lambda units: peak_of_len(units * multiple_of), budget_bytes, lower, upper,
                    probes, degree=2, axis="sequence length", unit=multiple_of)
    at_next = search.cache.get(search.lo + 1) if not search.capped else None
    return SeqLenResult(
        max_seq_len=search.lo * multiple_of, bytes_at_max=search.cache[search.lo],
        bytes_at_next=at_next, evaluations=len(search.cache),
        evaluated=tuple((units * multiple_of, b) for units, b in search.cache.items()),
        capped=search.capped, monotone=search.monotone(),
        pieces=tuple(tuple(c / multiple_of**power for power, c in enumerate(piece))
                     for piece in search.first_pieces))


def default_seq_len_probes(max_len: int, multiple_of: int = 1) -> tuple[int, int]:
    """The lengths :func:`solve_max_seq_len` probes first when not given ``probe_lens``:
    a quarter and a half of ``max_len``, as multiples of ``multiple_of``."""
    return tuple(u * multiple_of for u in _default_probe_units(max_len // multiple_of))


def _default_probe_units(upper: int) -> tuple[int, int]:
    return (upper // 4, upper // 2)


# --- The search state: an evaluation cache and the bracket it implies. -------------------------


class _StepKind(StrEnum):
    PROBE = "probe"
    MODEL = "model"
    BISECT = "bisect"


@dataclass
class _Search:
    """Evaluations so far, and the bookkeeping the strategies share.

    The bracket: ``hi`` is the smallest evaluated size over budget (None while
    every evaluated size fits) and ``lo`` the largest evaluated size that fits
    below it. No evaluated size lies strictly between them, and every step
    evaluates one that does, so exactly one end moves per call.
    """

    peak: PeakFn
    budget_bytes: int
    lower: int
    upper: int
    cache: dict[int, int] = field(default_factory=dict)   # insertion order = call order
    run_side: int = 0            # +1: lo moved last, -1: hi moved last (probes reset it)
    run_length: int = 0          # how many times in a row that end moved
    phase_steps: int = 0         # non-probe calls since the phase (open / bracketed) began
    phase_origin: float | None = None   # reach (open) or width (bracketed) when it began
    first_pieces: tuple[Piece, ...] = ()

    def evaluate(self, x: int) -> int:
        if x not in self.cache:
            value = self.peak(x)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InvalidInputError(
                    f"peak({x}) returned {value!r}; expected a non-negative int of bytes")
            self.cache[x] = value
        return self.cache[x]

    def fits(self, x: int) -> bool:
        return self.cache[x] <= self.budget_bytes

    @property
    def hi(self) -> int | None:
        return min((x for x in self.cache if not self.fits(x)), default=None)

    @property
    def lo(self) -> int:
        hi = self.hi
        return max(x for x in self.cache if self.fits(x) and (hi is None or x < hi))

    @property
    def capped(self) -> bool:
        return self.lo == self.upper

    @property
    def finished(self) -> bool:
        return self.capped or self.hi == self.lo + 1

    def phase_extent(self) -> float:
        """The reach ``lo - lower + 1`` while unbracketed, else the bracket width."""
        return float(self.lo - self.lower + 1 if self.hi is None else self.hi - self.lo)

    def progress(self) -> float:
        """log2 of how far the phase has come: doublings of the reach while
        unbracketed, halvings of the bracket after."""
        if self.phase_origin is None:
            return 0.0
        ratio = self.phase_extent() / self.phase_origin
        return math.log2(ratio if self.hi is None else 1 / ratio)

    def behind_schedule(self) -> bool:
        return self.phase_steps >= self.progress() + _SLACK_STEPS

    def take(self, x: int, kind: _StepKind) -> None:
        was_bracketed = self.hi is not None
        if kind is not _StepKind.PROBE and self.phase_origin is None:
            self.phase_origin = self.phase_extent()
        self.evaluate(x)
        side = 1 if self.fits(x) else -1
        if kind is _StepKind.PROBE:
            self.run_side, self.run_length = 0, 0
            if self.hi is not None and not was_bracketed:
                self.phase_origin = None   # the bracket phase starts with the first non-probe
            return
        self.run_length = self.run_length + 1 if side == self.run_side else 1
        self.run_side = side
        if self.hi is not None and not was_bracketed:
            self.phase_steps, self.phase_origin = 0, self.phase_extent()
        else:
            self.phase_steps += 1

    def monotone(self) -> bool:
        values = [self.cache[x] for x in sorted(self.cache)]
        return all(a <= b for a, b in itertools.pairwise(values))


# --- Strategies: each proposes the next size inside the bracket, or None. ---------------------


def _probe_step(search: _Search, probes: Sequence[int]) -> int | None:
    ceiling = search.upper if search.hi is None else search.hi - 1
    return next((p for p in sorted(set(probes)) if search.lo < p <= ceiling
                 and p not in search.cache), None)


def _scheduled_step(search: _Search) -> int | None:
    return _bisect_step(search) if search.behind_schedule() else None


def _bisect_step(search: _Search) -> int:
    """Double the reach while nothing is known to exceed the budget; then halve the
    bracket, in log space while its ends are more than 4x apart (a guess at the
    cap that failed must not cost log2(cap) halvings)."""
    reach = search.lo - search.lower + 1
    if search.hi is None:
        return min(search.upper, search.lo + reach)
    if search.hi - search.lower + 1 > 4 * reach:
        return search.lower - 1 + math.isqrt(reach * (search.hi - search.lower + 1))
    return (search.lo + search.hi) // 2


def _model_step(search: _Search, degree: int) -> int | None:
    """The model's largest fitting size g (or g+1 when g is already known to fit),
    pushed towards the far end when one end of the bracket keeps moving."""
    pieces = _fit_model(search, degree)
    if pieces is None:
        return None
    if not search.first_pieces:
        search.first_pieces = tuple(tuple(float(c) for c in piece) for piece in pieces)
    guess = _last_fitting(pieces, search)
    if search.run_length > 1:
        guess += search.run_side * (2 ** (search.run_length - 1) - 1)
    ceiling = search.upper if search.hi is None else search.hi - 1
    return min(max(guess, search.lo + 1), ceiling)


# --- The one loop. -----------------------------------------------------------------------------


def _solve(peak: PeakFn, budget_bytes: int, lower: int, upper: int, probes: Sequence[int], *,
           degree: int, axis: str, unit: int = 1) -> _Search:
    search = _Search(peak, budget_bytes, lower, upper)
    needed = search.evaluate(lower)
    if needed > budget_bytes:
        raise NothingFits(needed, budget_bytes, smallest=lower * unit, axis=axis)
    strategies: tuple[tuple[_StepKind, Callable[[_Search], int | None]], ...] = (
        (_StepKind.PROBE, lambda s: _probe_step(s, probes)),
        (_StepKind.BISECT, _scheduled_step),
        (_StepKind.MODEL, lambda s: _model_step(s, degree)),
        (_StepKind.BISECT, _bisect_step),
    )
    while not search.finished:
        kind, x = next((kind, x) for kind, strategy in strategies
                       if (x := strategy(search)) is not None)
        search.take(x, kind)
    return search


# --- Fitting. ----------------------------------------------------------------------------------


def _fit_points(search: _Search, count: int) -> list[tuple[int, int]]:
    """The ends of the bracket (or the largest fitting size), then sizes below it,
    each at least a quarter of its distance from ``lower`` further down, so that
    one allocator step between neighbours cannot dominate the slope."""
    chosen = [search.lo] if search.hi is None else [search.lo, search.hi]
    edge = search.lo
    for x in sorted((x for x in search.cache if x < search.lo), reverse=True):
        if len(chosen) == count:
            break
        if edge - x >= max(1, (edge - search.lower) // 4):
            chosen.append(x)
            edge = x
    return [(x, search.cache[x]) for x in chosen]


def _fit_model(search: _Search, degree: int) -> tuple[_Poly, ...] | None:
    """A flat piece at ``peak(lower)`` and a line (degree 1) or convex parabola
    (degree 2) through the points nearest the budget; the model is their max."""
    points = _fit_points(search, degree + 1)
    if len(points) < 2:
        return None
    curve = _fit_polynomial(points)
    if len(curve) == 3 and curve[2] <= 0:   # concave: allocator noise, not attention; a line
        curve = _fit_polynomial(points[:2])
    flat = (Fraction(search.cache[search.lower]),)
    return tuple(piece + (Fraction(0),) * (degree + 1 - len(piece)) for piece in (flat, curve))


def _fit_polynomial(points: Sequence[tuple[int, int]]) -> _Poly:
    """Exact coefficients of the line (2 points) or parabola (3 points) through
    ``points`` (Newton's divided differences), lowest order first."""
    (x0, y0), (x1, y1) = points[0], points[1]
    d01 = Fraction(y1 - y0, x1 - x0)
    if len(points) == 2:
        return (y0 - d01 * x0, d01)
    x2, y2 = points[2]
    d012 = (Fraction(y2 - y1, x2 - x1) - d01) / (x2 - x0)
    return (y0 - d01 * x0 + d012 * x0 * x1, d01 - d012 * (x0 + x1), d012)


def _last_fitting(pieces: Sequence[_Poly], search: _Search) -> int:
    """Largest size in [lower - 1, upper] that the model puts within budget: solved
    in floats, then settled exactly, so an exactly affine peak gives its exact answer."""
    def fits(x: int) -> bool:
        return max(_value(piece, x) for piece in pieces) <= search.budget_bytes

    approx = min(_crossing(piece, search.budget_bytes) for piece in pieces)
    guess = math.floor(min(max(approx, search.lower - 1.0), float(search.upper)))
    for _ in range(4):   # float error moves the root by a unit or two at most
        if guess < search.upper and fits(guess + 1):
            guess += 1
        elif guess >= search.lower and not fits(guess):
            guess -= 1
        else:
            break
    return guess


def _value(piece: _Poly, x: int) -> Fraction:
    return sum((c * x**power for power, c in enumerate(piece)), Fraction(0))


def _crossing(piece: _Poly, budget_bytes: int) -> float:
    """About the largest x at which the piece (non-decreasing where it matters) is
    still within budget: inf when it never exceeds it, -inf when always over."""
    c0, c1 = float(piece[0] - budget_bytes), float(piece[1])
    c2 = float(piece[2]) if len(piece) > 2 else 0.0
    if c2 > 0:
        discriminant = c1 * c1 - 4 * c2 * c0
        if discriminant < 0:
            return -math.inf
        q = -0.5 * (c1 + math.copysign(math.sqrt(discriminant), c1))
        return max(q / c2, c0 / q) if q else 0.0
    if c1 > 0:
        return -c0 / c1
    return math.inf if c0 <= 0 else -math.inf


# --- Small helpers. ----------------------------------------------------------------------------


def _check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidInputError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise InvalidInputError(f"{name} must be at least {minimum}, got {value}")
    return value


def format_size(n: int) -> str:
    """``n`` bytes as a person reads them: GiB from 1 GiB up, MiB below."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _result_dict(result: SolveResult | SeqLenResult) -> dict[str, Any]:
    out = {name: getattr(result, name) for name in result.__dataclass_fields__}
    out["evaluated"] = [list(pair) for pair in result.evaluated]
    out["pieces"] = [list(piece) for piece in result.pieces]
    return out
