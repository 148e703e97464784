"""Trials of a sharded model (FSDP2, HSDP, tensor parallel): each trial's processes, one
per rank, meet in a gloo group of that trial's own and shard the model there.

A sharded model runs collectives inside forward and backward, so one rank's trial
cannot run apart from the others'. :func:`batchfit.search_max_batch` with ``parallel=``
(under ``torch.distributed``) gives every trial a :class:`TrialGroup`: rank 0 of the
search hosts a ``TCPStore`` (:class:`TrialRendezvous`), and the n-th trial of every rank
joins it under the prefix ``batchfit/trial{n}/`` (every rank runs the same trials in the
same order, so the n-th trials meet). The trial process (a child of the
:class:`~batchfit.realrun.trial_server.TrialServer`) joins after it has its batch size,
then builds the model, shards it with torch's own classes
(:func:`batchfit.sharding.transforms.shard_model`), runs the warm-up step at batch 1,
sets its memory cap and runs the steps. The search's own processes never join a trial's
group, so the agreement's collectives always pair up.

A rank's trial that runs out of memory ends its process; the kernel closes its sockets
and the other ranks' trials, waiting in (or arriving at) a collective, fail at once with
gloo's "connection closed/reset by peer". They report "does not fit" with
:data:`PEER_STOPPED`, which the agreement does not count as
their own limit (``limiting_rank`` names the rank that ran out). A peer that is alive but
stuck fails them at the group's timeout (the trial's ``timeout_s``, else torch's default).

Threads after a fork (why :meth:`~batchfit.realrun.trial_server._PreparedTrial.build`
sets the thread count first, on the main thread): the trial process is forked from a
process that created ATen's pthreadpool (``torch.set_num_threads``). torch's
``pthread_atfork`` child handler only marks the inherited pool corrupt; the first call of
``caffe2::pthreadpool()`` in the child then releases it and creates a new one, with no
lock (``caffe2/utils/threadpool/pthreadpool-cpp.cc``: the flag is cleared, the pointer
released, then reset). The first backward through DTensors (FSDP2's and tensor
parallel's parameters) starts autograd's device threads (8 ``pt_autograd_N`` threads
here, measured; a plain model, a device mesh or a gloo group alone start none), and each
calls ``at::init_num_threads()`` -> ``set_num_threads`` -> ``pthreadpool()`` at once: one
of them can see the released (null) pool and abort the process ("Invalid thread pool!",
``ATen/ParallelOpenMP.cpp``), mid warm-up; its peers' collectives then fail with
"Connection reset by peer". Setting the thread count on the main thread, before the
group and before any other thread exists, replaces the pool there, so the device
threads find it valid. Measured on the 2-rank test (``tests/realrun/test_distributed.py``):
without it 3 of 30 runs failed so (7 of 17 with the sharded scenarios alone), every
failure a trial process aborted in the warm-up; with it 30 of 30 passed.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

from batchfit.errors import InvalidInputError

#: How a sharded trial's error starts when another rank's trial stopped first (the
#: agreement does not count it as this rank's limit: batchfit.realrun.distributed).
PEER_STOPPED = "another rank's trial stopped"
#: What gloo raises when a peer of the group has gone (its process exited: the
#: connection closes or is reset) or stopped answering (the collective times out).
_PEER_GONE = ("connection closed by peer", "connection reset by peer", "broken pipe",
              "timed out", "timeout")


@dataclass(frozen=True)
class TrialGroup:
    """Where the ranks' processes of one sharded trial meet: the search's rank 0 hosts a
    ``TCPStore`` at ``host:port`` (:class:`TrialRendezvous`); this trial uses ``prefix``
    in it. ``timeout_s``: the group's timeout (None: torch's default)."""

    host: str
    port: int
    rank: int
    world_size: int
    prefix: str
    timeout_s: float | None = None


@dataclass
class TrialRendezvous:
    """The trial groups of one sharded search, on one rank (see the module docstring).

    Attributes:
        parallel: the layout every trial shards the model with.
        host, port: rank 0's store.
        rank, world_size: this rank in the search's group.
        store: the store itself (rank 0 only), kept alive for the search.
        trials: the groups handed out so far.
    """

    parallel: Any
    host: str
    port: int
    rank: int
    world_size: int
    store: Any = None
    trials: int = 0

    @classmethod
    def start(cls, agreement: Any, parallel: Any, device: Any) -> TrialRendezvous:
        """Check the layout against the search's group; rank 0 starts the store. No
        collective: the caller runs this under an agreement's stage, then :meth:`share`.

        Raises:
            InvalidInputError: no ``torch.distributed`` group, a world size other than the
                group's, a layout whose trials need no group (DDP, ZeRO, FSDP1), a
                CUDA device.
        """
        import torch.distributed as dist

        from batchfit.sharding.layout import Parallelism, Strategy

        if not isinstance(parallel, Parallelism):
            raise InvalidInputError(
                f"parallel must be a batchfit.sharding.Parallelism, not {type(parallel).__name__}")
        if agreement is None:
            raise InvalidInputError(
                "parallel= searches a sharded model across the ranks of torch.distributed: "
                "start every rank (torchrun) and call torch.distributed.init_process_group first")
        if parallel.world_size != agreement.world_size:
            raise InvalidInputError(
                f"parallel has world size {parallel.world_size} but the group has "
                f"{agreement.world_size} ranks: give world_size={agreement.world_size}")
        if parallel.strategy is Strategy.DDP or parallel.strategy.is_zero:
            raise InvalidInputError(
                f"parallel= is for FSDP2, HSDP and tensor-parallel models; "
                f"{parallel.strategy.value} trials need no group of their own: search the "
                "unwrapped model without parallel= (a DDP model is searched through its module)")
        if parallel.strategy is Strategy.FSDP1:
            raise InvalidInputError(
                "parallel= shards with FSDP2 (fully_shard); an FSDP1 layout cannot be "
                "searched: use strategy='fsdp'")
        if str(device).strip().lower().startswith("cuda"):
            raise InvalidInputError(
                "a sharded search runs its trials in capped CPU processes: use device='cpu' "
                "(for GPUs, batchfit max --world-size N --strategy ... predicts each rank)")
        store, host, port = None, "", 0
        if agreement.rank == 0:
            store = dist.TCPStore("0.0.0.0", 0, is_master=True, wait_for_workers=False)
            host, port = _reachable_host(), store.port
        return cls(parallel, host, port, agreement.rank, agreement.world_size, store)

    def share(self, agreement: Any) -> None:
        """Every rank learns rank 0's store address (one broadcast in the search's group)."""
        import torch.distributed as dist

        address = [(self.host, self.port)]
        dist.broadcast_object_list(address, src=dist.get_global_rank(agreement.group, 0),
                                   group=agreement.group, device=agreement.device)
        self.host, self.port = address[0]

    def next_group(self, timeout_s: float | None) -> TrialGroup:
        """The group of this rank's next trial (the n-th trial's prefix is the same on
        every rank: every rank runs the same trials in the same order)."""
        self.trials += 1
        return TrialGroup(self.host, self.port, self.rank, self.world_size,
                          prefix=f"batchfit/trial{self.trials}/", timeout_s=timeout_s)

    def close(self) -> None:
        self.store = None


def _reachable_host() -> str:
    """Rank 0's address as the other ranks reach it: ``MASTER_ADDR`` when the launcher
    set it (torchrun: the address of the node that hosts rank 0's store), else this
    machine's hostname's address, else the loopback (one machine)."""
    import os
    import socket

    if os.environ.get("MASTER_ADDR"):
        return os.environ["MASTER_ADDR"]
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def join_and_shard(request: Any, setup: Any, build: Any) -> Any:
    """In a trial process: join the trial's group, then build (``build()``) and shard the
    model as the layout says; returns the sharded model."""
    import torch.distributed as dist

    from batchfit.sharding.layout import Strategy
    from batchfit.sharding.transforms import shard_model
    from batchfit.sharding.world import meshes

    group, layout = request.group, request.parallel
    timeout = (datetime.timedelta(seconds=group.timeout_s) if group.timeout_s is not None
               else dist.default_pg_timeout)
    store = dist.PrefixStore(group.prefix, dist.TCPStore(
        group.host, group.port, is_master=False, timeout=timeout))
    dist.init_process_group("gloo", store=store, rank=group.rank,
                            world_size=group.world_size, timeout=timeout)
    replicas = layout.nodes if layout.strategy is Strategy.HSDP else 1
    world = meshes(group.world_size, group.rank, replicas=replicas, tp=layout.tp)
    return shard_model(setup.prepare(build()), layout, world, request.config.precision)


def step_config(request: Any) -> Any:
    """The config a sharded trial's step runs (FSDP's mixed precision replaces autocast,
    as in the per-rank prediction: :func:`batchfit.sharding.rank.trace_config`)."""
    from batchfit.sharding.rank import trace_config

    return trace_config(request.config, request.parallel)


def peer_stopped(exc: BaseException) -> bool:
    """Whether ``exc`` is gloo's report that a peer of the trial's group has gone."""
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(words in text for words in _PEER_GONE)
