"""What importing DeepSpeed sets for the process does not follow the traces, and a ZeRO trace
builds none of DeepSpeed's CPU-only C++ ops.

Importing DeepSpeed sets ``PYTORCH_NVML_BASED_CUDA_CHECK=1`` (deepspeed/__init__.py), after
which each ``torch.cuda.is_available()`` asks NVML again (``torch.cuda._device_count_nvml``),
and torch's fake-tensor mode calls it on every op its cache misses. Each case runs in a
fresh process, where DeepSpeed is not imported yet and the variable is not set, as in a
user's ``batchfit plan``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import batchfit

pytest.importorskip("deepspeed")

SRC = Path(batchfit.__file__).resolve().parents[1]

# Two ZeRO-2 estimates (two ranks each) of a small MLP in one process; the number of NVML
# device counts torch makes before, between and after them, and the variable after.
SCRIPT = """
import json, os, torch
counts = []
nvml = torch.cuda._device_count_nvml
def counted():
    counts.append(1)
    return nvml()
torch.cuda._device_count_nvml = counted
from batchfit.answers.ranks import estimate_ranks
from batchfit.sharding import Parallelism
def mlp():
    return torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
layout = Parallelism(world_size=4, strategy="zero2")
seen = [len(counts)]
for batch in (2, 4):
    estimate_ranks(mlp, (64,), batch, optimizer="adamw", precision="amp-bf16",
                   device="H100 SXM", parallel=layout)
    seen.append(len(counts))
print(json.dumps({"seen": seen, "variable": os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK")}))
"""


def test_traces_do_not_ask_nvml_after_deepspeed_is_imported():
    env = {k: v for k, v in os.environ.items() if k != "PYTORCH_NVML_BASED_CUDA_CHECK"}
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    before, after_first, after_second = result["seen"]
    # only while DeepSpeed is imported (its accelerator, Triton's backends: 3 here), once
    # per process; before, each estimate added one per op the fake cache missed (749 here)
    assert after_first - before < 10
    assert after_second == after_first
    # the user's environment is as it was: no variable
    assert result["variable"] is None


def test_a_zero_trace_builds_no_shared_memory_op(monkeypatch):
    # DeepSpeed's CPU communication backend compiles and loads its shared-memory all-reduce
    # op (deepspeed/comm/torch.py build_shm_op, a g++ build when its cache is cold) each
    # time it starts, once per ZeRO trace; the op serves DeepSpeed inference only
    import importlib

    import torch

    from batchfit.answers.ranks import estimate_ranks
    from batchfit.sharding import Parallelism
    from batchfit.sharding.zero import _import_deepspeed

    _import_deepspeed()
    from deepspeed.accelerator import get_accelerator

    ds_torch = importlib.import_module("deepspeed.comm.torch")  # the attribute is torch

    accelerator = get_accelerator()
    create = accelerator.create_op_builder
    asked: list[str] = []
    monkeypatch.setattr(accelerator, "create_op_builder",
                        lambda name: asked.append(name) or create(name))
    build_shm_op = ds_torch.build_shm_op

    def mlp() -> torch.nn.Module:
        return torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(2)])

    for strategy in ("zero2", "zero3"):
        estimate_ranks(mlp, (64,), 2, optimizer="adamw", precision="amp-bf16",
                       device="H100 SXM", parallel=Parallelism(world_size=4, strategy=strategy,
                                                               rank=0))
    assert "ShareMemCommBuilder" not in asked
    assert ds_torch.build_shm_op is build_shm_op  # put back after each trace
