"""The CLI with Keras 3 model files: the model's own compiled optimizer and loss, Keras layer
names in the JSON, and one clear line for a Keras model batchfit cannot trace (another
backend, no optimizer)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from batchfit.cli import app

runner = CliRunner()
SRC = Path(__file__).resolve().parents[2] / "src"


def invoke(*args: str):
    return runner.invoke(app, list(args))


def test_keras_estimate_uses_the_compiled_optimizer_and_keras_names(keras_file):
    result = invoke("estimate", f"{keras_file}:cnn", "-b", "16", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    # by hand: stem 3*3*3*8+8 = 224, classifier (14*14*8)*10+10 = 15,690 weights;
    # SGD with momentum keeps one float32 momentum per weight (+ Keras's iteration count
    # and learning rate, 4 bytes each)
    weights = 224 + 14 * 14 * 8 * 10 + 10
    assert data["by_category"]["parameters"] == weights * 4
    assert data["by_category"]["optimizer_state"] == weights * 4 + 8
    assert data["top_modules"] and {m["module"] for m in data["top_modules"]} <= {
        "stem", "flatten", "classifier", "<root>", ""}


def test_keras_explicit_optimizer_replaces_the_compiled_one(keras_file):
    result = invoke("estimate", f"{keras_file}:cnn", "-b", "16", "--optimizer", "adam",
                    "--json")
    assert result.exit_code == 0, result.output
    weights = 224 + 14 * 14 * 8 * 10 + 10
    # Keras Adam: two float32 slots per weight, plus the iteration count and learning rate
    assert json.loads(result.stdout)["by_category"]["optimizer_state"] == 2 * weights * 4 + 8


def test_uncompiled_keras_model_without_optimizer_is_one_line(keras_file):
    result = invoke("estimate", f"{keras_file}:uncompiled", "-b", "4")
    assert result.exit_code == 2
    assert "not compiled" in result.output and "--optimizer" in result.output
    assert "Traceback" not in result.output


def _cli(backend: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "KERAS_BACKEND": backend, "PYTHONPATH": str(SRC)}
    return subprocess.run([sys.executable, "-c", "from batchfit.cli import main; main()", *args],
                          env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("backend", ["tensorflow"])  # jax: the same line (README), slower
def test_keras_on_another_backend_says_torch_is_needed(keras_file, backend):
    # tensorflow is not installed here: importing the file fails, and the line says why
    result = _cli(backend, "estimate", f"{keras_file}:cnn", "-b", "4")
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert "torch backend" in lines[0] and "KERAS_BACKEND=torch" in lines[0]


@pytest.mark.slow
def test_keras_bench_predict_on_a_named_gpu(keras_file):
    result = invoke("bench", f"{keras_file}:cnn", "--gpu", "RTX 3090", "--predict",
                    "--batches", "8,64", "--json")
    assert result.exit_code == 0, result.output
    points = {p["batch_size"]: p for p in json.loads(result.stdout)["points"]}
    assert points[64]["samples_per_s"] > points[8]["samples_per_s"] > 0


def test_keras_wrong_input_is_bad_input_like_torch(keras_file):
    # the cnn declares 16x16x3 per sample; a torch model given a wrong --input exits 2 too
    result = invoke("estimate", f"{keras_file}:cnn", "--input", "5", "-b", "2")
    assert result.exit_code == 2, result.output
    line = result.stderr.strip()
    assert line.startswith("error: input does not fit the Keras model")
    assert "the model declares per-sample input 16x16x3 (--input)" in line
    assert len(line.splitlines()) == 1
