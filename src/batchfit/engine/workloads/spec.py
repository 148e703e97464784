"""What an LLM fine-tuning workload adds to a step: LoRA adapters, quantized base weights,
the loss over the vocabulary.

Plain dataclasses, no torch import: the CLI parses ``--lora r=16,alpha=32,targets=all-linear``
and ``--quant nf4-dq`` into these, and :mod:`batchfit.engine.workloads.build` applies them to the
model with the real libraries (peft, bitsandbytes, transformers).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from batchfit.errors import InvalidInputError, option

ALL_LINEAR = "all-linear"


class AdapterDtype(StrEnum):
    """The dtype LoRA weights are held in. peft keeps them in float32 by default
    (``autocast_adapter_dtype=True`` upcasts bf16/fp16 adapters); ``base`` keeps the base
    layer's dtype (``autocast_adapter_dtype=False``)."""

    FP32 = "fp32"
    BASE = "base"
    BF16 = "bf16"  # bf16 adapters whatever the base (litgpt, torchtune: bf16 throughout)


@dataclass(frozen=True)
class LoraSpec:
    """A peft ``LoraConfig``, with the fields that change memory.

    Args:
        r: the rank (> 0).
        alpha: ``lora_alpha`` (peft's default 8); it scales, it costs no memory.
        dropout: ``lora_dropout``; above 0 peft keeps a dropout mask and the dropped input
            per adapted layer for backward.
        targets: ``"all-linear"`` or module names (``("q_proj", "v_proj")``); None is peft's
            default for the model type.
        modules_to_save: modules trained in full next to the adapters (peft copies them).
        dtype: adapter dtype (:class:`AdapterDtype`); None: the recipe's (fp32 without one).
        bias: ``"none"``, ``"all"`` or ``"lora_only"`` (which biases train).
        dora: weight-decomposed LoRA (``use_dora``): a magnitude vector per layer and the
            base weight's norm in forward.
    """

    r: int = 8
    alpha: float = 8.0
    dropout: float = 0.0
    targets: str | tuple[str, ...] | None = None
    modules_to_save: tuple[str, ...] = ()
    dtype: AdapterDtype | str | None = None
    bias: str = "none"
    dora: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.r, bool) or not isinstance(self.r, int) or self.r < 1:
            raise InvalidInputError(f"LoRA rank r={self.r!r} must be a positive integer, e.g. r=16")
        if not 0.0 <= float(self.dropout) < 1.0:
            raise InvalidInputError(f"LoRA dropout={self.dropout!r} must be in [0, 1), e.g. 0.05")
        if self.bias not in ("none", "all", "lora_only"):
            raise InvalidInputError(
                f"LoRA bias={self.bias!r}: use none, all or lora_only")
        targets = self.targets
        if isinstance(targets, (list, tuple)):
            targets = tuple(str(t) for t in targets)
            if not targets:
                raise InvalidInputError("LoRA targets is empty: name modules or use all-linear")
        elif targets is not None:
            targets = str(targets)
            targets = ALL_LINEAR if targets.lower().replace("_", "-") == ALL_LINEAR else (targets,)
        object.__setattr__(self, "targets", targets)
        object.__setattr__(self, "modules_to_save", tuple(self.modules_to_save))
        object.__setattr__(self, "alpha", float(self.alpha))
        object.__setattr__(self, "dropout", float(self.dropout))
        if self.dtype is not None:
            try:
                object.__setattr__(self, "dtype", AdapterDtype(str(self.dtype).lower()))
            except ValueError:
                raise InvalidInputError(
                    f"LoRA dtype={self.dtype!r}: use fp32 (peft's default), bf16 or base "
                    "(the base layer's dtype)") from None

    def to_dict(self) -> dict[str, Any]:
        targets = self.targets if isinstance(self.targets, str) or self.targets is None \
            else list(self.targets)
        return {"r": self.r, "alpha": self.alpha, "dropout": self.dropout, "targets": targets,
                "modules_to_save": list(self.modules_to_save),
                "dtype": self.dtype.value if self.dtype is not None else None,
                "bias": self.bias, "dora": self.dora}


class QuantMethod(StrEnum):
    """bitsandbytes base-weight quantization (``BitsAndBytesConfig``)."""

    NF4 = "nf4"
    NF4_DQ = "nf4-dq"
    FP4 = "fp4"
    FP4_DQ = "fp4-dq"
    INT8 = "int8"

    @property
    def is_4bit(self) -> bool:
        return self is not QuantMethod.INT8

    @property
    def quant_type(self) -> str:
        return self.value.split("-")[0]

    @property
    def double_quant(self) -> bool:
        return self.value.endswith("-dq")


