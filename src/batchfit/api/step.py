"""The step a user names in words: a model spec string and the options' values, as the CLI
and :mod:`batchfit.api` take them, turned into what the engine runs (a :class:`ModelSpec`,
its input spec and a :class:`~batchfit.engine.spec.TrainConfig`).

Every default that changes an answer is decided here, once, for both callers. Messages name
options through :func:`batchfit.errors.option`, so each caller reads its own vocabulary.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from batchfit._gc import imports_done
from batchfit.engine.spec import Mode, Precision, parse_enum, parse_shape, parse_size
from batchfit.errors import InvalidInputError, option

#: ``attn`` spellings -> the implementation
ATTN = {"sdpa": "sdpa", "eager": "eager", "flash": "flash", "flash-attention-2": "flash",
        "flash_attention_2": "flash"}


@dataclass(frozen=True)
class Step:
    """What runs: the resolved model spec, its per-sample inputs and the step's config."""

    spec: Any  # batchfit.models.resolve.ModelSpec
    inputs: Any
    config: Any  # batchfit.engine.spec.TrainConfig


def stack_settings(stack: str | None = None, torch_version: str | None = None,
                   cuda_version: str | None = None, cudnn_benchmark: bool = False,
                   inference_mode: bool = False, alloc_conf: str | None = None) -> dict[str, Any]:
    """TrainConfig fields for the stack options and the ones whose effect the stack decides
    (checked now: a bad version or allocator option is one line)."""
    from batchfit.device.allocator import AllocatorConfig

    # None leaves the choice to the library (the shell's variable, or a snapshot's
    # options); a malformed variable is reported now, before any tracing.
    AllocatorConfig.from_environment()
    settings: dict[str, Any] = {"cudnn_benchmark": cudnn_benchmark,
                                "inference_mode": inference_mode,
                                "alloc_conf": (None if alloc_conf is None
                                               else AllocatorConfig.parse(alloc_conf))}
    if stack is not None or torch_version is not None or cuda_version is not None:
        from batchfit.engine.stack import Stack

        settings["stack"] = Stack.parse(stack=stack, torch_version=torch_version,
                                        cuda_version=cuda_version)
    return settings


def parallel_layout(world_size: int | None = None, strategy: str | None = None,
                    offload: str = "none", tp: int = 1, nodes: int = 1, rank: int | None = None,
                    wrap: str | None = None, nccl_memory: str | None = None) -> tuple[Any, Any]:
    """The multi-GPU layout and NCCL model of the options, or (None, None)."""
    if world_size is None:
        given = [name for name, value in (("strategy", strategy), ("tp", tp != 1),
                                          ("nodes", nodes != 1), ("rank", rank),
                                          ("wrap", wrap), ("nccl_memory", nccl_memory),
                                          ("offload", offload != "none")) if value]
        if given:
            raise InvalidInputError(f"{option(given[0])} is a multi-GPU option: add "
                                    f"{option('world_size', 'N')}")
        return None, None
    from batchfit.sharding import NcclMemory, Parallelism

    units = tuple(w.strip() for w in wrap.split(",") if w.strip()) if wrap else None
    layout = Parallelism(world_size=world_size, strategy=strategy or "ddp", offload=offload,
                         tp=tp, nodes=nodes, rank=rank, wrap=units)
    nccl = NcclMemory(per_communicator_bytes=parse_size(nccl_memory, allow_zero=True)) \
        if nccl_memory is not None else None
    return layout, nccl


def _model_kwargs(model_kwargs: Sequence[str] | Mapping[str, Any] | None) -> dict[str, Any]:
    from batchfit.models.resolve import parse_model_kwargs

    if isinstance(model_kwargs, Mapping):
        return dict(model_kwargs)
    return parse_model_kwargs(list(model_kwargs or []))


