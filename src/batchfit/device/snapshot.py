"""Compare a predicted step with a real CUDA memory snapshot of the same step.

The emulation's misses on real GPUs (``benchmarks/gpu_brackets.py``) cannot be traced
to a cause from out-of-memory brackets alone: a bracket says the step needed more (or
less) than predicted, not which allocation differs. A CUDA memory snapshot does. With
``torch.cuda.memory._record_memory_history()`` on, the caching allocator records every
action it takes; ``torch.cuda.memory._dump_snapshot(path)`` pickles them, with the
segments held at the end (format: the ``Snapshot`` TypedDict in the docstring of
``torch.cuda.memory._snapshot``). This module reads the allocations of the recorded
window and sets them against the allocations batchfit traced for one step:

* peaks: the real allocated and reserved peaks of the window next to the predicted ones;
* sizes: how many allocations of each size (rounded to the allocator's 512 B) the GPU made
  and how many batchfit predicted, largest byte differences first, each labelled with
  batchfit's op and module and the first frame of the real stack outside torch;
* order: the first place where the sequence of large allocations differs.

A size only the GPU has is memory batchfit does not model (an unseen copy, a library
workspace); a size only batchfit has is memory it assumes and the GPU never allocated.

Record exactly the step to compare (after a warm-up step, so that cuDNN's benchmark search
and the autocast weight cache are behind it): recording more steps multiplies the counts.
``benchmarks/gpu_snapshot.py`` does this for a row of the GPU brackets.

Example:
    >>> from batchfit.device.snapshot import read_allocations
    >>> segment = {"total_size": 20 << 20, "blocks": [{"size": 20 << 20, "state": "inactive"}]}
    >>> snapshot = {"segments": [segment], "device_traces": [[
    ...     {"action": "segment_alloc", "addr": 0, "size": 20 << 20},
    ...     {"action": "alloc", "addr": 0, "size": 4 << 20, "frames": []},
    ...     {"action": "free_completed", "addr": 0, "size": 4 << 20, "frames": []}]]}
    >>> real = read_allocations(snapshot)
    >>> real.peak_allocated_bytes >> 20, real.peak_reserved_bytes >> 20, real.sizes
    (4, 20, (4194304,))
"""

from __future__ import annotations

import pickle
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchfit.device.allocator import AllocatorConfig
from batchfit.engine.tracer import Event, EventKind, Phase
from batchfit.errors import InvalidInputError

#: Allocations below this are left out of the size and order comparison (the small pool,
#: scalars and per-channel statistics: many, and none decides a fit).
DEFAULT_MIN_BYTES = 1 << 20
_RECORD_HINT = ("record the step with torch.cuda.memory._record_memory_history() on, then "
                "torch.cuda.memory._dump_snapshot(path)")


@dataclass(frozen=True)
class RealAllocations:
    """The allocations a recorded window made on one device.

    Attributes:
        sizes: the bytes of each allocation in order (as requested, like the trace's).
        labels: for each allocation, the first stack frame outside torch (``file:line
            function``), or "" when the snapshot has no Python frames.
        peak_allocated_bytes: the most bytes in live allocations during the window,
            counting those alive when it started.
        peak_reserved_bytes: the most bytes in cudaMalloc'd segments during the window.
        oom_count: out-of-memory errors the allocator raised in the window.
        places: for each allocation, its ``(module, op)`` read from its frames
            (:func:`frame_place`).
        reserved_at_peak_bytes: the bytes in segments when the allocated bytes peak (the
            first time they do); minus ``peak_allocated_bytes``, the allocator's slack there.
    """

    sizes: tuple[int, ...]
    labels: tuple[str, ...]
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    oom_count: int
    places: tuple[tuple[str, str], ...] = ()
    reserved_at_peak_bytes: int = 0

    @property
    def slack_at_peak_bytes(self) -> int:
        """Reserved minus allocated bytes when the allocated bytes peak."""
        return self.reserved_at_peak_bytes - self.peak_allocated_bytes


@dataclass(frozen=True)
class SizeDifference:
    """Allocations of one (rounded) size: how many the GPU made and batchfit predicted."""

    size_bytes: int
    real_count: int
    predicted_count: int
    predicted_label: str  # batchfit's op and module of the first such allocation
    real_label: str  # the real stack's first frame outside torch

    @property
    def difference_bytes(self) -> int:
        """Real minus predicted bytes of this size (positive: batchfit misses memory)."""
        return (self.real_count - self.predicted_count) * self.size_bytes

    def to_dict(self) -> dict[str, Any]:
        return {"size_bytes": self.size_bytes, "real_count": self.real_count,
                "predicted_count": self.predicted_count,
                "difference_bytes": self.difference_bytes,
                "predicted_label": self.predicted_label, "real_label": self.real_label}


