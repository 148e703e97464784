"""Tensor parallel (DTensor ``parallelize_module`` with the model's own plan).

The reference is the same rank run for real: real tensors of the real model, sharded by
the same plan on torch's fake process group in this process, measured by the
live-storage tracker (a fake collective moves no data, but allocates as the real one
does). Real 2- and 4-process gloo runs of this model, and tensor parallel with FSDP2 on
a 2-D mesh, agree with the trace as well (``benchmarks/sharded_vs_gloo.py``).
"""

from __future__ import annotations

import pytest
import torch

from batchfit.device.profile import DeviceProfile
from batchfit.device.timeline import replay_events
from batchfit.engine.spec import TrainConfig
from batchfit.errors import InvalidInputError
from batchfit.realrun.measure import _build_runner, run_tracked_session
from batchfit.sharding.layout import Parallelism
from batchfit.sharding.rank import trace_rank
from batchfit.sharding.transforms import shard_model
from batchfit.sharding.world import fake_world
from sharded_models import llama_inputs, tiny_llama

CONFIG = TrainConfig(optimizer="adamw")


def _real_peak(layout: Parallelism) -> int:
    with fake_world(layout.world_size, 0, tp=layout.tp) as world:
        def build():
            runner = _build_runner(tiny_llama, llama_inputs(), 4, CONFIG)
            runner.model = shard_model(runner.model, layout, world, CONFIG.precision)
            runner.optimizer = None
            runner.__post_init__()
            return runner

        torch.manual_seed(0)
        windows = run_tracked_session(build, 2)
    return windows[1].peak_bytes


def test_a_tensor_parallel_rank_matches_the_real_rank() -> None:
    layout = Parallelism(world_size=2, strategy="tp", tp=2)
    trace = trace_rank(tiny_llama, llama_inputs(), 4, CONFIG,
                       DeviceProfile.cpu(kernel_scratch=False), layout, 0)
    predicted = replay_events(trace.steady_events, DeviceProfile.cpu()).peak_allocated_bytes
    assert predicted == pytest.approx(_real_peak(layout), rel=1e-3)


def test_heads_must_divide() -> None:
    layout = Parallelism(world_size=8, strategy="tp", tp=8)  # 4 heads, 2 key-value heads
    with pytest.raises(InvalidInputError, match="does not divide the model's num_"):
        trace_rank(tiny_llama, llama_inputs(), 1, CONFIG, DeviceProfile.cpu(), layout, 0)
