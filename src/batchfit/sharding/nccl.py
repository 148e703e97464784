"""NCCL's own memory on each GPU: buffers outside PyTorch's caching allocator.

No tensor trace sees them (NCCL allocates with ``cudaMalloc``/``cuMem`` directly), so
they are modelled from how NCCL lays its buffers out, with documented defaults a user
can override (:class:`NcclMemory`):

* **Per connection** (one peer, one channel, receiving side): one FIFO per protocol,
  ``NCCL_BUFFSIZE`` (Simple, 4 MiB by default, NCCL docs, env.html) + the LL buffer
  (512 KiB: ``NCCL_LL_LINES_PER_THREAD x NCCL_LL_MAX_NTHREADS x NCCL_STEPS x 16 B`` =
  8 x 512 x 8 x 16, ``DEFAULT_LL_BUFFSIZE`` in NCCL's src/init.cc) + the LL128 buffer
  (4,915,200 B: 120 elements x 640 threads x 8 steps x 8 B, ``DEFAULT_LL128_BUFFSIZE``),
  9.19 MiB, which NCCL's cuMem allocations (the default since NCCL 2.19) round to the
  2 MiB granularity: 10 MiB. NVIDIA/nccl#1685 logs exactly these 10,485,760-byte
  allocations on 8 x H100, beside 2 MiB ones (the sending side), one pair per channel
  and peer.
* **Per channel**: "each channel has its own buffer for collective operations"
  (NVIDIA/nccl#1450); a ring has 2 connections "regardless of the scale" and memory is
  "linearly tied to the number of channels" (NCCL maintainer, NVIDIA/nccl#986). A tree
  (multi-node all-reduce) adds its own connections: counted as a second ring.
* **Channels**: NCCL picks them from the topology; logs show 24 on 4 x A100 NVLink
  (NVIDIA/nccl#1785) and 32 on 8 x H100 (NVIDIA/nccl#1685). Defaults: 32 from sm90
  (Hopper and later), 24 on sm80 (A100-class NVLink), 16 otherwise (PCIe cards and
  older GPUs).
* **Communicators**: one per process group a step uses (DDP, FSDP, ZeRO: the world;
  HSDP: the shard group and the replicate group; tensor parallel with FSDP: the
  ``dp`` and ``tp`` groups). More communicators use more memory unless they are split
  with shared resources (NVIDIA/nccl#986).

So the default is 12 MiB per channel and ring: 384 MiB per communicator on Hopper, 288
MiB on an A100, 192 MiB on other cards; a multi-node all-reduce group twice that.
Public measurements vary with the NCCL version and options (NVIDIA/nccl#964: 544-688 MB
per group on 4 x A100; NVLS on H100 NVSwitch systems adds more, NCCL_NVLS_ENABLE=0
removes it), so give ``per_communicator_bytes`` (CLI ``--nccl-memory``) when you know
your stack's number (``nvidia-smi`` after the first collective, less the context).

Example:
    >>> from batchfit.device.profile import DeviceProfile
    >>> from batchfit.sharding.layout import Parallelism
    >>> a100 = DeviceProfile.cuda(80 << 30, (8, 0))
    >>> NcclMemory().rank_bytes(a100, Parallelism(world_size=8, strategy="fsdp")) >> 20
    288
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from batchfit.errors import InvalidInputError
from batchfit.sharding.layout import Parallelism, Strategy

MiB = 1 << 20
SIMPLE_BYTES = 4 * MiB  # NCCL_BUFFSIZE default
LL_BYTES = 8 * 512 * 8 * 16  # DEFAULT_LL_BUFFSIZE
LL128_BYTES = 120 * 640 * 8 * 8  # DEFAULT_LL128_BUFFSIZE
CUMEM_GRANULARITY = 2 * MiB


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@dataclass(frozen=True)
class Communicator:
    """One NCCL communicator a rank uses: its name, size and whether it spans nodes."""

    name: str
    ranks: int
    crosses_nodes: bool


@dataclass(frozen=True)
class NcclMemory:
    """How much memory NCCL holds on each GPU (see the module docstring).

    Args:
        channels: channels per communicator (None: by compute capability).
        receive_bytes: buffers per connection on the receiving side (default: Simple +
            LL + LL128 rounded to cuMem's 2 MiB).
        send_bytes: buffers per connection on the sending side (2 MiB).
        per_communicator_bytes: the whole per-communicator amount, replacing the model.
    """

    channels: int | None = None
    receive_bytes: int = _round_up(SIMPLE_BYTES + LL_BYTES + LL128_BYTES, CUMEM_GRANULARITY)
    send_bytes: int = CUMEM_GRANULARITY
    per_communicator_bytes: int | None = None

    def __post_init__(self) -> None:
        for name in ("channels", "per_communicator_bytes"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 0):
                raise InvalidInputError(f"{name} must be an integer >= 0, not {value!r}")

    def channels_for(self, device: Any) -> int:
        if self.channels is not None:
            return self.channels
        capability = device.compute_capability or (0, 0)
        if capability >= (9, 0):
            return 32
        return 24 if capability == (8, 0) else 16

    def communicator_bytes(self, device: Any, communicator: Communicator) -> int:
        """One communicator's memory on this GPU (0 for a group of one rank)."""
        if communicator.ranks <= 1:
            return 0
        if self.per_communicator_bytes is not None:
            return self.per_communicator_bytes
        rings = 2 if communicator.crosses_nodes else 1  # a tree beside the ring
        return self.channels_for(device) * rings * (self.receive_bytes + self.send_bytes)

    def rank_bytes(self, device: Any, layout: Parallelism) -> int:
        """NCCL's memory on one GPU of ``layout`` (0 on the CPU or for one rank)."""
        if not device.is_cuda:
            return 0
        return sum(self.communicator_bytes(device, c) for c in communicators(layout))


def communicators(layout: Parallelism) -> tuple[Communicator, ...]:
    """The communicators one rank of ``layout`` uses in a training step."""
    world, per_node = layout.world_size, layout.gpus_per_node
    if layout.strategy is Strategy.HSDP:
        return (Communicator("shard", per_node, False),
                Communicator("replicate", layout.nodes, layout.nodes > 1))
    if layout.tp > 1:
        dp = layout.data_parallel_size
        return (Communicator("tp", layout.tp, layout.tp > per_node),
                Communicator("dp", dp, world > per_node))
    return (Communicator("world", world, layout.nodes > 1),)