@dataclass(frozen=True)
class SnapshotComparison:
    """A predicted step set against a real snapshot of it (see the module docstring).

    Attributes:
        real_peak_allocated_bytes / predicted_peak_allocated_bytes: live bytes at the peak.
        real_peak_reserved_bytes / predicted_peak_reserved_bytes: segment bytes at the peak.
        real_allocations / predicted_allocations: allocations of at least ``min_bytes``.
        differences: sizes whose counts differ, largest byte difference first.
        first_divergence: the index of the first large allocation whose size differs
            between the two sequences (None when one is a prefix of the other).
        real_at_divergence / predicted_at_divergence: ``(size_bytes, label)`` of each
            sequence there (None past its end).
        oom_count: out-of-memory errors in the recorded window.
        min_bytes: the size below which allocations were left out.
    """

    real_peak_allocated_bytes: int
    predicted_peak_allocated_bytes: int
    real_peak_reserved_bytes: int
    predicted_peak_reserved_bytes: int
    real_allocations: int
    predicted_allocations: int
    differences: tuple[SizeDifference, ...]
    first_divergence: int | None
    real_at_divergence: tuple[int, str] | None
    predicted_at_divergence: tuple[int, str] | None
    oom_count: int
    min_bytes: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "real_peak_allocated_bytes": self.real_peak_allocated_bytes,
            "predicted_peak_allocated_bytes": self.predicted_peak_allocated_bytes,
            "real_peak_reserved_bytes": self.real_peak_reserved_bytes,
            "predicted_peak_reserved_bytes": self.predicted_peak_reserved_bytes,
            "real_allocations": self.real_allocations,
            "predicted_allocations": self.predicted_allocations,
            "differences": [d.to_dict() for d in self.differences],
            "first_divergence": self.first_divergence,
            "real_at_divergence": _entry_dict(self.real_at_divergence),
            "predicted_at_divergence": _entry_dict(self.predicted_at_divergence),
            "oom_count": self.oom_count, "min_bytes": self.min_bytes,
        }


def load_snapshot(path: str | Path) -> dict[str, Any]:
    """Read a snapshot pickled by ``torch.cuda.memory._dump_snapshot``.

    Raises:
        InvalidInputError: the file is missing, not a pickle, or not a memory snapshot.
    """
    path = Path(path)
    try:
        with path.open("rb") as f:
            data = pickle.load(f)  # the user's own file, in the format torch writes
    except OSError as exc:
        raise InvalidInputError(f"cannot read the snapshot {path}: {exc.strerror}") from exc
    except Exception as exc:  # whatever unpickling raised, the file is not a snapshot
        raise InvalidInputError(f"{path} is not a pickled CUDA memory snapshot "
                                f"({type(exc).__name__}): {_RECORD_HINT}") from exc
    if not isinstance(data, dict) or "device_traces" not in data or "segments" not in data:
        raise InvalidInputError(f"{path} is not a CUDA memory snapshot (no 'segments' and "
                                f"'device_traces'): {_RECORD_HINT}")
    return data


def read_allocations(snapshot: dict[str, Any], device: int | None = None) -> RealAllocations:
    """The allocations, peaks and OOMs of a snapshot's recorded window.

    Args:
        snapshot: the dictionary of :func:`load_snapshot` (or ``torch.cuda.memory._snapshot()``).
        device: the device index; None for the only device with recorded actions.

    Raises:
        InvalidInputError: no device recorded any action, or several did and ``device`` is
            None, or ``device`` recorded nothing.
    """
    traces = snapshot["device_traces"]
    recorded = [i for i, trace in enumerate(traces) if trace]
    if device is None:
        if len(recorded) != 1:
            raise InvalidInputError(
                "the snapshot has no recorded allocator actions: " + _RECORD_HINT
                if not recorded else
                f"the snapshot recorded devices {recorded}: say which one to compare")
        device = recorded[0]
    if device not in recorded:
        raise InvalidInputError(f"the snapshot recorded nothing on device {device}: "
                                + _RECORD_HINT)
    segments = [s for s in snapshot["segments"] if s.get("device", device) == device]
    # The counters at the end, as the segments show them; the window's actions, walked
    # backwards, give where it started. A block awaiting its free_completed is still
    # allocated, as the walk counts it.
    reserved = sum(s["total_size"] for s in segments)
    allocated = sum(b.get("requested_size", b["size"]) for s in segments for b in s["blocks"]
                    if b["state"] in ("active_allocated", "active_awaiting_free"))
    live: dict[int, int] = {}
    sizes: list[int] = []
    labels: list[str] = []
    places: list[tuple[str, str]] = []
    # the window's running (allocated, reserved) bytes after each action, from zero
    steps: list[tuple[int, int]] = [(0, 0)]
    ooms = 0
    for entry in traces[device]:
        action = entry["action"]
        now_allocated, now_reserved = steps[-1]
        if action == "alloc":
            live[entry["addr"]] = entry["size"]
            sizes.append(entry["size"])
            labels.append(_user_frame(entry.get("frames", ())))
            places.append(frame_place(entry.get("frames", ())))
            steps.append((now_allocated + entry["size"], now_reserved))
        elif action == "free_completed":
            steps.append((now_allocated - live.pop(entry["addr"], entry["size"]), now_reserved))
        elif action == "segment_alloc":
            steps.append((now_allocated, now_reserved + entry["size"]))
        elif action == "segment_free":
            steps.append((now_allocated, now_reserved - entry["size"]))
        elif action == "oom":
            ooms += 1
    start_allocated = allocated - steps[-1][0]
    start_reserved = reserved - steps[-1][1]
    at_peak = max(range(len(steps)), key=lambda i: steps[i][0])  # the first of equal peaks
    return RealAllocations(
        sizes=tuple(sizes), labels=tuple(labels),
        peak_allocated_bytes=start_allocated + steps[at_peak][0],
        peak_reserved_bytes=start_reserved + max(r for _, r in steps), oom_count=ooms,
        places=tuple(places), reserved_at_peak_bytes=start_reserved + steps[at_peak][1])


