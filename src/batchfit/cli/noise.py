"""``batchfit noise`` and ``batchfit recommend``: the gradient noise scale of a workload, and
the batch that reaches a target loss soonest (registered on the app when imported)."""

from __future__ import annotations

import re
import warnings
from typing import Any

import typer

from batchfit.cli.common import (
    check_plot,
    emit_json,
    errors,
    out,
    parse_batches,
    predicted_only,
)
from batchfit.cli.options import option
from batchfit.cli.progress import bench_progress, counted_progress, progress
from batchfit.cli.root import app
from batchfit.engine.spec import parse_size
from batchfit.errors import InvalidInputError

WorkloadArg = typer.Argument(
    ..., help="path/to/file.py:factory returning (model, data, loss[, optimizer]) or a dict "
              "with those keys; data: a map-style Dataset, a DataLoader or tensors; loss: "
              "loss_fn(model, batch) -> mean loss, or a criterion(output, target) such as "
              "nn.MSELoss() for batches (input..., target), told apart by its first "
              "parameter (model, module, net, network, m, or typed nn.Module: loss_fn)")
SmallOpt = typer.Option(8, "--batch-small", help="the small batch (micro-batch) size")
BigOpt = typer.Option(64, "--batch-big", help="the big batch size (a multiple of the small one)")
StepsOpt = typer.Option(50, "--steps", help="measured steps (big batches)")
MethodOpt = typer.Option("auto", "--method", help="auto, microbatch, per-example or ddp")
TrainOpt = typer.Option(None, "--train/--no-train",
                        help="train while measuring (default: if the factory returns an "
                             "optimizer); the starting weights are restored after")
SeedOpt = typer.Option(0, "--seed", help="seed of the batch sampler")


def _torch_device(device: str | None) -> Any:
    import torch

    if device is None:
        return None
    text = device.strip().lower()
    if text == "cpu":
        return torch.device("cpu")
    if re.fullmatch(r"cuda(:\d+)?", text):
        index = int(text.partition(":")[2] or 0)
        if not torch.cuda.is_available() or index >= torch.cuda.device_count():
            raise InvalidInputError(f"{device} is not available here: use --device cpu")
        return torch.device("cuda", index)
    raise InvalidInputError(f"unknown device {device!r}: use cpu or cuda:N (e.g. cuda:0)")


def _load(workload: str, device: str | None, model_kwargs: list[str] | None) -> Any:
    from batchfit.models.resolve import parse_model_kwargs
    from batchfit.stats.workload import load_workload

    target = _torch_device(device)
    loaded = load_workload(workload, kwargs=parse_model_kwargs(model_kwargs or []))
    if target is not None:
        loaded.model.to(target)
    return loaded


def _measure(loaded: Any, batch_small: int, batch_big: int, steps: int, method: str,
             train: bool | None, seed: int) -> Any:
    from batchfit.stats.measure import noise_scale
    from batchfit.stats.monitor import NoiseScaleWarning

    if train and loaded.optimizer is None:
        raise InvalidInputError(
            "--train needs an optimizer: return (model, data, loss_fn, optimizer) from the factory")
    optimizer = loaded.optimizer if (train is None or train) else None
    with counted_progress("noise", "measuring the noise scale", steps) as on_step, \
            warnings.catch_warnings():
        warnings.simplefilter("ignore", NoiseScaleWarning)  # shown as notes
        return noise_scale(loaded.model, loaded.loss_fn, loaded.data, batch_small=batch_small,
                           batch_big=batch_big, steps=steps, method=method,
                           optimizer=optimizer, seed=seed, on_step=on_step)


