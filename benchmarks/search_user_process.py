"""Issue 14's check of the capped-CPU search: does it answer for the user's own process?

How it asks batchfit: ``batchfit.search_max_batch(SPEC, device="cpu", memory_cap=CAP,
steps_per_trial=2, optimizer="adamw", ...)`` with the model's spec string and the options a
user gives (``max_vs_true_cpu.user_words``), as ``batchfit search SPEC --device cpu
--memory-cap CAP`` asks it; the truth is ``max_vs_true_cpu.py``'s child code in plain
processes.

The device (DESIGN.md section 4): a process builds the model and AdamW, runs one training
step at batch 1, frees that step's gradients and batch, sets ``RLIMIT_DATA`` = VmData +
cap, then runs 2 steps at batch B. The truth is a **plain** fresh ``python -c`` process
with torch's defaults: no ``MALLOC_MMAP_THRESHOLD_``, no ``OMP_NUM_THREADS`` (the CPU's
threads), what a user's training script is (``max_vs_true_cpu.py``'s child code, run in
that plain environment). The largest batch that fits in every one of 3 such processes is
the true maximum; a batch above it that fits in some is reported as flaky (k of 3).

For each model: the truth; then ``batchfit.search_max_batch(SPEC, device="cpu",
memory_cap=CAP)`` with its defaults (the caller's threads and allocator, the answer run in
3 fresh processes) ``--repeats`` times, each a whole call as a user makes it (its trial
server started and stopped inside, so its wall time includes that start-up; before the
words form, the searches shared one running server); its recommended batch
re-run in 3 plain processes (it must never fail); and Lightning's
``scale_batch_size(mode="binsearch", steps_per_trial=2)`` in one plain capped process, its
finder call timed as ``search_vs_peers.py`` times it. Wall times are medians.

The search's answer is settled in exec'd fresh interpreters with the server's (plain)
environment (:mod:`batchfit.realrun.fresh`); its bisection forks from the zygote.

A plain process is a random device (``cpu_peak_spread.py``: its hash seed, address layout
and thread interleaving draw the heap's layout), so "the largest batch fitting 3 of 3" is
itself a draw, and two draws need not agree. ``--fractions M`` measures the statistic that
is well defined instead: per batch, the fraction of M plain processes it fits in, at each
search's answer, the batch above it and its recommended batch
(``benchmarks/results/search_fit_fraction.{md,json}``).

Run: ``python benchmarks/search_user_process.py [--models cnn,gpt2-tiny,resnet18]
[--repeats 3] [--lightning-repeats N] [--fractions M]``. Writes
``benchmarks/results/search_user_process.{md,json}``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import max_vs_true_cpu as device
import search_vs_peers as peers

RESULTS = device.RESULTS


def plain_env() -> dict[str, str]:
    """The user's process: this environment less anything batchfit's benchmarks set."""
    env = dict(os.environ)
    env.pop("MALLOC_MMAP_THRESHOLD_", None)
    env.pop("OMP_NUM_THREADS", None)
    return env


def plain_trial(name: str, batch_size: int, cap: int) -> dict:
    entry = device.MODELS[name]
    args = {k: entry[k] for k in ("spec", "model_kwargs", "seq_len", "input_shape") if k in entry}
    args.update(batch_size=batch_size, cap=cap, steps=device.STEPS, optimizer=device.OPTIMIZER)
    done = subprocess.run([sys.executable, "-c", device.TRUTH_CHILD, json.dumps(args)],
                          cwd=device.ROOT, env=plain_env(), capture_output=True, text=True,
                          check=False)
    if done.returncode != 0:
        raise RuntimeError(f"plain run failed for {name} at {batch_size}:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def true_maximum(name: str, cap: int, guess: int) -> tuple[int, dict[int, list[bool]]]:
    """Bisection with one plain process per batch, then the boundary to 3 runs each."""
    runs: dict[int, list[bool]] = {}

    def run(batch_size: int) -> bool:
        fits = plain_trial(name, batch_size, cap)["fits"]
        runs.setdefault(batch_size, []).append(fits)
        print(f"    plain {name} B={batch_size}: {'fits' if fits else 'OOM'}", flush=True)
        return fits

    def first(batch_size: int) -> bool:
        return runs[batch_size][0] if batch_size in runs else run(batch_size)

    lo, hi = max(1, guess // 2), max(2, 2 * guess)
    while not first(lo):
        lo, hi = max(1, lo // 2), lo
    while first(hi):
        lo, hi = hi, 2 * hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if first(mid) else (lo, mid)

    def every_time(batch_size: int) -> bool:
        while len(runs.setdefault(batch_size, [])) < 3 and all(runs[batch_size]):
            run(batch_size)
        return all(runs[batch_size])

    while lo > 1 and not every_time(lo):
        lo -= 1
    while len(runs.setdefault(lo + 1, [])) < 3:  # the flakiness above the truth
        run(lo + 1)
    if all(runs[lo + 1]):  # it fits every time after all: the truth is higher
        return true_maximum(name, cap, lo + 1)
    return lo, runs


def run_search(name: str, cap: int) -> dict:
    """``batchfit search SPEC --device cpu --memory-cap CAP`` in the library's words."""
    import batchfit

    start = time.perf_counter()
    result = batchfit.search_max_batch(device.MODELS[name]["spec"], memory_cap=cap,
                                       steps_per_trial=device.STEPS, **device.user_words(name))
    return {"answer": result.max_batch_size, "recommended": result.recommended_batch_size,
            "wall_s": time.perf_counter() - start, "trials": len(result.trials),
            "boundary": [list(b) for b in result.boundary]}


