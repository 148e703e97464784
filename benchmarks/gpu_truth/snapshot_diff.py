"""Part 3, on the CPU after a run: each recorded snapshot against batchfit's predicted step.

For every snapshot in a run folder's ``snapshots.tar.gz`` this runs
:meth:`~benchmarks.gpu_truth.configs.Config.estimate_argv`: ``batchfit estimate`` of the
row's step at the recorded batch, on the H100's architecture with the row's cap, no
context and the device's stack, with ``--snapshot`` (:mod:`batchfit.device.snapshot`:
peaks, allocation sizes only the card made or only batchfit predicted, where the order of
large allocations first differs, the slack the real allocator's segments leave). Writes
``snapshot_diff.json`` beside the run's files.

Usage: python3 -m benchmarks.gpu_truth.snapshot_diff benchmarks/results/gpu/<run>/
"""

from __future__ import annotations

import json
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.gpu_truth.configs import Config
from benchmarks.gpu_truth.predict import CLI, ROOT


def diff_run(folder: Path) -> dict[str, Any]:
    import os
    import subprocess

    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as unpacked:
        with tarfile.open(folder / "snapshots.tar.gz") as tar:
            tar.extractall(unpacked, filter="data")
        for record_path in sorted(Path(unpacked).glob("*.json")):
            record = json.loads(record_path.read_text())
            pickle = record_path.with_suffix(".pickle")
            key = record["config"]["key"]
            if not pickle.exists():
                results[key] = {"error": "no snapshot (left out of the bundle, or the step "
                                         f"failed: {record.get('message', '')})"}
                continue
            config = Config.from_dict(record["config"])
            argv = config.estimate_argv(record["batch_size"], str(pickle))
            done = subprocess.run([sys.executable, "-c", CLI, *argv], capture_output=True,
                                  text=True, env=env, check=False)
            if done.returncode != 0:
                results[key] = {"error": (done.stderr.strip().splitlines() or ["?"])[-1]}
                continue
            estimate = json.loads(done.stdout)
            results[key] = {"batch_size": record["batch_size"],
                            "command": "batchfit " + " ".join(argv),
                            "comparison": estimate.get("snapshot_comparison")}
    return results


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or not (Path(args[0]) / "snapshots.tar.gz").exists():
        print("usage: python3 -m benchmarks.gpu_truth.snapshot_diff RUN_FOLDER (holding "
              "snapshots.tar.gz)", file=sys.stderr)
        return 2
    folder = Path(args[0])
    results = diff_run(folder)
    (folder / "snapshot_diff.json").write_text(json.dumps(results, indent=1) + "\n")
    for key, result in results.items():
        print(f"{key}: {result.get('error') or 'compared'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
