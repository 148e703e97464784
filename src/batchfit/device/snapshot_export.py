"""A predicted step as a CUDA memory snapshot, in the format torch writes.

People look at GPU memory in torch's own viewer: a process records the caching
allocator's actions (``torch.cuda.memory._record_memory_history()``), dumps them with
``torch.cuda.memory._dump_snapshot(path)``, and opens the pickle in pytorch.org/memory_viz
or ``python -m torch.cuda._memory_viz``. :func:`predicted_snapshot` writes the same
dictionary for a step batchfit traced, before the job runs: the steady step replayed
through the allocator model as a loop runs it (:mod:`batchfit.device.timeline`), with
the addresses and sizes of that replay.

What it holds, as ``torch.cuda.memory._snapshot()`` documents its ``Snapshot``:

* ``device_traces[0]``: the allocator's actions over one steady step, the window a user
  records after a warm-up step: the previous step's leftovers freed, then the last step
  the loop replayed. ``alloc`` entries carry the size requested, ``free_requested`` and
  ``free_completed`` the same (one stream: a free completes at once), ``segment_alloc``
  and ``segment_free`` the segment's size (``record_trace`` in c10/cuda/
  CUDACachingAllocator.cpp), and ``oom`` a cuDNN workspace the replay could not give
  (torch then runs another algorithm; :func:`batchfit.device.timeline.is_fallible`).
* ``segments``: every segment at the end of that step (when ``_snapshot()`` would be
  called), its blocks in address order with their state, size and size requested.
* Frames: one per allocation, naming batchfit's op as the function and the module path
  as the file (``<root>`` for the model itself), and one naming the phase and category:
  the viewer's stack for each block.

Only the default (segment-caching) allocator is written; ``expandable_segments``
allocations map pages into one growing segment, which this model does not give
addresses for.

Example:
    >>> from batchfit.device.profile import DeviceProfile
    >>> from batchfit.engine.tracer import Category, Event, EventKind, Phase
    >>> alloc = Event(EventKind.ALLOC, 1, 3 << 20, Category.ACTIVATIONS, "fc", "aten.mm", Phase.FORWARD)
    >>> free = Event(EventKind.FREE, 1, 3 << 20, Category.ACTIVATIONS, "fc", "", Phase.FORWARD)
    >>> gpu = DeviceProfile.cuda(8 << 30, (8, 0), context_bytes=0, workspace_bytes=0)
    >>> snapshot = predicted_snapshot([alloc, free], gpu)
    >>> [entry["action"] for entry in snapshot["device_traces"][0]]
    ['alloc', 'free_requested', 'free_completed']
    >>> [(s["total_size"] >> 20, s["segment_type"]) for s in snapshot["segments"]]
    [(20, 'large')]
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from batchfit.device.allocator import AllocatorOutOfMemory, CachingAllocator
from batchfit.device.profile import DeviceProfile
from batchfit.device.timeline import _loop, _setup_end, loop_steps, needed_bytes
from batchfit.engine.tracer import Event, EventKind
from batchfit.errors import InvalidInputError

#: The frame of the cuBLAS workspace, which the replay allocates before anything else.
_WORKSPACE_FRAMES = ({"filename": "<cuBLAS>", "line": 0, "name": "cuBLAS workspace"},
                     {"filename": "batchfit", "line": 0, "name": "context_workspace"})


class _RecordingAllocator(CachingAllocator):
    """The caching allocator model, keeping every action as a snapshot trace entry."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.actions: list[dict[str, Any]] = []

    def malloc(self, nbytes: int) -> int:
        try:
            handle = super().malloc(nbytes)
        except AllocatorOutOfMemory:
            self.actions.append(_entry("oom", None, nbytes))
            raise
        if nbytes:
            self.actions.append(_entry("alloc", handle, nbytes))
        return handle

    def free(self, handle: int) -> None:
        block = self._live.get(handle)
        requested = block.requested if block is not None else 0  # reset by the free
        super().free(handle)
        if block is not None:
            self.actions.append(_entry("free_requested", handle, requested))
            self.actions.append(_entry("free_completed", handle, requested))

    def _new_segment(self, nbytes: int, small: bool) -> Any:
        block = super()._new_segment(nbytes, small)
        self.actions.append(_entry("segment_alloc", block.address, nbytes))
        return block

    def _release(self, pool: Any, block: Any) -> None:
        super()._release(pool, block)
        self.actions.append(_entry("segment_free", block.address, block.size))


def _entry(action: str, address: int | None, size: int) -> dict[str, Any]:
    entry: dict[str, Any] = {"action": action, "size": size, "stream": 0, "frames": []}
    if address is not None:
        entry["addr"] = address
    else:
        entry["device_free"] = 0
    return entry


