"""The web app (``cli/webapp.py``): the form's words, and the page in a real browser.

The browser tests fill the form in Debian's chromium, submit it and read the answer from
the page; the command line, run with the same words in this process, must give the same
JSON. They are slow (each answer is a fresh ``batchfit`` process tracing a model).
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from batchfit.cli import app
from batchfit.cli.webapp import Request, command_words
from browser import open_page, screenshot

FACTORY = '''
from torch import nn


def build():
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 30 * 30, 10)), (3, 32, 32)
'''


def test_words_for_an_estimate():
    request = Request(model="timm:resnet18", gpu="T4", batch_size=8, precision="amp-fp16",
                      mode="infer", seq_len=0, lora="")
    assert command_words(request) == ["estimate", "timm:resnet18", "--batch-size", "8",
                                      "--gpu", "T4", "--precision", "amp-fp16",
                                      "--mode", "infer", "--json"]


def test_words_for_a_largest_batch():
    assert command_words(Request(model="hf:gpt2", gpu="A100", lora="r=8", quant="nf4",
                                 seq_len=512, world_size=0)) == [
        "max", "hf:gpt2", "--gpu", "A100", "--lora", "r=8", "--quant", "nf4",
        "--seq-len", "512", "--json"]
    # a model file replaces the name; on the CPU the memory is the budget
    assert command_words(Request(model="ignored", model_file="/tmp/m.py", factory="make",
                                 memory="2GiB")) == [
        "max", "/tmp/m.py:make", "--memory", "2GiB", "--device", "cpu", "--json"]


def test_output_files_follow_the_target(tmp_path):
    from batchfit.cli.webapp import output_files

    gpu = output_files(["max", "timm:resnet18", "--gpu", "T4", "--json"], tmp_path)
    assert gpu.flags == ["--html", str(tmp_path / "batchfit-report.html"),
                         "--export-snapshot", str(tmp_path / "batchfit-step.pickle")]
    cpu = output_files(["max", "timm:resnet18", "--memory", "1GiB", "--device", "cpu"],
                       tmp_path)
    assert cpu.flags == ["--html", str(tmp_path / "batchfit-report.html")]
    assert cpu.existing("report") is None  # nothing written yet


@pytest.mark.parametrize("request_, message", [
    (Request(), "give a model"),
    (Request(model="timm:resnet18"), "give a GPU, or a memory size"),
])
def test_incomplete_forms_say_what_is_missing(request_, message):
    with pytest.raises(ValueError, match=message):
        command_words(request_)


@pytest.fixture(scope="module")
def server():
    pytest.importorskip("gradio")
    from batchfit.cli.webapp import build_app

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    page = build_app()
    page.queue().launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True,
                        quiet=True)
    yield f"http://127.0.0.1:{port}/"
    page.close()


def _fill(page, values: dict[str, str]) -> None:
    for elem, value in values.items():
        box = page.locator(f"#{elem} textarea, #{elem} input").first
        box.click()
        box.fill(value)
        box.press("Enter" if elem == "gpu" else "Tab")


def _answer(page, timeout_s: float = 300) -> str:
    page.locator("#run").click()
    page.wait_for_function(
        "() => /Peak memory|Largest batch|Nothing fits|Error/.test("
        "document.querySelector('#answer').innerText)", timeout=timeout_s * 1000)
    return page.inner_text("#answer")


def _cli(words: list[str]) -> tuple[int, dict | None, str]:
    result = CliRunner().invoke(app, words)
    try:
        data = json.loads(result.stdout)
    except ValueError:
        data = None
    return result.exit_code, data, result.stderr


@pytest.mark.slow
def test_an_estimate_in_the_browser_equals_the_cli(server, tmp_path):
    with open_page(server) as (page, errors):
        page.wait_for_selector("#model textarea, #model input")
        _fill(page, {"model": "torchvision:resnet18", "gpu": "T4", "batch": "4"})
        text = _answer(page).replace("*", "")
        page.wait_for_selector("#report a", timeout=30_000)
        status = page.input_value("#status textarea")
        downloads = {elem: page.eval_on_selector_all(
            f"#{elem} a", "as => as.map(a => a.href + ' ' + a.download).join(' ')")
            for elem in ("report", "snapshot")}
        page.screenshot(path=str(tmp_path / "ui.png"), full_page=True)
        screenshot(page, "webapp.png")
    assert errors == []
    code, data, _ = _cli(["estimate", "torchvision:resnet18", "--batch-size", "4",
                          "--gpu", "T4", "--json"])
    assert code == 0
    assert f"({data['total_bytes']:,} bytes) on {data['device']['name']}" in text
    # the finished answer's status is the command that gave it, not a stale progress line
    assert status == ("done: batchfit estimate torchvision:resnet18 --batch-size 4 "
                      "--gpu 'NVIDIA Tesla T4'")  # the catalog's name, as the list offers it
    assert "batchfit-report.html" in downloads["report"]
    assert "batchfit-step.pickle" in downloads["snapshot"]


@pytest.mark.slow
def test_a_model_file_upload_answers_as_the_cli(server, tmp_path):
    model_file = tmp_path / "small.py"
    model_file.write_text(FACTORY)
    with open_page(server) as (page, errors):
        page.wait_for_selector("#model-file input[type=file]", state="attached")
        page.set_input_files("#model-file input[type=file]", str(model_file))
        _fill(page, {"gpu": "T4"})
        text = _answer(page).replace("*", "")
    assert errors == []
    code, data, _ = _cli(["max", f"{model_file}:build", "--gpu", "T4", "--json"])
    assert code == 0
    assert f"Largest batch: {data['max_batch_size']} on {data['device']['name']}" in text
    assert f"{data['total_bytes_at_max']:,} bytes needed" in text


@pytest.mark.slow
def test_a_largest_inference_batch_in_the_browser_equals_the_cli(server):
    with open_page(server) as (page, errors):
        page.wait_for_selector("#model textarea, #model input")
        _fill(page, {"model": "torchvision:resnet18", "gpu": "L4"})
        page.locator("#mode label", has_text="infer").click()
        text = _answer(page).replace("*", "")
    assert errors == []
    code, data, _ = _cli(["max", "torchvision:resnet18", "--gpu", "L4", "--mode", "infer",
                          "--json"])
    assert code == 0
    assert f"Largest batch: {data['max_batch_size']} on {data['device']['name']}" in text
    assert f"{data['total_bytes_at_max']:,} bytes needed" in text


@pytest.mark.slow
def test_bad_input_shows_the_cli_line(server):
    with open_page(server) as (page, errors):
        page.wait_for_selector("#model textarea, #model input")
        _fill(page, {"model": "timm:resnet5", "gpu": "T4"})
        text = _answer(page)
    code, _, stderr = _cli(["max", "timm:resnet5", "--gpu", "T4", "--json"])
    assert code == 2 and errors == []
    line = " ".join(stderr.split())
    assert "did you mean 'resnet50'" in line
    assert "(exit 2)" in text and line in " ".join(text.split())


def _children() -> list[int]:
    """This process's child processes (from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == os.getpid():
                found.append(int(entry.name))
    return found


