"""Trace one rank of a sharded training step.

Example:
    >>> import torch
    >>> from batchfit.engine.spec import TrainConfig
    >>> from batchfit.device.profile import DeviceProfile
    >>> layout = Parallelism(world_size=2, strategy="ddp")
    >>> trace = trace_rank(lambda: torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)),
    ...                    (8,), 4, TrainConfig(optimizer="sgd"), DeviceProfile.cpu(), layout, rank=1)
    >>> trace.parameter_count
    90
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from batchfit.engine.spec import Precision, TrainConfig
from batchfit.engine.trace import StepTrace, TraceReuse, trace_step
from batchfit.sharding.layout import Parallelism, Strategy


def trace_config(config: TrainConfig, layout: Parallelism) -> TrainConfig:
    """The config the trace runs: FSDP's mixed precision replaces autocast
    (:func:`batchfit.sharding.transforms.mixed_precision`), and DeepSpeed's ``bf16`` and
    ``fp16`` modes (16-bit parameters, fp32 master weights in its optimizer) replace it
    for ZeRO (:func:`batchfit.sharding.zero.deepspeed_config`)."""
    from batchfit.sharding.transforms import mixed_precision

    if layout.strategy is Strategy.DDP:
        return config
    if layout.strategy.is_zero:  # DeepSpeed's bf16/fp16 modes, not autocast
        sixteen = {Precision.AMP_BF16: Precision.BF16, Precision.AMP_FP16: Precision.FP16}
        return replace(config, precision=sixteen.get(config.precision, config.precision))
    _, _, keep_autocast = mixed_precision(layout, config.precision)
    if not keep_autocast and config.precision in (Precision.AMP_BF16, Precision.AMP_FP16):
        return replace(config, precision=Precision.FP32)
    return config


def trace_rank(model: Any, inputs: Any, batch_size: int, config: TrainConfig, device: Any,
               layout: Parallelism, rank: int, reuse: TraceReuse | None = None) -> StepTrace:
    """Trace rank ``rank`` of ``layout`` running one step of ``model`` at the per-rank
    (micro-)batch ``batch_size`` (see :func:`batchfit.engine.trace.trace_step`)."""
    from batchfit.sharding.transforms import transform_for

    transform = transform_for(layout, rank, config.precision)
    return trace_step(model, inputs, batch_size, trace_config(config, layout), device,
                      reuse=reuse, transform=transform)
