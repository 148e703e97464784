"""``batchfit plan`` with ``--checkpointing auto`` (the default) on an ``nn.Sequential``,
which has no built-in activation checkpointing, when every layout fits without it.

Where a core is idle, the plan traces each layout's first two variants (without and with
checkpointing) at a micro-batch of 1 at once, ahead of need. The second of them fails
for a ``Sequential``; that failure belongs to the checkpointing variant, which the plan
never needs here, and must not end the plan (before: exit 2, "Sequential has no built-in
activation checkpointing")."""

from __future__ import annotations

import json
import textwrap

import pytest
from typer.testing import CliRunner

from batchfit.answers.tracepool import TracePool
from batchfit.cli import app

runner = CliRunner()


@pytest.fixture
def mlp_file(tmp_path):
    path = tmp_path / "mlp.py"
    path.write_text(textwrap.dedent("""
        from torch import nn
        from batchfit import TensorSpec

        def with_spec():
            return nn.Sequential(nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 10)), \\
                TensorSpec((128,))
    """))
    return path


@pytest.fixture
def pairs_run(monkeypatch):
    # a core is idle: the pool runs pairs (here one after the other, in this process, so
    # that the test does not depend on this machine's load or on forking)
    monkeypatch.setattr(TracePool, "parallel", lambda self: self._allowed)
    monkeypatch.setattr(TracePool, "_pair",
                        lambda self, first, second: {first: self._trace(first),
                                                     second: self._trace(second)})


def test_sequential_plans_without_checkpointing_when_it_fits(mlp_file, pairs_run):
    # 2 x 16 samples of a 9 K-parameter MLP: every layout fits the whole replica batch
    result = runner.invoke(app, ["plan", f"{mlp_file}:with_spec", "--gpus", "2xA100",
                                 "--global-batch", "32", "--strategies", "ddp,fsdp",
                                 "--offload", "none", "--json"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)["layouts"]
    assert [(r["strategy"], r["feasible"], r["checkpointing"], r["micro_batch_size"])
            for r in sorted(rows, key=lambda r: r["strategy"])] == [
        ("ddp", True, False, 16), ("fsdp", True, False, 16)]


def test_sequential_that_needs_checkpointing_still_says_why(mlp_file, pairs_run):
    # the checkpointing variant's failure is still the answer where the plan needs it:
    # --checkpointing on asks for it first
    result = runner.invoke(app, ["plan", f"{mlp_file}:with_spec", "--gpus", "2xA100",
                                 "--global-batch", "32", "--strategies", "ddp",
                                 "--checkpointing", "on", "--offload", "none", "--json"])
    assert result.exit_code == 0, result.output
    (row,) = json.loads(result.stdout)["layouts"]
    assert not row["feasible"] and "no built-in activation checkpointing" in row["reason"]
