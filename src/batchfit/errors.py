"""The exceptions batchfit raises.

Every error a user can cause derives from :class:`BatchfitError` and carries a
one-line message that says what is wrong and how to fix it. The CLI prints that
line and exits with :attr:`BatchfitError.exit_code`.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Mapping
from typing import Any

#: How the caller names options: None is Python's (keywords), else keyword -> CLI flag.
_FLAGS: contextvars.ContextVar[Mapping[str, str] | None] = contextvars.ContextVar(
    "batchfit_option_flags", default=None)


@contextlib.contextmanager
def option_vocabulary(flags: Mapping[str, str]) -> Iterator[None]:
    """Messages raised inside name options as ``flags`` does (keyword -> flag), not as
    keywords: the CLI wraps each command in this, with its one table of flags."""
    token = _FLAGS.set(flags)
    try:
        yield
    finally:
        _FLAGS.reset(token)


def option(keyword: str, value: Any = None) -> str:
    """An option, optionally with a value, in the caller's vocabulary: ``seq_len=512`` for a
    Python caller, ``--seq-len 512`` on the command line (a bare flag for ``True``, a
    switch's off flag for ``False``).

    Example:
        >>> option("seq_len", 512)
        'seq_len=512'
    """
    flags = _FLAGS.get()
    if flags is None or keyword not in flags:
        return keyword if value is None else f"{keyword}={value!r}"
    if value is False and f"{keyword}=False" in flags:  # a switch's off flag
        return flags[f"{keyword}=False"]
    flag = flags[keyword]
    return flag if value is None or value is True else f"{flag} {value}"


class BatchfitError(Exception):
    """Base class of every batchfit error. ``exit_code`` is what the CLI returns."""

    exit_code = 2


class InvalidInputError(BatchfitError, ValueError):
    """A malformed option: a bad shape, size, optimizer, precision or GPU name."""


class MemoryBelowOverheadError(InvalidInputError):
    """A memory size that cannot even hold the device's fixed overheads (the CUDA context and
    the cuBLAS workspaces), so no step fits whatever the batch: a mistyped ``--memory``.

    Attributes:
        needed_bytes: the context plus the workspaces.
        given_bytes: the memory given.
    """

    def __init__(self, message: str, needed_bytes: int, given_bytes: int):
        super().__init__(message)
        self.needed_bytes = needed_bytes
        self.given_bytes = given_bytes


class ModelSpecError(BatchfitError, ValueError):
    """A model specification that cannot be resolved into a model."""


class ModelForwardError(BatchfitError, RuntimeError):
    """The user's model raised while it was being traced.

    Attributes:
        module: dotted path of the innermost module that was running ("" is the root).
        op: the operator that failed, when known.
    """

    def __init__(self, message: str, module: str | None = None, op: str | None = None):
        super().__init__(message)
        self.module = module
        self.op = op


class InputShapeError(ModelForwardError):
    """The input spec does not fit the model; ``expected`` is the inferred shape if known."""

    def __init__(self, message: str, module: str | None = None, op: str | None = None,
                 expected: tuple[int, ...] | None = None):
        super().__init__(message, module, op)
        self.expected = expected


class UntraceableError(ModelForwardError):
    """The trace cannot continue: an op that fake tensors cannot run (data-dependent
    output, a custom kernel without a meta implementation)."""


class DoesNotFitError(BatchfitError):
    """Even the smallest batch does not fit the budget.

    Attributes:
        needed_bytes: device bytes needed at the smallest batch.
        available_bytes: the budget.
    """

    exit_code = 3

    def __init__(self, message: str, needed_bytes: int, available_bytes: int):
        super().__init__(message)
        self.needed_bytes = needed_bytes
        self.available_bytes = available_bytes

    def to_dict(self) -> dict[str, object]:
        """The verdict as JSON-ready data (``--json`` prints it on exit 3)."""
        return {"fits": False, "verdict": str(self), "needed_bytes": self.needed_bytes,
                "available_bytes": self.available_bytes}


class TrialError(BatchfitError, RuntimeError):
    """A real trial could not run for a reason other than memory: its process died before
    the memory cap was set, it timed out or could not be started, or (distributed) another
    rank's trial raised."""
