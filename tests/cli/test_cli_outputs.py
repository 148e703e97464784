"""``--html`` and ``--export-snapshot`` on ``estimate`` and ``max`` (``cli/outputs.py``)."""

from __future__ import annotations

import json
import pickle
import re

import pytest
from typer.testing import CliRunner

from batchfit.cli import app
from batchfit.device.snapshot import read_allocations
from browser import open_page, screenshot

FACTORY = '''
from torch import nn


def build():
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 30 * 30, 10)), (3, 32, 32)
'''


@pytest.fixture
def model(tmp_path):
    path = tmp_path / "small.py"
    path.write_text(FACTORY)
    return f"{path}:build"


def _embedded(page_text: str) -> dict:
    found = re.search(r'<script type="application/json" id="batchfit-json">(.*?)</script>',
                      page_text, re.S)
    return json.loads(found.group(1).replace("<\\/", "</"))


def test_estimate_writes_a_snapshot_and_a_report(model, tmp_path):
    snapshot, report = tmp_path / "step.pickle", tmp_path / "step.html"
    result = CliRunner().invoke(app, ["estimate", model, "-b", "64", "--gpu", "T4",
                                      "--export-snapshot", str(snapshot), "--html", str(report),
                                      "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    with snapshot.open("rb") as f:
        written = pickle.load(f)
    assert read_allocations(written).peak_reserved_bytes == data["peak_reserved_bytes"]
    assert _embedded(report.read_text()) == data
    # the export given back as the real snapshot of the same step: no difference
    again = CliRunner().invoke(app, ["estimate", model, "-b", "64", "--gpu", "T4",
                                     "--snapshot", str(snapshot), "--json"])
    assert again.exit_code == 0, again.output
    comparison = json.loads(again.stdout)["snapshot_comparison"]
    assert comparison["differences"] == [] and comparison["first_divergence"] is None
    diff = json.loads(again.stdout)["snapshot_diff"]
    assert diff["lacking"] == [] and diff["adding"] == [] and diff["slack_difference_bytes"] == 0
    assert diff["matched_allocations"] == comparison["real_allocations"] > 0
    text = CliRunner().invoke(app, ["estimate", model, "-b", "64", "--gpu", "T4",
                                    "--snapshot", str(snapshot)])
    assert text.exit_code == 0, text.output
    assert f"all {diff['matched_allocations']} allocations >= 1.0 MiB match, in order" in " ".join(
        text.stdout.split())


def _with_a_workspace(snapshot: dict, size: int) -> dict:
    """``snapshot`` with one more allocation at the end of its window, as a real GPU's
    cuDNN workspace would be: in a segment of its own, freed, the segment kept."""
    frames = [{"filename": "/x/site-packages/torch/nn/modules/conv.py", "line": 456,
               "name": "_conv_forward"}, {"filename": "/home/me/small.py", "line": 5,
                                          "name": "forward"}]
    address = max(s["address"] + s["total_size"] for s in snapshot["segments"]) + (2 << 20)
    snapshot["device_traces"][0] += [
        {"action": "segment_alloc", "addr": address, "size": size},
        {"action": "alloc", "addr": address, "size": size, "frames": frames},
        {"action": "free_requested", "addr": address, "size": size},
        {"action": "free_completed", "addr": address, "size": size}]
    snapshot["segments"].append({"device": 0, "address": address, "total_size": size,
                                 "blocks": [{"size": size, "state": "inactive"}]})
    return snapshot


def test_a_real_only_allocation_is_named_by_its_frames(model, tmp_path):
    exported = tmp_path / "predicted.pickle"
    result = CliRunner().invoke(app, ["estimate", model, "-b", "16", "--gpu", "T4",
                                      "--export-snapshot", str(exported)])
    assert result.exit_code == 0, result.output
    with exported.open("rb") as f:
        real = _with_a_workspace(pickle.load(f), 24 << 20)
    real_path = tmp_path / "real.pickle"
    real_path.write_bytes(pickle.dumps(real))
    again = CliRunner().invoke(app, ["estimate", model, "-b", "16", "--gpu", "T4",
                                     "--snapshot", str(real_path), "--json"])
    assert again.exit_code == 0, again.output
    diff = json.loads(again.stdout)["snapshot_diff"]
    assert diff["lacking"] == [{"module": "small.py:5 forward", "op": "conv._conv_forward",
                                "count": 1, "total_bytes": 24 << 20}]
    assert diff["adding"] == []
    text = CliRunner().invoke(app, ["estimate", model, "-b", "16", "--gpu", "T4",
                                    "--snapshot", str(real_path)])
    lines = " ".join(text.stdout.split())
    assert "Allocations the prediction lacks (real only): 24.0 MiB" in lines
    assert "small.py:5 forward" in lines and "conv._conv_forward" in lines


def test_text_output_says_what_was_written(model, tmp_path):
    report = tmp_path / "r.html"
    result = CliRunner().invoke(app, ["estimate", model, "-b", "4", "--gpu", "T4",
                                      "--html", str(report)])
    assert result.exit_code == 0, result.output
    assert f"report written to {report}" in result.stdout and report.stat().st_size > 100_000


@pytest.mark.parametrize(("extra", "message"), [
    (["--html", "/nonexistent/folder/r.html"], "does not exist"),
    (["--html", "REPORT.png"], "ending in .html"),
    (["--export-snapshot", "/nonexistent/folder/s.pickle"], "does not exist"),
    (["--export-snapshot", "s.pickle", "--world-size", "2"], "leave out --world-size"),
])
def test_bad_output_paths_are_refused_before_any_work(model, extra, message):
    result = CliRunner().invoke(app, ["estimate", model, "-b", "4", "--gpu", "T4", *extra])
    assert result.exit_code == 2
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_max_report_in_a_browser_equals_the_json(model, tmp_path):
    report = tmp_path / "max.html"
    result = CliRunner().invoke(app, ["max", model, "--gpu", "T4", "--html", str(report),
                                      "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    with open_page(report.as_uri()) as (page, errors):
        page.wait_for_selector(".js-plotly-plot .main-svg")
        cells = dict(page.eval_on_selector_all(
            "td[data-json]", "cs => cs.map(c => [c.dataset.json, JSON.parse(c.dataset.value)])"))
        figures = page.eval_on_selector_all(".js-plotly-plot", "ds => ds.length")
    assert errors == []
    assert cells["max_batch_size"] == data["max_batch_size"]
    assert cells["budget_bytes"] == data["budget_bytes"]
    assert cells["total_bytes_at_max"] == data["total_bytes_at_max"]
    assert figures == 5  # memory vs batch, breakdown, modules, timeline, segments


@pytest.mark.slow
def test_the_report_shows_the_diff_as_the_json(tmp_path, monkeypatch):
    (tmp_path / "small.py").write_text(FACTORY)
    monkeypatch.chdir(tmp_path)  # the page's title names the model as a user would
    model = "small.py:build"
    exported, report = tmp_path / "predicted.pickle", tmp_path / "diff.html"
    result = CliRunner().invoke(app, ["estimate", model, "-b", "64", "--gpu", "T4",
                                      "--export-snapshot", str(exported)])
    assert result.exit_code == 0, result.output
    with exported.open("rb") as f:
        real = _with_a_workspace(pickle.load(f), 24 << 20)
    real_path = tmp_path / "real.pickle"
    real_path.write_bytes(pickle.dumps(real))
    again = CliRunner().invoke(app, ["estimate", model, "-b", "64", "--gpu", "T4", "--snapshot",
                                     str(real_path), "--html", str(report), "--json"])
    assert again.exit_code == 0, again.output
    data = json.loads(again.stdout)
    diff = data["snapshot_diff"]
    with open_page(report.as_uri()) as (page, errors):
        page.wait_for_selector(".js-plotly-plot .main-svg")
        cells = dict(page.eval_on_selector_all(
            "td[data-json]", "cs => cs.map(c => [c.dataset.json, JSON.parse(c.dataset.value)])"))
        bars = page.evaluate("""() => [...document.querySelectorAll('.js-plotly-plot')]
            .filter(d => d.layout.title.text.startsWith('Against the real snapshot'))
            .map(d => d.data.map(t => ({name: t.name, x: [...t.x], y: [...t.y]})))""")
        screenshot(page, "report-diff.png")
    assert errors == []
    for key in ("real_slack_bytes", "predicted_slack_bytes", "lacking_bytes", "adding_bytes",
                "matched_allocations"):
        assert cells[f"snapshot_diff.{key}"] == diff[key]
    for key in ("real_peak_allocated_bytes", "real_peak_reserved_bytes"):
        assert cells[f"snapshot_comparison.{key}"] == data["snapshot_comparison"][key]
    # one bar: the 24 MiB the prediction lacks, named by its op and the model's line
    assert bars == [[{"name": "the prediction lacks (real only)", "x": [24.0],
                      "y": ["conv._conv_forward in small.py:5 forward"]}]]
