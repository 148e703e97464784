"""The multi-GPU flags of ``estimate`` and ``max``: per-rank JSON, and bad input as one line."""

from __future__ import annotations

import importlib.util
import json
import textwrap

import pytest
from typer.testing import CliRunner

from batchfit.cli import app

runner = CliRunner()


@pytest.fixture()
def model_file(tmp_path):
    path = tmp_path / "blocks.py"
    path.write_text(textwrap.dedent("""
        from torch import nn
        from batchfit import TensorSpec

        def blocks():
            layers = [nn.Linear(64, 64) for _ in range(3)] + [nn.Linear(64, 10)]
            return nn.Sequential(*layers), TensorSpec((64,))

        def single():
            return nn.Sequential(nn.Linear(64, 10), nn.ReLU()), TensorSpec((64,))
    """))
    return path


def invoke(*args: str):
    return runner.invoke(app, list(args))


def test_estimate_gives_every_traced_rank(model_file):
    result = invoke("estimate", f"{model_file}:blocks", "-b", "8", "--world-size", "4",
                    "--strategy", "fsdp", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["parallel"]["world_size"] == 4 and data["parallel"]["strategy"] == "fsdp"
    assert [r["rank"] for r in data["ranks"]] == [0, 3]
    binding = next(r for r in data["ranks"] if r["rank"] == data["binding_rank"])
    assert data["total_bytes"] == binding["total_bytes"] == max(r["total_bytes"]
                                                               for r in data["ranks"])
    # FSDP keeps a quarter of each 64-row weight on every rank: 16 x 64 + 16 floats; the
    # head's 10 rows pad to chunks of 3 (torch.chunk): 3 x 64 + 3
    assert data["by_category"]["parameters"] == (3 * (16 * 64 + 16) + 3 * 64 + 3) * 4


def test_max_answers_per_gpu_with_the_binding_rank(model_file):
    result = invoke("max", f"{model_file}:blocks", "--device", "cpu", "--memory", "64MiB",
                    "--overhead", "0", "--world-size", "2", "--strategy", "ddp", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    answers = {r["rank"]: r["max_batch_size"] for r in data["ranks"]}
    assert set(answers) == {0, 1}
    assert data["max_batch_size"] == min(answers.values()) == answers[data["binding_rank"]]
    assert data["total_bytes_at_max"] <= 64 << 20 < data["total_bytes_at_next"]


BAD = [
    (["--world-size", "0"], "world size must be a positive integer"),
    (["--world-size", "6", "--strategy", "tp", "--tp", "4"], "not divisible by --tp 4"),
    (["--world-size", "4", "--strategy", "fsdp", "--offload", "optimizer"],
     "has no --offload optimizer"),
    (["--world-size", "4", "--strategy", "ddp", "--offload", "params"], "offloads nothing"),
    (["--strategy", "fsdp"], "add --world-size"),
    (["--world-size", "4", "--strategy", "fsdp", "--wrap", "Conv9d"], "no module of"),
]


@pytest.mark.parametrize("extra,fragment", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_layouts_get_one_clear_line(extra, fragment, model_file):
    result = invoke("estimate", f"{model_file}:blocks", "-b", "2", *extra)
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and fragment in result.output, result.output


def test_a_model_without_layers_to_wrap_is_refused(model_file):
    result = invoke("estimate", f"{model_file}:single", "-b", "2", "--world-size", "2",
                    "--strategy", "fsdp")
    assert result.exit_code == 2, result.output
    assert "cannot find Sequential's layers to shard" in result.output
    assert len([line for line in result.output.splitlines() if line.strip()]) == 1


def test_zero_without_deepspeed_says_how_to_install(model_file, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "deepspeed" else real(name, *a))
    result = invoke("estimate", f"{model_file}:blocks", "-b", "2", "--world-size", "8",
                    "--strategy", "zero3")
    assert result.exit_code == 2 and "pip install deepspeed" in result.output, result.output