def frame_place(frames: Sequence[dict[str, Any]]) -> tuple[str, str]:
    """The ``(module, op)`` an allocation's frames name (frames come innermost first).

    batchfit's predicted snapshot (:mod:`batchfit.device.snapshot_export`) names them
    itself: the module path as the first frame's file (``<root>``: the model, read as "")
    and the op as its function, with a second frame from ``batchfit``. A real stack names
    Python code: the module is the model's line (``file:line function``, as
    :class:`SizeDifference`'s real labels), the op the innermost Python function
    (``file_stem.function``, e.g. ``conv._conv_forward``). ("", "") without frames.

    Example:
        >>> frame_place([{"filename": "layer1.0.conv1", "line": 0, "name": "aten.convolution"},
        ...              {"filename": "batchfit", "line": 0, "name": "forward: activations"}])
        ('layer1.0.conv1', 'aten.convolution')
        >>> frame_place([{"filename": "/x/site-packages/torch/nn/modules/conv.py", "line": 456,
        ...               "name": "_conv_forward"},
        ...              {"filename": "/home/me/net.py", "line": 12, "name": "forward"}])
        ('net.py:12 forward', 'conv._conv_forward')
    """
    if len(frames) > 1 and frames[1].get("filename") == "batchfit":
        module = str(frames[0].get("filename", ""))
        return ("" if module == "<root>" else module), str(frames[0].get("name", ""))
    inner = next((f for f in frames if str(f.get("filename", "")).endswith(".py")), None)
    op = f"{Path(inner['filename']).stem}.{inner.get('name', '')}" if inner else ""
    return _user_frame(frames), op


def compare(real: RealAllocations, predicted_sizes: Sequence[int],
            predicted_labels: Sequence[str], predicted_peak_allocated_bytes: int,
            predicted_peak_reserved_bytes: int, min_bytes: int = DEFAULT_MIN_BYTES,
            top: int = 10, allocator: AllocatorConfig | None = None) -> SnapshotComparison:
    """Set a predicted step's allocations against the real ones (see the module docstring).

    Args:
        real: :func:`read_allocations` of the snapshot.
        predicted_sizes / predicted_labels: the bytes and ``op module`` of each allocation
            batchfit traced for the step, in order.
        predicted_peak_allocated_bytes / predicted_peak_reserved_bytes: the predicted peaks.
        min_bytes: leave out allocations smaller than this.
        top: keep this many size differences.
        allocator: the options the sizes are rounded with (the snapshot's own, by default).
    """
    rounding = (allocator or AllocatorConfig()).round_size

    def large(sizes: Sequence[int], labels: Sequence[str]) -> list[tuple[int, str]]:
        return [(rounding(n), label) for n, label in zip(sizes, labels) if n >= min_bytes]

    real_seq = large(real.sizes, real.labels)
    pred_seq = large(predicted_sizes, predicted_labels)
    real_count = Counter(size for size, _ in real_seq)
    pred_count = Counter(size for size, _ in pred_seq)
    real_label = _first_labels(real_seq)
    pred_label = _first_labels(pred_seq)
    differences = sorted(
        (SizeDifference(size, real_count[size], pred_count[size], pred_label.get(size, ""),
                        real_label.get(size, ""))
         for size in real_count.keys() | pred_count.keys()
         if real_count[size] != pred_count[size]),
        key=lambda d: (-abs(d.difference_bytes), d.size_bytes))[:top]
    divergence = next((i for i, (a, b) in enumerate(zip(real_seq, pred_seq)) if a[0] != b[0]),
                      None)
    if divergence is None and len(real_seq) != len(pred_seq):
        divergence = min(len(real_seq), len(pred_seq))
    return SnapshotComparison(
        real_peak_allocated_bytes=real.peak_allocated_bytes,
        predicted_peak_allocated_bytes=predicted_peak_allocated_bytes,
        real_peak_reserved_bytes=real.peak_reserved_bytes,
        predicted_peak_reserved_bytes=predicted_peak_reserved_bytes,
        real_allocations=len(real_seq), predicted_allocations=len(pred_seq),
        differences=tuple(differences), first_divergence=divergence,
        real_at_divergence=_at(real_seq, divergence),
        predicted_at_divergence=_at(pred_seq, divergence),
        oom_count=real.oom_count, min_bytes=min_bytes)


