"""The GPU truth kit (``benchmarks/gpu_truth``): its search, its scorer, its predictions
and, end to end, its dry run on the CPU (the pipeline a lent card runs).

Expected values are by hand: the searches run against a threshold oracle fixed here; the
scorer against a CSV written here; the budget against the CUDA allocator's rules (an
sm90 card keeps two 32 MiB cuBLAS workspaces in the allocator)."""

from __future__ import annotations

import ast
import csv
import json
import math
import os
import re
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.gpu_truth.configs import (
    CONFIGS,
    DRY_CONFIGS,
    SNAPSHOT_KEYS,
    Config,
)
from benchmarks.gpu_truth.predict import predictions_path, read_predictions
from benchmarks.gpu_truth.report import outcome, score_csv
from benchmarks.gpu_truth.results import COLUMNS
from benchmarks.gpu_truth.search import BoundarySearch

MIB = 1 << 20
REQUIRED = ("model", "mode", "precision", "layout", "input", "cap_bytes", "boundary",
            "failed_at", "predicted", "device_name", "torch_version", "peak_reserved_bytes",
            "peak_allocated_bytes", "failed_message")


def search_against(threshold: int, predicted: int | None, max_batch: int = 1 << 16
                   ) -> tuple[BoundarySearch, list[int]]:
    """Run a search where batch B fits iff B <= threshold; return it and the batches tried."""
    search = BoundarySearch.seeded(predicted, max_batch)
    tried = []
    while (batch := search.next_batch()) is not None:
        tried.append(batch)
        search.record(batch, {"fits": batch <= threshold})
        assert len(tried) < 60
    return search, tried


# --------------------------------------------------------------------------- the search


def test_an_exact_prediction_takes_two_trials():
    search, tried = search_against(178, 178)
    assert tried == [178, 179] and search.exact and search.boundary == 178


def test_a_prediction_one_above_takes_two_trials_downward():
    search, tried = search_against(177, 178)
    assert tried == [178, 177] and (search.boundary, search.failed_at) == (177, 178)


def test_gallops_up_by_doubling_steps_then_bisects():
    # P = 100: 100, 101 fit; steps of 2% of P doubling: +2 -> 103, +4 -> 107 fails;
    # bisect (103, 107): 105 fits, 106 fits -> exact at 106
    search, tried = search_against(106, 100)
    assert tried == [100, 101, 103, 107, 105, 106]
    assert (search.boundary, search.failed_at) == (106, 107)


def test_nothing_fits_is_boundary_zero():
    search, tried = search_against(0, 3)
    assert tried == [3, 2, 1] and search.boundary == 0 and search.failed_at == 1


def test_a_contradiction_stops_the_search():
    search = BoundarySearch.seeded(10)
    search.record(10, {"fits": True})
    search.record(11, {"fits": True})
    search.record(5, {"fits": False})
    assert search.contradicted and search.done() and search.next_batch() is None


@settings(max_examples=200, deadline=None)
@given(threshold=st.integers(1, 5000), predicted=st.integers(1, 5000))
def test_always_ends_on_the_exact_boundary(threshold, predicted):
    search, tried = search_against(threshold, predicted)
    assert (search.boundary, search.failed_at) == (threshold, threshold + 1)
    assert len(set(tried)) == len(tried)  # no batch runs twice


@settings(max_examples=100, deadline=None)
@given(predicted=st.integers(20, 5000), error=st.floats(-0.05, 0.05))
def test_within_five_percent_costs_a_gallop_and_a_bisection(predicted, error):
    # P, P +/- 1, then steps of 2% and 4% of P reach past 5% (4 trials, a fifth to fail);
    # the bracket left is at most 4% of P wide, bisected in ceil(log2(width)) trials
    threshold = max(1, round(predicted * (1 + error)))
    _, tried = search_against(threshold, predicted)
    assert len(tried) <= 5 + math.ceil(math.log2(0.04 * predicted + 2))


# --------------------------------------------------------------------------- the scorer


