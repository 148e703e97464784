"""``batchfit plan`` refuses unknown strategies and a global batch no layout can split,
with one line before any tracing."""

from __future__ import annotations

import json
import textwrap

import pytest
from typer.testing import CliRunner

from batchfit.cli import app

runner = CliRunner()


@pytest.fixture(scope="module")
def mlp_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("plan_inputs") / "mlp.py"
    path.write_text(textwrap.dedent("""
        from torch import nn
        from batchfit import TensorSpec

        def with_spec():
            return nn.Sequential(nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 10)), \\
                TensorSpec((128,))
    """))
    return path


def plan(mlp_file, *args: str):
    return runner.invoke(app, ["plan", f"{mlp_file}:with_spec", "--checkpointing", "off",
                               "--offload", "none", *args])


@pytest.mark.parametrize("as_json", [False, True])
def test_unknown_strategy_is_one_line_naming_the_valid_ones(mlp_file, as_json):
    result = plan(mlp_file, "--gpus", "8xA100", "--global-batch", "64",
                  "--strategies", "ddp,bogus", *(["--json"] if as_json else []))
    assert result.exit_code == 2, result.output
    line = result.output.strip()
    assert len(line.splitlines()) == 1 and "'bogus'" in line
    for valid in ("ddp", "fsdp", "fsdp-grad-op", "zero1", "zero2", "zero3", "hsdp"):
        assert valid in line


def test_global_batch_that_no_layout_splits_is_one_line_stating_the_rule(mlp_file):
    # 7 samples over 8 data-parallel replicas: not a whole number each
    result = plan(mlp_file, "--gpus", "8xA100", "--global-batch", "7")
    assert result.exit_code == 2, result.output
    line = result.output.strip()
    assert len(line.splitlines()) == 1
    assert "global batch (7) must be a multiple of the data-parallel size (8 on 8 GPUs" in line
    assert "--global-batch 8" in line


def test_global_batch_that_splits_still_plans_every_strategy(mlp_file):
    result = plan(mlp_file, "--gpus", "2xA100", "--global-batch", "6", "--strategies",
                  "ddp,zero1", "--json")
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)["layouts"]
    assert sorted(row["strategy"] for row in rows) == ["ddp", "zero1"]
    assert all(row["micro_batch_size"] for row in rows)
