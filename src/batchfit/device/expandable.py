"""A model of PyTorch's CUDA caching allocator with ``expandable_segments:True``.

With ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` (torch 2.4-2.9) each pool reserves
a large virtual range (``ExpandableSegment``) and maps physical pages into it on demand, so a
segment grows at its end instead of a new one being cudaMalloc'd. This is a pure-Python copy
of those rules in ``DeviceCachingAllocator`` (c10/cuda/CUDACachingAllocator.cpp), with the
interface of :class:`batchfit.device.allocator.CachingAllocator`:

* ``ExpandableSegment``: pages of ``segment_size_`` = 2 MiB (small pool) or 20 MiB (large
  pool), counted from the range's start (``segmentLeft``/``segmentRight``); a range spans
  ``totalGlobalMem * 9/8`` of address space (``address_space_bytes`` here).
* ``get_free_block``: best fit in (size, address) order, then step to the next block in
  that order while its ``expandable_size`` (size plus an unmapped block right after it) is
  smaller; then the two oversize rules of ``max_split_size_mb``.
* ``alloc_block`` -> ``try_allocate_expandable_block``: ``find_expandable_block`` picks the
  lowest-address run of free and unmapped blocks with room (a free block just before an
  unmapped one counts), or a new range; ``map_block`` maps whole pages, which merge with
  free mapped neighbours (``try_merge_blocks``).
* ``should_split``: ``remaining >= kMinBlockSize`` in both pools with expandable segments.
* ``free_block``: merges with free neighbours of the same mapped state; unmaps nothing.
* ``malloc``: on a failed map, ``release_cached_blocks`` -> ``release_blocks`` ->
  ``unmap_block`` unmaps every whole free page of both pools (``release_expandable_segment``
  drops a range left wholly unmapped) and the allocation is retried once.

Example:
    >>> allocator = ExpandableAllocator()
    >>> first = allocator.malloc(15 * 2**20)  # maps one 20 MiB page
    >>> second = allocator.malloc(15 * 2**20)  # its 5 MiB free tail + one more page
    >>> (second - first) // 2**20, allocator.reserved_bytes // 2**20
    (15, 40)

Known limitations:
    * One device, one stream: no per-stream ranges, ``record_stream`` events, peer access.
    * ``release_available_cached_blocks`` (tried before ``release_cached_blocks`` when
      ``max_split_size_mb`` is set) is not modelled: it calls ``release_block``, which the
      source reserves for non-expandable blocks.
    * No ``garbage_collection_threshold``, ``set_per_process_memory_fraction``, CUDA graph
      private pools (which never use expandable segments), or IPC.
    * ``capacity_bytes`` stands for the physical memory ``cuMemCreate`` may take; memory
      outside the allocator must be subtracted by the caller. A map that does not fit maps
      nothing, as ``ExpandableSegment::map`` releases the pages it created on OOM.
    * Addresses are synthetic (each new range above the last), so ties between equal-sized
      free blocks of different ranges may resolve differently from a real run.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Mapping

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
)
from batchfit.errors import InvalidInputError

_UNLIMITED_ADDRESS_SPACE = 2**50


class _Range:
    """One ``ExpandableSegment``: a virtual range of ``size`` bytes in pages of ``page``."""

    __slots__ = ("base", "mapped_bytes", "page", "size", "small")

    def __init__(self, base: int, size: int, page: int, small: bool):
        self.base, self.size, self.page, self.small = base, size, page, small
        self.mapped_bytes = 0


class _Block:
    """A contiguous part of a range; ``prev``/``next`` link the range's blocks by address."""

    __slots__ = ("address", "allocated", "mapped", "next", "prev", "range", "requested", "size")

    def __init__(self, address: int, size: int, rng: _Range, mapped: bool):
        self.address, self.size, self.range, self.mapped = address, size, rng, mapped
        self.allocated, self.requested = False, 0
        self.prev: _Block | None = None
        self.next: _Block | None = None

    def splice(self, before: _Block | None, after: _Block | None) -> None:
        """Link this block between ``before`` and ``after`` (the source's ``Block::splice``)."""
        self.prev, self.next = before, after
        if before is not None:
            before.next = self
        if after is not None:
            after.prev = self


class _SortedBlocks:
    """A ``std::set<Block*>``: by (size, address) (``BlockComparatorSize``) or by address."""

    def __init__(self, by_size: bool):
        self._by_size = by_size
        self.keys: list = []
        self.blocks: dict = {}

    def _key(self, block: _Block):
        return (block.size, block.address) if self._by_size else block.address

    def add(self, block: _Block) -> None:
        key = self._key(block)
        bisect.insort(self.keys, key)
        self.blocks[key] = block

    def remove(self, block: _Block) -> None:
        key = self._key(block)
        del self.keys[bisect.bisect_left(self.keys, key)]
        del self.blocks[key]

    def ordered(self) -> list[_Block]:
        return [self.blocks[key] for key in self.keys]


