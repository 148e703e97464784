"""Where a real-device search spends its steps, and what the seed trial measures.

How it asks batchfit: ``search_max_batch`` and the trial's internals, instrumented (a
harness).

Two measurements behind issue 4's notes (same capped CPU device as
``search_vs_peers.py``: AdamW, 2 steps per trial, 128 MiB cap, one thread, glibc's mmap
threshold pinned):

* ``trials``: ``search_max_batch`` three times on one kept ``TrialServer`` (warm, then
  twice hot), with each trial's batch, outcome and step seconds. The two trials the
  issue requires (the maximum for K steps, the maximum + 1 until it fails) set a floor
  on any search's wall time.
* ``overhead``: process memory beyond live tensors (data-segment growth minus
  live-tensor growth) in the warm-up step at batch 1 and in trials forked after it at
  other batch sizes: whether the warm-up could stand in for the seed trial.

Run: ``python benchmarks/search_trials.py [--models cnn,gpt2-tiny] [--batches 2,4,8,16]``
(~3 min per model). Writes ``benchmarks/results/search_trials.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import max_vs_true_cpu as device

CAP = 128 << 20
MIB = 1 << 20


def trials(name: str) -> list[dict]:
    from batchfit.realrun.search import search_max_batch

    server = device.trial_server(name)
    runs = []
    try:
        for label in ("warm", "hot", "hot"):
            result = search_max_batch(device.resolve(name), None, device="cpu",
                                      memory_cap_bytes=CAP, steps_per_trial=device.STEPS,
                                      optimizer=device.OPTIMIZER, trial_server=server)
            runs.append({"start": label, "answer": result.max_batch_size,
                         "wall_s": result.seconds,
                         "trials": [{"batch_size": t.batch_size, "fits": t.fits,
                                     "seconds": t.seconds} for t in result.trials]})
    finally:
        server.close()
    return runs


#: The overhead measurement, in a fresh process like a trial template's.
_OVERHEAD = r"""
import gc, json, os, sys
sys.path.insert(0, sys.argv[3])
import torch
torch.set_num_threads(1)
import max_vs_true_cpu as device
from batchfit.realrun.trial import _UsageTracker, _StepSetup, _run_steps, _state_tensors, _data_segment_now
from batchfit.engine.spec import TrainConfig

spec = device.resolve(sys.argv[1])
config = TrainConfig(optimizer=device.OPTIMIZER, loss_fn=spec.loss_fn)
setup = _StepSetup.of(spec.input_spec, config, torch.device("cpu"))
torch.manual_seed(0)
generator = torch.Generator().manual_seed(0)
runner = setup.runner(setup.prepare(spec.factory()), None, generator)

def tracked():
    tracker = _UsageTracker(True)
    for tensor in _state_tensors(runner):
        tracker.add(tensor)
    tracker.data_peak = _data_segment_now()
    return tracker, tracker.live_bytes, tracker.data_peak

tracker, live0, data0 = tracked()
with tracker:
    runner.batch = setup.batch(1, generator)
    runner.train_step()
rows = [{"batch_size": 1, "phase": "warm-up",
         "overhead_bytes": (tracker.data_peak - data0) - (tracker.peak_bytes - live0)}]
runner.optimizer.zero_grad(set_to_none=True)
runner.batch = ((), {})
gc.collect()
for batch_size in [int(b) for b in sys.argv[2].split(",")]:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        tracker, live0, data0 = tracked()
        peak = _run_steps(runner, setup, batch_size, 2, generator, tracker)
        used = tracker.data_peak - data0
        os.write(write, json.dumps({"batch_size": batch_size, "phase": "trial",
                                    "overhead_bytes": used - (peak - live0)}).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        rows.append(json.loads(pipe.read()))
    os.waitpid(pid, 0)
print(json.dumps(rows))
"""


def overhead(name: str, batches: str) -> list[dict]:
    done = subprocess.run([sys.executable, "-c", _OVERHEAD, name, batches,
                           str(Path(__file__).resolve().parent)], cwd=device.ROOT,
                          env=device.device_env(), capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="cnn,resnet18,gpt2-tiny")
    parser.add_argument("--batches", default="2,4,8,16,32")
    args = parser.parse_args()
    os.environ.update(device.DEVICE_ENV)  # the search's own trial processes pin it too
    results = {}
    for name in args.models.split(","):
        results[name] = {"trials": trials(name), "overhead": overhead(name, args.batches)}
        for run in results[name]["trials"]:
            steps = sum(t["seconds"] for t in run["trials"])
            answer = run["answer"]
            required = sum(t["seconds"] for t in run["trials"]
                           if t["batch_size"] in (answer, answer + 1))
            print(f"{name} {run['start']}: answer {answer}, trials "
                  + ", ".join(f"{t['batch_size']}{'' if t['fits'] else ' (fails)'} "
                              f"{t['seconds']:.2f} s" for t in run["trials"])
                  + f"; the maximum and the maximum + 1 are {required / steps:.0%} of the steps")
        print(f"{name} overhead beyond live tensors: " + ", ".join(
            f"{row['phase']} at {row['batch_size']}: {row['overhead_bytes'] / MIB:.1f} MiB"
            for row in results[name]["overhead"]))
    out = device.RESULTS / "search_trials.json"
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
