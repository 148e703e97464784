"""Speed and memory of the engine itself.

1. One trace of timm ResNet-50 (training, AdamW, batch 64): batchfit vs torch's
   MemTracker under FakeTensorMode on the same step, median of several runs.
   Target: <= 2 s, and faster than MemTracker.
2. Llama-2-7B (transformers LlamaConfig defaults, seq 4096, batch 1, bf16,
   AdamW) in a fresh process: wall time and peak RSS. Target: <= 60 s, <= 2 GB.

Usage: python benchmarks/trace_speed.py [--runs 5] [--skip-llama]
Writes benchmarks/results/trace_speed.json and prints a summary.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def time_batchfit(runs: int) -> list[float]:
    import timm

    from batchfit.predict import estimate

    def factory():
        return timm.create_model("resnet50")

    estimate(factory, (3, 224, 224), 8)  # warm-up: imports, fake-tensor caches
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        estimate(factory, (3, 224, 224), 64, optimizer="adamw")
        times.append(time.perf_counter() - start)
    return times


def time_memtracker(runs: int) -> list[float]:
    import timm
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    def one() -> float:
        start = time.perf_counter()
        with FakeTensorMode():
            model = timm.create_model("resnet50")
            optim = torch.optim.AdamW(model.parameters(), foreach=False)
            x = torch.randn(64, 3, 224, 224)
            tracker = MemTracker()
            tracker.track_external(model, optim)
            with tracker:
                loss = model(x).sum()
                loss.backward()
                optim.step()
                optim.zero_grad()
            tracker.get_tracker_snapshot("peak")
        return time.perf_counter() - start

    one()
    return [one() for _ in range(runs)]


_LLAMA = r"""
import resource, time, json
start = time.perf_counter()
import transformers
import batchfit
from batchfit import TensorSpec
def factory():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig())
spec = {"input_ids": TensorSpec((4096,), "int64", high=32000),
        "labels": TensorSpec((4096,), "int64", high=32000)}
est = batchfit.estimate(factory, spec, 1, optimizer="adamw", precision="bf16", device="A100-80GB")
print(json.dumps({"seconds": time.perf_counter() - start,
                  "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "total_bytes": est.total_bytes, "parameters": est.parameter_count}))
"""


def llama_7b() -> dict:
    proc = subprocess.run([sys.executable, "-c", _LLAMA], capture_output=True, text=True,
                          check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--skip-llama", action="store_true")
    args = parser.parse_args()
    ours = time_batchfit(args.runs)
    theirs = time_memtracker(args.runs)
    result = {
        "resnet50_b64_train": {
            "batchfit_seconds": ours, "memtracker_seconds": theirs,
            "batchfit_median_s": statistics.median(ours),
            "memtracker_median_s": statistics.median(theirs),
            "ratio_batchfit_over_memtracker": statistics.median(ours) / statistics.median(theirs),
        }
    }
    if not args.skip_llama:
        result["llama2_7b_seq4096_bf16_adamw"] = llama_7b()
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "trace_speed.json").write_text(json.dumps(result, indent=2) + "\n")
    r = result["resnet50_b64_train"]
    print(f"ResNet-50 B=64 trace: batchfit {r['batchfit_median_s']:.2f} s, MemTracker "
          f"{r['memtracker_median_s']:.2f} s (median of {args.runs}); "
          f"ratio {r['ratio_batchfit_over_memtracker']:.2f}")
    if "llama2_7b_seq4096_bf16_adamw" in result:
        ll = result["llama2_7b_seq4096_bf16_adamw"]
        print(f"Llama-2-7B seq 4096 bf16 AdamW on A100-80GB: {ll['seconds']:.1f} s, "
              f"peak RSS {ll['max_rss_bytes'] / 2**30:.2f} GiB, predicted "
              f"{ll['total_bytes'] / 2**30:.1f} GiB, {ll['parameters']:,} parameters")


if __name__ == "__main__":
    main()