@app.command("noise")
def noise_cmd(
    workload: str = WorkloadArg, batch_small: int = SmallOpt, batch_big: int = BigOpt,
    steps: int = StepsOpt, method: str = MethodOpt,
    device: str | None = typer.Option(None, "--device", help="cpu or cuda:N (default: "
                                         "where the factory put the model)"),
    train: bool | None = TrainOpt, seed: int = SeedOpt,
    model_kwargs: list[str] | None = option("model_kwargs"),
    as_json: bool = option("as_json"), plot: str | None = option("plot"), debug: bool = option("debug"),
) -> None:
    """Measure the gradient noise scale B_simple of a model on its data.

    The factory returns (model, data, loss) or (model, data, loss, optimizer). The loss is
    either loss_fn(model, batch), returning the batch's mean loss, or a criterion(output,
    target) such as nn.MSELoss(), F.cross_entropy or lambda out, y: ..., called as
    criterion(model(*inputs), target) on batches (input..., target). An nn.Module loss is
    a criterion; otherwise the first parameter decides (after a bound method's self and a
    functools.partial's arguments): named model, module, net, network or m, or typed
    nn.Module, means loss_fn(model, batch); only *args means loss_fn(model, batch).
    """
    with errors(debug):
        check_plot(plot)
        loaded = _load(workload, device, model_kwargs)
        noise = _measure(loaded, batch_small, batch_big, steps, method, train, seed)
        if plot:
            from batchfit.cli.noise_report import plot_noise

            plot_noise(noise, plot)
        if as_json:
            emit_json({"workload": workload, **noise.to_dict()})
            return
        from batchfit.cli.noise_report import render_noise

        out.print(render_noise(noise, workload))
        if plot:
            out.print(f"plot written to {plot}")


def _given_noise(value: float, batch_small: int, batch_big: int) -> Any:
    from batchfit.stats.estimator import NoiseScale

    if not value > 0:
        raise InvalidInputError(f"--noise-scale must be a positive number, not {value}")
    return NoiseScale(b_simple=value, grad_sq_norm=float("nan"), trace_sigma=float("nan"),
                      ci_low=value, ci_high=value, confidence=0.95, steps=0,
                      effective_steps=0.0, batch_small=batch_small, batch_big=batch_big,
                      method="given", notes=("given with --noise-scale, not measured",))


def _throughput(loaded: Any, device: str | None, memory: str | None, gpu: str | None,
                predict: bool, batches: str, precision: str, optimizer: str | None,
                settings: dict[str, Any] | None = None) -> tuple[Any, bool]:
    """The step-time curve of the workload's own loss: measured (bench) or predicted
    (``settings``: the stack options' TrainConfig fields, for a predicted card)."""
    from batchfit.engine.spec import OptimizerName, Precision, TrainConfig, parse_enum
    from batchfit.stats.data import BatchSource
    from batchfit.stats.measure import default_loss
    from batchfit.stats.workload import LossStep, identity_loss, input_spec_of

    source = BatchSource(loaded.data, seed=0)
    sample = source.take(source.draw(min(source.size, 256)))
    spec, kind = input_spec_of(sample)
    step_module = LossStep(loaded.model, loaded.loss_fn or default_loss, kind)
    if optimizer is not None:
        options: dict[str, Any] = {"optimizer": parse_enum(OptimizerName, optimizer, "optimizer")}
    elif loaded.optimizer is not None:
        from batchfit.integrations._seed import optimizer_options

        options = optimizer_options(loaded.optimizer)
    else:
        options = {"optimizer": OptimizerName.ADAMW}
    config = TrainConfig(precision=parse_enum(Precision, precision or "fp32", "precision"),
                         loss_fn=identity_loss, **options, **(settings or {}))
    batch_list = parse_batches(batches)
    limit = min(source.size, 1 << 16)  # a batch larger than the data does not train
    memory_bytes = parse_size(memory) if memory is not None else None
    if predict:
        from batchfit.api.target import predicted_card
        from batchfit.speed.roofline import predict_throughput

        card = predicted_card(gpu, memory_bytes, (settings or {}).get("stack"))
        with progress("recommend", f"predicting step times on {gpu}"):
            return predict_throughput(step_module, spec, config, gpu=card, batches=batch_list,
                                      max_batch_limit=limit), True
    from batchfit.speed.bench import bench

    with bench_progress("recommend") as (on_measure, on_point):
        return bench(step_module, spec, config, device=device or "cpu", memory_bytes=memory_bytes,
                     batches=batch_list, max_batch_limit=limit, on_measure=on_measure,
                     on_point=on_point), False


