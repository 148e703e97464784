"""Wall time of `batchfit plan` for an 8B LLM over four layouts, run as a user runs it (a
fresh `batchfit` process, start-up included): issue 36's case, target <= 60 s.

How it asks batchfit: the ``batchfit plan`` command line in fresh processes (a speed
benchmark).

    batchfit plan hf:meta-llama/Meta-Llama-3-8B --gpus 8xH100 --global-batch 256
      --seq-len 2048 --strategies ddp,fsdp,zero2,zero3

Usage: nice python benchmarks/plan_speed.py [--runs 3] [--old-src DIR] [--case small]

``--old-src DIR``: also time an older checkout's ``src`` (e.g. ``git archive OLD src | tar -x
-C /tmp/old``, then ``--old-src /tmp/old/src``), alternating with this one in each round, and
check that both give the same plan (``differences``: the layout rows whose fields differ).
``--case small``: GPT-2 (124M) at 256 tokens instead. ``--ops``: instead of timing, count the
torch ops the plan's traces dispatch, in one process, for each source (a measure of the
plan's work that the machine's load does not move): benchmarks/results/plan_speed_8b_ops.json.
Writes benchmarks/results/plan_speed[_small].json (every run's wall and CPU seconds, their
medians and the load average before and after each run) and the same as a table (.md, for
the accuracy page), and prints a summary.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from llm_speed import RESULTS

CASES = {
    "8b": ["plan", "hf:meta-llama/Meta-Llama-3-8B", "--gpus", "8xH100", "--global-batch", "256",
           "--seq-len", "2048", "--strategies", "ddp,fsdp,zero2,zero3"],
    "small": ["plan", "hf:openai-community/gpt2", "--gpus", "8xH100", "--global-batch", "64",
              "--seq-len", "256", "--strategies", "ddp,fsdp,zero2,zero3"],
}
TARGET_S = 60.0
SRC = Path(__file__).parents[1] / "src"


def run_plan(arguments: list[str], src: Path) -> dict:
    """One plan in a fresh process importing batchfit from ``src``: seconds and its JSON."""
    code = ("import sys; from batchfit.cli import main; sys.argv = ['batchfit'] + sys.argv[1:]\n"
            "try:\n    main()\nexcept SystemExit:\n    pass\n")
    env = {**os.environ, "PYTHONPATH": str(src)}
    load = os.getloadavg()[0]
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code, *arguments, "--json"], env=env,
                          capture_output=True, text=True, check=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    # CPU seconds of the plan's process and its worker: on a machine shared with other
    # work, wall seconds measure the load as much as the plan
    cpu = (after.ru_utime - used.ru_utime) + (after.ru_stime - used.ru_stime)
    return {"seconds": round(wall, 2), "cpu_s": round(cpu, 2), "load_before": round(load, 2),
            "load_after": round(os.getloadavg()[0], 2), "answer": json.loads(proc.stdout)}


_COUNTING = """
import atexit, os, sys
from batchfit.engine import _torch_internals as ti
counted = [0]
dispatch = ti.OpInterceptor.__torch_dispatch__
def counting(self, func, types, args=(), kwargs=None):
    counted[0] += 1
    return dispatch(self, func, types, args, kwargs)
