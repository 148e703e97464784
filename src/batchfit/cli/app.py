"""The ``batchfit`` command line (typer + rich).

Exit codes: 0 ok; 2 bad input (one line, no traceback unless ``--debug``); 3 nothing fits.
Torch is imported inside the commands, so ``batchfit --help`` stays fast.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import re
import sys
import warnings
from typing import Any, Iterator, Optional

import typer
from rich.console import Console

from batchfit._gc import freeze_after_imports
from batchfit.engine.spec import (
    Mode,
    OptimizerName,
    Precision,
    parse_duration,
    parse_enum,
    parse_shape,
    parse_size,
)
from batchfit.errors import BatchfitError, InvalidInputError

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Predict the GPU memory of a PyTorch step and the largest batch that fits.")
out = Console()
err = Console(stderr=True)

ModelArg = typer.Argument(..., help="timm:NAME, torchvision:NAME, hf:NAME or path/to/file.py:factory")
GpuOpt = typer.Option(None, "--gpu", help="a catalog GPU name (batchfit gpus lists them), or "
                      "'auto'; with --memory SIZE, that card with SIZE of memory")
DeviceOpt = typer.Option(None, "--device", help="cpu, or cuda:N to read a live GPU")
InputOpt = typer.Option(None, "--input", help="per-sample input shape, e.g. 3x224x224")
SeqOpt = typer.Option(None, "--seq-len", help="sequence length for token models")
ModeOpt = typer.Option("train", "--mode", help="train or infer")
OptimOpt = typer.Option(
    None, "--optimizer",
    help="sgd, momentum, nesterov, adam, adamw, adagrad, rmsprop, adafactor (default adamw; "
         "a compiled Keras model: its own)")
PrecOpt = typer.Option("fp32", "--precision", help="fp32, tf32, amp-fp16, amp-bf16, bf16, fp16")
CkptOpt = typer.Option(False, "--checkpointing", help="activation checkpointing")
ClOpt = typer.Option(False, "--channels-last", help="channels-last memory format")
OverheadOpt = typer.Option(
    None, "--overhead",
    help="memory outside the tensors, e.g. 600MiB: the CUDA context (GPU), or the CPU runtime's "
         "overhead (--device cpu; max measures it with one real step unless given)")
KwargsOpt = typer.Option(None, "--model-kwargs", help="key=value passed to the model builder")
JsonOpt = typer.Option(False, "--json", help="print one JSON object")
PlotOpt = typer.Option(None, "--plot", help="write a PNG plot here")
DebugOpt = typer.Option(False, "--debug", help="show tracebacks")


@contextlib.contextmanager
def _errors(debug: bool) -> Iterator[None]:
    """One clear line and an exit code for every error; a traceback only with --debug."""
    try:
        yield
    except typer.Exit:
        raise
    except BatchfitError as exc:
        if debug:
            raise
        err.print(f"[red]error:[/red] {exc}", highlight=False, soft_wrap=True)
        raise typer.Exit(exc.exit_code) from None
    except KeyboardInterrupt:
        raise typer.Exit(130) from None
    except Exception as exc:  # noqa: BLE001 - last resort: still one line
        if debug:
            raise
        line = (str(exc).strip().splitlines() or [""])[0]
        err.print(f"[red]error:[/red] {type(exc).__name__}: {line} (rerun with --debug for details)",
                  highlight=False, soft_wrap=True)
        raise typer.Exit(1) from None


def _progress(enabled: bool, description: str):
    """A rich status spinner on stderr for anything slower than a blink."""
    if not enabled:
        return contextlib.nullcontext(None)
    return err.status(description)


def _resolve_device(gpu: str | None, device: str | None, memory: str | None,
                    overhead: str | None, need_budget: bool) -> tuple[Any, int | None]:
    """The target profile, and the memory budget when it is not the profile's own memory.

    ``--gpu NAME --memory SIZE`` is that card's architecture with SIZE of memory: the size
    becomes the profile's memory (shown and reported as the card's), so no separate budget
    is returned. With ``--device`` (or alone) ``--memory`` keeps its budget meaning: the CPU's
    budget, or a cap below a live card's memory.
    """
    from batchfit.device.profile import DeviceProfile, gpu_profile

    if gpu and device:
        raise InvalidInputError("give --gpu or --device, not both")
    memory_bytes = parse_size(memory) if memory is not None else None
    context_bytes = parse_size(overhead, allow_zero=True) if overhead is not None else None
    if gpu:
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


def _setup(model: str, input_shape: str | None, seq_len: int | None, mode: str,
           optimizer: str | None, precision: str, checkpointing: bool, channels_last: bool,
           model_kwargs: list[str] | None) -> tuple[Any, Any, Any]:
    from dataclasses import replace

    from batchfit.engine.spec import TrainConfig
    from batchfit.models.resolve import parse_model_kwargs, resolve_model

    config = TrainConfig(
        mode=parse_enum(Mode, mode, "mode"),
        optimizer=parse_enum(OptimizerName, optimizer or "adamw", "optimizer"),
        precision=parse_enum(Precision, precision, "precision"),
        checkpointing=checkpointing, channels_last=channels_last)
    if seq_len is not None and seq_len < 1:
        raise InvalidInputError(f"--seq-len must be a positive integer, not {seq_len}")
    shape = parse_shape(input_shape) if input_shape is not None else None
    spec = resolve_model(model, model_kwargs=parse_model_kwargs(model_kwargs or []),
                         seq_len=seq_len, input_shape=shape)
    if not gc.isenabled():  # main() turned it off for the imports, which are done now
        freeze_after_imports()
    if spec.keras_compiled is False and optimizer is None:
        raise InvalidInputError(
            f"the Keras model of {model} is not compiled: compile it in the factory "
            "(model.compile(optimizer=..., loss=...)) or give --optimizer NAME")
    if spec.keras_compiled and optimizer is not None:  # the user's choice over the compiled one
        from batchfit.engine.keras_step import with_optimizer

        spec = replace(spec, factory=with_optimizer(spec.factory, config.optimizer))
    if spec.input_spec is None:
        raise InvalidInputError(
            f"{model} has no default input: give --input (per-sample shape, e.g. 3x224x224)")
    if spec.loss_fn is not None:
        config = replace(config, loss_fn=spec.loss_fn)
    return spec, spec.input_spec, config


def _check_plot(path: str | None) -> None:
    if path is not None:
        from batchfit.cli.plot import check_plot_path

        check_plot_path(path)


def _emit_json(data: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(data, indent=2) + "\n")


@app.command("estimate")
def estimate_cmd(
    model: str = ModelArg,
    batch_size: int = typer.Option(..., "--batch-size", "-b", help="the batch size"),
    gpu: Optional[str] = GpuOpt, device: Optional[str] = DeviceOpt,
    memory: Optional[str] = typer.Option(
        None, "--memory", help="with --gpu: the card's memory, e.g. 48GiB (its architecture, "
        "this much memory)"),
    input_shape: Optional[str] = InputOpt, seq_len: Optional[int] = SeqOpt,
    mode: str = ModeOpt, optimizer: Optional[str] = OptimOpt, precision: str = PrecOpt,
    checkpointing: bool = CkptOpt, channels_last: bool = ClOpt,
    overhead: Optional[str] = OverheadOpt, model_kwargs: Optional[list[str]] = KwargsOpt,
    as_json: bool = JsonOpt, plot: Optional[str] = PlotOpt, debug: bool = DebugOpt,
) -> None:
    """Predict the peak memory of one step at a batch size."""
    with _errors(debug):
        if batch_size < 1:
            raise InvalidInputError(f"--batch-size must be a positive integer, not {batch_size}")
        _check_plot(plot)
        if memory is not None and not gpu:
            raise InvalidInputError(
                "estimate --memory goes with --gpu NAME, as that card's memory; an estimate "
                "on --device uses the device as it is (max --memory sets a budget)")
        profile, _ = _resolve_device(gpu, device, memory, overhead, need_budget=False)
        with _progress(not as_json, f"tracing {model} at batch {batch_size}..."):
            spec, inputs, config = _setup(model, input_shape, seq_len, mode, optimizer, precision,
                                          checkpointing, channels_last, model_kwargs)
            from batchfit.answers.estimate import estimate

            est = estimate(spec.factory, inputs, batch_size, config, device=profile)
        if plot:
            from batchfit.cli.plot import plot_estimate

            plot_estimate(est, plot)
        if as_json:
            _emit_json({"model": model, **est.to_dict()})
            return
        from batchfit.cli.report import render_estimate

        out.print(render_estimate(est))
        if plot:
            out.print(f"plot written to {plot}")


@app.command("max")
def max_cmd(
    model: str = ModelArg,
    gpu: Optional[str] = GpuOpt, device: Optional[str] = DeviceOpt,
    memory: Optional[str] = typer.Option(
        None, "--memory", help="memory budget, e.g. 24GiB; with --gpu NAME, that card's memory"),
    input_shape: Optional[str] = InputOpt, seq_len: Optional[int] = SeqOpt,
    mode: str = ModeOpt, optimizer: Optional[str] = OptimOpt, precision: str = PrecOpt,
    checkpointing: bool = CkptOpt, channels_last: bool = ClOpt,
    margin: float = typer.Option(0.0, "--margin", help="fraction of memory kept free, e.g. 0.05"),
    overhead: Optional[str] = OverheadOpt, model_kwargs: Optional[list[str]] = KwargsOpt,
    max_limit: int = typer.Option(65536, "--max-batch-limit", help="largest batch considered"),
    batch_size: Optional[int] = typer.Option(
        None, "--batch-size", "-b",
        help="token models: fix the batch and find the longest --seq-len that fits"),
    as_json: bool = JsonOpt, plot: Optional[str] = PlotOpt, debug: bool = DebugOpt,
) -> None:
    """The largest batch size that fits the GPU (or a memory budget).

    With --batch-size, the longest sequence length that fits at that batch instead.
    """
    with _errors(debug):
        if not 0 <= margin < 1:
            raise InvalidInputError(f"--margin {margin} must be a fraction in [0, 1), e.g. 0.05")
        if max_limit < 1:
            raise InvalidInputError("--max-batch-limit must be positive")
        _check_plot(plot)
        profile, memory_bytes = _resolve_device(gpu, device, memory, overhead, need_budget=True)
        if not profile.is_cuda and memory_bytes is None:
            raise InvalidInputError("--device cpu needs --memory SIZE as the budget")
        with _progress(not as_json, f"resolving {model}...") as status:
            spec, inputs, config = _setup(model, input_shape, seq_len, mode, optimizer, precision,
                                          checkpointing, channels_last, model_kwargs)
            if not profile.is_cuda and overhead is None:
                if status is not None:
                    status.update(f"measuring the CPU runtime's overhead: one real step of {model}...")
                profile = profile.with_overheads(
                    context_bytes=_measure_cpu_overhead(spec, inputs, config))
            if batch_size is not None:
                _max_seq_len(model, spec, inputs, config, profile, memory_bytes, margin,
                             batch_size, as_json, status)
                return
            from batchfit.answers.maxbatch import max_batch_size

            def on_trace(batch: int) -> None:
                if status is not None:
                    status.update(f"tracing {model} at batch {batch}...")

            result = max_batch_size(spec.factory, inputs, config, device=profile,
                                    memory_bytes=memory_bytes, margin=margin,
                                    max_batch_limit=max_limit, on_trace=on_trace)
        if plot:
            from batchfit.cli.plot import plot_max_batch

            plot_max_batch(result, plot)
        if as_json:
            _emit_json({"model": model, **result.to_dict()})
            return
        from batchfit.cli.report import render_max_batch

        out.print(render_max_batch(result, model))
        if plot:
            out.print(f"plot written to {plot}")


def _measure_cpu_overhead(spec: Any, inputs: Any, config: Any) -> int:
    """The CPU runtime's memory beyond tensors for this model (batchfit.realrun.cpu_overhead)."""
    from batchfit.realrun.cpu_overhead import measure_cpu_overhead

    try:
        return measure_cpu_overhead(spec, inputs, config).overhead_bytes
    except BatchfitError as exc:
        raise InvalidInputError(
            f"could not measure the CPU runtime's overhead ({exc}): give it with --overhead "
            "SIZE (--overhead 0 ignores it)") from exc


