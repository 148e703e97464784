"""The answers asked in words: a model spec string and the CLI's option names as keywords.

``max_batch_words("hf:meta-llama/Llama-3.2-1B", gpu="RTX 4090", seq_len=512, lora="r=8",
quant="nf4")`` answers what ``batchfit max hf:meta-llama/Llama-3.2-1B --gpu "RTX 4090"
--seq-len 512 --lora r=8 --quant nf4`` answers: the command line is a translation of its
flags into these calls (flag ``--seq-len`` -> keyword ``seq_len``; ``--input`` ->
``input_shape``). The public entry points (:func:`batchfit.estimate`,
:func:`batchfit.max_batch_size`, :func:`batchfit.max_seq_len`) send a spec string here.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from batchfit.api.step import (
    Step,
    check_attn,
    context_length,
    parallel_layout,
    resolve_step,
    small_answer_batches,
    stack_settings,
)
from batchfit.api.target import chosen, resolve_target, with_cpu_overhead
from batchfit.errors import InvalidInputError, option

#: The keywords of each group, as the CLI's flags name them (``--seq-len`` -> ``seq_len``).
STEP_WORDS = ("input_shape", "seq_len", "mode", "optimizer", "precision", "checkpointing",
              "channels_last", "model_kwargs", "lora", "quant", "loss", "grad_accum",
              "use_reentrant", "packing", "attn", "transformers_version", "recipe",
              "bitsandbytes_version", "torchtune_version", "zero_grad")
STACK_WORDS = ("stack", "torch_version", "cuda_version", "cudnn_benchmark", "inference_mode",
               "alloc_conf")
TARGET_WORDS = ("gpu", "device", "memory", "overhead")
PARALLEL_WORDS = ("world_size", "strategy", "offload", "tp", "nodes", "rank", "wrap",
                  "nccl_memory")
StatusFn = Callable[[str], None]


@dataclass(frozen=True)
class Answer:
    """A library answer with what was chosen for the caller.

    Attributes:
        model: the spec string asked about.
        result: the engine's result (:class:`~batchfit.answers.estimate.MemoryEstimate`,
            :class:`~batchfit.answers.maxbatch.MaxBatchResult`, ...); its fields read
            through the answer too (``answer.max_batch_size``).
        choices: ``gpu_choice`` (the catalog card a short name stands for) and ``hf_task``
            (the head a bare Hugging Face name is built with), when made.
        notes: one line for each choice worth telling the caller.
    """

    model: str
    result: Any
    choices: dict[str, Any] = field(default_factory=dict)
    notes: tuple[str, ...] = ()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "result":
            raise AttributeError(name)
        return getattr(self.result, name)

    def to_dict(self) -> dict[str, Any]:
        """What ``--json`` prints: the model, the choices and the result's fields."""
        return {"model": self.model, **self.choices, **self.result.to_dict()}


def _split(words: dict[str, Any], *groups: tuple[str, ...]) -> list[dict[str, Any]]:
    """``words`` by group; an unknown keyword is one line naming the closest known one."""
    known = [name for group in groups for name in group]
    unknown = [name for name in words if name not in known]
    if unknown:
        close = difflib.get_close_matches(unknown[0], known, n=1)
        hint = f": did you mean {close[0]}?" if close else f"; known: {', '.join(known)}"
        raise InvalidInputError(f"unknown keyword {unknown[0]!r}{hint}")
    return [{name: words[name] for name in group if name in words} for group in groups]


@dataclass(frozen=True)
class _Prepared:
    step: Step
    profile: Any
    memory_bytes: int | None
    parallel: Any
    nccl: Any
    choices: dict[str, Any]
    notes: tuple[str, ...]


