"""What the answers say about fitting: estimate's verdict, max's budget fields, the card and
head that were chosen (issue 35, items 1, 3 and 4)."""

from __future__ import annotations

import json
import textwrap

import pytest
from typer.testing import CliRunner

from batchfit.cli import app

runner = CliRunner()
MIB, GIB = 1 << 20, 1 << 30


@pytest.fixture()
def heavy_file(tmp_path):
    path = tmp_path / "heavy.py"
    path.write_text(textwrap.dedent("""
        from torch import nn
        from batchfit import TensorSpec

        def heavy():
            # each sample: a 2048x4096 fp32 input and output, 32 MiB each
            return nn.Sequential(nn.Linear(4096, 4096), nn.ReLU()), TensorSpec((2048, 4096))

        def mlp():
            return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
    """))
    return path


def invoke(*args: str):
    return runner.invoke(app, list(args))


def test_estimate_says_it_does_not_fit(heavy_file):
    # batch 64: the input alone is 64 x 32 MiB = 2 GiB and the output as much, on a 1 GiB card
    result = invoke("estimate", f"{heavy_file}:heavy", "-b", "64", "--gpu", "T4",
                    "--memory", "1GiB", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["memory_bytes"] == GIB
    assert data["fits"] is False
    assert data["margin_bytes"] < -3 * GIB
    assert data["margin_bytes"] == data["memory_bytes"] - data["total_bytes"]
    text = invoke("estimate", f"{heavy_file}:heavy", "-b", "64", "--gpu", "T4",
                  "--memory", "1GiB")
    assert text.exit_code == 0, text.output
    assert "does not fit" in text.stdout and "short" in text.stdout


def test_estimate_says_it_fits(heavy_file):
    # batch 1: weights, gradients and AdamW's two states are 4 x 64 MiB, the activations a
    # few 32 MiB tensors, the context 512 MiB: well under 2 GiB of a 4 GiB card
    result = invoke("estimate", f"{heavy_file}:heavy", "-b", "1", "--gpu", "T4",
                    "--memory", "4GiB", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["fits"] is True
    assert data["margin_bytes"] > 2 * GIB
    text = invoke("estimate", f"{heavy_file}:heavy", "-b", "1", "--gpu", "T4", "--memory", "4GiB")
    assert "fits NVIDIA Tesla T4's 4.0 GiB" in text.stdout and "to spare" in text.stdout


def test_estimate_without_budget_says_nothing_of_fitting(heavy_file):
    result = invoke("estimate", f"{heavy_file}:mlp", "-b", "4", "--input", "32", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["fits"] is None and data["margin_bytes"] is None and data["memory_bytes"] is None
    text = invoke("estimate", f"{heavy_file}:mlp", "-b", "4", "--input", "32")
    assert "fit" not in text.stdout.lower()
