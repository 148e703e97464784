"""The gradient noise scale from gradient norms at two batch sizes (no torch here).

McCandlish et al. 2018, "An Empirical Model of Large-Batch Training" (arXiv:1812.06162),
section 2.2 and appendix A.1. A batch-``B`` gradient estimate ``G_B`` of the true gradient
``G`` has ``E|G_B|^2 = |G|^2 + tr(Σ)/B`` (``Σ`` is the covariance of per-example
gradients), so squared norms measured at a small batch ``b`` and a big batch ``B`` give
unbiased estimates of both parts::

    |G|^2  ~ (B |G_B|^2 - b |G_b|^2) / (B - b)
    tr(Σ)  ~ (|G_b|^2 - |G_B|^2) / (1/b - 1/B)

and the simple noise scale is ``B_simple = tr(Σ) / |G|^2``. One step's estimates are very
noisy (the ``|G|^2`` estimate is often negative early in a measurement), and the ratio of
two unbiased estimates is not unbiased, so each part is averaged on its own (an
exponential moving average, bias-corrected as Adam's moments are) and the ratio is taken
of the averages.

Sampling without replacement from a finite dataset of ``N`` examples shrinks the batch
variance by the finite-population factor: ``E|G_B|^2 = |G|^2 + tr(Σ) (N-B)/((N-1) B)``
(Σ normalised by N). With ``dataset_size`` set, ``1/B`` is replaced by that factor; it
matters when ``B`` is a sizeable fraction of ``N`` (3.4% at B=64 of 1,797 examples).

The confidence interval is Fieller's interval for a ratio of two means (Fieller 1954,
"Some problems in interval estimation", JRSS B 16:175-185) over the per-step estimates,
with the EMA's weights, their effective number of steps ``n_eff = (Σw)^2/Σw^2`` and a
Student t quantile on ``n_eff - 1`` degrees of freedom. It treats steps as independent
(each uses a fresh batch) and the weights as fixed; when training moves the weights, the
interval describes the weighted average over the window, which is what the estimate is.
When the ``|G|^2`` average is not significantly above zero the interval has no upper
end (``ci_high = inf``): the gradient is still mostly noise at these batch sizes.

Example:
    >>> est = NoiseScaleEstimator()
    >>> for small, big in [(2.1, 1.12), (1.9, 1.08), (2.0, 1.10)]:
    ...     _ = est.update(small, big, batch_small=8, batch_big=64)
    >>> r = est.result()
    >>> round(r.grad_sq_norm, 3), round(r.trace_sigma, 2), round(r.b_simple, 1)
    (0.971, 8.23, 8.5)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from statistics import NormalDist
from typing import Any

from batchfit.errors import InvalidInputError


def batch_variance_factor(batch_size: int, dataset_size: int | None = None) -> float:
    """The factor ``f`` in ``E|G_B|^2 = |G|^2 + f tr(Σ)``: ``1/B`` for i.i.d. samples,
    ``(N-B)/((N-1)B)`` for a batch drawn without replacement from ``N`` examples."""
    if dataset_size is None or dataset_size <= 1:
        return 1.0 / batch_size
    return (dataset_size - batch_size) / ((dataset_size - 1) * batch_size)


def two_batch_estimates(small_sq_norm: float, big_sq_norm: float, batch_small: int,
                        batch_big: int, dataset_size: int | None = None) -> tuple[float, float]:
    """One step's unbiased estimates ``(|G|^2, tr(Σ))`` from squared gradient norms.

    ``small_sq_norm`` is ``|G_b|^2`` (or the mean of several such norms, which is still
    unbiased), ``big_sq_norm`` is ``|G_B|^2``; both of gradients of the *mean* loss.

    Example:
        >>> g2, trace = two_batch_estimates(2.0, 1.1, 8, 64)  # tr(Σ) = 0.9 / (1/8 - 1/64)
        >>> round(g2, 6), round(trace, 6)
        (0.971429, 8.228571)
    """
    if not 0 < batch_small < batch_big:
        raise InvalidInputError(
            f"the small batch ({batch_small}) must be smaller than the big batch ({batch_big})")
    f_small = batch_variance_factor(batch_small, dataset_size)
    f_big = batch_variance_factor(batch_big, dataset_size)
    trace_sigma = (small_sq_norm - big_sq_norm) / (f_small - f_big)
    return big_sq_norm - trace_sigma * f_big, trace_sigma


def t_quantile(probability: float, dof: float) -> float:
    """Student t quantile, from the normal one by the Cornish-Fisher expansion of
    Abramowitz & Stegun 26.7.5 (error below 1% for ``dof >= 2``; 11.3 for 12.7 at 1)."""
    z = NormalDist().inv_cdf(probability)
    if math.isinf(dof):
        return z
    g1 = (z ** 3 + z) / 4
    g2 = (5 * z ** 5 + 16 * z ** 3 + 3 * z) / 96
    g3 = (3 * z ** 7 + 19 * z ** 5 + 17 * z ** 3 - 15 * z) / 384
    g4 = (79 * z ** 9 + 776 * z ** 7 + 1482 * z ** 5 - 1920 * z ** 3 - 945 * z) / 92160
    return z + g1 / dof + g2 / dof ** 2 + g3 / dof ** 3 + g4 / dof ** 4


def chi2_quantile(probability: float, dof: float) -> float:
    """Chi-square quantile by the Wilson-Hilferty cube-root approximation (within 1% of
    the table for ``dof >= 5``)."""
    z = NormalDist().inv_cdf(probability)
    h = 2 / (9 * dof)
    return dof * max(1 - h + z * math.sqrt(h), 0.0) ** 3


def fieller_interval(mean_num: float, mean_den: float, var_num: float, var_den: float,
                     cov: float, t: float) -> tuple[float, float]:
    """Fieller's interval for ``mean_num / mean_den`` given the variances of the two means
    and their covariance: every ``r`` with ``(num - r den)^2 <= t^2 Var(num - r den)``.

    Returns the piece that holds the point estimate (it always holds it); either end may
    be infinite when the denominator is not significantly away from zero. A zero or
    negative denominator mean gives ``(lower, inf)``: the ratio is unbounded above.
    """
    a = mean_den ** 2 - t * t * var_den
    b = mean_num * mean_den - t * t * cov
    c = mean_num ** 2 - t * t * var_num
    disc = b * b - a * c
    estimate = mean_num / mean_den if mean_den > 0 else math.inf
    if a > 0 and disc >= 0:  # a bounded interval
        root = math.sqrt(disc)
        return (b - root) / a, (b + root) / a
    if disc < 0:  # the whole line (a < 0): nothing is excluded
        return -math.inf, math.inf
    if a == 0:  # linear: -2 b r + c <= 0
        if b == 0:
            return -math.inf, math.inf
        roots = [c / (2 * b)] * 2
    else:
        root = math.sqrt(disc)
        roots = sorted(((b - root) / a, (b + root) / a))
    # a <= 0: the set is (-inf, roots[0]] U [roots[1], inf); keep the piece with the estimate
    if estimate >= roots[1]:
        return roots[1], math.inf
    return -math.inf, roots[0]


@dataclass(frozen=True)
class NoiseSample:
    """One measured step: its unbiased estimates and the running estimate after it."""

    step: int
    grad_sq_norm: float
    trace_sigma: float
    b_simple: float

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "grad_sq_norm": self.grad_sq_norm,
                "trace_sigma": self.trace_sigma, "b_simple": _finite(self.b_simple)}


def _finite(value: float) -> float | None:
    """JSON has no infinity: None stands for an unbounded value."""
    return value if math.isfinite(value) else None


@dataclass(frozen=True)
class NoiseScale:
    """The simple noise scale and what it rests on.

    Attributes:
        b_simple: ``tr(Σ)/|G|^2`` of the averaged parts, in examples (``inf`` when the
            ``|G|^2`` average is not positive).
        grad_sq_norm: the averaged ``|G|^2`` (squared norm of the true gradient of the
            mean loss, loss and AMP scaling undone).
        trace_sigma: the averaged ``tr(Σ)`` (per-example gradient variance, summed).
        ci_low, ci_high: the ``confidence`` interval of ``b_simple`` (``ci_high`` may be
            ``inf``).
        steps: measured steps the estimate rests on; ``skipped_steps``: steps dropped
            (non-finite gradients, such as a GradScaler overflow, or unequal micro-batches).
        effective_steps: ``(Σw)^2/Σw^2`` of the EMA weights (``steps`` for a plain mean).
        batch_small, batch_big: the two batch sizes (the latest, if they changed).
        method: how the small-batch norms were obtained (``microbatch``,
            ``per_example``, ``ddp``).
        ema_decay: the EMA's decay per measured step (None: a plain mean over all steps).
        history: per-step estimates and the running ``b_simple``.
        notes: caveats found while measuring (BatchNorm, skipped steps...).
    """

    b_simple: float
    grad_sq_norm: float
    trace_sigma: float
    ci_low: float
    ci_high: float
    confidence: float
    steps: int
    effective_steps: float
    batch_small: int
    batch_big: int
    method: str = "microbatch"
    ema_decay: float | None = None
    skipped_steps: int = 0
    dataset_size: int | None = None
    history: tuple[NoiseSample, ...] = field(default=(), repr=False)
    notes: tuple[str, ...] = ()

    @property
    def relative_halfwidth(self) -> float:
        """Half the interval's width over the estimate (``inf`` if unbounded)."""
        if not (math.isfinite(self.ci_high) and math.isfinite(self.b_simple)) or self.b_simple <= 0:
            return math.inf
        return (self.ci_high - self.ci_low) / 2 / self.b_simple

    def steps_for(self, relative_halfwidth: float = 0.1, assurance: float = 0.8) -> int | None:
        """Measured steps (equal weights) for the interval's half-width to reach
        ``relative_halfwidth`` of the estimate: the width shrinks as ``1/sqrt(n)``, and the
        spread seen so far is itself an estimate from few steps, so its upper
        ``assurance`` bound is used (the chi-square bound on a variance: x1.39 after 20
        steps, x1.14 after 100). None when the interval is still unbounded."""
        if not 0 < relative_halfwidth:
            raise InvalidInputError(f"relative_halfwidth must be positive, not {relative_halfwidth}")
        if not 0 < assurance < 1:
            raise InvalidInputError(f"assurance must be in (0, 1), not {assurance}")
        current = self.relative_halfwidth
        n_eff = self.effective_steps
        if not math.isfinite(current) or n_eff < 2:
            return None
        spread = (n_eff - 1) / max(chi2_quantile(1 - assurance, n_eff - 1), 1e-9)
        return max(2, math.ceil(n_eff * (current / relative_halfwidth) ** 2 * spread))

    def to_dict(self) -> dict[str, Any]:
        return {
            "b_simple": _finite(self.b_simple), "grad_sq_norm": _finite(self.grad_sq_norm),
            "trace_sigma": _finite(self.trace_sigma), "ci_low": _finite(self.ci_low),
            "ci_high": _finite(self.ci_high), "confidence": self.confidence,
            "relative_halfwidth": _finite(self.relative_halfwidth),
            "steps": self.steps, "effective_steps": self.effective_steps,
            "steps_for_10_percent": self.steps_for(0.1),
            "skipped_steps": self.skipped_steps, "batch_small": self.batch_small,
            "batch_big": self.batch_big, "method": self.method, "ema_decay": self.ema_decay,
            "dataset_size": self.dataset_size,
            "history": [s.to_dict() for s in self.history], "notes": list(self.notes),
        }


