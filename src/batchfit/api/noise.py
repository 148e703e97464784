"""The noise scale and the recommended batch asked in words: a workload file and the option
names of ``batchfit noise`` and ``batchfit recommend`` as keywords.

``noise_words("train.py:workload", batch_small=8, batch_big=64)`` answers what ``batchfit
noise train.py:workload --batch-small 8 --batch-big 64`` answers, and ``recommend_words(
"train.py:workload", gpu="A100 80GB", predict=True)`` what ``batchfit recommend
train.py:workload --gpu "A100 80GB" --predict`` answers (flag ``--noise-scale`` -> keyword
``noise_scale``, ``--current-batch`` -> ``current_batch``). Every check and default of the
two commands is made here, once; messages name options through
:func:`batchfit.errors.option`. The public entry points (:func:`batchfit.noise_scale`,
:func:`batchfit.recommend_batch_size`) send a workload string here.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

from batchfit.api.answers import STACK_WORDS, Answer, _split, batch_list
from batchfit.api.step import stack_settings
from batchfit.errors import InvalidInputError, option

#: The stack options ``recommend`` takes: they describe the process on a predicted card.
RECOMMEND_STACK_WORDS = tuple(name for name in STACK_WORDS if name != "inference_mode")
#: ``noise``'s defaults: the micro-batch, the big batch and the measured steps.
BATCH_SMALL, BATCH_BIG, STEPS = 8, 64, 50


@dataclass(frozen=True)
class NoiseAnswer(Answer):
    """A measured noise scale (:class:`~batchfit.stats.estimator.NoiseScale`, read through
    the answer) of the workload named ``model``."""

    def to_dict(self) -> dict[str, Any]:
        """What ``batchfit noise --json`` prints."""
        return {"workload": self.model, **self.result.to_dict()}


@dataclass(frozen=True)
class RecommendAnswer(Answer):
    """A recommendation (:class:`~batchfit.stats.recommend.Recommendation`, read through the
    answer) with the noise scale and the step-time curve it combines; ``predicted``: the
    curve was predicted for a card, not measured."""

    noise: Any = None
    throughput: Any = None
    predicted: bool = False

    def to_dict(self) -> dict[str, Any]:
        """What ``batchfit recommend --json`` prints."""
        return {"workload": self.model, "predicted": self.predicted, **self.result.to_dict(),
                "noise": self.noise.to_dict(), "throughput": self.throughput.to_dict()}


def load(workload: str, device: str | None = None,
         model_kwargs: Sequence[str] | Mapping[str, Any] | None = None) -> Any:
    """The workload file's model, data, loss and optimizer, the model moved to ``device``
    (``"cpu"`` or ``"cuda:N"``; None: where the factory put it)."""
    from batchfit.api.step import _model_kwargs
    from batchfit.realrun.search import torch_device_of
    from batchfit.stats.workload import load_workload

    target = None if device is None else torch_device_of(device)  # checked before loading
    loaded = load_workload(workload, kwargs=_model_kwargs(model_kwargs))
    if target is not None:
        loaded.model.to(target)
    return loaded


def _measured(loaded: Any, batch_small: int, batch_big: int, steps: int, method: str,
              train: bool | None, seed: int, on_step: Callable[[int], None] | None) -> Any:
    """The noise scale of a loaded workload; its warnings become the result's notes."""
    from batchfit.stats.measure import noise_scale
    from batchfit.stats.monitor import NoiseScaleWarning

    if train and loaded.optimizer is None:
        raise InvalidInputError(f"{option('train', True)} needs an optimizer: return (model, "
                                "data, loss_fn, optimizer) from the factory")
    optimizer = loaded.optimizer if (train is None or train) else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NoiseScaleWarning)  # in the result's notes
        return noise_scale(loaded.model, loaded.loss_fn, loaded.data, batch_small=batch_small,
                           batch_big=batch_big, steps=steps, method=method,
                           optimizer=optimizer, seed=seed, on_step=on_step)


def noise_words(workload: str, *, batch_small: int = BATCH_SMALL, batch_big: int = BATCH_BIG,
                steps: int = STEPS, method: str = "auto", device: str | None = None,
                train: bool | None = None, seed: int = 0,
                model_kwargs: Sequence[str] | Mapping[str, Any] | None = None,
                on_step: Callable[[int], None] | None = None) -> NoiseAnswer:
    """The gradient noise scale ``B_simple`` of the workload file ``workload``
    (``path/file.py:factory`` returning model, data, loss and optionally an optimizer), as
    ``batchfit noise`` measures it (:func:`batchfit.stats.measure.noise_scale`).

    Args:
        batch_small, batch_big: the micro-batch and the big batch (a multiple of it).
        steps: measured steps (big batches).
        method: auto, microbatch, per-example or ddp.
        device: ``"cpu"`` or ``"cuda:N"`` (default: where the factory put the model).
        train: train while measuring (default: if the factory returns an optimizer); the
            starting weights are restored after.
        seed: the batch sampler's seed.
        on_step: called with each step's index as it ends.
    """
    loaded = load(workload, device, model_kwargs)
    return NoiseAnswer(workload, _measured(loaded, batch_small, batch_big, steps, method,
                                           train, seed, on_step))