def _prepare(model: str, words: dict[str, Any], need_budget: bool) -> _Prepared:
    """The step, target and layout of ``words``, checked in the order a user fixes them."""
    target, stack, parallel_words, step_words = _split(
        words, TARGET_WORDS, STACK_WORDS, PARALLEL_WORDS, STEP_WORDS)
    parallel, nccl = parallel_layout(**parallel_words)
    settings = stack_settings(**stack)
    if not need_budget and target.get("memory") is not None and not target.get("gpu"):
        raise InvalidInputError(
            f"estimate {option('memory')} goes with {option('gpu', 'NAME')}, as that card's "
            f"memory; an estimate on {option('device')} uses the device as it is (max "
            f"{option('memory')} sets a budget)")
    profile, memory_bytes = resolve_target(
        target.get("gpu"), target.get("device"), target.get("memory"), target.get("overhead"),
        need_budget=need_budget)
    if "stack" in settings:  # the stack's context must leave room (checked before tracing)
        profile.for_stack(settings["stack"])
    if need_budget and not profile.is_cuda and memory_bytes is None:
        raise InvalidInputError(f"{option('device', 'cpu')} needs {option('memory', 'SIZE')} "
                                "as the budget")
    step = resolve_step(model, **step_words, **settings)
    check_attn(step_words.get("attn"), step.config, profile)
    choices, notes = chosen(target.get("gpu"), step.spec, step.config)
    return _Prepared(step, profile, memory_bytes, parallel, nccl, choices, tuple(notes))


def estimate_words(model: str, batch_size: int, *, snapshot: str | None = None,
                   on_status: StatusFn | None = None, **words: Any) -> Answer:
    """Predict the peak memory of one step of the model named ``model`` at ``batch_size``
    (per GPU with ``world_size``); ``snapshot``: a CUDA memory snapshot file of this step
    to set the prediction against. ``words``: the CLI's options as keywords."""
    if batch_size < 1:
        raise InvalidInputError(f"{option('batch_size')} must be a positive integer, "
                                f"not {batch_size}")
    real = None
    if snapshot is not None:
        from batchfit.device.snapshot import load_snapshot

        if words.get("world_size") is not None:
            raise InvalidInputError(f"{option('snapshot')} compares one GPU's step: leave out "
                                    f"{option('world_size')}")
        real = load_snapshot(snapshot)
    prepared = _prepare(model, words, need_budget=False)
    step = prepared.step
    if on_status is not None:
        on_status(f"tracing {model} at batch {batch_size}")
    if prepared.parallel is None:
        from batchfit.answers.estimate import estimate

        result = estimate(step.spec.factory, step.inputs, batch_size, step.config,
                          device=prepared.profile, snapshot=real)
    else:
        from batchfit.answers.ranks import estimate_ranks

        result = estimate_ranks(step.spec.factory, step.inputs, batch_size, step.config,
                                device=prepared.profile, parallel=prepared.parallel,
                                nccl=prepared.nccl)
    return Answer(model, result, prepared.choices, prepared.notes)


def _check_search(margin: float, max_batch_limit: int) -> None:
    if not 0 <= margin < 1:
        raise InvalidInputError(f"{option('margin', margin)} must be a fraction in [0, 1), "
                                "e.g. 0.05")
    if max_batch_limit < 1:
        raise InvalidInputError(f"{option('max_batch_limit')} must be positive")


def _budgeted(model: str, words: dict[str, Any], on_status: StatusFn | None) -> _Prepared:
    """The prepared step of ``max``; on the CPU without ``overhead``, the runtime's overhead
    measured with one real step of the model."""
    prepared = _prepare(model, words, need_budget=True)
    if not prepared.profile.is_cuda and words.get("overhead") is None:
        if on_status is not None:
            on_status(f"measuring the CPU runtime's overhead: one real step of {model}")
        from dataclasses import replace

        prepared = replace(prepared, profile=with_cpu_overhead(prepared.profile, prepared.step))
    return prepared


def _tracing(model: str, what: str, on_status: StatusFn | None) -> Callable[[int], None] | None:
    if on_status is None:
        return None
    return lambda value: on_status(f"tracing {model} at {what} {value}")


