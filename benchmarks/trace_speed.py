"""Speed and memory of the engine itself.

How it asks batchfit: the engine's trace directly (item 1, the same step as the peer's) and
the ``batchfit max`` CLI in fresh processes (a speed harness).

1. One trace of timm ResNet-50 (training, AdamW, batch 64): batchfit vs torch's
   MemTracker under FakeTensorMode on the same step, median of several runs.
   Target: <= 2 s, and faster than MemTracker.
2. Llama-2-7B (transformers LlamaConfig defaults, seq 4096, batch 1, bf16,
   AdamW) in a fresh process: wall time and peak RSS. Target: <= 60 s, <= 2 GB.
3. Issue 3's two `max` commands, run as a user runs them (a fresh `batchfit` process,
   start-up included), wall time and peak RSS, median of ``--runs``:
   `batchfit max timm:resnet50 --gpu "RTX 3090" --precision amp-fp16` (target <= 10 s) and
   `batchfit max hf:meta-llama/Llama-2-7b-hf --seq-len 4096 --precision bf16 --optimizer
   adamw --gpu A100-80GB` (<= 60 s, <= 2 GB). This machine's speed drifts from day to day
   (the same commit's ResNet-50 `max` took 10.8 s one day and 22 s another), so the run also
   times a fixed pure-Python loop and ``import torch`` as a reference, and
   ``--compare-src DIR`` runs the same commands from another checkout's ``src``,
   interleaved run by run, for a like-for-like ratio.

Usage: python benchmarks/trace_speed.py [--runs 5] [--skip-llama] [--skip-cli]
       [--compare-src /path/to/other/src]
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

    from batchfit.answers.estimate import estimate

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


CLI_COMMANDS = {
    "resnet50_3090_amp": ["max", "timm:resnet50", "--gpu", "RTX 3090", "--precision",
                          "amp-fp16"],
    "llama2_7b_a100_max": ["max", "hf:meta-llama/Llama-2-7b-hf", "--seq-len", "4096",
                           "--precision", "bf16", "--optimizer", "adamw", "--gpu", "A100-80GB"],
}

_REFERENCE_LOOP = ("import time\nt = time.perf_counter()\ns = 0\nfor i in range(10**7):\n"
                   "    s += i\nprint(time.perf_counter() - t)")


def run_cli(arguments: list[str], src: str | None) -> dict:
    """One `batchfit` command in a fresh process: wall seconds, peak RSS, the answer."""
    import os

    env = dict(os.environ)
    if src is not None:
        env["PYTHONPATH"] = src
    code = ("import resource, sys; from batchfit.cli import main; sys.argv = ['batchfit'] + "
            "sys.argv[1:]\ntry:\n    main()\nexcept SystemExit:\n    pass\n"
            "print('RSS', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)")
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code, *arguments, "--json"], env=env,
                          capture_output=True, text=True, check=True)
    wall = time.perf_counter() - start
    lines = proc.stdout.strip().splitlines()
    rss = int(lines[-1].split()[1])
    answer = json.loads("\n".join(lines[:-1]))
    return {"seconds": wall, "max_rss_bytes": rss, "max_batch_size": answer["max_batch_size"],
            "traces": answer["traces"]}


def machine_reference() -> dict:
    loop = subprocess.run([sys.executable, "-c", _REFERENCE_LOOP], capture_output=True,
                          text=True, check=True)
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch"], check=True)
    return {"python_loop_s": float(loop.stdout.strip()),
            "import_torch_s": time.perf_counter() - start}


def time_cli(runs: int, compare_src: str | None) -> dict:
    """Each command ``runs`` times (and from ``compare_src``, interleaved), with the
    machine reference before each round."""
    out: dict = {"reference": [], "commands": {}}
    # Byte-compile both checkouts first, as `pip install` does: with
    # PYTHONDONTWRITEBYTECODE set (as on this machine) an editable checkout is otherwise
    # recompiled at every start (batchfit's modules: ~0.13 s).
    for src in (Path(__file__).parents[1] / "src", compare_src):
        if src is not None:
            subprocess.run([sys.executable, "-m", "compileall", "-q", str(src)], check=True)
    for name in CLI_COMMANDS:
        out["commands"][name] = {"this": [], "compared": [] if compare_src else None}
    for _ in range(runs):
        out["reference"].append(machine_reference())
        for name, arguments in CLI_COMMANDS.items():
            out["commands"][name]["this"].append(run_cli(arguments, None))
            if compare_src:
                out["commands"][name]["compared"].append(run_cli(arguments, compare_src))
    for name, entry in out["commands"].items():
        entry["median_s"] = statistics.median(r["seconds"] for r in entry["this"])
        entry["median_rss_bytes"] = statistics.median(r["max_rss_bytes"] for r in entry["this"])
        if entry["compared"]:
            entry["compared_median_s"] = statistics.median(r["seconds"]
                                                           for r in entry["compared"])
            entry["ratio_this_over_compared"] = entry["median_s"] / entry["compared_median_s"]
    out["reference_median"] = {
        key: statistics.median(r[key] for r in out["reference"])
        for key in ("python_loop_s", "import_torch_s")}
    out["compare_src"] = compare_src
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--skip-llama", action="store_true")
    parser.add_argument("--skip-cli", action="store_true")
    parser.add_argument("--skip-trace", action="store_true")
    parser.add_argument("--compare-src", default=None)
    args = parser.parse_args()
    result: dict = {}
    if not args.skip_cli:
        result["cli_max"] = cli = time_cli(args.runs, args.compare_src)
        ref = cli["reference_median"]
        print(f"machine reference: 10**7-step Python loop {ref['python_loop_s']:.2f} s, "
              f"import torch {ref['import_torch_s']:.2f} s")
        for name, entry in cli["commands"].items():
            line = (f"{name}: {entry['median_s']:.1f} s, peak RSS "
                    f"{entry['median_rss_bytes'] / 2**30:.2f} GiB (median of {args.runs}), "
                    f"answer {entry['this'][0]['max_batch_size']}")
            if entry.get("compared_median_s"):
                line += (f"; {args.compare_src}: {entry['compared_median_s']:.1f} s, ratio "
                         f"{entry['ratio_this_over_compared']:.2f}")
            print(line)
    if args.skip_trace:
        _write(result)
        return
    ours = time_batchfit(args.runs)
    theirs = time_memtracker(args.runs)
    result.update({
        "resnet50_b64_train": {
            "batchfit_seconds": ours, "memtracker_seconds": theirs,
            "batchfit_median_s": statistics.median(ours),
            "memtracker_median_s": statistics.median(theirs),
            "ratio_batchfit_over_memtracker": statistics.median(ours) / statistics.median(theirs),
        }
    })
    if not args.skip_llama:
        result["llama2_7b_seq4096_bf16_adamw"] = llama_7b()
    _write(result)
    r = result["resnet50_b64_train"]
    print(f"ResNet-50 B=64 trace: batchfit {r['batchfit_median_s']:.2f} s, MemTracker "
          f"{r['memtracker_median_s']:.2f} s (median of {args.runs}); "
          f"ratio {r['ratio_batchfit_over_memtracker']:.2f}")
    if "llama2_7b_seq4096_bf16_adamw" in result:
        ll = result["llama2_7b_seq4096_bf16_adamw"]
        print(f"Llama-2-7B seq 4096 bf16 AdamW on A100-80GB: {ll['seconds']:.1f} s, "
              f"peak RSS {ll['max_rss_bytes'] / 2**30:.2f} GiB, predicted "
              f"{ll['total_bytes'] / 2**30:.1f} GiB, {ll['parameters']:,} parameters")


def _write(result: dict) -> None:
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / "trace_speed.json"
    saved = json.loads(path.read_text()) if path.exists() else {}
    saved.update(result)  # a partial run (--skip-...) keeps the other sections
    path.write_text(json.dumps(saved, indent=2) + "\n")


if __name__ == "__main__":
    main()
