"""Measure a sharded step for real: N processes on this CPU, talking over gloo.

The reference for a multi-GPU prediction (:mod:`batchfit.sharding`): every rank is a
real process that builds the real model, shards it with the same torch classes and the
same options (:func:`batchfit.sharding.transforms.shard_model`: DDP, FSDP2, DeepSpeed
ZeRO), runs the step the engine predicts (:class:`batchfit.engine.step.StepRunner`) and
measures its own memory with a live-storage tracker that runs from before the model is
built (:func:`batchfit.realrun.measure.run_tracked_session`): DDP's buckets, FSDP's
shards, gathered parameters and collective buffers, all counted as torch allocates them.

Why not the profiler: gloo runs collectives on its own threads, which allocate and free
their staging copies and drop the last references to FSDP's buffers; the profiler's
running sum over those threads drifted upwards from step to step, by a different amount
in each run (measured: +0 to +29% by the fifth step of a 2-rank FSDP run), while the
tracker's peaks repeat to the byte. The tracker counts tensors only, so the predictions
it checks count tensors only (``DeviceProfile.cpu(kernel_scratch=False)``).

The processes come from a ``forkserver`` (a clean process that imported torch once), so
the model factory must be importable by reference (a module-level function or a class),
not a lambda.

Example (4 processes take a few seconds to start):
    >>> from batchfit.engine.spec import TrainConfig
    >>> from batchfit.sharding.layout import Parallelism
    >>> runs = measure_sharded_step(_tiny_model, (8,), 4, TrainConfig(optimizer="sgd"),
    ...                             Parallelism(world_size=2, strategy="ddp"))  # doctest: +SKIP
    >>> len(runs)  # doctest: +SKIP
    2
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import traceback
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from batchfit.engine.spec import TrainConfig
from batchfit.errors import InvalidInputError, TrialError
from batchfit.realrun.measure import MeasuredStep, MeasureMethod
from batchfit.sharding.layout import Parallelism

#: What the forkserver imports once for all ranks: without it each rank spent ~10 s
#: importing (``torch._dynamo``, which the first optimizer step imports, DTensor, FSDP).
_PRELOAD = ["torch", "torch._dynamo", "torch.distributed", "torch.distributed.fsdp",
            "torch.distributed.tensor", "torch.nn.parallel", "batchfit.realrun.sharded",
            "batchfit.realrun.measure", "batchfit.sharding.transforms"]


@dataclass(frozen=True)
class ShardedJob:
    """One sharded step to measure (the arguments of :func:`measure_sharded_step`)."""

    model_factory: Callable[[], Any]
    inputs: Any
    batch_size: int
    config: TrainConfig
    layout: Parallelism


def measure_sharded_step(model_factory: Callable[[], Any], inputs: Any, batch_size: int,
                         config: TrainConfig, layout: Parallelism, *, steps: int = 3,
                         timeout_s: float = 600.0) -> tuple[MeasuredStep, ...]:
    """Run ``steps`` real steps on ``layout.world_size`` gloo processes; each rank's memory.

    Args:
        model_factory: builds the model; importable by reference (see the module
            docstring).
        inputs: the per-sample input spec.
        batch_size: the per-rank batch size.
        config: the training config (as :func:`batchfit.sharding.rank.trace_config` runs
            it: FSDP's mixed precision instead of autocast).
        layout: the parallel layout (its ``world_size`` processes are started).
        steps: steps per rank (>= 2; the first creates the optimizer state).
        timeout_s: give up (and stop every rank) after this long.

    Returns:
        One :class:`~batchfit.realrun.measure.MeasuredStep` per rank, in rank order.

    Raises:
        TrialError: a rank raised, died or timed out (its message is in the error).
    """
    job = ShardedJob(model_factory, inputs, batch_size, config, layout)
    return measure_sharded_steps([job], steps=steps, timeout_s=timeout_s)[0]


def measure_sharded_steps(jobs: Sequence[ShardedJob], *, steps: int = 3,
                          timeout_s: float = 600.0) -> list[tuple[MeasuredStep, ...]]:
    """:func:`measure_sharded_step` for several jobs of one world size, run one after
    the other by the same processes (one start-up for all)."""
    import multiprocessing

    if steps < 2:
        raise InvalidInputError(f"steps must be >= 2 (the first creates state), not {steps!r}")
    sizes = {job.layout.world_size for job in jobs}
    if len(sizes) != 1:
        raise InvalidInputError(f"the jobs must share one world size, not {sorted(sizes)}")
    world_size = sizes.pop()
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(_PRELOAD)
    queue = context.Queue()
    # a file store (the group creates the file): unlike a TCP port, nothing can take it
    rendezvous = os.path.join(tempfile.gettempdir(), f"batchfit-gloo-{uuid.uuid4().hex}")
    ranks = [context.Process(target=_rank_main,
                             args=(rank, f"file://{rendezvous}", list(jobs), steps, queue),
                             daemon=True)
             for rank in range(world_size)]
    for process in ranks:
        process.start()
    results: dict[int, Any] = {}
    try:
        for _ in ranks:
            rank, payload = queue.get(timeout=timeout_s)
            if isinstance(payload, str):
                raise TrialError(f"rank {rank} of the real sharded run raised: {payload}")
            results[rank] = payload
    except TrialError:
        raise
    except Exception as exc:
        raise TrialError(f"the real sharded run did not finish in {timeout_s:.0f} s "
                         f"({len(results)} of {len(ranks)} ranks reported)") from exc
    finally:
        for process in ranks:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(rendezvous)
    return [tuple(results[rank][index] for rank in range(world_size))
            for index in range(len(jobs))]


def _rank_main(rank: int, init_method: str, jobs: list[ShardedJob], steps: int,
               queue: Any) -> None:
    """One rank: join the gloo group, then build, shard, run and measure each job."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=init_method, rank=rank,
                                world_size=jobs[0].layout.world_size)
        try:
            queue.put((rank, [_measure_rank(rank, job, steps) for job in jobs]))
        finally:
            dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which raises
        queue.put((rank, f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=-3)}"))