def _context_length(spec: Any) -> int | None:
    """The model's maximum positions, read from its config (built on meta)."""
    from batchfit.engine.fake import build_on_meta
    from batchfit.models.resolve import _max_positions

    built = build_on_meta(spec.factory)
    config = getattr(built, "config", None)
    return _max_positions(config) if config is not None else None


def _max_seq_len(model: str, spec: Any, inputs: Any, config: Any, profile: Any,
                 memory_bytes: int | None, margin: float, batch_size: int, as_json: bool,
                 status: Any) -> None:
    from batchfit.answers.maxbatch import max_seq_len

    if batch_size < 1:
        raise InvalidInputError(f"--batch-size must be a positive integer, not {batch_size}")
    if not spec.is_token_model:
        raise InvalidInputError(
            f"{model} takes no token sequence: --batch-size with max solves for --seq-len; "
            "drop --batch-size to find the largest batch")

    def on_trace(length: int) -> None:
        if status is not None:
            status.update(f"tracing {model} at sequence length {length}...")

    limit = _context_length(spec) or 131072
    result = max_seq_len(spec.factory, inputs, batch_size, config, device=profile,
                         memory_bytes=memory_bytes, margin=margin, max_len=limit,
                         on_trace=on_trace)
    if as_json:
        _emit_json({"model": model, **result.to_dict()})
        return
    from batchfit.cli.report import format_bytes

    out.print(f"[bold]Longest sequence:[/bold] [bold green]{result.max_seq_len}[/bold green] "
              f"tokens at batch {batch_size} on {profile.name} "
              f"({format_bytes(result.total_bytes_at_max)} needed, budget "
              f"{format_bytes(result.budget_bytes)}; {result.traces} traces"
              + ("; capped at the model's context" if result.capped else "") + ")")


