"""What to run: the per-sample input spec, the training config and the option enums.

Nothing here imports torch at module load; dtypes are named by strings
("float32", "int64") and turned into ``torch.dtype`` on demand.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any, Mapping

from batchfit.errors import InvalidInputError, option


def _choices(enum: type[StrEnum]) -> str:
    return ", ".join(m.value for m in enum)


def parse_enum(enum: type[StrEnum], value: Any, what: str) -> Any:
    """Parse ``value`` into ``enum`` or raise a one-line error listing the choices."""
    if isinstance(value, enum):
        return value
    text = str(value).strip().lower().replace("_", "-")
    for member in enum:
        if text == member.value:
            return member
    raise InvalidInputError(f"unknown {what} {value!r}: choose one of {_choices(enum)}")


class Mode(StrEnum):
    """Which step to trace."""

    TRAIN = "train"
    INFER = "infer"


class Precision(StrEnum):
    """Numerical precision of the step.

    ``amp-*`` keep fp32 weights and run CUDA's autocast policy; ``bf16``/``fp16``
    hold the weights themselves in 16 bits; ``tf32`` only changes matmul speed.
    """

    FP32 = "fp32"
    TF32 = "tf32"
    AMP_FP16 = "amp-fp16"
    AMP_BF16 = "amp-bf16"
    BF16 = "bf16"
    FP16 = "fp16"

    @property
    def weight_dtype(self) -> str:
        return {"bf16": "bfloat16", "fp16": "float16"}.get(self.value, "float32")

    @property
    def autocast_dtype(self) -> str | None:
        return {"amp-fp16": "float16", "amp-bf16": "bfloat16"}.get(self.value)

    @property
    def uses_grad_scaler(self) -> bool:
        return self is Precision.AMP_FP16


class OptimizerName(StrEnum):
    """Optimizers known by name. Any ``torch.optim.Optimizer`` class also works."""

    SGD = "sgd"
    MOMENTUM = "momentum"
    NESTEROV = "nesterov"
    ADAM = "adam"
    ADAMW = "adamw"
    ADAGRAD = "adagrad"
    RMSPROP = "rmsprop"
    ADAFACTOR = "adafactor"
    # bitsandbytes (batchfit.engine.workloads.optim): 8-bit state, paged state
    ADAMW8BIT = "adamw8bit"
    ADAM8BIT = "adam8bit"
    PAGED_ADAMW8BIT = "paged-adamw8bit"
    PAGED_ADAMW32BIT = "paged-adamw32bit"
    LION = "lion"
    LION8BIT = "lion8bit"
    PAGED_LION8BIT = "paged-lion8bit"

    @property
    def is_bitsandbytes(self) -> bool:
        return "8bit" in self.value or "32bit" in self.value or self.value == "lion"


#: transformers' ``optim=`` spellings of the bitsandbytes optimizers.
_OPTIMIZER_ALIASES = {
    "adamw-8bit": "adamw8bit", "adamw-bnb-8bit": "adamw8bit", "adam-8bit": "adam8bit",
    "paged-adamw-8bit": "paged-adamw8bit", "paged-adamw-32bit": "paged-adamw32bit",
    "lion-32bit": "lion", "lion-8bit": "lion8bit", "paged-lion-8bit": "paged-lion8bit",
}


def parse_optimizer(value: Any) -> "OptimizerName":
    """An :class:`OptimizerName` from its name or transformers' spelling (``paged_adamw_8bit``)."""
    if isinstance(value, OptimizerName):
        return value
    text = str(value).strip().lower().replace("_", "-")
    return parse_enum(OptimizerName, _OPTIMIZER_ALIASES.get(text, text), "optimizer")


_DTYPE_ALIASES = {
    "float32": "float32", "fp32": "float32", "float": "float32",
    "float16": "float16", "fp16": "float16", "half": "float16",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float64": "float64", "double": "float64",
    "int64": "int64", "long": "int64", "int32": "int32", "int": "int32",
    "int16": "int16", "int8": "int8", "uint8": "uint8", "bool": "bool",
}


def _dtype_name(dtype: Any) -> str:
    text = str(dtype).removeprefix("torch.")
    if text not in _DTYPE_ALIASES:
        raise InvalidInputError(
            f"unknown dtype {dtype!r}: use one of float32, float16, bfloat16, int64, int32, bool")
    return _DTYPE_ALIASES[text]


