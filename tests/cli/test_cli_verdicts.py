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


def test_max_json_pairs_budgets_with_like_totals(heavy_file):
    # the fixture's heavy step on a 4 GiB T4-class card, no margin: the card's 4 GiB is the
    # budget of the totals (context included); the step's own budget leaves the context out
    result = invoke("max", f"{heavy_file}:heavy", "--gpu", "T4", "--memory", "4GiB", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["total_budget_bytes"] == 4 * GIB
    assert data["budget_bytes"] < data["total_budget_bytes"]
    assert data["next_batch_size"] == data["max_batch_size"] + 1
    assert data["step_bytes_at_max"] <= data["budget_bytes"] < data["step_bytes_at_next"]
    assert (data["total_bytes_at_max"] <= data["total_budget_bytes"]
            < data["total_bytes_at_next"])


def test_max_json_nothing_fits_still_prints_the_verdict(heavy_file):
    # the MLP's parameters alone are (32*64 + 64 + 64*4 + 4) * 4 = 9,488 bytes > 1 KiB
    result = invoke("max", f"{heavy_file}:mlp", "--input", "32", "--device", "cpu",
                    "--memory", "1KiB", "--overhead", "0", "--json")
    assert result.exit_code == 3
    data = json.loads(result.stdout)
    assert data["fits"] is False and data["max_batch_size"] == 0
    assert data["budget_bytes"] == 1024 and data["needed_bytes"] >= 9488
    assert "over the budget" in data["verdict"]
    assert result.stderr.startswith("error:") and len(result.stderr.strip().splitlines()) == 1


def test_a_short_gpu_name_says_which_card(heavy_file):
    result = invoke("estimate", f"{heavy_file}:mlp", "-b", "2", "--input", "32", "--gpu", "V100",
                    "--json")
    assert result.exit_code == 0, result.output
    choice = json.loads(result.stdout)["gpu_choice"]
    assert choice["name"] == "NVIDIA Tesla V100 SXM2 16GB"
    assert "NVIDIA Tesla V100 SXM2 32GB" in choice["alternatives"]
    assert "note: --gpu 'V100' is the NVIDIA Tesla V100 SXM2 16GB" in result.stderr
    full = invoke("estimate", f"{heavy_file}:mlp", "-b", "2", "--input", "32", "--gpu",
                  "A100 80GB SXM", "--json")
    assert json.loads(full.stdout)["gpu_choice"]["alternatives"] == []
    assert "note:" not in full.stderr


@pytest.mark.parametrize("command", [("estimate", "-b", "2"), ("max",)])
def test_an_empty_gpu_name_is_an_error(heavy_file, command):
    result = invoke(*command, f"{heavy_file}:mlp", "--input", "32", "--gpu", "")
    assert result.exit_code == 2
    assert result.stderr.startswith("error: empty GPU name")
    assert result.stdout == ""


@pytest.mark.parametrize(("gpu", "precision", "fix"), [
    ("V100", "amp-bf16", "amp-fp16"), ("T4", "bf16", "fp16")])
def test_bf16_on_a_card_without_it_is_refused(heavy_file, gpu, precision, fix):
    for command in (("estimate", "-b", "2"), ("max",)):
        result = invoke(*command, f"{heavy_file}:mlp", "--input", "32", "--gpu", gpu,
                        "--precision", precision)
        assert result.exit_code == 2, result.output
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1, result.stderr  # no --gpu note before the refusal
        line = lines[0]
        assert "compute capability 7." in line and f"--precision {fix}" in line


def test_bf16_on_an_ampere_card_runs(heavy_file):
    result = invoke("estimate", f"{heavy_file}:mlp", "-b", "2", "--input", "32", "--gpu",
                    "A100 80GB SXM", "--precision", "amp-bf16")
    assert result.exit_code == 0, result.output


def test_a_bare_hf_name_says_which_head(heavy_file):
    result = invoke("estimate", "hf:bert-base-uncased", "-b", "1", "--seq-len", "16", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["hf_task"] == "masked-lm"
    assert "is built with its masked-lm head" in result.stderr
    chosen = invoke("estimate", "hf:bert-base-uncased", "-b", "1", "--seq-len", "16",
                    "--model-kwargs", "task=sequence-classification", "--json")
    assert chosen.exit_code == 0, chosen.output
    assert json.loads(chosen.stdout)["hf_task"] == "sequence-classification"
    assert "note:" not in chosen.stderr


def test_bench_predict_says_which_card_too(heavy_file):
    result = invoke("bench", f"{heavy_file}:mlp", "--input", "32", "--gpu", "H100", "--predict",
                    "--batches", "8,16", "--json")
    assert result.exit_code == 0, result.output
    choice = json.loads(result.stdout)["gpu_choice"]
    assert choice["name"] == "NVIDIA H100 SXM5 80GB"
    assert set(choice["alternatives"]) == {"NVIDIA H100 PCIe", "NVIDIA H100 NVL"}
    assert "note: --gpu 'H100' is the NVIDIA H100 SXM5 80GB" in result.stderr
