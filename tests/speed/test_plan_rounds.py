"""``plan`` runs every layout's search at once, each trace in whichever of two workers is
free, and traces each request once; the rows are the ones the plan in sequence gives."""

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

tracepool._idle_cores = lambda window_s=0.05: 2.0  # run two at once whatever the load
sent, here = [], []
original_send, original_timed = tracepool._Worker.send, tracepool.TraceQueue._timed


def named(queue, request):
    needs = queue._trace.__self__
    if request >= len(needs.requests):  # a roofline micro-step, numbered after the ranks
        config, micro = needs.rooflines[request - len(needs.requests)]
        return ["roofline", config.checkpointing, micro]
    layout, config, micro = needs.requests[request]
    return [layout.strategy.value, config.checkpointing, micro]


queues = []
original_init = tracepool.TraceQueue.__init__


def init(self, *args, **kwargs):
    queues.append(self)
    original_init(self, *args, **kwargs)


def counted_send(self, request):
    sent.append(named(queues[-1], request))
    return original_send(self, request)


def counted_timed(self, request):
    here.append(named(self, request))
    return original_timed(self, request)


tracepool.TraceQueue.__init__ = init
tracepool._Worker.send, tracepool.TraceQueue._timed = counted_send, counted_timed
mlp = lambda: torch.nn.Sequential(*[torch.nn.Linear(8192, 8192) for _ in range(20)])
result = plan(mlp, (16, 8192), TrainConfig(optimizer="sgd"), gpus="4xT4", global_batch=8,
              strategies=["ddp", "fsdp", "fsdp-grad-op"], checkpointing="auto",
              offload="none")
print(json.dumps({"sent": sent, "here": here, "rows": [r.to_dict() for r in result.rows]}))
"""


def _run(parallel: str) -> dict:
    # a fresh process: the worker is forked before the process's first backward
    env = {**os.environ, "BATCHFIT_PARALLEL_TRACES": parallel}
    done = subprocess.run([sys.executable, "-c", _PLAN], env=env, capture_output=True,
                          text=True, timeout=600, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _traced(run: dict) -> list[tuple]:
    return sorted(tuple(request) for request in run["sent"] + run["here"])


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "fork") or (os.cpu_count() or 1) < 2,
                    reason="workers need fork and a second core")
def test_every_layout_is_searched_at_once_and_each_request_traced_once():
    in_sequence, in_parallel = _run("0"), _run("1")
    assert in_parallel["rows"] == in_sequence["rows"]
    ddp = next(row for row in in_parallel["rows"] if row["strategy"] == "ddp")
    assert not ddp["feasible"] and ddp["checkpointing"]
    assert [row["micro_batch_size"] for row in in_parallel["rows"] if row["feasible"]] == [2, 2]
    # in sequence: one layout after another (its roofline as its search ends), a
    # micro-batch at a time from 1; DDP does not fit at 1, nor does its checkpointed
    # variant (a Sequential has no checkpointing)
    assert in_sequence["sent"] == []
    assert in_sequence["here"] == [
        ["ddp", False, 1], ["ddp", True, 1], ["fsdp", False, 1], ["fsdp", False, 2],
        ["roofline", False, 2], ["fsdp-grad-op", False, 1], ["fsdp-grad-op", False, 2]]
    # at once: every trace in a worker, each once; the per-replica batch is 2, so every
    # search asks its two divisors together (DDP's variants both, though 1 settles them);
    # the roofline both rows use, once
    assert in_parallel["here"] == []
    assert len(_traced(in_parallel)) == len(set(_traced(in_parallel)))
    assert _traced(in_parallel) == sorted([
        ("ddp", False, 1), ("ddp", False, 2), ("ddp", True, 1), ("ddp", True, 2),
        ("fsdp", False, 1), ("fsdp", False, 2), ("fsdp-grad-op", False, 1),
        ("fsdp-grad-op", False, 2), ("roofline", False, 2)])
    # the first two traces are the first layout's pair, then the searches interleave: the
    # second layout's traces start before the first layout's search ends
    assert in_parallel["sent"][:2] == [["ddp", False, 1], ["ddp", False, 2]]
    assert in_parallel["sent"].index(["fsdp", False, 1]) < \
        in_parallel["sent"].index(["ddp", True, 1])
