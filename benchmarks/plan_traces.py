"""Each trace of `plan` for an 8B LLM over four layouts, timed (where its time goes).

How it asks batchfit: the planner's internals, each trace timed (a speed harness).

Usage: PYTHONPATH=SRC nice python benchmarks/plan_traces.py hf:meta-llama/Meta-Llama-3-8B 2048
Prints one line per rank trace (strategy, offload, checkpointing, micro-batch, seconds, bytes)
and per roofline trace (checkpointing, micro-batch, seconds), then the wall time and the plan.
Results: benchmarks/results/plan_speed_8b_traces.json.
"""
import json
import sys
import time

from batchfit.answers import ranks as R
from batchfit.engine.spec import TrainConfig
from batchfit.models.resolve import resolve_model
from batchfit.speed import op_costs
from batchfit.speed import plan as P

spec = resolve_model(sys.argv[1], seq_len=int(sys.argv[2]))
calls = []
orig = R.estimate_ranks
def wrap(*a, **k):
    t = time.perf_counter(); r = orig(*a, **k)
    calls.append(("rank", k["parallel"].strategy.value, k["parallel"].offload.value, a[3].checkpointing, a[2], round(time.perf_counter()-t,1), r.total_bytes)); print(calls[-1], flush=True)
    return r
R.estimate_ranks = wrap
orig_oc = op_costs.trace_op_costs
def wrap2(*a, **k):
    t = time.perf_counter(); r = orig_oc(*a, **k)
    calls.append(("ops", a[3].checkpointing, a[2], round(time.perf_counter()-t,1))); print(calls[-1], flush=True)
    return r
op_costs.trace_op_costs = wrap2
t = time.perf_counter()
res = P.plan(spec.factory, spec.input_spec, TrainConfig(), gpus="8xH100 SXM", global_batch=256, checkpoint_dtype="bfloat16", strategies=["ddp","fsdp","zero2","zero3"])
print("wall", time.perf_counter() - t)
print(json.dumps(res.to_dict()))
