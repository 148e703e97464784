"""Issue 3's end-to-end check: ``batchfit max --device cpu --memory BUDGET`` against the true
maximum on a capped CPU, for a small CNN, a timm model and a small transformer.

How it asks batchfit: ``batchfit max SPEC --device cpu --memory BUDGET --json`` (the CLI),
and ``batchfit.estimate(SPEC, B, device="cpu", ...)`` for the budget's state and the live
bytes.

The device (DESIGN.md §4): a fresh ``python -c`` process builds the model and AdamW, runs
one training step at batch 1, frees that step's gradients and batch, reads its
``VmData`` and sets ``RLIMIT_DATA`` to ``VmData + CAP``; then it runs 2 steps at batch B.
B fits when no step raises the CPU allocator's (or oneDNN's) out-of-memory error. Every
process runs with glibc's mmap threshold pinned at 128 KiB (``MALLOC_MMAP_THRESHOLD_``,
see :mod:`batchfit.realrun.search` for why: unpinned, the outcome near the cap is random) and
``OMP_NUM_THREADS=1`` (this 2-core machine is shared; one thread keeps step times steady).

The true maximum: bisection over B with one fresh process per B (this file's own child
code, independent of :mod:`batchfit.realrun.trial`); then the boundary B and B+1 are re-run to
three fresh processes each: the truth is the largest B that fitted in every run (a B+1
that fitted in some runs is reported as flaky), and B-1 and B+2 are checked once.

The budget that corresponds to the cap: the cap is what the step may use *beyond* the
process's state after warm-up; the CPU prediction counts live tensor bytes including
that state. So ``--memory = state + CAP``, with state = parameters + buffers + optimizer
state as the trace counts them (the batch-1 estimate's categories).

What the live tensors do not show: the process uses more than its live tensors, mostly
the runtime's first-use cost at a new batch shape (oneDNN's primitive cache, MKL's
buffers; :mod:`batchfit.realrun.cpu_overhead`). ``batchfit max --device cpu`` measures it with
one real step at batch 2 in a fresh process; the table also shows the answer without
it (``--overhead 0``), and the overhead measured afterwards at the true maximum and at
half of it (a fresh capped trial through :func:`batchfit.realrun.trial_server.run_trial_subprocess`:
growth of the data segment minus growth of live tensors), fitted as
``fixed + per_sample * B``, to show that it barely depends on the batch.

Run: ``python benchmarks/max_vs_true_cpu.py [--models cnn,resnet18,gpt2-tiny]
[--flakiness]``. Writes ``benchmarks/results/max_vs_true_cpu.{md,json}``; takes ~8 min here.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
MIB = 1 << 20
STEPS = 2
OPTIMIZER = "adamw"
DEVICE_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072", "OMP_NUM_THREADS": "1"}

#: name -> how to build it (as resolve_model takes it) and the cap of the device.
MODELS = {
    "cnn": {"spec": "benchmarks/max_vs_true_cpu.py:small_cnn", "cap": 128 * MIB},
    "resnet18": {"spec": "timm:resnet18", "input_shape": [3, 64, 64], "cap": 128 * MIB},
    "gpt2-tiny": {"spec": "hf:gpt2", "seq_len": 64, "cap": 128 * MIB,
                  "model_kwargs": {"n_layer": 2, "n_embd": 128, "n_head": 4,
                                   "vocab_size": 2048, "bos_token_id": 0, "eos_token_id": 0}},
}


def small_cnn():
    """Four 3x3 convolutions on 3x64x64 images (a model for the file:factory spec)."""
    from torch import nn

    from batchfit import TensorSpec

    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))
    return model, TensorSpec((3, 64, 64))


def resolve(name: str):
    from batchfit.models.resolve import resolve_model

    entry = MODELS[name]
    shape = entry.get("input_shape")
    return resolve_model(entry["spec"], model_kwargs=entry.get("model_kwargs"),
                         seq_len=entry.get("seq_len"),
                         input_shape=tuple(shape) if shape else None)


def device_env(pinned: bool = True) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("MALLOC_MMAP_THRESHOLD_", None)
    if pinned:
        env.update(DEVICE_ENV)
    return env


# --------------------------------------------------------------------------- the truth

#: The fresh process of one truth check; deliberately not batchfit.realrun.trial's code.
TRUTH_CHILD = r"""
import gc, json, resource, sys, time
args = json.loads(sys.argv[1])
import torch
from batchfit.models.resolve import resolve_model
from batchfit.engine.spec import TrainConfig
from batchfit.engine.step import StepRunner, make_batch