ti.OpInterceptor.__torch_dispatch__ = counting
atexit.register(lambda: os.write(2, f"\\nOPS_TRACED {counted[0]}\\n".encode()))
"""


def count_ops(arguments: list[str], src: Path) -> int:
    """The torch ops every trace of one plan dispatched (batchfit's interceptor sees each),
    traced in one process (``BATCHFIT_PARALLEL_TRACES=0``): the plan's work as a count,
    which no load on the machine moves."""
    code = (_COUNTING + "from batchfit.cli import main; sys.argv = ['batchfit'] + sys.argv[1:]\n"
            "try:\n    main()\nexcept SystemExit:\n    pass\n")
    env = {**os.environ, "PYTHONPATH": str(src), "BATCHFIT_PARALLEL_TRACES": "0"}
    proc = subprocess.run([sys.executable, "-c", code, *arguments, "--json"], env=env,
                          capture_output=True, text=True, check=True)
    return int(proc.stderr.rsplit("OPS_TRACED ", 1)[1].split()[0])


def _differences(old: dict | None, new: dict) -> list[dict]:
    """Each layout row whose fields differ between the old and the new plan: the fields,
    (old, new)."""
    if old is None:
        return []
    found = []
    for a, b in zip(old["layouts"], new["layouts"]):
        fields = {k: [a.get(k), b.get(k)] for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}
        if fields:
            found.append({"strategy": a["strategy"], "checkpointing": a["checkpointing"],
                          "fields": fields})
    return found


def markdown(out: dict, args: argparse.Namespace) -> str:
    """The result as the accuracy page shows it: each run's wall and CPU seconds with the
    load average around it, the medians against the target, and the older source's as
    the peer (same rounds, alternating)."""
    command = (f"python benchmarks/plan_speed.py --runs {args.runs}"
               f"{' --old-src DIR' if args.old_src else ''}"
               f"{f' --case {args.case}' if args.case != '8b' else ''}")
    lines = [(f"`{command}`: `batchfit {' '.join(out['argv'])}` in fresh processes, "
             "start-up included."), "",
             ("| source | runs: wall s (CPU s) [load average before-after] | median wall s "
             "| median CPU s | target | met | ratio to the old source |"),
             "|---|---|---|---|---|---|---|"]
    old = out["medians_s"].get("old")
    for name, runs in out["runs"].items():
        shown = ", ".join(f"{r['seconds']:.1f} ({r['cpu_s']:.0f}) "
                          f"[{r['load_before']:.1f}-{r['load_after']:.1f}]" for r in runs)
        median = out["medians_s"][name]
        target = f"<= {out['target_s']:.0f} s" if args.case == "8b" else "-"
        met = str(median <= out["target_s"]) if args.case == "8b" else ""
        ratio = f"{median / old:.2f}" if old and name != "old" else ""
        lines.append(f"| {name} | {shown} | {median:.1f} | {out['medians_cpu_s'][name]:.1f} "
                     f"| {target} | {met} | {ratio} |")
    if old is not None:
        lines += ["", f"Same plan from both sources: {out['same_answer']}."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--old-src", type=Path, default=None)
    parser.add_argument("--case", choices=sorted(CASES), default="8b")
    parser.add_argument("--ops", action="store_true",
                        help="count the ops the plan traces instead of timing it")
    args = parser.parse_args()
    argv = CASES[args.case]
    sources = {"new": SRC, **({"old": args.old_src} if args.old_src else {})}
    for src in sources.values():
        subprocess.run([sys.executable, "-m", "compileall", "-q", str(src)], check=True)
    if args.ops:
        ops = {name: count_ops(argv, src) for name, src in sources.items()}
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / f"plan_speed_{args.case}_ops.json").write_text(json.dumps(
            {"argv": argv, "ops_traced": ops}, indent=2) + "\n")
        print(f"plan {args.case}: ops traced {ops}")
        return
    runs: dict[str, list[dict]] = {name: [] for name in sources}
    for _ in range(args.runs):
        for name, src in sources.items():
            runs[name].append(run_plan(argv, src))
            print(name, {k: v for k, v in runs[name][-1].items() if k != "answer"}, flush=True)
    answers = {name: runs[name][0]["answer"] for name in sources}
    medians = {name: statistics.median(r["seconds"] for r in rs) for name, rs in runs.items()}
    cpu = {name: statistics.median(r["cpu_s"] for r in rs) for name, rs in runs.items()}
    out = {"argv": argv, "target_s": TARGET_S, "medians_s": medians, "medians_cpu_s": cpu,
           "same_answer": len({json.dumps(a, sort_keys=True) for a in answers.values()}) == 1,
           "differences": _differences(answers.get("old"), answers["new"]),
           "runs": {name: [{k: v for k, v in r.items() if k != "answer"} for r in rs]
                    for name, rs in runs.items()}, "answer": answers["new"]}
    RESULTS.mkdir(exist_ok=True)
    name = "plan_speed" if args.case == "8b" else f"plan_speed_{args.case}"
    (RESULTS / f"{name}.json").write_text(json.dumps(out, indent=2) + "\n")
    (RESULTS / f"{name}.md").write_text(markdown(out, args))
    print(f"plan {args.case}: medians {medians}, CPU {cpu} (target {TARGET_S:.0f} s for 8b), "
          f"same answer: {out['same_answer']}")


if __name__ == "__main__":
    main()
