"""Apply a :class:`~batchfit.engine.workloads.spec.Workload` to a built model, with the real libraries.

The order is the one a QLoRA script follows::

    model = AutoModelForCausalLM.from_pretrained(..., quantization_config=BitsAndBytesConfig(...))
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=...)
    model = get_peft_model(model, LoraConfig(...))

Quantization goes through transformers' own bitsandbytes quantizer
(``AutoHfQuantizer.from_config(BitsAndBytesConfig(...))``): it chooses the modules to keep in
full precision (the output embedding; ``llm_int8_skip_modules``) and swaps every other
``nn.Linear`` for ``bnb.nn.Linear4bit`` / ``Linear8bitLt``; then each weight is quantized as
transformers' loader does, ``Params4bit(weight, **old.__dict__).to(device)``, by bitsandbytes'
own ``quantize_4bit``. On the meta device (the trace) the same call runs bitsandbytes'
registered fake kernels, which give the packed data, the absmax blocks and, with double
quantization, the 8-bit absmax with its second-level statistics, in their exact shapes and
dtypes; nothing is approximated. LoRA is peft's ``get_peft_model``.

Works on meta tensors (what the trace builds) and on real CPU tensors (what
:mod:`batchfit.measure` runs as the reference).
"""

from __future__ import annotations

import contextlib
import difflib
import logging
import warnings
from typing import Any, Iterator

import torch
from torch import nn

from batchfit.errors import InvalidInputError, ModelSpecError, option
from batchfit.engine.workloads.spec import ALL_LINEAR, AdapterDtype, LoraSpec, QuantMethod, QuantSpec

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """transformers, peft and bitsandbytes log advice (\"prepare_model_for_kbit_training
    ...\", deprecation notes) that would break ``--json``; the library never prints."""
    loggers = [logging.getLogger(n) for n in ("transformers", "peft", "bitsandbytes")]
    levels = [lg.level for lg in loggers]
    try:
        for lg in loggers:
            lg.setLevel(logging.ERROR)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def import_bitsandbytes() -> Any:
    """``import bitsandbytes``. With ``BATCHFIT_BNB_NO_COMPILE=1`` (the CLI sets it for its
    own process), ``torch.compile`` is an identity while bitsandbytes imports: its CPU
    fallback kernels are wrapped in ``torch.compile`` at import, which imports
    ``torch._inductor`` (seconds of imports), and a trace never calls them."""
    import os
    import sys

    if "bitsandbytes" in sys.modules or os.environ.get("BATCHFIT_BNB_NO_COMPILE") != "1":
        import bitsandbytes

        return bitsandbytes

    def identity(fn: Any = None, **kwargs: Any) -> Any:
        return fn if fn is not None else (lambda f: f)

    saved = torch.compile
    torch.compile = identity
    try:
        import bitsandbytes
    finally:
        torch.compile = saved
    return bitsandbytes


def compute_dtype(quant: QuantSpec, precision: Any) -> torch.dtype:
    """``bnb_4bit_compute_dtype``: given, or the precision's 16-bit type (fp32 otherwise)."""
    if quant.compute_dtype is not None:
        return _DTYPES[quant.compute_dtype]
    name = getattr(precision, "autocast_dtype", None) or getattr(precision, "weight_dtype", None)
    return _DTYPES.get(name or "float32", torch.float32)


def apply_workload(model: nn.Module, workload: Any, *, precision: Any, checkpointing: bool,
                   use_reentrant: bool, training: bool) -> nn.Module:
    """Quantize, prepare and adapt ``model`` (meta or real) as ``workload`` says.

    Returns the model to train (a ``PeftModel`` when LoRA is on). The model's parameters
    must already be in the precision's weight dtype (the dtype a checkpoint is loaded in).
    """
    from batchfit.engine.keras_detect import is_keras_model

    if is_keras_model(model):
        raise InvalidInputError(
            f"{option('lora')}/{option('quant')} adapt torch modules with peft and bitsandbytes; "
            f"{type(model).__name__} is a Keras model (Keras has its own model.enable_lora(rank) "
            f"and quantize()): drop {option('lora')}/{option('quant')}")
    from batchfit.engine.workloads import litgpt
    from batchfit.engine.workloads.recipes import Recipe

    as_litgpt = getattr(workload, "recipe", None) is Recipe.LITGPT
    quant = litgpt.litgpt_quant(workload.quant) if as_litgpt else workload.quant
    with _quiet():
        if quant is not None or workload.lora is not None:
            import_bitsandbytes()  # before peft, which imports it (see import_bitsandbytes)
        if as_litgpt:
            litgpt.untie_output_embedding(model)
            litgpt.expand_kv_heads(model)
        if quant is not None:
            model = quantize(model, quant, compute_dtype(quant, precision),
                             from_dtype=litgpt.QUANTIZED_FROM if as_litgpt else None)
            if quant.prepare and training:
                model = _prepare_kbit(model, checkpointing, use_reentrant)
        if workload.lora is not None:
            model = add_lora(model, workload.lora)
            if as_litgpt:
                litgpt.fuse_qkv_dropout(model)
    return model


