"""Tests of the expandable-segments allocator model.

Every expected number is derived by hand in a comment from the rules of
c10/cuda/CUDACachingAllocator.cpp with ``expandable_segments:True``: one virtual range per
pool, mapped in pages of 2 MiB (small pool, rounded size <= 1 MiB) or 20 MiB (large pool);
``find_expandable_block`` grows the lowest-address run of free + unmapped blocks;
``map_block`` maps whole pages and merges with free mapped neighbours; blocks split when
>= 512 B would remain (both pools); ``release_cached_blocks`` unmaps whole free pages.
Page offsets below are counted from the range's start; never copied from the code's output.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchfit.device.allocator import CachingAllocator
from batchfit.device.allocator_rules import NULL_HANDLE, AllocatorOutOfMemory, round_size
from batchfit.device.expandable import ExpandableAllocator
from batchfit.errors import InvalidInputError

KiB = 2**10
MiB = 2**20


def _layout(allocator: ExpandableAllocator) -> list[list[tuple[int, bool]]]:
    """(size in MiB, allocated) of the mapped blocks, per range."""
    return [[(b.size_bytes / MiB, b.allocated) for b in s.blocks] for s in allocator.segments()]


# --- mapping pages ----------------------------------------------------------------------

def test_5mib_maps_one_page_and_10mib_reuses_its_tail():
    allocator = ExpandableAllocator()
    a = allocator.malloc(5 * MiB)
    # New large range; map_block(5 MiB) maps pages [0, ceil(5/20)) = 1 page of 20 MiB,
    # split 5 | 15 free (15 MiB >= 512 B).
    assert (allocator.allocated_bytes, allocator.reserved_bytes) == (5 * MiB, 20 * MiB)
    b = allocator.malloc(10 * MiB)
    # Best fit is the free 15 MiB tail at offset 5 MiB: no new page; split 10 | 5.
    assert b - a == 5 * MiB
    assert (allocator.allocated_bytes, allocator.reserved_bytes) == (15 * MiB, 20 * MiB)
    assert _layout(allocator) == [[(5, True), (10, True), (5, False)]]
    # The default allocator reuses that 15 MiB tail too (15 - 10 = 5 > 1 MiB: split).
    default = CachingAllocator()
    default.malloc(5 * MiB)
    default.malloc(10 * MiB)
    assert default.reserved_bytes == 20 * MiB


def test_a_lone_12mib_request_maps_a_whole_20mib_page():
    allocator = ExpandableAllocator()
    allocator.malloc(12 * MiB)
    # 1 page of 20 MiB, split 12 | 8 free.
    assert (allocator.allocated_bytes, allocator.reserved_bytes) == (12 * MiB, 20 * MiB)
    default = CachingAllocator()
    default.malloc(12 * MiB)
    # The default allocator's own segment: 12 MiB rounded to 2 MiB is 12 MiB.
    assert default.reserved_bytes == 12 * MiB


def test_30mib_maps_two_pages_and_512b_one_small_page():
    allocator = ExpandableAllocator()
    allocator.malloc(30 * MiB)
    # Pages [0, ceil(30/20)) = 2 pages = 40 MiB; split 30 | 10 free.
    assert (allocator.allocated_bytes, allocator.reserved_bytes) == (30 * MiB, 40 * MiB)
    allocator.malloc(512)
    # 512 B is small: a second range, pages of 2 MiB, one page mapped; 40 + 2.
    assert (allocator.allocated_bytes, allocator.reserved_bytes) == (30 * MiB + 512, 42 * MiB)
    small, large = sorted(allocator.segments(), key=lambda s: not s.is_small_pool)
    assert (small.size_bytes, large.size_bytes) == (2 * MiB, 40 * MiB)
    assert [(b.size_bytes, b.allocated) for b in small.blocks] == [
        (512, True), (2 * MiB - 512, False)]
    assert allocator.stats().segment_count == 2


def test_zero_byte_allocation_costs_nothing():
    allocator = ExpandableAllocator()
    assert allocator.malloc(0) == NULL_HANDLE
    allocator.free(NULL_HANDLE)
    assert (allocator.allocated_bytes, allocator.reserved_bytes) == (0, 0)
    assert allocator.segments() == ()


def test_the_tail_grows_by_mapping_the_next_page():
    allocator = ExpandableAllocator()
    a = allocator.malloc(15 * MiB)
    # Page 0 mapped: a 15 | 5 free, then the unmapped rest of the range.
    b = allocator.malloc(15 * MiB)
    # No free block >= 15 MiB. find_expandable_block: the unmapped rest has a free 5 MiB
    # block before it, so the run starts at offset 15 MiB; map_block(next, 15 - 5 = 10 MiB)
    # maps page 1 (offsets 20-40 MiB), which merges into a free 25 MiB block at 15 MiB;
    # split 15 | 10. Two pages (40 MiB), not three 20 MiB ones (60).
    assert b - a == 15 * MiB
    assert (allocator.allocated_bytes, allocator.reserved_bytes) == (30 * MiB, 40 * MiB)
    assert _layout(allocator) == [[(15, True), (15, True), (10, False)]]
    assert allocator.stats().cuda_malloc_count == 2  # two map_block calls


def test_a_large_block_splits_off_less_than_1mib():
    def run(allocator):
        a = allocator.malloc(5 * MiB)
        allocator.malloc(15 * MiB)  # the free 15 MiB tail, exactly: 20 MiB in use
        allocator.free(a)
        assert allocator.malloc(4 * MiB + 512 * KiB) == a  # best fit: a's 5 MiB hole
        return allocator

    expandable, default = run(ExpandableAllocator()), run(CachingAllocator())
    # Expandable: 0.5 MiB >= 512 B remains, so it splits: 4.5 + 15 allocated.
    assert expandable.allocated_bytes == 19 * MiB + 512 * KiB
    assert _layout(expandable) == [[(4.5, True), (0.5, False), (15, True)]]
    # Default: 0.5 MiB is not > 1 MiB: the whole 5 MiB block is handed out, 5 + 15.
    assert default.allocated_bytes == 20 * MiB
    assert expandable.reserved_bytes == default.reserved_bytes == 20 * MiB


def test_free_merges_only_free_mapped_neighbours_and_unmaps_nothing():
    allocator = ExpandableAllocator()
    a, b, c = (allocator.malloc(5 * MiB) for _ in range(3))
    # Page 0: a 5 | b 5 | c 5 | 5 free.
    allocator.free(c)
    allocator.free(a)
    # c merged with the free tail into 10 MiB; a stands alone next to live b.
    assert _layout(allocator) == [[(5, False), (5, True), (10, False)]]
    allocator.free(b)
    # One free mapped 20 MiB block; the unmapped rest of the range is not merged into it.
    assert _layout(allocator) == [[(20, False)]]
    assert allocator.reserved_bytes == 20 * MiB


# --- best fit ---------------------------------------------------------------------------

def test_best_fit_prefers_a_block_without_an_unmapped_tail():
    allocator = ExpandableAllocator()
    a = allocator.malloc(16 * MiB)  # page 0: a 16 | 4 free
    allocator.malloc(4 * MiB)  # the 4 MiB tail exactly: page 0 is full
    allocator.malloc(5 * MiB)  # page 1 (20-40): 5 | free 15, then the unmapped rest
    allocator.free(a)
    # Free blocks in (size, address) order: 15 MiB at 25 (expandable size 15 MiB + the
    # unmapped rest), then 16 MiB at 0 (expandable 16: live neighbour). lower_bound for
    # 15 MiB is the 15 MiB block, but the 16 MiB one has the smaller expandable size, so
    # get_free_block moves to it: 15 | 1 free at offset 0.
    assert allocator.malloc(15 * MiB) == a
    assert _layout(allocator) == [[(15, True), (1, False), (4, True), (5, True), (15, False)]]
    assert allocator.reserved_bytes == 40 * MiB


# --- max_split_size ---------------------------------------------------------------------

def test_a_small_request_does_not_take_an_oversize_block():
    def run(max_split):
        allocator = ExpandableAllocator(max_split_size_bytes=max_split)
        a = allocator.malloc(60 * MiB)  # pages 0-2, exactly
        allocator.malloc(20 * MiB)  # page 3, so a's block is not followed by unmapped space
        allocator.free(a)
        allocator.malloc(10 * MiB)
        return allocator.reserved_bytes

    # Unset: best fit takes a's free 60 MiB block; nothing new is mapped: 80 MiB.
    assert run(None) == 80 * MiB
    # 10 < 40 <= 60: get_free_block refuses the oversize block; find_expandable_block
    # skips it too (its unmapped neighbour is after the live page 3): page 4 is mapped.
    assert run(40 * MiB) == 100 * MiB


def test_a_large_request_takes_an_oversize_block_only_within_20mib():
    def run(nbytes):
        allocator = ExpandableAllocator(max_split_size_bytes=40 * MiB)
        a = allocator.malloc(80 * MiB)  # pages 0-3
        allocator.malloc(20 * MiB)  # page 4
        allocator.free(a)
        allocator.malloc(nbytes)
        return allocator.reserved_bytes

    # 40 MiB: 80 >= 40 + 20, refused; map pages 5-6 (2 pages) after the live page: 140.
    assert run(40 * MiB) == 140 * MiB
    # 61 MiB: 80 < 61 + 20, so the free 80 MiB block is reused: still 100.
    assert run(61 * MiB) == 100 * MiB


def test_free_space_next_to_unmapped_space_is_used_despite_max_split():
    allocator = ExpandableAllocator(max_split_size_bytes=40 * MiB)
    allocator.free(allocator.malloc(60 * MiB))  # pages 0-2, free, then the unmapped rest
    allocator.malloc(10 * MiB)
    # get_free_block refuses the 60 MiB block, but find_expandable_block starts its run at
    # the free block before the unmapped rest, and 60 >= 10 needs no new page.
    assert allocator.reserved_bytes == 60 * MiB
    assert _layout(allocator) == [[(10, True), (50, False)]]


# --- empty_cache ------------------------------------------------------------------------

def test_empty_cache_unmaps_only_whole_free_pages():
    allocator = ExpandableAllocator()
    a = allocator.malloc(5 * MiB)  # page 0: a 5 | 15 free
    allocator.empty_cache()
    # The free block [5, 20) holds no whole page (segmentRight(5) = 1 = segmentLeft(20)).
    assert allocator.reserved_bytes == 20 * MiB
    b = allocator.malloc(30 * MiB)
    # Run from the free block at 5: map 30 - 15 = 15 MiB -> page 1; [5, 40) free, split
    # 30 | 5: b = [5, 35), free [35, 40).
    assert allocator.reserved_bytes == 40 * MiB
    allocator.free(b)  # merges with [35, 40): free [5, 40)
    allocator.empty_cache()
    # Pages segmentRight(5) = 1 .. segmentLeft(40) = 2: page 1 is unmapped; [5, 20) stays.
    assert allocator.reserved_bytes == 20 * MiB
    assert _layout(allocator) == [[(5, True), (15, False)]]
    allocator.free(a)
    allocator.empty_cache()
    # [0, 20) is free: page 0 goes, the range is wholly unmapped and released.
    assert allocator.reserved_bytes == 0 and allocator.segments() == ()
    stats = allocator.stats()
    assert (stats.cuda_malloc_count, stats.cuda_free_count, stats.segment_count) == (2, 2, 0)
    assert stats.peak_reserved_bytes == 40 * MiB


# --- capacity, retry and out of memory --------------------------------------------------

def test_a_failed_map_unmaps_a_free_middle_page_and_retries():
    allocator = ExpandableAllocator(capacity_bytes=80 * MiB)
    _, b, c = (allocator.malloc(20 * MiB) for _ in range(3))  # pages 0, 1, 2, each exact
    allocator.free(b)
    d = allocator.malloc(40 * MiB)
    # No free block >= 40. The run after c maps pages 3-4: 60 + 40 > 80, fails.
    # release_cached_blocks unmaps b's page 1 (40 reserved). Retry: the unmapped page 1
    # has only 20 MiB of room between a and c; after c, pages 3-4: 40 + 40 <= 80.
    assert d - c == 20 * MiB
    assert (allocator.allocated_bytes, allocator.reserved_bytes) == (80 * MiB, 80 * MiB)
    assert _layout(allocator) == [[(20, True), (20, True), (40, True)]]
    stats = allocator.stats()
    assert (stats.alloc_retry_count, stats.oom_count) == (1, 0)
    assert (stats.cuda_malloc_count, stats.cuda_free_count) == (4, 1)
    with pytest.raises(AllocatorOutOfMemory) as info:
        allocator.malloc(20 * MiB)
    # The lowest run with room is the unmapped page 1; mapping it: 80 + 20 > 80, and
    # nothing is free to unmap, so the retry fails too.
    err = info.value
    assert (err.requested_bytes, err.segment_bytes) == (20 * MiB, 20 * MiB)
    assert (err.reserved_bytes, err.allocated_bytes, err.capacity_bytes) == (
        80 * MiB, 80 * MiB, 80 * MiB)
    assert allocator.stats().oom_count == 1 and allocator.stats().alloc_retry_count == 2


def test_oom_after_release_when_live_memory_leaves_no_room():
    allocator = ExpandableAllocator(capacity_bytes=60 * MiB)
    allocator.malloc(20 * MiB)
    b = allocator.malloc(20 * MiB)
    allocator.malloc(20 * MiB)  # pages 0-2: 60 of 60
    allocator.free(b)
    with pytest.raises(AllocatorOutOfMemory) as info:
        allocator.malloc(40 * MiB)
    # 40 MiB live + the 2 pages needed after c = 80 > 60. The retry had unmapped b's
    # page, so 40 MiB stays reserved.
    assert (info.value.reserved_bytes, info.value.segment_bytes) == (40 * MiB, 40 * MiB)
    assert allocator.reserved_bytes == 40 * MiB


def test_exactly_the_capacity_fits():
    allocator = ExpandableAllocator(capacity_bytes=40 * MiB)
    allocator.malloc(40 * MiB)  # 2 pages: 40 + 0 is not > 40
    assert allocator.reserved_bytes == 40 * MiB
    assert allocator.stats().alloc_retry_count == 0


def test_a_small_page_blocks_the_large_pool_until_released():
    allocator = ExpandableAllocator(capacity_bytes=40 * MiB)
    allocator.free(allocator.malloc(512))  # a free 2 MiB small page
    allocator.malloc(40 * MiB)
    # 2 + 40 > 40 fails; release_cached_blocks unmaps the small page; 0 + 40 fits.
    assert allocator.reserved_bytes == 40 * MiB
    assert allocator.stats().alloc_retry_count == 1


def test_address_space_defaults_to_nine_eighths_of_the_capacity():
    allocator = ExpandableAllocator(capacity_bytes=80 * MiB)
    # 80 + 80 // 8 = 90 MiB of address space: ceil(90 / 20) = 5 large pages per range.
    a, _, c, _ = (allocator.malloc(20 * MiB) for _ in range(4))  # pages 0-3, each exact
    allocator.free(a)
    allocator.free(c)
    allocator.empty_cache()
    # Pages 0 and 2 unmapped: 40 reserved; unmapped gaps of 20 MiB at 0, 40 and 80.
    assert allocator.reserved_bytes == 40 * MiB
    e = allocator.malloc(30 * MiB)
    # No gap holds 30 MiB, so find_expandable_block makes a new range 100 MiB above the
    # first and maps 2 pages there: 40 + 40 <= 80.
    assert e - a == 100 * MiB
    assert allocator.reserved_bytes == 80 * MiB
    assert allocator.stats().segment_count == 2


def test_an_explicit_address_space_is_rounded_up_to_whole_pages():
    allocator = ExpandableAllocator(address_space_bytes=30 * MiB)
    a = allocator.malloc(30 * MiB)
    # Large ranges: ceil(30 / 20) = 2 pages = 40 MiB, both mapped now: 30 | 10 free.
    b = allocator.malloc(15 * MiB)
    # The free 10 MiB is too small and the range has no unmapped block left: a new range
    # 40 MiB above the first, one page mapped there.
    assert b - a == 40 * MiB
    assert allocator.reserved_bytes == 60 * MiB
    c = allocator.malloc(10 * MiB)
    # Best fit: the first range's free 10 MiB (the new range has only 5 MiB free).
    assert c - a == 30 * MiB
    assert allocator.reserved_bytes == 60 * MiB


@pytest.mark.parametrize("bad", [-1, 1.5, "512", True, None])
def test_bad_sizes_are_rejected(bad):
    with pytest.raises(InvalidInputError):
        ExpandableAllocator().malloc(bad)


def test_the_injected_round_size_is_used():
    allocator = ExpandableAllocator(round_size=lambda n: 4 * MiB)
    allocator.malloc(1)
    # Everything rounds to 4 MiB, a large-pool size: one 20 MiB page, split 4 | 16.
    assert (allocator.allocated_bytes, allocator.reserved_bytes) == (4 * MiB, 20 * MiB)
    assert allocator.requested_bytes == 1


# --- properties -------------------------------------------------------------------------

_sizes = st.one_of(
    st.integers(0, 4 * KiB),
    st.integers(MiB - 1024, MiB + 1024),
    st.integers(MiB, 30 * MiB),
    st.integers(30 * MiB, 90 * MiB),
)
_ops = st.lists(st.one_of(st.tuples(st.just("alloc"), _sizes),
                          st.tuples(st.just("free"), st.integers(0, 10**6)),
                          st.tuples(st.just("empty"), st.just(0))),
                max_size=80)


def _step(allocator, live, kind, arg):
    if kind == "alloc":
        handle = allocator.malloc(arg)
        if handle != NULL_HANDLE:
            live[handle] = arg
    elif kind == "free" and live:
        handle = sorted(live)[arg % len(live)]
        allocator.free(handle)
        del live[handle]
    elif kind == "empty":
        allocator.empty_cache()


def _check(allocator, live):
    # Page sizes are multiples of 512 B, so any remainder is 0 or >= 512 B and is split off:
    # every live block is exactly its rounded size.
    assert allocator.allocated_bytes == sum(round_size(n) for n in live.values())
    assert allocator.requested_bytes == sum(live.values())
    assert allocator.reserved_bytes % (2 * MiB) == 0
    assert allocator.allocated_bytes <= allocator.reserved_bytes <= allocator.peak_reserved_bytes
    segments = allocator.segments()
    assert allocator.reserved_bytes == sum(s.size_bytes for s in segments)
    assert allocator.allocated_bytes == sum(
        b.size_bytes for s in segments for b in s.blocks if b.allocated)
    assert allocator.stats().segment_count == len(segments)
    for segment in segments:
        assert segment.size_bytes % (2 * MiB if segment.is_small_pool else 20 * MiB) == 0


@given(_ops)
@settings(max_examples=300, deadline=None)
def test_invariants_hold_over_random_sequences(ops):
    allocator, live = ExpandableAllocator(), {}
    for kind, arg in ops:
        before = allocator.reserved_bytes
        _step(allocator, live, kind, arg)
        _check(allocator, live)
        if kind != "empty":
            # Without a capacity nothing is unmapped except by empty_cache.
            assert allocator.reserved_bytes >= before
    for handle in list(live):
        allocator.free(handle)
    allocator.empty_cache()
    # Everything free: each range is free mapped blocks between page-aligned unmapped ones,
    # so every mapped page is whole and free, and every range is released.
    assert allocator.allocated_bytes == 0
    assert allocator.reserved_bytes == 0 and allocator.segments() == ()


@given(_ops, st.integers(0, 200 * MiB))
@settings(max_examples=300, deadline=None)
def test_invariants_hold_under_a_capacity(ops, capacity_bytes):
    allocator, live = ExpandableAllocator(capacity_bytes), {}
    for kind, arg in ops:
        try:
            _step(allocator, live, kind, arg)
        except AllocatorOutOfMemory as err:
            # The failed map really did not fit, after the cache was released.
            assert err.reserved_bytes + err.segment_bytes > capacity_bytes
        _check(allocator, live)
        assert allocator.reserved_bytes <= capacity_bytes
