"""What both models of the CUDA caching allocator share: the request and segment sizes of
c10/cuda/CUDACachingAllocator.cpp, the allocator's statistics and its out-of-memory error,
and the bookkeeping of live blocks.

:mod:`batchfit.device.allocator` (the default segments) and
:mod:`batchfit.device.expandable` (``expandable_segments:True``) build on these; the rules
are described in :mod:`batchfit.device.allocator`'s docstring.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from batchfit.errors import BatchfitError, InvalidInputError

MIN_BLOCK_BYTES = 512  # kMinBlockSize
SMALL_SIZE_BYTES = 1 << 20  # kSmallSize: largest request served by the small pool
SMALL_BUFFER_BYTES = 2 << 20  # kSmallBuffer: segment size of the small pool
LARGE_BUFFER_BYTES = 20 << 20  # kLargeBuffer: shared segment for 1-10 MiB requests
MIN_LARGE_ALLOC_BYTES = 10 << 20  # kMinLargeAlloc: from here a request gets its own segment
ROUND_LARGE_BYTES = 2 << 20  # kRoundLarge: rounding of those own segments

NULL_HANDLE = 0
"""The handle of a 0-byte allocation, like the null pointer torch returns; freeing it is a no-op."""


def round_size(nbytes: int, roundup_power2_divisions: int = 0) -> int:
    """The block size the allocator uses for a request of ``nbytes``.

    Args:
        nbytes: requested bytes, >= 0.
        roundup_power2_divisions: ``PYTORCH_CUDA_ALLOC_CONF``'s option (0: unset). With
            N > 1 a request above ``512 * N`` B that is not a power of two rounds up to the
            next of N equal steps between the powers of two around it (the source's
            ``roundup_power2_next_division``: step = ``PowerOf2Floor(size) / N``).

    Returns:
        ``nbytes`` rounded up to a multiple of 512, and at least 512 (as in the source's
        ``round_size``; :meth:`CachingAllocator.malloc` never calls it for 0 bytes).

    Example:
        >>> round_size(1), round_size(512), round_size(513)
        (512, 512, 1024)
        >>> round_size(1200 * 2**20, roundup_power2_divisions=4) // 2**20  # 1024 + 256 steps
        1280
    """
    _check_nbytes(nbytes)
    if nbytes < MIN_BLOCK_BYTES:
        return MIN_BLOCK_BYTES
    divisions = roundup_power2_divisions
    if divisions > 1 and nbytes > MIN_BLOCK_BYTES * divisions:
        if nbytes & (nbytes - 1) == 0:
            return nbytes
        step = (1 << (nbytes.bit_length() - 1)) // divisions
        return -(-nbytes // step) * step
    return -(-nbytes // MIN_BLOCK_BYTES) * MIN_BLOCK_BYTES


def segment_size(rounded: int) -> int:
    """The cudaMalloc size for a rounded request that finds no cached block to reuse.

    Args:
        rounded: a size returned by :func:`round_size`.

    Returns:
        2 MiB for the small pool, 20 MiB for requests below 10 MiB, otherwise the request
        rounded up to a multiple of 2 MiB (the source's ``get_allocation_size``).

    Example:
        >>> [segment_size(n) // 2**20 for n in (512, 5 * 2**20, 11 * 2**20 + 512)]
        [2, 20, 12]
    """
    _check_nbytes(rounded)
    if rounded <= SMALL_SIZE_BYTES:
        return SMALL_BUFFER_BYTES
    if rounded < MIN_LARGE_ALLOC_BYTES:
        return LARGE_BUFFER_BYTES
    return -(-rounded // ROUND_LARGE_BYTES) * ROUND_LARGE_BYTES


def refuses_oversize(block_size: int, size: int, max_split_size_bytes: int | None,
                     max_non_split_rounding_bytes: int = LARGE_BUFFER_BYTES) -> bool:
    """``get_free_block``'s rules for ``max_split_size_mb`` (none when it is None): the best
    fit is refused (no other block is tried) when it is oversize and the request is not,
    or when the request is oversize and the block exceeds it by the rounding allowance."""
    if max_split_size_bytes is None:
        return False
    if size < max_split_size_bytes:
        return block_size >= max_split_size_bytes
    return block_size >= size + max_non_split_rounding_bytes


def _check_nbytes(nbytes: Any) -> None:
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise InvalidInputError(f"a byte count must be an int >= 0, got {nbytes!r}")


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.2f} MiB"


class AllocatorOutOfMemory(BatchfitError):
    """The modelled allocator could not reserve a segment within ``capacity_bytes``.

    Like the real allocator, the failed request has already released every cached,
    wholly free segment, so ``reserved_bytes`` is what remained held after that.

    Attributes:
        requested_bytes: the bytes asked for.
        segment_bytes: the segment the allocator tried to cudaMalloc.
        allocated_bytes: bytes in live blocks at the failure.
        reserved_bytes: bytes held in segments at the failure.
        capacity_bytes: the limit on reserved bytes.
        event_index: the index of the failing event during :func:`replay`, else None.
    """

    exit_code = 3

    def __init__(self, requested_bytes: int, segment_bytes: int, allocated_bytes: int,
                 reserved_bytes: int, capacity_bytes: int, event_index: int | None = None):
        where = "" if event_index is None else f" at event {event_index}"
        super().__init__(
            f"out of memory{where}: tried to allocate {_mib(requested_bytes)} (a new "
            f"{_mib(segment_bytes)} segment) with {_mib(reserved_bytes)} reserved, of which "
            f"{_mib(allocated_bytes)} allocated, and a capacity of {_mib(capacity_bytes)}")
        self.requested_bytes = requested_bytes
        self.segment_bytes = segment_bytes
        self.allocated_bytes = allocated_bytes
        self.reserved_bytes = reserved_bytes
        self.capacity_bytes = capacity_bytes
        self.event_index = event_index

    def at_event(self, event_index: int) -> AllocatorOutOfMemory:
        """A copy of this error that names the replayed event which failed."""
        return AllocatorOutOfMemory(self.requested_bytes, self.segment_bytes,
                                    self.allocated_bytes, self.reserved_bytes,
                                    self.capacity_bytes, event_index)


@dataclass(frozen=True)
class AllocatorStats:
    """A snapshot of the allocator's counters, named after ``torch.cuda.memory_stats``.

    Attributes:
        allocated_bytes: bytes in live blocks (``allocated_bytes.all.current``); a block
            handed out unsplit counts whole, so this can exceed the rounded requests.
        reserved_bytes: bytes in cudaMalloc'd segments (``reserved_bytes.all.current``).
        requested_bytes: bytes the live allocations asked for, before rounding.
        peak_allocated_bytes: high-water mark of ``allocated_bytes``.
        peak_reserved_bytes: high-water mark of ``reserved_bytes``.
        segment_count: segments currently held.
        live_block_count: allocations currently live (0-byte ones excluded).
        cuda_malloc_count: segments ever cudaMalloc'd (``num_device_alloc``).
        cuda_free_count: segments ever returned to the driver (``num_device_free``).
        alloc_retry_count: allocations retried after releasing the cache
            (``num_alloc_retries``).
        oom_count: allocations that failed (``num_ooms``).
    """

    allocated_bytes: int
    reserved_bytes: int
    requested_bytes: int
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    segment_count: int
    live_block_count: int
    cuda_malloc_count: int
    cuda_free_count: int
    alloc_retry_count: int
    oom_count: int

    @property
    def cached_free_bytes(self) -> int:
        """Reserved bytes not in a live block: the cache a fragmenting run leaves behind."""
        return self.reserved_bytes - self.allocated_bytes

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass(frozen=True)
class BlockInfo:
    """One block of a segment, as in ``torch.cuda.memory_snapshot()``."""

    size_bytes: int
    allocated: bool


@dataclass(frozen=True)
class SegmentInfo:
    """One cudaMalloc'd segment and its blocks in address order."""

    is_small_pool: bool
    size_bytes: int
    blocks: tuple[BlockInfo, ...]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class _LiveBlocks:
    """What both allocator models keep the same way: live blocks by handle (their
    address) and the allocated/requested counters (``torch.cuda.memory_stats``)."""

    _live: dict[int, Any]
    allocated_bytes: int
    requested_bytes: int
    peak_allocated_bytes: int

    def _hand_out(self, block: Any, nbytes: int) -> int:
        block.allocated, block.requested = True, nbytes
        self._live[block.address] = block
        self.allocated_bytes += block.size
        self.requested_bytes += nbytes
        self.peak_allocated_bytes = max(self.peak_allocated_bytes, self.allocated_bytes)
        return block.address

    def _take_back(self, handle: int) -> Any:
        block = self._live.pop(handle, None)
        if block is None:
            raise InvalidInputError(f"handle {handle} is not a live allocation")
        block.allocated = False
        self.allocated_bytes -= block.size
        self.requested_bytes -= block.requested
        block.requested = 0
        return block
