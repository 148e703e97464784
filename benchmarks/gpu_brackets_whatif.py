"""What-if replays of the GPU brackets: a rule changed in the allocator replay for one run.

How it asks batchfit: through ``gpu_brackets.py``, with a rule of the allocator replay
swapped in this process (an experiment, not a user's answer).

These are experiments, not the engine. Each one swaps a piece of
``batchfit.device.timeline`` or ``batchfit.device.allocator`` in this process (the rows
run in forked children, which inherit the swap), then runs ``gpu_brackets.py`` with the
remaining arguments. Give the run its own ``--tag`` so that the engine's results are
not overwritten, and ``--trace-cache`` so that only the replays run again:

    cd benchmarks && python gpu_brackets_whatif.py --what-if no-workspace --steps 3 \\
        --set I --files memory --rows-from results/gpu_brackets/s14_I120.jsonl \\
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
* ``sticky-workspace``: torch keeps the algorithm that ran after a workspace failed.
  When a benchmarked convolution's kept algorithm cannot get its workspace, torch
  searches again and caches the algorithm that then runs (``run_single_conv`` and
  ``try_plans``'s ``benchmark_cache.update`` in aten/src/ATen/native/cudnn/Conv_v8.cpp;
  ``try_all``'s ``cache.insert`` in Conv_v7.cpp), so every later call of that shape uses
  it; the engine asks for the first algorithm's workspace again at every call. Here a
  shape whose workspace failed asks for none from then on (the fallback's workspace is
  taken as none, as in the engine), and the loop's state includes the shapes replaced.
  A workspace's shape is the search mark just before it, so only traces of torch >= 2.0
  (the inference rows) have one.
* ``no-norm-copy``: the fp32 copy CUDA autocast makes of a LayerNorm's or GroupNorm's
  16-bit input (``layer_norm``/``group_norm`` are on its fp32 list, ``cached_cast`` copies)
  is not made: a diagnostic of the norm-heavy families the dev set answers under, not a
  mechanism (torch's source makes the copy).
* ``ideal-allocator``: an allocator that never fragments: a request fails only when the
  live bytes (each rounded to the allocator's 512 B; in all, to whole 2 MiB pages) would
  exceed the capacity; a
  workspace that does not fit is skipped, as in the engine. The least memory any
  allocator could run the traced tensors in: where a row's answer is under its bracket
  even so, the card held fewer tensors than traced; where only the engine's answer is
  under, the replay's fragmentation is what puts it there.

* ``at-card-capacity``: a step fits when its replay runs at the card's own capacity (its
  memory less the context). The engine asks for more: the least capacity above which every
  capacity fits (:func:`batchfit.device.timeline.needed_bytes`), because with fallible
  workspaces fitting is not monotone in the capacity (more room lets a workspace in,
  whose cached segment then fragments what follows), so a step can fit at the card's
  capacity and fail a little above it. This measures what that rule costs.

``--steps N`` replays the step exactly N times through one allocator instead of the
engine's rule (:func:`batchfit.device.timeline.loop_steps`: until the allocator repeats
a state); the timeline is the last step's.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_brackets  # noqa: E402

from batchfit.device import allocator as allocator_module  # noqa: E402
from batchfit.device import expandable as expandable_module  # noqa: E402
from batchfit.device import timeline  # noqa: E402
from batchfit.device.allocator_rules import AllocatorOutOfMemory  # noqa: E402
from batchfit.engine.tracer import Event, EventKind  # noqa: E402

WHAT_IFS = ("reverse-addresses", "no-workspace", "sticky-workspace", "no-norm-copy",
            "ideal-allocator", "at-card-capacity")
_NORMS = ("aten.native_layer_norm.default", "aten.native_group_norm.default")


def install(what_if: str | None, steps: int | None) -> None:
    """Swap the replay's pieces for this process."""
    engine_loop = timeline._loop
    no_workspace = what_if == "no-workspace"

    def _loop(events: Sequence[Event], device, capacity, steps_=None, record=None,
              skipped=None):
        if no_workspace:  # each workspace asks for nothing (the event count stays)
            if skipped is not None:
                skipped.update(e.key for e in events if timeline.is_fallible(e))
            events = [replace(e, nbytes=0) if e.kind is EventKind.ALLOC
                      and timeline.is_fallible(e) else e for e in events]
        if what_if == "no-norm-copy":
            events = _without_norm_copies(events)
        return engine_loop(events, device, capacity, steps if steps_ is None else steps_,
                           record, skipped)

    timeline._loop = _loop
    if what_if == "no-norm-copy":  # the bisection's lower bound sees the same events
        engine_live = timeline.peak_live_bytes
        timeline.peak_live_bytes = lambda events: engine_live(_without_norm_copies(events))
    if what_if == "sticky-workspace":
        _install_sticky_workspaces()
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
    if what_if == "at-card-capacity":
        _install_at_card_capacity()
    if what_if == "ideal-allocator":
        allocator_module.AllocatorConfig.new_allocator = (
            lambda self, capacity_bytes=None: IdealAllocator(capacity_bytes, self.round_size))


