"""What one whole replica of a model holds at its optimizer step, whatever the batch: the
floor ``plan`` rules a replicated layout out with, before any trace."""

from __future__ import annotations

from typing import Any

from batchfit.engine.spec import TrainConfig


def replica_floor_bytes(model: Any, config: TrainConfig) -> int | None:
    """Bytes one whole replica of ``model`` holds at its optimizer step whatever the
    micro-batch: every parameter, a gradient of each trainable one, and the optimizer's
    per-parameter state tensors; a lower bound of any trace of the step (None where the
    step's weights are not the module's own: an LLM workload, which quantizes and adapts).

    Each is the parameter's shape and dtype: autograd's ``AccumulateGrad`` stores a
    gradient like its variable (torch/csrc/autograd/functions/accumulate_grad.h), and the
    states are ``torch.zeros_like(p)``/``torch.clone(grad)``/``torch.full_like(p)`` of
    torch.optim: Adam and AdamW's ``exp_avg`` and ``exp_avg_sq`` (and ``max_exp_avg_sq``
    with ``amsgrad``) in adam.py's ``_init_group``; SGD's ``momentum_buffer`` where
    ``momentum`` is not 0 (sgd.py); Adagrad's ``sum`` (adagrad.py); RMSprop's
    ``square_avg``, ``momentum_buffer`` with momentum and ``grad_avg`` when centered
    (rmsprop.py). Other optimizers count no state (the bound stays a bound). A floating
    weight's dtype is the smaller of the module's and the precision's weight dtype (a
    16-bit precision casts the weights, the others keep the module's). Under DDP every
    trainable parameter gets its gradient: its reducer fails the step when one does not
    (unless ``find_unused_parameters``), and its buckets hold a gradient-sized copy of each.
    """
    from torch import nn

    from batchfit.engine.spec import OptimizerName
    from batchfit.engine.step import _OPTIMIZERS, torch_dtype

    if config.workload is not None or not isinstance(model, nn.Module):
        return None
    weight = torch_dtype(config.precision.weight_dtype).itemsize
    states = 0
    if isinstance(config.optimizer, OptimizerName) and config.optimizer in _OPTIMIZERS:
        kwargs = {**_OPTIMIZERS[config.optimizer][1], **config.optimizer_kwargs}
        states = {
            "Adam": 2 + bool(kwargs.get("amsgrad")), "AdamW": 2 + bool(kwargs.get("amsgrad")),
            "SGD": int(bool(kwargs.get("momentum"))), "Adagrad": 1,
            "RMSprop": 1 + bool(kwargs.get("momentum")) + bool(kwargs.get("centered")),
        }.get(_OPTIMIZERS[config.optimizer][0], 0)
    total = 0
    for p in model.parameters():
        size = min(p.element_size(), weight) if p.is_floating_point() else p.element_size()
        total += p.numel() * size * (1 + (1 + states) * p.requires_grad)
    return total