def vm_data():
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmData:"):
                return int(line.split()[1]) * 1024

shape = args.get("input_shape")
spec = resolve_model(args["spec"], model_kwargs=args.get("model_kwargs"),
                     seq_len=args.get("seq_len"), input_shape=tuple(shape) if shape else None)
torch.manual_seed(0)
model = spec.factory()
config = TrainConfig(optimizer=args["optimizer"], loss_fn=spec.loss_fn)
generator = torch.Generator().manual_seed(0)
runner = StepRunner(model, config, make_batch(spec.input_spec, 1, None, generator),
                    foreach=False, generator=generator)
runner.train_step()
runner.optimizer.zero_grad(set_to_none=True)
runner.batch = None
gc.collect()
base = vm_data()
_, hard = resource.getrlimit(resource.RLIMIT_DATA)
resource.setrlimit(resource.RLIMIT_DATA, (base + args["cap"], hard))
start = time.perf_counter()
try:
    runner.batch = make_batch(spec.input_spec, args["batch_size"], None, generator)
    for _ in range(args["steps"]):
        runner.train_step()
    fits, error = True, ""
except (RuntimeError, MemoryError) as exc:
    text = str(exc)
    if not (isinstance(exc, MemoryError) or "can't allocate memory" in text
            or "could not create a primitive" in text):
        raise
    fits, error = False, text.splitlines()[0][:160]
print(json.dumps({"batch_size": args["batch_size"], "fits": fits, "error": error,
                  "seconds": time.perf_counter() - start}))
