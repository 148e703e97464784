"""Progress on stderr, shared by every long-running command.

On a terminal, a rich spinner (or bar) updates in place and disappears when the work is
done. Where stderr is not a terminal (CI, ``| tee``, a notebook's ``!``) a spinner draws
nothing, so progress is plain lines instead, flushed at once, with the seconds since the
command's work began: one per finished trial, measured batch or tenth of the steps, and
one per trace, build or layout that runs for more than :data:`START_DELAY_S` (so a
command that stops on bad input prints its one error line alone)::

    batchfit search [  41.2 s]: batch 57 fits (trial, 1.9 s of steps)

stdout is left to the answer (with ``--json``, pure JSON), whichever way progress shows.
The commands call :func:`progress` (a description that changes per trace, trial or
layout), :func:`counted_progress` (a known number of steps) or :func:`bench_progress`
(throughput measurements).
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from rich.console import Console

_err = Console(stderr=True)


#: Plain mode: seconds a piece of work must run before the line saying it started shows.
#: A command that stops on bad input prints its one error line alone: such an error comes
#: while the model's library imports, well before any work runs this long.
START_DELAY_S = 5.0


class Progress:
    """What a command reports while it works.

    :meth:`update` says what starts now (a trace, a model's build): on a terminal the
    spinner's text at once; elsewhere a line once it has run for :data:`START_DELAY_S`
    (none if the next update or the end comes first). :meth:`done` says what just finished
    (a trial, a measured batch): a line at once.
    """

    def __init__(self, command: str, status: Any = None):
        self.command, self.status = command, status
        self.started = time.perf_counter()
        self._lock = threading.Lock()
        self._pending: threading.Timer | None = None

    def update(self, text: str) -> None:
        if self.status is not None:
            self.status.update(text)
            return
        if START_DELAY_S <= 0:
            self._write(text)
            return
        with self._lock:
            if self._pending is not None:
                self._pending.cancel()
            self._pending = threading.Timer(START_DELAY_S, self._write, (text,))
            self._pending.daemon = True
            self._pending.start()

    def done(self, text: str) -> None:
        if self.status is not None:
            self.status.update(text)
            return
        self.close()
        self._write(text)

    def close(self) -> None:
        """Drop a start line not yet shown (the work it announced is over)."""
        with self._lock:
            if self._pending is not None:
                self._pending.cancel()
                self._pending = None

    def _write(self, text: str) -> None:
        seconds = time.perf_counter() - self.started
        sys.stderr.write(f"batchfit {self.command} [{seconds:6.1f} s]: {text}\n")
        sys.stderr.flush()


def on_terminal() -> bool:
    """Whether stderr is a terminal (rich's test: it honours ``FORCE_TERMINAL`` too)."""
    return _err.is_terminal


@contextlib.contextmanager
def progress(command: str, description: str) -> Iterator[Progress]:
    """A spinner on a terminal, else plain lines; ``description`` is the first of them.

    Example:
        >>> with progress("max", "tracing at batch 16") as status:  # doctest: +SKIP
        ...     status.update("tracing at batch 32")
    """
    if on_terminal():
        with _err.status(description) as status:
            yield Progress(command, status)
        return
    reporter = Progress(command)
    reporter.update(description)
    try:
        yield reporter
    finally:
        reporter.close()


@contextlib.contextmanager
def counted_progress(command: str, description: str,
                     total: int) -> Iterator[Callable[[int], None]]:
    """A bar over ``total`` steps on a terminal; elsewhere a line at every tenth of them
    (and the last). Yields ``on_step(index)``, ``index`` counting from 0."""
    if on_terminal():
        from rich.progress import BarColumn, MofNCompleteColumn, TextColumn
        from rich.progress import Progress as Bar

        with Bar(TextColumn(description), BarColumn(), MofNCompleteColumn(), console=_err,
                 transient=True) as bar:
            task = bar.add_task("steps", total=total)
            yield lambda index: bar.update(task, completed=index + 1)
        return
    reporter = Progress(command)
    every = max(1, total // 10)

    def on_step(index: int) -> None:
        done = index + 1
        if done % every == 0 or done == total:
            reporter.done(f"{description}: step {done} of {total}")

    reporter.update(f"{description}: {total} steps")
    try:
        yield on_step
    finally:
        reporter.close()


def trial_text(trial: Any) -> str:
    """One finished search trial, in words: the batch, the verdict, where it ran."""
    verdict = "fits" if trial.fits else "out of memory"
    where = "fresh interpreter" if trial.process == "exec" else "trial"
    return f"batch {trial.batch_size} {verdict} ({where}, {trial.seconds:.1f} s of steps)"


def point_text(point: Any) -> str:
    """One measured (or not measured) batch of a throughput sweep, in words."""
    if point.measured:
        return (f"batch {point.batch_size}: {point.samples_per_s:,.1f} samples/s "
                f"(step {point.step_s * 1e3:,.1f} ms; {point.seconds:.1f} s)")
    return f"batch {point.batch_size}: {point.error}"


@contextlib.contextmanager
def bench_progress(command: str) -> Iterator[tuple[Callable[[int], None] | None,
                                                   Callable[[Any], None] | None]]:
    """``(on_measure, on_point)`` for :func:`batchfit.speed.bench.bench`: a bar over the
    measured batches (at most 8 for the knee) on a terminal; elsewhere one line per batch
    measured or skipped (:func:`point_text`)."""
    if not on_terminal():
        reporter = Progress(command)
        reporter.update("predicting the largest batch, then measuring")
        try:
            yield None, lambda point: reporter.done(point_text(point))
        finally:
            reporter.close()
        return
    from rich.progress import BarColumn, TextColumn, TimeElapsedColumn
    from rich.progress import Progress as Bar

    with Bar(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(),
             console=_err, transient=True) as bar:
        task = bar.add_task("measuring", total=8)

        def on_measure(batch: int) -> None:
            bar.update(task, advance=1, description=f"measuring batch {batch}")

        yield on_measure, None
