"""The docs site: generated reference pages, the accuracy page, and a strict build."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def hooks():
    return _load(ROOT / "docs" / "hooks" / "reference.py", "docs_reference_hook")


@pytest.fixture(scope="module")
def accuracy_page():
    return _load(ROOT / "benchmarks" / "accuracy_page.py", "accuracy_page")


def test_cli_reference_is_generated_from_the_typer_app(hooks):
    text = hooks.cli_reference_markdown()
    for command in ("estimate", "max", "search", "serve", "plan", "bench", "gpus"):
        assert f"## `batchfit {command}`" in text
    # an option with its help, read from the declaration, not written into the page
    assert "| `--batch-size`, `-b` | the batch size |" in text
    page = (ROOT / "docs" / "reference" / "cli.md").read_text()
    assert hooks.CLI_MARKER in page and "--batch-size" not in page


def test_api_reference_has_a_directive_per_public_name(hooks):
    import batchfit

    text = hooks.api_reference_markdown()
    assert "::: batchfit.api.max_batch_size" in text
    assert "::: batchfit.engine.spec.TrainConfig" in text
    assert text.count(":::") == len(batchfit.__all__)


def test_accuracy_page_names_each_result_its_command_and_date(accuracy_page):
    text = accuracy_page.page()
    for result in (ROOT / "benchmarks" / "results").glob("*.md"):
        assert f"## {result.stem}\n" in text
    assert "Command: `python benchmarks/accuracy_cpu.py` · result: " \
        "`benchmarks/results/accuracy_cpu.md` · date: 20" in text
    # the command a table states is the one shown
    assert "Command: `python benchmarks/noise_closed_form.py --seeds 100`" in text
    # the real-GPU brackets: the latest training and inference tables of gpu_brackets.py
    brackets = [line for line in text.splitlines()
                if line.startswith("Command: `python benchmarks/gpu_brackets.py`")]
    assert len(brackets) >= 2


def test_accuracy_page_names_a_result_s_script_by_prefix(accuracy_page):
    results = accuracy_page.RESULTS
    assert accuracy_page.script_for(results / "llm_published_vllm.md") == \
        "benchmarks/llm_published.py"
    assert accuracy_page.script_for(results / "gpu_brackets" / "cards.md") == \
        "benchmarks/gpu_brackets_cards.py"
    assert accuracy_page.script_for(results / "gpu_brackets" / "s14_T60.md") == \
        "benchmarks/gpu_brackets.py"


def test_accuracy_page_turns_links_beside_a_result_into_repository_paths(accuracy_page):
    result = accuracy_page.RESULTS / "noise_tradeoff.md"
    text = accuracy_page.repository_links("see ![the plot](noise_tradeoff.png) and "
                                          "[docs](https://example.org)", result)
    assert text == ("see the plot (`benchmarks/results/noise_tradeoff.png`) and "
                    "[docs](https://example.org)")


def _site_copy(tmp_path: Path) -> Path:
    """mkdocs.yml and docs/ in a scratch folder."""
    site = tmp_path / "repo"
    site.mkdir()
    shutil.copy(ROOT / "mkdocs.yml", site / "mkdocs.yml")
    shutil.copytree(ROOT / "docs", site / "docs", ignore=shutil.ignore_patterns("accuracy.md"))
    for name in ("src", "benchmarks"):
        (site / name).symlink_to(ROOT / name)
    return site


def _build(site: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict",
                           "-d", str(site / "site")], cwd=site, env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_docs_build_strict(tmp_path):
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings")
    site = _site_copy(tmp_path)
    run = _build(site)
    assert run.returncode == 0, run.stderr[-3000:]
    cli = (site / "site" / "reference" / "cli" / "index.html").read_text()
    assert "batchfit estimate" in cli and "--batch-size" in cli
    api = (site / "site" / "reference" / "api" / "index.html").read_text()
    assert "max_batch_size" in api
    accuracy = (site / "site" / "accuracy" / "index.html").read_text()
    assert "accuracy_cpu" in accuracy


@pytest.mark.slow
def test_docs_build_fails_on_a_broken_link(tmp_path):
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings")
    site = _site_copy(tmp_path)
    index = site / "docs" / "index.md"
    index.write_text(index.read_text() + "\n[gone](guides/no-such-page.md)\n")
    run = _build(site)
    assert run.returncode != 0
    assert "no-such-page.md" in run.stderr
