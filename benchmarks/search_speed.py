"""Issue 35 item 10: where a CPU `batchfit search` spends its wall time, before and after.

How it asks batchfit: the ``batchfit search`` command line in a subprocess (a speed
benchmark).

Runs the command a user runs, ``batchfit search MODEL --device cpu --memory-cap CAP
--json``, in a subprocess with stderr piped, ``--repeats`` times per source tree, and
reads the phases from the command's own progress lines on stderr (one per trial, each
stamped with the seconds since the command's work began; ``batchfit/cli/progress.py``):

* ``startup_s``: from the process start to its first progress line (``import torch``,
  the model's module, the CLI);
* ``predict_s``: from there to the first trial's line (the zygote's start and the two
  traces of the prediction, with the first trial's steps);
* ``forked_s``: the forked trials (the bisection), to the last forked trial's line;
* ``settle_s``: the exec'd fresh interpreters that settle the answer, to the last line;
* ``wall_s``: the whole command; ``forked``/``exec``: trial counts.

Also ``python -c "import torch"`` timed alone (what each fresh interpreter pays first).

``--src DIR`` runs another source tree (e.g. ``git archive`` of the commit before a
change, unpacked): the results are keyed by ``--label``; ``--append`` adds to a label's
runs, so two trees can be run alternately (the machine's load then hits both alike).
Medians over the repeats.

Run: ``python benchmarks/search_speed.py --label after [--src src] [--repeats 3]
[--model benchmarks/max_vs_true_cpu.py:small_cnn] [--cap 1GiB]``. Writes (merging
labels) ``benchmarks/results/search_speed.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
LINE = re.compile(r"batchfit search \[ *([\d.]+) s\]: (.*)")
TRIAL = re.compile(r"batch (\d+) (fits|out of memory) \((trial|fresh interpreter),")


def run_search(src: Path, model: str, cap: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(src)}
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", "from batchfit.cli import main; main()", "search", model,
         "--device", "cpu", "--memory-cap", cap, "--json"],
        capture_output=True, text=True, env=env, cwd=ROOT, check=False)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"search failed ({done.returncode}): {done.stderr[-2000:]}")
    data = json.loads(done.stdout)
    stamps = [(float(m[1]), m[2]) for m in map(LINE.match, done.stderr.splitlines()) if m]
    trials = [(s, TRIAL.match(text)) for s, text in stamps if TRIAL.match(text)]
    forked = [s for s, m in trials if m[3] == "trial"]
    fresh = [s for s, m in trials if m[3] == "fresh interpreter"]
    work_s = stamps[-1][0] if stamps else None
    startup = wall - work_s if work_s is not None else None  # the lines count from the work
    return {
        "wall_s": wall, "startup_s": startup,
        "predict_s": trials[0][0] if trials else None,
        "forked_s": (forked[-1] - trials[0][0]) if forked else None,
        "settle_s": (fresh[-1] - (forked[-1] if forked else 0.0)) if fresh else 0.0,
        "forked": len(data["trials"]) - sum(t.get("process") == "exec" for t in data["trials"]),
        "exec": sum(t.get("process") == "exec" for t in data["trials"]),
        "answer": data["max_batch_size"], "recommended": data["recommended_batch_size"],
        "predicted": data["predicted_max_batch_size"],
        "boundary": data["boundary"],
        "trials": [(t["batch_size"], t["fits"], t.get("process")) for t in data["trials"]],
    }


def import_torch_s() -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch"], check=True)
    return time.perf_counter() - started


def median(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if r[key] is not None]
    return statistics.median(values) if values else None


def markdown(results: dict) -> str:
    lines = ["# `batchfit search` on the CPU: where the time goes (issue 35 item 10)", "",
             ("Medians over the repeats; produced by `benchmarks/search_speed.py` on the "
              "shared 2-core machine (load from other sessions varies)."), "",
             ("| label | model | cap | runs | wall s | startup s | predict s | forked s | "
              "settle s | forked trials | exec trials | answers | boundary (last run) |"),
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for label, entry in results.items():
        rows = entry["runs"]
        cells = {key: median(rows, key) for key in ("wall_s", "startup_s", "predict_s",
                                                     "forked_s", "settle_s", "forked", "exec")}
        shown = {key: "-" if value is None else f"{value:.1f}" for key, value in cells.items()}
        boundary = ", ".join(f"{b['batch_size']}: {b['fits']}/{b['runs']}"
                             for b in rows[-1]["boundary"])
        lines.append(f"| {label} | {entry['model']} | {entry['cap']} | {len(rows)} | "
                     f"{shown['wall_s']} | {shown['startup_s']} | {shown['predict_s']} | "
                     f"{shown['forked_s']} | {shown['settle_s']} | {shown['forked']} | "
                     f"{shown['exec']} | {', '.join(str(r['answer']) for r in rows)} | "
                     f"{boundary} |")
    torch_s = [e["import_torch_s"] for e in results.values() if e.get("import_torch_s")]
    if torch_s:
        lines += ["", (f"`python -c 'import torch'` alone: {statistics.median(torch_s):.1f} s "
                       "(median of the labels' measurements).")]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--label", required=True)
    parser.add_argument("--src", default=str(ROOT / "src"))
    parser.add_argument("--model", default="benchmarks/max_vs_true_cpu.py:small_cnn")
    parser.add_argument("--cap", default="1GiB")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--append", action="store_true",
                        help="add to the label's runs (to interleave labels run by run)")
    args = parser.parse_args()
    runs = []
    for i in range(args.repeats):
        runs.append(run_search(Path(args.src), args.model, args.cap))
        print(f"{args.label} run {i + 1}: {runs[-1]['wall_s']:.1f} s, answer "
              f"{runs[-1]['answer']}, {runs[-1]['forked']} forked + {runs[-1]['exec']} exec",
              flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / "search_speed.json"
    results = json.loads(path.read_text()) if path.exists() else {}
    if args.append and args.label in results:  # interleaved labels: one run at a time
        runs = results[args.label]["runs"] + runs
    results[args.label] = {"model": args.model, "cap": args.cap, "runs": runs,
                           "import_torch_s": import_torch_s()}
    path.write_text(json.dumps(results, indent=2) + "\n")
    (RESULTS / "search_speed.md").write_text(markdown(results))


if __name__ == "__main__":
    main()
