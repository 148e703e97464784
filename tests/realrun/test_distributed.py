"""Distributed searches: two real gloo ranks on the CPU, each with its own memory, must agree
on every trial and return the same answer, the smaller rank's true maximum.

The ranks are started once (``torch.multiprocessing.spawn``) and run every scenario in turn;
each test checks one scenario's results. Every expected answer is derived by hand:

* a model that raises ``torch.OutOfMemoryError`` above a per-rank batch size (rank 0 at
  9, rank 1 at 5): the agreed answer is 5, and rank 0 fits the batches 6..9 on its own;
* ``Broadcast`` (12 MiB per sample, see ``capped_models.py``) under a 100 MiB cap on rank 0
  (8 samples) and a 64 MiB cap on rank 1 (5 samples, 60 MiB; 6 would need 72 MiB): 5;
* the same models wrapped in ``DistributedDataParallel``, searched in fresh capped
  processes (the wrapped module is what is sent) and in process (the way CUDA searches):
  rank 1 runs out of memory in forward while rank 0 goes through backward, which under
  DDP's own forward would block in its gradient all-reduce;
* a sharded model (``ShardedRaisesAbove``: two ``fully_shard`` units), searched from its
  factory with ``parallel=``: each trial's processes form a gloo group of their own and
  shard the model. Above batch 5 rank 1 runs out of memory between the two units, while
  rank 0 waits for it in the second unit's all-gather (FSDP2) or, with no sharding to
  gather (HSDP over 2 nodes of 1 rank), in backward's gradient all-reduce: rank 0's
  trial must end at once ("another rank's trial stopped", its peer's sockets closed),
  not hang, both agree on 5 and name rank 1, and each trial holds its rank's shard of the
  parameters (the tracker counts a DTensor's local shard: 288 of the model's 576 bytes);
* a non-memory error, or a bad argument, on rank 1 only: both ranks raise, neither hangs.

Collectives time out after 60 s and the whole run is killed after ``RUN_TIMEOUT_S``, so a
hang fails the tests instead of stalling them.
"""

from __future__ import annotations

import datetime
import functools
import os
import time
import traceback

import pytest
import torch
import torch.distributed as dist
from torch import nn

from capped_models import Broadcast
from gloo_ranks import finish_rank, run_ranks, scenario_results

pytestmark = pytest.mark.slow  # real gloo process groups, one process per rank

MIB = 1 << 20
WORLD_SIZE = 2
#: Per-rank batch size above which ``RaisesAbove`` runs out of memory.
LIMITS = (9, 5)
#: Per-rank memory caps for ``Broadcast`` (12 MiB per sample): 8 and 5 samples.
CAPS = (100 * MIB, 64 * MIB)
AGREED = 5
RUN_TIMEOUT_S = 240


class RaisesAbove(nn.Module):
    """A linear layer whose forward raises ``torch.OutOfMemoryError`` (what the CUDA
    allocator raises) when the batch has more than ``limit`` samples."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > self.limit:
            raise torch.OutOfMemoryError(f"fake: batch {x.shape[0]} > {self.limit}")
        return self.linear(x)


#: Models built in this (the search's) process: a sharded search builds none here.
BUILT_HERE = []


class ShardedRaisesAbove(nn.Module):
    """Two linear layers, each its own FSDP2 unit; above ``limit`` samples forward raises
    ``torch.OutOfMemoryError`` after the first unit, before the second unit's collective.
    Parameters: 2 x (8 x 8 + 8) floats = 576 bytes; FSDP2 over 2 ranks keeps rows 0-3
    or 4-7 of each weight and bias on a rank: 2 x (4 x 8 + 4) x 4 = 288 bytes."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        BUILT_HERE.append(os.getpid())
        self.limit = limit
        self.first = nn.Linear(8, 8)
        self.second = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.first(x)
        if x.shape[0] > self.limit:
            raise torch.OutOfMemoryError(f"fake: batch {x.shape[0]} > {self.limit}")
        return self.second(hidden)


