"""The CPU runtime's overhead beyond live tensors: what it is, and that the capped CPU's
largest batch needs it.

Each test starts fresh processes (a measurement or a capped trial), a few seconds each.
"""

from __future__ import annotations

import json
import os
import textwrap

import pytest

from batchfit import TrainConfig
from batchfit.answers.maxbatch import max_batch_size
from batchfit.device.profile import DeviceProfile
from batchfit.models.resolve import resolve_model
from batchfit.realrun.cpu_overhead import measure_cpu_overhead
from batchfit.realrun.search import PINNED_MMAP_THRESHOLD
from batchfit.realrun.trial_server import (
    TrialServer,
    preloads_for,
    run_trial_subprocess,
)

pytestmark = pytest.mark.slow  # real steps in fresh interpreters

MIB = 1 << 20
CONFIG = TrainConfig(optimizer="sgd")


@pytest.fixture(scope="module")
def convnet_file(tmp_path_factory):
    """Three convolutions of distinct shapes on 3x64x64 images (no Linear: no MKL GEMM).
    About 1.8 MiB per sample, so the overhead's run-to-run noise (~1 MiB) stays under one
    sample."""
    path = tmp_path_factory.mktemp("models") / "convnet.py"
    path.write_text(textwrap.dedent("""
        from torch import nn
        from batchfit import TensorSpec

        def convs():
            return nn.Sequential(
                nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(),
                nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(),
                nn.Conv2d(32, 32, 3, padding=1),
                nn.AdaptiveAvgPool2d(1), nn.Flatten()), TensorSpec((3, 64, 64))
    """))
    return f"{path}:convs"


@pytest.fixture(scope="module")
def convnet(convnet_file):
    return resolve_model(convnet_file)


def test_the_overhead_is_onednn_primitive_cache(convnet, monkeypatch):
    # Three distinct convolutions make nine oneDNN primitives (forward, backward data,
    # backward weights) at the new batch shape; the cache keeps each one's JIT code.
    # With the cache off nothing outlives its op, and only heap noise (< 1 MiB) is left.
    cached = measure_cpu_overhead(convnet, config=CONFIG)
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "0")
    uncached = measure_cpu_overhead(convnet, config=CONFIG)
    assert uncached.overhead_bytes < 1 * MIB
    assert cached.overhead_bytes - uncached.overhead_bytes > 2 * MIB
    # the live tensors are the same either way: the measurement separates the two
    assert cached.live_growth_bytes == uncached.live_growth_bytes > 0


def test_capped_cpu_maximum_needs_the_overhead(convnet):
    # batchfit's CPU device: a fresh process capped 64 MiB above its warmed-up state.
    # The budget for the prediction is that state plus the cap.
    cap = 64 * MIB
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(PINNED_MMAP_THRESHOLD)}
    with TrialServer(preloads_for(convnet.factory), env=env) as server:
        overhead = measure_cpu_overhead(convnet, config=CONFIG, server=server)
        state = run_trial_subprocess(convnet, None, 1, CONFIG, server=server).baseline_bytes
        with_overhead = max_batch_size(convnet.factory, convnet.input_spec, CONFIG,
                                       device=DeviceProfile.cpu(overhead.overhead_bytes),
                                       memory_bytes=state + cap).max_batch_size
        live_only = max_batch_size(convnet.factory, convnet.input_spec, CONFIG, device="cpu",
                                   memory_bytes=state + cap).max_batch_size
        assert live_only > with_overhead
        assert run_trial_subprocess(convnet, None, with_overhead, CONFIG, cap_bytes=cap,
                                    server=server).fits
        assert not run_trial_subprocess(convnet, None, live_only, CONFIG, cap_bytes=cap,
                                        server=server).fits


def test_cli_measures_the_overhead_unless_given(convnet_file):
    from typer.testing import CliRunner

    from batchfit.cli import app

    model = convnet_file
    runner = CliRunner()
    measured = json.loads(runner.invoke(app, ["max", model, "--device", "cpu", "--memory",
                                              "64MiB", "--optimizer", "sgd", "--json"]).stdout)
    given = json.loads(runner.invoke(app, ["max", model, "--device", "cpu", "--memory", "64MiB",
                                           "--optimizer", "sgd", "--overhead", "3MiB",
                                           "--json"]).stdout)
    assert measured["device"]["context_bytes"] > 2 * MIB
    assert measured["budget_bytes"] == 64 * MIB - measured["device"]["context_bytes"]
    assert given["device"]["context_bytes"] == 3 * MIB
    assert given["budget_bytes"] == 61 * MIB
    assert measured["by_category"]["context_workspace"] == measured["device"]["context_bytes"]
