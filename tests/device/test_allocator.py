"""Tests of the caching-allocator model.

Every expected number is derived by hand in a comment from the rules in
c10/cuda/CUDACachingAllocator.cpp (512 B rounding; small pool <= 1 MiB in 2 MiB segments;
20 MiB segments below 10 MiB; 2 MiB rounding above; large blocks split only when > 1 MiB
would remain), never copied from the code's output.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchfit.device.allocator import (
    AllocatorConfig,
    AllocEvent,
    CachingAllocator,
    FreeEvent,
    replay,
)
from batchfit.device.allocator_rules import (
    NULL_HANDLE,
    AllocatorOutOfMemory,
    round_size,
    segment_size,
)
from batchfit.device.expandable import ExpandableAllocator
from batchfit.errors import BatchfitError, InvalidInputError

KiB = 2**10
MiB = 2**20


# --- rounding ---------------------------------------------------------------------------

@pytest.mark.parametrize(("nbytes", "expected"), [
    (0, 512),  # the source's round_size(0); malloc(0) never calls it (see below)
    (1, 512),
    (511, 512),
    (512, 512),
    (513, 1024),
    (1000, 1024),
    (MiB + 1, MiB + 512),  # 2048 * 512 + 1 -> 2049 * 512
])
def test_round_size_rounds_up_to_512(nbytes, expected):
    assert round_size(nbytes) == expected


@pytest.mark.parametrize(("rounded", "expected"), [
    (512, 2 * MiB),  # small pool: kSmallBuffer
    (MiB, 2 * MiB),  # 1 MiB is still small (<= kSmallSize)
    (MiB + 512, 20 * MiB),  # just above 1 MiB: kLargeBuffer
    (10 * MiB - 512, 20 * MiB),  # just below kMinLargeAlloc: still kLargeBuffer
    (10 * MiB, 10 * MiB),  # from 10 MiB on: own segment, already a multiple of 2 MiB
    (11 * MiB + 512, 12 * MiB),  # rounded up to the next multiple of 2 MiB
    (12 * MiB, 12 * MiB),
])
def test_segment_size(rounded, expected):
    assert segment_size(rounded) == expected


@pytest.mark.parametrize("bad", [-1, 1.5, "512", True, None])
def test_bad_sizes_are_rejected(bad):
    with pytest.raises(InvalidInputError):
        round_size(bad)
    with pytest.raises(InvalidInputError):
        CachingAllocator().malloc(bad)


def test_zero_byte_allocation_costs_nothing():
    # NativeCachingAllocator::allocate skips malloc for size 0 and returns a null pointer.
    allocator = CachingAllocator()
    handle = allocator.malloc(0)
    assert handle == NULL_HANDLE
    assert (allocator.allocated_bytes, allocator.reserved_bytes) == (0, 0)
    allocator.free(handle)  # freeing null is a no-op, as in torch
    assert allocator.stats().segment_count == 0


# --- small pool -------------------------------------------------------------------------

def test_first_small_allocation_reserves_a_2mib_segment():
    allocator = CachingAllocator()
    allocator.malloc(1)
    # 1 B -> a 512 B block in a fresh 2 MiB small segment.
    assert allocator.allocated_bytes == 512
    assert allocator.reserved_bytes == 2 * MiB


def test_4096_blocks_of_512_fill_one_small_segment():
    allocator = CachingAllocator()
    for _ in range(4096):
        allocator.malloc(512)
    # 4096 * 512 B = 2 MiB: the 4096th takes the last 512 B unsplit, no new segment.
    assert allocator.allocated_bytes == 2 * MiB
    assert allocator.reserved_bytes == 2 * MiB
    assert allocator.stats().segment_count == 1
    allocator.malloc(512)
    # The segment is full, so the 4097th needs a second 2 MiB segment.
    assert allocator.reserved_bytes == 4 * MiB
    assert allocator.stats().segment_count == 2


def test_1mib_is_small_and_1mib_plus_one_byte_is_large():
    allocator = CachingAllocator()
    allocator.malloc(MiB)
    allocator.malloc(MiB)
    # Two 1 MiB blocks fill one 2 MiB small segment exactly.
    assert allocator.reserved_bytes == 2 * MiB
    allocator.malloc(MiB + 1)
    # Rounded to 1 MiB + 512 > kSmallSize: large pool, a new 20 MiB segment.
    assert allocator.reserved_bytes == 2 * MiB + 20 * MiB


# --- large pool -------------------------------------------------------------------------

def test_requests_under_10mib_share_a_20mib_segment():
    allocator = CachingAllocator()
    allocator.malloc(5 * MiB)
    # 5 MiB < 10 MiB: a 20 MiB segment, split 5 | 15 (15 MiB > 1 MiB remains).
    assert (allocator.allocated_bytes, allocator.reserved_bytes) == (5 * MiB, 20 * MiB)
    allocator.malloc(5 * MiB)
    # Best fit is the free 15 MiB remainder: no new segment.
    assert (allocator.allocated_bytes, allocator.reserved_bytes) == (10 * MiB, 20 * MiB)


def test_requests_from_10mib_get_a_segment_of_their_own_size():
    allocator = CachingAllocator()
    allocator.malloc(12 * MiB)
    # 12 MiB is a multiple of 2 MiB: a segment of exactly 12 MiB, nothing to split.
    assert (allocator.allocated_bytes, allocator.reserved_bytes) == (12 * MiB, 12 * MiB)


def test_11mib_plus_one_byte_rounds_to_a_12mib_segment_handed_out_whole():
    allocator = CachingAllocator()
    allocator.malloc(11 * MiB + 1)
    # Rounded to 11 MiB + 512; segment rounded to 12 MiB. The remainder, 1 MiB - 512,
    # is not > 1 MiB, so the block is not split and memory_allocated counts all 12 MiB.
    assert allocator.reserved_bytes == 12 * MiB
    assert allocator.allocated_bytes == 12 * MiB
    assert allocator.requested_bytes == 11 * MiB + 1


def test_a_large_request_can_reuse_the_remainder_of_a_20mib_segment():
    allocator = CachingAllocator()
    allocator.malloc(5 * MiB)  # 20 MiB segment: 5 used | 15 free
    allocator.malloc(12 * MiB)
    # 12 MiB fits the free 15 MiB block; 3 MiB > 1 MiB remains, so it splits.
    assert (allocator.allocated_bytes, allocator.reserved_bytes) == (17 * MiB, 20 * MiB)


def test_large_block_is_not_split_when_1mib_or_less_would_remain():
    allocator = CachingAllocator()
    allocator.malloc(5 * MiB)  # 20 MiB segment: 5 | 15 free
    allocator.malloc(14 * MiB)
    # 15 - 14 = 1 MiB remains, not > 1 MiB: the whole 15 MiB block is handed out.
    assert allocator.allocated_bytes == 5 * MiB + 15 * MiB
    [segment] = allocator.segments()
    assert [b.size_bytes for b in segment.blocks] == [5 * MiB, 15 * MiB]


def test_large_block_is_split_when_more_than_1mib_would_remain():
    allocator = CachingAllocator()
    allocator.malloc(5 * MiB)  # 20 MiB segment: 5 | 15 free
    allocator.malloc(14 * MiB - 512)
    # 15 MiB - (14 MiB - 512) = 1 MiB + 512 > 1 MiB: split.
    assert allocator.allocated_bytes == 5 * MiB + 14 * MiB - 512
    [segment] = allocator.segments()
    assert [b.size_bytes for b in segment.blocks] == [5 * MiB, 14 * MiB - 512, MiB + 512]


# --- splitting, best fit, reuse, coalescing ---------------------------------------------

def test_small_block_split_and_reused_after_free():
    allocator = CachingAllocator()
    a = allocator.malloc(KiB)
    allocator.malloc(KiB)
    allocator.free(a)
    c = allocator.malloc(512)
    # Free blocks: a's 1 KiB hole and the 2 MiB - 2 KiB tail. Best fit is the hole; 512 B
    # remain (>= 512), so it splits: c takes a's address, 512 B stay free after it.
    assert c == a
    [segment] = allocator.segments()
    assert [(b.size_bytes, b.allocated) for b in segment.blocks] == [
        (512, True), (512, False), (KiB, True), (2 * MiB - 2 * KiB, False)]
    assert allocator.reserved_bytes == 2 * MiB


def test_best_fit_takes_the_smallest_free_block_that_fits():
    allocator = CachingAllocator()
    a = allocator.malloc(3 * MiB)
    allocator.malloc(2 * MiB)
    b = allocator.malloc(2 * MiB)
    allocator.malloc(2 * MiB)
    # One 20 MiB segment: a 3 | 2 | b 2 | 2 | 11 free.
    allocator.free(a)
    allocator.free(b)
    # Free blocks: 3 MiB, 2 MiB and 11 MiB; the exact 2 MiB hole wins, though a's comes first.
    assert allocator.malloc(2 * MiB) == b
    # 2.5 MiB: only the 3 MiB hole (besides 11) fits; 0.5 MiB would remain -> not split.
    assert allocator.malloc(2 * MiB + 512 * KiB) == a
    assert allocator.allocated_bytes == 3 * MiB + 2 * MiB + 2 * MiB + 2 * MiB
    assert allocator.reserved_bytes == 20 * MiB


def test_freed_neighbours_coalesce():
    allocator = CachingAllocator()
    a, b, c = (allocator.malloc(5 * MiB) for _ in range(3))
    # One 20 MiB segment: a 5 | b 5 | c 5 | 5 free.
    allocator.free(a)
    allocator.free(c)
    [segment] = allocator.segments()
    # c merged with the free tail into 10 MiB; a is alone because b is live.
    assert [(x.size_bytes, x.allocated) for x in segment.blocks] == [
        (5 * MiB, False), (5 * MiB, True), (10 * MiB, False)]
    allocator.free(b)
    [segment] = allocator.segments()
    # b merges with both sides: one free 20 MiB block.
    assert [(x.size_bytes, x.allocated) for x in segment.blocks] == [(20 * MiB, False)]
    allocator.malloc(20 * MiB)
    # Only a coalesced 20 MiB block can hold 20 MiB without a new segment.
    assert allocator.reserved_bytes == 20 * MiB


def test_free_keeps_memory_reserved_until_empty_cache():
    allocator = CachingAllocator()
    live = allocator.malloc(12 * MiB)
    dead = allocator.malloc(5 * MiB)
    allocator.free(dead)
    # 12 MiB segment (live) + 20 MiB segment (now wholly free) stay reserved.
    assert (allocator.allocated_bytes, allocator.reserved_bytes) == (12 * MiB, 32 * MiB)
    allocator.empty_cache()
    # Only the wholly free 20 MiB segment is released.
    assert allocator.reserved_bytes == 12 * MiB
    allocator.free(live)
    allocator.empty_cache()
    assert allocator.reserved_bytes == 0
    stats = allocator.stats()
    assert (stats.cuda_malloc_count, stats.cuda_free_count, stats.segment_count) == (2, 2, 0)
    assert stats.peak_reserved_bytes == 32 * MiB


def test_pools_are_separate():
    allocator = CachingAllocator()
    big = allocator.malloc(5 * MiB)
    allocator.free(big)
    allocator.malloc(512)
    # A free 20 MiB large block cannot serve a small request: a 2 MiB segment is added.
    assert allocator.reserved_bytes == 22 * MiB


@pytest.mark.parametrize("model", [CachingAllocator, ExpandableAllocator])
def test_freeing_an_unknown_or_dead_handle_is_an_error(model):
    allocator = model()
    handle = allocator.malloc(512)
    allocator.free(handle)
    with pytest.raises(InvalidInputError, match="not a live allocation"):
        allocator.free(handle)
    with pytest.raises(InvalidInputError):
        allocator.free(12345)


# --- capacity, retry and out of memory --------------------------------------------------

def test_cached_segment_is_released_and_the_allocation_retried():
    allocator = CachingAllocator(capacity_bytes=40 * MiB)
    allocator.free(allocator.malloc(5 * MiB))
    # The 20 MiB segment is cached, wholly free.
    assert allocator.reserved_bytes == 20 * MiB
    allocator.malloc(30 * MiB)
    # 20 + 30 = 50 > 40 fails; releasing the cached 20 MiB leaves 0 + 30 <= 40.
    assert allocator.reserved_bytes == 30 * MiB
    assert allocator.peak_reserved_bytes == 30 * MiB
    stats = allocator.stats()
    assert (stats.alloc_retry_count, stats.cuda_free_count, stats.oom_count) == (1, 1, 0)


def test_allocation_that_can_never_fit_raises_with_the_numbers():
    allocator = CachingAllocator(capacity_bytes=40 * MiB)
    with pytest.raises(AllocatorOutOfMemory) as info:
        allocator.malloc(41 * MiB)
    # 41 MiB needs a 42 MiB segment > 40 MiB, even with nothing reserved.
    err = info.value
    assert (err.requested_bytes, err.segment_bytes) == (41 * MiB, 42 * MiB)
    assert (err.reserved_bytes, err.allocated_bytes, err.capacity_bytes) == (0, 0, 40 * MiB)
    assert err.event_index is None
    assert isinstance(err, BatchfitError)
    assert "41.00 MiB" in str(err) and "40.00 MiB" in str(err)
    assert allocator.stats().oom_count == 1


def test_exactly_the_capacity_fits():
    allocator = CachingAllocator(capacity_bytes=40 * MiB)
    # The source fails only when total + size > the limit.
    allocator.malloc(40 * MiB)
    assert allocator.reserved_bytes == 40 * MiB
    assert allocator.stats().alloc_retry_count == 0  # it fit on the first attempt


def test_a_split_segment_with_a_live_block_is_not_released():
    allocator = CachingAllocator(capacity_bytes=40 * MiB)
    a = allocator.malloc(5 * MiB)
    allocator.malloc(5 * MiB)  # same 20 MiB segment as a
    allocator.free(a)
    with pytest.raises(AllocatorOutOfMemory) as info:
        allocator.malloc(30 * MiB)
    # The only segment still holds a live 5 MiB block: 20 + 30 > 40 even after the retry.
    err = info.value
    assert (err.reserved_bytes, err.allocated_bytes) == (20 * MiB, 5 * MiB)
    assert (err.requested_bytes, err.segment_bytes) == (30 * MiB, 30 * MiB)


def test_failed_allocation_still_releases_the_cache():
    allocator = CachingAllocator(capacity_bytes=40 * MiB)
    allocator.free(allocator.malloc(1))  # a cached 2 MiB small segment
    with pytest.raises(AllocatorOutOfMemory) as info:
        allocator.malloc(41 * MiB)
    # As in torch, the retry path cudaFreed the cached segment before giving up.
    assert info.value.reserved_bytes == 0
    assert allocator.reserved_bytes == 0


# --- replay -----------------------------------------------------------------------------

def test_replay_timeline():
    events = [
        AllocEvent("a", 1),  # 512 B in a new 2 MiB small segment
        AllocEvent("b", 5 * MiB),  # new 20 MiB large segment, split 5 | 15
        FreeEvent("a"),  # small segment stays reserved
        AllocEvent("c", 12 * MiB),  # fits b's free 15 MiB; 3 MiB > 1 MiB remain -> split
        FreeEvent("b"),
        FreeEvent("c"),
    ]
    result = replay(events)
    assert result.allocated_bytes == [
        512, 512 + 5 * MiB, 5 * MiB, 17 * MiB, 12 * MiB, 0]
    assert result.reserved_bytes == [2 * MiB, 22 * MiB, 22 * MiB, 22 * MiB, 22 * MiB, 22 * MiB]
    assert result.peak_reserved_bytes == 22 * MiB
    assert result.peak_reserved_index == 1  # first event to reach 22 MiB
    assert result.peak_allocated_bytes == 17 * MiB
    assert result.peak_allocated_index == 3
    assert result.final.live_block_count == 0
    json.dumps(result.to_dict())


def test_replay_of_nothing():
    result = replay([])
    assert (result.peak_reserved_bytes, result.peak_allocated_bytes) == (0, 0)
    assert result.peak_reserved_index is None and result.peak_allocated_index is None
    assert result.reserved_bytes == [] and result.allocated_bytes == []


def test_replay_allows_a_key_again_after_its_free():
    result = replay([AllocEvent("x", 512), FreeEvent("x"), AllocEvent("x", 512)])
    # The second x reuses the first one's cached block.
    assert result.reserved_bytes == [2 * MiB] * 3
    assert result.allocated_bytes == [512, 0, 512]


def test_replay_zero_byte_objects():
    result = replay([AllocEvent("empty", 0), FreeEvent("empty")])
    assert result.reserved_bytes == [0, 0]
    assert result.peak_reserved_index == 0


def test_replay_reports_the_event_that_ran_out_of_memory():
    events = [AllocEvent("a", 12 * MiB), AllocEvent("b", 30 * MiB)]
    with pytest.raises(AllocatorOutOfMemory) as info:
        replay(events, capacity_bytes=40 * MiB)
    # 12 + 30 = 42 > 40 and the 12 MiB segment is live, so nothing can be released.
    assert info.value.event_index == 1
    assert info.value.reserved_bytes == 12 * MiB
    assert "event 1" in str(info.value)


@pytest.mark.parametrize(("events", "match"), [
    ([AllocEvent("a", 1), AllocEvent("a", 1)], "already live"),
    ([FreeEvent("a")], "not live"),
    ([AllocEvent("a", 1), FreeEvent("a"), FreeEvent("a")], "not live"),
    ([("a", 1)], "expected AllocEvent or FreeEvent"),
])
def test_replay_rejects_inconsistent_events(events, match):
    with pytest.raises(InvalidInputError, match=match):
        replay(events)


# --- properties -------------------------------------------------------------------------

_sizes = st.one_of(
    st.integers(0, 4 * KiB),  # small pool, mostly sub-512 rounding
    st.integers(MiB - 1024, MiB + 1024),  # across the small/large boundary
    st.integers(MiB, 10 * MiB),  # shared 20 MiB segments
    st.integers(10 * MiB - 1024, 40 * MiB),  # own segments, with the 1 MiB split rule
)
# An op is either an allocation of the given size or a free of the live block at a position.
_ops = st.lists(st.one_of(st.tuples(st.just("alloc"), _sizes),
                          st.tuples(st.just("free"), st.integers(0, 10**6))),
                max_size=80)


def _check_invariants(allocator: CachingAllocator, live: dict[int, int]) -> None:
    segments = allocator.segments()
    blocks = [b for s in segments for b in s.blocks]
    assert allocator.reserved_bytes == sum(s.size_bytes for s in segments)
    assert allocator.allocated_bytes == sum(b.size_bytes for b in blocks if b.allocated)
    assert allocator.stats().segment_count == len(segments)
    assert allocator.requested_bytes == sum(live.values())
    # Rounding and unsplit remainders only ever add: live rounded sizes <= allocated.
    assert sum(round_size(n) for n in live.values() if n) <= allocator.allocated_bytes
    assert allocator.allocated_bytes <= allocator.reserved_bytes
    assert allocator.peak_allocated_bytes <= allocator.peak_reserved_bytes
    assert allocator.reserved_bytes <= allocator.peak_reserved_bytes
    for segment in segments:
        if segment.is_small_pool:
            assert segment.size_bytes == 2 * MiB
        # Coalescing leaves no two free neighbours.
        for left, right in zip(segment.blocks, segment.blocks[1:]):
            assert left.allocated or right.allocated
        assert all(b.size_bytes % 512 == 0 for b in segment.blocks)


def _run(ops, capacity_bytes=None):
    allocator = CachingAllocator(capacity_bytes)
    live: dict[int, int] = {}
    for kind, arg in ops:
        if kind == "alloc":
            try:
                handle = allocator.malloc(arg)
            except AllocatorOutOfMemory as err:
                # The new segment really did not fit, even after releasing the cache.
                assert err.reserved_bytes + err.segment_bytes > capacity_bytes
                assert allocator.stats().segment_count == sum(
                    1 for s in allocator.segments() if any(b.allocated for b in s.blocks))
            else:
                if handle != NULL_HANDLE:
                    live[handle] = arg
        elif live:
            handle = sorted(live)[arg % len(live)]
            allocator.free(handle)
            del live[handle]
        _check_invariants(allocator, live)
        if capacity_bytes is not None:
            assert allocator.reserved_bytes <= capacity_bytes
    return allocator, live


@given(_ops)
@settings(max_examples=300, deadline=None)
def test_invariants_hold_over_random_sequences(ops):
    allocator, live = _run(ops)
    for handle in list(live):
        allocator.free(handle)
    assert allocator.allocated_bytes == 0
    allocator.empty_cache()
    # With nothing live, every segment coalesced back to one free block and was released.
    assert allocator.reserved_bytes == 0 and allocator.segments() == ()


@given(_ops, st.integers(0, 100 * MiB))
@settings(max_examples=300, deadline=None)
def test_invariants_hold_under_a_capacity(ops, capacity_bytes):
    _run(ops, capacity_bytes)


@given(st.lists(st.integers(1, MiB), max_size=60))
@settings(max_examples=100, deadline=None)
def test_small_pool_allocated_is_the_sum_of_rounded_sizes(sizes):
    allocator = CachingAllocator()
    for n in sizes:
        allocator.malloc(n)
    # Small blocks always split off >= 512 B remainders, so nothing is handed out oversize.
    assert allocator.allocated_bytes == sum(round_size(n) for n in sizes)


@given(_ops)
@settings(max_examples=100, deadline=None)
def test_replay_matches_the_allocator(ops):
    events, live_keys, allocator = [], [], CachingAllocator()
    handles = {}
    for key, (kind, arg) in enumerate(ops):
        if kind == "alloc":
            events.append(AllocEvent(key, arg))
            live_keys.append(key)
            handles[key] = allocator.malloc(arg)
        elif live_keys:
            victim = live_keys.pop(arg % len(live_keys))
            events.append(FreeEvent(victim))
            allocator.free(handles.pop(victim))
    result = replay(events)
    assert result.peak_reserved_bytes == max(result.reserved_bytes, default=0)
    assert result.peak_allocated_bytes == max(result.allocated_bytes, default=0)
    assert result.peak_reserved_bytes >= result.peak_allocated_bytes
    assert result.final == allocator.stats()
    if events:
        assert result.reserved_bytes[result.peak_reserved_index] == result.peak_reserved_bytes
        assert result.reserved_bytes.index(result.peak_reserved_bytes) == \
            result.peak_reserved_index


# --- PYTORCH_CUDA_ALLOC_CONF options ----------------------------------------------------
# Expected values from c10/cuda/CUDACachingAllocator.cpp with the option set:
# round_size/roundup_power2_next_division, get_free_block's two oversize rules,
# should_split (size < max_split_size), release_available_cached_blocks; and from
# c10/cuda/CUDAAllocatorConfig.cpp's parseArgs checks.


@pytest.mark.parametrize(("nbytes", "divisions", "expected"), [
    (1200 * MiB, 4, 1280 * MiB),  # floor power of two 1024 MiB, steps of 1024/4 = 256 MiB
    (1024 * MiB, 4, 1024 * MiB),  # a power of two stays
    (3 * MiB + 1, 4, 3 * MiB + 512 * KiB),  # floor 2 MiB, steps of 512 KiB
    (4609, 2, 6144),  # floor 4096, steps of 2048 (512-rounding would give 5120)
    (1500, 4, 1536),  # not above 512 * 4 = 2048 B: plain 512-rounding
    (1200 * MiB, 1, 1200 * MiB),  # one division is no rounding beyond 512 B
])
def test_roundup_power2_divisions(nbytes, divisions, expected):
    assert round_size(nbytes, divisions) == expected


def test_roundup_power2_divisions_changes_what_a_request_reserves():
    # 1200 MiB rounds to 1280 MiB with 4 divisions; its own segment is that (a multiple
    # of 2 MiB), so 80 MiB more is reserved than without the option.
    plain = CachingAllocator()
    plain.malloc(1200 * MiB)
    rounded = AllocatorConfig(roundup_power2_divisions=4).new_allocator()
    rounded.malloc(1200 * MiB)
    assert (plain.reserved_bytes, rounded.reserved_bytes) == (1200 * MiB, 1280 * MiB)
    assert rounded.allocated_bytes == 1280 * MiB


def _max_split(mib: int, capacity: int | None = None) -> CachingAllocator:
    return AllocatorConfig(max_split_size_bytes=mib * MiB).new_allocator(capacity)


def test_max_split_size_keeps_small_requests_out_of_oversize_blocks():
    # A cached 100 MiB block is oversize (>= 40 MiB): a 30 MiB request (< 40) is refused
    # it and gets its own 30 MiB segment; without the option it splits the 100 MiB block.
    for allocator, reserved in ((_max_split(40), 130 * MiB), (CachingAllocator(), 100 * MiB)):
        allocator.free(allocator.malloc(100 * MiB))
        allocator.malloc(30 * MiB)
        assert allocator.reserved_bytes == reserved


def test_max_split_size_hands_oversize_blocks_out_whole_within_the_rounding_allowance():
    # 90 MiB >= 40 MiB takes the cached 100 MiB block (100 < 90 + 20) unsplit: 100 MiB
    # allocated. Without the option the block splits (10 MiB > 1 MiB left): 90 allocated.
    allocator = _max_split(40)
    allocator.free(allocator.malloc(100 * MiB))
    allocator.malloc(90 * MiB)
    assert (allocator.allocated_bytes, allocator.reserved_bytes) == (100 * MiB, 100 * MiB)
    plain = CachingAllocator()
    plain.free(plain.malloc(100 * MiB))
    plain.malloc(90 * MiB)
    assert plain.allocated_bytes == 90 * MiB
    # 70 MiB: the 100 MiB block exceeds 70 + 20, so it is refused: a new 70 MiB segment.
    allocator = _max_split(40)
    allocator.free(allocator.malloc(100 * MiB))
    allocator.malloc(70 * MiB)
    assert allocator.reserved_bytes == 170 * MiB


def test_max_non_split_rounding_widens_the_allowance():
    # With max_non_split_rounding_mb:40 a 70 MiB request may take the 100 MiB block whole.
    allocator = AllocatorConfig.parse("max_split_size_mb:40,max_non_split_rounding_mb:40"
                                      ).new_allocator()
    allocator.free(allocator.malloc(100 * MiB))
    allocator.malloc(70 * MiB)
    assert (allocator.allocated_bytes, allocator.reserved_bytes) == (100 * MiB, 100 * MiB)


def test_release_available_cached_blocks_frees_one_covering_oversize_segment():
    # Capacity 150 MiB; cached free segments of 22 MiB and 100 MiB. A 30 MiB request is
    # refused the 100 MiB block (oversize) and cannot cudaMalloc 30 (122 + 30 > 150):
    # release_available_cached_blocks frees the smallest oversize segment covering
    # max(30, 40) = 40 MiB, the 100 MiB one, and the retry fits: 22 + 30 = 52 MiB
    # reserved, the 22 MiB segment still cached (release_cached_blocks would free it too).
    allocator = _max_split(40, capacity=150 * MiB)
    x, a = allocator.malloc(22 * MiB), allocator.malloc(100 * MiB)
    allocator.free(x)
    allocator.free(a)
    allocator.malloc(30 * MiB)
    stats = allocator.stats()
    assert (stats.reserved_bytes, stats.cached_free_bytes) == (52 * MiB, 22 * MiB)
    assert (stats.cuda_free_count, stats.alloc_retry_count) == (1, 0)


def test_release_available_cached_blocks_frees_oversize_segments_largest_first():
    # Cached free: 50 and 45 MiB (oversize, >= 40) and 22 MiB; 60 MiB live; capacity
    # 200 MiB. An 80 MiB request finds no block (none >= 80) and cudaMalloc fails
    # (177 + 80 > 200). No single oversize segment covers 80 MiB, so they are freed from
    # the largest down until 80 MiB are released: 50, then 45 (95 >= 80). Then 82 + 80 =
    # 162 MiB reserved, the 22 MiB segment still cached.
    allocator = _max_split(40, capacity=200 * MiB)
    b50, b45 = allocator.malloc(50 * MiB), allocator.malloc(45 * MiB)
    allocator.malloc(60 * MiB)
    z = allocator.malloc(22 * MiB)
    for handle in (b50, b45, z):
        allocator.free(handle)
    allocator.malloc(80 * MiB)
    assert allocator.reserved_bytes == 162 * MiB
    assert allocator.stats().cuda_free_count == 2


@pytest.mark.parametrize(("text", "expected"), [
    ("", AllocatorConfig()),
    (None, AllocatorConfig()),
    ("max_split_size_mb:128", AllocatorConfig(max_split_size_bytes=128 * MiB)),
    (" expandable_segments:True , garbage_collection_threshold:0.6",
     AllocatorConfig(expandable_segments=True)),
    ("expandable_segments:False,roundup_power2_divisions:8",
     AllocatorConfig(roundup_power2_divisions=8)),
    ("backend:native,pinned_use_cuda_host_register:True,release_lock_on_cudamalloc:True",
     AllocatorConfig()),
])
def test_alloc_conf_parses(text, expected):
    assert AllocatorConfig.parse(text) == expected


@pytest.mark.parametrize(("text", "says"), [
    ("max_split_size_mb:20", "must be > 20"),  # torch: "must be > kLargeBuffer / 1 MiB"
    ("max_split_size_mb:lots", "whole number"),
    ("roundup_power2_divisions:3", "power of 2"),
    ("roundup_power2_divisions:[256:1,512:2,>:8]", "per-size list"),
    ("expandable_segments:true", "True or False"),  # torch compares with "True"/"False"
    ("backend:cudaMallocAsync", "not modelled"),
    ("expandable_segments", "no value"),
    ("max_splitsize_mb:64", "unknown allocator option"),
])
def test_alloc_conf_refuses_with_one_line(text, says):
    with pytest.raises(InvalidInputError, match=says) as info:
        AllocatorConfig.parse(text)
    assert "\n" not in str(info.value)


def test_alloc_conf_from_the_environment_prefers_the_cuda_variable():
    assert AllocatorConfig.from_environment({}) == AllocatorConfig()
    assert AllocatorConfig.from_environment(
        {"PYTORCH_ALLOC_CONF": "max_split_size_mb:64"}).max_split_size_bytes == 64 * MiB
    both = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
            "PYTORCH_ALLOC_CONF": "max_split_size_mb:64"}
    assert AllocatorConfig.from_environment(both) == AllocatorConfig(expandable_segments=True)
    with pytest.raises(InvalidInputError, match="PYTORCH_CUDA_ALLOC_CONF: unknown"):
        AllocatorConfig.from_environment({"PYTORCH_CUDA_ALLOC_CONF": "bogus:1"})


_REAL_ALLOCATOR = """
import json, sys
import torch
events = json.loads(sys.argv[1])
live, reserved = {}, []
torch.cuda.init()
base = torch.cuda.memory_reserved()
for kind, key, nbytes in events:
    if kind == "alloc":
        live[key] = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    else:
        del live[key]
    reserved.append(torch.cuda.memory_reserved() - base)