def _measure_rank(rank: int, job: ShardedJob, steps: int) -> MeasuredStep:
    import torch

    from batchfit.realrun.measure import _build_runner, run_tracked_session
    from batchfit.sharding.layout import Strategy
    from batchfit.sharding.rank import trace_config
    from batchfit.sharding.transforms import shard_model
    from batchfit.sharding.world import meshes

    layout = job.layout
    replicas = layout.nodes if layout.strategy is Strategy.HSDP else 1
    world = meshes(layout.world_size, rank, replicas=replicas, tp=layout.tp)
    run_config = trace_config(job.config, layout)

    def build() -> Any:
        runner = _build_runner(job.model_factory, job.inputs, job.batch_size, run_config)
        if layout.strategy.is_zero:
            from batchfit.sharding.zero import initialize

            initialize(runner, layout, job.config.precision)
            return runner
        runner.model = shard_model(runner.model, layout, world, job.config.precision)
        runner.optimizer = None
        runner.__post_init__()  # the optimizer over the sharded parameters
        return runner

    torch.default_generator.manual_seed(0)
    if layout.strategy.is_zero:  # DeepSpeed reads its rank from the environment, any time
        from batchfit.sharding.zero import deepspeed_environment

        with deepspeed_environment(rank, layout.world_size):
            windows = run_tracked_session(build, steps)
    else:
        windows = run_tracked_session(build, steps)
    return MeasuredStep(peak_bytes=max(w.peak_bytes for w in windows[1:]),
                        first_step_peak_bytes=windows[0].peak_bytes,
                        baseline_bytes=windows[-1].baseline_bytes,
                        method=MeasureMethod.TRACKER, seconds=windows[-1].seconds)
