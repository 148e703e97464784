"""Shared-library loads (``ctypes.CDLL``) and seconds per rank-0 trace of `plan`'s layouts on a
small Llama (tests/speed/plan_reference.py's, 128 tokens, 8 x H100 SXM, amp-bf16), old src
against new, each in a fresh process: ZeRO-2, ZeRO-3, then DDP, at micro-batches 1, 2, 4.

How it asks batchfit: through the planner's rank traces (a speed harness of the engine, not
an answer for users).

Before, importing DeepSpeed left ``PYTORCH_NVML_BASED_CUDA_CHECK=1`` set, and torch's fake
tensors then loaded libnvidia-ml on every op their cache missed, in every later trace.

Usage: nice python benchmarks/plan_trace_loads.py NEW_SRC OLD_SRC [--runs 3]
Writes benchmarks/results/plan_speed_trace_loads.json (every run, the load average around it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
TESTS = Path(__file__).parents[1] / "tests" / "speed"

CHILD = """
import ctypes, json, os, sys, time
sys.path.insert(0, %r)
calls = [0]
load = ctypes.CDLL.__init__
def counted(self, *a, **k):
    calls[0] += 1
    return load(self, *a, **k)
ctypes.CDLL.__init__ = counted
from plan_reference import llama, TOKENS
from batchfit.answers.ranks import estimate_ranks
from batchfit.engine.spec import TrainConfig
from batchfit.sharding import Parallelism
config = TrainConfig(optimizer="adamw", precision="amp-bf16")
out = []
for strategy in ("zero2", "zero3", "ddp"):
    for micro in (1, 2, 4):
        before, start = calls[0], time.perf_counter()
        est = estimate_ranks(llama, {"input_ids": TOKENS, "labels": TOKENS}, micro, config,
                             device="H100 SXM", first_step=False,
                             parallel=Parallelism(world_size=8, strategy=strategy, rank=0))
        out.append({"strategy": strategy, "micro": micro, "library_loads": calls[0] - before,
                    "seconds": round(time.perf_counter() - start, 2),
                    "total_bytes": est.total_bytes})
print(json.dumps({"traces": out,
                  "nvml_variable_after": os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK")}))
""" % str(TESTS)


def one_run(src: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTORCH_NVML_BASED_CUDA_CHECK"}
    env["PYTHONPATH"] = src
    load = os.getloadavg()[0]
    proc = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True,
                          text=True, check=True)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result.update(load_before=round(load, 2), load_after=round(os.getloadavg()[0], 2))
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("new_src")
    parser.add_argument("old_src")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    sources = {"new": args.new_src, "old": args.old_src}
    runs: dict[str, list[dict]] = {name: [] for name in sources}
    for _ in range(args.runs):
        for name, src in sources.items():
            runs[name].append(one_run(src))
            print(name, json.dumps(runs[name][-1]), flush=True)
    medians = {name: {f"{t['strategy']}@{t['micro']}": statistics.median(
        r["traces"][i]["seconds"] for r in rs) for i, t in enumerate(rs[0]["traces"])}
        for name, rs in runs.items()}
    same = all(r["traces"][i]["total_bytes"] == runs["old"][0]["traces"][i]["total_bytes"]
               for rs in runs.values() for r in rs for i in range(len(r["traces"])))
    out = {"command": " ".join(["python", *sys.argv]), "medians_s": medians,
           "same_bytes": same, "runs": runs}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "plan_speed_trace_loads.json").write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(medians), "same bytes:", same)


if __name__ == "__main__":
    main()