def _config(mode: str, optimizer: str | None, precision: str | None,
            checkpointing: bool | None, channels_last: bool, lora: str | None,
            quant: str | None, loss: str | None, grad_accum: int, use_reentrant: bool | None,
            packing: bool, attn: str | None, transformers_version: str | None,
            bitsandbytes_version: str | None, recipe: str | None, zero_grad: str | None,
            settings: dict[str, Any], torchtune_version: str | None = None) -> Any:
    """The step's config. What the options leave None (precision, checkpointing, optimizer,
    loss) the recipe decides in :class:`TrainConfig` (peft's QLoRA defaults with ``quant``
    and no recipe: :mod:`batchfit.engine.workloads.recipes`)."""
    from batchfit.engine.spec import TrainConfig, parse_optimizer

    if grad_accum < 1:
        raise InvalidInputError(f"{option('grad_accum')} must be a positive integer, "
                                f"not {grad_accum}")
    config = TrainConfig(
        mode=parse_enum(Mode, mode, "mode"),
        optimizer=parse_optimizer(optimizer) if optimizer else None, recipe=recipe,
        precision=parse_enum(Precision, precision, "precision") if precision else None,
        checkpointing=checkpointing, channels_last=channels_last,
        lora=lora, quant=quant, loss=loss, grad_accum_steps=grad_accum,
        use_reentrant=use_reentrant, transformers_version=transformers_version,
        bitsandbytes_version=bitsandbytes_version, torchtune_version=torchtune_version,
        zero_grad_after_forward=_zero_grad_after_forward(zero_grad), **settings,
        # flash attention takes packed rows as varlen sequences and builds no mask
        packing=packing and ATTN.get((attn or "sdpa").strip().lower()) != "flash")
    if config.quant is not None and config.lora is None and config.mode is Mode.TRAIN:
        raise InvalidInputError(
            f"{option('quant', config.quant.method.value)} freezes the quantized base weights, "
            f"so nothing would train: add {option('lora')} (QLoRA), or use "
            f"{option('mode', 'infer')}")
    if use_reentrant is not None and not config.checkpointing:
        raise InvalidInputError(f"{option('use_reentrant')} applies to checkpointing: "
                                f"add {option('checkpointing', True)}")
    return config


def _zero_grad_after_forward(zero_grad: str | None) -> bool:
    """``zero_grad``: where the loop calls ``zero_grad``: ``first`` (before the forward, as
    torch's examples do) or ``after-forward`` (between the loss and ``backward``, as
    Lightning's automatic optimization does: last step's gradients live through the
    forward)."""
    text = "first" if zero_grad is None else str(zero_grad).strip().lower().replace("_", "-")
    if text not in ("first", "after-forward"):
        raise InvalidInputError(f"unknown {option('zero_grad')} {zero_grad!r}: use first or "
                                "after-forward (Lightning's Trainer)")
    return text == "after-forward"


def _attn_kwargs(attn: str | None, kwargs: dict[str, Any]) -> None:
    """``attn`` as the model's ``attn_implementation`` (flash: the SDPA path, with the
    target's flash kernel required, checked by :func:`check_attn`)."""
    if attn is None:
        return
    implementation = ATTN.get(attn.strip().lower())
    if implementation is None:
        raise InvalidInputError(f"unknown {option('attn')} {attn!r}: use sdpa, eager or flash")
    if "attn_implementation" in kwargs:
        raise InvalidInputError(f"give {option('attn')} or {option('model_kwargs')} "
                                "attn_implementation=..., not both")
    kwargs["attn_implementation"] = "sdpa" if implementation == "flash" else implementation


def resolve_step(model: str, *, input_shape: str | None = None, seq_len: int | None = None,
                 mode: str = "train", optimizer: str | None = None,
                 precision: str | None = None, checkpointing: bool | None = None,
                 channels_last: bool = False,
                 model_kwargs: Sequence[str] | Mapping[str, Any] | None = None,
                 lora: str | None = None, quant: str | None = None, loss: str | None = None,
                 grad_accum: int = 1, use_reentrant: bool | None = None, packing: bool = False,
                 attn: str | None = None, transformers_version: str | None = None,
                 bitsandbytes_version: str | None = None,
                 torchtune_version: str | None = None,
                 recipe: str | None = None, zero_grad: str | None = None,
                 **settings: Any) -> Step:
    """The step named by ``model`` (``timm:NAME``, ``hf:NAME``, ``path/file.py:factory``...)
    and the options, with every default decided: the optimizer (adamw, or a compiled Keras
    model's own), the precision and checkpointing (the ``recipe``'s; with ``quant`` and no
    recipe, amp-bf16 and on, as peft's QLoRA runs), the attention implementation. ``settings`` are
    :func:`stack_settings`'s fields."""
    from batchfit.models.resolve import resolve_model

    config = _config(mode, optimizer, precision, checkpointing, channels_last, lora, quant,
                     loss, grad_accum, use_reentrant, packing, attn, transformers_version,
                     bitsandbytes_version, recipe, zero_grad, settings, torchtune_version)
    if seq_len is not None and seq_len < 1:
        raise InvalidInputError(f"{option('seq_len')} must be a positive integer, not {seq_len}")
    shape = parse_shape(input_shape) if input_shape is not None else None
    kwargs = _model_kwargs(model_kwargs)
    _attn_kwargs(attn, kwargs)
    spec = resolve_model(model, model_kwargs=kwargs, seq_len=seq_len, input_shape=shape,
                         packing=packing)
    imports_done()  # the CLI's process freezes what the imports built (batchfit._gc)
    if spec.keras_compiled is False and optimizer is None:
        raise InvalidInputError(
            f"the Keras model of {model} is not compiled: compile it in the factory "
            f"(model.compile(optimizer=..., loss=...)) or give {option('optimizer', 'NAME')}")
    if spec.keras_compiled and optimizer is not None:  # the user's choice over the compiled one
        from batchfit.engine.keras_step import with_optimizer

        spec = replace(spec, factory=with_optimizer(spec.factory, config.optimizer))
    if spec.input_spec is None:
        raise InvalidInputError(
            f"{model} has no default input: give {option('input_shape')} (per-sample shape, "
            "e.g. 3x224x224)")
    if spec.loss_fn is not None:
        config = replace(config, loss_fn=spec.loss_fn)
    inputs = spec.input_spec
    if spec.hf_labels and config.mode is Mode.INFER:
        inputs = inference_inputs(inputs, spec.hf_task)
    return Step(spec, inputs, config)


