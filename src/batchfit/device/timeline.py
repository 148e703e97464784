"""Replay a traced step on a target device: the memory timeline, its peak and what
is held at the peak.

On the CPU the answer is the live bytes of every storage (the CPU allocator
returns memory to the system). On CUDA every event goes through the caching
allocator model (:mod:`batchfit.device.allocator`), so the peak is *reserved* memory,
with the cuBLAS workspace held from the start and the CUDA context added on top.

A steady step on CUDA is replayed the way a loop runs it (:func:`loop_steps`): the
step, then the step again in the same allocator, until the allocator is in a state a
step already started from, when every later step repeats one already run (at most
:data:`MAX_LOOP_STEPS`). The caching allocator keeps every segment the first step
cudaMalloc'd; later steps' requests are served from those cached blocks by best fit and
split, and can fragment them where the first step, on an empty allocator, got exact
segments. The capacity a loop needs is what its steps, each on the cache of the steps
before it, need (with cudaMalloc's free-and-retry); across the dev set's inference steps
this is the same as one step for most models and 8-30% more for some (xception, rexnet,
regnetz_b16_evos, xcit, tiny_vit, BiT ResNetV2).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from batchfit.device.allocator_rules import AllocatorOutOfMemory
from batchfit.device.profile import DeviceProfile
from batchfit.engine.trace import alive_at_end
from batchfit.engine.tracer import Category, Event, EventKind, Phase

_WORKSPACE_KEY = -1
_SEGMENT_UNIT = 2 * 1024 * 1024  # every segment is a multiple of this
#: The op name prefix of a cuDNN workspace event (batchfit.engine.tracer).
WORKSPACE_OP = "cudnn workspace"


@dataclass(frozen=True)
class ModuleMemory:
    """Bytes held at the peak by storages created in one module."""

    module: str
    bytes: int  # noqa: A003 - field name mirrors the JSON key
    share: float

    def to_dict(self) -> dict[str, Any]:
        return {"module": self.module, "bytes": self.bytes, "share": round(self.share, 4)}


@dataclass(frozen=True)
class Timeline:
    """Per-event memory of one step on one device.

    ``allocated_bytes[i]`` / ``reserved_bytes[i]`` are the totals after event ``i``;
    ``phases[i]`` is the phase of event ``i``. Reserved equals allocated on the CPU.
    """

    allocated_bytes: tuple[int, ...]
    reserved_bytes: tuple[int, ...]
    phases: tuple[Phase, ...]
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    peak_index: int  # the event at the peak that decides the fit (reserved on CUDA)
    by_category: dict[Category, int]
    top_modules: tuple[ModuleMemory, ...]
    peak_phase: Phase
    peak_op: str
    peak_module: str
    #: steps the loop replayed until the allocator repeated a state (:func:`loop_steps`;
    #: 1 on the CPU or without ``loop``)
    loop_steps: int = 1

    def to_dict(self, max_points: int = 400) -> dict[str, Any]:
        step = max(1, len(self.allocated_bytes) // max_points)
        return {
            "allocated_bytes": list(self.allocated_bytes[::step]),
            "reserved_bytes": list(self.reserved_bytes[::step]),
            "phases": [p.value for p in self.phases[::step]],
        }


#: The most times the loop replays the step while no allocator state repeats. Of 150
#: cached dev-set traces, at the capacity each needs on the 4090's profile, 149 repeat
#: within 8 steps (most after 3 or 4); coatnet_0 repeats after 11, with the same need.
MAX_LOOP_STEPS = 8


def loop_steps(events: Sequence[Event], device: DeviceProfile,
               capacity: int | None = None) -> int:
    """How many times a loop's step runs through one allocator before the loop repeats
    itself, within ``capacity``: until the allocator, after a step and the frees that
    follow it, is in a state a step already started from (:meth:`CachingAllocator.layout
    <batchfit.device.allocator.CachingAllocator.layout>`: the same segments in the same
    order, the same blocks of them free, the same tensors in the others). From then on
    every step replays one already run (the replay is deterministic), so the loop fits
    if these steps do; at most :data:`MAX_LOOP_STEPS`. The first step is never compared:
    it alone runs the cuDNN searches that empty the cache (``EMPTY_CACHE`` marks), so a
    step like it does not come again. Raises AllocatorOutOfMemory when they do not fit."""
    return _loop(events, device, capacity)[0]


def _loop(events: Sequence[Event], device: DeviceProfile, capacity: int | None,
          steps: int | None = None, record: tuple[list[int], list[int]] | None = None,
          skipped: set[int] | None = None, allocator: Any = None) -> tuple[int, Any]:
    """Replay ``events`` as a training or inference loop runs them through one allocator
    (``allocator``, empty, if given: one that records its actions; by default the device's).

    The leading setup events (parameters, buffers, inputs, optimizer state) happen once;
    then the step; then whatever the step allocated and left alive is freed, as the next
    iteration does (``zero_grad(set_to_none=True)`` drops the gradients, rebinding
    ``loss``/``output`` drops those); then the step again with the same keys, until the
    loop repeats itself (:func:`loop_steps`) or ``steps`` times if given (1: no loop).
    A later step's search marks empty nothing (torch's benchmark cache keeps the
    algorithm for the process) and its frees of setup allocations find them gone.

    ``record`` gets the allocated and reserved bytes after every event replayed: the
    setup, the first step, then the frees and step of each later one. A fallible
    workspace that does not fit is left out (its key added to ``skipped``).

    Returns:
        The number of steps run and the allocator. Raises AllocatorOutOfMemory.
    """
    setup_end = _setup_end(events)
    step = events[setup_end:]
    tail = _tail(step)
    if allocator is None:
        allocator = device.allocator.new_allocator(capacity)
    handles: dict[int, int] = {}
    if device.workspace_bytes:
        handles[_WORKSPACE_KEY] = allocator.malloc(device.workspace_bytes)
    searched: set[int] = set()
    _run(events[:setup_end], allocator, handles, searched, record, skipped)
    if not step:
        return 0, allocator
    limit = steps if steps is not None else MAX_LOOP_STEPS
    seen: set[tuple] = set()
    count = 0
    while True:
        _run(step, allocator, handles, searched, record, skipped)
        count += 1
        if count >= limit:
            return count, allocator
        _run(tail, allocator, handles, searched, record, skipped)
        if steps is None:
            owners = {handle: key for key, handle in handles.items()}
            state = allocator.layout(owners)
            if state in seen:
                if record is not None:  # the loop ends with a step, not its frees
                    del record[0][len(record[0]) - len(tail):]
                    del record[1][len(record[1]) - len(tail):]
                return count, allocator
            seen.add(state)


def _tail(step: Sequence[Event]) -> list[Event]:
    """The frees, before the next step, of what ``step`` allocated and left alive."""
    owned = {e.key for e in step if e.kind is EventKind.ALLOC}
    return [Event(EventKind.FREE, e.key, e.nbytes, e.category, e.module, "", e.phase)
            for e in alive_at_end(step) if e.key in owned]


def _setup_end(events: Sequence[Event]) -> int:
    end = 0
    while end < len(events) and events[end].phase is Phase.SETUP:
        end += 1
    return end


def _run(events: Sequence[Event], allocator: Any, handles: dict[int, int], searched: set[int],
         record: tuple[list[int], list[int]] | None, skipped: set[int] | None) -> None:
    """Replay ``events`` into ``allocator`` (the loop's one pass); raises
    AllocatorOutOfMemory unless the allocation that fails is fallible."""
    alloc_kind, free_kind, mark_kind = EventKind.ALLOC, EventKind.FREE, EventKind.EMPTY_CACHE
    malloc, free = allocator.malloc, allocator.free
    for event in events:
        kind = event.kind
        if kind is alloc_kind:
            try:
                handles[event.key] = malloc(event.nbytes)
            except AllocatorOutOfMemory:
                if not is_fallible(event):
                    raise
                if skipped is not None:
                    skipped.add(event.key)
        elif kind is free_kind:
            handle = handles.pop(event.key, None)
            if handle is not None:
                free(handle)
        elif kind is mark_kind and event.key not in searched:
            searched.add(event.key)
            allocator.empty_cache()
        if record is not None:
            record[0].append(allocator.allocated_bytes)
            record[1].append(allocator.reserved_bytes)


def replay_events(events: Sequence[Event], device: DeviceProfile, top: int = 10,
                  loop: bool = True) -> Timeline:
    """Replay ``events`` on ``device`` and describe the peak.

    On CUDA the reserved peak is the smallest allocator capacity with which the
    step runs: the real allocator, when cudaMalloc fails, releases its cached
    free segments and retries, so a cache fragmented by earlier phases does not
    by itself cause an OOM. Without that, the reserved peak of an unlimited
    replay overstates the need (by 15% for ResNet-50 at B=64 in amp-fp16).
    The breakdown is taken at the peak of allocated memory, where the slack
    is the needed reserved memory less what is allocated then. With ``loop`` (a steady
    step on CUDA) the step is replayed as a loop runs it (:func:`loop_steps`) and the
    timeline is the last step's, on the cached segments of the steps before it.
    """
    if not events:
        return Timeline((), (), (), 0, 0, -1, {}, (), Phase.SETUP, "", "")
    phases = tuple(event.phase for event in events)
    skipped: set[int] = set()  # fallible workspaces the replay at the needed capacity skips
    count = 1
    if device.is_cuda:
        steps = None if loop else 1
        needed = _least_capacity(events, device, steps)
        looped: tuple[list[int], list[int]] = ([], [])
        count = _loop(events, device, needed, steps, looped, None if loop else skipped)[0]
        # The loop ends with the last step: its events are the record's last ones.
        setup_end = _setup_end(events)
        offset = len(looped[1]) - len(events)
        mapping = [i if i < setup_end else i + offset for i in range(len(events))]
        allocated, reserved = looped
        peak_reserved = max(reserved)
        reserved = [reserved[i] for i in mapping]
        if loop:
            # The breakdown is taken where the step's own allocated memory peaks: a later
            # step can be handed cached blocks whole (unsplit), which moves its allocated
            # peak to another op although the same tensors are alive. The step alone is
            # the loop's first part, so it runs within ``needed`` too.
            fallible = any(is_fallible(e) for e in events)
            allocated = _replay_cuda(events, device, needed if fallible else None, skipped)[0]
        reserved[max(range(len(reserved)), key=reserved.__getitem__)] = peak_reserved
    else:
        allocated = reserved = _replay_cpu(events)
    peak_index = max(range(len(allocated)), key=allocated.__getitem__)
    by_category, modules = _held_at(events, peak_index, device, skipped)
    if device.is_cuda:
        live = sum(by_category.values()) + device.workspace_bytes
        by_category[Category.ALLOCATOR_SLACK] = max(reserved) - live
    if device.is_cuda or device.context_bytes:
        by_category[Category.CONTEXT] = device.context_bytes + device.workspace_bytes
    if device.nccl_bytes:
        by_category[Category.NCCL] = device.nccl_bytes
    held = sum(modules.values()) or 1
    top_modules = tuple(
        ModuleMemory(name, size, size / held)
        for name, size in sorted(modules.items(), key=lambda kv: -kv[1])[:top])
    peak_event = _last_alloc_at_or_before(events, peak_index)
    return Timeline(
        allocated_bytes=tuple(allocated), reserved_bytes=tuple(reserved), phases=phases,
        peak_allocated_bytes=max(allocated), peak_reserved_bytes=max(reserved),
        peak_index=peak_index, by_category=by_category, top_modules=top_modules,
        peak_phase=events[peak_index].phase, peak_op=peak_event.op if peak_event else "",
        peak_module=peak_event.module if peak_event else "", loop_steps=count)


def needed_bytes(events: Sequence[Event], device: DeviceProfile, loop: bool = True) -> int:
    """Peak live bytes (CPU) or the least allocator capacity the step fits (CUDA; with
    ``loop``, as a loop runs it, :func:`loop_steps`), without the breakdown: the cheap
    number a solver needs."""
    if not events:
        return 0
    if not device.is_cuda:
        return max(_replay_cpu(events))
    return _least_capacity(events, device, None if loop else 1)


def fits_within(events: Sequence[Event], device: DeviceProfile, limit_bytes: int) -> bool:
    """``needed_bytes(events, device) <= limit_bytes``, from one replay instead of the
    ~10 that finding the least capacity takes (a solver's yes/no question)."""
    if not events:
        return limit_bytes >= 0
    if not device.is_cuda:
        return peak_live_bytes(events) <= limit_bytes
    capacity = limit_bytes // _SEGMENT_UNIT * _SEGMENT_UNIT
    return capacity > 0 and _fits(events, device, capacity)


def is_fallible(event: Event) -> bool:
    """Whether torch survives this allocation failing: a benchmarked cuDNN convolution's
    workspace (:mod:`batchfit.engine.cudnn`). When the caching allocator cannot give it
    (after releasing its cached blocks, as for any request), torch catches the
    ``OutOfMemoryError`` and runs another algorithm instead: ``AlgoIterator::try_all``
    in aten/src/ATen/native/cudnn/Conv_v7.cpp, ``run_single_conv``/``try_plans`` in
    Conv_v8.cpp (``catch (c10::OutOfMemoryError& e)``). The replay then goes on without
    that workspace (the fallback's is taken as none: cuDNN's implicit-GEMM algorithms
    need no workspace)."""
    return event.op.startswith(WORKSPACE_OP)


def peak_live_bytes(events: Sequence[Event]) -> int:
    """The most bytes live at once (no allocator: the sizes as requested)."""
    return max(_replay_cpu(events), default=0)


def _replay_cpu(events: Sequence[Event]) -> list[int]:
    total = 0
    sizes: dict[int, int] = {}
    allocated = []
    for event in events:
        if event.kind is EventKind.ALLOC:
            sizes[event.key] = event.nbytes
            total += event.nbytes
        elif event.kind is EventKind.FREE:
            total -= sizes.pop(event.key, 0)
        allocated.append(total)
    return allocated


def _least_capacity(events: Sequence[Event], device: DeviceProfile,
                    steps: int | None = None) -> int:
    """The least capacity the loop (``steps``: see :func:`_loop`) fits in. The one rule
    both :func:`needed_bytes` (what a solver solves with) and :func:`replay_events` (the
    breakdown) use, so that they agree. The unlimited replay bounds it: within its peak
    reserved bytes a capped replay never reaches the cap, so runs the same."""
    unlimited = _loop(events, device, None, steps)[1]
    if not any(is_fallible(e) for e in events):
        return _smallest_capacity(events, device, unlimited.peak_allocated_bytes,
                                  unlimited.peak_reserved_bytes, steps)
    return _smallest_capacity_fallible(events, device, unlimited.peak_reserved_bytes, steps)


def _replay_cuda(events: Sequence[Event], device: DeviceProfile, capacity: int | None,
                 skipped: set[int] | None = None) -> tuple[list[int], list[int]]:
    """Allocated and reserved bytes after each event of one pass (no loop); raises
    AllocatorOutOfMemory. The keys of fallible allocations that did not fit are added to
    ``skipped``."""
    record: tuple[list[int], list[int]] = ([], [])
    _loop(events, device, capacity, 1, record, skipped)
    return record


def _smallest_capacity(events: Sequence[Event], device: DeviceProfile, low: int, high: int,
                       steps: int | None = None) -> int:
    """The least capacity (a multiple of 2 MiB, like every segment) the replay fits in."""
    unit = _SEGMENT_UNIT
    lo, hi = -(-low // unit) - 1, high // unit  # lo fails (or is below allocated), hi fits
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if _fits(events, device, mid * unit, steps):
            hi = mid
        else:
            lo = mid
    return hi * unit


def _smallest_capacity_fallible(events: Sequence[Event], device: DeviceProfile, high: int,
                                steps: int | None = None) -> int:
    """The least capacity above which the replay fits, with fallible workspaces.

    Fitting is not monotone in the capacity then: with more room a workspace is
    allocated, and the blocks it leaves cached can fragment what follows (as in torch),
    so the step can fail at a capacity above one where it fits. The bisection's answer
    is checked at capacities 1, 2, 4, ... segments above it; from the largest that
    fails the search starts again, until none fails. A solver asking "does it fit in
    the budget" then gets the same answer from this number as from :func:`fits_within`
    (up to capacities between two checks).
    """
    unit = _SEGMENT_UNIT
    low = peak_live_bytes([e for e in events if not is_fallible(e)])  # fails below this
    needed = _smallest_capacity(events, device, low, high, steps)
    while True:
        failing = None
        step = unit
        while needed + step < high:
            if not _fits(events, device, needed + step, steps):
                failing = needed + step
            step *= 2
        if failing is None:
            return needed
        needed = _smallest_capacity(events, device, failing + 1, high, steps)


def _fits(events: Sequence[Event], device: DeviceProfile, capacity: int,
          steps: int | None = None) -> bool:
    """Whether the loop (``steps``: see :func:`_loop`) runs within ``capacity``."""
    try:
        _loop(events, device, capacity, steps)
    except AllocatorOutOfMemory:
        return False
    return True


def _held_at(events: Sequence[Event], index: int, device: DeviceProfile,
             skipped: set[int] = frozenset()  # type: ignore[assignment]
             ) -> tuple[dict[Category, int], dict[str, int]]:
    """Live bytes by category and by module (activations and temporaries) after ``index``,
    leaving out the ``skipped`` fallible workspaces (never allocated)."""
    by_category: dict[Category, int] = {}
    modules: dict[str, int] = {}
    for event in alive_at_end(events[: index + 1]):
        if event.key in skipped:
            continue
        size = (device.allocator.round_size(event.nbytes) if device.is_cuda and event.nbytes
                else event.nbytes)
        category = event.category
        by_category[category] = by_category.get(category, 0) + size
        if category in (Category.ACTIVATIONS, Category.TEMPORARIES, Category.AUTOCAST_COPIES):
            name = event.module or "<root>"
            modules[name] = modules.get(name, 0) + size
    return by_category, modules


def _last_alloc_at_or_before(events: Sequence[Event], index: int) -> Event | None:
    for i in range(index, -1, -1):
        if events[i].kind is EventKind.ALLOC:
            return events[i]
    return None
