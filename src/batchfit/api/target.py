"""What a call targets, named in words: the device profile of ``gpu``, ``device``,
``memory`` and ``overhead``, and what was chosen for the user (the card a short ``gpu`` name
stands for, the head a bare Hugging Face name is built with), as data a caller may show.
"""

from __future__ import annotations

import re
from typing import Any

from batchfit.engine.spec import parse_size
from batchfit.errors import BatchfitError, InvalidInputError, option


def resolve_target(gpu: str | None, device: str | None, memory: str | None,
                   overhead: str | None, need_budget: bool) -> tuple[Any, int | None]:
    """The target profile, and the memory budget when it is not the profile's own memory.

    ``gpu=NAME, memory=SIZE`` is that card's architecture with SIZE of memory: the size
    becomes the profile's memory (shown and reported as the card's), so no separate budget
    is returned. With ``device`` (or alone) ``memory`` keeps its budget meaning: the CPU's
    budget, or a cap below a live card's memory.
    """
    from batchfit.device.profile import DeviceProfile, gpu_profile

    if gpu is not None and device:
        raise InvalidInputError(f"give {option('gpu')} or {option('device')}, not both")
    memory_bytes = parse_size(memory) if memory is not None else None
    context_bytes = parse_size(overhead, allow_zero=True) if overhead is not None else None
    if gpu is not None:  # an empty name is find_gpu's error, not the CPU
        from batchfit.device.catalog import find_gpu, live_gpu

        card = live_gpu(0) if gpu.strip().lower() == "auto" else find_gpu(gpu)
        return gpu_profile(card, memory_bytes, context_bytes=context_bytes), None
    if device is not None:
        text = device.strip().lower()
        if text == "cpu":
            profile = DeviceProfile.cpu()
        elif re.fullmatch(r"cuda(:\d+)?", text):
            from batchfit.device.catalog import live_gpu

            profile = gpu_profile(live_gpu(int(text.partition(":")[2] or 0)))
        else:
            raise InvalidInputError(f"unknown device {device!r}: use cpu or cuda:N (e.g. cuda:0)")
    elif memory_bytes is not None:
        profile = DeviceProfile.cpu()
    elif need_budget:
        raise InvalidInputError(
            f"give a budget: {option('gpu', 'NAME')}, {option('memory', 'SIZE')} (with "
            f"{option('device', 'cpu')}) or {option('device', 'cuda:N')}")
    else:
        profile = DeviceProfile.cpu()
    if context_bytes is not None:
        profile = profile.with_overheads(context_bytes=context_bytes)
    return profile, memory_bytes


def chosen(gpu: str | None, spec: Any, config: Any = None) -> tuple[dict[str, Any], list[str]]:
    """What was chosen for the user (a catalog variant, a Hugging Face head, a recipe's
    defaults): the fields to add to the answer (``gpu_choice``, ``hf_task``, ``recipe``), and
    one note line for each choice."""
    fields: dict[str, Any] = {}
    notes: list[str] = []
    if config is not None and getattr(config, "recipe", None) is not None:
        from batchfit.engine.workloads.recipes import RECIPES

        defaults = RECIPES[config.recipe]
        fields["recipe"] = defaults.to_dict()
        if defaults.compile_note:
            notes.append(f"note: {option('recipe', config.recipe.value)}: {defaults.compile_note}")
    if gpu and gpu.strip().lower() != "auto":
        from batchfit.device.catalog import choose_gpu

        choice = choose_gpu(gpu)
        fields["gpu_choice"] = choice.to_dict()
        if choice.ambiguous:
            others = ", ".join(g.name for g in choice.alternatives)
            notes.append(f"note: {option('gpu')} {gpu!r} is the {choice.card.name}; it could "
                         f"also mean {others}: give the full name to choose")
    task = getattr(spec, "hf_task", None)
    if task is not None and config is not None and _hf_checkpointing(config):
        reentrant, why = config.reentrant_default
        fields["use_reentrant"] = reentrant
        notes.append(f"note: checkpointing is {'' if reentrant else 'non-'}reentrant ({why}); "
                     f"{option('use_reentrant', not reentrant)} for the other variant")
    if task is not None:
        fields["hf_task"] = task.value
        if spec.hf_task_chosen:
            from batchfit.models.resolve import HFTask

            others = "|".join(t.value for t in HFTask if t is not task)
            notes.append(f"note: {spec.name} is built with its {task.value} head (from its "
                         f"config); another: {option('model_kwargs')} task={others}")
    return fields, notes


def _hf_checkpointing(config: Any) -> bool:
    """Whether the step checkpoints a Hugging Face model with the variant left unsaid."""
    from batchfit.engine.spec import Mode

    return bool(config.checkpointing) and config.mode is Mode.TRAIN and \
        config.use_reentrant is None


def with_cpu_overhead(profile: Any, step: Any) -> Any:
    """The CPU profile with the runtime's memory beyond tensors for this model, measured with
    one real step (:mod:`batchfit.realrun.cpu_overhead`)."""
    from batchfit.realrun.cpu_overhead import measure_cpu_overhead

    try:
        overhead = measure_cpu_overhead(step.spec, step.inputs, step.config).overhead_bytes
    except BatchfitError as exc:
        raise InvalidInputError(
            f"could not measure the CPU runtime's overhead ({exc}): give it with "
            f"{option('overhead', 'SIZE')} ({option('overhead', '0')} ignores it)") from exc
    return profile.with_overheads(context_bytes=overhead)


def predicted_card(gpu: str, memory_bytes: int | None, stack: Any = None) -> Any:
    """The catalog card a throughput prediction runs on; with ``memory_bytes``, its
    architecture with that memory. Checked against the context (the stack's, if given) and
    workspaces as ``max`` checks it: one clear line if the memory cannot hold them."""
    from batchfit.device.catalog import find_gpu
    from batchfit.device.profile import gpu_profile

    card = find_gpu(gpu)
    profile = gpu_profile(card, memory_bytes)
    if stack is not None:
        profile.for_stack(stack)
    return card if memory_bytes is None else card.with_memory(memory_bytes)
