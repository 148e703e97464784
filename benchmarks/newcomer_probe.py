"""Re-probe of issue 35's items 1, 3, 4, 8, 9 and 11: each input, its exit code and first line.

How it asks batchfit: the CLI in fresh processes, each input's exit code and first line (a
probe, no figure).

Run with the sources under test first on the path, e.g.
``PYTHONPATH=src python benchmarks/newcomer_probe.py`` (``--only SUBSTRING`` runs a subset).
For ``--json`` runs the line shown is the JSON keys the items are about; an interrupt row
sends SIGINT to the command's process group after the delay and shows its exit and the last
line of stderr.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

CLI = [sys.executable, "-c", "from batchfit.cli import main; main()"]
MODEL = textwrap.dedent("""
    import torch
    from torch import nn

    def build_mlp():
        return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
""")
KERAS = textwrap.dedent("""
    import keras

    def dense():
        model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(8)])
        model.compile(optimizer="adam", loss="mse")
        return model
""")
JSON_KEYS = ("fits", "verdict", "memory_bytes", "margin_bytes", "budget_bytes",
             "total_budget_bytes", "total_bytes_at_max", "step_bytes_at_max", "next_batch_size",
             "step_bytes_at_next", "max_batch_size", "gpu_choice", "hf_task")


def cases(tmp: Path) -> list[tuple[str, list[str], float | None]]:
    (tmp / "model.py").write_text(MODEL)
    (tmp / "kmodel.py").write_text(KERAS)
    (tmp / "adir").mkdir(exist_ok=True)
    m, k = f"{tmp}/model.py:build_mlp", f"{tmp}/kmodel.py:dense"
    r18 = "torchvision:resnet18"
    return [
        ("1 verdict T4", ["estimate", r18, "-b", "2048", "--gpu", "T4"], None),
        ("1 verdict T4 json", ["estimate", r18, "-b", "2048", "--gpu", "T4", "--json"], None),
        ("1 verdict 1e8 A100", ["estimate", r18, "-b", "100000000", "--gpu", "A100", "--json"],
         None),
        ("1 fits A100", ["estimate", r18, "-b", "8", "--gpu", "A100"], None),
        ("1 no budget", ["estimate", r18, "-b", "8", "--json"], None),
        ("3 max json", ["max", r18, "--gpu", "A100", "--json"], None),
        ("3 nothing fits json", ["max", m, "--input", "32", "--device", "cpu", "--memory",
                                 "1KiB", "--overhead", "0", "--json"], None),
        ("4 gpu A100", ["estimate", r18, "-b", "8", "--gpu", "A100"], None),
        ("4 gpu V100", ["estimate", r18, "-b", "8", "--gpu", "V100"], None),
        ("4 gpu V100 json", ["estimate", r18, "-b", "8", "--gpu", "V100", "--json"], None),
        ("4 gpu A100 80GB", ["estimate", r18, "-b", "8", "--gpu", "A100 SXM4 80GB"], None),
        ("4 gpu ''", ["estimate", r18, "-b", "8", "--gpu", ""], None),
        ("4 max gpu ''", ["max", r18, "--gpu", ""], None),
        ("4 amp-bf16 V100", ["estimate", r18, "-b", "8", "--gpu", "V100", "--precision",
                             "amp-bf16"], None),
        ("4 bf16 T4", ["max", r18, "--gpu", "T4", "--precision", "bf16"], None),
        ("4 amp-bf16 A100", ["estimate", r18, "-b", "8", "--gpu", "A100", "--precision",
                             "amp-bf16"], None),
        ("4 hf head", ["estimate", "hf:bert-base-uncased", "-b", "2", "--seq-len", "128",
                       "--gpu", "A100 80GB SXM"], None),
        ("4 hf head json", ["estimate", "hf:bert-base-uncased", "-b", "2", "--seq-len", "128",
                            "--gpu", "A100 80GB SXM", "--json"], None),
        ("8 dir as model", ["estimate", f"{tmp}/adir:build", "-b", "2"], None),
        ("8 huge -b", ["estimate", m, "--input", "32", "-b", "99999999999999999999"], None),
        ("8 huge -b max", ["max", m, "--input", "32", "--device", "cpu", "--memory", "1GiB",
                           "-b", "99999999999999999999"], None),
        ("8 bad plot dir", ["estimate", m, "--input", "32", "-b", "2", "--plot",
                            "/nonexistent/dir/x.png"], None),
        ("8 keras bad input", ["estimate", k, "--input", "5", "-b", "2"], None),
        ("8 torch bad input", ["estimate", m, "--input", "5", "-b", "2"], None),
        ("11 bench cpu stderr", ["bench", m, "--input", "32", "--device", "cpu", "--batches",
                                 "1,2", "--time-budget", "4s"], None),
        ("9 SIGINT max bert 4s", ["max", "hf:bert-base-uncased", "--gpu", "A100"], 4.0),
        ("9 SIGINT max bert 7s", ["max", "hf:bert-base-uncased", "--gpu", "A100"], 7.0),
        ("9 SIGINT search 8s", ["search", m, "--input", "32", "--device", "cpu",
                                "--memory-cap", "200MiB"], 8.0),
    ]


def first_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), "")


def summary(args: list[str], proc_out: str, proc_err: str) -> str:
    if "--json" in args:
        try:
            data = json.loads(proc_out)
        except ValueError:
            return f"(no JSON) {first_line(proc_err)}"
        shown = {key: data[key] for key in JSON_KEYS if key in data}
        return json.dumps(shown) + (f" | {first_line(proc_err)}" if proc_err.strip() else "")
    if args[0] == "bench":
        chatter = [line for line in proc_err.splitlines() if "CUDA" in line]
        return f"stderr CUDA lines: {chatter[:1] or 'none'}"
    lines = [line.strip() for line in (proc_out + "\n" + proc_err).splitlines() if line.strip()]
    notes = [line for line in lines if line.startswith(("note:", "error:", "warning: --gpu"))
             or " fit" in line.lower() or "built" in line.lower()]
    return " / ".join(dict.fromkeys([first_line(proc_out + proc_err), *notes[:3]]))


def run(args: list[str], delay: float | None) -> tuple[int, str, str]:
    env = {**os.environ, "COLUMNS": "200"}
    if delay is None:
        done = subprocess.run(CLI + args, capture_output=True, text=True, env=env, timeout=900)
        return done.returncode, done.stdout, done.stderr
    proc = subprocess.Popen(CLI + args, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, start_new_session=True,
                            # a background shell starts jobs with SIGINT ignored, and Python
                            # keeps an ignored SIGINT ignored: restore the default
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    time.sleep(delay)
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole group
    out, err = proc.communicate(timeout=120)
    time.sleep(1)
    # helpers still alive (not zombies waiting for init) in the command's process group
    listing = subprocess.run(["ps", "-o", "pid=,stat=", "-g", str(proc.pid)],
                             capture_output=True, text=True).stdout.splitlines()
    left = [row.split()[0] for row in listing if row.strip() and row.split()[1][0] != "Z"]
    lines = [line for line in err.splitlines() if line.strip()]
    tail = f"{len(lines)} stderr lines, last: {lines[-1] if lines else ''}"
    return proc.returncode, out, tail + (f"; LEFT: {left}" if left else "")


def main() -> None:
    only = sys.argv[sys.argv.index("--only") + 1] if "--only" in sys.argv else ""
    with tempfile.TemporaryDirectory() as tmp:
        for label, args, delay in cases(Path(tmp)):
            if only not in label:
                continue
            code, proc_out, proc_err = run(args, delay)
            text = proc_err if delay is not None else summary(args, proc_out, proc_err)
            print(f"| {label} | {code} | {text.replace(tmp, '<tmp>')[:300]} |", flush=True)


if __name__ == "__main__":
    main()
