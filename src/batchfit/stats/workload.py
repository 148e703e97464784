"""A training workload from a user's file: ``path/to/file.py:factory`` for ``batchfit noise``
and ``batchfit recommend``.

The factory returns the model, its data and its loss (and optionally its optimizer)::

    def build():
        return model, dataset, loss_fn            # or (model, dataset, loss_fn, optimizer)
    # or {"model": ..., "data": ..., "loss_fn": ..., "optimizer": ...}

``data`` is anything :func:`batchfit.noise_scale` takes (a map-style Dataset, a DataLoader
over one, tensors); the loss is either ``loss_fn(model, batch)`` returning the batch's mean
loss or a ``criterion(output, target)`` such as ``nn.MSELoss()`` for batches
``(input..., target)``, told apart by its signature (:mod:`batchfit.stats.loss`); None: the
model output's ``.loss`` for dict batches. With an optimizer, ``batchfit noise`` trains
while it measures (the weights it started from are restored after).

For the throughput sweep of ``recommend`` the workload becomes an ``nn.Module`` whose
forward is ``loss_fn(model, batch)`` (:class:`LossStep`) and an input spec read from the
data (:func:`input_spec_of`), so ``bench`` and ``predict_throughput`` time and trace the
user's own loss on batches of the data's shapes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from batchfit.engine.spec import TensorSpec
from batchfit.errors import InvalidInputError, ModelSpecError
from batchfit.stats.loss import as_model_loss


@dataclass
class Workload:
    """What a factory file returned."""

    name: str
    model: nn.Module
    data: Any
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None
    optimizer: torch.optim.Optimizer | None = None


def load_workload(spec: str, *, kwargs: Mapping[str, Any] | None = None) -> Workload:
    """Import ``path/to/file.py:factory`` and call the factory (with ``kwargs``).

    Raises:
        ModelSpecError: a malformed spec, a missing file or factory, a factory that raises
            or returns something else than described in the module docstring.
    """
    from batchfit.models.files import FILE_SPEC, file_factory, load_file
    from batchfit.models.resolve import _one_line

    match = FILE_SPEC.match(spec)
    if match is None:
        raise ModelSpecError(
            f"give the workload as path/to/file.py:factory, not {spec!r} (the factory returns "
            "the model, its data and its loss)")
    path = Path(match["path"]).expanduser().resolve()
    name = (match["factory"] or "").strip()
    if not path.is_file():
        raise ModelSpecError(f"workload file '{match['path']}' not found")
    factory = file_factory(path, name, load_file(path, reload=True))
    try:
        result = factory(**dict(kwargs or {}))
    except Exception as exc:
        raise ModelSpecError(f"factory {name}() in '{path}' raised {_one_line(exc)}") from exc
    return _unpack(result, f"factory {name}() in '{path}'", spec)


def _unpack(result: Any, where: str, spec: str) -> Workload:
    if isinstance(result, Mapping):
        extra = set(result) - {"model", "data", "loss_fn", "optimizer"}
        if extra or not {"model", "data"} <= set(result):
            raise ModelSpecError(
                f"{where} returned a dict with keys {sorted(result)}: use 'model' and 'data' "
                "(required), 'loss_fn' and 'optimizer'")
        parts = (result["model"], result["data"], result.get("loss_fn"), result.get("optimizer"))
    elif isinstance(result, (tuple, list)) and len(result) in (3, 4):
        parts = (*result, None)[:4]
    else:
        raise ModelSpecError(
            f"{where} returned {type(result).__name__}: return (model, data, loss_fn), "
            "(model, data, loss_fn, optimizer) or a dict with those keys")
    model, data, loss_fn, optimizer = parts
    if not isinstance(model, nn.Module):
        raise ModelSpecError(f"{where} returned a model of type {type(model).__name__}, not an "
                             "nn.Module")
    if loss_fn is not None and not callable(loss_fn):
        raise ModelSpecError(f"{where} returned a loss_fn that is not callable")
    if loss_fn is not None:
        loss_fn = as_model_loss(loss_fn)
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise ModelSpecError(f"{where} returned an optimizer of type {type(optimizer).__name__}")
    return Workload(spec, model, data, loss_fn, optimizer)


class LossStep(nn.Module):
    """``loss_fn(model, batch)`` as a module called with the batch's tensors as arguments
    (positional for a tuple batch, keywords for a dict, one argument for a tensor), which is
    how the training step of ``bench`` calls a model on an input spec."""

    def __init__(self, model: nn.Module, loss_fn: Callable[[nn.Module, Any], torch.Tensor],
                 kind: str):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn
        self.kind = kind

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.kind == "dict":
            batch: Any = kwargs
        elif self.kind == "tensor":
            batch = args[0]
        else:
            batch = tuple(args)
        return self.loss_fn(self.model, batch)


def identity_loss(output: torch.Tensor, batch: Any) -> torch.Tensor:
    """The step's loss is the module's output (it computed the loss itself)."""
    return output


def _spec_of(tensor: Any) -> TensorSpec:
    if not isinstance(tensor, torch.Tensor) or tensor.dim() == 0:
        raise InvalidInputError(
            f"a batch holds {type(tensor).__name__} values: the throughput sweep needs batches of "
            "tensors with a leading batch dimension")
    dtype = str(tensor.dtype).removeprefix("torch.")
    spec = TensorSpec(tuple(tensor.shape[1:]), dtype)
    if spec.is_integer and dtype != "bool":
        low, high = int(tensor.min()), int(tensor.max()) + 1
        return TensorSpec(spec.shape, dtype, low=low, high=max(high, low + 1))
    return spec


def input_spec_of(batch: Any) -> tuple[Any, str]:
    """The per-sample input spec of a collated batch and its kind (``tensor``, ``tuple``
    or ``dict``); integer ranges are the batch's own (ids seen in it, so always valid)."""
    if isinstance(batch, torch.Tensor):
        return _spec_of(batch), "tensor"
    if isinstance(batch, Mapping):
        return {str(k): _spec_of(v) for k, v in batch.items()}, "dict"
    if isinstance(batch, (tuple, list)) and batch:
        return tuple(_spec_of(v) for v in batch), "tuple"
    raise InvalidInputError(
        f"cannot time batches of type {type(batch).__name__}: give tensors, tuples or dicts of "
        "tensors")