# -- quantization ----------------------------------------------------------------------------

def _bnb_config(quant: QuantSpec, dtype: torch.dtype) -> Any:
    from transformers import BitsAndBytesConfig

    # () skips nothing (transformers adds its default skips only for None)
    skip = list(quant.skip_modules) if quant.skip_modules is not None else None
    if quant.method is QuantMethod.INT8:
        return BitsAndBytesConfig(load_in_8bit=True, llm_int8_skip_modules=skip)
    return BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type=quant.method.quant_type,
        bnb_4bit_use_double_quant=quant.method.double_quant, bnb_4bit_compute_dtype=dtype,
        llm_int8_skip_modules=skip)


def quantize(model: nn.Module, quant: QuantSpec, dtype: torch.dtype,
             from_dtype: torch.dtype | None = None) -> nn.Module:
    """Swap linear layers for bitsandbytes ones through transformers' quantizer, then
    quantize each weight with bitsandbytes (on the weight's own device: meta or real).

    ``from_dtype``: cast each weight to it before quantizing (the 4-bit quant state keeps
    that dtype, which its dequantization writes); None quantizes the weight as loaded."""
    bnb = import_bitsandbytes()
    from transformers.quantizers import AutoHfQuantizer

    linear = [n for n, m in model.named_modules() if type(m) is nn.Linear]
    if not linear:
        raise InvalidInputError(
            f"{option('quant', quant.method.value)}: {type(model).__name__} has no nn.Linear "
            f"layer to quantize (bitsandbytes quantizes linear layers only); drop "
            f"{option('quant')}")
    if not hasattr(model, "config"):
        raise InvalidInputError(
            f"{option('quant')} needs a transformers model (hf:NAME); {type(model).__name__} "
            "is not one")
    weights = {n: m.weight for n, m in model.named_modules() if type(m) is nn.Linear}
    biases = {n: m.bias for n, m in model.named_modules() if type(m) is nn.Linear}
    _prime_code_books()
    quantizer = AutoHfQuantizer.from_config(_bnb_config(quant, dtype), pre_quantized=False)
    device = next(iter(weights.values())).device
    quantizer.preprocess_model(model, device_map={"": str(device)})
    replaced = 0
    for name, module in model.named_modules():
        if isinstance(module, bnb.nn.Linear4bit):
            old = module.weight
            data = weights[name].data if from_dtype is None else weights[name].data.to(from_dtype)
            module.weight = bnb.nn.Params4bit(data, requires_grad=False,
                                              **old.__dict__)._quantize(device)
        elif isinstance(module, bnb.nn.Linear8bitLt):
            module.weight = _int8_param(weights[name].data, module.weight, device)
        else:
            continue
        if biases[name] is not None:
            # the checkpoint's bias, in its dtype (the loader copies it as stored)
            module.bias = nn.Parameter(biases[name].data, requires_grad=False)
        replaced += 1
    if not replaced:
        raise InvalidInputError(
            f"{option('quant', quant.method.value)}: no linear layer of {type(model).__name__} was "
            "quantized (all are kept in full precision by the skip list)")
    quantizer.postprocess_model(model)
    model.hf_quantizer = quantizer
    return model


def _prime_code_books() -> None:
    """bitsandbytes caches its 8-bit dynamic code book in a module-level dict on first use,
    on the device of the first tensor quantized, and copies it with ``.to(device)`` after.
    Built first on meta it would stay meta (a real quantization later could not copy it);
    build it on the CPU, where it belongs (it is computed with ``.tolist()``)."""
    import bitsandbytes.functional as bnbf

    if "dynamic" not in bnbf.name2qmap:
        with torch.device("cpu"):
            bnbf.name2qmap["dynamic"] = bnbf.create_dynamic_map()


def _int8_param(weight: torch.Tensor, old: Any, device: torch.device) -> Any:
    """``Int8Params(weight).to(device)``: int8 rows ``CB`` and their fp32 scales ``SCB``.

    On meta, ``Int8Params.to`` does not quantize (it skips the meta device), so the same
    bitsandbytes op is called directly: ``int8_vectorwise_quant(weight.to(float16))``.
    """
    import bitsandbytes as bnb

    if device.type != "meta":
        kwargs = {k: v for k, v in old.__dict__.items() if k in ("has_fp16_weights",)}
        return bnb.nn.Int8Params(weight.to("cpu"), requires_grad=False, **kwargs).to(device)
    cb, scb, _ = bnb.functional.int8_vectorwise_quant(weight.to(torch.float16))
    param = bnb.nn.Int8Params(cb, requires_grad=False, has_fp16_weights=False)
    param.CB, param.SCB = cb, scb
    return param


