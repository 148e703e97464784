"""Speed and memory of the LLM commands, run as a user runs them (a fresh `batchfit`
process, start-up included), with a peer from issue 3 in the same rounds.

How it asks batchfit: the ``batchfit`` command line in fresh processes (a speed benchmark).

* `batchfit max hf:meta-llama/Meta-Llama-3-8B --lora r=16 --quant nf4 --seq-len 4096
  --gpu "RTX 4090"`: target <= 30 s wall, <= 2 GB RSS.
* `batchfit serve hf:meta-llama/Llama-3.1-70B --gpu B200 --max-model-len 32768`: target
  <= 20 s (70B in bf16 is 131 GiB: on one H100 nothing is left for the cache).
* peer: `batchfit max hf:meta-llama/Llama-2-7b-hf --seq-len 4096 --precision bf16 --gpu
  A100-80GB` (issue 3's LLM command, <= 60 s there), run in the same rounds so the ratio is
  like for like on a machine whose speed drifts (other engineers share its 2 cores).

RSS is the largest of the process and its children (the trace worker `max` may fork).
Usage: nice python benchmarks/llm_speed.py [--runs 3]
Writes benchmarks/results/llm_speed.json and prints a summary.
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
COMMANDS = {
    "qlora_max": ["max", "hf:meta-llama/Meta-Llama-3-8B", "--lora", "r=16", "--quant", "nf4",
                  "--seq-len", "4096", "--gpu", "RTX 4090"],
    "serve_70b": ["serve", "hf:meta-llama/Llama-3.1-70B", "--gpu", "B200", "--max-model-len",
                  "32768"],
    "peer_llama2_max": ["max", "hf:meta-llama/Llama-2-7b-hf", "--seq-len", "4096",
                        "--precision", "bf16", "--gpu", "A100-80GB"],
}
TARGETS = {"qlora_max": 30.0, "serve_70b": 20.0, "peer_llama2_max": 60.0}


def run_cli(arguments: list[str]) -> dict:
    code = ("import resource, sys; from batchfit.cli import main; sys.argv = ['batchfit'] + "
            "sys.argv[1:]\ntry:\n    main()\nexcept SystemExit:\n    pass\n"
            "own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
            "kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss\n"
            "print('RSS', max(own, kids) * 1024)")
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code, *arguments, "--json"],
                          capture_output=True, text=True, check=True)
    wall = time.perf_counter() - start
    lines = proc.stdout.strip().splitlines()
    answer = json.loads("\n".join(lines[:-1]))
    summary = {k: answer[k] for k in ("max_batch_size", "traces", "num_blocks",
                                      "max_concurrency") if k in answer}
    return {"seconds": round(wall, 2), "max_rss_bytes": int(lines[-1].split()[1]), **summary}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    subprocess.run([sys.executable, "-m", "compileall", "-q",
                    str(Path(__file__).parents[1] / "src")], check=True)
    rounds: dict[str, list[dict]] = {name: [] for name in COMMANDS}
    reference = []
    for _ in range(args.runs):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import torch"], check=True)
        reference.append(round(time.perf_counter() - start, 2))
        for name, arguments in COMMANDS.items():
            rounds[name].append(run_cli(arguments))
            print(name, rounds[name][-1], flush=True)
    out = {"reference_import_torch_s": reference, "commands": {}}
    peer = statistics.median(r["seconds"] for r in rounds["peer_llama2_max"])
    for name, runs in rounds.items():
        median = statistics.median(r["seconds"] for r in runs)
        out["commands"][name] = {
            "argv": COMMANDS[name], "runs": runs, "median_s": median,
            "max_rss_bytes": max(r["max_rss_bytes"] for r in runs),
            "target_s": TARGETS[name], "ratio_to_peer": round(median / peer, 3)}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "llm_speed.json").write_text(json.dumps(out, indent=2) + "\n")
    for name, entry in out["commands"].items():
        print(f"{name}: median {entry['median_s']:.1f} s (target {entry['target_s']:.0f} s), "
              f"RSS {entry['max_rss_bytes'] / 2**30:.2f} GiB, {entry['ratio_to_peer']}x peer")


if __name__ == "__main__":
    main()