def given_noise(value: float, batch_small: int = BATCH_SMALL,
                batch_big: int = BATCH_BIG) -> Any:
    """A noise scale the caller knows (``noise_scale=`` of :func:`recommend_words`)."""
    from batchfit.stats.estimator import NoiseScale

    if not value > 0:
        raise InvalidInputError(f"{option('noise_scale')} must be a positive number, "
                                f"not {value}")
    return NoiseScale(b_simple=value, grad_sq_norm=float("nan"), trace_sigma=float("nan"),
                      ci_low=value, ci_high=value, confidence=0.95, steps=0,
                      effective_steps=0.0, batch_small=batch_small, batch_big=batch_big,
                      method="given", notes=("given by the caller, not measured",))


def _step_config(loaded: Any, precision: str | None, optimizer: str | None,
                 settings: dict[str, Any]) -> Any:
    """The workload's training step: its precision (fp32 by default) and optimizer (the
    factory's, else adamw), the loss being the workload's own."""
    from batchfit.engine.spec import OptimizerName, Precision, TrainConfig, parse_enum
    from batchfit.stats.workload import identity_loss

    if optimizer is not None:
        options: dict[str, Any] = {"optimizer": parse_enum(OptimizerName, optimizer,
                                                           "optimizer")}
    elif loaded.optimizer is not None:
        from batchfit.integrations._seed import optimizer_options

        options = optimizer_options(loaded.optimizer)
    else:
        options = {"optimizer": OptimizerName.ADAMW}
    return TrainConfig(precision=parse_enum(Precision, precision or "fp32", "precision"),
                       loss_fn=identity_loss, **options, **settings)


def _curve(loaded: Any, config: Any, run_on: str | None, memory: str | int | None,
           gpu: str | None, batches: Any, callbacks: dict[str, Any]) -> Any:
    """The step-time curve of the workload's own loss: measured on ``run_on``, or predicted
    for the catalog card ``gpu`` when ``run_on`` is None."""
    from batchfit.engine.spec import parse_size
    from batchfit.stats.data import BatchSource
    from batchfit.stats.measure import default_loss
    from batchfit.stats.workload import LossStep, input_spec_of

    source = BatchSource(loaded.data, seed=0)
    spec, kind = input_spec_of(source.take(source.draw(min(source.size, 256))))
    step_module = LossStep(loaded.model, loaded.loss_fn or default_loss, kind)
    limit = min(source.size, 1 << 16)  # a batch larger than the data does not train
    memory_bytes = parse_size(memory) if memory is not None else None
    if run_on is None:
        from batchfit.api.target import predicted_card
        from batchfit.speed.roofline import predict_throughput

        card = predicted_card(gpu, memory_bytes, getattr(config, "stack", None))
        return predict_throughput(step_module, spec, config, gpu=card, batches=batches,
                                  max_batch_limit=limit)
    from batchfit.speed.bench import bench

    return bench(step_module, spec, config, device=run_on, memory_bytes=memory_bytes,
                 batches=batches, max_batch_limit=limit, on_measure=callbacks.get("on_measure"),
                 on_point=callbacks.get("on_point"))


@dataclass(frozen=True)
class RecommendPhases:
    """Progress for :func:`recommend_words`' two phases, one display each (the command's):
    ``noise()`` is entered while the noise scale is measured and gives the per-step hook;
    ``curve()`` while the step-time curve is measured or predicted and gives the
    ``(on_measure, on_point)`` hooks (None, None when predicting)."""

    noise: Callable[[], AbstractContextManager[Callable[[int], None] | None]]
    curve: Callable[[], AbstractContextManager[tuple[Callable[[int], None] | None,
                                                     Callable[[Any], None] | None]]]


