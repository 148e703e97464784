"""``batchfit noise`` and ``batchfit recommend``: the gradient noise scale of a workload, and
the batch that reaches a target loss soonest (registered on the app when imported)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import typer

from batchfit.cli.common import check_plot, emit_json, errors, out
from batchfit.cli.options import option
from batchfit.cli.progress import bench_progress, counted_progress, progress
from batchfit.cli.root import app

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
        from batchfit.api.noise import noise_words

        with counted_progress("noise", "measuring the noise scale", steps) as on_step:
            noise = noise_words(workload, batch_small=batch_small, batch_big=batch_big,
                                steps=steps, method=method, device=device, train=train,
                                seed=seed, model_kwargs=model_kwargs, on_step=on_step)
        if plot:
            from batchfit.cli.noise_report import plot_noise

            plot_noise(noise, plot)
        if as_json:
            emit_json(noise.to_dict())
            return
        from batchfit.cli.noise_report import render_noise

        out.print(render_noise(noise.result, workload))
        if plot:
            out.print(f"plot written to {plot}")


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
        from batchfit.api.noise import RecommendPhases, recommend_words

        stack_words = {"stack": stack, "torch_version": torch_version,
                       "cuda_version": cuda_version, "cudnn_benchmark": cudnn_benchmark,
                       "alloc_conf": alloc_conf}
        phases = RecommendPhases(
            noise=lambda: counted_progress("recommend", "measuring the noise scale", steps),
            curve=lambda: _curve_progress(predict, gpu))
        answer = recommend_words(
            workload, batch_small=batch_small, batch_big=batch_big, steps=steps,
            method=method, train=train, seed=seed, noise_scale=noise_scale_value,
            device=device, memory=memory, gpu=gpu, predict=predict, batches=batches,
            precision=precision, optimizer=optimizer, current_batch=current_batch,
            model_kwargs=model_kwargs, phases=phases, **stack_words)
        rec = answer.result
        if plot:
            from batchfit.cli.noise_report import plot_recommendation

            plot_recommendation(rec, plot)
        if as_json:
            emit_json(answer.to_dict())
            return
        from batchfit.cli.noise_report import render_recommendation

        out.print(render_recommendation(rec, answer.noise, workload, predict))
        if plot:
            out.print(f"plot written to {plot}")


@contextlib.contextmanager
def _curve_progress(predict: bool, gpu: str | None) -> Iterator[tuple[Any, Any]]:
    """The curve's display: a spinner while predicting (no per-batch hooks), else the
    measured batches as they end."""
    if predict:
        with progress("recommend", f"predicting step times on {gpu}"):
            yield None, None
    else:
        with bench_progress("recommend") as hooks:
            yield hooks
