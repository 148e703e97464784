"""``--html`` and ``--export-snapshot`` on ``estimate`` and ``max`` (``cli/outputs.py``)."""

from __future__ import annotations

import json
import pickle
import re

import pytest
from typer.testing import CliRunner

from batchfit.cli import app
from batchfit.device.snapshot import read_allocations
from browser import open_page

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
    result = CliRunner().invoke(app, ["estimate", model, "-b", "16", "--gpu", "T4",
                                      "--export-snapshot", str(snapshot), "--html", str(report),
                                      "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    with snapshot.open("rb") as f:
        written = pickle.load(f)
    assert read_allocations(written).peak_reserved_bytes == data["peak_reserved_bytes"]
    assert _embedded(report.read_text()) == data
    # the export given back as the real snapshot of the same step: no difference
    again = CliRunner().invoke(app, ["estimate", model, "-b", "16", "--gpu", "T4",
                                     "--snapshot", str(snapshot), "--json"])
    assert again.exit_code == 0, again.output
    comparison = json.loads(again.stdout)["snapshot_comparison"]
    assert comparison["differences"] == [] and comparison["first_divergence"] is None


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