class _Pool:
    """A ``BlockPool``: free mapped blocks (``blocks``) and unmapped blocks (``unmapped``)."""

    def __init__(self, small: bool):
        self.small = small
        self.page = SMALL_BUFFER_BYTES if small else LARGE_BUFFER_BYTES
        self.free = _SortedBlocks(by_size=True)
        self.unmapped = _SortedBlocks(by_size=False)


def _expandable_size(block: _Block) -> int:
    """``get_free_block``'s size of a block that an unmapped neighbour could extend."""
    nxt = block.next
    return block.size + (nxt.size if nxt is not None and not nxt.mapped else 0)


class ExpandableAllocator(_LiveBlocks):
    """A one-stream model of ``DeviceCachingAllocator`` with expandable segments.

    Args:
        capacity_bytes: most bytes that may be mapped (the card minus what lives outside
            the allocator); None for no limit.
        round_size: the request rounding, e.g. one with ``roundup_power2_divisions``.
        address_space_bytes: virtual size of each range, rounded up to whole pages;
            default ``capacity + capacity // 8`` (the source's ``totalGlobalMem * 9/8``),
            or 2**50 without a capacity.
        max_split_size_bytes: ``max_split_size_mb`` in bytes; None for unset.
        max_non_split_rounding_bytes: ``max_non_split_rounding_mb`` in bytes.

    Attributes:
        allocated_bytes: bytes in live blocks (``torch.cuda.memory_allocated``).
        reserved_bytes: bytes of mapped pages (``torch.cuda.memory_reserved``).
        requested_bytes: bytes the live allocations asked for, before rounding.
        peak_allocated_bytes: high-water mark of ``allocated_bytes``.
        peak_reserved_bytes: high-water mark of ``reserved_bytes``.
    """

    def __init__(self, capacity_bytes: int | None = None, *,
                 round_size: Callable[[int], int] = round_size,
                 address_space_bytes: int | None = None,
                 max_split_size_bytes: int | None = None,
                 max_non_split_rounding_bytes: int = LARGE_BUFFER_BYTES):
        for value in (capacity_bytes, address_space_bytes, max_split_size_bytes):
            if value is not None:
                _check_nbytes(value)
        if address_space_bytes == 0:
            raise InvalidInputError("address_space_bytes must be > 0")
        if address_space_bytes is None:  # at least one page, even for a capacity of 0
            address_space_bytes = (_UNLIMITED_ADDRESS_SPACE if capacity_bytes is None
                                   else max(capacity_bytes + capacity_bytes // 8, 1))
        self.capacity_bytes = capacity_bytes
        self.address_space_bytes = address_space_bytes
        self.max_split_size_bytes = max_split_size_bytes
        self.max_non_split_rounding_bytes = max_non_split_rounding_bytes
        self._round_size = round_size
        self.allocated_bytes = self.reserved_bytes = self.requested_bytes = 0
        self.peak_allocated_bytes = self.peak_reserved_bytes = 0
        self._map_count = self._unmap_count = self._retry_count = self._oom_count = 0
        self._failed_map_bytes = 0
        self._small_pool, self._large_pool = _Pool(small=True), _Pool(small=False)
        self._ranges: list[_Range] = []
        self._live: dict[int, _Block] = {}
        self._next_address = SMALL_BUFFER_BYTES  # above 0, so never NULL_HANDLE

    def malloc(self, nbytes: int) -> int:
        """Allocate ``nbytes`` and return an opaque handle for :meth:`free`.

        Raises:
            AllocatorOutOfMemory: the pages to map would exceed ``capacity_bytes`` even
                after every whole free page was unmapped.
            InvalidInputError: ``nbytes`` is not an int >= 0.
        """
        _check_nbytes(nbytes)
        if nbytes == 0:
            return NULL_HANDLE
        size = self._round_size(nbytes)
        pool = self._small_pool if size <= SMALL_SIZE_BYTES else self._large_pool
        block = self._get_free_block(pool, size) or self._alloc_block(pool, nbytes, size)
        if block.size - size >= MIN_BLOCK_BYTES:  # should_split, expandable branch
            self._split(pool, block, size)
        return self._hand_out(block, nbytes)

    def free(self, handle: int) -> None:
        """Return an allocation to its pool (``free_block``); its pages stay mapped.

        Raises:
            InvalidInputError: ``handle`` is not live (never allocated or already freed).
        """
        if handle == NULL_HANDLE:
            return
        block = self._take_back(handle)
        pool = self._pool_of(block)
        self._try_merge(pool, block, block.prev)
        self._try_merge(pool, block, block.next)
        pool.free.add(block)

    def empty_cache(self) -> None:
        """Unmap every whole free page of both pools (``release_cached_blocks``)."""
        for pool in (self._large_pool, self._small_pool):
            # release_blocks gathers first: unmapping mutates the free set.
            for block in pool.free.ordered():
                self._unmap_block(pool, block)
                if not block.mapped and block.prev is None and block.next is None:
                    pool.unmapped.remove(block)  # release_expandable_segment
                    self._ranges.remove(block.range)

    def stats(self) -> AllocatorStats:
        """A frozen snapshot of the counters; a segment is a range with mapped pages."""
        return AllocatorStats(
            allocated_bytes=self.allocated_bytes, reserved_bytes=self.reserved_bytes,
            requested_bytes=self.requested_bytes,
            peak_allocated_bytes=self.peak_allocated_bytes,
            peak_reserved_bytes=self.peak_reserved_bytes,
            segment_count=sum(1 for r in self._ranges if r.mapped_bytes),
            live_block_count=len(self._live), cuda_malloc_count=self._map_count,
            cuda_free_count=self._unmap_count, alloc_retry_count=self._retry_count,
            oom_count=self._oom_count)

    def segments(self) -> tuple[SegmentInfo, ...]:
        """Every range with mapped pages, its mapped blocks in address order.

        ``size_bytes`` is the range's mapped bytes; unmapped blocks are left out. Walks all
        blocks, so it is for inspection and tests.
        """
        return tuple(
            SegmentInfo(is_small_pool=rng.small, size_bytes=rng.mapped_bytes,
                        blocks=tuple(BlockInfo(b.size, b.allocated) for b in blocks))
            for rng, blocks in self._range_blocks(unmapped=False) if blocks)

    def layout(self, owners: Mapping[int, int]) -> tuple:
        """The state up to where the ranges lie (see ``CachingAllocator.layout``): every
        range in address order, its blocks as ``(offset in the range, size, mapped,
        owner)``, the owner ``owners[handle]`` for a live block and None otherwise."""
        return tuple((rng.small, tuple(
            (b.address - rng.base, b.size, b.mapped,
             owners.get(b.address) if b.allocated else None) for b in blocks))
            for rng, blocks in self._range_blocks(unmapped=True))

    def _range_blocks(self, unmapped: bool) -> list[tuple[_Range, list[_Block]]]:
        """Each range in address order with its mapped blocks (and, with ``unmapped``, its
        unmapped ones) in address order."""
        blocks = [*self._live.values()]
        for pool in (self._small_pool, self._large_pool):
            blocks += pool.free.blocks.values()
            if unmapped:
                blocks += pool.unmapped.blocks.values()
        return [(rng, sorted((b for b in blocks if b.range is rng), key=lambda b: b.address))
                for rng in sorted(self._ranges, key=lambda r: r.base)]

    def _pool_of(self, block: _Block) -> _Pool:
        return self._small_pool if block.range.small else self._large_pool

    def _get_free_block(self, pool: _Pool, size: int) -> _Block | None:
        """``get_free_block``: best fit, preferring blocks with less expandable room."""
        keys, blocks = pool.free.keys, pool.free.blocks
        i = bisect.bisect_left(keys, (size, -1))
        if i == len(keys):
            return None
        while i + 1 < len(keys) and (_expandable_size(blocks[keys[i + 1]])
                                     < _expandable_size(blocks[keys[i]])):
            i += 1
        block = blocks[keys[i]]
        if refuses_oversize(block.size, size, self.max_split_size_bytes,
                            self.max_non_split_rounding_bytes):
            return None
        pool.free.remove(block)
        return block

    def _alloc_block(self, pool: _Pool, nbytes: int, size: int) -> _Block:
        """``malloc``'s ``alloc_block``, then ``release_cached_blocks`` and one retry."""
        block = self._try_allocate_expandable_block(pool, size)
        if block is None:
            self.empty_cache()
            self._retry_count += 1
            block = self._try_allocate_expandable_block(pool, size)
        if block is None:
            self._oom_count += 1
            raise AllocatorOutOfMemory(nbytes, self._failed_map_bytes, self.allocated_bytes,
                                       self.reserved_bytes, self.capacity_bytes or 0)
        return block

    def _try_allocate_expandable_block(self, pool: _Pool, size: int) -> _Block | None:
        """``try_allocate_expandable_block``: map pages until a free block holds ``size``."""
        candidate = self._find_expandable_block(pool, size)
        if not candidate.mapped and not self._map_block(pool, candidate,
                                                        min(candidate.size, size)):
            return None
        while candidate.size < size:
            nxt = candidate.next  # unmapped: free mapped neighbours are always merged
            if nxt is None:  # the range is too small
                self._failed_map_bytes = size - candidate.size
                return None
            if not self._map_block(pool, nxt, min(size - candidate.size, nxt.size)):
                return None
            candidate = nxt  # map_block merged the old candidate into it
        pool.free.remove(candidate)
        return candidate

    def _find_expandable_block(self, pool: _Pool, size: int) -> _Block:
        """``find_expandable_block``: lowest-address free run with room, else a new range."""
        for block in pool.unmapped.ordered():
            if block.prev is not None and not block.prev.allocated:
                block = block.prev
            room, cursor = 0, block
            while room < size and cursor is not None and not cursor.allocated:
                room, cursor = room + cursor.size, cursor.next
            if room >= size:  # has_available_address_space
                return block
        page = pool.page
        rng = _Range(self._next_address, -(-self.address_space_bytes // page) * page, page,
                     pool.small)
        self._next_address += rng.size
        self._ranges.append(rng)
        block = _Block(rng.base, rng.size, rng, mapped=False)
        pool.unmapped.add(block)
        return block

    def _map_block(self, pool: _Pool, block: _Block, nbytes: int) -> bool:
        """``map_block``: map the pages under ``[block, block + nbytes)``, all or none."""
        rng = block.range
        begin = (block.address - rng.base) // rng.page  # segmentLeft
        end = -(-(block.address + nbytes - rng.base) // rng.page)  # segmentRight
        mapped = (end - begin) * rng.page
        capacity = self.capacity_bytes
        if mapped == 0 or (capacity is not None and self.reserved_bytes + mapped > capacity):
            self._failed_map_bytes = mapped
            return False
        pool.unmapped.remove(block)
        block.mapped = True
        if mapped < block.size:
            rest = _Block(block.address + mapped, block.size - mapped, rng, mapped=False)
            rest.splice(block, block.next)
            pool.unmapped.add(rest)
            block.size = mapped
        self._try_merge(pool, block, block.prev)
        self._try_merge(pool, block, block.next)
        pool.free.add(block)
        self._add_reserved(rng, mapped)
        self._map_count += 1
        return True

    def _unmap_block(self, pool: _Pool, block: _Block) -> None:
        """``unmap_block``: unmap the whole pages inside a free block; the rest stays mapped."""
        rng, start, stop = block.range, block.address, block.address + block.size
        begin = -(-(start - rng.base) // rng.page)  # segmentRight
        end = (stop - rng.base) // rng.page  # segmentLeft
        if begin >= end:
            return
        pool.free.remove(block)
        lo, hi = rng.base + begin * rng.page, rng.base + end * rng.page
        if lo > start:
            _Block(start, lo - start, rng, mapped=True).splice(block.prev, block)
            pool.free.add(block.prev)
        if hi < stop:
            _Block(hi, stop - hi, rng, mapped=True).splice(block, block.next)
            pool.free.add(block.next)
        block.address, block.size, block.mapped = lo, hi - lo, False
        self._try_merge(pool, block, block.prev)
        self._try_merge(pool, block, block.next)
        pool.unmapped.add(block)
        self._add_reserved(rng, lo - hi)
        self._unmap_count += 1

    @staticmethod
    def _try_merge(pool: _Pool, dst: _Block, src: _Block | None) -> None:
        """``try_merge_blocks``: absorb a free neighbour of the same mapped state."""
        if src is None or src.allocated or src.mapped != dst.mapped:
            return
        (pool.free if src.mapped else pool.unmapped).remove(src)
        if src is dst.prev:
            dst.address = src.address
            dst.splice(src.prev, dst.next)
        else:
            dst.splice(dst.prev, src.next)
        dst.size += src.size

    @staticmethod
    def _split(pool: _Pool, block: _Block, size: int) -> None:
        """``alloc_found_block``: the front ``size`` bytes stay; the rest goes back free."""
        remaining = _Block(block.address + size, block.size - size, block.range, mapped=True)
        remaining.splice(block, block.next)
        block.size = size
        pool.free.add(remaining)

    def _add_reserved(self, rng: _Range, delta: int) -> None:
        rng.mapped_bytes += delta
        self.reserved_bytes += delta
        self.peak_reserved_bytes = max(self.peak_reserved_bytes, self.reserved_bytes)