def test_scorer_counts_only_exact_rows(tmp_path):
    path = tmp_path / "boundaries.csv"
    rows = [  # (boundary, failed_at, predicted) -> by hand
        (100, 101, 96),   # in: 95 <= 96 <= 100
        (100, 101, 95),   # in: the 95% edge
        (100, 101, 100),  # in: exact
        (100, 101, 101),  # above: predicted >= failed_at
        (100, 101, 94),   # below
        (100, 110, 96),   # not exact: left out
        (0, 1, 3),        # nothing fits: left out
        (50, 51, ""),     # no prediction: left out
    ]
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, ["boundary", "failed_at", "predicted", "device_name",
                                         "torch_version"])
        writer.writeheader()
        for boundary, failed_at, predicted in rows:
            writer.writerow({"boundary": boundary, "failed_at": failed_at,
                             "predicted": predicted, "device_name": "NVIDIA H100 80GB HBM3",
                             "torch_version": "2.11.0+cu130"})
    score = score_csv(path)
    assert (score.rows, score.in_rows, score.above_rows, score.below_rows) == (5, 3, 1, 1)
    assert (score.device, score.stack) == ("NVIDIA H100 80GB HBM3", "torch 2.11.0+cu130")


def test_outcome_edges():
    assert outcome(20, 21, 19) == "in"  # 0.95 * 20 = 19
    assert outcome(20, 21, 18) == "below"
    assert outcome(20, 21, 21) == "above"


# --------------------------------------------------------------------------- configs


def test_the_configuration_list_covers_the_issue():
    assert len(CONFIGS) >= 40 and len({c.key for c in CONFIGS}) == len(CONFIGS)
    models = " ".join(c.model for c in CONFIGS)
    for name in ("convnext_tiny", "resnetv2_101x3_bit", "eva02_large_patch14_448",
                 "seresnet152d", "torchvision:mobilenet_v3_large", "torchvision:efficientnet_b0",
                 "gpt2", "bert", "TinyLlama", "vit_", "lambda_resnet26rpt_256"):
        assert name in models, name
    assert {c.mode for c in CONFIGS} == {"train", "infer"}
    assert {"amp-fp16", "amp-bf16"} <= {c.precision for c in CONFIGS}
    assert {c.layout for c in CONFIGS} == {"nchw", "nhwc"}
    assert {c.cudnn_benchmark for c in CONFIGS} == {True, False}
    assert all(8 * 1024 <= c.cap_mib <= 40 * 1024 for c in CONFIGS)
    assert set(SNAPSHOT_KEYS) <= {c.key for c in CONFIGS} and len(SNAPSHOT_KEYS) == 4


@pytest.mark.parametrize("dry_run", [False, True])
def test_every_row_has_a_committed_prediction_with_its_command(dry_run):
    predictions = read_predictions(predictions_path(dry_run))
    for config in (DRY_CONFIGS if dry_run else CONFIGS):
        row = predictions[config.key]
        assert not row["error"] and int(row["predicted"]) >= 1, config.key
        assert re.fullmatch(r"[0-9a-f]{12}(\+dirty)?", row["batchfit_commit"])
        assert row["command"].startswith("batchfit max ")
        if not dry_run:
            assert "--overhead 0" in row["command"] and "--stack torch2.11+cu130" in row["command"]
            assert f"--memory {config.cap_mib}MiB" in row["command"]


def test_a_prediction_is_stale_when_src_differs_from_its_commit():
    from benchmarks.gpu_truth.predict import src_changed_since

    head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT,
                          capture_output=True, text=True, check=False)
    if head.returncode != 0:
        pytest.skip("not a git checkout")
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "src"], cwd=ROOT,
                           capture_output=True, text=True, check=False).stdout.strip()
    assert src_changed_since(head.stdout.strip()) == bool(dirty)
    assert src_changed_since("0123abc+dirty") and src_changed_since("not-a-commit")
    # the commit before the torch 2.10 cuDNN row of engine/stack.py: src differs since
    assert src_changed_since("3919efb")