def check_ema_decay(ema_decay: float | None) -> None:
    if ema_decay is not None and not (isinstance(ema_decay, (int, float)) and 0 < ema_decay < 1):
        raise InvalidInputError(
            f"ema_decay must be in (0, 1), or None for a plain mean, not {ema_decay!r}")


class NoiseScaleEstimator:
    """Accumulates per-step norm measurements into the noise scale and its interval.

    Each part (``|G|^2`` and ``tr(Σ)``) is smoothed by its own bias-corrected EMA
    (weights ``decay^(age)``); the ratio is taken of the smoothed parts. With
    ``ema_decay=None`` every step weighs the same (the right choice at fixed weights).

    Args:
        ema_decay: per measured step, in (0, 1), or None for a plain mean.
        confidence: two-sided level of the interval.
        dataset_size: apply the finite-population factor (batches drawn without
            replacement from this many examples); None for i.i.d. batches.
        keep_history: keep every step's estimates (for plots) in :meth:`result`.
    """

    def __init__(self, *, ema_decay: float | None = None, confidence: float = 0.95,
                 dataset_size: int | None = None, keep_history: bool = True):
        check_ema_decay(ema_decay)
        if not 0 < confidence < 1:
            raise InvalidInputError(f"confidence must be in (0, 1), not {confidence!r}")
        self.ema_decay = ema_decay
        self.confidence = confidence
        self.dataset_size = dataset_size
        self.keep_history = keep_history
        self.steps = 0
        self.skipped_steps = 0
        self.batch_small = 0
        self.batch_big = 0
        # decayed sums: weights, squared weights, and the weighted moments of (g, s)
        self._w = self._w2 = 0.0
        self._g = self._s = self._gg = self._ss = self._gs = 0.0
        self._history: list[NoiseSample] = []

    def update(self, small_sq_norm: float, big_sq_norm: float, batch_small: int,
               batch_big: int) -> bool:
        """Add one step's squared norms; returns False (and counts a skip) when they are
        not finite, as after a GradScaler overflow."""
        if not (math.isfinite(small_sq_norm) and math.isfinite(big_sq_norm)):
            self.skipped_steps += 1
            return False
        g, s = two_batch_estimates(small_sq_norm, big_sq_norm, batch_small, batch_big,
                                   self.dataset_size)
        decay = 1.0 if self.ema_decay is None else self.ema_decay
        self._w = decay * self._w + 1.0
        self._w2 = decay * decay * self._w2 + 1.0
        self._g = decay * self._g + g
        self._s = decay * self._s + s
        self._gg = decay * self._gg + g * g
        self._ss = decay * self._ss + s * s
        self._gs = decay * self._gs + g * s
        self.steps += 1
        self.batch_small, self.batch_big = batch_small, batch_big
        if self.keep_history:
            self._history.append(NoiseSample(self.steps, g, s, self.b_simple))
        return True

    def skip(self) -> None:
        """Count a step that could not be measured."""
        self.skipped_steps += 1

    @property
    def grad_sq_norm(self) -> float:
        return self._g / self._w if self._w else math.nan

    @property
    def trace_sigma(self) -> float:
        return self._s / self._w if self._w else math.nan

    @property
    def b_simple(self) -> float:
        if not self._w:
            return math.nan
        g = self.grad_sq_norm
        return self.trace_sigma / g if g > 0 else math.inf

    @property
    def effective_steps(self) -> float:
        return self._w * self._w / self._w2 if self._w2 else 0.0

    def interval(self) -> tuple[float, float]:
        """The ``confidence`` interval of :attr:`b_simple` (see the module docstring)."""
        n_eff = self.effective_steps
        if self.steps < 2 or n_eff <= 1 + 1e-9:
            return 0.0, math.inf
        g, s = self.grad_sq_norm, self.trace_sigma
        # reliability-weighted (co)variances of one step, then of the weighted means
        unbias = self._w - self._w2 / self._w
        var_g = max(self._gg - self._w * g * g, 0.0) / unbias
        var_s = max(self._ss - self._w * s * s, 0.0) / unbias
        cov = (self._gs - self._w * g * s) / unbias
        t = t_quantile(0.5 + self.confidence / 2, n_eff - 1)
        low, high = fieller_interval(s, g, var_s / n_eff, var_g / n_eff, cov / n_eff, t)
        if high <= 0:  # |G|^2 significantly negative: no positive noise scale is supported
            return 0.0, math.inf
        return max(low, 0.0), high

    def result(self, *, method: str = "microbatch", notes: tuple[str, ...] = ()) -> NoiseScale:
        """The estimate so far (``b_simple`` is NaN before the first measured step)."""
        low, high = self.interval()
        return NoiseScale(
            b_simple=self.b_simple, grad_sq_norm=self.grad_sq_norm, trace_sigma=self.trace_sigma,
            ci_low=low, ci_high=high, confidence=self.confidence, steps=self.steps,
            effective_steps=self.effective_steps, batch_small=self.batch_small,
            batch_big=self.batch_big, method=method, ema_decay=self.ema_decay,
            skipped_steps=self.skipped_steps, dataset_size=self.dataset_size,
            history=tuple(self._history), notes=notes)
