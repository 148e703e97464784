"""The exceptions batchfit raises.

Every error a user can cause derives from :class:`BatchfitError` and carries a
one-line message that says what is wrong and how to fix it. The CLI prints that
line and exits with :attr:`BatchfitError.exit_code`.
"""

from __future__ import annotations


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