def run_lightning(name: str, cap: int) -> dict:
    payload = json.dumps({"method": "lightning-binsearch", "model": name, "cap": cap})
    done = subprocess.run([sys.executable, peers.__file__, "--peer", payload],
                          cwd=device.ROOT, env=plain_env(), capture_output=True, text=True,
                          check=False)
    if done.returncode != 0:
        return {"answer": None, "wall_s": None, "trials": 0,
                "error": (done.stderr.strip().splitlines() or ["?"])[-1][:200]}
    data = json.loads(done.stdout.strip().splitlines()[-1])
    data["trials"] = len(data.get("trials", []))
    return data


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="cnn,gpt2-tiny,resnet18")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--lightning-repeats", type=int, default=None,
                        help="Lightning binsearch runs per model (default: --repeats)")
    parser.add_argument("--fractions", type=int, default=0, metavar="M",
                        help="instead of the 3-of-3 truth's bisection, run M plain processes "
                             "at each search's answer, the batch above it and its recommended "
                             "batch: the fit fraction the user's process has there")
    args = parser.parse_args()
    if args.fractions:
        return fractions_main(args)
    os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
    os.environ.pop("OMP_NUM_THREADS", None)
    rows = []
    for name in args.models.split(","):
        cap = device.MODELS[name]["cap"]
        print(f"{name}: cap {cap >> 20} MiB", flush=True)
        searches = []
        for _ in range(args.repeats):
            searches.append(run_search(name, cap))
            print(f"  search: {searches[-1]}", flush=True)
        truth, runs = true_maximum(name, cap, searches[0]["answer"])
        recommended = {r["recommended"] for r in searches}
        rec_runs = {b: [plain_trial(name, b, cap)["fits"] for _ in range(3)] for b in recommended}
        lightning = [run_lightning(name, cap) for _ in range(
            args.repeats if args.lightning_repeats is None else args.lightning_repeats)]
        print(f"  truth {truth}; lightning {lightning}", flush=True)
        walls = [s["wall_s"] for s in searches]
        lwalls = [r["wall_s"] for r in lightning if r["wall_s"] is not None]
        rows.append({
            "model": name, "cap_mib": cap >> 20, "truth": truth,
            "flaky": {str(b): f"{sum(v)}/{len(v)}" for b, v in sorted(runs.items())
                      if b > truth and 0 < sum(v)},
            "answers": [s["answer"] for s in searches],
            "correct": sum(s["answer"] == truth for s in searches),
            "recommended_fit": {str(b): f"{sum(v)}/{len(v)}" for b, v in rec_runs.items()},
            "search_trials": [s["trials"] for s in searches],
            "search_wall_s": statistics.median(walls),
            "lightning_answers": [r["answer"] for r in lightning],
            "lightning_trials": [r["trials"] for r in lightning],
            "lightning_wall_s": statistics.median(lwalls) if lwalls else None,
            "ratio": (statistics.median(walls) / statistics.median(lwalls)) if lwalls else None,
            "boundaries": [s["boundary"] for s in searches],
        })
        write_results(rows[-1], args.repeats)


