"""The what-if replays of ``benchmarks/gpu_brackets_whatif.py`` (experiments, not the
engine), on hand-built event lists.

Expected values follow the allocator's rules in c10/cuda/CUDACachingAllocator.cpp as in
tests/device/test_timeline.py: a request of 10 MiB or more gets a segment of its own
size; ``get_free_block`` takes the smallest cached block that fits; a large block splits
when more than 1 MiB would remain; when cudaMalloc fails the allocator releases every
wholly free segment and retries once.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from batchfit.device import allocator as allocator_module
from batchfit.device import expandable as expandable_module
from batchfit.device import timeline
from batchfit.device.profile import DeviceProfile
from batchfit.engine.tracer import Category, Event, EventKind, Phase

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
whatif = pytest.importorskip("gpu_brackets_whatif")

MiB = 1 << 20
DEV = DeviceProfile.cuda(80 * 1024 * MiB, (8, 0), context_bytes=0, workspace_bytes=0)


def _event(kind: EventKind, key: int, mib: int, op: str = "op") -> Event:
    return Event(kind, key, mib * MiB, Category.ACTIVATIONS, "m", op, Phase.FORWARD)


WS = "cudnn workspace (aten.convolution.default)"
# x (40 MiB) dies and stays cached; a convolution's 12 MiB workspace; then y (20) and
# z (30) live together.
STEP = [_event(EventKind.ALLOC, 1, 40), _event(EventKind.FREE, 1, 40),
        _event(EventKind.ALLOC, 2, 12, WS), _event(EventKind.FREE, 2, 12, WS),
        _event(EventKind.ALLOC, 3, 20), _event(EventKind.ALLOC, 4, 30),
        _event(EventKind.FREE, 3, 20), _event(EventKind.FREE, 4, 30)]


@pytest.fixture
def restore_replay(monkeypatch):
    """Each test installs a what-if; put the engine's pieces back afterwards."""
    monkeypatch.setattr(timeline, "_loop", timeline._loop)
    monkeypatch.setattr(timeline, "_run", timeline._run)
    monkeypatch.setattr(timeline, "peak_live_bytes", timeline.peak_live_bytes)
    monkeypatch.setattr(allocator_module.CachingAllocator, "layout",
                        allocator_module.CachingAllocator.layout)
    monkeypatch.setattr(expandable_module.ExpandableAllocator, "layout",
                        expandable_module.ExpandableAllocator.layout)
    monkeypatch.setattr(allocator_module.CachingAllocator, "_new_segment",
                        allocator_module.CachingAllocator._new_segment)
    monkeypatch.setattr(allocator_module.AllocatorConfig, "new_allocator",
                        allocator_module.AllocatorConfig.new_allocator)
    monkeypatch.setattr(timeline, "_least_capacity", timeline._least_capacity)


def test_the_engine_splits_the_cached_segment_and_needs_70_mib(restore_replay):
    # The workspace (12) and then y (20) take x's cached 40 MiB block by best fit; y splits
    # it (20 MiB remain). z (30) does not fit the remainder: cudaMalloc(30) gives 70 MiB;
    # under 70 nothing is wholly free to release (y holds the 40 MiB segment).
    assert timeline._fits(STEP, DEV, 70 * MiB)
    assert not timeline._fits(STEP, DEV, 68 * MiB)


def test_steps_replays_the_step_that_many_times(restore_replay):
    # The engine stops when a step leaves the allocator as the step before did: step 2
    # finds x's 40 MiB and z's 30 MiB segments cached (the workspace and y split the 30,
    # z takes the 40) and leaves both whole, as step 1 did: two steps.
    assert timeline.loop_steps(STEP, DEV) == 2
    whatif.install(None, steps=3)
    assert timeline.loop_steps(STEP, DEV) == 3
    record: tuple[list[int], list[int]] = ([], [])
    timeline._loop(STEP, DEV, None, record=record)
    assert len(record[0]) == 3 * len(STEP)  # nothing outlives the step: no frees between
    assert timeline.needed_bytes(STEP, DEV) == 70 * MiB


# x (40) is live while a convolution's 30 MiB workspace is allocated; then y (25) and
# z (40) live together.
HELPFUL_WORKSPACE = [_event(EventKind.ALLOC, 1, 40), _event(EventKind.ALLOC, 2, 30, WS),
                     _event(EventKind.FREE, 2, 30, WS), _event(EventKind.FREE, 1, 40),
                     _event(EventKind.ALLOC, 3, 25), _event(EventKind.ALLOC, 4, 40),
                     _event(EventKind.FREE, 3, 25), _event(EventKind.FREE, 4, 40)]