@app.command("search")
def search_cmd(
    model: str = ModelArg,
    device: str = typer.Option("cpu", "--device", help="cpu or cuda:N: the device to run on"),
    memory_cap: Optional[str] = typer.Option(
        None, "--memory-cap", help="CPU: bytes a trial may use beyond its warmed-up state; "
        "CUDA: the allocator's limit (what if my card were smaller)"),
    steps_per_trial: int = typer.Option(2, "--steps-per-trial", help="real steps per trial (>= 2)"),
    boundary_runs: int = typer.Option(
        3, "--boundary-runs",
        help="CPU: exec'd fresh processes the answer must fit in (the batch above runs as "
        "often); 1: no settling, the forked trials' answer"),
    input_shape: Optional[str] = InputOpt, seq_len: Optional[int] = SeqOpt,
    mode: str = ModeOpt, optimizer: Optional[str] = OptimOpt, precision: str = PrecOpt,
    checkpointing: bool = CkptOpt, channels_last: bool = ClOpt,
    model_kwargs: Optional[list[str]] = KwargsOpt,
    as_json: bool = JsonOpt, debug: bool = DebugOpt,
) -> None:
    """Find the exact largest batch on the real device, starting from the prediction."""
    with _errors(debug):
        if boundary_runs < 1:
            raise InvalidInputError(f"--boundary-runs must be at least 1, not {boundary_runs}")
        if steps_per_trial < 2:
            raise InvalidInputError(
                f"--steps-per-trial must be at least 2 (the first step creates the optimizer "
                f"state; the peak is the steady state's), not {steps_per_trial}")
        text = device.strip().lower()
        if text != "cpu" and not re.fullmatch(r"cuda(:\d+)?", text):
            raise InvalidInputError(f"unknown device {device!r}: use cpu or cuda:N (e.g. cuda:0)")
        if text.startswith("cuda"):
            from batchfit.device.catalog import live_gpu

            live_gpu(int(text.partition(":")[2] or 0))  # one clear line if it does not exist
        cap = parse_size(memory_cap) if memory_cap is not None else None
        if cap is not None and text == "cpu":
            total = _machine_memory_bytes()
            if total is not None and cap > total:
                from batchfit.cli.report import format_bytes

                raise InvalidInputError(
                    f"--memory-cap {memory_cap} is larger than this machine's memory "
                    f"({format_bytes(total)}): give a smaller cap")
        spec, inputs, config = _setup(model, input_shape, seq_len, mode, optimizer, precision,
                                      checkpointing, channels_last, model_kwargs)
        from batchfit.realrun.search import search_max_batch

        with _progress(not as_json, f"predicting, then running {model} on {device}...") as status:
            def on_trial(trial: Any) -> None:
                if status is not None:
                    verdict = "fits" if trial.fits else "out of memory"
                    status.update(f"batch {trial.batch_size} {verdict}; next trial...")

            result = search_max_batch(spec, inputs, config, device=text,
                                      memory_cap_bytes=cap, steps_per_trial=steps_per_trial,
                                      boundary_runs=boundary_runs, on_trial=on_trial)
        if as_json:
            _emit_json({"model": model, **result.to_dict()})
            return
        from batchfit.cli.report import render_search

        out.print(render_search(result, model))


