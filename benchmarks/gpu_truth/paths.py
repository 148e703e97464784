"""Part 4: every CUDA code path once, each beside an independent measurement.

Each path is a command in its own process (a user's process, not a fork of the kit),
run one at a time next to the boundary trials, its memory bounded so the trials keep
their room (``search --memory-cap``, ``bench --memory``):

* ``search:<row>``: ``batchfit search --device cuda:0 --memory-cap CAP`` on 3 kit rows,
  and ``lightning:<row>``: Lightning's ``scale_batch_size(mode="binsearch")`` on the same
  step and cap (:mod:`.peers`); both answers, trials and wall times, and the kit's
  boundary for that row, go side by side in the report;
* ``bench:measured`` / ``bench:predicted``: ``bench --device cuda:0`` and ``bench
  --predict --gpu H100`` on the same step; the error per batch size is
  measured/predicted throughput - 1;
* ``noise``: ``noise --device cuda:0`` on the bundled digits MLP;
* ``pytest-gpu``: ``pytest -m gpu`` (the project's CUDA tests, the Lightning, Hugging
  Face and Keras callbacks' CUDA tests among them; Keras only where it is installed);
* ``estimate-snapshot``: ``estimate --snapshot`` on the first snapshot the kit recorded
  (queued once it exists).

Each path's result in ``paths.json``: ``ok`` or ``failed`` with the error's first lines,
its wall time, and its JSON answer where it printed one. The dry run runs the same
machinery on the CPU with a tiny row and the cheapest commands (``estimate`` on the CPU,
``bench --predict``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.gpu_truth.configs import CONFIGS, DRY_CONFIGS, PREDICT_GPU, Config

CLI = "from batchfit.cli import main; main()"
ROOT = Path(__file__).resolve().parents[2]
#: The rows ``search`` runs on (training rows without cudnn.benchmark: search has no flag).
SEARCH_ROWS = (CONFIGS[0], CONFIGS[21], CONFIGS[31])
BENCH_ROW = CONFIGS[0]


@dataclass(frozen=True)
class PathSpec:
    name: str
    argv: tuple[str, ...]
    timeout_s: float
    row_key: str = ""  # the kit row it is compared with


def _cli(*args: str) -> tuple[str, ...]:
    return (sys.executable, "-c", CLI, *args)


def _search(config: Config, device: str, boundary_runs: int) -> tuple[str, ...]:
    return _cli("search", *config.step_args(), "--device", device, "--memory-cap",
                f"{config.cap_mib}MiB", "--boundary-runs", str(boundary_runs), "--json")


def path_specs(dry_run: bool) -> list[PathSpec]:
    """The paths in the order they run (the snapshot's path is added when one exists)."""
    if dry_run:  # the machinery, on the cheapest commands (search on a CPU takes minutes)
        row = DRY_CONFIGS[0]
        return [
            PathSpec("estimate:cpu", _cli("estimate", *row.step_args(), "--batch-size", "2",
                                          "--device", "cpu", "--json"), 120, row.key),
            PathSpec("bench:predicted", _cli("bench", *row.step_args(), "--predict", "--gpu",
                                             PREDICT_GPU, "--batches", "2,4", "--json"), 120),
        ]
    specs = []
    for row in SEARCH_ROWS:
        specs.append(PathSpec(f"search:{row.model}", _search(row, "cuda:0", 1), 240, row.key))
        specs.append(PathSpec(f"lightning:{row.model}", (sys.executable, "-m",
                                                          "benchmarks.gpu_truth.peers", row.key),
                              240, row.key))
    bench = BENCH_ROW.step_args()
    specs += [
        PathSpec("bench:measured", _cli("bench", *bench, "--device", "cuda:0", "--memory",
                                        f"{BENCH_ROW.cap_mib}MiB", "--time-budget", "60s",
                                        "--json"), 180),
        PathSpec("bench:predicted", _cli("bench", *bench, "--predict", "--gpu", PREDICT_GPU,
                                         "--memory", f"{BENCH_ROW.cap_mib}MiB", "--json"), 180),
        PathSpec("noise", _cli("noise", "examples/digits.py:build", "--device", "cuda:0",
                               "--steps", "20", "--json"), 180),
        PathSpec("pytest-gpu", (sys.executable, "-m", "pytest", "-q", "-rs", "-m", "gpu", "-p",
                                "no:cacheprovider", "--continue-on-collection-errors",
                                "tests"), 300),
    ]
    return specs


def snapshot_path_spec(config: Config, batch_size: int, snapshot: Path) -> PathSpec:
    """``estimate --snapshot`` on a recorded step (the card's own profile, this stack)."""
    argv = _cli("estimate", *config.step_args(), "--batch-size", str(batch_size), "--device",
                "cuda:0", "--snapshot", str(snapshot), "--json")
    if config.cudnn_benchmark:
        argv += ("--cudnn-benchmark",)
    return PathSpec("estimate-snapshot", argv, 240, config.key)


def summarize(spec: PathSpec, outcome: dict[str, Any]) -> dict[str, Any]:
    """``ok``/``failed``, the first lines of a failure, and the JSON answer if any."""
    result: dict[str, Any] = {"name": spec.name, "command": " ".join(spec.argv[1:]),
                              "seconds": outcome.get("seconds"), "row": spec.row_key}
    stdout = outcome.get("stdout") or ""
    if outcome.get("timed_out") or outcome.get("rc") != 0:
        lines = (outcome.get("stderr") or stdout or "").strip().splitlines()
        why = "timed out" if outcome.get("timed_out") else f"exit {outcome.get('rc')}"
        return {**result, "status": "failed", "error": [why, *lines[-6:]]}
    result["status"] = "ok"
    try:
        result["answer"] = json.loads(stdout[stdout.index("{"):]) if "{" in stdout else None
    except ValueError:
        result["answer"] = None
    if result["answer"] is None:
        result["tail"] = stdout.strip().splitlines()[-3:]
    return result


class PathRunner:
    """Runs the path commands one at a time, without blocking the kit's loop."""

    def __init__(self, specs: list[PathSpec], done: dict[str, dict[str, Any]],
                 env: dict[str, str]) -> None:
        self.queue = [s for s in specs if s.name not in done or done[s.name]["status"] != "ok"]
        self.done = done
        self.env = env
        self.current: tuple[PathSpec, subprocess.Popen, Any, Any, float] | None = None

    def add(self, spec: PathSpec) -> None:
        if spec.name not in self.done or self.done[spec.name]["status"] != "ok":
            self.queue.append(spec)

    def idle(self) -> bool:
        return self.current is None and not self.queue

    def poll(self) -> dict[str, Any] | None:
        """Start the next path, or collect the running one; its summary when it ended."""
        if self.current is None:
            if not self.queue:
                return None
            spec = self.queue.pop(0)
            # closed by _collect when the command ends (the loop must not wait on it)
            out = tempfile.TemporaryFile("w+")  # noqa: SIM115
            err = tempfile.TemporaryFile("w+")  # noqa: SIM115
            process = subprocess.Popen(spec.argv, stdout=out, stderr=err, env=self.env,
                                       cwd=ROOT, start_new_session=True)
            self.current = (spec, process, out, err, time.monotonic())
            return None
        spec, process, out, err, started = self.current
        elapsed = time.monotonic() - started
        timed_out = process.poll() is None and elapsed > spec.timeout_s
        if process.poll() is None and not timed_out:
            return None
        if timed_out:
            os.killpg(process.pid, 9)
            process.wait()
        return self._collect(timed_out)

    def stop(self) -> dict[str, Any] | None:
        """The budget is spent: end the running path, recorded as stopped."""
        if self.current is None:
            return None
        os.killpg(self.current[1].pid, 9)
        self.current[1].wait()
        result = self._collect(True)
        result["error"] = ["stopped at the kit's time budget"]
        return result

    def _collect(self, timed_out: bool) -> dict[str, Any]:
        spec, process, out, err, started = self.current
        self.current = None
        out.seek(0)
        err.seek(0)
        outcome = {"rc": process.returncode, "timed_out": timed_out, "stdout": out.read(),
                   "stderr": err.read()[-4000:], "seconds": round(time.monotonic() - started, 1)}
        out.close()
        err.close()
        summary = summarize(spec, outcome)
        self.done[spec.name] = summary
        return summary