def test_the_prediction_is_for_the_cap_alone():
    """The cap limits the caching allocator; the CUDA context lies outside it, the cuBLAS
    and cuBLASLt workspaces (32 MiB each on sm90) inside: budget = cap - 64 MiB."""
    from typer.testing import CliRunner

    from batchfit.cli import app

    config = Config("torchvision:mobilenet_v3_small", "3x32x32", precision="fp32",
                    optimizer="sgd", cap_mib=512)
    result = CliRunner().invoke(app, config.max_argv())
    assert result.exit_code == 0, result.output
    answer = json.loads(result.stdout)
    assert answer["budget_bytes"] == 512 * MIB - 64 * MIB
    assert answer["device"]["context_bytes"] == 0


def test_the_kit_imports_only_what_the_device_has():
    """The device has torch, torchvision, timm, transformers, lightning and batchfit's own
    needs, not the virtualenv here (KINDS.md)."""
    allowed = {"torch", "torchvision", "timm", "transformers", "lightning", "batchfit",
               "benchmarks", "typer"} | set(sys.stdlib_module_names)
    for path in (ROOT / "benchmarks" / "gpu_truth").glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0
                     else [])
            for name in names:
                assert name.split(".")[0] in allowed, f"{path.name} imports {name}"


# --------------------------------------------------------------------------- dry run


