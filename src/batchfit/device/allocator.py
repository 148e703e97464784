"""A model of PyTorch's CUDA caching allocator: tensor alloc/free events in, reserved bytes out.

What counts against a GPU is not the bytes of live tensors (``memory_allocated``) but the
segments the caching allocator holds from ``cudaMalloc`` (``memory_reserved``). This module
replays a sequence of allocations and frees through a pure-Python copy of the allocator's
rules, so a fake-tensor trace can be turned into the number that decides an OOM.

The rules follow ``DeviceCachingAllocator`` in c10/cuda/CUDACachingAllocator.cpp
(https://github.com/pytorch/pytorch/blob/main/c10/cuda/CUDACachingAllocator.cpp) with the
default ``PYTORCH_CUDA_ALLOC_CONF``:

* ``round_size``: every request rounds up to a multiple of ``kMinBlockSize`` = 512 B.
* ``get_pool``: rounded sizes <= ``kSmallSize`` = 1 MiB use the small pool, the rest the
  large pool; blocks never move between pools.
* ``get_allocation_size``: when no cached block fits, the allocator cudaMallocs a segment of
  ``kSmallBuffer`` = 2 MiB (small pool), ``kLargeBuffer`` = 20 MiB (rounded sizes below
  ``kMinLargeAlloc`` = 10 MiB), or the size rounded up to ``kRoundLarge`` = 2 MiB.
* ``get_free_block``: best fit, the first free block of the pool in (size, address) order
  whose size is at least the request.
* ``should_split``: a small-pool block splits when >= 512 B would remain, a large-pool block
  only when more than 1 MiB would remain; an unsplit block is handed out whole, and
  ``memory_allocated`` counts its whole size.
* ``free_block`` / ``try_merge_blocks``: a freed block merges with free neighbours of its
  segment; it stays reserved.
* ``malloc``: when cudaMalloc fails, ``release_cached_blocks`` returns every wholly free
  segment to the driver and the allocation is retried once before the OOM error.
  (``release_available_cached_blocks``, tried first in the source, does nothing unless
  ``max_split_size_mb`` is set.)

The options of ``PYTORCH_CUDA_ALLOC_CONF`` that change these rules are an
:class:`AllocatorConfig` (c10/cuda/CUDAAllocatorConfig.cpp parses them):
``max_split_size_mb`` (the oversize rules of ``get_free_block`` and ``should_split``, and
``release_available_cached_blocks``), ``max_non_split_rounding_mb``,
``roundup_power2_divisions`` (``round_size``) and ``expandable_segments`` (another model:
:mod:`batchfit.device.expandable`). :meth:`AllocatorConfig.from_environment` reads them as
the user's torch would.
* ``NativeCachingAllocator::allocate``: a 0-byte request never reaches the allocator (it
  returns a null pointer), so it costs nothing, although ``round_size(0)`` is 512.

Example:
    >>> from batchfit.device.allocator import AllocEvent, FreeEvent, replay
    >>> result = replay([AllocEvent("x", 5 * 2**20), FreeEvent("x"), AllocEvent("y", 3 * 2**20)])
    >>> result.peak_reserved_bytes // 2**20, result.peak_allocated_bytes // 2**20
    (20, 5)

Known limitations:
    * One device, one stream: no per-stream pools, ``record_stream`` events or deferred frees.
    * No ``set_per_process_memory_fraction`` (and so no ``garbage_collection_threshold``,
      which acts only under a fraction), no per-size ``roundup_power2_divisions`` lists,
      no ``backend:cudaMallocAsync``.
    * No CUDA graph private pools, no ``PYTORCH_NO_CUDA_MEMORY_CACHING``.
    * Addresses are synthetic (each new segment above the last), so ties between equal-sized
      free blocks, which the source breaks by device address, may resolve differently from
      a real run; the memory totals are unaffected until fragmentation differs.
    * ``capacity_bytes`` is all the allocator may reserve: memory outside it (CUDA context,
      cuBLAS/cuDNN workspaces, other processes) must be subtracted by the caller.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from batchfit.device.allocator_rules import (
    LARGE_BUFFER_BYTES,
    MIN_BLOCK_BYTES,
    NULL_HANDLE,
    SMALL_BUFFER_BYTES,
    SMALL_SIZE_BYTES,
    AllocatorOutOfMemory,
    AllocatorStats,
    BlockInfo,
    SegmentInfo,
    _check_nbytes,
    _LiveBlocks,
    refuses_oversize,
    round_size,
    segment_size,
)
from batchfit.errors import InvalidInputError

#: Options torch accepts that change nothing this model counts: host (pinned) memory,
#: locking, CUDA graphs; ``garbage_collection_threshold`` acts only under
#: ``torch.cuda.set_per_process_memory_fraction`` (``get_free_block`` and ``malloc`` test
#: ``set_fraction && garbage_collection_threshold() > 0``), which batchfit does not model.
_NO_EFFECT_OPTIONS = frozenset({
    "garbage_collection_threshold", "release_lock_on_cudamalloc",
    "pinned_use_cuda_host_register", "pinned_num_register_threads",
    "pinned_use_background_threads", "graph_capture_record_stream_reuse",
    "pinned_reserve_segment_size_mb"})
#: The modelled options and the :class:`AllocatorConfig` fields they set.
_FIELDS = {"max_split_size_mb": "max_split_size_bytes",
           "max_non_split_rounding_mb": "max_non_split_rounding_bytes",
           "roundup_power2_divisions": "roundup_power2_divisions",
           "expandable_segments": "expandable_segments"}
#: The environment variables torch reads its options from: the CUDA name first (torch 2.9.1
#: still ignores ``expandable_segments`` under the new name, pytorch/pytorch#183387).
ALLOC_CONF_VARIABLES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


@dataclass(frozen=True)
class AllocatorConfig:
    """The ``PYTORCH_CUDA_ALLOC_CONF`` options that change what the allocator reserves.

    Parsed as c10/cuda/CUDAAllocatorConfig.cpp does (``parseArgs``): ``key:value`` pairs
    separated by commas.

    Attributes:
        max_split_size_bytes: ``max_split_size_mb`` (None: unset, torch's default). Blocks
            of at least this size are never split; a smaller request is never served
            from one, a larger one only from a block less than
            ``max_non_split_rounding_bytes`` bigger (``get_free_block``); when cudaMalloc
            fails, such blocks are freed first (``release_available_cached_blocks``).
        max_non_split_rounding_bytes: ``max_non_split_rounding_mb`` (default 20 MiB,
            ``kLargeBuffer``).
        roundup_power2_divisions: ``roundup_power2_divisions`` as one number (0: unset;
            see :func:`round_size`).
        expandable_segments: ``expandable_segments:True``
            (:class:`batchfit.device.expandable.ExpandableAllocator`).

    Example:
        >>> AllocatorConfig.parse("max_split_size_mb:128,expandable_segments:False")
        AllocatorConfig(max_split_size_bytes=134217728, max_non_split_rounding_bytes=20971520, roundup_power2_divisions=0, expandable_segments=False)
    """

    max_split_size_bytes: int | None = None
    max_non_split_rounding_bytes: int = LARGE_BUFFER_BYTES
    roundup_power2_divisions: int = 0
    expandable_segments: bool = False

    @classmethod
    def parse(cls, text: str | None) -> AllocatorConfig:
        """The options of one ``PYTORCH_CUDA_ALLOC_CONF`` string ("" or None: defaults).

        Raises:
            InvalidInputError: an unknown option, a malformed value, a value torch refuses
                (``max_split_size_mb`` <= 20, divisions not a power of two), or an option
                that changes memory in a way batchfit does not model (``backend:cudaMallocAsync``,
                per-size ``roundup_power2_divisions`` lists).
        """
        values: dict[str, object] = {}
        for item in filter(None, (part.strip() for part in (text or "").split(","))):
            key, sep, value = (x.strip() for x in item.partition(":"))
            if not sep or not value:
                raise InvalidInputError(f"allocator option {item!r} has no value: write key:value, "
                                        "e.g. expandable_segments:True")
            value_of_field = _option_value(key, value)
            if key in _FIELDS:
                values[_FIELDS[key]] = value_of_field
        return cls(**values)  # type: ignore[arg-type]

    @classmethod
    def resolve(cls, value: AllocatorConfig | str | None) -> AllocatorConfig:
        """A config from ``TrainConfig.alloc_conf``: itself, its text, or (None) the
        environment's."""
        if isinstance(value, AllocatorConfig):
            return value
        if value is None:
            return cls.from_environment()
        if not isinstance(value, str):
            raise InvalidInputError(f"alloc_conf must be PYTORCH_CUDA_ALLOC_CONF text or an "
                                    f"AllocatorConfig, not {value!r}")
        return cls.parse(value)

    @classmethod
    def from_environment(cls, environ: Any = None) -> AllocatorConfig:
        """The options this process's torch would read (:data:`ALLOC_CONF_VARIABLES`)."""
        import os

        env = os.environ if environ is None else environ
        for name in ALLOC_CONF_VARIABLES:
            if env.get(name):
                try:
                    return cls.parse(env[name])
                except InvalidInputError as exc:
                    raise InvalidInputError(f"{name}: {exc}") from exc
        return cls()

    def __str__(self) -> str:
        parts = []
        if self.max_split_size_bytes is not None:
            parts.append(f"max_split_size_mb:{self.max_split_size_bytes >> 20}")
        if self.max_non_split_rounding_bytes != LARGE_BUFFER_BYTES:
            parts.append(f"max_non_split_rounding_mb:{self.max_non_split_rounding_bytes >> 20}")
        if self.roundup_power2_divisions:
            parts.append(f"roundup_power2_divisions:{self.roundup_power2_divisions}")
        if self.expandable_segments:
            parts.append("expandable_segments:True")
        return ",".join(parts) or "default"

    def new_allocator(self, capacity_bytes: int | None = None) -> Any:
        """An empty allocator model with these options and ``capacity_bytes``."""
        if self.expandable_segments:
            from batchfit.device.expandable import ExpandableAllocator

            return ExpandableAllocator(
                capacity_bytes, round_size=self.round_size,
                max_split_size_bytes=self.max_split_size_bytes,
                max_non_split_rounding_bytes=self.max_non_split_rounding_bytes)
        return CachingAllocator(capacity_bytes, config=self)

    def round_size(self, nbytes: int) -> int:
        """:func:`round_size` with these options."""
        return round_size(nbytes, self.roundup_power2_divisions)


def _option_value(key: str, value: str) -> object:
    """One option's value, checked as ``CUDAAllocatorConfig::parseArgs`` checks it."""
    if key in ("max_split_size_mb", "max_non_split_rounding_mb"):
        megabytes = _integer(key, value)
        if key == "max_split_size_mb" and megabytes <= LARGE_BUFFER_BYTES >> 20:
            raise InvalidInputError(f"max_split_size_mb must be > {LARGE_BUFFER_BYTES >> 20} "
                                    f"(torch refuses {megabytes})")
        return megabytes << 20
    if key == "roundup_power2_divisions":
        if value.startswith("["):
            raise InvalidInputError("roundup_power2_divisions as a per-size list is not modelled: "
                                    "give one number, e.g. roundup_power2_divisions:4")
        divisions = _integer(key, value)
        if divisions & (divisions - 1) or divisions == 0:
            raise InvalidInputError(f"roundup_power2_divisions must be a power of 2, got {divisions}")
        return divisions
    if key == "expandable_segments":
        if value not in ("True", "False"):
            raise InvalidInputError(f"expandable_segments must be True or False, got {value!r}")
        return value == "True"
    if key == "backend":
        if value != "native":
            raise InvalidInputError(f"backend:{value} is not modelled (batchfit models torch's "
                                    "native caching allocator): drop the option or use backend:native")
        return None
    if key in _NO_EFFECT_OPTIONS:
        return None
    raise InvalidInputError(f"unknown allocator option {key!r}: batchfit knows max_split_size_mb, "
                            "max_non_split_rounding_mb, roundup_power2_divisions, "
                            "expandable_segments, backend and torch's host/locking options")


def _integer(key: str, value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise InvalidInputError(f"{key} must be a whole number, got {value!r}") from None
    if number < 0:
        raise InvalidInputError(f"{key} must not be negative, got {number}")
    return number



class _Block:
    """A contiguous range of a segment; ``prev``/``next`` link the segment's blocks."""

    __slots__ = ("address", "allocated", "next", "prev", "requested", "size", "small")

    def __init__(self, address: int, size: int, small: bool):
        self.address = address
        self.size = size
        self.small = small
        self.allocated = False
        self.requested = 0
        self.prev: _Block | None = None
        self.next: _Block | None = None


class _FreePool:
    """The cached free blocks of one pool, ordered like the source's ``BlockComparatorSize``.

    A sorted list of ``(size, address)`` keys plus a map from address to block: bisect
    finds the best fit in O(log n), and the list stays short (free blocks, not tensors).
    """

    def __init__(self) -> None:
        self._keys: list[tuple[int, int]] = []
        self._blocks: dict[int, _Block] = {}

    def add(self, block: _Block) -> None:
        bisect.insort(self._keys, (block.size, block.address))
        self._blocks[block.address] = block

    def remove(self, block: _Block) -> None:
        key = (block.size, block.address)
        del self._keys[bisect.bisect_left(self._keys, key)]
        del self._blocks[block.address]

    def take_best_fit(self, size: int,
                      refused: Callable[[int, int], bool] | None = None) -> _Block | None:
        """The smallest free block of at least ``size`` (None if ``refused(its size, size)``)."""
        # (size, -1) sorts before every key of that size, so this is lower_bound on size.
        i = bisect.bisect_left(self._keys, (size, -1))
        if i == len(self._keys) or (refused is not None and refused(self._keys[i][0], size)):
            return None
        return self._blocks.pop(self._keys.pop(i)[1])

    def whole_segments(self) -> list[_Block]:
        """Free blocks that span a whole segment: the ones ``release_blocks`` may cudaFree."""
        return [b for b in self._blocks.values() if b.prev is None and b.next is None]

    def blocks(self) -> Iterable[_Block]:
        return self._blocks.values()


class CachingAllocator(_LiveBlocks):
    """A one-stream, default-configuration model of torch's ``DeviceCachingAllocator``.

    Args:
        capacity_bytes: most bytes the allocator may reserve (the card minus what lives
            outside the allocator); None for no limit.

    Attributes:
        allocated_bytes: bytes in live blocks (``torch.cuda.memory_allocated``).
        reserved_bytes: bytes in segments (``torch.cuda.memory_reserved``).
        peak_allocated_bytes: high-water mark of ``allocated_bytes``.
        peak_reserved_bytes: high-water mark of ``reserved_bytes``.

    Example:
        >>> allocator = CachingAllocator()
        >>> handle = allocator.malloc(1)
        >>> allocator.allocated_bytes, allocator.reserved_bytes
        (512, 2097152)
        >>> allocator.free(handle)
        >>> allocator.allocated_bytes, allocator.reserved_bytes
        (0, 2097152)
        >>> allocator.empty_cache()
        >>> allocator.reserved_bytes
        0
    """

    def __init__(self, capacity_bytes: int | None = None,
                 config: AllocatorConfig | None = None):
        if capacity_bytes is not None:
            _check_nbytes(capacity_bytes)
        self.capacity_bytes = capacity_bytes
        self.config = config or AllocatorConfig()
        self._max_split = self.config.max_split_size_bytes or float("inf")
        # The best-fit search checks the oversize rules only when they exist (a hot path).
        self._refused = None if self.config.max_split_size_bytes is None else (
            lambda block_size, size: refuses_oversize(
                block_size, size, self.config.max_split_size_bytes,
                self.config.max_non_split_rounding_bytes))
        self.allocated_bytes = 0
        self.reserved_bytes = 0
        self.requested_bytes = 0
        self.peak_allocated_bytes = 0
        self.peak_reserved_bytes = 0
        self._segment_count = 0
        self._cuda_malloc_count = 0
        self._cuda_free_count = 0
        self._alloc_retry_count = 0
        self._oom_count = 0
        self._small_pool = _FreePool()
        self._large_pool = _FreePool()
        self._live: dict[int, _Block] = {}
        # Start above 0 so that no block's address collides with NULL_HANDLE.
        self._next_address = SMALL_BUFFER_BYTES

    def malloc(self, nbytes: int) -> int:
        """Allocate ``nbytes`` and return an opaque handle for :meth:`free`.

        Raises:
            AllocatorOutOfMemory: no cached block fits and a new segment would exceed
                ``capacity_bytes`` even after the cache was released.
            InvalidInputError: ``nbytes`` is not an int >= 0.
        """
        _check_nbytes(nbytes)
        if nbytes == 0:
            return NULL_HANDLE
        size = round_size(nbytes, self.config.roundup_power2_divisions)
        small = size <= SMALL_SIZE_BYTES
        pool = self._small_pool if small else self._large_pool
        block = pool.take_best_fit(size, self._refused)
        if block is None:
            block = self._alloc_segment(nbytes, size, small)
        if self._should_split(block, size):
            block = self._split(block, size, pool)
        return self._hand_out(block, nbytes)

    def free(self, handle: int) -> None:
        """Return an allocation to the cache; its segment stays reserved.

        Raises:
            InvalidInputError: ``handle`` is not live (never allocated or already freed).
        """
        if handle == NULL_HANDLE:
            return
        block = self._take_back(handle)
        pool = self._small_pool if block.small else self._large_pool
        prev, nxt = block.prev, block.next
        if prev is not None and not prev.allocated:
            pool.remove(prev)
            block.address = prev.address
            block.size += prev.size
            block.prev = prev.prev
            if block.prev is not None:
                block.prev.next = block
        if nxt is not None and not nxt.allocated:
            pool.remove(nxt)
            block.size += nxt.size
            block.next = nxt.next
            if block.next is not None:
                block.next.prev = block
        pool.add(block)

    def empty_cache(self) -> None:
        """Release every segment with no live block, as ``torch.cuda.empty_cache()`` does."""
        for pool in (self._large_pool, self._small_pool):
            for block in pool.whole_segments():
                self._release(pool, block)

    def stats(self) -> AllocatorStats:
        """A frozen snapshot of the counters."""
        return AllocatorStats(
            allocated_bytes=self.allocated_bytes,
            reserved_bytes=self.reserved_bytes,
            requested_bytes=self.requested_bytes,
            peak_allocated_bytes=self.peak_allocated_bytes,
            peak_reserved_bytes=self.peak_reserved_bytes,
            segment_count=self._segment_count,
            live_block_count=len(self._live),
            cuda_malloc_count=self._cuda_malloc_count,
            cuda_free_count=self._cuda_free_count,
            alloc_retry_count=self._alloc_retry_count,
            oom_count=self._oom_count,
        )

    def segments(self) -> tuple[SegmentInfo, ...]:
        """Every segment with its blocks in address order, like ``torch.cuda.memory_snapshot``.

        Walks all blocks, so it is for inspection and tests, not for the replay loop.
        """
        result = []
        for blocks in self._segment_blocks():
            infos = tuple(BlockInfo(size_bytes=b.size, allocated=b.allocated) for b in blocks)
            result.append(SegmentInfo(is_small_pool=blocks[0].small,
                                      size_bytes=sum(i.size_bytes for i in infos), blocks=infos))
        return tuple(result)

    def layout(self, owners: Mapping[int, int]) -> tuple:
        """The allocator's state up to where its segments lie, for telling whether a loop's
        step starts where an earlier one did: every segment in address order, its blocks
        in address order as ``(size, owner)``, the owner being ``owners[handle]`` for a
        live block and None for a free one. Best fit breaks ties by address, which this
        order keeps, and a new segment lies above every other: two allocators with equal
        layouts answer the same requests alike."""
        return tuple((blocks[0].small, tuple(
            (b.size, owners.get(b.address) if b.allocated else None) for b in blocks))
            for blocks in self._segment_blocks())

    def _segment_blocks(self) -> list[list[_Block]]:
        """Each segment's blocks in address order, the segments in address order."""
        blocks = [*self._live.values(), *self._small_pool.blocks(), *self._large_pool.blocks()]
        result = []
        for head in sorted((b for b in blocks if b.prev is None), key=lambda b: b.address):
            segment = []
            block: _Block | None = head
            while block is not None:
                segment.append(block)
                block = block.next
            result.append(segment)
        return result

    def _alloc_segment(self, nbytes: int, size: int, small: bool) -> _Block:
        """cudaMalloc a segment for ``size``; on failure release the cache and retry once."""
        seg_bytes = segment_size(size)
        capacity = self.capacity_bytes
        # The source fails only when the total would be strictly over the limit.
        if capacity is None or self.reserved_bytes + seg_bytes <= capacity:
            return self._new_segment(seg_bytes, small)
        if (self._release_oversize_blocks(size, small)
                and self.reserved_bytes + seg_bytes <= capacity):
            return self._new_segment(seg_bytes, small)
        self.empty_cache()
        self._alloc_retry_count += 1
        if self.reserved_bytes + seg_bytes <= capacity:
            return self._new_segment(seg_bytes, small)
        self._oom_count += 1
        raise AllocatorOutOfMemory(nbytes, seg_bytes, self.allocated_bytes, self.reserved_bytes,
                                   capacity)

    def _new_segment(self, nbytes: int, small: bool) -> _Block:
        block = _Block(self._next_address, nbytes, small)
        self._next_address += nbytes
        self.reserved_bytes += nbytes
        self._segment_count += 1
        self._cuda_malloc_count += 1
        self.peak_reserved_bytes = max(self.peak_reserved_bytes, self.reserved_bytes)
        return block

    def _should_split(self, block: _Block, size: int) -> bool:
        remaining = block.size - size
        if block.small:
            return remaining >= MIN_BLOCK_BYTES
        # Large blocks keep small slivers attached rather than fragment the large pool;
        # with max_split_size_mb, a block handed to a request that large stays whole.
        return size < self._max_split and remaining > SMALL_SIZE_BYTES

    def _release_oversize_blocks(self, size: int, small: bool) -> bool:
        """``release_available_cached_blocks``: with ``max_split_size_mb``, before
        releasing the whole cache, cudaFree the smallest cached oversize segment that
        covers the request (at least ``max_split_size``), else oversize segments from the
        largest down until they add up to that; False when that is not enough."""
        if self.config.max_split_size_bytes is None:
            return False
        pool = self._small_pool if small else self._large_pool
        wanted = max(size, self.config.max_split_size_bytes)
        oversize = sorted((b for b in pool.whole_segments() if b.size >= self._max_split),
                          key=lambda b: (b.size, b.address))
        covering = [b for b in oversize if b.size >= wanted]
        if covering:
            self._release(pool, covering[0])
            return True
        released = 0
        for block in reversed(oversize):
            if released >= wanted:
                break
            self._release(pool, block)
            released += block.size
        return released >= wanted

    def _release(self, pool: _FreePool, block: _Block) -> None:
        pool.remove(block)
        self.reserved_bytes -= block.size
        self._segment_count -= 1
        self._cuda_free_count += 1

    @staticmethod
    def _split(block: _Block, size: int, pool: _FreePool) -> _Block:
        """Carve ``size`` bytes off the front of the free ``block``; the rest goes back to the pool."""
        remaining = _Block(block.address + size, block.size - size, block.small)
        block.size = size
        remaining.prev, remaining.next = block, block.next
        if block.next is not None:
            block.next.prev = remaining
        block.next = remaining
        pool.add(remaining)
        return block


@dataclass(frozen=True, slots=True)
class AllocEvent:
    """A new live object ``key`` of ``nbytes`` bytes (0 is allowed and costs nothing)."""

    key: Hashable
    nbytes: int


@dataclass(frozen=True, slots=True)
class FreeEvent:
    """The live object ``key`` dies."""

    key: Hashable


@dataclass(frozen=True)
class ReplayResult:
    """The allocator's view of one replayed event sequence.

    Attributes:
        peak_allocated_bytes: high-water mark of bytes in live blocks.
        peak_reserved_bytes: high-water mark of reserved bytes: the number to compare
            with the card (after subtracting what lives outside the allocator).
        peak_allocated_index: first event after which allocated bytes were at their peak.
        peak_reserved_index: first event after which reserved bytes were at their peak.
            Both indices are None when there were no events.
        allocated_bytes: allocated bytes after each event.
        reserved_bytes: reserved bytes after each event.
        final: the allocator's counters after the last event.
    """

    peak_allocated_bytes: int
    peak_reserved_bytes: int
    peak_allocated_index: int | None
    peak_reserved_index: int | None
    allocated_bytes: list[int]
    reserved_bytes: list[int]
    final: AllocatorStats

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def replay(events: Iterable[AllocEvent | FreeEvent],
           capacity_bytes: int | None = None) -> ReplayResult:
    """Run alloc/free events through a fresh :class:`CachingAllocator`.

    Events are :class:`AllocEvent` (a new live object) and :class:`FreeEvent` (its death),
    matched by ``key``; a key may be reused once its object has been freed.

    Args:
        events: the events in program order.
        capacity_bytes: most bytes the allocator may reserve; None for no limit.

    Returns:
        Peaks, where they happened, and per-event allocated/reserved timelines.

    Raises:
        AllocatorOutOfMemory: an allocation did not fit, with ``event_index`` set.
        InvalidInputError: a key allocated twice, a free of a key that is not live, or an
            event of another type.

    Example:
        >>> events = [AllocEvent("a", 1), AllocEvent("b", 12 * 2**20), FreeEvent("b")]
        >>> result = replay(events)
        >>> result.reserved_bytes == [2 * 2**20, 14 * 2**20, 14 * 2**20]
        True
        >>> result.peak_reserved_index
        1
    """
    allocator = CachingAllocator(capacity_bytes)
    handles: dict[Hashable, int] = {}
    allocated: list[int] = []
    reserved: list[int] = []
    peak_allocated_index: int | None = None
    peak_reserved_index: int | None = None
    for index, event in enumerate(events):
        if isinstance(event, AllocEvent):
            if event.key in handles:
                raise InvalidInputError(f"event {index} allocates {event.key!r}, which is "
                                        "already live; free it first")
            try:
                handles[event.key] = allocator.malloc(event.nbytes)
            except AllocatorOutOfMemory as exc:
                raise exc.at_event(index) from exc
        elif isinstance(event, FreeEvent):
            handle = handles.pop(event.key, None)
            if handle is None:
                raise InvalidInputError(f"event {index} frees {event.key!r}, which is not live")
            allocator.free(handle)
        else:
            raise InvalidInputError(f"event {index} is a {type(event).__name__}; expected "
                                    "AllocEvent or FreeEvent")
        allocated.append(allocator.allocated_bytes)
        reserved.append(allocator.reserved_bytes)
        # Strictly greater, so the index is the first event that reached the peak.
        if peak_allocated_index is None or allocated[-1] > allocated[peak_allocated_index]:
            peak_allocated_index = index
        if peak_reserved_index is None or reserved[-1] > reserved[peak_reserved_index]:
            peak_reserved_index = index
    return ReplayResult(
        peak_allocated_bytes=allocator.peak_allocated_bytes,
        peak_reserved_bytes=allocator.peak_reserved_bytes,
        peak_allocated_index=peak_allocated_index,
        peak_reserved_index=peak_reserved_index,
        allocated_bytes=allocated,
        reserved_bytes=reserved,
        final=allocator.stats(),
    )