def inference_inputs(inputs: Mapping[str, Any], task: Any) -> dict[str, Any]:
    """A Hugging Face model's batch for inference: what ``model(**batch)`` takes to
    predict, without the ``labels`` that make it compute its loss as well (the logits
    upcast to float32 and their log-softmax, as large again as the logits: in
    ``transformers``' ``ForCausalLMLoss``, loss/loss_utils.py); a seq2seq model, which
    derives its decoder's input from the labels when it has no ``decoder_input_ids``
    (T5's ``_shift_right``, BART's ``shift_tokens_right`` in their forwards), takes them
    as ``decoder_input_ids``.

    Example:
        >>> from batchfit import TensorSpec
        >>> from batchfit.models.modelspec import HFTask
        >>> tokens = TensorSpec((8,), "int64", high=100)
        >>> sorted(inference_inputs({"input_ids": tokens, "labels": tokens}, HFTask.CAUSAL_LM))
        ['input_ids']
        >>> sorted(inference_inputs({"input_ids": tokens, "labels": tokens}, HFTask.SEQ2SEQ_LM))
        ['decoder_input_ids', 'input_ids']
    """
    from batchfit.models.modelspec import HFTask

    kept = {name: value for name, value in inputs.items() if name != "labels"}
    if task is HFTask.SEQ2SEQ_LM and "labels" in inputs:
        kept["decoder_input_ids"] = inputs["labels"]
    return kept


def check_attn(attn: str | None, config: Any, profile: Any) -> None:
    """``attn="flash"`` is the flash kernel the target must be able to run: flash-attention
    (and SDPA's flash backend) need an sm80+ GPU and fp16/bf16 activations."""
    if attn is None or ATTN.get(attn.strip().lower()) != "flash":
        return
    half = config.precision.value in ("amp-fp16", "amp-bf16", "bf16", "fp16")
    if not profile.is_cuda:
        raise InvalidInputError(f"{option('attn', 'flash')} runs flash-attention CUDA kernels: "
                                f"give {option('gpu', 'NAME')}")
    if tuple(profile.compute_capability or (0, 0)) < (8, 0) or not half:
        raise InvalidInputError(
            f"{option('attn', 'flash')} needs an sm80+ GPU and fp16/bf16 "
            f"({option('precision', 'amp-bf16')}, bf16...); {profile.name} is "
            f"sm{''.join(map(str, profile.compute_capability or ()))} with "
            f"{config.precision.value}: use {option('attn', 'sdpa')}")


def small_answer_batches(config: Any) -> tuple[int, int] | None:
    """The batches ``max`` traces first. LLM fine-tuning: the weights fill most of the card
    and the answer is small; tracing batches 1 and 2 first makes them the confirming pair of
    an answer of 1 (one round of traces); when 2 fits, the step is interpolated from 2 and 3.
    None: the library's default pair."""
    return (1, 2) if config.lora is not None or config.quant is not None else None


def context_length(spec: Any) -> int | None:
    """The model's maximum positions, from its config (HF specs carry it; other models are
    built on meta to read it)."""
    from batchfit.engine.fake import build_on_meta
    from batchfit.models.resolve import _max_positions

    if getattr(spec, "max_positions", None):
        return spec.max_positions
    built = build_on_meta(spec.factory)
    config = getattr(built, "config", None)
    return _max_positions(config) if config is not None else None
