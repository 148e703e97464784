"""The steady step replayed as a loop runs it: twice through one caching allocator.

Expected values are derived by hand from the allocator's rules in
c10/cuda/CUDACachingAllocator.cpp (see :mod:`batchfit.device.allocator`): requests of
10 MiB and more get a segment of their own size rounded to 2 MiB; freed blocks stay
cached; ``get_free_block`` takes the smallest cached block that fits; a large block
splits when more than 1 MiB would remain; when cudaMalloc fails the allocator releases
every wholly free segment and retries once.
"""

from __future__ import annotations

from batchfit.device.allocator import AllocatorConfig
from batchfit.device.profile import DeviceProfile
from batchfit.device.timeline import (
    MAX_LOOP_STEPS,
    fits_within,
    loop_steps,
    needed_bytes,
    replay_events,
)
from batchfit.engine.tracer import Category, Event, EventKind, Phase

MiB = 1 << 20
DEV = DeviceProfile.cuda(80 * 1024 * MiB, (8, 0), context_bytes=0, workspace_bytes=0)


def _alloc(key: int, mib: int, phase: Phase = Phase.FORWARD) -> Event:
    return Event(EventKind.ALLOC, key, mib * MiB, Category.ACTIVATIONS, "m", "op", phase)


def _free(key: int, mib: int, phase: Phase = Phase.FORWARD) -> Event:
    return Event(EventKind.FREE, key, mib * MiB, Category.ACTIVATIONS, "m", "op", phase)


# s (12 MiB) and t (30 MiB) live together, then u (40 MiB) alone.
STEP = [_alloc(1, 12), _alloc(2, 30), _free(1, 12), _free(2, 30), _alloc(3, 40), _free(3, 40)]


def test_one_step_on_an_empty_allocator_needs_42_mib():
    # s and t each cudaMalloc their own segment (12 + 30 = 42 MiB). u (40 MiB) finds no
    # cached block that large; under a 42 MiB capacity cudaMalloc fails, the two wholly
    # free segments are released and the retry gets a 40 MiB segment. 40 MiB fails at t.
    assert needed_bytes(STEP, DEV, loop=False) == 42 * MiB


def test_the_second_step_on_the_first_steps_cache_needs_70_mib():
    # After step 1 the cache holds u's 40 MiB segment only (the retry released the others).
    # Step 2: s (12) takes the 40 MiB block by best fit and splits it (28 MiB > 1 MiB
    # remains); t (30) does not fit the 28 MiB remainder, so cudaMalloc(30): with less than
    # 40 + 30 MiB nothing is wholly free to release (s holds the 40 MiB segment): OOM.
    # At 70 MiB, s and t free, the 40 MiB segment merges whole again and takes u.
    assert needed_bytes(STEP, DEV) == 70 * MiB
    assert fits_within(STEP, DEV, 70 * MiB)
    assert not fits_within(STEP, DEV, 68 * MiB)  # capacities are whole 2 MiB segments


def test_max_split_size_keeps_the_second_step_from_splitting_the_cached_block():
    # PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:21 (get_free_block refuses an oversize
    # block, >= 21 MiB, to a request below 21 MiB; an oversize request takes a block less
    # than 20 MiB larger whole). Step 2 at a 42 MiB capacity: s (12) is refused the cached
    # 40 MiB block, cudaMalloc(12) fails (52 > 42), release_available_cached_blocks frees
    # the 40 MiB oversize segment and s gets 12; t (30) gets its own 30 (42 in all); u (40)
    # fits after the release of the two free segments. At 40 MiB step 1 already fails at t
    # (12 + 30). So 42 MiB, where the default allocator needs 70.
    device = DEV.with_allocator(AllocatorConfig(max_split_size_bytes=21 * MiB))
    assert needed_bytes(STEP, device) == 42 * MiB
    assert fits_within(STEP, device, 42 * MiB) and not fits_within(STEP, device, 40 * MiB)