def test_the_engine_reuses_a_workspace_segment_that_fitted(restore_replay):
    # At 70 MiB the workspace gets a 30 MiB segment beside x's 40; once both are free, y
    # (25) takes the 30 MiB block by best fit and z (40) takes x's: 70 MiB. Below that the
    # workspace is skipped (torch falls back), y splits x's block and z needs 80.
    assert timeline._fits(HELPFUL_WORKSPACE, DEV, 70 * MiB)
    assert not timeline._fits(HELPFUL_WORKSPACE, DEV, 68 * MiB)
    assert timeline._fits(HELPFUL_WORKSPACE, DEV, 80 * MiB)


def test_no_workspace_never_allocates_the_workspace(restore_replay):
    # Without the workspace, y (25) splits x's cached 40 MiB block and z (40) needs a
    # segment of its own: 40 + 40 = 80 MiB at any capacity.
    whatif.install("no-workspace", steps=2)
    assert not timeline._fits(HELPFUL_WORKSPACE, DEV, 70 * MiB)
    assert not timeline._fits(HELPFUL_WORKSPACE, DEV, 78 * MiB)
    assert timeline._fits(HELPFUL_WORKSPACE, DEV, 80 * MiB)


def _tie_winner() -> str:
    """Two 20 MiB segments freed, then a 20 MiB request: which one best fit hands out
    (equal sizes: the lower address, ``BlockComparatorSize``)."""
    allocator = allocator_module.CachingAllocator()
    first, second = allocator.malloc(20 * MiB), allocator.malloc(20 * MiB)
    allocator.free(first)
    allocator.free(second)
    return "first" if allocator.malloc(20 * MiB) == first else "second"


def test_reversed_addresses_break_a_tie_the_other_way(restore_replay):
    assert _tie_winner() == "first"  # the segment cudaMalloc'd first is the lower one
    whatif.install("reverse-addresses", steps=2)
    assert _tie_winner() == "second"


def test_ideal_allocator_needs_the_live_peak(restore_replay):
    # No segments: x (40) is gone before the workspace (12); y (20) and z (30) live
    # together, 50 MiB, where the engine's replay needed 70 (x's segment split by y).
    whatif.install("ideal-allocator", steps=2)
    assert timeline._fits(STEP, DEV, 50 * MiB)
    assert not timeline._fits(STEP, DEV, 48 * MiB)
    # the loop changes nothing without fragmentation; a workspace that does not fit is
    # skipped: at 40 MiB x fits, the 12 MiB workspace fits, then y + z = 50 does not
    assert timeline.needed_bytes(STEP, DEV) == 50 * MiB
    skip_ws = [_event(EventKind.ALLOC, 5, 45), _event(EventKind.ALLOC, 6, 10, WS),
               _event(EventKind.FREE, 6, 10, WS), _event(EventKind.FREE, 5, 45)]
    assert timeline._fits(skip_ws, DEV, 46 * MiB)  # 45 + 10 > 46: the workspace is skipped


# A convolution shape (search mark -7) whose 40 MiB workspace fails while x (50) is live,
# and a second call of the same shape after x is freed.
MARK = Event(EventKind.EMPTY_CACHE, -7, 0, Category.TEMPORARIES, "m", "cudnn benchmark search",
             Phase.FORWARD)
SAME_SHAPE_TWICE = [_event(EventKind.ALLOC, 1, 50), MARK,
                    _event(EventKind.ALLOC, 2, 40, WS), _event(EventKind.FREE, 2, 40, WS),
                    _event(EventKind.FREE, 1, 50), MARK,
                    _event(EventKind.ALLOC, 3, 40, WS), _event(EventKind.FREE, 3, 40, WS)]


def _allocated_at_second_workspace() -> int:
    record: tuple[list[int], list[int]] = ([], [])
    timeline._loop(SAME_SHAPE_TWICE, DEV, 80 * MiB, 1, record)
    return record[0][6]


def test_sticky_workspace_keeps_the_fallback_for_the_shape(restore_replay):
    # At 80 MiB: x takes a 50 MiB segment; the first workspace would make it 90, nothing is
    # wholly free to release, so it fails (torch runs another algorithm). x is freed; the
    # second call's workspace fits x's cached 50 MiB block. The engine asks for it again
    # (40 MiB allocated); torch cached the algorithm that ran, which the what-if takes as
    # needing none (0 allocated).
    assert _allocated_at_second_workspace() == 40 * MiB
    whatif.install("sticky-workspace", steps=None)
    assert _allocated_at_second_workspace() == 0
    skipped: set[int] = set()
    timeline._loop(SAME_SHAPE_TWICE, DEV, 80 * MiB, 1, None, skipped)
    assert skipped == {2, 3}  # the one that failed and the one never asked for


