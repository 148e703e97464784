"""The kit's output folder: what it writes, and what a later run resumes from.

At most 8 files come back from the device tool, 2 folders down at most, so the kit writes
exactly these (each rewritten whole as results arrive, so a run stopped at any point
leaves a consistent folder):

* ``boundaries.csv``: one row per configuration tried (the columns of :data:`COLUMNS`);
* ``trials.jsonl``: every trial, this run's and the resumed runs', one JSON per line;
* ``paths.json``: part 4, one entry per CUDA path;
* ``run.json``: the device, the stack, the batchfit commit of the predictions, the
  budget and what each part got done;
* ``snapshots.tar.gz``: one ``<row>.pickle`` (the allocator history of one steady step)
  and ``<row>.json`` (the exact config, batch and peaks) per snapshot row.

The device command tees its output to a sixth, ``kit.log``. The lead commits the folder
as ``benchmarks/results/gpu/<device>-<date>/``; the next run resumes from the newest such
folder of the same device (``--resume-from`` names another): its trials are replayed
into the row searches, its ``ok`` paths and its snapshots are kept.
"""

from __future__ import annotations

import csv
import io
import json
import re
import tarfile
from pathlib import Path
from typing import Any

from benchmarks.gpu_truth.configs import Config
from benchmarks.gpu_truth.search import BoundarySearch

COLUMNS = ("model", "mode", "precision", "layout", "input", "cap_bytes", "boundary",
           "failed_at", "predicted", "device_name", "torch_version", "status",
           "peak_reserved_bytes", "peak_allocated_bytes", "failed_kind", "failed_message",
           "trials", "trial_seconds", "optimizer", "cudnn_benchmark", "inference_mode",
           "predicted_binding", "batchfit_commit", "key", "note")
FILES = ("boundaries.csv", "trials.jsonl", "paths.json", "run.json", "snapshots.tar.gz")


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_")


def status_of(search: BoundarySearch) -> str:
    if search.exact:
        return "exact"
    if search.contradicted:
        return "contradicted"
    if search.failed_at == 1:
        return "none-fits"
    if search.boundary >= search.max_batch:
        return "limit"
    return "open"


def boundary_row(config: Config, search: BoundarySearch, prediction: dict[str, str],
                 info: dict[str, Any]) -> dict[str, Any]:
    """The ``boundaries.csv`` row of a configuration."""
    fit = search.fits.get(search.boundary, {})
    fail = search.fails.get(search.failed_at, {}) if search.failed_at is not None else {}
    trials = [*search.fits.values(), *search.fails.values()]
    return {
        "model": config.model, "mode": config.mode, "precision": config.precision,
        "layout": config.layout, "input": config.input, "cap_bytes": config.cap_bytes,
        "boundary": search.boundary, "failed_at": search.failed_at or "",
        "predicted": prediction.get("predicted", ""), "device_name": info.get("device_name", ""),
        "torch_version": info.get("torch_version", ""), "status": status_of(search),
        "peak_reserved_bytes": fit.get("peak_reserved_bytes", ""),
        "peak_allocated_bytes": fit.get("peak_allocated_bytes", ""),
        "failed_kind": fail.get("kind", ""), "failed_message": fail.get("message", ""),
        "trials": len(trials), "trial_seconds": round(sum(t.get("seconds", 0) for t in trials), 1),
        "optimizer": config.optimizer if config.mode == "train" else "",
        "cudnn_benchmark": config.cudnn_benchmark, "inference_mode": config.inference_mode,
        "predicted_binding": prediction.get("binding_constraint", ""),
        "batchfit_commit": prediction.get("batchfit_commit", ""), "key": config.key,
        "note": config.note,
    }


def write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, COLUMNS)
    writer.writeheader()
    writer.writerows(rows)
    _write(path, buffer.getvalue())


def write_json(path: Path, data: Any) -> None:
    _write(path, json.dumps(data, indent=1, default=str) + "\n")


def write_trials(path: Path, trials: list[dict[str, Any]]) -> None:
    _write(path, "".join(json.dumps(t, default=str) + "\n" for t in trials))


#: The device tool returns no file over 16 MiB: the bundle stays under this.
BUNDLE_LIMIT_BYTES = 15 << 20


def write_snapshots(path: Path, folder: Path, limit_bytes: int = BUNDLE_LIMIT_BYTES
                    ) -> list[str]:
    """Bundle every file of ``folder`` (snapshots and their configs) into one tarball;
    while it is over ``limit_bytes``, leave out the largest snapshot (its config stays).
    Returns the snapshots left out."""
    left_out: list[str] = []
    tmp = path.with_suffix(".tmp")
    while True:
        files = [f for f in sorted(folder.iterdir()) if f.name not in left_out]
        with tarfile.open(tmp, "w:gz") as tar:
            for file in files:
                tar.add(file, arcname=file.name)
        pickles = [f for f in files if f.suffix == ".pickle"]
        if tmp.stat().st_size <= limit_bytes or not pickles:
            break
        left_out.append(max(pickles, key=lambda f: f.stat().st_size).name)
    tmp.replace(path)
    return left_out


def _write(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def read_previous(folder: Path | None, snapshots_to: Path) -> tuple[list[dict[str, Any]],
                                                                  dict[str, dict[str, Any]]]:
    """The trials and paths of an earlier run's folder; its snapshots unpacked into
    ``snapshots_to``. Nothing when ``folder`` is None or empty."""
    if folder is None or not folder.is_dir():
        return [], {}
    trials = []
    if (folder / "trials.jsonl").exists():
        trials = [json.loads(line) for line in (folder / "trials.jsonl").read_text().splitlines()
                  if line.strip()]
    paths = {}
    if (folder / "paths.json").exists():
        paths = json.loads((folder / "paths.json").read_text()).get("paths", {})
    if (folder / "snapshots.tar.gz").exists():
        with tarfile.open(folder / "snapshots.tar.gz") as tar:
            tar.extractall(snapshots_to, filter="data")
    return trials, paths


def newest_run_folder(results: Path, device_name: str) -> Path | None:
    """The newest ``<device>-<date>`` folder under ``results`` for this device."""
    prefix = slug(device_name) + "-"
    folders = sorted(p for p in results.glob(prefix + "*") if (p / "trials.jsonl").exists())
    return folders[-1] if folders else None
