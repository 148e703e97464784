"""The answers measured on a real device, asked in words: ``bench_words("timm:resnet18",
device="cpu", memory="2GiB", batches="1,2")`` answers what ``batchfit bench timm:resnet18
--device cpu --memory 2GiB --batches 1,2`` answers, and ``search_words("timm:resnet18",
device="cpu", memory_cap="2GiB")`` what ``batchfit search timm:resnet18 --device cpu
--memory-cap 2GiB`` answers (flag ``--memory-cap`` -> keyword ``memory_cap``,
``--time-budget`` -> ``time_budget``, ``--steps-per-trial`` -> ``steps_per_trial``).

Every check and default of the two commands is made here, once, for both callers;
messages name options through :func:`batchfit.errors.option`. The public entry points
(:func:`batchfit.bench`, :func:`batchfit.search_max_batch`) send a spec string here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from batchfit.api.answers import (
    STACK_WORDS,
    STEP_WORDS,
    Answer,
    _split,
    batch_list,
    predict_throughput_words,
)
from batchfit.api.step import resolve_step
from batchfit.api.target import chosen, resolve_target
from batchfit.engine.spec import parse_duration, parse_size
from batchfit.errors import InvalidInputError, option

#: The stack options that describe a predicted process, not the one a measurement runs in.
PREDICTED_STACK_WORDS = tuple(name for name in STACK_WORDS if name != "inference_mode")
#: What ``bench`` measures by default: seconds the whole sweep may take.
DEFAULT_TIME_BUDGET = "120s"


def _run_device(device: str | None) -> str:
    """``"cpu"`` or ``"cuda:N"``, checked (one line for an unknown name or a GPU this
    machine does not have)."""
    text = "cpu" if device is None else device.strip().lower()
    resolve_target(None, text, None, None, need_budget=False)
    return text


def _duration(value: str | float) -> float:
    try:
        return parse_duration(value)
    except InvalidInputError as exc:
        raise InvalidInputError(f"bad {option('time_budget', value)}: {exc}") from None


def bench_words(model: str, *, device: str | None = None, gpu: str | None = None,
                predict: bool = False, memory: str | int | None = None,
                time_budget: str | float | None = DEFAULT_TIME_BUDGET,
                batches: str | Sequence[int] = "auto", dataset_size: int | None = None,
                alignment: bool = False, timing: Any = None,
                on_measure: Callable[[int], None] | None = None,
                on_point: Callable[[Any], None] | None = None, **words: Any) -> Answer:
    """Throughput against batch size of the model named ``model`` and the fastest batch, as
    ``batchfit bench`` asks it: measured on ``device`` (``"cpu"``, the default, or
    ``"cuda:N"``), or with ``predict=True`` predicted for the catalog card ``gpu``
    (:func:`~batchfit.api.answers.predict_throughput_words`).

    Args:
        memory: the budget on ``device`` (a size, ``"8GiB"``, or bytes); without it the CPU
            uses the memory this machine has available now, and the answer's notes say so.
            With ``predict``: the card's memory.
        time_budget: measuring stops short of batches that would end past it (``"5m"``, or
            seconds; None: no limit).
        batches: ``"auto"``, ``"16,32,64"`` or a list of batch sizes.
        dataset_size: samples per epoch, for the epoch time.
        alignment: measure the recommendation against multiples of 8, powers of two, B±1.
        timing: a :class:`~batchfit.speed.timing.TimingConfig` (how each point is timed).
        on_measure, on_point: progress callbacks (see :func:`batchfit.speed.bench.bench`).
        words: the step's options as keywords (the stack's only with ``predict``; a
            measurement runs in this process, with its own torch and settings).

    The example is :func:`batchfit.bench`'s, which sends a spec string here.
    """
    if dataset_size is not None and dataset_size < 1:
        raise InvalidInputError(f"{option('dataset_size')} must be a positive integer, "
                                f"not {dataset_size}")
    chosen_batches = batch_list(batches)
    if predict:
        if not gpu:
            raise InvalidInputError(f"{option('predict', True)} needs {option('gpu', 'NAME')}: "
                                    "the card to predict for")
        if device is not None:
            raise InvalidInputError(f"{option('predict', True)} predicts for "
                                    f"{option('gpu')}: drop {option('device')}")
        return predict_throughput_words(model, gpu=gpu, memory=memory, batches=chosen_batches,
                                        dataset_size=dataset_size, **words)
    if gpu is not None:
        raise InvalidInputError(f"{option('gpu')} goes with {option('predict', True)}; to "
                                f"measure, use {option('device', 'cpu')} or "
                                f"{option('device', 'cuda:N')}")
    step_words, stack = _split(words, STEP_WORDS, STACK_WORDS)
    given = [name for name in PREDICTED_STACK_WORDS if stack.get(name) not in (None, False)]
    if given:
        raise InvalidInputError(
            f"{option(given[0])} describes a predicted process: add {option('predict', True)} "
            f"{option('gpu', 'NAME')} (a measured bench runs with this process's torch and "
            "settings)")
    run_on = _run_device(device)
    memory_bytes = parse_size(memory) if memory is not None else None
    budget_s = _duration(time_budget) if time_budget is not None else None
    step = resolve_step(model, **step_words, inference_mode=stack.get("inference_mode", False))
    fields, notes = chosen(None, step.spec, step.config)
    from batchfit.speed.bench import bench

    result = bench(step.spec.factory, step.inputs, step.config, device=run_on,
                   memory_bytes=memory_bytes, batches=chosen_batches,
                   dataset_size=dataset_size, alignment=alignment, timing=timing,
                   time_budget_s=budget_s, on_measure=on_measure, on_point=on_point)
    if result.memory_source == "available":
        from batchfit.answers.solve import format_size

        notes.append(f"bench: no {option('memory')}: using the "
                     f"{format_size(result.memory_bytes)} this machine has available now")
    return Answer(model, result, fields, tuple(notes))


def search_words(model: str, *, device: str = "cpu", memory_cap: str | int | None = None,
                 steps_per_trial: int = 2, boundary_runs: int = 3,
                 on_trial: Callable[[Any], None] | None = None, **words: Any) -> Answer:
    """The exact largest batch of the model named ``model`` on the real ``device`` (``"cpu"``
    or ``"cuda:N"``), starting from the prediction, as ``batchfit search`` asks it
    (:func:`batchfit.realrun.search.search_max_batch`).

    Args:
        memory_cap: a size (``"2GiB"``) or bytes. CPU: what a trial may use beyond its
            warmed-up state (default: the memory the machine has available); CUDA: the
            caching allocator's limit (what if my card were smaller).
        steps_per_trial: real steps per trial (>= 2: the first creates the optimizer
            state; the peak is the steady state's).
        boundary_runs: CPU: the exec'd fresh processes the answer must fit in (the batch
            above runs as often); 1: no settling, the forked trials' answer.
        on_trial: called with each :class:`~batchfit.realrun.trial.Trial` as it finishes.
        words: the step's options as keywords.

    The example is :func:`batchfit.search_max_batch`'s, which sends a spec string here.
    """
    if boundary_runs < 1:
        raise InvalidInputError(f"{option('boundary_runs')} must be at least 1, "
                                f"not {boundary_runs}")
    if steps_per_trial < 2:
        raise InvalidInputError(
            f"{option('steps_per_trial')} must be at least 2 (the first step creates the "
            f"optimizer state; the peak is the steady state's), not {steps_per_trial}")
    run_on = _run_device(device)
    cap = parse_size(memory_cap) if memory_cap is not None else None
    if cap is not None and run_on == "cpu":
        from batchfit.answers.solve import format_size
        from batchfit.realrun.search import machine_memory_bytes

        total, _ = machine_memory_bytes()
        if cap > total:
            raise InvalidInputError(
                f"{option('memory_cap', memory_cap)} is larger than this machine's memory "
                f"({format_size(total)}): give a smaller cap")
    step_words, stack = _split(words, STEP_WORDS, ("inference_mode",))
    step = resolve_step(model, **step_words, **stack)
    fields, notes = chosen(None, step.spec, step.config)
    from batchfit.realrun.search import search_max_batch

    result = search_max_batch(step.spec, step.inputs, step.config, device=run_on,
                              memory_cap_bytes=cap, steps_per_trial=steps_per_trial,
                              boundary_runs=boundary_runs, on_trial=on_trial)
    return Answer(model, result, fields, tuple(notes))