def _machine_memory_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


@app.command("bench")
def bench_cmd(
    model: str = ModelArg,
    device: Optional[str] = typer.Option(None, "--device", help="cpu or cuda:N (measured)"),
    gpu: Optional[str] = typer.Option(None, "--gpu", help="a catalog GPU, with --predict"),
    predict: bool = typer.Option(False, "--predict", help="predict on --gpu; no device needed"),
    memory: Optional[str] = typer.Option(
        None, "--memory", help="memory budget on --device, e.g. 8GiB (default on the CPU: the "
        "memory this machine has available); with --gpu NAME --predict, that card's memory"),
    time_budget: str = typer.Option(
        "120s", "--time-budget",
        help="measuring stops short of batches that would end past this, e.g. 5m"),
    batches: str = typer.Option("auto", "--batches", help="auto, or a list like 16,32,64"),
    dataset_size: Optional[int] = typer.Option(None, "--dataset-size",
                                               help="samples per epoch, for the epoch time"),
    alignment: bool = typer.Option(False, "--alignment",
                                   help="measure B against multiples of 8, powers of two, B±1"),
    input_shape: Optional[str] = InputOpt, seq_len: Optional[int] = SeqOpt,
    mode: str = ModeOpt, optimizer: Optional[str] = OptimOpt, precision: str = PrecOpt,
    checkpointing: bool = CkptOpt, channels_last: bool = ClOpt,
    model_kwargs: Optional[list[str]] = KwargsOpt,
    as_json: bool = JsonOpt, plot: Optional[str] = PlotOpt, debug: bool = DebugOpt,
) -> None:
    """Measure (or predict) throughput against batch size and recommend the fastest batch."""
    with _errors(debug):
        _check_plot(plot)
        if dataset_size is not None and dataset_size < 1:
            raise InvalidInputError(f"--dataset-size must be a positive integer, not {dataset_size}")
        if predict and not gpu:
            raise InvalidInputError("--predict needs --gpu NAME: the card to predict for")
        if gpu and not predict:
            raise InvalidInputError("--gpu goes with --predict; to measure, use --device cpu|cuda:N")
        batch_list = _parse_batches(batches)
        memory_bytes = parse_size(memory) if memory is not None else None
        budget_s = parse_duration(time_budget)
        card = _predicted_card(gpu, memory_bytes) if predict else None
        spec, inputs, config = _setup(model, input_shape, seq_len, mode, optimizer, precision,
                                      checkpointing, channels_last, model_kwargs)
        if predict:
            from batchfit.speed.roofline import predict_throughput

            with _progress(not as_json, f"predicting {model} on {gpu}..."):
                result = predict_throughput(spec.factory, inputs, config, gpu=card,
                                            batches=batch_list, dataset_size=dataset_size)
        else:
            from batchfit.speed.bench import bench

            with _measure_progress(not as_json) as on_measure:
                result = bench(spec.factory, inputs, config, device=device or "cpu",
                               memory_bytes=memory_bytes, batches=batch_list,
                               dataset_size=dataset_size, alignment=alignment,
                               time_budget_s=budget_s, on_measure=on_measure,
                               on_point=_point_line if as_json else None)
            if result.memory_source == "available":
                from batchfit.cli.report import format_bytes

                err.print(f"bench: no --memory: using the {format_bytes(result.memory_bytes)} "
                          "this machine has available now", highlight=False)
        if plot:
            from batchfit.cli.plot import plot_throughput

            plot_throughput(result, plot)
        if as_json:
            _emit_json({"model": model, **result.to_dict()})
            return
        from batchfit.cli.report import render_bench

        out.print(render_bench(result, model))
        if plot:
            out.print(f"plot written to {plot}")