@pytest.mark.slow
def test_cancel_ends_the_command(server):
    with open_page(server) as (page, errors):
        page.wait_for_selector("#model textarea, #model input")
        before = set(_children())
        # a 70B model: each of its traces outlasts the progress delay (cli/progress.py) on
        # a fast machine too, where a 7B model's max can end without a progress line
        _fill(page, {"model": "hf:meta-llama/Llama-2-70b-hf", "gpu": "A100",
                     "memory": "4TiB"})
        page.locator("#run").click()
        deadline = time.time() + 60
        while not set(_children()) - before and time.time() < deadline:
            time.sleep(0.2)
        assert set(_children()) - before, "the command did not start"
        # long work shows progress: the command's own lines ("batchfit max [   5.0 s]: ...")
        page.wait_for_function(
            "() => /batchfit max \\[ *[0-9.]+ s\\]/.test("
            "document.querySelector('#status textarea').value)", timeout=60_000)
        page.locator("#cancel").click()
        deadline = time.time() + 5  # at once: well before its next progress line
        while set(_children()) - before and time.time() < deadline:
            time.sleep(0.2)
    assert not set(_children()) - before, "the cancelled command is still running"


def test_running_stop_ends_the_sessions_command_between_its_lines():
    # a command that writes nothing for a minute: a generator blocked reading its stderr
    # cannot be closed, so Cancel must end the process itself
    import subprocess
    import sys

    from batchfit.cli.webapp import Running

    running = Running()
    quiet = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    running.add("a", quiet)
    running.add("b", other)
    try:
        begin = time.time()
        assert running.stop("a") and quiet.poll() is not None
        assert time.time() - begin < 5
        assert other.poll() is None  # another session's command runs on
        assert not running.stop("a")  # nothing left under "a"
        running.remove("b", other)
        assert not running.stop("b") and other.poll() is None
    finally:
        other.kill()
        other.wait()
