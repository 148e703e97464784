"""The interactive HTML report (``cli/html_report.py``), read in a real headless browser.

Each page is opened from disk in chromium (no network: plotly's JavaScript is inside the
page): it must render every figure with no console error, and the numbers it shows must
be the answer's JSON.
"""

from __future__ import annotations

import json

import pytest
from torch import nn

import batchfit
from batchfit.answers.maxbatch import max_batch_size
from batchfit.cli.html_report import check_html_path, memory_report, unit_for, write_report
from batchfit.cli.report import format_bytes
from batchfit.errors import InvalidInputError
from browser import open_page, screenshot

pytestmark = pytest.mark.slow  # the report read in a real headless browser

pytest.importorskip("plotly")
MiB, GiB = 1 << 20, 1 << 30
SUMMARY = [("largest batch", "max_batch_size"), ("budget", "budget_bytes"),
           ("needed at the answer", "total_bytes_at_max"), ("traces", "traces")]


def _net():
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Flatten(),
                         nn.Linear(16 * 32 * 32, 10))


def _figures(page) -> list[dict]:
    """Each plotly figure's traces, as the browser holds them."""
    return page.evaluate("""() => [...document.querySelectorAll('.js-plotly-plot')].map(
        d => ({title: d.layout.title.text,
               traces: d.data.map(t => ({name: t.name, x: [...t.x], y: [...t.y]}))}))""")


@pytest.mark.slow
def test_max_report_in_a_browser(tmp_path):
    result = max_batch_size(_net(), (3, 32, 32), device="A100", memory_bytes=2 * GiB,
                            optimizer="adamw")
    data = {"model": "net", **result.to_dict()}
    page_html = memory_report("batchfit max net", data, result.estimate_at_max,
                              result.evaluated, result.budget_bytes, SUMMARY)
    path = write_report(page_html, str(tmp_path / "max.html"))
    with open_page(path.as_uri()) as (page, errors):
        page.wait_for_selector(".js-plotly-plot .main-svg")
        embedded = json.loads(page.inner_text("#batchfit-json"))
        cells = page.eval_on_selector_all(
            "td[data-json]", "cs => cs.map(c => [c.dataset.json, c.dataset.value, c.innerText])")
        figures = _figures(page)
        page.screenshot(path=str(tmp_path / "max.png"), full_page=True)
        screenshot(page, "report.png")
    assert errors == []
    assert embedded == json.loads(json.dumps(data))
    assert [(key, json.loads(value)) for key, value, _ in cells] == [
        (key, data[key]) for _, key in SUMMARY]
    shown = {key: text for key, _, text in cells}
    assert shown["budget_bytes"] == format_bytes(result.budget_bytes)
    assert shown["max_batch_size"] == f"{result.max_batch_size:,}"
    # memory vs batch: one marker per traced batch, in the unit the axis names
    traced = next(f for f in figures if f["title"].startswith("Memory against batch"))
    markers, answer = traced["traces"]
    scale, _ = unit_for([b for _, b in result.evaluated] + [result.budget_bytes])
    # the answer: a vertical line from 0 to the top of the data, named
    top = max([n for _, n in result.evaluated] + [result.budget_bytes])
    assert answer == {"name": f"answer {result.max_batch_size:,}",
                      "x": [result.max_batch_size] * 2, "y": [0, pytest.approx(top / scale)]}
    drawn_points = sorted(zip(markers["x"], markers["y"]))
    expected = sorted((b, n / scale) for b, n in result.evaluated)
    assert [b for b, _ in drawn_points] == [b for b, _ in expected]
    assert [y for _, y in drawn_points] == pytest.approx([y for _, y in expected])
    # the segments at the peak: every block drawn, adding up to the peak's reserved bytes
    segments = next(f for f in figures if f["title"].startswith("Segments"))
    peak = result.estimate_at_max.predicted_snapshot()["batchfit"]["peak_segments"]
    scale, _ = unit_for([s["total_size"] for s in peak])
    drawn = sum(x for t in segments["traces"] for x in t["x"])
    assert drawn == pytest.approx(sum(s["total_size"] for s in peak) / scale)
    assert (tmp_path / "max.png").stat().st_size > 10_000


@pytest.mark.slow
def test_cpu_estimate_report_has_no_segments(tmp_path):
    est = batchfit.estimate(_net(), (3, 32, 32), 8, optimizer="sgd")
    data = est.to_dict()
    path = write_report(memory_report("estimate", data, est, summary=[
        ("peak", "total_bytes")]), str(tmp_path / "cpu.html"))
    with open_page(path.as_uri()) as (page, errors):
        page.wait_for_selector(".js-plotly-plot .main-svg")
        titles = [f["title"] for f in _figures(page)]
    assert errors == []
    assert not any(t.startswith("Segments") for t in titles)
    assert any(t.startswith("The step's memory") for t in titles)


def test_units_follow_the_data():
    assert unit_for([3 * GiB, 5 * MiB]) == (GiB, "GiB")
    assert unit_for([500 * MiB]) == (MiB, "MiB")
    assert unit_for([1023]) == (1, "B")
    assert unit_for([]) == (1, "B")


def test_report_path_is_checked_before_any_work(tmp_path):
    with pytest.raises(InvalidInputError, match="does not exist"):
        check_html_path(str(tmp_path / "missing" / "r.html"))
    with pytest.raises(InvalidInputError, match="ending in .html"):
        check_html_path(str(tmp_path / "r.png"))
    check_html_path(str(tmp_path / "r.html"))
