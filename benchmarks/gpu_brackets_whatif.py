"""What-if replays of the GPU brackets: a rule changed in the allocator replay for one run.

These are experiments, not the engine. Each one swaps a piece of
``batchfit.device.timeline`` or ``batchfit.device.allocator`` in this process (the rows
run in forked children, which inherit the swap), then runs ``gpu_brackets.py`` with the
remaining arguments. Give the run its own ``--tag`` so that the engine's results are
not overwritten, and ``--trace-cache`` so that only the replays run again:

    cd benchmarks && python gpu_brackets_whatif.py --what-if no-workspace --steps 3 \\
        --set I --files memory --rows-from results/gpu_brackets/s10_I120.jsonl \\
        --tag whatif_nows3_I120 --trace-cache /some/dir

What-ifs:

* ``empty-cache`` (until this release; now in the engine, keyed by convolution shape and
  on every convolution torch sends to cuDNN: :mod:`batchfit.engine.cudnn`): its results
  ``whatif_emptycache*_I120`` are kept for the record.
* ``reverse-addresses``: each new segment gets an address below the previous ones
  instead of above. The address only breaks ties between free blocks of equal size
  (the source's ``BlockComparatorSize``), so this measures how much the answers depend
  on a tie-break the real driver decides.
* ``no-workspace``: every cuDNN workspace allocation is dropped (what benchmark mode
  off would give, as modelled).
* ``ideal-allocator``: an allocator that never fragments: a request fails only when the
  live bytes (each rounded to the allocator's 512 B; in all, to whole 2 MiB pages) would
  exceed the capacity; a
  workspace that does not fit is skipped, as in the engine. The least memory any
  allocator could run the traced tensors in: where a row's answer is under its bracket
  even so, the card held fewer tensors than traced; where only the engine's answer is
  under, the replay's fragmentation is what puts it there.

``--steps N`` replays the step N times through one allocator (at least the engine's
:func:`batchfit.device.timeline.loop_steps`: 2, or 3 after a first step with cuDNN
searches); the timeline is the last step's.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_brackets  # noqa: E402

from batchfit.device import allocator as allocator_module  # noqa: E402
from batchfit.device import timeline  # noqa: E402
from batchfit.device.allocator import AllocatorOutOfMemory  # noqa: E402
from batchfit.engine.tracer import Event, EventKind  # noqa: E402

WHAT_IFS = ("reverse-addresses", "no-workspace", "ideal-allocator")


def install(what_if: str | None, steps: int) -> None:
    """Swap the replay's pieces for this process."""
    engine_loop = timeline.loop_events

    def loop_events(events: Sequence[Event]):
        return engine_loop(events, max(steps, timeline.loop_steps(events)))

    timeline.loop_events = loop_events
    if what_if == "reverse-addresses":
        engine_new_segment = allocator_module.CachingAllocator._new_segment

        def _new_segment(self, nbytes: int, small: bool):
            if not getattr(self, "_reversed", False):
                self._reversed, self._next_address = True, 1 << 60
            base = self._next_address - nbytes
            self._next_address = base
            block = engine_new_segment(self, nbytes, small)
            self._next_address = base
            return block

        allocator_module.CachingAllocator._new_segment = _new_segment
    if what_if == "ideal-allocator":
        allocator_module.AllocatorConfig.new_allocator = (
            lambda self, capacity_bytes=None: IdealAllocator(capacity_bytes, self.round_size))
    if what_if == "no-workspace":
        _WORKSPACE_RULE["what_if"] = what_if
        timeline._fits = _fits
        timeline._replay_cuda = _replay_cuda


def _pages(nbytes: int) -> int:
    """``nbytes`` in whole 2 MiB pages (the unit of every segment, and of the capacities
    the replay checks)."""
    return -(-nbytes // (2 << 20)) * (2 << 20)


class IdealAllocator:
    """No fragmentation: the live bytes, in whole 2 MiB pages, against the capacity (the
    what-if ``ideal-allocator``). The interface of
    :class:`batchfit.device.allocator.CachingAllocator` that the replay uses."""

    def __init__(self, capacity_bytes: int | None, round_size) -> None:
        self.capacity_bytes, self._round = capacity_bytes, round_size
        self._live: dict[int, int] = {}
        self._next = 1
        self.allocated_bytes = self.reserved_bytes = 0
        self.peak_allocated_bytes = self.peak_reserved_bytes = 0

    def malloc(self, nbytes: int) -> int:
        size = self._round(nbytes) if nbytes else 0
        reserved = _pages(self.allocated_bytes + size)
        if self.capacity_bytes is not None and reserved > self.capacity_bytes:
            raise AllocatorOutOfMemory(nbytes, size, self.allocated_bytes,
                                       self.reserved_bytes, self.capacity_bytes)
        handle, self._next = self._next, self._next + 1
        self._live[handle] = size
        self.allocated_bytes += size
        self.reserved_bytes = reserved
        self.peak_allocated_bytes = max(self.peak_allocated_bytes, self.allocated_bytes)
        self.peak_reserved_bytes = max(self.peak_reserved_bytes, reserved)
        return handle

    def free(self, handle: int) -> None:
        self.allocated_bytes -= self._live.pop(handle)
        self.reserved_bytes = _pages(self.allocated_bytes)

    def empty_cache(self) -> None:
        """Nothing is cached."""


#: which workspace rule ``_run`` applies ("no-workspace" or none)
_WORKSPACE_RULE = {"what_if": ""}


def _run(events, device, capacity, record=None, skipped=None) -> None:
    """The replay with the what-if's workspace rule (the engine's search marks as in
    ``timeline._fits``); raises AllocatorOutOfMemory."""
    allocator = device.allocator.new_allocator(capacity)
    handles: dict[int, int] = {}
    searched: set[int] = set()
    if device.workspace_bytes:
        allocator.malloc(device.workspace_bytes)
    for event in events:
        if event.kind is EventKind.EMPTY_CACHE:
            if event.key not in searched:
                searched.add(event.key)
                allocator.empty_cache()
        elif event.kind is EventKind.ALLOC:
            workspace = timeline.is_fallible(event)
            if workspace and _WORKSPACE_RULE["what_if"] == "no-workspace":
                if skipped is not None:
                    skipped.add(event.key)
            else:
                try:
                    handles[event.key] = allocator.malloc(event.nbytes)
                except AllocatorOutOfMemory:
                    if not workspace:
                        raise
                    if skipped is not None:
                        skipped.add(event.key)
        elif event.kind is EventKind.FREE:
            handle = handles.pop(event.key, None)
            if handle is not None:
                allocator.free(handle)
        if record is not None:
            record[0].append(allocator.allocated_bytes)
            record[1].append(allocator.reserved_bytes)


def _fits(events, device, capacity) -> bool:
    try:
        _run(events, device, capacity)
    except AllocatorOutOfMemory:
        return False
    return True


def _replay_cuda(events, device, capacity, skipped=None):
    record: tuple[list[int], list[int]] = ([], [])
    _run(events, device, capacity, record, skipped)
    return record


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--what-if", choices=WHAT_IFS)
    parser.add_argument("--steps", type=int, default=2)
    args, rest = parser.parse_known_args(argv)
    if args.steps < 2:
        parser.error("--steps must be at least 2")
    if "--tag" not in rest:
        parser.error("give the run its own --tag")
    install(args.what_if, args.steps)
    gpu_brackets.main(rest)


if __name__ == "__main__":
    main()