def predicted_snapshot(events: Sequence[Event], device: DeviceProfile) -> dict[str, Any]:
    """The steady step of ``events`` on the CUDA ``device`` as ``torch.cuda.memory._snapshot()``
    would return it after recording that step (see the module docstring).

    The replay runs at the capacity the step needs (:func:`batchfit.device.timeline.needed_bytes`)
    for as many steps as the loop takes to repeat itself, as the estimate's does, so the
    segments and blocks are the ones its figures come from.

    Raises:
        InvalidInputError: ``device`` is not a CUDA target, or its allocator uses
            expandable segments.
    """
    if not device.is_cuda:
        raise InvalidInputError("a CUDA memory snapshot is of a step on a GPU: give a GPU "
                                "(--gpu NAME)")
    if device.allocator.expandable_segments:
        raise InvalidInputError("a predicted snapshot is written for the default caching "
                                "allocator only, not expandable_segments:True")
    capacity = needed_bytes(events, device)
    steps = loop_steps(events, device, capacity) if events else 0
    allocator = _replay(events, device, capacity, steps)
    frames = _frames_in_order(events, device, steps)
    labelled = [i for i, entry in enumerate(allocator.actions)
                if entry["action"] in ("alloc", "oom")]
    if len(labelled) != len(frames):  # pragma: no cover - the replay's own invariant
        raise AssertionError("the replay's allocations do not match the step's events")
    live_frames: dict[int, list[dict[str, Any]]] = {}
    for index, frame in zip(labelled, frames):
        entry = allocator.actions[index]
        entry["frames"] = frame
        if entry["action"] == "alloc":
            live_frames[entry["addr"]] = frame
    if steps > 1:  # the replay is deterministic: the steps before it made the same actions
        start = len(_replay(events, device, capacity, steps - 1).actions)
    else:  # after the setup's allocations
        before = len(frames) - _allocations(_step(events)) if steps else len(frames)
        start = labelled[before - 1] + 1 if before else 0
    return {
        "segments": _segments(allocator, live_frames),
        "device_traces": [allocator.actions[start:]],
        "allocator_settings": _settings(device),
    }


def _replay(events: Sequence[Event], device: DeviceProfile, capacity: int,
            steps: int) -> _RecordingAllocator:
    """The loop's replay for ``steps`` steps, ending with the last step (no frees after it)."""
    allocator = _RecordingAllocator(capacity, config=device.allocator)
    if events:
        _loop(events, device, capacity, steps, allocator=allocator)
    return allocator


def write_snapshot(snapshot: dict[str, Any], path: str | Path) -> Path:
    """Pickle ``snapshot`` to ``path`` as ``torch.cuda.memory._dump_snapshot`` does.

    Raises:
        InvalidInputError: the file cannot be written.
    """
    path = Path(path)
    try:
        with path.open("wb") as f:
            pickle.dump(snapshot, f)
    except OSError as exc:
        raise InvalidInputError(f"cannot write the snapshot {path}: {exc.strerror}") from exc
    return path


def _step(events: Sequence[Event]) -> Sequence[Event]:
    return events[_setup_end(events):]


def _allocations(events: Sequence[Event]) -> int:
    return sum(1 for e in events if e.kind is EventKind.ALLOC and e.nbytes)


def _frames_in_order(events: Sequence[Event], device: DeviceProfile,
                     steps: int) -> list[list[dict[str, Any]]]:
    """The frames of every allocation the loop makes, in the order it makes them: the cuBLAS
    workspace, the setup's, then the step's once per step (the frees between steps
    allocate nothing)."""
    def of(event: Event) -> list[dict[str, Any]]:
        return [{"filename": event.module or "<root>", "line": 0, "name": event.op or "?"},
                {"filename": "batchfit", "line": 0,
                 "name": f"{event.phase.value}: {event.category.value}"}]

    step = _step(events)
    setup = events[:len(events) - len(step)]
    allocs = [e for e in setup if e.kind is EventKind.ALLOC and e.nbytes]
    frames = [list(_WORKSPACE_FRAMES)] if device.workspace_bytes and events else []
    frames += [of(e) for e in allocs]
    step_frames = [of(e) for e in step if e.kind is EventKind.ALLOC and e.nbytes]
    for _ in range(steps):
        frames += step_frames
    return frames


def _segments(allocator: _RecordingAllocator,
              live_frames: dict[int, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    segments = []
    for blocks in allocator._segment_blocks():
        infos = [{"address": b.address, "size": b.size,
                  "requested_size": b.requested if b.allocated else 0,
                  "state": "active_allocated" if b.allocated else "inactive",
                  "frames": live_frames.get(b.address, []) if b.allocated else []}
                 for b in blocks]
        allocated = sum(b.size for b in blocks if b.allocated)
        segments.append({
            "device": 0, "address": blocks[0].address,
            "total_size": sum(b.size for b in blocks), "stream": 0,
            "segment_type": "small" if blocks[0].small else "large",
            "segment_pool_id": (0, 0), "allocated_size": allocated, "active_size": allocated,
            "requested_size": sum(i["requested_size"] for i in infos),
            "is_expandable": False, "frames": [], "blocks": infos})
    return segments


def _settings(device: DeviceProfile) -> dict[str, Any]:
    """The allocator options, as torch's ``_memory_snapshot`` reports them
    (:func:`batchfit.device.snapshot.allocator_config_of` reads them back)."""
    config = device.allocator
    divisions = config.roundup_power2_divisions
    return {
        "PYTORCH_CUDA_ALLOC_CONF": "" if str(config) == "default" else str(config),
        "max_split_size": -1 if config.max_split_size_bytes is None
        else config.max_split_size_bytes,
        "roundup_power2_divisions": {str(1 << 20): divisions} if divisions else {},
        "expandable_segments": False,
    }