@app.command("recommend")
def recommend_cmd(
    workload: str = WorkloadArg, batch_small: int = SmallOpt, batch_big: int = BigOpt,
    steps: int = StepsOpt, method: str = MethodOpt, train: bool | None = TrainOpt,
    seed: int = SeedOpt,
    noise_scale_value: float | None = typer.Option(
        None, "--noise-scale", help="use this B_simple instead of measuring it"),
    device: str | None = typer.Option(None, "--device", help="cpu or cuda:N (measured)"),
    memory: str | None = typer.Option(
        None, "--memory", help="memory budget on --device, e.g. 8GiB; with --gpu NAME "
        "--predict, that card's memory"),
    gpu: str | None = typer.Option(None, "--gpu", help="a catalog GPU, with --predict"),
    predict: bool = typer.Option(False, "--predict", help="predict step times on --gpu"),
    batches: str = typer.Option("auto", "--batches", help="auto, or a list like 16,32,64"),
    precision: str = option("precision"),
    optimizer: str | None = typer.Option(
        None, "--optimizer", help="for the step and the learning-rate rule (default: the "
                                  "factory's optimizer, else adamw)"),
    current_batch: int | None = typer.Option(
        None, "--current-batch", help="the batch you train with now (default: --batch-big)"),
    model_kwargs: list[str] | None = option("model_kwargs"),
    stack: str | None = option("stack"), torch_version: str | None = option("torch_version"),
    cuda_version: str | None = option("cuda_version"), cudnn_benchmark: bool = option("cudnn_benchmark"),
    alloc_conf: str | None = option("alloc_conf"),
    as_json: bool = option("as_json"), plot: str | None = option("plot"), debug: bool = option("debug"),
) -> None:
    """The batch that reaches a target loss soonest: noise scale x throughput x memory.

    With --predict, the stack options (--stack, --torch-version, --cuda-version,
    --cudnn-benchmark, --alloc-conf) describe the training process on the predicted card,
    as for ``bench --predict``.
    """
    with errors(debug):
        check_plot(plot)
        if predict and not gpu:
            raise InvalidInputError("--predict needs --gpu NAME: the card to predict for")
        if gpu and not predict:
            raise InvalidInputError("--gpu goes with --predict; to measure, use --device cpu|cuda:N")
        predicted_only(predict, "recommend", stack, torch_version, cuda_version,
                       cudnn_benchmark, alloc_conf)
        from batchfit.api.step import stack_settings

        settings = stack_settings(stack, torch_version, cuda_version, cudnn_benchmark,
                                  False, alloc_conf)
        if current_batch is not None and current_batch < 1:
            raise InvalidInputError(f"--current-batch must be a positive integer, not {current_batch}")
        loaded = _load(workload, None if predict else device, model_kwargs)
        if noise_scale_value is not None:
            noise = _given_noise(noise_scale_value, batch_small, batch_big)
        else:
            noise = _measure(loaded, batch_small, batch_big, steps, method, train, seed)
        throughput, predicted = _throughput(loaded, device, memory, gpu, predict, batches,
                                            precision, optimizer, settings)
        from batchfit.stats.recommend import curve_points, recommend_batch_size

        points, limit = curve_points(throughput)
        family = optimizer or (type(loaded.optimizer) if loaded.optimizer is not None
                               else "adamw")
        rec = recommend_batch_size(noise, points, max_batch_size=limit,
                                   current_batch_size=current_batch or batch_big,
                                   optimizer=family)
        if plot:
            from batchfit.cli.noise_report import plot_recommendation

            plot_recommendation(rec, plot)
        if as_json:
            emit_json({"workload": workload, "predicted": predicted, **rec.to_dict(),
                        "noise": noise.to_dict(), "throughput": throughput.to_dict()})
            return
        from batchfit.cli.noise_report import render_recommendation

        out.print(render_recommendation(rec, noise, workload, predicted))
        if plot:
            out.print(f"plot written to {plot}")