def test_expandable_segments_serve_the_loop_from_three_mapped_pages():
    # expandable_segments:True, 20 MiB pages. Step 1: s (12) maps page 0 and splits it
    # (8 MiB free at 12); t (30) finds no free block, so find_expandable_block takes that
    # free 8 MiB block (it precedes the unmapped rest) and maps 22 MiB more: pages 1-2,
    # t at [12, 42), 18 MiB free after it; 60 MiB mapped. s and t free, merging [0, 60);
    # u (40) splits it. Step 2 finds [0, 60) free and splits it again for s, t and u. At
    # 40 MiB, t cannot map its two pages and the retry unmaps nothing (the free 8 MiB
    # covers no whole page). So 60 MiB, for one step and for the loop.
    device = DEV.with_allocator(AllocatorConfig(expandable_segments=True))
    assert needed_bytes(STEP, device, loop=False) == 60 * MiB
    assert needed_bytes(STEP, device) == 60 * MiB
    assert not fits_within(STEP, device, 58 * MiB)


def test_roundup_power2_divisions_rounds_what_the_replay_reserves():
    # roundup_power2_divisions:4 rounds 1200 MiB up to 1280 (steps of 1024/4 MiB), and
    # the breakdown counts the rounded block.
    step = [_alloc(1, 1200), _free(1, 1200)]
    device = DEV.with_allocator(AllocatorConfig(roundup_power2_divisions=4))
    assert needed_bytes(step, DEV) == 1200 * MiB and needed_bytes(step, device) == 1280 * MiB
    assert replay_events(step, device).by_category[Category.ACTIVATIONS] == 1280 * MiB


def test_the_timeline_reports_the_loops_peak_on_the_steps_events():
    timeline = replay_events(STEP, DEV)
    assert timeline.peak_reserved_bytes == 70 * MiB
    assert len(timeline.reserved_bytes) == len(STEP)  # the second step's, event for event
    assert replay_events(STEP, DEV, loop=False).peak_reserved_bytes == 42 * MiB