def _point_line(point: Any) -> None:
    """One line on stderr per measured (or skipped) batch: --json mode has no progress bar."""
    if point.fits:
        text = (f"bench: batch {point.batch_size}: {point.samples_per_s:,.1f} samples/s "
                f"(step {point.step_s * 1e3:,.1f} ms; {point.seconds:.1f} s)")
    else:
        text = f"bench: batch {point.batch_size}: {point.error}"
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


def _predicted_card(gpu: str, memory_bytes: int | None) -> Any:
    """The catalog card ``bench --predict`` runs on; with ``--memory``, its architecture with
    that memory (checked against the context and workspaces as ``max`` checks it)."""
    from batchfit.device.catalog import find_gpu
    from batchfit.device.profile import gpu_profile

    card = find_gpu(gpu)
    if memory_bytes is None:
        return card
    gpu_profile(card, memory_bytes)  # one clear line if the memory cannot hold the overheads
    return card.with_memory(memory_bytes)


def _parse_batches(text: str) -> Any:
    if text.strip().lower() == "auto":
        return "auto"
    try:
        values = [int(v) for v in text.replace(" ", "").split(",") if v]
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values):
        raise InvalidInputError(
            f"bad --batches {text!r}: use auto or a comma-separated list like 16,32,64")
    return sorted(set(values))