def run_kit(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": "src"}
    env.pop("OUT", None)
    return subprocess.run([sys.executable, "-m", "benchmarks.gpu_truth", *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=timeout, check=False)


def read_csv(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as handle:
        return list(csv.DictReader(handle))


def test_the_documented_device_command_fits_the_tool():
    (command,) = re.findall(r"```\n(set -o pipefail;[^\n]*)\n```",
                            (ROOT / "docs" / "accuracy-notes.md").read_text())
    assert len(command) < 2000  # the device tool's limit
    assert "python3 -m benchmarks.gpu_truth --budget-s 480" in command
    assert "PYTHONPATH=src" in command and "$OUT/kit.log" in command


def test_help_needs_no_torch():
    """``--help`` answers before anything heavy is imported (the device command's check)."""
    code = ("import sys; sys.modules['torch'] = None; "
            "from benchmarks.gpu_truth.run import main; main(['--help'])")
    done = subprocess.run([sys.executable, "-c", code],
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": "src"},
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0 and "--budget-s" in done.stdout


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a card is here")
def test_without_a_card_the_kit_says_so_in_one_line(tmp_path):
    done = run_kit("--out", str(tmp_path / "out"), "--budget-s", "30", timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    (line,) = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert "no CUDA device" in line and "--dry-run" in line
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_dry_run_end_to_end_resume_and_budget(tmp_path):
    first, second, third = tmp_path / "first", tmp_path / "second", tmp_path / "third"
    gpt2 = re.escape(DRY_CONFIGS[2].key)

    done = run_kit("--dry-run", "--out", str(first), "--only", gpt2, "--budget-s", "150")
    assert done.returncode == 0, done.stderr[-2000:]
    rows = read_csv(first / "boundaries.csv")
    assert set(REQUIRED) <= set(rows[0]) and list(rows[0]) == list(COLUMNS)
    (row,) = rows
    boundary, failed_at = int(row["boundary"]), int(row["failed_at"])
    assert row["status"] == "exact" and failed_at == boundary + 1 and boundary >= 1
    assert row["predicted"] == read_predictions(predictions_path(True))[row["key"]]["predicted"]
    trials = [json.loads(line) for line in (first / "trials.jsonl").read_text().splitlines()]
    runs = {(t["batch_size"], t["fits"]) for t in trials if t["job"] == "boundary"}
    assert {(boundary, True), (failed_at, False)} <= runs
    assert int(row["peak_reserved_bytes"]) > 0 and row["failed_kind"] == "memory"
    assert "can't allocate memory" in row["failed_message"]
    paths = json.loads((first / "paths.json").read_text())["paths"]
    assert paths["estimate:cpu"]["status"] == "ok"
    assert paths["estimate:cpu"]["answer"]["batch_size"] == 2
    with tarfile.open(first / "snapshots.tar.gz") as tar:
        (member,) = [m for m in tar.getnames() if m.endswith(".json")]
        record = json.load(tar.extractfile(member))
    assert record["config"]["key"] == row["key"] and record["batch_size"] == boundary
    run = json.loads((first / "run.json").read_text())
    assert run["final"] is True
    assert run["device"]["batchfit_path"] == str(ROOT / "src" / "batchfit")  # not the venv's

    # resume: the row is done, so no trial runs again and the rows are the same
    done = run_kit("--dry-run", "--out", str(second), "--resume-from", str(first), "--only",
                   gpt2, "--parts", "boundaries,snapshots", "--budget-s", "60")
    assert done.returncode == 0, done.stderr[-2000:]
    assert (second / "trials.jsonl").read_text() == (first / "trials.jsonl").read_text()
    assert read_csv(second / "boundaries.csv") == rows
    assert json.loads((second / "run.json").read_text())["resumed_from"] == str(first)

    # the budget: a row that needs many trials stops at it, cleanly, with what it has
    start = time.monotonic()
    done = run_kit("--dry-run", "--out", str(third), "--only",
                   re.escape(DRY_CONFIGS[0].key), "--parts", "boundaries", "--budget-s", "12")
    assert done.returncode == 0, done.stderr[-2000:]
    run = json.loads((third / "run.json").read_text())
    assert run["final"] is True and run["elapsed_s"] < 12 + 5
    assert time.monotonic() - start < 12 + 60  # the imports, then at most the budget
    rows = read_csv(third / "boundaries.csv")
    assert all(r["status"] == "open" for r in rows)


def test_the_snapshot_bundle_leaves_out_the_largest_snapshot_over_the_limit(tmp_path):
    from benchmarks.gpu_truth.results import write_snapshots

    folder = tmp_path / "snapshots"
    folder.mkdir()
    (folder / "big.pickle").write_bytes(os.urandom(200_000))  # random: gzip cannot shrink it
    (folder / "small.pickle").write_bytes(os.urandom(20_000))
    (folder / "big.json").write_text("{}")
    left_out = write_snapshots(tmp_path / "bundle.tar.gz", folder, limit_bytes=100_000)
    assert left_out == ["big.pickle"]
    with tarfile.open(tmp_path / "bundle.tar.gz") as tar:
        assert sorted(tar.getnames()) == ["big.json", "small.pickle"]


def test_the_snapshot_diff_sets_a_recorded_step_against_the_prediction(tmp_path):
    """A run folder with one snapshot made by hand (the documented format: a 20 MiB
    segment, one 4 MiB allocation made and freed): the diff runs ``estimate --snapshot``
    for the row's step, and reads back the real peaks counted here."""
    import pickle

    from benchmarks.gpu_truth.snapshot_diff import diff_run

    config = DRY_CONFIGS[2]
    snapshot = {"segments": [{"total_size": 20 * MIB, "blocks": [
        {"size": 20 * MIB, "state": "inactive"}]}], "device_traces": [[
            {"action": "segment_alloc", "addr": 0, "size": 20 * MIB},
            {"action": "alloc", "addr": 0, "size": 4 * MIB, "frames": []},
            {"action": "free_completed", "addr": 0, "size": 4 * MIB, "frames": []}]]}
    folder = tmp_path / "snapshots"
    folder.mkdir()
    (folder / "row.pickle").write_bytes(pickle.dumps(snapshot))
    (folder / "row.json").write_text(json.dumps({"config": config.to_dict(), "batch_size": 2}))
    with tarfile.open(tmp_path / "snapshots.tar.gz", "w:gz") as tar:
        for file in folder.iterdir():
            tar.add(file, arcname=file.name)
    result = diff_run(tmp_path)[config.key]
    assert "--snapshot" in result["command"] and "--overhead 0" in result["command"]
    comparison = result["comparison"]
    assert comparison["real_peak_allocated_bytes"] == 4 * MIB
    assert comparison["real_peak_reserved_bytes"] == 20 * MIB
    assert comparison["predicted_peak_allocated_bytes"] > 0
