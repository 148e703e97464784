"""The two loss conventions a workload may use, told apart by the loss's signature.

* ``loss_fn(model, batch)``: calls the model itself and returns the batch's mean loss.
* ``criterion(output, target)``: what people write for a plain training loop
  (``nn.MSELoss()``, ``nn.CrossEntropyLoss()``, ``F.mse_loss``, ``lambda out, y: ...``);
  the batch is ``(input..., target)`` and the step is ``criterion(model(*inputs), target)``.

The rule (:func:`is_model_loss`), in order:

1. An ``nn.Module`` (every ``torch.nn`` loss) is a criterion.
2. Otherwise the first positional parameter left after binding decides: ``inspect.signature``
   already drops a bound method's ``self`` and a ``functools.partial``'s bound arguments.
   Annotated with an ``nn.Module`` type, or named ``model``, ``module``, ``net``, ``network``
   or ``m``: ``loss_fn(model, batch)``. Any other name (``output``, ``out``, ``input``,
   ``pred``, ``logits``...): a criterion.
3. No named positional parameter (only ``*args``), or no signature at all (some builtins):
   ``loss_fn(model, batch)``, the convention batchfit has always used.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from batchfit.errors import InvalidInputError

LossFn = Callable[[nn.Module, Any], torch.Tensor]

#: First-parameter names that mean ``loss_fn(model, batch)``.
MODEL_PARAMETER_NAMES = frozenset({"model", "module", "net", "network", "m"})


def _is_module_annotation(annotation: Any) -> bool:
    if isinstance(annotation, str):
        return annotation.rsplit(".", 1)[-1] == "Module"
    return isinstance(annotation, type) and issubclass(annotation, nn.Module)


def _signature(loss: Callable[..., Any]) -> inspect.Signature:
    """The signature with string annotations evaluated where they can be (a file with
    ``from __future__ import annotations``), else as written."""
    try:
        return inspect.signature(loss, eval_str=True)
    except (NameError, SyntaxError, AttributeError):
        return inspect.signature(loss)


def is_model_loss(loss: Callable[..., Any]) -> bool:
    """True for ``loss_fn(model, batch)``, False for ``criterion(output, target)`` (the
    rule is in the module docstring)."""
    if isinstance(loss, nn.Module):
        return False
    try:
        parameters = list(_signature(loss).parameters.values())
    except (TypeError, ValueError):
        return True
    positional = [p for p in parameters
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if not positional:
        return True
    first = positional[0]
    return (_is_module_annotation(first.annotation)
            or first.name.lower() in MODEL_PARAMETER_NAMES)


class CriterionLoss:
    """``criterion(output, target)`` as ``loss_fn(model, batch)``: the batch is a tuple or
    list ``(input..., target)`` and the model gets the inputs as positional arguments."""

    def __init__(self, criterion: Callable[..., Any]):
        self.criterion = criterion

    def __call__(self, model: nn.Module, batch: Any) -> torch.Tensor:
        if isinstance(batch, Mapping) or not isinstance(batch, (tuple, list)) or len(batch) < 2:
            raise InvalidInputError(
                f"the loss is a criterion(output, target), so each batch must be a tuple "
                f"(input..., target), not {type(batch).__name__}: return tensors (x, y) as the "
                "data, or give loss_fn(model, batch) instead")
        *inputs, target = batch
        return self.criterion(model(*inputs), target)


def as_model_loss(loss: Callable[..., Any]) -> LossFn:
    """``loss`` in the ``loss_fn(model, batch)`` convention, whichever it was written in."""
    if not callable(loss):
        raise InvalidInputError(
            f"the loss must be callable, as loss_fn(model, batch) or criterion(output, target), "
            f"not {type(loss).__name__}")
    return loss if is_model_loss(loss) else CriterionLoss(loss)