@contextlib.contextmanager
def _measure_progress(enabled: bool) -> Iterator[Any]:
    """A rich progress bar over measured batch sizes (at most 8 for the knee)."""
    if not enabled:
        yield None
        return
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(),
                  console=err, transient=True) as progress:
        task = progress.add_task("measuring", total=8)

        def on_measure(batch: int) -> None:
            progress.update(task, advance=1, description=f"measuring batch {batch}")

        yield on_measure


@app.command("gpus")
def gpus_cmd(as_json: bool = JsonOpt, debug: bool = DebugOpt) -> None:
    """List the GPU catalog."""
    with _errors(debug):
        from batchfit.device.catalog import list_gpus

        gpus = list_gpus()
        if as_json:
            _emit_json({"gpus": [g.to_dict() for g in gpus]})
            return
        from batchfit.cli.report import render_gpus

        out.print(render_gpus(gpus))


def main() -> None:
    # Library chatter (transformers' advisory logs, deprecation warnings) would break
    # --json on stdout and bury the answer; batchfit's own warnings are in its results.
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    # Keras 3 picks its backend when a model file first imports it: torch, the one batchfit
    # traces, unless the user chose another (then Keras models get one clear error)
    os.environ.setdefault("KERAS_BACKEND", "torch")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    # The cyclic collector would walk the objects torch and the model library create
    # while they import, again and again (0.64 s in 6 walks of a 12 s `max`); _setup()
    # freezes them once they exist and turns it back on (batchfit/_gc.py).
    gc.disable()
    try:
        app()
    finally:
        gc.enable()


if __name__ == "__main__":  # pragma: no cover
    main()
