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
* ``batchfit``: batchfit's own key, which torch's readers ignore: ``peak_segments``, the
  segments as they are when the step's allocated memory peaks (what the estimate's
  breakdown describes), and ``peak_trace_index``, that moment in ``device_traces[0]``.
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

from batchfit.device.allocator import CachingAllocator
from batchfit.device.allocator_rules import AllocatorOutOfMemory
from batchfit.device.profile import DeviceProfile
from batchfit.device.timeline import _loop, _setup_end, loop_steps, needed_bytes
from batchfit.engine.tracer import Event, EventKind
from batchfit.errors import InvalidInputError

#: The frame of the cuBLAS workspace, which the replay allocates before anything else.
_WORKSPACE_FRAMES = ({"filename": "<cuBLAS>", "line": 0, "name": "cuBLAS workspace"},
                     {"filename": "batchfit", "line": 0, "name": "context_workspace"})


class _RecordingAllocator(CachingAllocator):
    """The caching allocator model, keeping every action as a snapshot trace entry."""

    def __init__(self, capacity_bytes: int, config: Any, watch_from: int | None = None):
        super().__init__(capacity_bytes, config=config)
        self.actions: list[dict[str, Any]] = []
        #: from this action on, the layout at the most allocated bytes is kept
        self.watch_from = watch_from
        self.peak_action = -1
        self.peak_layout: list[list[tuple[int, int, bool, int, bool]]] = []
        self._peak_bytes = -1

    def malloc(self, nbytes: int) -> int:
        try:
            handle = super().malloc(nbytes)
        except AllocatorOutOfMemory:
            self.actions.append(_entry("oom", None, nbytes))
            raise
        if nbytes:
            self.actions.append(_entry("alloc", handle, nbytes))
            if (self.watch_from is not None and len(self.actions) > self.watch_from
                    and self.allocated_bytes > self._peak_bytes):
                self._peak_bytes = self.allocated_bytes
                self.peak_action = len(self.actions) - 1
                self.peak_layout = self.layout_now()
        return handle

    def layout_now(self) -> list[list[tuple[int, int, bool, int, bool]]]:
        """Every segment's blocks as (address, size, allocated, requested, small)."""
        return [[(b.address, b.size, b.allocated, b.requested, b.small) for b in blocks]
                for blocks in self._segment_blocks()]

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
    frames = _frames_in_order(events, device, steps)
    start = _window_start(events, device, capacity, steps, len(frames))
    allocator = _replay(events, device, capacity, steps, watch_from=start)
    labelled = [i for i, entry in enumerate(allocator.actions)
                if entry["action"] in ("alloc", "oom")]
    if len(labelled) != len(frames):  # pragma: no cover - the replay's own invariant
        raise AssertionError("the replay's allocations do not match the step's events")
    for index, frame in zip(labelled, frames):
        allocator.actions[index]["frames"] = frame
    at_peak = _live_frames(allocator.actions[:allocator.peak_action + 1])
    return {
        "segments": _segments(allocator.layout_now(), _live_frames(allocator.actions)),
        "device_traces": [allocator.actions[start:]],
        "allocator_settings": _settings(device),
        # batchfit's own key (torch's readers ignore it): the segments when the step's
        # allocated memory peaks, and that moment's index in device_traces[0]
        "batchfit": {"peak_segments": _segments(allocator.peak_layout, at_peak),
                     "peak_trace_index": allocator.peak_action - start},
    }


def _window_start(events: Sequence[Event], device: DeviceProfile, capacity: int, steps: int,
                  allocations: int) -> int:
    """Where the recorded window starts in the loop's actions: after the steps before the
    last (the replay is deterministic, so they made the same actions), or after the
    setup's allocations when the loop runs one step."""
    if steps > 1:
        return len(_replay(events, device, capacity, steps - 1).actions)
    actions = _replay(events, device, capacity, steps).actions
    labelled = [i for i, e in enumerate(actions) if e["action"] in ("alloc", "oom")]
    before = allocations - _allocations(_step(events)) if steps else allocations
    return labelled[before - 1] + 1 if before else 0


def _live_frames(actions: Sequence[dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
    """The frames of the allocations live after ``actions``, by address."""
    live: dict[int, list[dict[str, Any]]] = {}
    for entry in actions:
        if entry["action"] == "alloc":
            live[entry["addr"]] = entry["frames"]
        elif entry["action"] == "free_completed":
            live.pop(entry["addr"], None)
    return live


def _replay(events: Sequence[Event], device: DeviceProfile, capacity: int, steps: int,
            watch_from: int | None = None) -> _RecordingAllocator:
    """The loop's replay for ``steps`` steps, ending with the last step (no frees after it)."""
    allocator = _RecordingAllocator(capacity, device.allocator, watch_from)
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


def _segments(layout: Sequence[Sequence[tuple[int, int, bool, int, bool]]],
              frames: dict[int, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Segments in ``_snapshot()``'s form from :meth:`_RecordingAllocator.layout_now`."""
    segments = []
    for blocks in layout:
        infos = [{"address": address, "size": size,
                  "requested_size": requested if allocated else 0,
                  "state": "active_allocated" if allocated else "inactive",
                  "frames": frames.get(address, []) if allocated else []}
                 for address, size, allocated, requested, _ in blocks]
        used = sum(i["size"] for i in infos if i["state"] == "active_allocated")
        segments.append({
            "device": 0, "address": blocks[0][0], "total_size": sum(i["size"] for i in infos),
            "stream": 0, "segment_type": "small" if blocks[0][4] else "large",
            "segment_pool_id": (0, 0), "allocated_size": used, "active_size": used,
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