print(json.dumps(reserved))
"""


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("conf", ["", "max_split_size_mb:21", "roundup_power2_divisions:4",
                                  "expandable_segments:True"])
def test_the_model_reserves_what_the_real_allocator_reserves(conf):
    # The same allocations and frees on the real allocator, in a fresh process with the
    # options set: reserved bytes after every event agree with the model's.
    import os
    import subprocess
    import sys

    sizes = [12 * MiB, 30 * MiB, 5 * MiB, 1200 * MiB + 3, 700 * KiB, 64 * MiB]
    events = [("alloc", i, n) for i, n in enumerate(sizes)]
    events += [("free", 1, 0), ("free", 3, 0), ("alloc", 10, 40 * MiB), ("free", 0, 0),
               ("alloc", 11, 24 * MiB), ("alloc", 12, 1000 * MiB), ("free", 5, 0)]
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF=conf)
    real = json.loads(subprocess.run([sys.executable, "-c", _REAL_ALLOCATOR, json.dumps(events)],
                                     env=env, check=True, capture_output=True, text=True
                                     ).stdout)
    model = AllocatorConfig.parse(conf).new_allocator()
    handles, predicted = {}, []
    for kind, key, nbytes in events:
        if kind == "alloc":
            handles[key] = model.malloc(nbytes)
        else:
            model.free(handles.pop(key))
        predicted.append(model.reserved_bytes)
    assert predicted == real


@pytest.mark.parametrize("model", [CachingAllocator, ExpandableAllocator])
def test_layout_tells_two_allocators_apart_by_what_later_requests_would_see(model):
    # Two allocators that got the same requests in the same order are in the same state,
    # whatever the owners' handles: a 30 MiB block holds x, 10 MiB are free after it.
    first, second = model(), model()
    for allocator in (first, second):
        allocator.malloc(30 * MiB)  # held: its handle is read from _live below
        allocator.free(allocator.malloc(10 * MiB))
    held_first = next(iter(first._live))
    held_second = next(iter(second._live))
    assert first.layout({held_first: "x"}) == second.layout({held_second: "x"})
    # Another tensor in the held block is another state (its free changes what is cached).
    assert first.layout({held_first: "x"}) != second.layout({held_second: "y"})
    # Freeing it: one free 40 MiB stretch instead of a held 30 and a free 10.
    second.free(held_second)
    assert first.layout({held_first: "x"}) != second.layout({})


def test_layout_lists_segments_in_address_order():
    # Best fit breaks ties between equal sizes by address, so where a segment lies among
    # the others is part of the state: a cached 20 MiB segment below a 30 MiB one is not
    # the same state as the two the other way round (each new segment lies above the last).
    a, b = CachingAllocator(), CachingAllocator()
    x, y = a.malloc(20 * MiB), a.malloc(30 * MiB)
    a.free(x), a.free(y)
    y, x = b.malloc(30 * MiB), b.malloc(20 * MiB)
    b.free(y), b.free(x)
    assert a.layout({}) == ((False, ((20 * MiB, None),)), (False, ((30 * MiB, None),)))
    assert b.layout({}) == ((False, ((30 * MiB, None),)), (False, ((20 * MiB, None),)))


# --- where the rules are imported from ----------------------------------------------------

def _imports_from(source: str, module: str) -> list[tuple[int, str]]:
    """(line, name) of every ``from module import name`` in ``source``."""
    import ast

    return [(node.lineno, alias.name) for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.ImportFrom) and node.module == module
            for alias in node.names]


def test_the_rules_are_imported_from_allocator_rules_and_allocator_reexports_none():
    # allocator.py used to re-export the names moved to allocator_rules.py (review debt
    # D1): every caller imports them from allocator_rules, and allocator.py imports only
    # the ones its own code uses.
    import ast
    from pathlib import Path

    from batchfit.device import allocator
    from batchfit.device import allocator_rules as rules

    root = Path(__file__).resolve().parents[2]
    defined = {name for name in vars(rules) if not name.startswith("__")}
    through_allocator = [
        f"{path.relative_to(root)}:{line} {name}"
        for folder in ("src", "tests", "benchmarks", "examples")
        for path in sorted((root / folder).rglob("*.py")) if ".timm" not in path.parts
        for line, name in _imports_from(path.read_text(encoding="utf-8"),
                                        "batchfit.device.allocator")
        if name in defined]
    assert through_allocator == []
    source = Path(allocator.__file__).read_text(encoding="utf-8")
    used = {node.id for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Name)}
    unused = [name for _, name in _imports_from(source, "batchfit.device.allocator_rules")
              if name not in used]
    assert unused == []
