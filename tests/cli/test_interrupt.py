"""Ctrl-C: exit 130, one line, every time, and no helper process left (issue 35, item 9).

Real SIGINTs to real ``batchfit`` processes at several points of their work: to the whole
process group, as a terminal's Ctrl-C sends it (helpers included), and to the command's
process alone, as ``kill -INT`` does (its helpers must still end with it).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    # wide enough that the boundary under the 200 MiB cap is a few thousand and the search
    # settles it in fresh interpreters: it runs far past the last delay on any machine
    path = tmp_path_factory.mktemp("interrupt") / "model.py"
    path.write_text("from torch import nn\n\n"
                    "def mlp():\n"
                    "    return nn.Sequential(nn.Linear(32, 4096), nn.ReLU(), nn.Linear(4096, 4))\n")
    return path


def _alive_in_group(pgid: int) -> list[str]:
    """Processes of the group that still run (zombies waiting for init are done)."""
    listing = subprocess.run(["ps", "-o", "pid=,stat=", "-g", str(pgid)],
                             capture_output=True, text=True).stdout.splitlines()
    return [row.split()[0] for row in listing if row.strip() and row.split()[1][0] != "Z"]


def interrupt(args: list[str], delay_s: float, *, group: bool) -> tuple[int, list[str], list[str]]:
    """Run ``batchfit ARGS``, SIGINT it after ``delay_s`` (while it still runs); its exit
    status, stderr lines and the processes of its group alive 2 s later."""
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    proc = subprocess.Popen(
        [sys.executable, "-c", "from batchfit.cli import main; main()", *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        start_new_session=True,  # its own group, as a shell's job
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    time.sleep(delay_s)
    assert proc.poll() is None, f"finished before {delay_s} s: the check would be void"
    if group:
        os.killpg(proc.pid, signal.SIGINT)
    else:
        os.kill(proc.pid, signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    deadline = time.monotonic() + 2
    while (left := _alive_in_group(proc.pid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    # progress lines (stderr is not a terminal: issue 35 item 10) may come before the
    # interrupt's own line; what the interrupt prints is that line alone
    lines = [line for line in stderr.splitlines()
             if line.strip() and not line.startswith("batchfit ")]
    return proc.returncode, lines, left


def test_the_handler_is_in_place_once_the_cli_package_is_imported():
    # the entry point imports batchfit.cli (typer, rich, the commands) before main runs:
    # a Ctrl-C during those imports must already get the one line and exit 130
    code = ("import signal, batchfit.cli.interrupt as i, batchfit.cli\n"
            "print(signal.getsignal(signal.SIGINT) is i._interrupted)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(SRC)}, check=True, timeout=120)
    assert done.stdout.strip() == "True"


@pytest.mark.parametrize("delay_s", [0.5, 2.0, 5.0])
def test_ctrl_c_during_max(delay_s):
    # importing, building, tracing: a 7B model's traces take far longer than the last
    # delay on any machine (a small model can finish first on an idle one, voiding the check)
    code, lines, left = interrupt(["max", "hf:meta-llama/Llama-2-7b-hf", "--gpu",
                                   "A100 80GB SXM"], delay_s, group=True)
    assert code == 130 and lines == ["interrupted"] and left == []


@pytest.mark.parametrize(("delay_s", "group"), [(1.0, True), (6.0, True), (9.0, True),
                                                 (6.0, False)])
def test_ctrl_c_during_search(model_file, delay_s, group):
    # the predicted search, then its trial server, template, trial children and fresh
    # interpreters: none may print a traceback or outlive the command
    code, lines, left = interrupt(["search", f"{model_file}:mlp", "--input", "32", "--device",
                                   "cpu", "--memory-cap", "200MiB"], delay_s, group=group)
    assert code == 130 and lines == ["interrupted"] and left == []