class BadOnRankOne(nn.Module):
    """Raises a plain ValueError (not out of memory) on rank 1 only."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.rank == 1:
            raise ValueError("rank 1's forward is broken")
        return self.linear(x)


# --------------------------------------------------------------------------- in each rank


def _summary(result) -> dict:
    return {"max": result.max_batch_size, "world_size": result.world_size,
            "limiting_rank": result.limiting_rank,
            "trials": [(t.batch_size, t.fits) for t in result.trials]}


def _fake_oom(rank: int, server) -> dict:
    from batchfit.realrun.search import search_max_batch

    result = search_max_batch(functools.partial(RaisesAbove, LIMITS[rank]), (8,), device="cpu",
                              memory_cap_bytes=64 * MIB, optimizer="sgd", predicted=8,
                              trial_server=server)
    return _summary(result)


def _real_cap(rank: int, server) -> dict:
    from batchfit.realrun.search import search_max_batch

    result = search_max_batch(Broadcast, (1,), device="cpu", memory_cap_bytes=CAPS[rank],
                              optimizer="sgd", trial_server=server)
    return {**_summary(result), "predicted": result.predicted_max_batch_size}


def _ddp_capped(rank: int, server) -> dict:
    from torch.nn.parallel import DistributedDataParallel

    from batchfit.realrun.search import search_max_batch

    torch.manual_seed(0)
    model = DistributedDataParallel(RaisesAbove(LIMITS[rank]))
    result = search_max_batch(model, (8,), device="cpu", memory_cap_bytes=64 * MIB,
                              optimizer="sgd", predicted=8, trial_server=server)
    return _summary(result)


def _ddp_in_process(rank: int, server) -> dict:
    """The CUDA search's in-process trials, on the CPU: the user's DDP model, its optimizer,
    state restored after each trial; then one real DDP step to show DDP still works."""
    from torch.nn.parallel import DistributedDataParallel

    from batchfit.engine.spec import TrainConfig
    from batchfit.realrun.distributed import agreement_for, local_module
    from batchfit.realrun.search import _InProcessSearch, _Prediction, _RunOptions
    from batchfit.realrun.state import preserved_state

    torch.manual_seed(0)
    model = DistributedDataParallel(RaisesAbove(LIMITS[rank]))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    with preserved_state(model, optimizer) as snapshot:
        search = _InProcessSearch(local_module(model), (8,), TrainConfig(optimizer="sgd"),
                                  torch.device("cpu"), 2, optimizer, snapshot)
        result = search.run(_Prediction(8), _RunOptions(64, None, 0.05, None, time.perf_counter()),
                            agreement_for(None))
    restored = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    # A real DDP step afterwards: rank-dependent inputs, all-reduced gradients must agree.
    model(torch.full((2, 8), float(rank + 1))).sum().backward()
    grads = [p.grad.detach().clone() for p in model.parameters()]
    gathered = [None] * WORLD_SIZE
    dist.all_gather_object(gathered, [g.tolist() for g in grads])
    return {**_summary(result), "restored": restored, "ddp_grads_agree": gathered[0] == gathered[1]}


def _sharded(rank: int, server, **layout) -> dict:
    from batchfit.realrun.search import search_max_batch
    from batchfit.sharding import Parallelism

    rng = torch.get_rng_state()
    built = len(BUILT_HERE)
    result = search_max_batch(functools.partial(ShardedRaisesAbove, LIMITS[rank]), (8,),
                              device="cpu", memory_cap_bytes=64 * MIB, optimizer="sgd",
                              predicted=8, trial_server=server, timeout_s=60,
                              parallel=Parallelism(world_size=WORLD_SIZE, wrap=("Linear",),
                                                   **layout))
    return {**_summary(result),
            "errors": {t.batch_size: t.error for t in result.trials if not t.fits},
            "baselines": sorted({t.baseline_bytes for t in result.trials if t.fits}),
            "slowest_trial_s": max(t.seconds for t in result.trials),
            "rng_kept": torch.equal(rng, torch.get_rng_state()),
            "built_here": len(BUILT_HERE) - built}


def _error_on_one_rank(rank: int, server) -> dict:
    from batchfit.realrun.search import search_max_batch

    try:
        search_max_batch(functools.partial(BadOnRankOne, rank), (8,), device="cpu",
                         memory_cap_bytes=64 * MIB, optimizer="sgd", predicted=4,
                         trial_server=server)
    except Exception as exc:  # noqa: BLE001 - the scenario is what each rank raises
        return {"raised": type(exc).__name__, "message": str(exc)}
    return {"raised": None}


def _bad_argument_on_one_rank(rank: int, server) -> dict:
    from batchfit.realrun.search import search_max_batch

    try:
        search_max_batch(functools.partial(RaisesAbove, 9), (8,), device="cpu",
                         memory_cap_bytes=64 * MIB if rank == 0 else 0, optimizer="sgd",
                         predicted=4, trial_server=server)
    except Exception as exc:  # noqa: BLE001 - the scenario is what each rank raises
        return {"raised": type(exc).__name__, "message": str(exc)}
    return {"raised": None}


SCENARIOS = {"fake_oom": _fake_oom, "real_cap": _real_cap, "ddp_capped": _ddp_capped,
             "ddp_in_process": _ddp_in_process,
             "fsdp": functools.partial(_sharded, strategy="fsdp"),
             "hsdp": functools.partial(_sharded, strategy="hsdp", nodes=2),
             "error": _error_on_one_rank,
             "bad_argument": _bad_argument_on_one_rank}


def _rank_main(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE,
                            timeout=datetime.timedelta(seconds=60))
    from batchfit.realrun.trial_server import TrialServer

    results: dict = {}
    # torch._dynamo preloaded: the tests' boundaries have megabytes to spare, so the
    # templates need not import it themselves (that would cost seconds per scenario).
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "OMP_NUM_THREADS": "1"}
    try:
        with TrialServer([__name__, "torch._dynamo"], env=env) as server:
            for name, scenario in SCENARIOS.items():
                start = time.perf_counter()
                try:
                    results[name] = scenario(rank, server)
                except Exception:  # noqa: BLE001 - reported to the test
                    results[name] = {"crashed": traceback.format_exc()}
                results[name]["seconds"] = round(time.perf_counter() - start, 2)
    finally:
        finish_rank(rank, out_dir, results)


# --------------------------------------------------------------------------- the tests


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return run_ranks(_rank_main, tmp_path_factory.mktemp("ranks"), WORLD_SIZE, RUN_TIMEOUT_S)


def test_ranks_agree_on_the_smaller_ranks_maximum_with_a_fake_oom(ranks):
    zero, one = scenario_results(ranks, "fake_oom")
    assert zero["max"] == one["max"] == min(LIMITS) == AGREED
    assert zero["limiting_rank"] == one["limiting_rank"] == 1
    assert zero["world_size"] == one["world_size"] == WORLD_SIZE
    # Both ranks tried the same batch sizes in the same order...
    assert [b for b, _ in zero["trials"]] == [b for b, _ in one["trials"]]
    # ...and only rank 1 hit its limit: rank 0 fitted batch 6 on its own.
    assert dict(zero["trials"])[AGREED + 1] is True
    assert dict(one["trials"])[AGREED + 1] is False
    assert dict(zero["trials"])[AGREED] and dict(one["trials"])[AGREED]


def test_ranks_agree_under_real_memory_caps(ranks):
    zero, one = scenario_results(ranks, "real_cap")
    # 64 MiB / 12 MiB per sample = 5.33: rank 1 fits 5 with 4 MiB to spare.
    assert zero["max"] == one["max"] == AGREED
    assert zero["limiting_rank"] == one["limiting_rank"] == 1
    assert [b for b, _ in zero["trials"]] == [b for b, _ in one["trials"]]
    # Each rank's prediction differs (8 and 5); the agreed one is the smaller.
    assert zero["predicted"] == one["predicted"] == AGREED


def test_ddp_model_is_searched_through_its_wrapped_module(ranks):
    zero, one = scenario_results(ranks, "ddp_capped")
    assert zero["max"] == one["max"] == AGREED


def test_in_process_trials_of_a_ddp_model_never_wait_in_ddps_all_reduce(ranks):
    zero, one = scenario_results(ranks, "ddp_in_process")
    assert zero["max"] == one["max"] == AGREED
    assert dict(zero["trials"])[AGREED + 1] and not dict(one["trials"])[AGREED + 1]
    assert zero["restored"] and one["restored"]
    assert zero["ddp_grads_agree"] and one["ddp_grads_agree"]


@pytest.mark.parametrize("strategy", ["fsdp", "hsdp"])
def test_sharded_trials_meet_in_their_own_group_and_an_oom_strands_no_rank(ranks, strategy):
    zero, one = scenario_results(ranks, strategy)
    assert zero["max"] == one["max"] == AGREED
    assert zero["limiting_rank"] == one["limiting_rank"] == 1
    assert [b for b, _ in zero["trials"]] == [b for b, _ in one["trials"]]
    above = str(AGREED + 1)  # JSON keys
    assert f"batch {AGREED + 1} > {AGREED}" in one["errors"][above]
    # rank 0 fits 6 on its own, but its trial's peer left: it stopped at once, not waited
    # (a wait ends at the 60 s timeout and would say "timed out")
    assert zero["errors"][above].startswith("another rank's trial stopped")
    assert "connection" in zero["errors"][above].lower()
    assert zero["slowest_trial_s"] < 30 and one["slowest_trial_s"] < 30
    # each rank's trials start from its shard of the parameters: half of 576 bytes (FSDP2)
    # or all of them (HSDP over 2 nodes of 1 rank: replicated, not sharded)
    expected = 288 if strategy == "fsdp" else 576
    assert zero["baselines"] == one["baselines"] == [expected]
    # the search's processes build nothing and keep their RNG: the trials do the work
    assert zero["built_here"] == one["built_here"] == 0
    assert zero["rng_kept"] and one["rng_kept"]


def test_an_error_on_one_rank_is_raised_on_every_rank(ranks):
    zero, one = scenario_results(ranks, "error")
    assert one["raised"] == "ValueError" and "broken" in one["message"]
    assert zero["raised"] == "TrialError"
    assert "rank 1" in zero["message"] and "broken" in zero["message"]


def test_a_bad_argument_on_one_rank_is_raised_on_every_rank(ranks):
    zero, one = scenario_results(ranks, "bad_argument")
    assert one["raised"] == "InvalidInputError" and "memory cap" in one["message"]
    assert zero["raised"] == "TrialError"
    assert "rank 1" in zero["message"] and "arguments" in zero["message"]


def test_a_group_without_torch_distributed_is_a_clear_error():
    from batchfit.errors import InvalidInputError
    from batchfit.realrun.distributed import agreement_for

    assert agreement_for(None) is None
    with pytest.raises(InvalidInputError, match="init_process_group"):
        agreement_for(object())


def test_a_sharded_model_itself_is_refused_with_how_to_search_it():
    from batchfit.errors import InvalidInputError
    from batchfit.realrun.distributed import local_module

    class FullyShardedDataParallel(nn.Module):  # what FSDP's class is called
        pass

    with pytest.raises(InvalidInputError, match="parallel=Parallelism"):
        local_module(FullyShardedDataParallel())


def test_parallel_without_torch_distributed_is_a_clear_error():
    from batchfit.errors import InvalidInputError
    from batchfit.realrun.search import search_max_batch
    from batchfit.sharding import Parallelism

    with pytest.raises(InvalidInputError, match="init_process_group"):
        search_max_batch(functools.partial(ShardedRaisesAbove, 4), (8,), device="cpu",
                         optimizer="sgd", parallel=Parallelism(world_size=2, strategy="fsdp"))

