"""The search every integration shares: call a trial in this process at candidate batch
sizes, count an out-of-memory error as "does not fit", let any other error through.

The decisions come from the torch-free loop of :mod:`batchfit.realrun.search`
(:func:`~batchfit.realrun.search.search_boundary`); this module only turns "run the user's code at
batch B" into its ``Outcome``. The trials run in the caller's process, so
``SearchPlan.isolated`` is False: a failure that follows an earlier failure is re-run once
before it is believed (freed memory can stay fragmented after an out-of-memory error).

How a prediction seeds the search. An in-process trial of arbitrary code measures nothing,
so the usage model the search needs is the prediction's own, written in samples: a fitting
trial at batch ``b`` "uses" ``b`` and the limit is the predicted maximum ``P``. The first
trial is ``P - ceil(approach * P)`` (below the prediction, so it most likely fits), the
model then proposes ``P`` and ``P + 1``: three trials when the prediction is exact. When it
is not, the search gallops past it (steps of 1, 2, 4, ... above the largest fit, halving
below the smallest failure) and bisects once both ends are known, so a wrong prediction
costs O(log error) trials, never a wrong answer. Without a prediction the search starts at
a given batch and doubles until a failure, then bisects (Lightning's ``binsearch``).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch

from batchfit.errors import BatchfitError, DoesNotFitError, InvalidInputError
from batchfit.integrations._jit_error import clear_jit_allocation_error
from batchfit.realrun.boundary import Outcome, SearchPlan, search_boundary
from batchfit.realrun.trial import (
    Trial,
    collect_garbage,
    is_out_of_memory,
    release_exception,
)

T = TypeVar("T")


@dataclass(frozen=True)
class BatchSizeSearch:
    """What an in-process search found, and the evidence.

    Attributes:
        max_batch_size: the largest batch size that ran.
        recommended_batch_size: ``floor(max_batch_size * (1 - headroom))`` (at least 1) when
            the memory boundary was found (``confirmed``); else ``max_batch_size``.
        predicted_max_batch_size: the prediction the search started from (None: none).
        trials: every trial, in order (``peak_bytes`` is not measured in process: None).
        confirmed: ``max_batch_size + 1`` was tried and ran out of memory.
        capped: the search stopped at its ``max_batch_size`` limit (more may fit).
        seconds: wall time of the search, the prediction included.
    """

    max_batch_size: int
    recommended_batch_size: int
    predicted_max_batch_size: int | None
    trials: tuple[Trial, ...]
    confirmed: bool
    capped: bool
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "max_batch_size": self.max_batch_size,
            "recommended_batch_size": self.recommended_batch_size,
            "predicted_max_batch_size": self.predicted_max_batch_size,
            "trials": [t.to_dict() for t in self.trials],
            "confirmed": self.confirmed,
            "capped": self.capped,
            "seconds": round(self.seconds, 3),
        }


@dataclass(frozen=True)
class FoundBatchSize(Generic[T]):
    """What a function decorated with :func:`batchfit.find_batch_size` returns.

    Attributes:
        batch_size: the largest batch size the function ran at.
        value: what the function returned at ``batch_size``.
        search: the search (trials, prediction, recommended batch size).
    """

    batch_size: int
    value: T
    search: BatchSizeSearch


class SearchLimits:
    """The knobs every surface shares, checked once, up front."""

    def __init__(self, *, max_batch_size: int, max_trials: int, approach: float,
                 headroom: float):
        check_positive_int(max_batch_size, "max_batch_size")
        check_positive_int(max_trials, "max_trials")
        check_fraction(approach, "approach")
        check_fraction(headroom, "headroom")
        self.max_batch_size = max_batch_size
        self.max_trials = max_trials
        self.approach = approach
        self.headroom = headroom


    def capped_at(self, dataset: Any) -> SearchLimits:
        """These limits, with ``max_batch_size`` at most the dataset's length: a larger
        batch only repeats that length (its one batch is short), so it proves nothing."""
        try:
            length = len(dataset) if dataset is not None else None
        except TypeError:  # an iterable dataset
            length = None
        if length is None or not 1 <= length < self.max_batch_size:
            return self
        return SearchLimits(max_batch_size=length, max_trials=self.max_trials,
                            approach=self.approach, headroom=self.headroom)


def check_positive_int(value: Any, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidInputError(f"{what} must be a positive integer, not {value!r}")


def check_fraction(value: Any, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise InvalidInputError(f"{what} must be a fraction in [0, 1), not {value!r}")


def check_steps(value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 2:
        raise InvalidInputError(
            f"steps_per_trial must be an integer >= 2, not {value!r}: the first step may create "
            "the optimizer state, the steady state is measured from the second step on")


def plan_for(predicted: int | None, start: int, limits: SearchLimits) -> SearchPlan:
    """The search plan: seeded by a prediction (see the module docstring) or not."""
    if predicted is None:
        return SearchPlan(predicted=min(start, limits.max_batch_size), isolated=False,
                          approach=0.0, max_batch_size=limits.max_batch_size)
    predicted = max(1, min(predicted, limits.max_batch_size))
    return SearchPlan(predicted=predicted, limit_bytes=predicted, bytes_per_sample=1.0,
                      isolated=False, approach=limits.approach,
                      max_batch_size=limits.max_batch_size)


class _OutOfTrials(Exception):
    """Raised inside the search loop to stop it once ``max_trials`` trials ran."""


def free_device_memory() -> None:
    """``gc.collect()``, and hand cached CUDA blocks back when CUDA is in use."""
    in_use = torch.cuda.is_available() and torch.cuda.is_initialized()
    collect_garbage(torch.device("cuda") if in_use else None)


def trial_line(trial: Trial) -> str:
    """One progress line for a finished trial: batch, fits or not, seconds."""
    verdict = "fits" if trial.fits else "out of memory"
    return f"batch {trial.batch_size}: {verdict} ({trial.seconds:.1f} s)"


def cpu_trial_room(budget: int, held: int) -> int:
    """What an in-process CPU trial may use: the budget less what the model, its buffers and
    the optimizer state already hold.

    Raises:
        DoesNotFitError: nothing is left. A cap at the process's present size would fail the
            first allocation anywhere, oneDNN's own included, and oneDNN does not check all
            of its (its primitive descriptors' constructors dereference a failed ``malloc``):
            the process would crash instead of the trial failing.
    """
    if budget <= held:
        raise DoesNotFitError(
            f"the budget ({budget / 2**20:.1f} MiB) is not more than the {held / 2**20:.1f} MiB "
            "the model's weights, buffers and optimizer state already hold: nothing is left "
            "for a trial; raise memory_bytes", needed_bytes=held, available_bytes=budget)
    return budget - held


@contextlib.contextmanager
def cpu_memory_cap(limit_bytes: int) -> Iterator[None]:
    """This process as a CPU "device" of ``limit_bytes`` more than it holds now, for the
    block: ``RLIMIT_DATA`` (soft) = ``VmData`` now + ``limit_bytes``, put back after.

    An in-process trial on the CPU otherwise never runs out of memory before the machine
    does (swap, or the kernel's OOM killer): a search galloped through 13 trials of a
    small CNN in 2 minutes without one failure. Under the cap the CPU allocator raises
    its catchable "can't allocate memory" error (``DefaultCPUAllocator``'s check), which the search
    counts as "does not fit". The whole process is capped while a trial runs, as
    ``batchfit search --memory-cap`` caps its trial processes; after a failure glibc may
    keep freed memory, which :func:`search_in_process` handles by re-running a failure that
    follows another one. oneDNN keeps a failed JIT allocation as an error that would fail
    every new CPU kernel on this thread for good; it is cleared when the block ends
    (:mod:`batchfit.integrations._jit_error`)."""
    import resource

    from batchfit.realrun.trial import vm_data_bytes

    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    wanted = vm_data_bytes() + max(0, int(limit_bytes))
    if hard != resource.RLIM_INFINITY:
        wanted = min(wanted, hard)
    resource.setrlimit(resource.RLIMIT_DATA, (wanted, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))
        clear_jit_allocation_error()


def _one_line(exc: BaseException, limit: int = 300) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def search_in_process(trial: Callable[[int], T], limits: SearchLimits, *,
                      predicted: int | None, start: int = 2,
                      after_trial: Callable[[], None] | None = None,
                      started: float | None = None,
                      on_trial: Callable[[Trial], None] | None = None,
                      cap: Callable[[], Any] | None = None) -> tuple[BatchSizeSearch, T]:
    """Find the largest batch size at which ``trial(batch_size)`` runs without running out
    of memory; return the search and what ``trial`` returned at that batch size.

    ``after_trial`` runs after every trial, whether it fitted, failed or raised (restore
    the state a trial changed); ``on_trial`` gets each finished :class:`Trial` (a progress
    line); ``cap()`` is entered around each trial (a context manager: :func:`cpu_memory_cap`).
    An error other than out-of-memory propagates unchanged.

    Raises:
        DoesNotFitError: batch 1 ran out of memory.
        BatchfitError: no batch size ran within ``max_trials`` trials.
    """
    started = time.perf_counter() if started is None else started
    trials: list[Trial] = []
    best: list[tuple[int, T]] = []  # the value at the largest fit so far (one entry)

    def evaluate(batch_size: int) -> Outcome:
        if len(trials) >= limits.max_trials:
            raise _OutOfTrials
        begin = time.perf_counter()
        try:
            with cap() if cap is not None else contextlib.nullcontext():
                value = trial(batch_size)
        except Exception as exc:
            if not is_out_of_memory(exc):
                raise
            error = _one_line(exc)
            release_exception(exc)
            del exc
            free_device_memory()
            trials.append(Trial(batch_size, False, None, time.perf_counter() - begin, error))
            if on_trial is not None:
                on_trial(trials[-1])
            return Outcome(batch_size, False)
        finally:
            if after_trial is not None:
                after_trial()
        trials.append(Trial(batch_size, True, None, time.perf_counter() - begin))
        if on_trial is not None:
            on_trial(trials[-1])
        if not best or batch_size >= best[0][0]:
            best[:] = [(batch_size, value)]
        del value
        return Outcome(batch_size, True, batch_size if predicted is not None else None)

    plan = plan_for(predicted, start, limits)
    free_device_memory()
    try:
        log = search_boundary(evaluate, plan, max_trials=limits.max_trials + 1)
        lower, confirmed = log.lower, log.finished and log.lower < plan.max_batch_size
    except _OutOfTrials:
        lower = best[0][0] if best else 0
        confirmed = any(not t.fits and t.batch_size == lower + 1 for t in trials)
    if lower == 0:
        first = next((t for t in trials if t.batch_size == 1), None)
        if first is not None:
            raise DoesNotFitError(f"even batch size 1 ran out of memory: {first.error}",
                                  needed_bytes=0, available_bytes=0)
        raise BatchfitError(
            f"no batch size ran within max_trials={limits.max_trials} trials (tried "
            f"{', '.join(str(t.batch_size) for t in trials)}): raise max_trials")
    capped = lower >= plan.max_batch_size
    recommended = max(1, math.floor(lower * (1 - limits.headroom))) if confirmed else lower
    search = BatchSizeSearch(
        max_batch_size=lower, recommended_batch_size=recommended,
        predicted_max_batch_size=predicted, trials=tuple(trials), confirmed=confirmed,
        capped=capped, seconds=time.perf_counter() - started)
    return search, best[0][1]
