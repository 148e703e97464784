"""Issue 4's benchmark: batchfit's real-device search against Lightning's batch-size finder
(power and binsearch) and accelerate's ``find_executable_batch_size``, on a capped CPU.

How it asks batchfit: ``search_max_batch(..., device="cpu", memory_cap_bytes=CAP)`` as a
library user runs the real search (a speed and trial-count harness).

Same device for everyone (see ``max_vs_true_cpu.py``): AdamW, 2 steps per trial, each
method's process built the model and ran one warm-up step at batch 1, then
``RLIMIT_DATA`` = VmData + cap; glibc's mmap threshold pinned, ``OMP_NUM_THREADS=1``.

* batchfit: ``search_max_batch(..., device="cpu", memory_cap_bytes=cap)``: it traces the
  prediction, forks a template from its zygote (a fresh interpreter that imported torch
  and the model's library) that builds the model and warms up, and forks one capped
  child per trial from the template. Three starting points, each timed from the call:
  **cold**, in a fresh process (its zygote's start, the template's build and the
  prediction's first traces included); **warm**, with a running zygote (what a sweep
  over configs pays per search: the template and the prediction); **hot**, the same
  search again on that server, the template kept: the peers' starting point (torch
  imported, model built and warmed up, ``torch._dynamo`` imported by the optimizer).
* Lightning: ``Tuner(trainer).scale_batch_size(module, mode=..., steps_per_trial=2,
  init_val=2)`` in one capped process (its defaults otherwise: binsearch keeps a 5% margin).
* accelerate: ``find_executable_batch_size(starting_batch_size=128)`` (its default) around
  2 training steps, in one capped process.

Peers' wall time is the finder call only (their imports, model build and warm-up are not
counted). Lightning's trials are read from its ``train_dataloader()`` calls, one per
trial, plus the one or two resets after the search (restoring the found size), which
are listed (and counted) too. The true maximum comes from
``benchmarks/results/max_vs_true_cpu.json`` (fresh processes, one per batch size) when it
is there for the same model and cap, else it is recomputed. Every method runs
``--repeats`` times (timings on this shared 2-core machine vary by 2x; the tables show
medians). Writes ``benchmarks/results/search_vs_peers.{md,json}``.

Run: ``python benchmarks/search_vs_peers.py [--models cnn,resnet18,gpt2-tiny]
[--repeats 3]``; ~25 min here with 3 repeats.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import max_vs_true_cpu as device

PEERS = ("lightning-power", "lightning-binsearch", "accelerate")
ACCELERATE_START = 128


# --------------------------------------------------------------------------- peers (child side)


def _capped_runner(name: str, cap: int):
    """Build, warm up at batch 1, cap: the same start as every batchfit trial."""
    import gc
    import resource

    import torch

    from batchfit.engine.spec import TrainConfig
    from batchfit.engine.step import StepRunner, make_batch

    spec = device.resolve(name)
    torch.manual_seed(0)
    model = spec.factory()
    config = TrainConfig(optimizer=device.OPTIMIZER, loss_fn=spec.loss_fn)
    generator = torch.Generator().manual_seed(0)
    runner = StepRunner(model, config, make_batch(spec.input_spec, 1, None, generator),
                        foreach=False, generator=generator)
    runner.train_step()
    runner.optimizer.zero_grad(set_to_none=True)
    runner.batch = None
    gc.collect()
    with open("/proc/self/status") as status:
        vm_data = next(int(line.split()[1]) * 1024 for line in status
                       if line.startswith("VmData:"))
    _, hard = resource.getrlimit(resource.RLIMIT_DATA)
    resource.setrlimit(resource.RLIMIT_DATA, (vm_data + cap, hard))
    return runner, spec, generator


def _run_accelerate(name: str, cap: int) -> dict:
    from accelerate.utils import find_executable_batch_size

    from batchfit.engine.step import make_batch

    runner, spec, generator = _capped_runner(name, cap)
    trials: list[dict] = []

    @find_executable_batch_size(starting_batch_size=ACCELERATE_START)
    def train(batch_size: int) -> int:
        trials.append({"batch_size": batch_size, "fits": False})
        runner.batch = make_batch(spec.input_spec, batch_size, None, generator)
        try:
            for _ in range(device.STEPS):
                runner.train_step()
        finally:
            runner.batch = None
        trials[-1]["fits"] = True
        return batch_size

    start = time.perf_counter()
    answer = train()
    return {"answer": answer, "trials": trials, "wall_s": time.perf_counter() - start}


def _run_lightning(name: str, cap: int, mode: str) -> dict:
    import tempfile

    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.tuner import Tuner

    from batchfit.engine.step import make_batch

    runner, spec, generator = _capped_runner(name, cap)

    class Batches(torch.utils.data.IterableDataset):
        def __init__(self, batch_size: int):
            self.batch_size = batch_size

        def __iter__(self):
            for _ in range(1000):
                yield make_batch(spec.input_spec, self.batch_size, None, generator)

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = runner.model
            self.batch_size = 2
            self.trials: list[dict] = []

        def train_dataloader(self):
            self.trials.append({"batch_size": self.batch_size, "steps": 0})
            return torch.utils.data.DataLoader(Batches(self.batch_size), batch_size=None)

        def training_step(self, batch, index):
            runner.batch = batch
            try:
                return runner.forward_loss()
            finally:
                runner.batch = None

        def on_train_batch_end(self, *args) -> None:
            self.trials[-1]["steps"] += 1

        def configure_optimizers(self):
            return runner.optimizer

    module = Module()
    with tempfile.TemporaryDirectory() as root:
        trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, default_root_dir=root)
        start = time.perf_counter()
        try:
            answer = Tuner(trainer).scale_batch_size(module, mode=mode,
                                                     steps_per_trial=device.STEPS, init_val=2)
            error = None
        except Exception as exc:  # noqa: BLE001 - a finder that crashes is a result too
            answer, error = None, f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
        wall = time.perf_counter() - start
    trials = [{"batch_size": t["batch_size"], "fits": t["steps"] >= device.STEPS}
              for t in module.trials]
    return {"answer": answer, "trials": trials, "wall_s": wall, "error": error}


def run_peer_child(args: dict) -> dict:
    if args["method"] == "accelerate":
        return _run_accelerate(args["model"], args["cap"])
    return _run_lightning(args["model"], args["cap"], args["method"].split("-")[1])


def run_peer(method: str, name: str, cap: int) -> dict:
    """A peer in its own capped process."""
    payload = json.dumps({"method": method, "model": name, "cap": cap})
    done = subprocess.run([sys.executable, __file__, "--peer", payload], cwd=device.ROOT,
                          env=device.device_env(), capture_output=True, text=True, check=False)
    if done.returncode != 0:
        return {"answer": None, "trials": [], "wall_s": None,
                "error": done.stderr.strip().splitlines()[-1][:200] if done.stderr else
                f"exit code {done.returncode}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------- batchfit


def run_batchfit(name: str, cap: int, server=None) -> dict:
    """One search; ``setup_s``: from the call to the first trial's steps (the prediction
    and, cold or warm, the wait for the zygote and the template), ``trial_step_s``: the
    steps of every trial, ``trial_other_s``: the rest (forks, messages)."""
    from batchfit.realrun.search import search_max_batch

    spec = device.resolve(name)
    done_at: list[float] = []
    start = time.perf_counter()
    result = search_max_batch(spec, None, device="cpu", memory_cap_bytes=cap,
                              steps_per_trial=device.STEPS, optimizer=device.OPTIMIZER,
                              trial_server=server,
                              on_trial=lambda trial: done_at.append(time.perf_counter()))
    wall = time.perf_counter() - start
    steps = [t.seconds for t in result.trials]
    setup = done_at[0] - start - steps[0]
    return {"answer": result.max_batch_size, "wall_s": wall,
            "trials": [{"batch_size": t.batch_size, "fits": t.fits} for t in result.trials],
            "predicted": result.predicted_max_batch_size,
            "recommended": result.recommended_batch_size,
            "setup_s": setup, "trial_step_s": sum(steps),
            "trial_other_s": wall - setup - sum(steps), "error": None}


def run_batchfit_cold(name: str, cap: int) -> dict:
    """A search in a fresh process: only the call is timed (its own zygote, template and
    prediction included; this process's ``import torch`` is not, as for the peers)."""
    payload = json.dumps({"method": "batchfit-cold", "model": name, "cap": cap})
    done = subprocess.run([sys.executable, __file__, "--peer", payload], cwd=device.ROOT,
                          env=device.device_env(), capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"cold batchfit run failed for {name}:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------- the table


def truth_for(name: str, cap: int) -> tuple[int, list[int]]:
    """The true maximum and the batch sizes that fitted in only some fresh processes."""
    saved = device.RESULTS / "max_vs_true_cpu.json"
    if saved.exists():
        for row in json.loads(saved.read_text())["rows"]:
            if row["model"] == name and row["cap_bytes"] == cap:
                return row["true_max"], [int(b) for b in row.get("flaky", {})]
    print(f"  computing the true maximum of {name} (fresh processes)...", flush=True)
    guess = run_batchfit(name, cap)["answer"]
    log: list[dict] = []
    truth = device.true_maximum(name, cap, guess, log)
    return truth, list(device.flaky_batches(log))


def verdict(answer: int | None, truth: int, flaky: list[int]) -> str:
    if answer == truth:
        return "yes"
    return "flaky batch" if answer in flaky else "no"


def largest_fit(trials: list[dict]) -> int | None:
    return max((t["batch_size"] for t in trials if t["fits"]), default=None)


def median_wall(runs: list[dict]) -> float | None:
    """Median wall time of the runs that searched (a finder that crashed after some trials
    spent that time too; one that crashed before its first trial did not search)."""
    walls = [r["wall_s"] for r in runs if r.get("wall_s") is not None and r["trials"]]
    return statistics.median(walls) if walls else None


def _cell(runs: list[dict], key: str, digits: int = 1) -> str:
    values = [r[key] for r in runs if r.get(key) is not None and r["trials"]]
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return (f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}-"
            f"{max(values):.{digits}f})")


def markdown(rows: list[dict], summary: dict, repeats: int) -> str:
    lines = ["# batchfit search vs Lightning and accelerate on a capped CPU", "",
             (f"AdamW, {device.STEPS} steps per trial, `RLIMIT_DATA` cap after a warm-up at "
             "batch 1, `MALLOC_MMAP_THRESHOLD_=131072`, `OMP_NUM_THREADS=1`, 2 shared cores. "
             f"{repeats} runs of each method; wall time: median (min-max) of the runs. "
             "Peers: the finder call only (their process had imported torch, built the "
             "model, warmed up). batchfit, timed from the call: **cold**: a fresh process "
             "(its zygote's start, the template's build and the prediction's traces "
             "included); **warm**: a running zygote (the template, i.e. the model's build, "
             "warm-up and `torch._dynamo` import in a fresh process, and the prediction "
             "included); **hot**: the same search again on that server (the template "
             "kept): the peers' starting point. setup: from the call to the first trial's "
             "steps; steps: the trials' steps."), "",
             ("| model | cap MiB | true max (flaky) | method | trials | wall s | setup s | "
             "steps s | answers | correct |"),
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        for method, runs in row["methods"].items():
            answers = [r["answer"] if r.get("error") is None else f"error: {r['error']}"
                       for r in runs]
            shown = ", ".join(map(str, dict.fromkeys(answers)))
            correct = sum(verdict(r["answer"], row["true_max"], row["flaky"]) == "yes"
                          for r in runs)
            trials = statistics.median(len(r["trials"]) for r in runs)
            flaky = f" ({', '.join(map(str, row['flaky']))})" if row["flaky"] else ""
            lines.append(
                f"| {row['model']} | {row['cap_bytes'] / device.MIB:.0f} | "
                f"{row['true_max']}{flaky} | {method} | {trials:g} | "
                f"{_cell(runs, 'wall_s')} | {_cell(runs, 'setup_s')} | "
                f"{_cell(runs, 'trial_step_s')} | {shown} | {correct}/{len(runs)} |")
    lines += ["", "Summary:", ""]
    lines += [f"- {key}: {value}" for key, value in summary.items()]
    return "\n".join(lines) + "\n"


def summarize(rows: list[dict]) -> dict:
    scenarios = ("cold", "warm", "hot")
    ours = {s: [r["methods"][f"batchfit ({s})"] for r in rows] for s in scenarios}
    binsearch = [median_wall(r["methods"]["lightning-binsearch"]) for r in rows]
    every = [run for s in scenarios for runs in ours[s] for run in runs]
    summary = {
        "batchfit exact every time": all(
            run["answer"] == row["true_max"]
            for s in scenarios for row, runs in zip(rows, ours[s]) for run in runs),
        "batchfit runs off the true max (answer: count)": {
            row["model"]: dict(collections.Counter(
                run["answer"] for s in scenarios for run in row["methods"][f"batchfit ({s})"]
                if run["answer"] != row["true_max"]))
            for row in rows},
        "batchfit mean trials": round(statistics.mean(len(r["trials"]) for r in every), 2),
    }
    for s in scenarios:
        summary[f"batchfit {s} wall / Lightning binsearch wall (medians)"] = {
            row["model"]: (round(median_wall(runs) / b, 2) if b else
                           "n/a (Lightning binsearch crashed before its first trial)")
            for row, runs, b in zip(rows, ours[s], binsearch)}
    summary["peers exact (runs)"] = {
        m: sum(run["answer"] == r["true_max"] for r in rows for run in r["methods"][m])
        for m in PEERS}
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(device.MODELS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--peer", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.peer:
        request = json.loads(args.peer)
        if request["method"] == "batchfit-cold":
            print(json.dumps(run_batchfit(request["model"], request["cap"])))
        else:
            print(json.dumps(run_peer_child(request)))
        return
    os.chdir(device.ROOT)
    os.environ.update(device.DEVICE_ENV)  # batchfit's own zygote inherits the device setup
    import torch._dynamo  # noqa: F401 - as in a process that has built an optimizer

    rows = []
    for name in [n.strip() for n in args.models.split(",") if n.strip()]:
        cap = device.MODELS[name]["cap"]
        print(f"== {name}: cap {cap / device.MIB:.0f} MiB", flush=True)
        truth, flaky = truth_for(name, cap)
        methods: dict[str, list[dict]] = {f"batchfit ({s})": [] for s in ("cold", "warm", "hot")}
        methods.update({m: [] for m in PEERS})
        for repeat in range(args.repeats):
            methods["batchfit (cold)"].append(run_batchfit_cold(name, cap))
            with device.trial_server(name) as server:
                server.wait_ready()
                methods["batchfit (warm)"].append(run_batchfit(name, cap, server))
                methods["batchfit (hot)"].append(run_batchfit(name, cap, server))
            for method in PEERS:
                methods[method].append(run_peer(method, name, cap))
            for method, runs in methods.items():
                run = runs[-1]
                print(f"  [{repeat + 1}/{args.repeats}] {method}: answer {run['answer']}, "
                      f"{len(run['trials'])} trials, {run['wall_s']} s"
                      + (f", error {run['error']}" if run.get("error") else ""), flush=True)
        rows.append({"model": name, "cap_bytes": cap, "true_max": truth, "flaky": flaky,
                     "methods": methods})
    summary = summarize(rows)
    device.RESULTS.mkdir(parents=True, exist_ok=True)
    (device.RESULTS / "search_vs_peers.json").write_text(
        json.dumps({"repeats": args.repeats, "rows": rows, "summary": summary}, indent=2)
        + "\n")
    text = markdown(rows, summary, args.repeats)
    (device.RESULTS / "search_vs_peers.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
