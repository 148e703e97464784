"""The noise scale from DDP ranks: two real gloo ranks on the CPU.

* ``noise_scale`` of a ``DistributedDataParallel`` linear regression (noise_models.py): within
  10% of the closed form after the steps a pilot states, its interval agreeing with the
  per-example one measured here in one process;
* a hand-written DDP loop with two accumulated micro-batches per rank and the monitor: each
  step's parts equal a single-process computation from the four micro-batches' own
  gradients (so the small norms are read before DDP's all-reduce, the big one after it).
"""

from __future__ import annotations

import datetime
import os
import time
import traceback

import pytest
import torch
import torch.distributed as dist
from noise_models import half_mse, linear_regression
from torch import nn

from batchfit.stats.estimator import two_batch_estimates
from batchfit.stats.measure import noise_scale
from gloo_ranks import finish_rank, run_ranks, scenario_results

pytestmark = pytest.mark.slow  # real DDP ranks over gloo

WORLD_SIZE = 2
MICRO, SIZE, STEPS = 2, 5, 3
RUN_TIMEOUT_S = 240


def _micro_batch(step: int, rank: int, j: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + j)
    return torch.randn(SIZE, 4, generator=g), torch.randn(SIZE, 3, generator=g)


def _small_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))


def _mse(model: nn.Module, batch) -> torch.Tensor:
    return (model(batch[0]) - batch[1]).square().mean()


def _noise_scale_scenario(rank: int) -> dict:
    problem = linear_regression()
    model = nn.parallel.DistributedDataParallel(problem.model)
    data = (problem.x, problem.y)
    pilot = noise_scale(model, half_mse, data, batch_small=8, batch_big=64, steps=20, seed=1)
    stated = pilot.steps_for(0.1)
    result = noise_scale(model, half_mse, data, batch_small=8, batch_big=64, steps=stated,
                         seed=2)
    return {"stated": stated, **result.to_dict(), "truth": problem.b_simple}


def _monitor_scenario(rank: int, accumulation_steps: int | None = None) -> dict:
    from batchfit.stats.monitor import NoiseScaleMonitor

    model = nn.parallel.DistributedDataParallel(_small_model())
    with NoiseScaleMonitor(model, keep_history=True,
                           accumulation_steps=accumulation_steps) as monitor:
        for step in range(STEPS):
            for j in range(MICRO):
                context = model.no_sync() if j < MICRO - 1 else _Null()
                with context:
                    (_mse(model, _micro_batch(step, rank, j)) / MICRO).backward()
            monitor.step()
            model.zero_grad(set_to_none=True)
    result = monitor.result()
    return {"method": result.method, "batch_small": result.batch_small,
            "batch_big": result.batch_big,
            "history": [[s.grad_sq_norm, s.trace_sigma] for s in result.history]}


class _Null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


SCENARIOS = {"noise_scale": _noise_scale_scenario, "monitor": _monitor_scenario,
             "monitor_told_accumulation": lambda rank: _monitor_scenario(rank, MICRO)}


def _rank_main(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE,
                            timeout=datetime.timedelta(seconds=60))
    results: dict = {}
    try:
        for name, scenario in SCENARIOS.items():
            start = time.perf_counter()
            try:
                results[name] = scenario(rank)
                results[name]["seconds"] = round(time.perf_counter() - start, 2)
            except Exception:  # noqa: BLE001 - reported to the test
                results[name] = {"crashed": traceback.format_exc()}
    finally:
        finish_rank(rank, out_dir, results)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return run_ranks(_rank_main, tmp_path_factory.mktemp("noise_ranks"), WORLD_SIZE, RUN_TIMEOUT_S)


def test_ddp_noise_scale_is_within_10_percent_and_agrees_with_per_example(ranks):
    first, second = scenario_results(ranks, "noise_scale")
    assert first["b_simple"] == second["b_simple"]  # the ranks all-reduce to one answer
    assert first["method"] == "ddp" and (first["batch_small"], first["batch_big"]) == (8, 64)
    truth = first["truth"]
    assert first["steps"] == first["stated"]
    assert first["b_simple"] == pytest.approx(truth, rel=0.10)
    assert first["ci_low"] <= truth <= first["ci_high"]
    problem = linear_regression()
    per_example = noise_scale(problem.model, half_mse, (problem.x, problem.y), batch_small=1,
                              batch_big=64, steps=first["stated"], seed=3)
    assert max(first["ci_low"], per_example.ci_low) <= min(first["ci_high"], per_example.ci_high)


@pytest.mark.parametrize("scenario", ["monitor", "monitor_told_accumulation"])
def test_ddp_monitor_reads_small_norms_before_the_all_reduce(ranks, scenario):
    first, second = scenario_results(ranks, scenario)
    assert first["history"] == second["history"]
    assert first["method"] == "ddp"
    assert (first["batch_small"], first["batch_big"]) == (SIZE, SIZE * MICRO * WORLD_SIZE)
    model = _small_model()
    params = list(model.parameters())
    for step, (g2, trace) in enumerate(first["history"]):
        grads = [torch.cat([g.flatten() for g in torch.autograd.grad(
            _mse(model, _micro_batch(step, rank, j)), params)])
            for rank in range(WORLD_SIZE) for j in range(MICRO)]
        small = sum(float(g.square().sum()) for g in grads) / len(grads)
        big = float(torch.stack(grads).mean(0).square().sum())
        expected = two_batch_estimates(small, big, SIZE, SIZE * len(grads))
        assert g2 == pytest.approx(expected[0], rel=1e-4)
        assert trace == pytest.approx(expected[1], rel=1e-4)