NORM = "aten.native_layer_norm.default"
COPY = "aten._to_copy.default"


def _norm_event(kind: EventKind, key: int, mib: int, op: str, module: str) -> Event:
    return Event(kind, key, mib * MiB, Category.ACTIVATIONS, module, op, Phase.FORWARD)


# LayerNorm's fp32 copy of its input (20 MiB) and its output (20) in one module; then a
# cast for a linear layer (10) and its output (10) in another.
NORM_STEP = [_norm_event(EventKind.ALLOC, 1, 20, COPY, "norm"),
             _norm_event(EventKind.ALLOC, 2, 20, NORM, "norm"),
             _norm_event(EventKind.FREE, 1, 20, COPY, "norm"),
             _norm_event(EventKind.ALLOC, 3, 10, COPY, "fc"),
             _norm_event(EventKind.ALLOC, 4, 10, "aten.addmm.default", "fc"),
             _norm_event(EventKind.FREE, 3, 10, COPY, "fc"),
             _norm_event(EventKind.FREE, 2, 20, NORM, "norm"),
             _norm_event(EventKind.FREE, 4, 10, "aten.addmm.default", "fc")]


def test_no_norm_copy_drops_only_the_copy_a_norm_reads(restore_replay):
    # The norm: its copy and its output (20 + 20 MiB) are live together, each in a segment
    # of its own: 40 MiB live and 40 of segments. Without the copy: 20 and 20. The whole
    # step peaks at 40 MiB live either way, at the linear layer's output (the norm's 20,
    # the cast 10, the output 10), because the cast that feeds a matmul is kept.
    norm_only = NORM_STEP[:3]
    assert timeline.peak_live_bytes(norm_only) == 40 * MiB
    assert timeline.needed_bytes(norm_only, DEV) == 40 * MiB
    whatif.install("no-norm-copy", steps=None)
    assert timeline.peak_live_bytes(norm_only) == 20 * MiB
    assert timeline.needed_bytes(norm_only, DEV) == 20 * MiB
    assert timeline.peak_live_bytes(NORM_STEP) == 40 * MiB


# x (40) stays; a 62 MiB workspace; y (30) and w (24) allocated, y freed; then z (36).
# Below 102 MiB the workspace does not fit (40 + 62) and is skipped: y and w get segments
# of their own, z's cudaMalloc releases y's wholly free 30 MiB segment and needs
# 40 + 24 + 36 = 100 MiB. From 102 the workspace gets a segment; y splits it (32 remain),
# w splits the remainder (8 remain), y is freed: [30 free | w | 8 free], and z (36) needs
# a new segment that nothing wholly free can make room for: 102 + 36 = 138 MiB.
WINDOW = [_event(EventKind.ALLOC, 1, 40), _event(EventKind.ALLOC, 2, 62, WS),
          _event(EventKind.FREE, 2, 62, WS), _event(EventKind.ALLOC, 3, 30),
          _event(EventKind.ALLOC, 4, 24), _event(EventKind.FREE, 3, 30),
          _event(EventKind.ALLOC, 5, 36), _event(EventKind.FREE, 4, 24),
          _event(EventKind.FREE, 5, 36), _event(EventKind.FREE, 1, 40)]


def test_at_card_capacity_takes_the_card_where_a_larger_capacity_fails(restore_replay):
    card = DeviceProfile.cuda(100 * MiB, (8, 0), context_bytes=0, workspace_bytes=0)
    assert timeline._fits(WINDOW, card, 100 * MiB, 1)
    assert not timeline._fits(WINDOW, card, 102 * MiB, 1)
    assert not timeline._fits(WINDOW, card, 136 * MiB, 1)
    assert timeline.needed_bytes(WINDOW, card, loop=False) == 138 * MiB  # the engine's rule
    whatif.install("at-card-capacity", steps=1)
    assert timeline.needed_bytes(WINDOW, card) == 100 * MiB
    # a 110 MiB card is inside the failing range: the engine's answer stands
    larger = DeviceProfile.cuda(110 * MiB, (8, 0), context_bytes=0, workspace_bytes=0)
    assert timeline.needed_bytes(WINDOW, larger) == 138 * MiB