def fractions_main(args) -> None:
    """The statistic a noisy device allows: per batch, the fraction of plain processes in
    which it fits (``cpu_peak_spread.py`` shows why it is not 0 or 1 near the cap)."""
    os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
    os.environ.pop("OMP_NUM_THREADS", None)
    path = RESULTS / "search_fit_fraction.json"
    rows = json.loads(path.read_text()) if path.exists() else []
    for name in args.models.split(","):
        cap = device.MODELS[name]["cap"]
        load = os.getloadavg()[0]
        searches = [run_search(name, cap) for _ in range(args.repeats)]
        print(f"{name}: searches {searches}", flush=True)
        batches = sorted({b for s in searches
                          for b in (s["answer"], s["answer"] + 1, s["recommended"])})
        truth = {}
        for b in batches:
            truth[b] = [plain_trial(name, b, cap)["fits"] for _ in range(args.fractions)]
            print(f"  plain B={b}: {sum(truth[b])}/{len(truth[b])}", flush=True)
        lightning = [run_lightning(name, cap) for _ in range(args.lightning_repeats or 0)]
        walls = [s["wall_s"] for s in searches]
        lwalls = [r["wall_s"] for r in lightning if r["wall_s"] is not None]
        row = {"model": name, "cap_mib": cap >> 20, "load_start": load,
               "load_end": os.getloadavg()[0], "searches": searches,
               "plain_fits": {str(b): f"{sum(v)}/{len(v)}" for b, v in truth.items()},
               "lightning": lightning,
               "ratio": (statistics.median(walls) / statistics.median(lwalls)) if lwalls else None}
        rows = [r for r in rows if r["model"] != name] + [row]
        path.write_text(json.dumps(rows, indent=2) + "\n")
        write_fractions_table(rows, args.fractions)


