"""The exact boundary of one row: gallop from batchfit's answer, then bisect (no torch).

A row's search holds every trial it has run (a resumed run replays the earlier ones), so
the next batch is a pure function of them:

* first the prediction ``P`` (the seed);
* all fit so far: ``P + 1`` (an exact prediction ends here, in 2 trials), then steps of
  2%, 4%, 8%... of ``P`` above the largest fit, until one fails;
* all failed so far: ``P - 1``, then the same steps below the smallest failure, until one
  fits (or batch 1 fails: the boundary is 0);
* then bisection between the largest fit and the smallest failure.

The search is done when the smallest failure is the largest fit plus one (an exact
boundary), when batch 1 fails, when the largest fit reaches ``max_batch`` (no failure to
bracket it), or when the trials contradict each other (a failure below a fit: the step
is not monotone in the batch, and more trials would not settle it; the row says so).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

#: The first gallop step beyond P +/- 1, as a fraction of P; it doubles at each step.
GALLOP_FRACTION = 0.02
#: The seed when batchfit has no answer for a row (its prediction failed).
FALLBACK_SEED = 16


@dataclass
class BoundarySearch:
    """The trials of one row so far (``batch -> record``) and what to try next."""

    seed: int
    max_batch: int = 1 << 16
    fits: dict[int, dict[str, Any]] = field(default_factory=dict)
    fails: dict[int, dict[str, Any]] = field(default_factory=dict)

    @classmethod
    def seeded(cls, predicted: int | None, max_batch: int = 1 << 16) -> BoundarySearch:
        seed = predicted if predicted is not None and predicted >= 1 else FALLBACK_SEED
        return cls(min(seed, max_batch), max_batch)

    def record(self, batch: int, trial: dict[str, Any]) -> None:
        (self.fits if trial["fits"] else self.fails)[batch] = trial

    @property
    def boundary(self) -> int:
        """The largest batch that ran (0: none did)."""
        return max(self.fits, default=0)

    @property
    def failed_at(self) -> int | None:
        """The smallest batch that failed (None: none did)."""
        return min(self.fails, default=None)

    @property
    def contradicted(self) -> bool:
        return self.failed_at is not None and self.failed_at < self.boundary

    @property
    def exact(self) -> bool:
        return self.failed_at is not None and self.failed_at == self.boundary + 1

    def done(self) -> bool:
        return (self.exact or self.contradicted or self.failed_at == 1
                or self.boundary >= self.max_batch)

    def _step(self, taken: int) -> int:
        """The gallop's ``taken``-th step (1: the +/- 1 check)."""
        if taken <= 1:
            return 1
        return max(2, math.ceil(self.seed * GALLOP_FRACTION * 2 ** (taken - 2)))

    def next_batch(self) -> int | None:
        """The batch to try next, or None when :meth:`done`."""
        if self.done():
            return None
        if not self.fits and not self.fails:
            return self.seed
        low, high = self.boundary, self.failed_at
        if high is None:  # all fit: gallop up
            return min(low + self._step(len(self.fits)), self.max_batch)
        if low == 0:  # all failed: gallop down
            return max(1, high - self._step(len(self.fails)))
        return (low + high) // 2

    def trials(self) -> int:
        return len(self.fits) + len(self.fails)