def max_batch_words(model: str, *, margin: float = 0.0, max_batch_limit: int = 65536,
                    on_status: StatusFn | None = None, **words: Any) -> Answer:
    """The largest batch of the model named ``model`` that fits the target (per GPU with
    ``world_size``). ``words``: the CLI's options as keywords."""
    from batchfit.answers.maxbatch import max_batch_size

    _check_search(margin, max_batch_limit)
    prepared = _budgeted(model, words, on_status)
    step = prepared.step
    result = max_batch_size(step.spec.factory, step.inputs, step.config, device=prepared.profile,
                            memory_bytes=prepared.memory_bytes, margin=margin,
                            max_batch_limit=max_batch_limit,
                            on_trace=_tracing(model, "batch", on_status),
                            fit_batches=small_answer_batches(step.config),
                            parallel=prepared.parallel, nccl=prepared.nccl)
    return Answer(model, result, prepared.choices, prepared.notes)


def max_seq_len_words(model: str, batch_size: int, *, margin: float = 0.0,
                      on_status: StatusFn | None = None, **words: Any) -> Answer:
    """The longest sequence of the token model named ``model`` that fits the target at
    ``batch_size``, up to the model's context. ``words``: the CLI's options as keywords."""
    from batchfit.answers.maxbatch import max_seq_len

    if words.get("world_size") is not None:
        raise InvalidInputError(f"{option('batch_size')} (longest {option('seq_len')}) is "
                                f"single-GPU only: drop it, or drop {option('world_size')}")
    if batch_size < 1:
        raise InvalidInputError(f"{option('batch_size')} must be a positive integer, "
                                f"not {batch_size}")
    _check_search(margin, 1)
    prepared = _budgeted(model, words, on_status)
    step = prepared.step
    if not step.spec.is_token_model:
        raise InvalidInputError(
            f"{model} takes no token sequence: {option('batch_size')} with max solves for "
            f"{option('seq_len')}; drop {option('batch_size')} to find the largest batch")
    result = max_seq_len(step.spec.factory, step.inputs, batch_size, step.config,
                         device=prepared.profile, memory_bytes=prepared.memory_bytes,
                         margin=margin, max_len=context_length(step.spec) or 131072,
                         on_trace=_tracing(model, "sequence length", on_status))
    return Answer(model, result, prepared.choices, prepared.notes)


def batch_list(batches: str | Sequence[int]) -> str | list[int]:
    """``"auto"``, or the sorted distinct batch sizes of ``"16,32,64"`` or a list; one line
    naming the option otherwise."""
    if isinstance(batches, str) and batches.strip().lower() == "auto":
        return "auto"
    items = batches.replace(" ", "").split(",") if isinstance(batches, str) else list(batches)
    try:
        values = [int(v) for v in items if v != ""]
    except (TypeError, ValueError):
        values = []
    if not values or any(v < 1 for v in values):
        raise InvalidInputError(f"bad {option('batches', batches)}: use auto or a "
                                "comma-separated list like 16,32,64")
    return sorted(set(values))


def predict_throughput_words(model: str, *, gpu: str, memory: str | None = None,
                             batches: Any = "auto", dataset_size: int | None = None,
                             **words: Any) -> Answer:
    """Predicted step time and throughput against batch size of the model named ``model`` on
    the catalog card ``gpu`` (``memory``: that card with this much memory), as ``batchfit
    bench --predict`` asks it. ``batches``: ``"auto"``, ``"16,32,64"`` or a list of batch
    sizes. ``words``: the step's and the stack's options as keywords."""
    from batchfit.api.target import predicted_card
    from batchfit.engine.spec import parse_size
    from batchfit.speed.roofline import predict_throughput

    step_words, stack = _split(words, STEP_WORDS, STACK_WORDS)
    if dataset_size is not None and dataset_size < 1:
        raise InvalidInputError(f"{option('dataset_size')} must be a positive integer, "
                                f"not {dataset_size}")
    settings = stack_settings(**stack)
    card = predicted_card(gpu, parse_size(memory) if memory is not None else None,
                          settings.get("stack"))
    step = resolve_step(model, **step_words, **settings)
    choices, notes = chosen(gpu, step.spec, step.config)
    result = predict_throughput(step.spec.factory, step.inputs, step.config, gpu=card,
                                batches=batch_list(batches), dataset_size=dataset_size)
    return Answer(model, result, choices, tuple(notes))


