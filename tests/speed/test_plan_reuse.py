"""``plan`` builds the model on meta once for all it traces, traces each (layout variant,
micro-batch) and each roofline (checkpointing, micro-batch) at most once, and gives the
answers the code before that sharing gave (plan_reference.json)."""

from __future__ import annotations

import collections
import json
import sys
from pathlib import Path

import pytest
import torch

from batchfit.engine.spec import TrainConfig
from batchfit.speed.plan import plan

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import plan_reference

REFERENCE = json.loads((HERE / "plan_reference.json").read_text())


@pytest.mark.parametrize("name", sorted(REFERENCE))
def test_the_plan_answers_as_before(name, monkeypatch):
    # recorded by the old code one trace at a time (see plan_reference.py)
    monkeypatch.setenv("BATCHFIT_PARALLEL_TRACES", "0")
    answer = plan_reference.answer(name)
    # a key the recorded code did not have: no warning on these cards (each has a CUDA total)
    assert answer.pop("warnings") == []
    assert answer == REFERENCE[name]


def test_the_model_is_built_once_and_no_trace_is_repeated(monkeypatch):
    # A factory's model is built on meta once for the whole plan: the layouts' memory
    # traces, the roofline's traces and the parameter count all copy it (before: once for
    # the facts, once for the memory traces and once per roofline trace, 3 here).
    from batchfit.answers import ranks
    from batchfit.speed import op_costs

    monkeypatch.setenv("BATCHFIT_PARALLEL_TRACES", "0")
    builds = []

    def mlp() -> torch.nn.Module:
        builds.append(1)
        return torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)])

    memory, roofline = collections.Counter(), collections.Counter()
    estimate_ranks, costs = ranks.estimate_ranks, op_costs.trace_step_and_costs

    def counted_ranks(model, inputs, batch, config, **kw):
        layout = kw["parallel"]
        memory[layout.strategy.value, layout.offload.value, config.checkpointing, batch] += 1
        return estimate_ranks(model, inputs, batch, config, **kw)

    def counted_costs(model, inputs, batch, config, *args):
        roofline[config.checkpointing, batch] += 1
        return costs(model, inputs, batch, config, *args)

    monkeypatch.setattr(ranks, "estimate_ranks", counted_ranks)
    monkeypatch.setattr(op_costs, "trace_step_and_costs", counted_costs)
    result = plan(mlp, (256,), TrainConfig(optimizer="adamw"), gpus="4xA100-80GB",
                  global_batch=64, strategies=["ddp", "fsdp", "zero2", "zero3"],
                  precision="amp-bf16")
    assert len(builds) == 1
    assert all(row.feasible and row.micro_batch_size == 16 for row in result.rows)
    assert set(memory.values()) == {1} and set(roofline.values()) == {1}
    # everything fits: per layout the first two divisors and the largest one (the line
    # through 1 and 2 fits them all), and one roofline trace at the shared micro-batch 16
    assert len(memory) <= 4 * 3
    assert roofline == {(False, 16): 1}
