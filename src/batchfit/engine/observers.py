"""Observers of a traced step (:mod:`batchfit.engine.driver`): what the driver asks of
something that watches the step besides the memory tracer, and how it enters them."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any, Protocol


class StepObserver(Protocol):
    """Something that watches the traced step besides the memory tracer.

    :meth:`observing` is entered (above the tracer, so it sees every op the step runs)
    around each part of the run: the forward and backward on the fake module, and the
    optimizer phase, which may run on meta twins of the parameters. :meth:`steady` says
    whether what runs next belongs to the steady-state step (True) or to the first step,
    which creates the optimizer state (False); it is called before each part whose answer
    changes, and the driver starts each part in the steady state unless told otherwise.
    """

    def observing(self) -> contextlib.AbstractContextManager[Any]:
        """Intercept the ops of one part of the run."""

    def steady(self, flag: bool) -> None:
        """What runs next is (True) or is not (False) the steady step."""


@contextlib.contextmanager
def observing(observers: Sequence[StepObserver]) -> Iterator[None]:
    """Every observer's :meth:`~StepObserver.observing`, entered in order; each part of the
    run starts as the steady step."""
    with contextlib.ExitStack() as stack:
        for observer in observers:
            stack.enter_context(observer.observing())
            observer.steady(True)
        yield


def mark_steady(observers: Sequence[StepObserver], flag: bool) -> None:
    for observer in observers:
        observer.steady(flag)