#: The step's options ``plan`` takes (it chooses checkpointing itself, per layout).
PLAN_STEP_WORDS = ("input_shape", "seq_len", "optimizer", "precision", "model_kwargs")


def plan_words(model: str, *, gpus: str, global_batch: int, nodes: int = 1,
               strategies: str | list[str] | None = None, tp: str | list[int] | None = None,
               checkpointing: str = "auto", offload: str = "auto",
               network_gbs: float | None = None, on_status: StatusFn | None = None,
               **words: Any) -> Answer:
    """Multi-GPU layouts of ``global_batch`` samples per optimizer step of the model named
    ``model`` on ``gpus`` (``"8xH100 SXM"``), ranked by predicted step time, as ``batchfit
    plan`` asks it (:func:`batchfit.speed.plan.plan`). ``strategies``: the strategies to
    try (a list or ``"ddp,fsdp"``); ``tp``: tensor-parallel degrees to try with FSDP (a
    list or ``"2,4"``); ``checkpointing``: off, on or auto; ``offload``: none or auto;
    ``network_gbs``: the network between nodes per GPU, GB/s each way. ``words``: the step's
    and the stack's options as keywords.

    Without ``precision``, a Hugging Face model whose checkpoint is stored in 16 bits trains
    in mixed precision in that dtype (amp-bf16; amp-fp16 on a card without bfloat16), as
    :func:`batchfit.speed.plan.plan_precision` decides from the model's stored dtype; the
    answer's ``precision_source`` says where the precision came from.
    """
    from batchfit.speed.plan import plan

    step_words, stack = _split(words, PLAN_STEP_WORDS, STACK_WORDS)
    step = resolve_step(model, checkpointing=False, **step_words, **stack_settings(**stack))
    on_layout = None if on_status is None else lambda label: on_status(f"{model}: {label}")
    result = plan(step.spec.factory, step.inputs, step.config, gpus=gpus,
                  global_batch=global_batch, nodes=nodes,
                  strategies=_names(strategies), tp_degrees=_degrees(tp),
                  checkpointing=_checkpointing(checkpointing),
                  offload=str(offload).strip().lower(),
                  network_bytes_per_s=network_gbs * 1e9 if network_gbs else None,
                  precision=step_words.get("precision"),
                  checkpoint_dtype=step.spec.checkpoint_dtype, on_layout=on_layout)
    return Answer(model, result)


def _names(value: str | list[str] | None) -> list[str] | None:
    """``"ddp, fsdp"`` or a list -> the names; None or nothing: None (the defaults)."""
    if value is None:
        return None
    items = value.split(",") if isinstance(value, str) else list(value)
    names = [str(item).strip() for item in items if str(item).strip()]
    return names or None


def _degrees(value: str | list[int] | None) -> list[int]:
    """``"2,4"`` or a list -> positive integers; one line naming the option otherwise."""
    if value is None or value == "":
        return []
    items = value.split(",") if isinstance(value, str) else list(value)
    try:
        degrees = [int(str(item).strip()) for item in items if str(item).strip()]
    except ValueError:
        degrees = []
    if not degrees or any(d < 1 for d in degrees):
        raise InvalidInputError(f"bad {option('tp', value)}: give positive integers, e.g. 2,4")
    return degrees


def _checkpointing(value: str | bool) -> str:
    """off, on or auto; True and False (as the other answers take ``checkpointing``) stand
    for on and off."""
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value).strip().lower()
