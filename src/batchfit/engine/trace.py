"""Trace one step on fake tensors: the memory events of a step, first and steady
(:class:`StepTrace`), recorded by :class:`batchfit.engine.tracer.Tracer` as the step driver
(:mod:`batchfit.engine.driver`) prepares and runs it.

Known limitations: see :mod:`batchfit.engine.tracer`.
"""

from __future__ import annotations

from typing import Any

from batchfit.engine.driver import drive_step
from batchfit.engine.prepare import StepTransform, TraceReuse
from batchfit.engine.spec import TrainConfig
from batchfit.engine.step_trace import StepTrace, alive_at_end
from batchfit.engine.target import Target

__all__ = ["StepTrace", "StepTransform", "TraceReuse", "alive_at_end", "trace_step"]


def trace_step(model: Any, inputs: Any, batch_size: int, config: TrainConfig, device: Target,
               reuse: TraceReuse | None = None,
               transform: StepTransform | None = None) -> StepTrace:
    """Trace one step of ``model`` at ``batch_size`` on fake tensors.

    Args:
        model: an ``nn.Module`` (never modified), a Keras model or a zero-argument factory.
        inputs: a per-sample input spec (see :func:`batchfit.engine.step.normalize_input_spec`).
        batch_size: the batch size.
        config: a :class:`batchfit.engine.spec.TrainConfig`.
        device: a :class:`batchfit.device.profile.DeviceProfile` (any
            :class:`~batchfit.engine.driver.Target`).
        reuse: share work between traces of the same model at other batch sizes.
        transform: builds and runs the step another way (one rank of a sharded step,
            :mod:`batchfit.sharding`); with its ``whole_steps`` two whole training steps
            are traced, the second being the steady one.

    Example:
        >>> import torch
        >>> from batchfit.device.profile import DeviceProfile
        >>> traced = trace_step(lambda: torch.nn.Linear(64, 32), (64,), 16,
        ...                     TrainConfig(optimizer="sgd"), DeviceProfile.cpu())
        >>> traced.parameter_count
        2080
    """
    return drive_step(model, inputs, batch_size, config, device, reuse, transform)