def test_setup_runs_once_and_leftovers_are_freed_before_the_next_step():
    # w (100 MiB, set up once) lives on; the step makes s (12) and t (30) and frees s; t
    # outlives the step. Step 1: 100 + 12 + 30 = 142 MiB of segments. If t were not freed
    # before step 2, step 2's t would need a second 30 MiB segment (172); if the setup ran
    # again, a second 100 (242). Freed, step 2 takes s and t's cached blocks: 142.
    setup = [_alloc(10, 100, Phase.SETUP)]
    step = [_alloc(1, 12), _alloc(2, 30), _free(1, 12)]
    assert needed_bytes(setup + step, DEV) == 142 * MiB
    assert loop_steps(setup + step, DEV) == 2  # step 2 leaves the allocator as step 1 did
    # A step that frees the setup storage: the later steps find it gone. Step 1 leaves
    # 100, 12 and 30 cached; step 2 takes the 12 and the 30 again.
    frees_setup = setup + step + [_free(10, 100)]
    assert needed_bytes(frees_setup, DEV) == 142 * MiB
    # The timeline is the last step's, event for event after the setup's: step 2 runs on
    # the cached segments, so reserved stays at 142 throughout.
    timeline = replay_events(setup + step, DEV)
    assert len(timeline.reserved_bytes) == 4
    assert [r // MiB for r in timeline.reserved_bytes] == [100, 142, 142, 142]


def test_a_step_that_reuses_its_segments_exactly_needs_no_more_in_a_loop():
    # One 24 MiB storage per step: step 2 takes step 1's cached 24 MiB block whole.
    step = [_alloc(1, 24), _free(1, 24)]
    assert needed_bytes(step, DEV) == needed_bytes(step, DEV, loop=False) == 24 * MiB


def test_the_cpu_replay_is_not_looped():
    cpu = DeviceProfile.cpu()
    assert needed_bytes(STEP, cpu) == 42 * MiB  # s + t live together; the CPU frees at once


def _workspace(key: int, mib: int, kind: EventKind) -> Event:
    return Event(kind, key, mib * MiB, Category.TEMPORARIES, "m",
                 "cudnn workspace (aten.convolution.default)", Phase.FORWARD)


# a (10 MiB) lives while a convolution asks for a 12 MiB workspace; then b (10 MiB).
CONV_STEP = [_alloc(1, 10), _workspace(2, 12, EventKind.ALLOC), _workspace(2, 12, EventKind.FREE),
             _free(1, 10), _alloc(3, 10), _free(3, 10)]


def test_a_cudnn_workspace_that_does_not_fit_falls_back_instead_of_failing_the_step():
    # torch catches the OutOfMemoryError of a benchmarked convolution's workspace and runs
    # another algorithm (Conv_v7.cpp AlgoIterator::try_all, Conv_v8.cpp try_plans).
    # Under 10 MiB: a gets a 10 MiB segment (requests >= 10 MiB get their own size); the
    # workspace's cudaMalloc(12) fails, no segment is wholly free to release, so it is
    # skipped; b takes a's cached 10 MiB block. Both steps of the loop alike: 10 MiB.
    assert needed_bytes(CONV_STEP, DEV) == 10 * MiB
    assert fits_within(CONV_STEP, DEV, 10 * MiB)
    # The same 12 MiB as an ordinary temporary must fit: 10 + 12 = 22 MiB (then b takes
    # a's block, the loop's second step finds both blocks cached).
    plain = [Event(e.kind, e.key, e.nbytes, e.category, e.module, "op", e.phase) for e in CONV_STEP]
    assert needed_bytes(plain, DEV) == 22 * MiB
    assert not fits_within(plain, DEV, 20 * MiB)


def test_the_breakdown_describes_the_step_at_the_capacity_the_solver_solved_with():
    # One least-capacity rule for needed_bytes and replay_events. Unlimited, the workspace
    # gets its 12 MiB segment (a 10 + 12 = 22 MiB reserved), but the step runs in 10 MiB
    # (above): the breakdown's reserved peak is those 10 MiB, with a (10 MiB) alone held
    # at the peak, the skipped workspace not counted, and no slack.
    for loop in (True, False):
        timeline = replay_events(CONV_STEP, DEV, loop=loop)
        assert timeline.peak_reserved_bytes == needed_bytes(CONV_STEP, DEV, loop=loop) == 10 * MiB
        assert timeline.peak_allocated_bytes == 10 * MiB
        assert timeline.by_category[Category.ACTIVATIONS] == 10 * MiB
        assert Category.TEMPORARIES not in timeline.by_category
        assert timeline.by_category[Category.ALLOCATOR_SLACK] == 0
    # TWO_CONVS (below) needs 36 MiB, where step 1's first workspace is allocated (14 + 20
    # = 34 <= 36): the breakdown replays at 36 MiB, not the unlimited replay's 54 MiB.
    assert replay_events(TWO_CONVS, DEV).peak_reserved_bytes == 36 * MiB


# a (14 MiB) with a 20 MiB workspace, then b (16 MiB) and another 20 MiB workspace.
TWO_CONVS = [_alloc(1, 14), _workspace(2, 20, EventKind.ALLOC), _workspace(2, 20, EventKind.FREE),
             _alloc(3, 16), _free(1, 14), _workspace(4, 20, EventKind.ALLOC),
             _workspace(4, 20, EventKind.FREE), _free(3, 16)]


def test_with_fallible_workspaces_more_room_can_fail_and_the_answer_is_above_every_failure():
    # 34 MiB. Step 1: a gets 14; the first workspace fits (14 + 20 = 34) and leaves its
    # 20 MiB segment W cached; b (16) takes W by best fit and splits it; the second
    # workspace cannot have 20 more (releasing a's freed 14 leaves 20 + 20 > 34): skipped.
    # b frees, W is whole. Step 2: a (14) splits W; the first workspace is skipped (20 + 20
    # > 34, W is not wholly free); b (16) needs a new segment: 36 > 34, nothing to
    # release: out of memory.
    assert not fits_within(TWO_CONVS, DEV, 34 * MiB)
    # 32 MiB. Step 1: the first workspace is skipped (34 > 32), b gets its own 16 MiB
    # segment, the second is skipped (a's 14 released, 16 + 20 > 32). Step 2: a splits
    # b's cached 16 MiB block, both workspaces are skipped, b gets a new 16: 32. Fits.
    assert fits_within(TWO_CONVS, DEV, 32 * MiB)
    # 36 MiB: as at 34, but step 2's b fits its new segment (20 + 16 = 36). The answer is
    # the least capacity above which every capacity fits (checked one by one here).
    assert needed_bytes(TWO_CONVS, DEV) == 36 * MiB
    assert all(fits_within(TWO_CONVS, DEV, mib * MiB) for mib in range(36, 80, 2))


def _search(key: int) -> Event:
    return Event(EventKind.EMPTY_CACHE, key, 0, Category.TEMPORARIES, "m",
                 "cudnn benchmark search (aten.convolution.default)", Phase.FORWARD)


# a (30 MiB) is freed; a convolution searches (key -5); b (10) and c (30) live together;
# both free; the same shape again (no search: torch's benchmark cache has it); d (20).
SEARCH_STEP = [_alloc(1, 30), _free(1, 30), _search(-5), _alloc(2, 10), _alloc(3, 30),
               _free(2, 10), _free(3, 30), _search(-5), _alloc(4, 20), _free(4, 20)]


def test_the_first_search_of_a_shape_empties_the_cache_and_the_second_does_not():
    # With the search: a's free 30 MiB segment goes back to the driver; b gets its own
    # 10 MiB segment (>= 10 MiB: its size), c its own 30: 40 MiB. The second mark empties
    # nothing (reserved stays 40); d (20) splits c's cached 30 MiB block. At 38 MiB c's
    # cudaMalloc fails with nothing wholly free: 40 is the least capacity.
    timeline = replay_events(SEARCH_STEP, DEV, loop=False)
    assert needed_bytes(SEARCH_STEP, DEV, loop=False) == 40 * MiB
    assert timeline.reserved_bytes[2] == 0 and timeline.reserved_bytes[7] == 40 * MiB
    # Without it, b (10) splits a's cached 30 MiB block (20 MiB > 1 MiB remains); c (30)
    # needs a new segment and nothing is wholly free to release: 30 + 30 = 60 MiB.
    plain = [e for e in SEARCH_STEP if e.kind is not EventKind.EMPTY_CACHE]
    assert needed_bytes(plain, DEV, loop=False) == 60 * MiB
    # In a loop the later steps have no search (the algorithm is cached). The second runs
    # on the first step's 10 and 30 MiB segments (a takes the 30, then b and c their own,
    # d splits the 30) and leaves them as the first did: the loop repeats, 40 MiB.
    assert loop_steps(SEARCH_STEP, DEV) == 2 and loop_steps(plain, DEV) == 2
    assert needed_bytes(SEARCH_STEP, DEV) == 40 * MiB


# a (12) and b (14) live; a search that finds nothing wholly free to release; c (16);
# a dies; d (20); all die.
NO_FIXED_POINT = [_alloc(1, 12), _alloc(2, 14), _search(-5), _alloc(3, 16), _free(1, 12),
                  _alloc(4, 20), _free(3, 16), _free(2, 14), _free(4, 20)]


def test_the_loop_runs_until_the_allocator_repeats_a_state():
    # Within 60 MiB. Step 1 (empty allocator): a, b, c get segments of their own sizes (12 +
    # 14 + 16 = 42); d (20) fails at 62, a's free 12 MiB segment is released, d gets 20:
    # 50, segments (14, 16, 20). Step 2: a splits 14, b splits 16, c splits 20 (2, 2 and 4
    # MiB remain); a dies (its 14 whole); d finds no 20 MiB block: 50 + 20 > 60 releases
    # the 14: 56, segments (16, 20, 20). Step 3: a splits 16, b and c split the 20s; a
    # dies; d: 56 + 20 > 60 releases the 16: 60, segments (20, 20, 20). Step 4: a, b, c
    # split the three 20s; a dies; d takes a's 20 whole; all die: (20, 20, 20) again, so
    # every later step is step 4. Four steps; at 58 MiB step 3 fails (56 - 16 + 20 = 60).
    plain = [e for e in NO_FIXED_POINT if e.kind is not EventKind.EMPTY_CACHE]
    assert loop_steps(plain, DEV, 60 * MiB) == 4
    assert needed_bytes(plain, DEV) == 60 * MiB
    assert not fits_within(plain, DEV, 58 * MiB)
    # Two steps alone would have needed 56, one 50.
    assert needed_bytes(plain, DEV, loop=False) == 50 * MiB
    # The search (after b) finds nothing wholly free in step 1 and is not run again.
    assert needed_bytes(NO_FIXED_POINT, DEV) == 60 * MiB
    # Unlimited, step 2 is served from step 1's four segments and leaves them so: 2 steps.
    assert loop_steps(plain, DEV) == 2 <= MAX_LOOP_STEPS
    # The timeline says how many steps its loop ran (at the 60 MiB it needs): four; one
    # without the loop, and on the CPU, which is not looped.
    assert replay_events(plain, DEV).loop_steps == 4
    assert replay_events(plain, DEV, loop=False).loop_steps == 1
    assert replay_events(plain, DeviceProfile.cpu()).loop_steps == 1