def write_fractions_table(rows: list[dict], runs: int) -> None:
    lines = ["# The capped-CPU search against the fit fraction of plain processes", "",
             (f"AdamW, {device.STEPS} steps per trial. Search: the library call in words, its "
              "own trial server started inside (bisection in forked trials, settled in 3 "
              "exec'd fresh "
              "interpreters: the largest batch fitting 3 of 3, and the batch above's k of 3). "
              f"Plain: {runs} plain `python -c` processes per batch (torch's defaults, no "
              "MALLOC_MMAP_THRESHOLD_, no OMP_NUM_THREADS), the fraction that fitted. Lightning: "
              "binsearch in one plain capped process, 2 steps per trial, its finder call timed."),
             "", ("| model | cap MiB | load | search answer (3/3), above k/3, recommended, wall s | "
                  "plain fits at answer / above / recommended | Lightning answer, wall s | "
                  "wall ratio |"), "|---|---|---|---|---|---|---|"]
    for r in rows:
        fits = r["plain_fits"]
        for i, s in enumerate(r["searches"]):
            above = next((f"{b[1]}/{b[2]}" for b in s["boundary"] if b[0] == s["answer"] + 1), "-")
            lt = ", ".join(
                (f"{x['answer']}, {x['wall_s']:.0f} s" if x["answer"] is not None else
                 f"crashed after {x['trials']} trials ({x.get('error', '')[:50]}), "
                 f"{x['wall_s']:.0f} s") if x["wall_s"] else f"failed: {x.get('error', '')[:60]}"
                for x in r["lightning"]) or "-"
            ratio = f"{r['ratio']:.2f}" if r["ratio"] and i == 0 else ""
            if ratio and all(x["answer"] is None for x in r["lightning"]):
                ratio += " (to Lightning's crash)"
            lines.append(
                f"| {r['model'] if i == 0 else ''} | {r['cap_mib']} | "
                f"{r['load_start']:.1f}-{r['load_end']:.1f} | {s['answer']}, {above}, "
                f"{s['recommended']}, {s['wall_s']:.0f} | {fits[str(s['answer'])]} / "
                f"{fits[str(s['answer'] + 1)]} / {fits[str(s['recommended'])]} | "
                f"{lt if i == 0 else ''} | {ratio} |")
    (RESULTS / "search_fit_fraction.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def write_results(row: dict, repeats: int) -> None:
    """Merge ``row`` into the results (one row per model, so models can run in separate
    processes, each writing as it finishes), then rewrite the table from all rows."""
    import fcntl

    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / "search_user_process.json"
    with open(RESULTS / ".search_user_process.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        rows = json.loads(path.read_text()) if path.exists() else []
        rows = [r for r in rows if r["model"] != row["model"]] + [row]
        order = list(device.MODELS)
        rows.sort(key=lambda r: order.index(r["model"]) if r["model"] in order else len(order))
        path.write_text(json.dumps(rows, indent=2) + "\n")
        write_table(rows, repeats)


def write_table(rows: list[dict], repeats: int) -> None:
    lines = ["# The capped-CPU search against a plain fresh process (torch's defaults)", "",
             (f"AdamW, {device.STEPS} steps per trial; truth: the largest batch that fits in 3 "
              "of 3 plain `python -c` processes (no MALLOC_MMAP_THRESHOLD_, no OMP_NUM_THREADS); "
              f"batchfit's search with its defaults, {repeats} whole library calls in words "
              "(each starts its own trial server; bisection in forked trials, the answer "
              "settled in exec'd fresh "
              "interpreters); Lightning binsearch in one plain capped process (finder call "
              "timed)."), "",
             ("| model | cap MiB | truth | flaky above (fits/runs) | batchfit answers | correct | "
              "recommended fits (plain) | trials | wall s | Lightning answers | "
              "Lightning trials | Lightning wall s | wall ratio |"), "|" + "---|" * 13]
    for r in rows:
        if "correct" not in r:  # a row assembled from a stopped run's log: no truth yet
            so_far = ", ".join(f"{b}: {k}" for b, k in r.get("plain_runs", {}).items())
            lines.append(f"| {r['model']} | {r['cap_mib']} | not finished (plain runs so far: "
                         f"{so_far or '-'}) | - | {', '.join(map(str, r['answers']))} | - | - | "
                         "- | - | - | - | - | - |")
            continue
        ratio = f"{r['ratio']:.2f}" if r["ratio"] else "-"
        lwall = f"{r['lightning_wall_s']:.1f}" if r["lightning_wall_s"] else "-"
        lines.append(
            f"| {r['model']} | {r['cap_mib']} | {r['truth']} | {r['flaky'] or 'none'} | "
            f"{', '.join(map(str, r['answers']))} | {r['correct']}/{len(r['answers'])} | "
            f"{r['recommended_fit']} | {', '.join(map(str, r['search_trials']))} | "
            f"{r['search_wall_s']:.1f} | {r['lightning_answers']} | {r['lightning_trials']} | "
            f"{lwall} | {ratio} |")
    (RESULTS / "search_user_process.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