def _without_norm_copies(events: Sequence[Event]) -> list[Event]:
    """``events`` with each fp32 copy that feeds a LayerNorm or GroupNorm in the same
    module (the next allocation after it) asking for nothing (the event count stays)."""
    copies = set()
    allocs = [i for i, e in enumerate(events) if e.kind is EventKind.ALLOC]
    for i, j in itertools.pairwise(allocs):
        e, nxt = events[i], events[j]
        if e.op == "aten._to_copy.default" and nxt.op in _NORMS and nxt.module == e.module:
            copies.add(e.key)
    return [replace(e, nbytes=0) if e.kind is EventKind.ALLOC and e.key in copies else e
            for e in events]


def _install_sticky_workspaces() -> None:
    """A failed workspace's shape asks for none in every later call (``sticky-workspace``).
    The shapes replaced are kept on the allocator (one loop) and are part of its state."""
    engine_run = timeline._run

    def _run(events, allocator, handles, searched, record, skipped):
        gone = allocator.__dict__.setdefault("sticky_replaced", set())
        done = 0
        for i, event in enumerate(events):
            if not (event.kind is EventKind.ALLOC and timeline.is_fallible(event)):
                continue
            engine_run(events[done:i], allocator, handles, searched, record, skipped)
            done = i + 1
            mark = events[i - 1] if i else None  # the shape's search mark, just before
            shape = mark.key if mark is not None and mark.kind is EventKind.EMPTY_CACHE else None
            if shape is not None and shape in gone:  # the kept algorithm needs none
                if skipped is not None:
                    skipped.add(event.key)
                if record is not None:
                    record[0].append(allocator.allocated_bytes)
                    record[1].append(allocator.reserved_bytes)
                continue
            failed: set[int] = set()
            engine_run([event], allocator, handles, searched, record, failed)
            if failed:
                if skipped is not None:
                    skipped.update(failed)
                if shape is not None:
                    gone.add(shape)
        engine_run(events[done:], allocator, handles, searched, record, skipped)

    timeline._run = _run
    for cls in (allocator_module.CachingAllocator, expandable_module.ExpandableAllocator):
        engine_layout = cls.layout
        cls.layout = (lambda self, owners, _layout=engine_layout:
                      (_layout(self, owners),
                       frozenset(self.__dict__.get("sticky_replaced", ()))))


def _install_at_card_capacity() -> None:
    """A step fits when its replay runs at the card's own capacity (``at-card-capacity``),
    also where the engine's need is higher because some larger capacity fails."""
    engine_least = timeline._least_capacity

    def _least_capacity(events, device, steps=None):
        needed = engine_least(events, device, steps)
        if not device.is_cuda or device.total_memory_bytes is None:
            return needed
        unit = timeline._SEGMENT_UNIT  # as fits_within rounds the solver's budget
        card = (device.total_memory_bytes - device.outside_allocator_bytes) // unit * unit
        if needed <= card or not timeline._fits(events, device, card, steps):
            return needed
        return card

    timeline._least_capacity = _least_capacity


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

    def layout(self, owners) -> tuple:
        """Nothing is cached, so every step starts alike."""
        return ()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--what-if", choices=WHAT_IFS)
    parser.add_argument("--steps", type=int, default=None)
    args, rest = parser.parse_known_args(argv)
    if args.steps is not None and args.steps < 1:
        parser.error("--steps must be at least 1")
    if "--tag" not in rest:
        parser.error("give the run its own --tag")
    install(args.what_if, args.steps)
    gpu_brackets.main(rest)


if __name__ == "__main__":
    main()