@dataclass(frozen=True)
class TensorSpec:
    """One per-sample input tensor: its shape without the batch dimension.

    Integer tensors (token ids, class labels) are drawn from ``[low, high)``.

    Args:
        shape: per-sample shape, e.g. ``(3, 224, 224)`` or ``(512,)``.
        dtype: dtype name or ``torch.dtype``.
        low: lowest value of an integer tensor.
        high: one past the highest value of an integer tensor (the vocabulary size).
        batched: False for a tensor shared by the whole batch (no batch dimension).
    """

    shape: tuple[int, ...]
    dtype: str = "float32"
    low: int = 0
    high: int | None = None
    batched: bool = True

    def __post_init__(self) -> None:
        shape = tuple(self.shape)
        if any((not isinstance(d, int)) or d <= 0 for d in shape):
            raise InvalidInputError(
                f"bad input shape {self.shape!r}: every dimension must be a positive integer")
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "dtype", _dtype_name(self.dtype))
        if self.is_integer and self.high is not None and self.high <= self.low:
            raise InvalidInputError(
                f"bad value range [{self.low}, {self.high}) for an integer input: high must exceed low")

    @property
    def is_integer(self) -> bool:
        return self.dtype in {"int64", "int32", "int16", "int8", "uint8", "bool"}

    def batch_shape(self, batch_size: int) -> tuple[int, ...]:
        return (batch_size, *self.shape) if self.batched else self.shape

    def with_seq_len(self, seq_len: int) -> "TensorSpec":
        """The same spec with its first per-sample dimension set to ``seq_len``."""
        return replace(self, shape=(seq_len, *self.shape[1:]))


#: A per-sample input: one tensor, a tuple of tensors (positional args) or a
#: dict of tensors (keyword args).
InputSpec = TensorSpec | tuple[TensorSpec, ...] | Mapping[str, TensorSpec]


def parse_shape(text: str) -> tuple[int, ...]:
    """Parse ``"3x224x224"`` (or ``"3,224,224"``) into a shape tuple."""
    parts = re.split(r"[x,×*]", str(text).strip().lower())
    try:
        shape = tuple(int(p) for p in parts if p.strip() != "")
    except ValueError:
        shape = ()
    if not shape or any(d <= 0 for d in shape):
        raise InvalidInputError(
            f"malformed shape {text!r}: write the per-sample shape like 3x224x224 (positive integers)")
    return shape


_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}


def parse_size(text: str | int | float, *, allow_zero: bool = False) -> int:
    """Parse a memory size such as ``"24GiB"``, ``"16 GB"``, ``"512MiB"`` or ``1073741824``.

    Decimal units (GB) are powers of 10, binary units (GiB) powers of 2. Zero is an
    error unless ``allow_zero`` (an overhead may be zero, a budget may not).
    """
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value, unit = float(text), ""
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
        if not match or match.group(2).lower() not in _SIZE_UNITS:
            raise InvalidInputError(
                f"malformed size {text!r}: write a number with a unit, like 24GiB, 16GB or 512MiB")
        value, unit = float(match.group(1)), match.group(2).lower()
    size = int(value * _SIZE_UNITS[unit])
    if size < 0 or (size == 0 and not allow_zero):
        raise InvalidInputError(f"size {text!r} must be positive")
    return size


_DURATION_UNITS = {"": 1.0, "s": 1.0, "sec": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0}


def parse_duration(text: str | int | float) -> float:
    """Parse a duration such as ``"120s"``, ``"2m"``, ``"1.5h"`` or ``90`` into seconds
    (positive).

    Example:
        >>> parse_duration("2m"), parse_duration("45s"), parse_duration(10)
        (120.0, 45.0, 10.0)
    """
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value, unit = float(text), ""
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
        if not match or match.group(2).lower() not in _DURATION_UNITS:
            raise InvalidInputError(
                f"malformed duration {text!r}: write a number with a unit, like 120s or 2m")
        value, unit = float(match.group(1)), match.group(2).lower()
    seconds = value * _DURATION_UNITS[unit]
    if not seconds > 0:
        raise InvalidInputError(f"duration {text!r} must be positive")
    return seconds