"""


def fresh_trial(name: str, batch_size: int, cap: int, *, pinned: bool = True) -> dict:
    """One fresh ``python -c`` process at ``batch_size`` under ``cap``."""
    entry = MODELS[name]
    args = {k: entry[k] for k in ("spec", "model_kwargs", "seq_len", "input_shape") if k in entry}
    args.update(batch_size=batch_size, cap=cap, steps=STEPS, optimizer=OPTIMIZER)
    done = subprocess.run([sys.executable, "-c", TRUTH_CHILD, json.dumps(args)], cwd=ROOT,
                          env=device_env(pinned), capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"truth run failed for {name} at {batch_size}:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


#: Fresh runs a batch needs, all fitting, to count as fitting (and that its successor gets).
REPEATS = 3


def true_maximum(name: str, cap: int, guess: int, log: list[dict], *,
                 pinned: bool = True) -> int:
    """The largest batch that fits in every one of ``REPEATS`` fresh processes.

    Bisection with one fresh process per batch size, then the boundary re-run: a batch
    that fails in any run does not count, and a successor that fits in some runs is
    recorded as flaky (``log`` holds every run). Then B-1 and B+2 are checked once.
    """
    runs: dict[int, list[bool]] = {}

    def fits(batch_size: int) -> bool:
        run = fresh_trial(name, batch_size, cap, pinned=pinned)
        log.append(run)
        runs.setdefault(batch_size, []).append(run["fits"])
        print(f"    fresh {name} B={batch_size}: {'fits' if run['fits'] else 'OOM'}", flush=True)
        return run["fits"]

    def first(batch_size: int) -> bool:
        return runs[batch_size][0] if batch_size in runs else fits(batch_size)

    lo, hi = max(1, guess // 2), max(2, 2 * guess)
    while not first(lo):
        lo, hi = max(1, lo // 2), lo
        if lo == 1 and not first(1):
            return 0
    while first(hi):
        lo, hi = hi, 2 * hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if first(mid):
            lo = mid
        else:
            hi = mid
    def fits_every_time(batch_size: int) -> bool:
        while len(runs.get(batch_size, [])) < REPEATS:
            fits(batch_size)
        return all(runs[batch_size])

    while lo >= 1 and not fits_every_time(lo):
        lo -= 1  # it failed in some fresh process: the truth is below
    while fits_every_time(lo + 1):  # never happens when fits() is repeatable
        lo += 1
    for neighbour in (lo - 1, lo + 2):  # local monotonicity around the boundary
        if neighbour >= 1 and first(neighbour) != (neighbour < lo):
            if not pinned:  # expected there: the point of the flakiness check
                return lo
            raise RuntimeError(f"{name}: fits({neighbour}) is not monotone around {lo}")
    return lo


def flaky_batches(log: list[dict]) -> dict[int, list[bool]]:
    """Batch sizes that fitted in some fresh runs and not in others."""
    outcomes: dict[int, list[bool]] = {}
    for run in log:
        outcomes.setdefault(run["batch_size"], []).append(run["fits"])
    return {b: o for b, o in sorted(outcomes.items()) if len(set(o)) > 1}


# --------------------------------------------------------------------------- prediction


def user_words(name: str) -> dict:
    """The options a user gives for ``name``, as the public API's keywords (the CLI's flags
    in :func:`cli_prediction`)."""
    entry = MODELS[name]
    words = {"optimizer": OPTIMIZER, "device": "cpu", "seq_len": entry.get("seq_len"),
             "model_kwargs": entry.get("model_kwargs")}
    if "input_shape" in entry:
        words["input_shape"] = "x".join(map(str, entry["input_shape"]))
    return words


def state_bytes(name: str) -> int:
    """Parameters + buffers + optimizer state, as the trace counts them
    (``batchfit.estimate(SPEC, 1, device="cpu", ...)``)."""
    import batchfit

    est = batchfit.estimate(MODELS[name]["spec"], 1, **user_words(name))
    return sum(est.by_category.get(c, 0) for c in (batchfit.Category.PARAMETERS,
                                                   batchfit.Category.BUFFERS,
                                                   batchfit.Category.OPTIMIZER_STATE))


def cli_prediction(name: str, budget: int, *extra: str) -> dict:
    """``batchfit max --device cpu --memory BUDGET --json`` as a user would run it."""
    entry = MODELS[name]
    command = [str(Path(sys.executable).with_name("batchfit")), "max", entry["spec"],
               "--device", "cpu", "--memory", str(budget), "--optimizer", OPTIMIZER, "--json",
               *extra]
    if "input_shape" in entry:
        command += ["--input", "x".join(map(str, entry["input_shape"]))]
    if "seq_len" in entry:
        command += ["--seq-len", str(entry["seq_len"])]
    for key, value in entry.get("model_kwargs", {}).items():
        command += ["--model-kwargs", f"{key}={value}"]
    start = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"batchfit max failed for {name}: {done.stderr[-1000:]}")
    data = json.loads(done.stdout)
    data["wall_s"] = time.perf_counter() - start
    return data


def live_prediction(name: str, batch_size: int) -> int:
    import batchfit

    return batchfit.estimate(MODELS[name]["spec"], batch_size,
                             **user_words(name)).peak_allocated_bytes


def trial_server(name: str):
    """A zygote for ``name`` that imports what a fresh process for it imports."""
    from batchfit.realrun.trial_server import TrialServer, preloads_for

    return TrialServer(preloads_for(resolve(name).factory), env=device_env())


def measured_overhead(name: str, cap: int, batch_sizes: list[int]) -> list[dict]:
    """Capped fresh trials: data segment growth vs live tensor growth."""
    from batchfit.realrun.trial_server import run_trial_subprocess

    spec = resolve(name)
    rows = []
    with trial_server(name) as server:
        trials = [run_trial_subprocess(spec, None, batch_size, optimizer=OPTIMIZER,
                                       cap_bytes=cap, steps=STEPS, server=server)
                  for batch_size in batch_sizes]
    for batch_size, trial in zip(batch_sizes, trials):
        if not trial.fits:
            raise RuntimeError(f"{name}: B={batch_size} did not fit in the overhead run")
        live = trial.peak_bytes - trial.baseline_bytes
        rows.append({"batch_size": batch_size, "used_bytes": trial.used_bytes,
                     "live_growth_bytes": live, "overhead_bytes": trial.used_bytes - live,
                     "peak_bytes": trial.peak_bytes, "baseline_bytes": trial.baseline_bytes,
                     "predicted_peak_bytes": live_prediction(name, batch_size)})
    return rows


# --------------------------------------------------------------------------- report


def check_model(name: str) -> dict:
    cap = MODELS[name]["cap"]
    print(f"== {name}: cap {cap / MIB:.0f} MiB", flush=True)
    state = state_bytes(name)
    budget = state + cap
    cli = cli_prediction(name, budget)
    predicted = cli["max_batch_size"]
    live_only = cli_prediction(name, budget, "--overhead", "0")["max_batch_size"]
    print(f"  state {state / MIB:.2f} MiB, --memory {budget} -> predicted {predicted} "
          f"(runtime overhead {cli['device']['context_bytes'] / MIB:.2f} MiB; without it "
          f"{live_only})", flush=True)
    runs: list[dict] = []
    start = time.perf_counter()
    truth = true_maximum(name, cap, predicted, runs)
    truth_s = time.perf_counter() - start
    overhead = measured_overhead(name, cap, [max(1, truth // 2), truth])
    (b0, o0), (b1, o1) = [(r["batch_size"], r["overhead_bytes"]) for r in overhead]
    per_sample = (o1 - o0) / (b1 - b0) if b1 != b0 else 0.0
    fixed = o1 - per_sample * b1
    at_max = overhead[-1]
    row = {
        "model": name, "spec": MODELS[name]["spec"], "cap_bytes": cap, "state_bytes": state,
        "budget_bytes": budget, "predicted": predicted, "true_max": truth,
        "error_pct": 100.0 * (predicted - truth) / truth if truth else None,
        "measured_runtime_overhead_bytes": cli["device"]["context_bytes"],
        "predicted_without_overhead": live_only,
        "cli_wall_s": round(cli["wall_s"], 2), "cli_traces": cli.get("traces"),
        "measured_state_bytes": at_max["baseline_bytes"],
        "live_peak_at_true_max": {"predicted": at_max["predicted_peak_bytes"],
                                  "measured": at_max["peak_bytes"]},
        "overhead": overhead,
        "overhead_fit": {"fixed_bytes": fixed, "per_sample_bytes": per_sample},
        "overhead_at_max_pct_of_cap": 100.0 * at_max["overhead_bytes"] / cap,
        "fresh_runs": runs, "truth_s": round(truth_s, 1),
        "flaky": {str(b): o for b, o in flaky_batches(runs).items()},
    }
    print(f"  true max {truth} ({len(runs)} fresh runs, {truth_s:.0f} s); overhead at max "
          f"{at_max['overhead_bytes'] / MIB:.2f} MiB",
          flush=True)
    return row


def flakiness(name: str, guess: int, cap: int, repeats: int = 2) -> list[dict]:
    """Fresh processes with glibc's default (dynamic) mmap threshold: a bisection finds
    one boundary, then each batch around it runs ``repeats`` more times."""
    center = true_maximum(name, cap, guess, [], pinned=False)
    rows = []
    for batch_size in range(max(1, center - 3), center + 4):
        outcomes = [fresh_trial(name, batch_size, cap, pinned=False)["fits"]
                    for _ in range(repeats)]
        rows.append({"batch_size": batch_size, "fits": outcomes})
        print(f"    unpinned {name} B={batch_size}: {outcomes}", flush=True)
    return rows


def markdown(rows: list[dict], flaky: dict | None) -> str:
    lines = [
        "# `batchfit max --device cpu` vs the true maximum on a capped CPU",
        "",
        (f"Device: fresh process, AdamW, {STEPS} steps after a warm-up at batch 1, "
         "`RLIMIT_DATA` = VmData + cap, `MALLOC_MMAP_THRESHOLD_=131072`, `OMP_NUM_THREADS=1`. "
         "Budget `--memory` = state (parameters + buffers + AdamW state) + cap."),
        "",
        ("`batchfit max` measures the CPU runtime's overhead (oneDNN primitive cache, MKL "
         "buffers) with one real step at batch 2 in a fresh process "
         "(`batchfit.realrun.cpu_overhead`); `--overhead 0` shows the answer from live tensors only. "
         "The overhead at the true maximum and its fit are measured afterwards, for comparison."),
        "",
        ("| model | cap MiB | state MiB | `--memory` B | predicted | true max | error | "
         "measured overhead (batch 2) MiB | without overhead | "
         "peak at max MiB: predicted (kernel scratch incl.) / live tensors measured | overhead at max MiB (% cap) | "
         "overhead fit: fixed MiB + KiB/sample | flaky (fits in runs) |"),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        live = r["live_peak_at_true_max"]
        fit = r["overhead_fit"]
        at_max = r["overhead"][-1]["overhead_bytes"]
        lines.append(
            f"| {r['model']} | {r['cap_bytes'] / MIB:.0f} | {r['state_bytes'] / MIB:.2f} | "
            f"{r['budget_bytes']} | {r['predicted']} | {r['true_max']} | "
            f"{r['error_pct']:+.1f}% | {r['measured_runtime_overhead_bytes'] / MIB:.2f} | "
            f"{r['predicted_without_overhead']} | {live['predicted'] / MIB:.1f} / "
            f"{live['measured'] / MIB:.1f} | {at_max / MIB:.2f} "
            f"({r['overhead_at_max_pct_of_cap']:.1f}%) | {fit['fixed_bytes'] / MIB:.2f} + "
            f"{fit['per_sample_bytes'] / 1024:.1f} | "
            + (", ".join(f"{b}: {sum(o)}/{len(o)}" for b, o in r.get("flaky", {}).items())
               or "none") + " |")
    ok = all(0 <= r["true_max"] - r["predicted"] <= 0.03 * r["true_max"] for r in rows)
    verdict = "met" if ok else "NOT met"
    lines += ["", f"Target (within 3% of the true maximum, never above): {verdict} for "
              f"{len(rows)} models."]
    if flaky:
        lines += ["", "Unpinned mmap threshold (glibc default), fresh processes around an "
                  f"unpinned boundary of `{flaky['model']}` (cap "
                  f"{flaky['cap_bytes'] / MIB:.0f} MiB):", "",
                  "| batch | fits (repeats) |", "|---|---|"]
        lines += [f"| {f['batch_size']} | {f['fits']} |" for f in flaky["rows"]]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--flakiness", action="store_true",
                        help="also run unpinned fresh processes around the first boundary")
    args = parser.parse_args()
    os.environ.update(DEVICE_ENV)  # this process's zygote for the overhead runs
    sys.path.insert(0, str(ROOT))
    os.chdir(ROOT)
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    rows = [check_model(name) for name in names]
    flaky = None
    if args.flakiness:
        flaky = {"model": names[0], "cap_bytes": rows[0]["cap_bytes"],
                 "rows": flakiness(names[0], rows[0]["true_max"], rows[0]["cap_bytes"])}
    RESULTS.mkdir(parents=True, exist_ok=True)
    saved = RESULTS / "max_vs_true_cpu.json"
    if saved.exists():  # keep the rows of models not re-run this time
        old = json.loads(saved.read_text())
        rows = [r for r in old["rows"] if r["model"] not in names and r["model"] in MODELS] + rows
        rows.sort(key=lambda r: list(MODELS).index(r["model"]))
        if flaky is None and isinstance(old.get("flakiness"), dict):
            flaky = old["flakiness"]
    saved.write_text(json.dumps({"rows": rows, "flakiness": flaky}, indent=2) + "\n")
    text = markdown(rows, flaky)
    (RESULTS / "max_vs_true_cpu.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
