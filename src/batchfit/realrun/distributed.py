"""Searches under ``torch.distributed``: every rank runs every trial, and the ranks agree.

:func:`batchfit.search_max_batch` switches to this mode when ``torch.distributed`` is
initialized (the default group) or a ``process_group`` is given. Each rank runs the same
trial at the same batch size on its own device, exactly as a single-process search
does: on the CPU in its own fresh, capped child process; on CUDA in its own process on
its own GPU, an out-of-memory error caught and recovered by :mod:`batchfit.realrun.trial`. A
trial never takes part in a collective. Only when it is over, outside the code that can
raise, every rank enters one ``all_reduce(MIN)`` of a short integer vector: the batch
fits only if it fitted on every rank, the usage is that of the rank with the least room
left, the peak and the allocator overhead are the largest. So a rank that ran out of
memory never leaves the others waiting: it reports "does not fit" in the same
collective as the ranks that did fit. Every rank then feeds the same outcome to the
same deterministic loop (:func:`batchfit.realrun.search.search_boundary`), so all ranks try the
same batch sizes in the same order and return the same answer.

Agreement, rank by rank (each its own limit and usage):

* the plan: the smallest prediction, the largest per-sample slope, the smallest limit
  ``L`` and the smallest first trial;
* each trial: ``fits = min(fits_r)``; each rank's room ``slack_r = limit_r - used_r``,
  and the agreed usage is ``L - min(slack_r)``, so the usage model solves for the rank
  that runs out first even when the ranks' limits differ;
* errors: a rank whose trial (or set-up) raises anything but out-of-memory reports it
  in the same collective; every rank then raises, that rank its own error and the
  others a :class:`~batchfit.errors.TrialError` naming the rank and its message;
* each vector also carries what it is about (set-up, plan, trial at batch B, end) as
  both a minimum and a maximum: ranks that disagree (different arguments, a rank
  still searching) raise instead of pairing unrelated collectives.

DistributedDataParallel: trials run on the wrapped module (``model.module``), never
through DDP's ``forward``. DDP's gradient all-reduce is started by its autograd hooks,
armed only by its own ``forward``: through the wrapped module the hooks return at once
and backward runs no collective. Through DDP, a rank that ran out of memory in forward
would go on to the agreement's ``all_reduce`` while the others wait in DDP's bucket
all-reduce of backward: the collectives no longer pair up, a hang (gloo reports a size
mismatch at best). The memory DDP adds, its gradient buckets, was allocated when the
model was wrapped and counts in the state each trial starts from (CUDA, in process; a
CPU trial rebuilds the plain module and does not hold them); the communication
buffers of the all-reduce itself are not measured.

Sharded models (FSDP2, HSDP, tensor parallel) run collectives inside forward and
backward, so their trials cannot run apart: with ``parallel=`` each trial's processes,
one per rank, meet in a gloo group of that trial's own and shard the model there
(:mod:`batchfit.realrun.sharded_trial`). A trial that runs out of memory ends its
process; the other ranks' trials fail at once in their next collective (the sockets
close) and report :data:`PEER_STOPPED`, which is not counted as their own limit. The
agreement then proceeds as above, in the search's own processes, which never join a
trial's group. An FSDP-wrapped model itself cannot be sent to a trial process (its
parameters are shards of the caller's group): it is refused with how to search it.

Example:
    >>> agreement_for(None) is None  # torch.distributed not initialized here
    True
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import torch

from batchfit.errors import InvalidInputError, TrialError
from batchfit.realrun.sharded_trial import PEER_STOPPED

#: A value larger than any byte count or batch size (an absent measurement, in a minimum).
_ABSENT = 2**62
#: Fixed length of every reduced vector, so that any two reductions can pair up.
_SLOTS = 12


class _Topic(IntEnum):
    """What a reduction is about."""

    STAGE = 1
    PLAN = 2
    TRIAL = 3
    END = 4


@dataclass(frozen=True)
class AgreedPlan:
    """What every rank starts the search from.

    Attributes:
        predicted: the smallest prediction (None: no rank could predict).
        bytes_per_sample: the largest predicted per-sample growth.
        limit_bytes: the smallest limit (``L``).
        seed: the smallest proposed first trial.
        max_batch_size: the smallest batch limit.
        needed_bytes: the most any rank needs at batch 1.
    """

    predicted: int | None
    bytes_per_sample: float | None
    limit_bytes: int | None
    seed: int | None
    max_batch_size: int
    needed_bytes: int | None


@dataclass(frozen=True)
class AgreedTrial:
    """One trial as all ranks agree on it.

    Attributes:
        batch_size: the batch size every rank tried.
        fits: it fitted on every rank.
        slack_bytes: the least room any rank had left (limit - used), None if unmeasured.
        peak_bytes: the largest live peak of the ranks that fitted (None if none did).
        overhead_bytes: the largest allocator overhead of the ranks that fitted.
        limiting_rank: the lowest rank that ran out of memory (None when it fitted); in a
            sharded search, not a rank whose trial stopped because another rank's did.
    """

    batch_size: int
    fits: bool
    slack_bytes: int | None
    peak_bytes: int | None
    overhead_bytes: int | None
    limiting_rank: int | None


@dataclass(frozen=True)
class RankAgreement:
    """One rank's side of a distributed search (see the module docstring).

    Attributes:
        group: the process group.
        rank: this process's rank in it.
        world_size: the number of ranks.
        device: where the reduced vectors live (the current GPU for NCCL, else the CPU).
    """

    group: Any
    rank: int
    world_size: int
    device: torch.device

    def stage(self, what: str) -> contextlib.AbstractContextManager[None]:
        """A block every rank gets through, or every rank raises (see the module docstring)."""
        return _stage(self, what)

    def plan(self, predicted: int | None, bytes_per_sample: float | None,
             limit_bytes: int | None, seed: int | None, max_batch_size: int,
             needed_bytes: int | None) -> AgreedPlan:
        """Agree on the search's starting point."""
        values = self._exchange(_Topic.PLAN, 0, None, [
            _or_absent(predicted), -round(bytes_per_sample or 0), _or_absent(limit_bytes),
            _or_absent(seed), max_batch_size, -(needed_bytes or 0)])
        predicted_, slope, limit, seed_, limit_batch, needed = values[:6]
        return AgreedPlan(
            predicted=_present(predicted_), bytes_per_sample=float(-slope) if slope else None,
            limit_bytes=_present(limit), seed=_present(seed_), max_batch_size=limit_batch,
            needed_bytes=-needed or None)

    def trial(self, batch_size: int, run: Callable[[], Any],
              measure: Callable[[Any], tuple[bool, int | None, int | None, int | None]]
              ) -> tuple[Any, AgreedTrial]:
        """Run this rank's trial, then agree on its outcome with every rank.

        Args:
            batch_size: the batch size (the same on every rank, checked).
            run: runs this rank's trial and returns it (out-of-memory is its business:
                any exception it raises is an error every rank raises).
            measure: ``(fits, slack_bytes, peak_bytes, overhead_bytes)`` of a trial.

        Returns:
            This rank's trial and the agreed outcome.
        """
        error: Exception | None = None
        trial = None
        fields = [1, self.world_size, _ABSENT, 0, 0]
        try:
            trial = run()
            fits, slack, peak, overhead = measure(trial)
            own = not fits and not str(getattr(trial, "error", "") or "").startswith(PEER_STOPPED)
            fields = [int(fits), self.rank if own else self.world_size,
                      _ABSENT if slack is None or not fits else slack,
                      -(peak or 0) if fits else 0, -(overhead or 0) if fits else 0]
        except Exception as exc:  # noqa: BLE001 - every rank raises after the collective
            error = exc
        values = self._exchange(_Topic.TRIAL, batch_size, error, fields,
                                what=f"the trial at batch {batch_size}")
        fits_, limiting, slack_, peak_, overhead_ = values[:5]
        return trial, AgreedTrial(
            batch_size=batch_size, fits=bool(fits_), slack_bytes=_present(slack_),
            peak_bytes=-peak_ or None, overhead_bytes=-overhead_ or None,
            limiting_rank=None if limiting >= self.world_size else limiting)

    def end(self, trials: int) -> None:
        """Check that every rank ended the search after the same number of trials."""
        self._exchange(_Topic.END, trials, None, [])

    # ----------------------------------------------------------------------- internals

    def _exchange(self, topic: _Topic, batch_size: int, error: BaseException | None,
                  fields: Sequence[int], what: str = "") -> list[int]:
        """One ``all_reduce(MIN)``; raises on every rank if any rank failed or diverged."""
        import torch.distributed as dist

        failed = self.rank if error is not None else self.world_size
        header = [int(topic), -int(topic), batch_size, -batch_size, failed]
        vector = header + list(fields)
        vector += [0] * (_SLOTS - len(vector))
        tensor = torch.tensor(vector, dtype=torch.int64, device=self.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self.group)
        values = tensor.tolist()
        if values[0] != -values[1] or values[2] != -values[3]:
            raise TrialError(
                f"the ranks diverged: this rank ({self.rank}) was at {topic.name.lower()} "
                f"{batch_size}, another at {_Topic(-values[1]).name.lower()} {-values[3]} "
                "(give every rank the same search arguments)")
        if values[4] < self.world_size:
            self._raise_failure(values[4], error, what or topic.name.lower())
        return values[5:]

    def _raise_failure(self, failed_rank: int, error: BaseException | None, what: str) -> None:
        import torch.distributed as dist

        message = [f"{type(error).__name__}: {error}" if self.rank == failed_rank else None]
        dist.broadcast_object_list(message, src=dist.get_global_rank(self.group, failed_rank),
                                   group=self.group, device=self.device)
        if error is not None:
            raise error
        raise TrialError(f"rank {failed_rank} raised during {what}: {message[0]}")


