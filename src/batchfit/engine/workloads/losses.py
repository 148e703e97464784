"""The causal-LM losses of the fine-tuning frameworks, put in place of transformers' own.

Per token, with ``V`` the vocabulary and bf16 logits (2 bytes), transformers (4.49 on)
holds ``2 V`` (logits) ``+ 4 V`` (their float32 copy) ``+ 4 V`` (the float32 log-softmax
saved for backward) at the loss (see :mod:`batchfit.engine.workloads.hfloss`). The
frameworks avoid parts of it:

* litgpt, ``chunked_cross_entropy`` (litgpt/utils.py): ``F.cross_entropy`` on each chunk of
  128 tokens of the bf16 logits, no upcast: ``2 V + 2 V`` (every chunk's log-softmax is saved
  for backward, so chunking only bounds the transient).
* torchtune, ``CEWithChunkedOutputLoss`` (torchtune/modules/loss/ce_chunked_output_loss.py):
  the logits in 8 chunks along the tokens (``tensor_split``), each ``logits.float()`` on its
  own: ``2 V + 4 V`` saved, and one chunk's float32 copy (``4 V / 8``) at a time.

Applied as the model's ``loss_function`` (what its forward calls with the logits and labels),
with labels shifted by padding as transformers does since 4.49.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from batchfit.errors import InvalidInputError

#: litgpt/finetune/lora.py: ``model(input_ids, lm_head_chunk_size=128)``
LITGPT_CHUNK_TOKENS = 128
#: torchtune/modules/loss/ce_chunked_output_loss.py: ``num_output_chunks: int = 8``
TORCHTUNE_OUTPUT_CHUNKS = 8


def _shifted_labels(labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    return nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:].contiguous()


def _mean(total: torch.Tensor, labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    count = (labels != ignore_index).sum()
    return total / count.clamp(min=1)


def native_dtype_loss(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int,
                      ignore_index: int = -100, **kwargs: Any) -> torch.Tensor:
    """litgpt's ``chunked_cross_entropy``: cross-entropy per 128 tokens, in the logits' dtype."""
    targets = _shifted_labels(labels, ignore_index)
    losses = [nn.functional.cross_entropy(chunk.reshape(-1, vocab_size), target.reshape(-1),
                                          ignore_index=ignore_index, reduction="none")
              for chunk, target in zip(logits.split(LITGPT_CHUNK_TOKENS, dim=1),
                                       targets.split(LITGPT_CHUNK_TOKENS, dim=1))]
    return _mean(torch.cat(losses).sum(), targets, ignore_index)


def chunked_output_loss(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int,
                        ignore_index: int = -100, **kwargs: Any) -> torch.Tensor:
    """torchtune's ``CEWithChunkedOutputLoss``: 8 chunks, each upcast to float32 alone."""
    targets = _shifted_labels(labels, ignore_index)
    total = torch.zeros((), dtype=torch.float32, device=logits.device)
    for chunk, target in zip(logits.tensor_split(TORCHTUNE_OUTPUT_CHUNKS, dim=1),
                             targets.tensor_split(TORCHTUNE_OUTPUT_CHUNKS, dim=1)):
        total = total + nn.functional.cross_entropy(
            chunk.reshape(-1, vocab_size).float(), target.reshape(-1),
            ignore_index=ignore_index, reduction="sum")
    return _mean(total, targets, ignore_index)


_LOSSES = {"native": native_dtype_loss, "chunked-output": chunked_output_loss}


def base_model_of(model: nn.Module) -> nn.Module:
    """The transformers model inside ``model`` (itself, or the one inside peft's wrappers)."""
    base = model
    while hasattr(base, "get_base_model") and base.get_base_model() is not base:
        base = base.get_base_model()
    return base


def apply_framework_loss(model: nn.Module, kind: Any) -> None:
    """Make ``model`` (a causal LM, possibly inside peft) compute its loss as ``kind`` says."""
    base = base_model_of(model)
    if not hasattr(type(base), "loss_function"):
        raise InvalidInputError(
            f"--loss {kind.value} is a causal language model's loss; {type(base).__name__} "
            "has no loss function to replace: use --loss standard")
    base.loss_function = _LOSSES[kind.value]
