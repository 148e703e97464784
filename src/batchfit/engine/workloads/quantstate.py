"""Quantized weights in a fake trace.

bitsandbytes keeps a 4-bit weight as a ``Params4bit`` (a ``torch.nn.Parameter`` subclass)
whose ``quant_state`` holds the absmax blocks, the code book and, with double quantization,
a nested state. A fake tensor cannot be wrapped in ``Params4bit`` (``_make_subclass`` refuses
a tensor that already has a Python object of another type), so in the trace the packed
weight is a plain fake uint8 parameter that carries bitsandbytes' attributes, and its
``quant_state`` tensors are fake twins of the meta ones bitsandbytes computed. This is what
``Linear4bit.forward`` reads: it returns early from
``fix_4bit_weight_quant_state_from_module`` when ``weight.quant_state`` is set, and calls
``bnb.matmul_4bit(x, weight, bias, quant_state)``. LLM.int8 weights (``Int8Params``) are int8
parameters carrying ``CB`` (the same storage) and ``SCB``, their fp32 row scales.

:func:`layout_of` summarises the bytes of each part (packed data, absmax, nested absmax, code
books, offsets; int8 rows and scales), the per-component breakdown the README documents.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class QuantLayout:
    """Bytes of the quantized weights, by component, over the whole model.

    Attributes:
        layers: number of quantized linear layers.
        packed_bytes: 4-bit packed data (two values per byte) or int8 rows.
        absmax_bytes: first-level block scales (fp32, or uint8 when double-quantized).
        nested_absmax_bytes: second-level fp32 scales of the 8-bit absmax (double quant).
        code_bytes: code books (16 fp32 values per 4-bit layer; 256 for the nested state).
        offset_bytes: the fp32 offset of each nested state.
        scale_bytes: LLM.int8 per-row fp32 scales (``SCB``).
    """

    layers: int = 0
    packed_bytes: int = 0
    absmax_bytes: int = 0
    nested_absmax_bytes: int = 0
    code_bytes: int = 0
    offset_bytes: int = 0
    scale_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        return (self.packed_bytes + self.absmax_bytes + self.nested_absmax_bytes
                + self.code_bytes + self.offset_bytes + self.scale_bytes)

    def to_dict(self) -> dict[str, int]:
        return {"layers": self.layers, "packed_bytes": self.packed_bytes,
                "absmax_bytes": self.absmax_bytes,
                "nested_absmax_bytes": self.nested_absmax_bytes, "code_bytes": self.code_bytes,
                "offset_bytes": self.offset_bytes, "scale_bytes": self.scale_bytes,
                "total_bytes": self.total_bytes}


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def layout_of(model: nn.Module) -> QuantLayout:
    """The quantized-weight layout of a model built by :func:`batchfit.engine.workloads.build.quantize`
    (meta, fake or real)."""
    import bitsandbytes as bnb

    parts = dict.fromkeys(("layers", "packed_bytes", "absmax_bytes", "nested_absmax_bytes",
                           "code_bytes", "offset_bytes", "scale_bytes"), 0)
    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            state = getattr(module.weight, "quant_state", None) or module.quant_state
            parts["layers"] += 1
            parts["packed_bytes"] += _nbytes(module.weight)
            parts["absmax_bytes"] += _nbytes(state.absmax)
            parts["code_bytes"] += _nbytes(state.code)
            if state.nested:
                parts["nested_absmax_bytes"] += _nbytes(state.state2.absmax)
                parts["code_bytes"] += _nbytes(state.state2.code)
                parts["offset_bytes"] += _nbytes(state.offset)
        elif isinstance(module, bnb.nn.Linear8bitLt):
            parts["layers"] += 1
            parts["packed_bytes"] += _nbytes(module.weight)
            scb = getattr(module.weight, "SCB", None)
            if scb is None:
                scb = module.state.SCB
            parts["scale_bytes"] += _nbytes(scb)
    return QuantLayout(**parts)


def quant_attributes(model: nn.Module) -> dict[str, dict[str, Any]]:
    """What a fake copy of ``model`` loses per quantized layer: the bitsandbytes attributes
    of its weight (the quant state, the int8 scales), by module path."""
    import bitsandbytes as bnb

    found: dict[str, dict[str, Any]] = {}
    for path, module in model.named_modules():
        if isinstance(module, bnb.nn.Linear4bit):
            weight = module.weight
            found[path] = {
                "kind": "4bit", "quant_state": getattr(weight, "quant_state", None)
                or module.quant_state,
                **{k: getattr(weight, k) for k in ("blocksize", "compress_statistics",
                                                   "quant_type", "quant_storage")
                   if hasattr(weight, k)}}
        elif isinstance(module, bnb.nn.Linear8bitLt):
            found[path] = {"kind": "int8", "SCB": getattr(module.weight, "SCB", None)}
    return found


def _fake_twin(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(tuple(t.shape), t.stride(), dtype=t.dtype, device="cpu")


def _fake_state(state: Any, memo: dict[int, Any]) -> Any:
    if state is None:
        return None
    if id(state) in memo:
        return memo[id(state)]
    twin = copy.copy(state)
    for name in ("absmax", "code", "offset"):
        value = getattr(state, name, None)
        if isinstance(value, torch.Tensor):
            setattr(twin, name, _fake_twin(value))
    twin.state2 = _fake_state(getattr(state, "state2", None), memo)
    memo[id(state)] = twin
    return twin


def state_tensors(state: Any) -> list[torch.Tensor]:
    """The tensors of a 4-bit layer's quant state: absmax, code book, offset, and the nested
    state's absmax and code book with double quantization."""
    found = [t for t in (state.absmax, state.code, state.offset) if t is not None]
    if state.state2 is not None:
        found += [state.state2.absmax, state.state2.code]
    return found


def install_fake_quant_state(twin: nn.Module, attributes: dict[str, dict[str, Any]],
                             fake_mode: Any, cuda_target: bool) -> list[torch.Tensor]:
    """Give the fake twin's quantized layers fake versions of their quant state.

    ``attributes`` is :func:`quant_attributes` of the model ``twin`` was copied from.
    Returns the new fake tensors (absmax, code books, offsets, int8 scales), which are
    device memory as much as the packed weights are. Call after the twin's parameters
    became fake.
    """
    modules = dict(twin.named_modules())
    extra: list[torch.Tensor] = []
    memo: dict[int, Any] = {}
    with fake_mode:
        for path, attrs in attributes.items():
            module = modules.get(path)
            if module is None:
                continue
            weight = module.weight
            if attrs["kind"] == "4bit":
                state = _fake_state(attrs["quant_state"], memo)
                for name, value in attrs.items():
                    if name not in ("kind", "quant_state"):
                        setattr(weight, name, value)
                weight.quant_state = state
                weight.bnb_quantized = True
                module.quant_state = state
                # Linear4bit repacks its weight for AVX512-BF16 CPU inference; a CUDA target
                # never does, and the packed copy is another tensor.
                if cuda_target:
                    module.support_avx512bf16_for_cpu = False
                extra += state_tensors(state)
            else:
                scb = attrs["SCB"]
                fake_scb = _fake_twin(scb) if scb is not None else None
                weight.CB = weight
                weight.SCB = fake_scb
                weight.has_fp16_weights = False
                if fake_scb is not None:
                    extra.append(fake_scb)
    return extra