@contextlib.contextmanager
def _stage(agreement: RankAgreement, what: str) -> Iterator[None]:
    error: Exception | None = None
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - every rank raises after the collective
        error = exc
    agreement._exchange(_Topic.STAGE, 0, error, [], what=what)


def _or_absent(value: int | None) -> int:
    return _ABSENT if value is None else int(value)


def _present(value: int) -> int | None:
    return None if value >= _ABSENT else value


def agreement_for(process_group: Any = None) -> RankAgreement | None:
    """This rank's :class:`RankAgreement`, or None for a single-process search.

    Args:
        process_group: the group whose ranks search together (default: the default
            group when ``torch.distributed`` is initialized; a group of one rank is a
            single-process search).

    Raises:
        InvalidInputError: a group given without ``torch.distributed`` initialized, or
            one this process is not a member of.
    """
    import torch.distributed as dist

    initialized = dist.is_available() and dist.is_initialized()
    if process_group is None and not initialized:
        return None
    if not initialized:
        raise InvalidInputError(
            "process_group was given but torch.distributed is not initialized: call "
            "torch.distributed.init_process_group first")
    group = process_group if process_group is not None else dist.group.WORLD
    rank = dist.get_rank(group)
    if rank < 0:
        raise InvalidInputError("this process is not a member of process_group")
    world_size = dist.get_world_size(group)
    if world_size == 1:
        return None
    device = torch.device("cpu")
    if str(dist.get_backend(group)).lower() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    return RankAgreement(group, rank, world_size, device)


def local_module(model: Any) -> Any:
    """The module a trial runs: DDP's wrapped module (see the module docstring).

    Raises:
        InvalidInputError: a sharded (FSDP) model (searched from its factory with
            ``parallel=``).

    Example:
        >>> import torch
        >>> layer = torch.nn.Linear(2, 2)
        >>> local_module(layer) is layer
        True
    """
    if not isinstance(model, torch.nn.Module):
        return model
    names = {cls.__name__ for cls in type(model).__mro__}
    if names & {"FullyShardedDataParallel", "FSDPModule"}:
        raise InvalidInputError(
            "a sharded (FSDP) model cannot be sent to a trial process: give its unsharded "
            "factory and the layout, search_max_batch(factory, ..., parallel="
            "Parallelism(world_size=N, strategy='fsdp')), and each trial shards it")
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        return model.module
    return model
