"""The kit's entry point: one command, one time budget, every part in priority order.

Parts, started in this order and run side by side where the card allows: the CUDA paths'
smoke runs (:mod:`.paths`, one command at a time), the boundary trials (:mod:`.search`
over :mod:`.trials` in forked children, :mod:`.pool`), the snapshots of the snapshot rows
once their boundary is known, then ``estimate --snapshot`` on the first snapshot. At the
budget the running children are killed, everything finished is written (:mod:`.results`)
and the command exits 0; the next run resumes from the newest results folder of the same
device.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

GiB = 1 << 30
MiB = 1 << 20
ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results" / "gpu"
#: Device memory a CUDA child holds beside its capped allocator (context, cuBLAS/cuDNN
#: handles): admission counts it for every running child.
CONTEXT_RESERVE_BYTES = GiB
#: Kept free for the path commands running beside the trials (their caps are 8 GiB).
PATHS_RESERVE_BYTES = 14 * GiB
#: Never planned into: what the driver and the card's other users may still take.
SAFETY_BYTES = 2 * GiB
PARTS = ("paths", "boundaries", "snapshots")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python3 -m benchmarks.gpu_truth",
        description="First-hand GPU truth: exact out-of-memory boundaries, memory snapshots "
                    "and every CUDA path on the card at hand, within a time budget.")
    parser.add_argument("--budget-s", type=float, default=480,
                        help="stop starting work after this many seconds (default 480)")
    parser.add_argument("--out", type=Path,
                        help="results folder (default $OUT, else benchmarks/results/gpu/"
                             "<device>-<date>)")
    parser.add_argument("--resume-from", type=Path,
                        help="an earlier run's folder (default: the newest of this device "
                             "under benchmarks/results/gpu; none in a dry run)")
    parser.add_argument("--parts", default=",".join(PARTS),
                        help=f"comma-separated subset of {','.join(PARTS)}")
    parser.add_argument("--only", help="regular expression over row keys")
    parser.add_argument("--jobs", type=int, help="concurrent trial children (default 6; 2 in "
                        "a dry run)")
    parser.add_argument("--trial-timeout-s", type=float, default=180)
    parser.add_argument("--dry-run", action="store_true",
                        help="tiny models on the CPU under RLIMIT_DATA caps: the whole "
                             "pipeline without a GPU")
    args = parser.parse_args(argv)
    unknown = set(args.parts.split(",")) - set(PARTS)
    if unknown:
        parser.error(f"unknown part(s) {', '.join(sorted(unknown))}: use {', '.join(PARTS)}")
    return args


def preload(dry_run: bool) -> None:
    """Import what the trials use, once, in the parent (never touching CUDA)."""
    import torch  # noqa: F401
    import torchvision  # noqa: F401
    import transformers  # noqa: F401

    import batchfit.cli.app
    import batchfit.realrun.trial  # noqa: F401
    if not dry_run:
        import timm  # noqa: F401


class Kit:
    """One run: the searches, the pool, the paths, and the folder they are written to."""

    def __init__(self, args: argparse.Namespace) -> None:
        from benchmarks.gpu_truth.configs import configs_for, snapshot_keys_for
        from benchmarks.gpu_truth.predict import predictions_path, read_predictions

        self.args = args
        self.cuda = not args.dry_run
        self.start = time.monotonic()
        self.deadline = self.start + args.budget_s
        self.parts = set(args.parts.split(","))
        configs = configs_for(args.dry_run)
        if args.only:
            import re

            configs = tuple(c for c in configs if re.search(args.only, c.key))
        self.configs = {c.key: c for c in configs}
        self.snapshot_keys = [k for k in snapshot_keys_for(args.dry_run) if k in self.configs]
        self.predictions = read_predictions(predictions_path(args.dry_run))
        self.snap_dir = Path(tempfile.mkdtemp(prefix="gpu_truth_snapshots_"))
        self.trials: list[dict[str, Any]] = []
        self.stalled: set[str] = set()
        self.info: dict[str, Any] = {}
        self.snapshots_left_out: list[str] = []
        from benchmarks.gpu_truth.predict import batchfit_commit

        self.commit = batchfit_commit()

    def say(self, text: str) -> None:
        print(f"[{time.monotonic() - self.start:6.1f}s] {text}", flush=True)

    def time_left(self) -> float:
        return self.deadline - time.monotonic()

    # -- set-up ------------------------------------------------------------------------

    def probe(self, pool: Any) -> dict[str, Any]:
        from benchmarks.gpu_truth.pool import Job
        from benchmarks.gpu_truth.trials import device_info

        pool.start(Job("probe", lambda: device_info(self.cuda), 0, 120))
        while True:
            for _, result in pool.poll(1.0):
                return result

    def open_folder(self) -> None:
        from benchmarks.gpu_truth.results import newest_run_folder, read_previous, slug
        from benchmarks.gpu_truth.search import BoundarySearch

        name = self.info.get("device_name", "unknown")
        date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d")
        env_out = os.environ.get("OUT")
        self.folder_name = f"{slug(name)}-{date}"  # where the lead commits the results
        self.out = self.args.out or (Path(env_out) if env_out else RESULTS / self.folder_name)
        self.out.mkdir(parents=True, exist_ok=True)
        resume = self.args.resume_from
        if resume is None and self.cuda:
            resume = newest_run_folder(RESULTS, name)
        if resume is not None and resume.resolve() == self.out.resolve():
            resume = self.out
        previous, self.paths_done = read_previous(resume, self.snap_dir)
        self.resumed_from = str(resume) if resume else None
        self.searches = {}
        for key in self.configs:
            predicted = self.predictions.get(key, {}).get("predicted")
            self.searches[key] = BoundarySearch.seeded(int(predicted) if predicted else None)
        for trial in previous:
            self._record(trial, replayed=True)
        self.say(f"{self.info.get('device_name')} | torch {self.info.get('torch_version')} | "
                 f"{len(self.configs)} rows, {len(previous)} earlier trials"
                 f"{' from ' + str(resume) if resume else ''} | out {self.out}")

    def _record(self, trial: dict[str, Any], replayed: bool = False) -> None:
        self.trials.append(trial)
        search = self.searches.get(trial.get("key"))
        if search is None or trial.get("job") != "boundary":
            return
        if trial.get("kind") in ("timeout", "crash") and not replayed:
            self.stalled.add(trial["key"])  # not retried in this run
            return
        if trial.get("kind") not in ("timeout", "crash"):
            search.record(trial["batch_size"], trial)

    # -- jobs --------------------------------------------------------------------------

    def _reserve(self, cap_bytes: int) -> int:
        return cap_bytes + (CONTEXT_RESERVE_BYTES if self.cuda else 64 * MiB)

    def next_boundary_jobs(self, busy: set[str]) -> list[Any]:
        from benchmarks.gpu_truth.pool import Job
        from benchmarks.gpu_truth.trials import boundary_trial

        jobs = []
        for key, config in self.configs.items():
            search = self.searches[key]
            if key in busy or key in self.stalled or search.done():
                continue
            batch = search.next_batch()
            jobs.append(Job(f"{config.model} B={batch}",
                            lambda c=config, b=batch: boundary_trial(c, b, self.cuda),
                            self._reserve(config.cap_bytes), self.args.trial_timeout_s,
                            {"job": "boundary", "key": key, "batch_size": batch}))
        return jobs

    def next_snapshot_jobs(self, busy: set[str]) -> list[Any]:
        from benchmarks.gpu_truth.pool import Job
        from benchmarks.gpu_truth.results import slug
        from benchmarks.gpu_truth.trials import record_snapshot

        jobs = []
        for key in self.snapshot_keys:
            search = self.searches[key]
            done = (self.snap_dir / f"{slug(key)}.json").exists()
            if key in busy or done or not search.done() or search.boundary < 1:
                continue
            config, batch = self.configs[key], search.boundary
            path = self.snap_dir / f"{slug(key)}.pickle"
            jobs.append(Job(f"snapshot {config.model} B={batch}",
                            lambda c=config, b=batch, p=path: record_snapshot(c, b, self.cuda, p),
                            self._reserve(config.cap_bytes), self.args.trial_timeout_s * 2,
                            {"job": "snapshot", "key": key, "batch_size": batch}))
        return jobs

    def finish_job(self, job: Any, result: dict[str, Any]) -> None:
        trial = {**job.payload, **result, "device_name": self.info.get("device_name")}
        self._record(trial)
        key = job.payload["key"]
        if job.payload["job"] == "snapshot":
            self._finish_snapshot(key, trial)
            return
        search = self.searches[key]
        verdict = "fits" if result.get("fits") else f"fails ({result.get('kind')})"
        reserved = result.get("peak_reserved_bytes")
        extra = f", reserved {reserved / GiB:.2f} GiB" if reserved else ""
        state = (f"exact boundary {search.boundary}" if search.exact else
                 f"next {search.next_batch()}" if not search.done() else "done")
        predicted = self.predictions.get(key, {}).get("predicted", "-")
        self.say(f"{key}: B={job.payload['batch_size']} {verdict}{extra} | predicted "
                 f"{predicted} | {state}")

    def _finish_snapshot(self, key: str, trial: dict[str, Any]) -> None:
        from benchmarks.gpu_truth.paths import snapshot_path_spec
        from benchmarks.gpu_truth.results import slug, write_json

        config = self.configs[key]
        record = {"config": config.to_dict(), "device": self.info, **trial}
        write_json(self.snap_dir / f"{slug(key)}.json", record)
        self.bundle_snapshots()
        self.say(f"snapshot {key} at B={trial['batch_size']}: "
                 f"{trial.get('message', 'recorded')}")
        pickle = self.snap_dir / f"{slug(key)}.pickle"
        if self.paths is not None and pickle.exists() and "estimate-snapshot" not in (
                self.paths_done) and "message" not in trial:
            self.paths.add(snapshot_path_spec(config, trial["batch_size"], pickle))

    # -- the loop ----------------------------------------------------------------------

    def run(self) -> int:
        from benchmarks.gpu_truth.paths import PathRunner, path_specs
        from benchmarks.gpu_truth.pool import ForkPool

        slots = self.args.jobs or (6 if self.cuda else 2)
        pool = ForkPool(1 << 62, slots)
        self.info = self.probe(pool)
        if "device_name" not in self.info:
            print(f"error: no CUDA device to measure ({self.info.get('message', '?')}): run "
                  "the kit where a card is, or try the pipeline with --dry-run", file=sys.stderr)
            return 2
        self.open_folder()
        use_paths = "paths" in self.parts
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH", "")) if p)}
        self.paths = PathRunner(path_specs(self.args.dry_run), self.paths_done, env) \
            if use_paths else None
        if self.cuda:
            pool.memory_bytes = (self.info["free_bytes_at_start"] - SAFETY_BYTES
                                 - (PATHS_RESERVE_BYTES if use_paths else 0))
        self.write()
        while self.time_left() > 0:
            self._step_paths()
            busy = {job.payload.get("key") for job in
                    (r.job for r in pool.running.values())}
            waiting = []
            if "boundaries" in self.parts:
                waiting += self.next_boundary_jobs(busy)
            if "snapshots" in self.parts:
                waiting += self.next_snapshot_jobs(busy)
            for job in waiting:
                if pool.can_start(job):
                    pool.start(job)
                    busy.add(job.payload["key"])
            if not pool.running and not waiting and (self.paths is None or self.paths.idle()):
                break
            for job, result in pool.poll(0.5):
                self.finish_job(job, result)
                self.write()
        stopped = pool.stop_all()
        if stopped:
            self.say(f"budget spent: stopped {len(stopped)} running trial(s): "
                     + ", ".join(j.name for j in stopped))
        if self.paths is not None and (summary := self.paths.stop()) is not None:
            self.say(f"path {summary['name']}: stopped at the budget")
        self.write(final=True)
        self.say(f"wrote {self.out}")
        return 0

    def _step_paths(self) -> None:
        if self.paths is None:
            return
        summary = self.paths.poll()
        if summary is not None:
            error = "" if summary["status"] == "ok" else f": {summary['error'][:2]}"
            self.say(f"path {summary['name']}: {summary['status']} "
                     f"({summary['seconds']} s){error}")
            self.write()

    def write(self, final: bool = False) -> None:
        from benchmarks.gpu_truth.report import compare_paths
        from benchmarks.gpu_truth.results import (
            boundary_row,
            write_csv,
            write_json,
            write_trials,
        )

        if final:
            self.bundle_snapshots()
        rows = [boundary_row(config, self.searches[key], self.predictions.get(key, {}),
                             self.info)
                for key, config in self.configs.items() if self.searches[key].trials()]
        write_csv(self.out / "boundaries.csv", rows)
        write_trials(self.out / "trials.jsonl", self.trials)
        paths_done = self.paths.done if self.paths is not None else self.paths_done
        write_json(self.out / "paths.json", {"paths": paths_done,
                                             "comparisons": compare_paths(paths_done, rows)})
        status = {key: s.trials() and ("done" if s.done() else "open")
                  for key, s in self.searches.items()}
        write_json(self.out / "run.json", {
            "device": self.info, "kit_commit": self.commit, "folder_name": self.folder_name,
            "dry_run": self.args.dry_run,
            "budget_s": self.args.budget_s, "elapsed_s": round(time.monotonic() - self.start, 1),
            "final": final, "resumed_from": self.resumed_from,
            "rows_done": sum(1 for v in status.values() if v == "done"),
            "rows_total": len(status), "stalled": sorted(self.stalled),
            "snapshots_left_out": self.snapshots_left_out})

    def bundle_snapshots(self) -> None:
        """Rewrite ``snapshots.tar.gz`` (only when a snapshot is added: it is large)."""
        from benchmarks.gpu_truth.results import write_snapshots

        if any(self.snap_dir.iterdir()):
            self.snapshots_left_out = write_snapshots(self.out / "snapshots.tar.gz",
                                                      self.snap_dir)


def main(argv: list[str] | None = None) -> int:
    # before torch is imported: is_available() must not initialise CUDA here (pool.py)
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    # hf: rows come from batchfit's offline table; the device has no network to wait on
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args = parse_args(argv)
    preload(args.dry_run)
    return Kit(args).run()


if __name__ == "__main__":
    sys.exit(main())
