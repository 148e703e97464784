"""What a command targets and what was chosen for the user: the device profile of ``--gpu``,
``--device`` and ``--memory``, the card a short ``--gpu`` name stands for, the head a bare
Hugging Face name is built with, and the checks the target makes of the options.

The library decides (:func:`batchfit.device.catalog.choose_gpu`, the spec's ``hf_task``);
this module says so: one ``note:`` line each on stderr, and the same facts as JSON fields
(``gpu_choice``, ``hf_task``).
"""

from __future__ import annotations

import re
from typing import Any

from rich.console import Console

from batchfit.engine.spec import parse_size
from batchfit.errors import InvalidInputError

#: ``--attn`` spellings -> the implementation
ATTN = {"sdpa": "sdpa", "eager": "eager", "flash": "flash", "flash-attention-2": "flash",
        "flash_attention_2": "flash"}


def resolve_target(gpu: str | None, device: str | None, memory: str | None,
                   overhead: str | None, need_budget: bool) -> tuple[Any, int | None]:
    """The target profile, and the memory budget when it is not the profile's own memory.

    ``--gpu NAME --memory SIZE`` is that card's architecture with SIZE of memory: the size
    becomes the profile's memory (shown and reported as the card's), so no separate budget
    is returned. With ``--device`` (or alone) ``--memory`` keeps its budget meaning: the CPU's
    budget, or a cap below a live card's memory.
    """
    from batchfit.device.profile import DeviceProfile, gpu_profile

    if gpu is not None and device:
        raise InvalidInputError("give --gpu or --device, not both")
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
        raise InvalidInputError("give a budget: --gpu NAME, --memory SIZE (with --device cpu) "
                                "or --device cuda:N")
    else:
        profile = DeviceProfile.cpu()
    if context_bytes is not None:
        profile = profile.with_overheads(context_bytes=context_bytes)
    return profile, memory_bytes


def check_attn(attn: str | None, config: Any, profile: Any) -> None:
    """``--attn flash`` is the flash kernel the target must be able to run: flash-attention
    (and SDPA's flash backend) need an sm80+ GPU and fp16/bf16 activations."""
    if attn is None or ATTN.get(attn.strip().lower()) != "flash":
        return
    half = config.precision.value in ("amp-fp16", "amp-bf16", "bf16", "fp16")
    if not profile.is_cuda:
        raise InvalidInputError("--attn flash runs flash-attention CUDA kernels: give --gpu NAME")
    if tuple(profile.compute_capability or (0, 0)) < (8, 0) or not half:
        raise InvalidInputError(
            f"--attn flash needs an sm80+ GPU and fp16/bf16 (--precision amp-bf16, bf16...); "
            f"{profile.name} is sm{''.join(map(str, profile.compute_capability or ()))} with "
            f"{config.precision.value}: use --attn sdpa")


def chosen(gpu: str | None, spec: Any, config: Any = None) -> tuple[dict[str, Any], list[str]]:
    """What was chosen for the user (a catalog variant, a Hugging Face head, a recipe's
    defaults): the JSON fields to add, and the ``note:`` lines to print with the answer (not
    before an error: a refused input stays one line)."""
    fields: dict[str, Any] = {}
    notes: list[str] = []
    if config is not None and getattr(config, "recipe", None) is not None:
        from batchfit.engine.workloads.recipes import RECIPES

        defaults = RECIPES[config.recipe]
        fields["recipe"] = defaults.to_dict()
        if defaults.compile_note:
            notes.append(f"note: --recipe {config.recipe.value}: {defaults.compile_note}")
    if gpu and gpu.strip().lower() != "auto":
        from batchfit.device.catalog import choose_gpu

        choice = choose_gpu(gpu)
        fields["gpu_choice"] = choice.to_dict()
        if choice.ambiguous:
            others = ", ".join(g.name for g in choice.alternatives)
            notes.append(f"note: --gpu {gpu!r} is the {choice.card.name}; it could also mean "
                         f"{others}: give the full name to choose")
    task = getattr(spec, "hf_task", None)
    if task is not None:
        fields["hf_task"] = task.value
        if spec.hf_task_chosen:
            from batchfit.models.resolve import HFTask

            others = "|".join(t.value for t in HFTask if t is not task)
            notes.append(f"note: {spec.name} is built with its {task.value} head (from its "
                         f"config); another: --model-kwargs task={others}")
    return fields, notes


def print_notes(notes: list[str], err: Console) -> None:
    for note in notes:
        err.print(note, highlight=False, soft_wrap=True)