@dataclass(frozen=True)
class QuantSpec:
    """Quantized base weights as transformers' bitsandbytes integration loads them.

    Args:
        method: nf4, nf4-dq (double quantization: the absmax blocks quantized again to
            8 bits), fp4, fp4-dq, or int8 (LLM.int8, threshold 6.0).
        compute_dtype: ``bnb_4bit_compute_dtype``; None follows the precision (bf16 for
            bf16/amp-bf16, fp16 for fp16/amp-fp16, fp32 otherwise, which is also
            bitsandbytes' own default).
        prepare: run peft's ``prepare_model_for_kbit_training`` (freeze, fp32 upcast of the
            remaining fp16/bf16 parameters, input-gradient hooks, checkpointing if asked);
            None: the recipe's (:mod:`batchfit.engine.workloads.recipes`; peft's True).
        skip_modules: ``llm_int8_skip_modules``; None keeps transformers' default (the
            output embedding, e.g. ``lm_head``).
    """

    method: QuantMethod | str = QuantMethod.NF4
    compute_dtype: str | None = None
    prepare: bool | None = None
    skip_modules: tuple[str, ...] | None = None
    blocksize: int = 64

    def __post_init__(self) -> None:
        text = str(self.method).strip().lower().replace("_", "-")
        try:
            object.__setattr__(self, "method", QuantMethod(text))
        except ValueError:
            raise InvalidInputError(
                f"unknown {option('quant')} {self.method!r}: choose one of "
                f"{', '.join(m.value for m in QuantMethod)}") from None
        if self.compute_dtype is not None and self.compute_dtype not in (
                "float32", "bfloat16", "float16"):
            raise InvalidInputError(
                f"quant compute dtype {self.compute_dtype!r}: use float32, bfloat16 or float16")
        if self.skip_modules is not None:
            object.__setattr__(self, "skip_modules", tuple(self.skip_modules))

    def to_dict(self) -> dict[str, Any]:
        return {"method": self.method.value, "compute_dtype": self.compute_dtype,
                "prepare": self.prepare,
                "skip_modules": list(self.skip_modules) if self.skip_modules else None}


class LossKind(StrEnum):
    """How the language-model loss is computed.

    ``standard`` is the model's own loss as the installed transformers computes it (logits
    for every position, upcast to float32, cross-entropy); ``chunked`` is Liger-Kernel's
    fused linear cross-entropy, which never materialises the full logits; ``native`` is the
    cross-entropy on the logits in their own dtype, with no float32 upcast (litgpt's
    ``chunked_cross_entropy``); ``chunked-output`` is torchtune's ``CEWithChunkedOutputLoss``
    (each of 8 chunks upcast to float32 on its own). See
    :mod:`batchfit.engine.workloads.losses`.
    """

    STANDARD = "standard"
    CHUNKED = "chunked"
    NATIVE = "native"
    CHUNKED_OUTPUT = "chunked-output"


_LORA_KEYS = {
    "r": "r", "rank": "r", "alpha": "alpha", "lora_alpha": "alpha", "dropout": "dropout",
    "lora_dropout": "dropout", "targets": "targets", "target_modules": "targets",
    "save": "modules_to_save", "modules_to_save": "modules_to_save", "dtype": "dtype",
    "bias": "bias", "dora": "dora", "use_dora": "dora",
}


def parse_lora(text: str) -> LoraSpec:
    """Parse ``r=16,alpha=32,targets=all-linear,dropout=0.05`` into a :class:`LoraSpec`.

    Lists (targets, modules_to_save) are joined with ``+``: ``targets=q_proj+v_proj``.

    Example:
        >>> parse_lora("r=16,alpha=32,targets=q_proj+v_proj").targets
        ('q_proj', 'v_proj')
    """
    fields: dict[str, Any] = {}
    for item in str(text).split(","):
        item = item.strip()
        if not item:
            continue
        key, sep, value = item.partition("=")
        key = key.strip().lower().replace("-", "_")
        if not sep or key not in _LORA_KEYS:
            known = "r, alpha, dropout, targets, save, dtype, bias, dora"
            raise InvalidInputError(
                f"unknown {option('lora')} key {key!r}: use {known} (e.g. "
                f"{option('lora', 'r=16,alpha=32,targets=all-linear')})" if sep else
                f"malformed {option('lora')} item {item!r}: write key=value, e.g. r=16")
        name = _LORA_KEYS[key]
        if name in fields:
            raise InvalidInputError(f"{option('lora')} key {key!r} given twice")
        fields[name] = _lora_value(name, value.strip())
    return LoraSpec(**fields)