def recommend_checks(*, gpu: str | None = None, predict: bool = False,
                     current_batch: int | None = None, batches: str | Sequence[int] = "auto",
                     **stack: Any) -> tuple[dict[str, Any], Any]:
    """The checks :func:`recommend_words` makes before any work (the command makes them
    before it measures the noise scale): the stack's TrainConfig fields and the batches."""
    (stack_words,) = _split(stack, RECOMMEND_STACK_WORDS)
    if predict and not gpu:
        raise InvalidInputError(f"{option('predict', True)} needs {option('gpu', 'NAME')}: "
                                "the card to predict for")
    if gpu and not predict:
        raise InvalidInputError(f"{option('gpu')} goes with {option('predict', True)}; to "
                                f"measure, use {option('device', 'cpu')} or "
                                f"{option('device', 'cuda:N')}")
    given = [name for name, value in stack_words.items() if value not in (None, False)]
    if given and not predict:
        raise InvalidInputError(
            f"{option(given[0])} describes a predicted process: add {option('predict', True)} "
            f"{option('gpu', 'NAME')} (a measured recommend runs with this process's torch "
            "and settings)")
    settings = stack_settings(**stack_words)
    if current_batch is not None and current_batch < 1:
        raise InvalidInputError(f"{option('current_batch')} must be a positive integer, "
                                f"not {current_batch}")
    chosen_batches = batch_list(batches)
    return settings, chosen_batches


def recommend_words(workload: str, *, batch_small: int = BATCH_SMALL,
                    batch_big: int = BATCH_BIG, steps: int = STEPS, method: str = "auto",
                    train: bool | None = None, seed: int = 0,
                    noise_scale: float | Any = None, device: str | None = None,
                    memory: str | int | None = None, gpu: str | None = None,
                    predict: bool = False, batches: str | Sequence[int] = "auto",
                    precision: str | None = None, optimizer: str | None = None,
                    current_batch: int | None = None,
                    model_kwargs: Sequence[str] | Mapping[str, Any] | None = None,
                    on_step: Callable[[int], None] | None = None,
                    on_measure: Callable[[int], None] | None = None,
                    on_point: Callable[[Any], None] | None = None,
                    phases: RecommendPhases | None = None,
                    **stack: Any) -> RecommendAnswer:
    """The batch of the workload file ``workload`` that reaches a target loss soonest, as
    ``batchfit recommend`` answers it: its noise scale (measured as :func:`noise_words`
    measures it, or ``noise_scale``: a number, or a measured ``NoiseScale``) with its step
    times (measured on ``device``, or with ``predict=True`` predicted for the catalog card
    ``gpu``) and memory (:func:`batchfit.stats.recommend.recommend_batch_size`).

    Args:
        memory: the budget on ``device``; with ``predict``, the card's memory.
        batches: ``"auto"``, ``"16,32,64"`` or a list of batch sizes.
        precision: the step's precision (default fp32).
        optimizer: for the step and the learning-rate rule (default: the factory's
            optimizer, else adamw).
        current_batch: the batch trained with now (default: ``batch_big``).
        stack: the stack options (``stack``, ``torch_version``, ...), with ``predict`` only.
        on_step, on_measure, on_point: progress of the noise steps and of the measured
            curve.
        phases: a display per phase, entered around each (the command's); it replaces
            ``on_step``, ``on_measure`` and ``on_point``.
    """
    settings, chosen_batches = recommend_checks(gpu=gpu, predict=predict,
                                                current_batch=current_batch, batches=batches,
                                                **stack)
    if phases is None:
        phases = RecommendPhases(lambda: contextlib.nullcontext(on_step),
                                 lambda: contextlib.nullcontext((on_measure, on_point)))
    loaded = load(workload, None if predict else device, model_kwargs)  # once, for both
    if noise_scale is None:
        with phases.noise() as step_hook:
            noise = _measured(loaded, batch_small, batch_big, steps, method, train, seed,
                              step_hook)
    elif isinstance(noise_scale, (int, float)):
        noise = given_noise(float(noise_scale), batch_small, batch_big)
    else:
        noise = noise_scale
    config = _step_config(loaded, precision, optimizer, settings)
    run_on = None if predict else (device or "cpu")
    with phases.curve() as (measure_hook, point_hook):
        throughput = _curve(loaded, config, run_on, memory, gpu, chosen_batches,
                            {"on_measure": measure_hook, "on_point": point_hook})
    from batchfit.stats.recommend import curve_points, recommend_batch_size

    points, limit = curve_points(throughput)
    family = optimizer or (type(loaded.optimizer) if loaded.optimizer is not None else "adamw")
    result = recommend_batch_size(noise, points, max_batch_size=limit,
                                  current_batch_size=current_batch or batch_big,
                                  optimizer=family)
    return RecommendAnswer(workload, result, noise=noise, throughput=throughput,
                           predicted=predict)
