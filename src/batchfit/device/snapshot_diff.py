"""Predicted against real, allocation by allocation: the diff of two memory snapshots.

:mod:`batchfit.device.snapshot` counts allocation sizes; this module names them. Both
snapshots, the real one (``torch.cuda.memory._dump_snapshot``) and batchfit's predicted one
(:mod:`batchfit.device.snapshot_export`), are read the same way
(:func:`~batchfit.device.snapshot.read_allocations`), their allocations of at least
``min_bytes`` are rounded as the allocator rounds them, and the two sequences of sizes are
aligned in order (``difflib.SequenceMatcher``: the longest runs of equal sizes first). What
is left unmatched is:

* *lacking*: allocations the GPU made and the prediction lacks (memory batchfit does not
  model), grouped by the module and op their frames name;
* *adding*: allocations the prediction adds and the GPU never made (memory batchfit
  assumes), grouped by batchfit's module and op.

A size on one side only is one lacking and one adding allocation. With them, the slack of
each side: reserved minus allocated bytes when the allocated bytes peak, what the caching
allocator holds cached and unused at the moment that counts. The prediction's own export
read back as the real snapshot differs in nothing.

Example:
    >>> def snapshot(sizes, module):
    ...     trace = [{"action": "segment_alloc", "addr": 0, "size": 64 << 20}]
    ...     for i, size in enumerate(sizes):
    ...         frames = [{"filename": module, "line": 0, "name": "aten.mm"},
    ...                   {"filename": "batchfit", "line": 0, "name": "forward: activations"}]
    ...         trace.append({"action": "alloc", "addr": i << 24, "size": size, "frames": frames})
    ...     blocks = [{"size": 64 << 20, "state": "inactive"}]
    ...     return {"segments": [{"total_size": 64 << 20, "blocks": blocks}],
    ...             "device_traces": [trace]}
    >>> diff = diff_snapshots(snapshot([4 << 20, 8 << 20], "fc"), snapshot([4 << 20], "fc"))
    >>> [(g.module, g.op, g.count, g.total_bytes >> 20) for g in diff.lacking]
    [('fc', 'aten.mm', 1, 8)]
    >>> diff.adding, diff.matched_allocations
    ((), 1)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from difflib import SequenceMatcher
from typing import Any

from batchfit.device.allocator import AllocatorConfig
from batchfit.device.snapshot import (
    DEFAULT_MIN_BYTES,
    RealAllocations,
    allocator_config_of,
    read_allocations,
)


@dataclass(frozen=True)
class AllocationGroup:
    """Unmatched allocations of one module and op: how many, and their rounded bytes."""

    module: str  # "" for the model itself
    op: str
    count: int
    total_bytes: int

    def to_dict(self) -> dict[str, Any]:
        return {"module": self.module, "op": self.op, "count": self.count,
                "total_bytes": self.total_bytes}


@dataclass(frozen=True)
class SnapshotDiff:
    """A real snapshot against the predicted one (see the module docstring).

    Attributes:
        matched_allocations: allocations aligned with one of the same size on the other side.
        lacking: the real allocations the prediction lacks, by (module, op), most bytes first.
        adding: the predicted allocations the GPU never made, by (module, op), most bytes first.
        real_slack_bytes / predicted_slack_bytes: reserved minus allocated bytes when each
            side's allocated bytes peak.
        min_bytes: allocations smaller than this were left out of the alignment.
    """

    matched_allocations: int
    lacking: tuple[AllocationGroup, ...]
    adding: tuple[AllocationGroup, ...]
    real_slack_bytes: int
    predicted_slack_bytes: int
    min_bytes: int

    @property
    def lacking_bytes(self) -> int:
        return sum(g.total_bytes for g in self.lacking)

    @property
    def adding_bytes(self) -> int:
        return sum(g.total_bytes for g in self.adding)

    @property
    def slack_difference_bytes(self) -> int:
        """Real minus predicted slack (positive: the GPU caches more than predicted)."""
        return self.real_slack_bytes - self.predicted_slack_bytes

    @property
    def is_empty(self) -> bool:
        """No allocation on one side only, and the same slack."""
        return not self.lacking and not self.adding and not self.slack_difference_bytes

    def to_dict(self) -> dict[str, Any]:
        return {"matched_allocations": self.matched_allocations,
                "lacking": [g.to_dict() for g in self.lacking],
                "adding": [g.to_dict() for g in self.adding],
                "lacking_bytes": self.lacking_bytes, "adding_bytes": self.adding_bytes,
                "real_slack_bytes": self.real_slack_bytes,
                "predicted_slack_bytes": self.predicted_slack_bytes,
                "slack_difference_bytes": self.slack_difference_bytes,
                "min_bytes": self.min_bytes}


def diff_snapshots(real: dict[str, Any], predicted: dict[str, Any], device: int | None = None,
                   min_bytes: int = DEFAULT_MIN_BYTES) -> SnapshotDiff:
    """The allocations ``real`` has and ``predicted`` lacks, and the reverse.

    Args:
        real: a real snapshot (:func:`~batchfit.device.snapshot.load_snapshot`).
        predicted: batchfit's snapshot of the same step
            (:meth:`~batchfit.answers.estimate.MemoryEstimate.predicted_snapshot`).
        device: the real snapshot's device index; None for its only recorded one.
        min_bytes: leave out allocations smaller than this (the small pool's many scalars
            would swamp the alignment, and none decides a fit).

    Raises:
        InvalidInputError: a snapshot recorded no allocator actions (or several devices).
    """
    rounding = (allocator_config_of(real) or AllocatorConfig()).round_size
    real_side, predicted_side = read_allocations(real, device), read_allocations(predicted)
    real_seq = _large(real_side, rounding, min_bytes)
    predicted_seq = _large(predicted_side, rounding, min_bytes)
    matcher = SequenceMatcher(None, [size for size, _ in real_seq],
                              [size for size, _ in predicted_seq], autojunk=False)
    matched, lacking, adding = 0, [], []
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            matched += i2 - i1
        else:
            lacking += real_seq[i1:i2]
            adding += predicted_seq[j1:j2]
    return SnapshotDiff(
        matched_allocations=matched, lacking=_groups(lacking), adding=_groups(adding),
        real_slack_bytes=real_side.slack_at_peak_bytes,
        predicted_slack_bytes=predicted_side.slack_at_peak_bytes, min_bytes=min_bytes)


def _large(side: RealAllocations, rounding: Any,
           min_bytes: int) -> list[tuple[int, tuple[str, str]]]:
    places = side.places or (("", ""),) * len(side.sizes)
    return [(rounding(size), place) for size, place in zip(side.sizes, places)
            if size >= min_bytes]


def _groups(allocations: Sequence[tuple[int, tuple[str, str]]]) -> tuple[AllocationGroup, ...]:
    totals: dict[tuple[str, str], list[int]] = {}
    for size, place in allocations:
        entry = totals.setdefault(place, [0, 0])
        entry[0] += 1
        entry[1] += size
    groups = (AllocationGroup(module, op, count, nbytes)
              for (module, op), (count, nbytes) in totals.items())
    return tuple(sorted(groups, key=lambda g: (-g.total_bytes, g.module, g.op)))
