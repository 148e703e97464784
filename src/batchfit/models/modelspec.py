"""What a resolved model is (:class:`ModelSpec`) and the small helpers every resolver
shares: :mod:`batchfit.models.resolve` (library names) and :mod:`batchfit.models.files`
(a factory in a Python file) both build on this module."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING

from batchfit.engine.spec import InputSpec, TensorSpec

if TYPE_CHECKING:
    from torch import nn


@dataclass(frozen=True)
class ModelSpec:
    """A resolved model: how to build it and what it eats.

    Attributes:
        name: the user's spec string.
        factory: builds the module; call it under ``with torch.device("meta")``.
        input_spec: the per-sample input, when the spec implies one (None: the user must say).
        loss_fn: ``loss_fn(output, batch) -> scalar``; None means the engine's default rules.
        is_token_model: the input holds token ids with a sequence axis (``--seq-len`` applies).
        vocab_size: token id range of a token model.
        default_seq_len: the model's default sequence length (``input_spec`` holds the one
            in use, after any ``seq_len`` override).
        hf_labels: the batch carries ``labels`` so the HF model computes its own loss.
        max_positions: the model's context length from its config (HF models).
        keras_compiled: for a Keras 3 model, whether its factory compiles it (its own
            optimizer and loss are then used); None for other models.
        hf_task: the head a ``transformers`` model is built with; None for other models.
        hf_task_chosen: the head was chosen from the config (no ``task=`` given), so a
            caller says which.
        checkpoint_dtype: the dtype a Hugging Face model's checkpoint is stored in (its
            config's ``torch_dtype``: ``"bfloat16"``, ``"float16"``, ``"float32"``); None for
            other models, or when the config does not say.
    """

    name: str
    factory: Callable[[], nn.Module]
    input_spec: InputSpec | None
    loss_fn: Callable | None = None
    is_token_model: bool = False
    vocab_size: int | None = None
    default_seq_len: int | None = None
    hf_labels: bool = False
    max_positions: int | None = None
    keras_compiled: bool | None = None
    hf_task: HFTask | None = None
    hf_task_chosen: bool = False
    checkpoint_dtype: str | None = None


class HFTask(StrEnum):
    """Which head a ``transformers`` model is built with."""

    CAUSAL_LM = "causal-lm"
    MASKED_LM = "masked-lm"
    SEQ2SEQ_LM = "seq2seq-lm"
    SEQUENCE_CLASSIFICATION = "sequence-classification"


def _one_line(exc: BaseException, limit: int = 300) -> str:
    text = " ".join(str(exc).split()) or "(no message)"
    text = text if len(text) <= limit else text[: limit - 3] + "..."
    return f"{type(exc).__name__}: {text}"


def _tensor_specs(input_spec: InputSpec | None) -> list[TensorSpec]:
    if input_spec is None:
        return []
    if isinstance(input_spec, TensorSpec):
        return [input_spec]
    if isinstance(input_spec, Mapping):
        return list(input_spec.values())
    return list(input_spec)


def _token_tensor(input_spec: InputSpec | None) -> TensorSpec | None:
    """The first batched integer tensor with a sequence axis (token ids), if any."""
    for spec in _tensor_specs(input_spec):
        if spec.is_integer and spec.batched and spec.dtype != "bool" and len(spec.shape) >= 1:
            return spec
    return None
