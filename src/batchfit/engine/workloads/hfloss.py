"""The causal-LM loss as a given transformers version computes it (``--transformers-version``).

The step traced is the installed transformers' model; where the loss of the version the user
runs keeps other tensors alive, this patches the model to compute it that way. Three eras,
read in the sources of those versions (``LlamaForCausalLM.forward`` and
``transformers/loss/loss_utils.py``); per token, with ``V`` the vocabulary and the logits
computed in bf16/fp16 (2 bytes):

* **before 4.46** (read in 4.43.3): the model's forward upcasts, ``logits = logits.float()``
  (the half-precision logits are released when the name is rebound), then
  ``shift_logits = logits[..., :-1, :].contiguous()`` (a float32 copy) and
  ``CrossEntropyLoss`` (log-softmax, float32). At the loss: ``12 V`` bytes. The float32
  logits are returned in the output; transformers' ``Trainer.compute_loss`` returns only the
  loss unless asked for the outputs (4.43.3 ``training_step``), so they are gone before the
  backward, as in batchfit's step.
* **4.46 to 4.48** (read in 4.46.3 and 4.47.1): the forward keeps the half-precision logits and
  calls ``ForCausalLMLoss``, which makes ``logits.float()`` and the same contiguous shifted
  copy: ``2 V + 4 V + 4 V + 4 V = 14 V`` bytes at the loss.
* **4.49 on** (read in 4.49.0 and 5.23): labels are shifted by padding
  (``nn.functional.pad(labels, (0, 1), value=ignore_index)``), the logits are not copied:
  ``2 V + 4 V + 4 V = 10 V``.

The backward of the cross-entropy holds ``12 V`` in all three (log-softmax output, the
gradient of the NLL, the gradient of the log-softmax), so the loss can set the step's peak
before 4.49. At batch 1 the shifted slice of ``(1, S, V)`` logits is already contiguous and
``.contiguous()`` copies nothing (the real op runs on the fake tensors): the eras differ
from batch 2 on (Unsloth's batch-1 contexts do not change with the version).
"""

from __future__ import annotations

from importlib import metadata
from typing import Any

import torch
from torch import nn

from batchfit.errors import InvalidInputError, option

#: Where the causal-LM loss changed (see the module docstring).
SHIFT_COPY_IN_LOSS = (4, 46)
PAD_LABELS = (4, 49)


def parse_version(text: str | tuple[int, int] | None) -> tuple[int, int] | None:
    """``"4.46"``, ``"4.46.3"``, ``"v4.43"`` -> ``(4, 46)``; None stays None (the installed)."""
    if text is None or isinstance(text, tuple):
        return text
    parts = str(text).strip().lstrip("vV").split(".")
    try:
        major, minor = int(parts[0]), int(parts[1])
    except (ValueError, IndexError):
        raise InvalidInputError(
            f"malformed {option('transformers_version')} {text!r}: write it like 4.46 or "
            "4.46.3") from None
    if (major, minor) < (4, 28):
        raise InvalidInputError(
            f"{option('transformers_version', text)}: batchfit models the causal-LM loss from 4.28 "
            "(Llama's first release) on")
    return major, minor


def installed_version() -> tuple[int, int]:
    return parse_version(metadata.version("transformers")) or (0, 0)


def era(version: tuple[int, int]) -> str:
    if version < SHIFT_COPY_IN_LOSS:
        return "forward-upcast"
    if version < PAD_LABELS:
        return "shift-copy"
    return "pad-labels"


def causal_lm_loss_with_shift_copy(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int,
                                   num_items_in_batch: Any = None, ignore_index: int = -100,
                                   **kwargs: Any) -> torch.Tensor:
    """``ForCausalLMLoss`` of transformers 4.46-4.48: upcast, then a contiguous shifted copy."""
    logits = logits.float()
    shift_logits = logits[..., :-1, :].contiguous()
    shift_labels = labels[..., 1:].contiguous()
    shift_logits = shift_logits.view(-1, vocab_size)
    shift_labels = shift_labels.view(-1).to(shift_logits.device)
    return _cross_entropy(shift_logits, shift_labels, num_items_in_batch, ignore_index)


def causal_lm_loss_padded_labels(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int,
                                 num_items_in_batch: Any = None, ignore_index: int = -100,
                                 shift_labels: Any = None, **kwargs: Any) -> torch.Tensor:
    """``ForCausalLMLoss`` of transformers 4.49 on: upcast, labels shifted by padding."""
    logits = logits.float()
    if shift_labels is None:
        labels = nn.functional.pad(labels, (0, 1), value=ignore_index)
        shift_labels = labels[..., 1:].contiguous()
    logits = logits.view(-1, vocab_size)
    shift_labels = shift_labels.view(-1).to(logits.device)
    return _cross_entropy(logits, shift_labels, num_items_in_batch, ignore_index)


def _cross_entropy(source: torch.Tensor, target: torch.Tensor, num_items_in_batch: Any,
                   ignore_index: int) -> torch.Tensor:
    """transformers' ``fixed_cross_entropy`` (the same in every version above)."""
    reduction = "sum" if num_items_in_batch is not None else "mean"
    loss = nn.functional.cross_entropy(source, target, ignore_index=ignore_index,
                                       reduction=reduction)
    if reduction == "sum":
        loss = loss / num_items_in_batch
    return loss


def _upcast_output(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
    """Before 4.46: ``logits = logits.float()`` right after the head, in the forward."""
    return output.float()


def apply_transformers_loss(model: nn.Module, version: tuple[int, int]) -> None:
    """Make ``model`` (a causal LM, possibly inside peft) compute its loss as ``version`` does."""
    wanted = era(version)
    if wanted == era(installed_version()):
        return
    from batchfit.engine.workloads.losses import base_model_of

    base = base_model_of(model)
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    if head is None or not hasattr(type(base), "loss_function"):
        raise InvalidInputError(
            f"{option('transformers_version')} models a causal language model's loss; "
            f"{type(base).__name__} has no output embeddings and loss function")
    if wanted == "pad-labels":
        base.loss_function = causal_lm_loss_padded_labels
        return
    base.loss_function = causal_lm_loss_with_shift_copy
    if wanted == "forward-upcast":
        head.register_forward_hook(_upcast_output)