def _lora_value(name: str, value: str) -> Any:
    try:
        if name == "r":
            return int(value)
        if name in ("alpha", "dropout"):
            return float(value)
    except ValueError:
        raise InvalidInputError(f"{option('lora')} {name}={value!r} is not a number") from None
    if name == "dora":
        if value.lower() not in ("true", "false", "1", "0", "yes", "no"):
            raise InvalidInputError(f"{option('lora')} dora={value!r}: use true or false")
        return value.lower() in ("true", "1", "yes")
    if name == "targets":
        parts = tuple(p.strip() for p in value.split("+") if p.strip())
        if len(parts) == 1:
            return parts[0]
        return parts
    if name == "modules_to_save":
        return tuple(p.strip() for p in value.split("+") if p.strip())
    return value


#: ``compute=`` spellings of ``bnb_4bit_compute_dtype``
_COMPUTE_DTYPES = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16",
                   "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16"}


def parse_quant(text: str) -> QuantSpec:
    """Parse ``--quant nf4|nf4-dq|fp4|fp4-dq|int8``, optionally with the 4-bit compute dtype
    (``bnb_4bit_compute_dtype``): ``fp4,compute=fp32``. Without it the compute dtype follows
    the precision (:class:`QuantSpec`).

    Example:
        >>> parse_quant("nf4-dq").method.double_quant
        True
        >>> parse_quant("fp4,compute=fp32").compute_dtype
        'float32'
    """
    method, _, rest = str(text).partition(",")
    compute = None
    for item in (i.strip() for i in rest.split(",") if i.strip()):
        key, sep, value = item.partition("=")
        if not sep or key.strip().lower() != "compute":
            raise InvalidInputError(f"unknown {option('quant')} item {item!r}: the only one is "
                                    f"compute=fp32|bf16|fp16, e.g. "
                                    f"{option('quant', 'fp4,compute=fp32')}")
        compute = _COMPUTE_DTYPES.get(value.strip().lower())
        if compute is None:
            raise InvalidInputError(f"{option('quant')} compute={value.strip()!r}: use fp32, "
                                    "bf16 or fp16")
    spec = QuantSpec(method=method, compute_dtype=compute)
    if compute is not None and not spec.method.is_4bit:
        raise InvalidInputError(f"{option('quant')} compute= is the 4-bit compute dtype; "
                                f"{spec.method.value} has none: drop it")
    return spec


#: The first bitsandbytes with 4-bit weights (``Linear4bit``, the QLoRA release).
FIRST_4BIT = (0, 39, 0)


def parse_release(text: str | tuple[int, ...], keyword: str) -> tuple[int, int, int]:
    """A library release, ``"0.41.1"``, ``"0.43"``, ``"v0.45.0.post1"`` -> ``(0, 41, 1)``...,
    given as option ``keyword`` (named in the error a malformed one gets).

    Example:
        >>> parse_release("v0.2", "torchtune_version")
        (0, 2, 0)
    """
    found = re.match(r"v?(\d+)\.(\d+)(?:\.(\d+))?",
                     ".".join(map(str, text)) if isinstance(text, tuple) else str(text).strip())
    if found is None:
        raise InvalidInputError(f"malformed {option(keyword)} {text!r}: write it like 0.41.1 "
                                "or 0.45")
    return int(found[1]), int(found[2]), int(found[3] or 0)


def parse_bitsandbytes_version(text: str | tuple[int, ...] | None) -> tuple[int, int, int] | None:
    """``"0.41.1"``, ``"0.43"``, ``"v0.45.0.post1"`` -> ``(0, 41, 1)``...; None stays None
    (the installed one). What the version changes: :mod:`batchfit.engine.workloads.runtime`.

    Example:
        >>> parse_bitsandbytes_version("0.41.1")
        (0, 41, 1)
    """
    if text is None:
        return None
    version = parse_release(text, "bitsandbytes_version")
    if version < FIRST_4BIT:
        raise InvalidInputError(
            f"{option('bitsandbytes_version', text)}: bitsandbytes has 4-bit weights from "
            "0.39.0 on")
    return version


@dataclass(frozen=True)
class Workload:
    """Everything LLM-specific about a step (None fields: not used)."""

    lora: LoraSpec | None = None
    quant: QuantSpec | None = None
    loss: LossKind = LossKind.STANDARD
    transformers_version: tuple[int, int] | None = None  # None: the installed one's loss
    recipe: Any = None  # the framework (Recipe) whose model differs from transformers' (litgpt)
    extra: dict[str, Any] = field(default_factory=dict, compare=False)
