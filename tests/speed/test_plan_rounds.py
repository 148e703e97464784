"""``plan`` traces every layout's micro-batch of 1 in one round across layouts, pairs
those traces across layouts, and traces nothing the plan in sequence does not: the same
requests, each once, and the same rows, whether a worker runs pairs or not."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

# 20 Linear(8192, 8192): 1,342,341,120 parameters. Plain SGD keeps weights and gradients,
# 8 bytes each: 10.0 GiB, under a T4's 14.76 GiB, so DDP's floor does not settle it and
# it is traced; the trace goes over (DDP's gradient buckets are a second copy of the
# gradients: 15.7 GiB at a micro-batch of 1), so DDP moves on to checkpointing (which a
# Sequential does not have). Under FSDP over 4 GPUs a quarter of it fits at the
# micro-batches 1 and 2 of the per-replica batch 2.
_PLAN = """
import json
import torch
from batchfit.answers import tracepool
from batchfit.engine.spec import TrainConfig
from batchfit.speed.plan import plan

tracepool._idle_cores = lambda window_s=0.05: 2.0  # run pairs whatever the machine's load
maps, pairs = [], []
original_map, original_pair = tracepool.TracePool.map, tracepool.TracePool._pair


def named(pool, request):
    needs = pool._trace.__self__
    if request >= len(needs.requests):  # a roofline micro-step, numbered after the ranks
        config, micro = needs.rooflines[request - len(needs.requests)]
        return ["roofline", config.checkpointing, micro]
    layout, config, micro = needs.requests[request]
    return [layout.strategy.value, config.checkpointing, micro]


def counted_map(self, requests):
    maps.append([named(self, r) for r in requests])
    return original_map(self, requests)


def counted_pair(self, first, second):
    pairs.append([named(self, first), named(self, second)])
    return original_pair(self, first, second)


tracepool.TracePool.map, tracepool.TracePool._pair = counted_map, counted_pair
mlp = lambda: torch.nn.Sequential(*[torch.nn.Linear(8192, 8192) for _ in range(20)])
result = plan(mlp, (16, 8192), TrainConfig(optimizer="sgd"), gpus="4xT4", global_batch=8,
              strategies=["ddp", "fsdp", "fsdp-grad-op"], checkpointing="auto",
              offload="none")
print(json.dumps({"maps": maps, "pairs": pairs, "rows": [r.to_dict() for r in result.rows]}))
"""


def _run(parallel: str) -> dict:
    # a fresh process: the worker is forked before the process's first backward
    env = {**os.environ, "BATCHFIT_PARALLEL_TRACES": parallel}
    done = subprocess.run([sys.executable, "-c", _PLAN], env=env, capture_output=True,
                          text=True, timeout=600, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _traced(run: dict) -> list[tuple]:
    return sorted(tuple(request) for requests in run["maps"] for request in requests)


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "fork") or (os.cpu_count() or 1) < 2,
                    reason="a worker needs fork and a second core")
def test_the_first_round_pairs_layouts_and_traces_nothing_ahead_of_need():
    in_sequence, in_pairs = _run("0"), _run("1")
    assert in_pairs["rows"] == in_sequence["rows"]
    # every search begins with its first variant (no checkpointing) at a micro-batch of 1
    first_round = [["ddp", False, 1], ["fsdp", False, 1], ["fsdp-grad-op", False, 1]]
    assert in_pairs["maps"][0] == in_sequence["maps"][0] == first_round
    # two layouts' traces at once (before: a layout's two variants, so the checkpointed
    # FSDP variants were traced though FSDP fits without checkpointing)
    assert in_pairs["pairs"][0] == [["ddp", False, 1], ["fsdp", False, 1]]
    assert in_sequence["pairs"] == []
    # then the next variant of the one layout that does not fit at 1: DDP's checkpointed
    # one, which fails at 1 and is not traced at 2
    assert in_pairs["maps"][1] == [["ddp", True, 1]]
    assert _traced(in_pairs) == _traced(in_sequence) == sorted([
        ("ddp", False, 1), ("ddp", True, 1), ("fsdp", False, 1), ("fsdp", False, 2),
        ("fsdp-grad-op", False, 1), ("fsdp-grad-op", False, 2), ("roofline", False, 2)])
    # the roofline of the micro-step both rows use, once, after every layout's search
    assert in_pairs["maps"][-1] == in_sequence["maps"][-1] == [["roofline", False, 2]]
    ddp = next(row for row in in_pairs["rows"] if row["strategy"] == "ddp")
    assert not ddp["feasible"] and ddp["checkpointing"]
    assert [row["micro_batch_size"] for row in in_pairs["rows"] if row["feasible"]] == [2, 2]
