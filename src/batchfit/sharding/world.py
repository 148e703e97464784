"""One rank of a world of N, in this process: torch's fake process group and its meshes.

``torch.distributed`` with backend ``"fake"`` and a ``FakeStore`` (both torch's own,
``torch.testing._internal.distributed.fake_pg``) gives this process rank ``r`` of a
world of ``N`` without any other process: every collective returns at once and moves no
data, while the code around it (DDP's buckets, FSDP's all-gather and reduce-scatter
buffers, DTensor's redistributions) runs exactly as on rank ``r``. Device meshes are made
here, outside the fake tensor mode: making one reads the mesh's rank table
(``tolist()``), which a fake tensor cannot answer.

The default process group is process-wide, so a fake world can only be made where
``torch.distributed`` is not initialized (a program under ``torchrun`` predicts in a
fresh child process).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from batchfit.engine import _torch_internals as ti
from batchfit.errors import InvalidInputError

_WORLDS = itertools.count()


@dataclass(frozen=True)
class World:
    """The meshes of one rank (of a fake world, or of a real one: :func:`meshes`).

    Attributes:
        rank: this rank.
        world_size: the number of ranks.
        mesh: the 1-D mesh of all ranks (FSDP, DDP).
        dp_mesh: the data-parallel mesh FSDP shards over: ``mesh`` (FSDP), a 2-D
            ``("replicate", "shard")`` mesh (HSDP), or the ``"dp"`` dimension of a 2-D
            ``("dp", "tp")`` mesh (tensor parallel); None for DDP and ZeRO.
        tp_mesh: the ``"tp"`` dimension (tensor parallel), else None.
    """

    rank: int
    world_size: int
    mesh: Any
    dp_mesh: Any
    tp_mesh: Any


def meshes(world_size: int, rank: int, *, replicas: int = 1, tp: int = 1) -> World:
    """The device meshes of ``rank`` in the initialized default process group.

    Args:
        world_size: the number of ranks.
        rank: this process's rank.
        replicas: HSDP's replicate dimension (``world_size / replicas`` ranks shard).
        tp: the tensor-parallel degree (a 2-D ``("dp", "tp")`` mesh when > 1).
    """
    from torch.distributed.device_mesh import init_device_mesh

    # DTensor caches decisions by mesh, and equal meshes (same ranks and dimension names)
    # compare equal: a mesh of an earlier fake world, whose process groups are gone, would
    # come back from those caches. So every world's dimension names are its own.
    tag = next(_WORLDS)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=(f"world{tag}",))
    dp_mesh, tp_mesh = mesh, None
    if tp > 1:
        grid = init_device_mesh("cpu", (world_size // tp, tp),
                                mesh_dim_names=(f"dp{tag}", f"tp{tag}"))
        dp_mesh, tp_mesh = grid[f"dp{tag}"], grid[f"tp{tag}"]
    elif replicas > 1:
        dp_mesh = init_device_mesh("cpu", (replicas, world_size // replicas),
                                   mesh_dim_names=(f"replicate{tag}", f"shard{tag}"))
    return World(rank, world_size, mesh, dp_mesh, tp_mesh)


@contextlib.contextmanager
def fake_world(world_size: int, rank: int, *, replicas: int = 1, tp: int = 1
               ) -> Iterator[World]:
    """Be rank ``rank`` of ``world_size`` for the block (torch's fake process group);
    the arguments are those of :func:`meshes`.

    Raises:
        InvalidInputError: ``torch.distributed`` is already initialized here.
    """
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise InvalidInputError(
            "torch.distributed is already initialized in this process, so it cannot also "
            "be a fake rank: predict a sharded step before init_process_group, or in a "
            "fresh process")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    ti.clear_dtensor_caches()
    try:
        yield meshes(world_size, rank, replicas=replicas, tp=tp)
    finally:
        dist.destroy_process_group()
        ti.clear_dtensor_caches()