@dataclass(frozen=True)
class TrainConfig:
    """How the step is run.

    Args:
        mode: ``train`` (zero_grad, forward, loss, backward, optimizer.step) or ``infer``
            (eval + no_grad, forward only).
        inference_mode: the ``infer`` step runs under ``torch.inference_mode()`` instead of
            ``torch.no_grad()`` (what Lightning's validate/test/predict and many serving
            loops do). From torch 2.11 autocast then keeps no weight copies
            (:attr:`~batchfit.engine.stack.Stack.autocast_caches_in_inference_mode`).
        optimizer: an :class:`OptimizerName`, its string, or a ``torch.optim.Optimizer`` class;
            None: the recipe's, else AdamW.
        optimizer_kwargs: extra keyword arguments for the optimizer (``lr``, ``fused=True``...).
        precision: a :class:`Precision` or its string; None: the recipe's, else fp32.
        checkpointing: turn on activation checkpointing where the model supports it
            (timm ``set_grad_checkpointing``, HF ``gradient_checkpointing_enable``); None:
            the recipe's, else off.
        channels_last: use ``torch.channels_last`` for 4-D inputs and the model.
        loss_fn: ``loss_fn(output, batch) -> scalar``; default rules in :mod:`batchfit.engine.step`.
        grads_to_none: ``zero_grad(set_to_none=True)``. False models loops that zero
            gradients in place (torch < 2.0 ``zero_grad()``, HF Trainer of that era):
            gradients then stay allocated through forward and backward. None (default):
            what ``zero_grad()`` does on the stack (True from torch 2.0).
        holds_loss: the loop keeps the last step's loss or outputs (Python variables
            assigned each iteration, as litgpt's ``logits`` and ``loss``) until the next
            step's replace them, so the autograd graph behind them, and what its nodes
            keep beyond backward (an old bitsandbytes' 4-bit inputs), lives through the
            next forward. None: the recipe's (litgpt: True), else False.
        zero_grad_after_forward: the loop calls ``zero_grad`` between the loss and
            ``backward``, as Lightning's automatic optimization does (``Closure.closure``
            in lightning/pytorch/loops/optimization/automatic.py: ``training_step``, then
            ``zero_grad``, then ``backward``): the previous step's gradients are then live
            through the forward. False: ``zero_grad`` first, as torch's examples do.
        stack: the torch/CUDA/cuDNN versions the step runs on: a
            :class:`~batchfit.engine.stack.Stack`, a string like ``"torch2.4+cu124"``, or
            None for the installed torch (see :mod:`batchfit.engine.stack`).
        alloc_conf: the caching allocator's options, as ``PYTORCH_CUDA_ALLOC_CONF`` text
            (``"expandable_segments:True"``) or a
            :class:`~batchfit.device.allocator.AllocatorConfig`; None (default): what this
            process's environment sets, as the user's torch would read it (CUDA targets).
        cudnn_benchmark: ``torch.backends.cudnn.benchmark = True`` in the user's script
            (default False, as in torch): convolutions search for the fastest cuDNN
            algorithm and keep it per shape; see :mod:`batchfit.engine.cudnn`.
        lora: a :class:`~batchfit.engine.workloads.spec.LoraSpec` (or its ``--lora`` text):
            peft LoRA adapters on the model; only they (and ``modules_to_save``) train.
        quant: a :class:`~batchfit.engine.workloads.spec.QuantSpec` (or ``"nf4"``...):
            bitsandbytes base weights, as transformers loads them.
        loss: ``standard`` (the model's own loss), ``chunked`` (Liger's fused linear
            cross-entropy, CUDA targets), ``native`` (litgpt's, no float32 upcast) or
            ``chunked-output`` (torchtune's); None: the recipe's, else ``standard``.
        grad_accum_steps: micro-batches per optimizer step; the batch size is the
            micro-batch. From the second micro-batch on, the gradients of the earlier ones
            are live through forward and backward.
        use_reentrant: Hugging Face checkpointing with ``use_reentrant=True`` (torch's
            reentrant variant) or False; None: what the user's stack does
            (:attr:`reentrant`).
        packing: several documents per row (``position_ids`` restart per document), as
            TRL's packing with ``padding_free`` does; the attention mask then follows them.
        transformers_version: ``"4.46"``...: the causal-LM loss as that transformers computes
            it (:mod:`batchfit.engine.workloads.hfloss`: before 4.49 it copies the float32
            logits); None: the installed transformers'.
        bitsandbytes_version: ``"0.41.1"``...: the 4-bit matmul as that bitsandbytes runs
            it (before 0.43.2 each 4-bit layer keeps its input for backward; before 0.50.0
            its forward always dequantizes the whole weight; see
            :mod:`batchfit.engine.workloads.runtime`); None: the installed bitsandbytes'.
        torchtune_version: ``"0.1"``...: torchtune's QLoRA model build as that release runs
            it on the GPU (before 0.2, torchao 0.1 quantizes each weight in one pass; see
            :mod:`batchfit.engine.workloads.torchtune_build`); None: the release the
            ``torchtune`` recipe follows. Only with that recipe and ``quant``.
        recipe: a fine-tuning framework whose defaults fill the fields left None (kbit
            preparation, adapter dtype, precision, checkpointing, loss, optimizer):
            ``peft``, ``litgpt``, ``torchtune``, ``unsloth`` or ``axolotl``
            (:mod:`batchfit.engine.workloads.recipes`). None: peft's with ``quant``
            (QLoRA as transformers and peft run it), plain defaults otherwise.
    """

    mode: Mode | str = Mode.TRAIN
    optimizer: OptimizerName | str | type | None = None
    optimizer_kwargs: Mapping[str, Any] = field(default_factory=dict)
    precision: Precision | str | None = None
    checkpointing: bool | None = None
    channels_last: bool = False
    loss_fn: Any = None
    grads_to_none: bool | None = None
    zero_grad_after_forward: bool = False
    holds_loss: bool | None = None
    stack: Any = None
    cudnn_benchmark: bool = False
    lora: Any = None
    quant: Any = None
    loss: Any = None
    grad_accum_steps: int = 1
    use_reentrant: bool | None = None
    packing: bool = False
    transformers_version: Any = None
    bitsandbytes_version: Any = None
    torchtune_version: Any = None
    inference_mode: bool = False
    alloc_conf: Any = None
    recipe: Any = None

    def __post_init__(self) -> None:
        from batchfit.engine.workloads.spec import (LoraSpec, LossKind, QuantSpec, parse_lora,
                                                    parse_quant)

        if isinstance(self.stack, str):
            from batchfit.engine.stack import Stack

            object.__setattr__(self, "stack", Stack.parse(stack=self.stack))
        object.__setattr__(self, "mode", parse_enum(Mode, self.mode, "mode"))
        self._apply_recipe()
        object.__setattr__(self, "precision", parse_enum(Precision, self.precision, "precision"))
        if not isinstance(self.optimizer, type):
            object.__setattr__(self, "optimizer", parse_optimizer(self.optimizer))
        object.__setattr__(self, "optimizer_kwargs", dict(self.optimizer_kwargs))
        if isinstance(self.lora, str):
            object.__setattr__(self, "lora", parse_lora(self.lora))
        elif self.lora is not None and not isinstance(self.lora, LoraSpec):
            raise InvalidInputError(f"lora must be a LoraSpec or its text, not {self.lora!r}")
        if isinstance(self.quant, str):
            object.__setattr__(self, "quant", parse_quant(self.quant))
        elif self.quant is not None and not isinstance(self.quant, QuantSpec):
            raise InvalidInputError(f"quant must be a QuantSpec or its name, not {self.quant!r}")
        object.__setattr__(self, "loss", parse_enum(LossKind, self.loss, "loss"))
        if self.transformers_version is not None:
            from batchfit.engine.workloads.hfloss import parse_version

            object.__setattr__(self, "transformers_version",
                               parse_version(self.transformers_version))
            if self.loss is not LossKind.STANDARD:
                raise InvalidInputError(
                    f"{option('transformers_version')} models transformers' own loss; "
                    f"{option('loss', self.loss.value)} replaces it: give one of them")
        if self.bitsandbytes_version is not None:
            from batchfit.engine.workloads.spec import parse_bitsandbytes_version

            object.__setattr__(self, "bitsandbytes_version",
                               parse_bitsandbytes_version(self.bitsandbytes_version))
            if self.quant is None or not self.quant.method.is_4bit:
                raise InvalidInputError(
                    f"{option('bitsandbytes_version')} models bitsandbytes' 4-bit matmul: add "
                    f"{option('quant', 'nf4')} (or fp4, nf4-dq, fp4-dq)")
        if self.torchtune_version is not None:
            self._check_torchtune_version()
        if self.inference_mode and self.mode is Mode.TRAIN:
            raise InvalidInputError(f"{option('inference_mode', True)} goes with "
                                    f"{option('mode', 'infer')}: a training step cannot run "
                                    "under torch.inference_mode()")
        steps = self.grad_accum_steps
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise InvalidInputError(
                f"gradient accumulation steps must be a positive integer, not {steps!r}")

    def _check_torchtune_version(self) -> None:
        from batchfit.engine.workloads.recipes import Recipe
        from batchfit.engine.workloads.spec import parse_release

        object.__setattr__(self, "torchtune_version",
                           parse_release(self.torchtune_version, "torchtune_version"))
        if self.recipe is not Recipe.TORCHTUNE or self.quant is None:
            raise InvalidInputError(
                f"{option('torchtune_version')} models torchtune's QLoRA model build: add "
                f"{option('recipe', 'torchtune')} and {option('quant', 'nf4')}")

    def _apply_recipe(self) -> None:
        """Fill the fields left None from the recipe (an explicit value always wins), then
        refuse a recipe the framework could not run with the values given."""
        from batchfit.engine.workloads.recipes import (FUSED_OPTIMIZER, check_recipe,
                                                       parse_recipe, recipe_defaults)
        from batchfit.engine.workloads.spec import LoraSpec, QuantSpec, parse_lora, parse_quant

        recipe = parse_recipe(self.recipe)
        object.__setattr__(self, "recipe", recipe)
        if isinstance(self.lora, str):
            object.__setattr__(self, "lora", parse_lora(self.lora))
        if isinstance(self.quant, str):
            object.__setattr__(self, "quant", parse_quant(self.quant))
        quant = self.quant if isinstance(self.quant, QuantSpec) else None
        found = recipe_defaults(recipe, quantized=quant is not None)
        fill = {
            "precision": "fp32" if found is None else
            (found.precision_quant if quant is not None else found.precision),
            "checkpointing": False if found is None else
            (found.checkpointing_quant if quant is not None else found.checkpointing),
            "loss": "standard" if found is None else found.loss,
            "holds_loss": False if found is None else found.holds_loss,
            "optimizer": "adamw" if found is None else
            (found.optimizer_quant if quant is not None else found.optimizer),
        }
        for name, value in fill.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)
        if (recipe in FUSED_OPTIMIZER and self.optimizer == "adamw"
                and "fused" not in self.optimizer_kwargs):
            object.__setattr__(self, "optimizer_kwargs", {**self.optimizer_kwargs, "fused": True})
        if quant is not None and quant.prepare is None:
            object.__setattr__(self, "quant", replace(
                quant, prepare=True if found is None else found.kbit_prepare))
        if isinstance(self.lora, LoraSpec) and self.lora.dtype is None:
            object.__setattr__(self, "lora", replace(
                self.lora, dtype="fp32" if found is None else found.adapter_dtype))
        if recipe is not None:
            check_recipe(recipe, lora=self.lora, quant=self.quant,
                         precision=parse_enum(Precision, self.precision, "precision"),
                         training=self.mode is Mode.TRAIN)

    @property
    def workload(self) -> Any:
        """The LLM workload (:class:`~batchfit.engine.workloads.spec.Workload`), or None."""
        from batchfit.engine.workloads.spec import LossKind, Workload

        if (self.lora is None and self.quant is None and self.loss is LossKind.STANDARD
                and self.transformers_version is None):
            return None
        return Workload(lora=self.lora, quant=self.quant, loss=self.loss,
                        transformers_version=self.transformers_version, recipe=self.recipe)

    @property
    def reentrant(self) -> bool:
        """Whether Hugging Face checkpointing is reentrant: ``use_reentrant``, else the
        recipe's, peft's or transformers' default
        (:func:`~batchfit.engine.workloads.recipes.default_reentrant`)."""
        if self.use_reentrant is not None:
            return bool(self.use_reentrant)
        return self.reentrant_default[0]

    @property
    def reentrant_default(self) -> tuple[bool, str]:
        """What ``use_reentrant=None`` means for this step, and why."""
        from batchfit.engine.workloads.recipes import default_reentrant

        kbit = self.quant is not None and bool(self.quant.prepare)
        return default_reentrant(self.recipe, kbit, self.transformers_version)

    @property
    def resolved_stack(self) -> Any:
        """The :class:`~batchfit.engine.stack.Stack` (the installed one when None)."""
        from batchfit.engine.stack import resolve_stack

        return resolve_stack(self.stack)

    @property
    def zero_grad_to_none(self) -> bool:
        """Whether ``zero_grad()`` frees the gradients: ``grads_to_none``, or the stack's."""
        if self.grads_to_none is not None:
            return bool(self.grads_to_none)
        return bool(self.resolved_stack.zero_grad_sets_none)


def make_config(config: TrainConfig | None, options: Mapping[str, Any]) -> TrainConfig:
    """``config`` with ``options`` applied, or a new config from ``options``."""
    try:
        if config is None:
            return TrainConfig(**options)
        return replace(config, **options) if options else config
    except TypeError as exc:
        raise InvalidInputError(f"unknown option: {exc}") from exc
