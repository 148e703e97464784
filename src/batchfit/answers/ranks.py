"""Multi-GPU answers: each rank's memory under a :class:`~batchfit.sharding.Parallelism`.

A rank is traced on torch's fake process group (:mod:`batchfit.sharding`) and replayed
on its device, whose memory outside the allocator now also holds NCCL's buffers
(:mod:`batchfit.sharding.nccl`). The traced ranks are rank 0 and the last rank (they
bound the others, :meth:`Parallelism.ranks_to_trace`); the rank that needs the most
memory (or, for ``max``, fits the smallest batch) binds.

Example:
    >>> import torch
    >>> from batchfit.sharding import Parallelism
    >>> est = estimate_ranks(lambda: torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)),
    ...                      (64,), 8, device="cpu", parallel=Parallelism(world_size=4, strategy="fsdp"),
    ...                      optimizer="sgd")
    >>> [r.rank for r in est.ranks], est.binding_rank
    ([0, 3], 0)
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from batchfit.answers.estimate import MemoryEstimate, step_profile, summarize
from batchfit.device.profile import DeviceProfile
from batchfit.engine.spec import TrainConfig, make_config
from batchfit.engine.trace import TraceReuse
from batchfit.sharding.layout import Parallelism
from batchfit.sharding.nccl import NcclMemory


def rank_profile(device: DeviceProfile, layout: Parallelism,
                 nccl: NcclMemory | None = None) -> DeviceProfile:
    """``device`` as one rank of ``layout`` sees it: with NCCL's buffers on the card."""
    return replace(device, nccl_bytes=(nccl or NcclMemory()).rank_bytes(device, layout))


@dataclass(frozen=True)
class RankEstimate:
    """One traced rank: its number and its estimate."""

    rank: int
    estimate: MemoryEstimate

    def to_dict(self) -> dict[str, Any]:
        est = self.estimate
        return {"rank": self.rank, "total_bytes": est.total_bytes,
                "peak_allocated_bytes": est.peak_allocated_bytes,
                "peak_reserved_bytes": est.peak_reserved_bytes,
                "peak_phase": est.peak_phase.value,
                "by_category": {c.value: b for c, b in est.by_category.items()}}


@dataclass(frozen=True)
class ShardedEstimate:
    """Each traced rank's memory for one step of a sharded layout.

    Attributes:
        parallel: the layout.
        ranks: the traced ranks, in rank order.
        binding_rank: the rank that needs the most memory.
    """

    parallel: Parallelism
    ranks: tuple[RankEstimate, ...]
    binding_rank: int

    @property
    def binding(self) -> MemoryEstimate:
        """The binding rank's estimate (what the single-GPU fields of the JSON show)."""
        return next(r.estimate for r in self.ranks if r.rank == self.binding_rank)

    def __getattr__(self, name: str) -> Any:
        # batch_size, total_bytes, by_category, explain()...: the binding rank's
        if name.startswith("__") or name in ("parallel", "ranks", "binding_rank"):
            raise AttributeError(name)
        return getattr(self.binding, name)

    def to_dict(self, timeline: bool = False) -> dict[str, Any]:
        data = self.binding.to_dict(timeline)
        data.update(parallel=self.parallel.to_dict(), binding_rank=self.binding_rank,
                    ranks=[r.to_dict() for r in self.ranks])
        return data


def estimate_ranks(model: Any, inputs: Any, batch_size: int,
                   config: TrainConfig | None = None, *, device: DeviceProfile | str | None,
                   parallel: Parallelism, nccl: NcclMemory | None = None,
                   reuse: TraceReuse | None = None, first_step: bool = True,
                   **options: Any) -> ShardedEstimate:
    """Each traced rank's peak for one step at the per-rank (micro-)batch ``batch_size``.

    Args:
        model, inputs, batch_size, config, device, first_step, options: as for
            :func:`batchfit.estimate`.
        parallel: the layout (world size, strategy, offload...).
        nccl: NCCL's memory model (default: :class:`NcclMemory`'s documented defaults).
        reuse: shared by estimates of the same model at other batch sizes.
    """
    from batchfit.sharding.rank import trace_rank

    config = make_config(config, options)
    # the stack's context and the allocator options, as a single-GPU estimate takes them
    profile = rank_profile(step_profile(device, config), parallel, nccl)
    reuse = reuse if reuse is not None else TraceReuse()
    ranks = []
    for rank in parallel.ranks_to_trace():
        trace = trace_rank(model, inputs, batch_size, config, profile, parallel, rank, reuse)
        ranks.append(RankEstimate(rank, summarize(trace, profile, first_step=first_step)))
    binding = max(ranks, key=lambda r: (r.estimate.total_bytes, -r.rank))
    return ShardedEstimate(parallel, tuple(ranks), binding.rank)
