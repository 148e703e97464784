"""Multi-GPU: one rank of a sharded training step, traced with torch's own sharding.

:class:`Parallelism` says how the step is spread (DDP, FSDP2, HSDP, FSDP1, DeepSpeed
ZeRO, tensor parallel); :func:`~batchfit.sharding.rank.trace_rank` traces one rank on
torch's fake process group; :mod:`batchfit.sharding.nccl` models NCCL's own buffers.
"""

from batchfit.sharding.layout import Offload, Parallelism, Strategy
from batchfit.sharding.nccl import NcclMemory

__all__ = ["NcclMemory", "Offload", "Parallelism", "Strategy"]
