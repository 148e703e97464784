"""batchfit's answers for every kit row, computed here on the CPU before a card is lent.

Each row's prediction is the exact ``batchfit max`` command of
:meth:`~benchmarks.gpu_truth.configs.Config.max_argv` (the H100's architecture with the
row's cap as its memory, ``--overhead 0``, ``--stack torch2.11+cu130``, the row's flags),
run in its own process with this checkout's ``src`` first on the path. The answers go to
``benchmarks/gpu_truth/predictions.csv`` (``predictions_dry.csv`` for the dry run's CPU
rows) with the batchfit commit they came from and the command, so any row can be checked
by hand and the whole file recomputed with one command after a change to the engine.

Resumable: rows already in the file are kept; ``--recompute`` redoes every row,
``--stale`` the rows made by code whose ``src/`` differs from this checkout's.

Usage:
    python3 -m benchmarks.gpu_truth.predict [--dry-run] [--jobs 2] [--stale|--recompute]
        [--only REGEX]
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from benchmarks.gpu_truth.configs import Config, configs_for

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
COLUMNS = ("key", "predicted", "binding_constraint", "budget_bytes", "total_bytes_at_max",
           "traces", "seconds", "batchfit_commit", "command", "error")
CLI = "from batchfit.cli import main; main()"


def predictions_path(dry_run: bool) -> Path:
    return HERE / ("predictions_dry.csv" if dry_run else "predictions.csv")


def batchfit_commit() -> str:
    """HEAD's short hash, ``+dirty`` when ``src/`` has uncommitted changes (the answers
    then come from code no commit holds)."""
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                                  check=False).stdout.strip()
        except OSError:  # no git (the device machine may lack it)
            return ""

    head = git("rev-parse", "--short=12", "HEAD") or "unknown"
    return head + ("+dirty" if git("status", "--porcelain", "--", "src") else "")


def src_changed_since(commit: str) -> bool:
    """Whether ``src/`` differs from what made a prediction at ``commit`` (a ``+dirty``
    commit, or one git does not know, counts as changed)."""
    if commit.endswith("+dirty") or not re.fullmatch(r"[0-9a-f]{7,40}", commit):
        return True
    try:
        done = subprocess.run(["git", "diff", "--quiet", commit, "--", "src"], cwd=ROOT,
                              capture_output=True, check=False)
    except OSError:
        return True
    return done.returncode != 0


def read_predictions(path: Path) -> dict[str, dict[str, str]]:
    if not path.exists():
        return {}
    with path.open(newline="") as handle:
        return {row["key"]: row for row in csv.DictReader(handle)}


def write_predictions(path: Path, rows: dict[str, dict[str, Any]], order: list[str]) -> None:
    tmp = path.with_suffix(".tmp")
    with tmp.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, COLUMNS)
        writer.writeheader()
        for key in [k for k in order if k in rows] + sorted(set(rows) - set(order)):
            writer.writerow({c: rows[key].get(c, "") for c in COLUMNS})
    tmp.replace(path)


def command_text(config: Config, dry_run: bool) -> str:
    argv = config.max_argv(gpu=None) if dry_run else config.max_argv()
    return "batchfit " + " ".join(_quote(a) for a in argv)


def _quote(arg: str) -> str:
    return arg if re.fullmatch(r"[\w@%+=:,./-]+", arg) else "'" + arg.replace("'", "'\\''") + "'"


def predict_one(config: Config, dry_run: bool, commit: str, timeout_s: float) -> dict[str, Any]:
    """Run the row's ``batchfit max`` and read its JSON answer."""
    argv = config.max_argv(gpu=None) if dry_run else config.max_argv()
    env = {**os.environ, "HF_HUB_OFFLINE": "1",  # the offline table's configs, as on the card
           "PYTHONPATH": os.pathsep.join(
               [str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    row: dict[str, Any] = {"key": config.key, "batchfit_commit": commit,
                           "command": command_text(config, dry_run)}
    start = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, "-c", CLI, *argv], capture_output=True,
                              text=True, env=env, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        return {**row, "error": f"timed out after {timeout_s:.0f} s"}
    row["seconds"] = round(time.perf_counter() - start, 1)
    if done.returncode != 0:
        lines = (done.stderr or done.stdout).strip().splitlines()
        return {**row, "error": (lines[-1] if lines else f"exit {done.returncode}")[:300]}
    answer = json.loads(done.stdout)
    return {**row, "predicted": answer["max_batch_size"],
            "binding_constraint": answer["binding_constraint"],
            "budget_bytes": answer["budget_bytes"],
            "total_bytes_at_max": answer["total_bytes_at_max"], "traces": answer["traces"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="the dry run's CPU rows")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per row")
    parser.add_argument("--only", help="regular expression over row keys")
    redo = parser.add_mutually_exclusive_group()
    redo.add_argument("--stale", action="store_true",
                      help="redo rows made by another src/ than this checkout's")
    redo.add_argument("--recompute", action="store_true", help="redo every row")
    args = parser.parse_args(argv)
    path = predictions_path(args.dry_run)
    configs = list(configs_for(args.dry_run))
    if args.only:
        configs = [c for c in configs if re.search(args.only, c.key)]
    commit = batchfit_commit()
    rows: dict[str, dict[str, Any]] = dict(read_predictions(path))

    def wanted(config: Config) -> bool:
        old = rows.get(config.key)
        if args.recompute or old is None or old.get("error"):
            return True
        return args.stale and src_changed_since(old.get("batchfit_commit", ""))

    todo = [c for c in configs if wanted(c)]
    print(f"{len(todo)} of {len(configs)} rows to predict at {commit}", flush=True)
    order = [c.key for c in configs_for(args.dry_run)]
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        for row in pool.map(lambda c: predict_one(c, args.dry_run, commit, args.timeout), todo):
            rows[row["key"]] = row
            write_predictions(path, rows, order)
            print(f"{row['key']}: {row.get('predicted', '-')} {row.get('error', '')} "
                  f"({row.get('seconds', '?')} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
