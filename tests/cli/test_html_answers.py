"""``--html`` on ``bench``, ``plan`` and ``serve`` (``cli/html_answers.py``), read in a real
headless browser: no console error, and the numbers on the page are the command's JSON."""

from __future__ import annotations

import json
import math
import re

import pytest
from browser import open_page, screenshot
from typer.testing import CliRunner

from batchfit.cli import app

pytest.importorskip("plotly")

FACTORY = '''
from torch import nn


def build():
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 30 * 30, 10)), (3, 32, 32)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.act = nn.Linear(256, 256), nn.ReLU()

    def forward(self, x):
        return self.act(self.fc(x))


def blocks():
    return nn.Sequential(*[Block() for _ in range(4)], nn.Linear(256, 10)), (256,)
'''


@pytest.fixture
def models(tmp_path, monkeypatch):
    """The models' file, named from the test's own folder (as a user names it, and as the
    pages' titles show it)."""
    (tmp_path / "small.py").write_text(FACTORY)
    monkeypatch.chdir(tmp_path)
    return "small.py"


def _run(words: list[str]) -> dict:
    result = CliRunner().invoke(app, [*words, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def _read(path, png: str) -> tuple[dict, list[dict], list[str]]:
    """The summary cells (JSON key: value), each figure's traces, and the console errors."""
    with open_page(path.as_uri()) as (page, errors):
        page.wait_for_selector(".js-plotly-plot .main-svg")
        cells = dict(page.eval_on_selector_all(
            "td[data-json]", "cs => cs.map(c => [c.dataset.json, JSON.parse(c.dataset.value)])"))
        figures = page.evaluate("""() => [...document.querySelectorAll('.js-plotly-plot')].map(
            d => ({title: d.layout.title.text,
                   traces: d.data.map(t => ({name: t.name, x: [...t.x], y: [...t.y]}))}))""")
        screenshot(page, png)
    return cells, figures, errors


def _nested(data: dict, key: str):
    for part in key.split("."):
        data = data[part]
    return data


@pytest.mark.slow
def test_bench_report_shows_the_throughput_and_the_knee(models, tmp_path):
    report = tmp_path / "bench.html"
    data = _run(["bench", f"{models}:build", "--gpu", "A100 80GB SXM", "--predict",
                 "--html", str(report)])
    cells, figures, errors = _read(report, "report-bench.png")
    assert errors == []
    assert cells == {key: data[key] for key in (
        "recommended_batch_size", "knee_batch_size", "best_batch_size", "best_samples_per_s",
        "max_batch_size", "memory_bytes")}
    (curve,) = figures
    throughput, *marks = curve["traces"]
    assert throughput == {"name": "samples per second",
                          "x": [p["batch_size"] for p in data["points"]],
                          "y": [p["samples_per_s"] for p in data["points"]]}
    # the knee, the recommended batch and the largest that fits, each a vertical line
    top = max(p["samples_per_s"] for p in data["points"])
    assert marks == [{"name": f"{label} {data[key]:,}", "x": [data[key]] * 2, "y": [0, top]}
                     for label, key in (("knee", "knee_batch_size"),
                                        ("recommended", "recommended_batch_size"),
                                        ("largest that fits", "max_batch_size"))]


@pytest.mark.slow
def test_plan_report_shows_each_layout(models, tmp_path):
    report = tmp_path / "plan.html"
    data = _run(["plan", f"{models}:blocks", "--gpus", "4xT4", "--global-batch", "64",
                 "--strategies", "ddp,zero3", "--checkpointing", "off", "--offload", "none",
                 "--html", str(report)])
    cells, figures, errors = _read(report, "report-plan.png")
    assert errors == []
    for key in ("gpu", "world_size", "global_batch_size", "best.strategy",
                "best.micro_batch_size", "best.memory_per_gpu_bytes", "best.step_s"):
        assert cells[key] == _nested(data, key)
    memory, time = figures
    (bars,) = memory["traces"]
    assert bars["x"] == [row["strategy"] for row in data["layouts"]] == ["ddp", "zero3"]
    memory_bytes = [row["memory_per_gpu_bytes"] for row in data["layouts"]]
    unit = 2**30 if max(memory_bytes) >= 2**30 else 2**20  # the axis: GiB from 1 GiB up
    assert bars["y"] == pytest.approx([n / unit for n in memory_bytes])
    steps = next(t for t in time["traces"] if t["name"] == "step")
    assert steps["y"] == [row["step_s"] for row in data["layouts"]]


@pytest.mark.slow
def test_serve_report_shows_capacity_against_context(tmp_path):
    report = tmp_path / "serve.html"
    data = _run(["serve", "hf:Qwen/Qwen2.5-0.5B", "--gpu", "L4", "--html", str(report)])
    cells, figures, errors = _read(report, "report-serve.png")
    assert errors == []
    assert cells == {key: data[key] for key in (
        "engine", "max_model_len", "max_concurrency", "kv_cache_bytes", "kv_bytes_per_token",
        "kv_tokens", "weights_bytes")}
    split, curve = figures
    gib = 2**30
    assert split["traces"][0]["x"] == pytest.approx([data[k] / gib for k in (
        "kv_cache_bytes", "non_torch_bytes", "activation_peak_bytes", "weights_bytes")])
    (line,) = curve["traces"]
    assert line["x"] == [c["max_model_len"] for c in data["concurrency_by_context"]]
    assert line["y"] == [c["max_concurrency"] for c in data["concurrency_by_context"]]


def test_serve_capacity_against_context_by_hand():
    data = _run(["serve", "hf:Qwen/Qwen2.5-0.5B", "--gpu", "L4", "--max-model-len", "8192",
                 "--model-kwargs", "num_hidden_layers=2"])
    # One full-attention group: a request of L tokens needs ceil(L / 16) blocks of 16
    # tokens (vLLM's max_memory_usage_bytes), whatever L, from the same num_blocks.
    expected = [{"max_model_len": tokens,
                 "max_concurrency": round(data["num_blocks"] / math.ceil(tokens / 16), 4)}
                for tokens in (1024, 2048, 4096, 8192)]
    assert data["concurrency_by_context"] == expected
    assert expected[-1]["max_concurrency"] == data["max_concurrency"]


@pytest.mark.parametrize("words", [
    ["bench", "{models}:build", "--gpu", "T4", "--predict"],
    ["plan", "{models}:blocks", "--gpus", "2xT4", "--global-batch", "8"],
    ["serve", "hf:Qwen/Qwen2.5-0.5B", "--gpu", "L4"],
])
def test_a_bad_report_path_is_refused_before_any_work(models, words):
    words = [w.replace("{models}", models) for w in words]
    result = CliRunner().invoke(app, [*words, "--html", "REPORT.png"])
    assert result.exit_code == 2
    assert "--html REPORT.png: give a file name ending in .html" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_text_output_says_where_the_report_is(models, tmp_path):
    report = tmp_path / "bench.html"
    result = CliRunner().invoke(app, ["bench", f"{models}:build", "--gpu", "T4", "--predict",
                                      "--html", str(report)])
    assert result.exit_code == 0, result.output
    assert f"report written to {report}" in result.stdout
    # offline: no script is fetched, plotly is inside the page
    page = report.read_text()
    assert re.search(r"<script[^>]*\bsrc=", page) is None and "Plotly.newPlot" in page


def test_a_measured_bench_says_so(models, tmp_path):
    report = tmp_path / "bench.html"
    data = _run(["bench", f"{models}:build", "--device", "cpu", "--memory", "1GiB",
                 "--batches", "1,2", "--time-budget", "20s", "--html", str(report)])
    page = report.read_text()
    assert "predicted" not in data
    assert "batchfit: throughput measured on this device." in page
    assert "a prediction from a traced step" not in page


@pytest.mark.slow
def test_screenshots_go_where_the_variable_says(tmp_path, monkeypatch):
    page_file = tmp_path / "p.html"
    page_file.write_text("<!DOCTYPE html><html><body><h1>batchfit</h1></body></html>")
    with open_page(page_file.as_uri()) as (page, _):
        monkeypatch.delenv("BATCHFIT_SCREENSHOTS", raising=False)
        assert screenshot(page, "none.png") is None
        monkeypatch.setenv("BATCHFIT_SCREENSHOTS", str(tmp_path / "shots"))
        path = screenshot(page, "page.png")
    assert path == tmp_path / "shots" / "page.png"
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