def _prepare_kbit(model: nn.Module, checkpointing: bool, use_reentrant: bool) -> nn.Module:
    from peft import prepare_model_for_kbit_training

    return prepare_model_for_kbit_training(
        model, use_gradient_checkpointing=checkpointing,
        gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})


# -- LoRA --------------------------------------------------------------------------------------

def _adaptable(model: nn.Module) -> list[str]:
    """Names of the layers peft's LoRA can wrap (linear, Conv1D, embedding, conv)."""
    from transformers.pytorch_utils import Conv1D

    kinds = (nn.Linear, nn.Embedding, nn.Conv1d, nn.Conv2d, Conv1D)
    return [n for n, m in model.named_modules() if n and isinstance(m, kinds)]


def _check_targets(model: nn.Module, lora: LoraSpec) -> None:
    """A target that matches no module: one line with the candidates (peft's own error
    names the set, not what would have matched)."""
    if lora.targets is None or isinstance(lora.targets, str):
        return
    names = _adaptable(model)
    leaves = sorted({n.rsplit(".", 1)[-1] for n in names})
    for target in lora.targets:
        if not any(n == target or n.endswith("." + target) for n in names):
            close = difflib.get_close_matches(target, leaves, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise InvalidInputError(
                f"LoRA target {target!r} matches no module of {type(model).__name__}{hint}: "
                f"candidates are {', '.join(leaves) or 'none'}, or targets=all-linear")
    for name in lora.modules_to_save:
        if not any(n == name or n.endswith("." + name) for n, _ in model.named_modules()):
            raise InvalidInputError(
                f"LoRA modules_to_save {name!r} matches no module of {type(model).__name__}")


def add_lora(model: nn.Module, lora: LoraSpec) -> nn.Module:
    """``get_peft_model(model, LoraConfig(...))`` (task type causal LM for decoders)."""
    from peft import LoraConfig, get_peft_model

    _check_targets(model, lora)
    targets: Any = lora.targets
    if isinstance(targets, tuple):
        targets = list(targets)
    config = LoraConfig(
        r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
        target_modules=ALL_LINEAR if targets == ALL_LINEAR else targets,
        modules_to_save=list(lora.modules_to_save) or None, bias=lora.bias,
        use_dora=lora.dora, task_type=_task_type(model))
    # peft builds each adapter on the default device and then moves it to the base layer's;
    # for a meta model, build it on meta (224 adapters of Llama-3-8B: ~3.6 s of real
    # initialisation otherwise)
    on_meta = any(p.is_meta for p in model.parameters())
    try:
        with torch.device("meta") if on_meta else contextlib.nullcontext():
            adapted = get_peft_model(model, config,
                                     autocast_adapter_dtype=lora.dtype is not AdapterDtype.BASE)
            if lora.dtype is not AdapterDtype.FP32:
                _cast_adapters(adapted, torch.bfloat16 if lora.dtype is AdapterDtype.BF16
                               else None)
            return adapted
    except ValueError as exc:
        first = (str(exc).strip().splitlines() or ["ValueError"])[0]
        if "target_modules" in first or "not found" in first or "target modules" in first:
            leaves = sorted({n.rsplit(".", 1)[-1] for n in _adaptable(model)})
            raise InvalidInputError(
                f"LoRA targets matched no module ({first}): candidates are "
                f"{', '.join(leaves)}") from exc
        raise ModelSpecError(f"peft could not add LoRA: {first}") from exc


def _cast_adapters(model: nn.Module, dtype: torch.dtype | None) -> None:
    """Hold each LoRA layer's adapters in ``dtype``, or (None) in its base layer's dtype: the
    weight's when it is a float, else the 4-bit layer's compute dtype. Frameworks that build
    adapters under a bf16 default dtype (litgpt, torchtune) hold them in bf16; peft has no
    such switch (``autocast_adapter_dtype=False`` leaves adapters built on meta, and those of
    a uint8 4-bit layer, in fp32)."""
    from peft.tuners.lora import LoraLayer

    for module in model.modules():
        if not isinstance(module, LoraLayer):
            continue
        weight = module.get_base_layer().weight
        wanted = dtype or (weight.dtype if weight.is_floating_point() else getattr(
            module.get_base_layer(), "compute_dtype", None) or torch.float32)
        for name, param in module.named_parameters():
            if name.startswith("lora_") and param.dtype != wanted:
                param.data = param.data.to(wanted)


def _task_type(model: nn.Module) -> str | None:
    name = type(model).__name__
    if name.endswith(("ForCausalLM", "LMHeadModel")):
        return "CAUSAL_LM"
    if name.endswith("ForConditionalGeneration") and getattr(
            getattr(model, "config", None), "is_encoder_decoder", False):
        return "SEQ_2_SEQ_LM"
    if name.endswith("ForSequenceClassification"):
        return "SEQ_CLS"
    return None
