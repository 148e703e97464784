"""Wall time of `batchfit plan` for an 8B LLM over four layouts, run as a user runs it (a
fresh `batchfit` process, start-up included): issue 36's case, target <= 60 s.

    batchfit plan hf:meta-llama/Meta-Llama-3-8B --gpus 8xH100 --global-batch 256
      --seq-len 2048 --strategies ddp,fsdp,zero2,zero3

Usage: nice python benchmarks/plan_speed.py [--runs 3]
Writes benchmarks/results/plan_speed.json (every run and the median) and prints a summary.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from llm_speed import RESULTS, run_cli

ARGV = ["plan", "hf:meta-llama/Meta-Llama-3-8B", "--gpus", "8xH100", "--global-batch", "256",
        "--seq-len", "2048", "--strategies", "ddp,fsdp,zero2,zero3"]
TARGET_S = 60.0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    subprocess.run([sys.executable, "-m", "compileall", "-q",
                    str(Path(__file__).parents[1] / "src")], check=True)
    runs, reference = [], []
    for _ in range(args.runs):
        start = time.perf_counter()  # the machine's speed now, as a yardstick
        subprocess.run([sys.executable, "-c", "import torch"], check=True)
        reference.append(round(time.perf_counter() - start, 2))
        runs.append(run_cli(ARGV))
        print(runs[-1], flush=True)
    median = statistics.median(r["seconds"] for r in runs)
    out = {"argv": ARGV, "runs": runs, "median_s": median, "target_s": TARGET_S,
           "reference_import_torch_s": reference,
           "max_rss_bytes": max(r["max_rss_bytes"] for r in runs)}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "plan_speed.json").write_text(json.dumps(out, indent=2) + "\n")
    print(f"plan 8B x 4 layouts: median {median:.1f} s (target {TARGET_S:.0f} s)")


if __name__ == "__main__":
    main()