def compare_step(snapshot: dict[str, Any], events: Sequence[Event],
                 predicted_peak_allocated_bytes: int, predicted_peak_reserved_bytes: int,
                 device: int | None = None, min_bytes: int = DEFAULT_MIN_BYTES
                 ) -> SnapshotComparison:
    """:func:`compare` for a traced step: its allocations are the step's own (the setup,
    parameters and inputs, happened before any recorded step), labelled ``op module``."""
    step = [e for e in events if e.kind is EventKind.ALLOC and e.phase is not Phase.SETUP]
    return compare(read_allocations(snapshot, device), [e.nbytes for e in step],
                   [f"{e.op} {e.module}".strip() for e in step],
                   predicted_peak_allocated_bytes, predicted_peak_reserved_bytes, min_bytes,
                   allocator=allocator_config_of(snapshot))


def allocator_config_of(snapshot: dict[str, Any]) -> AllocatorConfig | None:
    """The allocator options the recorded process ran with, from the snapshot's
    ``allocator_settings`` (torch/csrc/cuda/Module.cpp ``_memory_snapshot``:
    ``expandable_segments``; ``max_split_size``, whose unset value ``SIZE_MAX`` reads as
    -1 through ``int64_t``; ``roundup_power2_divisions`` per size interval), or None for a
    snapshot without them (older torch).

    Example:
        >>> allocator_config_of({"allocator_settings": {"expandable_segments": True,
        ...                      "max_split_size": -1}})
        AllocatorConfig(max_split_size_bytes=None, max_non_split_rounding_bytes=20971520, roundup_power2_divisions=0, expandable_segments=True)
    """
    settings = snapshot.get("allocator_settings")
    if not isinstance(settings, dict):
        return None
    max_split = settings.get("max_split_size")
    per_interval = {v for v in (settings.get("roundup_power2_divisions") or {}).values()
                    if isinstance(v, int)}
    if len(per_interval) > 1:
        raise InvalidInputError("the snapshot's process rounded with per-size "
                                "roundup_power2_divisions, which batchfit does not model")
    (divisions,) = per_interval or {0}
    return AllocatorConfig(
        max_split_size_bytes=(max_split if isinstance(max_split, int) and 0 < max_split < 1 << 62
                              else None),
        roundup_power2_divisions=divisions if divisions > 1 else 0,
        expandable_segments=bool(settings.get("expandable_segments", False)))


def _first_labels(seq: list[tuple[int, str]]) -> dict[int, str]:
    labels: dict[int, str] = {}
    for size, label in seq:
        labels.setdefault(size, label)
    return labels


def _at(seq: list[tuple[int, str]], index: int | None) -> tuple[int, str] | None:
    return None if index is None or index >= len(seq) else seq[index]


def _entry_dict(entry: tuple[int, str] | None) -> dict[str, Any] | None:
    return None if entry is None else {"size_bytes": entry[0], "label": entry[1]}


def _user_frame(frames: Sequence[dict[str, Any]]) -> str:
    """The innermost Python frame outside torch and the standard library (the model's line),
    as ``file:line function``; frames come innermost first."""
    for frame in frames:
        name = frame.get("filename", "")
        if _is_model_code(name):
            return f"{Path(name).name}:{frame.get('line', 0)} {frame.get('name', '')}"
    return ""


def _is_model_code(filename: str) -> bool:
    if not filename.endswith(".py") or "/torch/" in filename:
        return False
    return "/lib/python" not in filename or "-packages/" in filename  # not the stdlib
