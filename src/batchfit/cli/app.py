"""The ``batchfit`` command line (typer + rich).

Exit codes: 0 ok; 2 bad input (one line, no traceback unless ``--debug``); 3 nothing fits.
Torch is imported inside the commands, so ``batchfit --help`` stays fast. The commands
translate flags into library calls (:mod:`batchfit.api`), which decide every default; the
options are declared once (:mod:`batchfit.cli.options`).
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import warnings
from typing import Any, Optional

import typer

import batchfit.cli.outputs as outputs
from batchfit._gc import one_command_process
from batchfit.cli.common import (
    check_plot,
    emit_json,
    errors,
    out,
    print_notes,
)
from batchfit.cli.interrupt import exit_on_interrupt
from batchfit.cli.options import (
    LLM_OPTIONS,
    MULTI_OPTIONS,
    OUTPUT,
    STACK_OPTIONS,
    STEP,
    STEP_OPTIONS,
    TARGET,
    ModelArg,
    option,
    takes,
)
from batchfit.cli.progress import bench_progress, progress, trial_text
from batchfit.cli.root import app
from batchfit.errors import InvalidInputError

#: What estimate and max ask the library with (batchfit.api.answers' keyword groups).
ANSWER_OPTIONS = (*STEP_OPTIONS, "gpu", "device", "overhead", *STACK_OPTIONS, *LLM_OPTIONS,
                  *MULTI_OPTIONS)


@app.command("estimate")
@takes(*ANSWER_OPTIONS)
def estimate_cmd(
    model: str = ModelArg,
    batch_size: int = typer.Option(..., "--batch-size", "-b", help="the batch size",
                                   rich_help_panel=STEP),
    memory: Optional[str] = typer.Option(None, "--memory", help="with --gpu: the card's "
                                         "memory, e.g. 48GiB", rich_help_panel=TARGET),
    snapshot: Optional[str] = typer.Option(
        None, "--snapshot", help="a CUDA memory snapshot of this step to compare with",
        rich_help_panel=OUTPUT),
    as_json: bool = option("as_json"), plot: Optional[str] = option("plot"),
    html: Optional[str] = option("html"),
    export_snapshot: Optional[str] = option("export_snapshot"),
    debug: bool = option("debug"), words: Any = None,
) -> None:
    """Predict the peak memory of one step at a batch size (per GPU with --world-size)."""
    with errors(debug):
        check_plot(plot)
        outputs.check_outputs(html, export_snapshot, sharded=words["world_size"] is not None)
        from batchfit.api.answers import estimate_words

        with progress("estimate", f"tracing {model} at batch {batch_size}"):
            answer = estimate_words(model, batch_size, memory=memory, snapshot=snapshot,
                                    **words)
        print_notes(answer.notes)
        if plot:
            from batchfit.cli.plot import plot_estimate

            plot_estimate(answer.result, plot)
        data = answer.to_dict()
        written = outputs.write_outputs(
            data, answer.result, f"batchfit estimate {model} at batch {batch_size}", html=html,
            snapshot=export_snapshot, summary=outputs.ESTIMATE_SUMMARY)
        if as_json:
            emit_json(data)
            return
        from batchfit.cli.report import render_estimate

        out.print(render_estimate(answer.result))
        for line in ([f"plot written to {plot}"] if plot else []) + written:
            out.print(line, soft_wrap=True, highlight=False)


@app.command("max")
@takes(*ANSWER_OPTIONS)
def max_cmd(
    model: str = ModelArg,
    memory: Optional[str] = typer.Option(None, "--memory", help="budget, e.g. 24GiB; with "
                                         "--gpu: the card's memory", rich_help_panel=TARGET),
    margin: float = typer.Option(0.0, "--margin", help="fraction kept free, e.g. 0.05",
                                 rich_help_panel=TARGET, show_default=False),
    max_limit: int = typer.Option(65536, "--max-batch-limit", help="largest batch considered "
                                  "(65536)", rich_help_panel=STEP, show_default=False),
    batch_size: Optional[int] = typer.Option(
        None, "--batch-size", "-b", help="fix the batch: find the longest --seq-len",
        rich_help_panel=STEP),
    as_json: bool = option("as_json"), plot: Optional[str] = option("plot"),
    html: Optional[str] = option("html"),
    export_snapshot: Optional[str] = option("export_snapshot"),
    debug: bool = option("debug"), words: Any = None,
) -> None:
    """The largest batch size that fits the GPU (or a memory budget).

    With --batch-size: the longest sequence length that fits at that batch.

    With --world-size: the largest per-GPU (micro-)batch that fits every rank.
    """
    with errors(debug, {"model": model} if as_json else None):
        check_plot(plot)
        outputs.check_outputs(html, export_snapshot, sharded=words["world_size"] is not None)
        if batch_size is not None and (html or export_snapshot):
            raise InvalidInputError("--html and --export-snapshot go with the largest batch: "
                                    "drop --batch-size, or estimate at the length found")
        from batchfit.api.answers import max_batch_words, max_seq_len_words

        with progress("max", f"resolving {model}") as status:
            if batch_size is not None:
                answer = max_seq_len_words(model, batch_size, memory=memory, margin=margin,
                                           on_status=status.update, **words)
            else:
                answer = max_batch_words(model, memory=memory, margin=margin,
                                         max_batch_limit=max_limit, on_status=status.update,
                                         **words)
        print_notes(answer.notes)
        if batch_size is not None:
            _print_seq_len(answer, as_json)
            return
        _print_max_batch(answer, as_json, plot, html, export_snapshot)


def _print_max_batch(answer: Any, as_json: bool, plot: str | None, html: str | None,
                     export_snapshot: str | None) -> None:
    result = answer.result
    if plot:
        from batchfit.cli.plot import plot_max_batch

        plot_max_batch(result, plot)
    data = answer.to_dict()
    written = outputs.write_outputs(
        data, result.estimate_at_max, f"batchfit max {answer.model} on {result.device.name}",
        html=html, snapshot=export_snapshot, evaluated=result.evaluated,
        budget_bytes=result.budget_bytes, summary=outputs.MAX_SUMMARY)
    if as_json:
        emit_json(data)
        return
    from batchfit.cli.report import render_max_batch

    out.print(render_max_batch(result, answer.model))
    for line in ([f"plot written to {plot}"] if plot else []) + written:
        out.print(line, soft_wrap=True, highlight=False)


def given(**values: Any) -> dict[str, Any]:
    """The options the user gave: the library's defaults stand for the others."""
    return {name: value for name, value in values.items() if value is not None}


def _print_seq_len(answer: Any, as_json: bool) -> None:
    if as_json:
        emit_json(answer.to_dict())
        return
    from batchfit.cli.report import format_bytes

    result = answer.result
    out.print(f"[bold]Longest sequence:[/bold] [bold green]{result.max_seq_len}[/bold green] "
              f"tokens at batch {result.batch_size} on {result.device.name} "
              f"({format_bytes(result.total_bytes_at_max)} needed, budget "
              f"{format_bytes(result.budget_bytes)}; {result.traces} traces"
              + ("; capped at the model's context" if result.capped else "") + ")")
    from batchfit.cli.report import warning_lines

    for line in warning_lines(result.warnings):
        out.print(line)


@app.command("search")
@takes(*STEP_OPTIONS)
def search_cmd(
    model: str = ModelArg,
    device: Optional[str] = typer.Option(None, "--device", help="cpu (default) or cuda:N: the "
                                         "device to run on", show_default=False),
    memory_cap: Optional[str] = typer.Option(
        None, "--memory-cap", help="CPU: bytes a trial may use beyond its warmed-up state; "
        "CUDA: the allocator's limit (what if my card were smaller)"),
    steps_per_trial: Optional[int] = typer.Option(
        None, "--steps-per-trial", help="real steps per trial (2; at least 2)",
        show_default=False),
    boundary_runs: Optional[int] = typer.Option(
        None, "--boundary-runs", show_default=False,
        help="CPU: exec'd fresh processes the answer must fit in (3; the batch above runs as "
        "often); 1: no settling, the forked trials' answer"),
    as_json: bool = option("as_json"), debug: bool = option("debug"), words: Any = None,
) -> None:
    """Find the exact largest batch on the real device, starting from the prediction."""
    with errors(debug, {"model": model} if as_json else None):
        from batchfit.api.measured import search_words

        with progress("search", f"predicting {model}'s largest batch (two traces), then "
                      "real trials") as status:
            def on_trial(trial: Any) -> None:
                status.done(trial_text(trial))

            answer = search_words(model, memory_cap=memory_cap, on_trial=on_trial,
                                  **given(device=device, steps_per_trial=steps_per_trial,
                                          boundary_runs=boundary_runs), **words)
        print_notes(answer.notes)
        if as_json:
            emit_json(answer.to_dict())
            return
        from batchfit.cli.report import render_search

        out.print(render_search(answer.result, model))


@app.command("bench")
@takes(*STEP_OPTIONS, *STACK_OPTIONS)
def bench_cmd(
    model: str = ModelArg,
    device: Optional[str] = typer.Option(None, "--device", help="cpu or cuda:N (measured)"),
    gpu: Optional[str] = typer.Option(None, "--gpu", help="a catalog GPU, with --predict"),
    predict: bool = typer.Option(False, "--predict", help="predict on --gpu; no device needed"),
    memory: Optional[str] = typer.Option(
        None, "--memory", help="memory budget on --device, e.g. 8GiB (default on the CPU: the "
        "memory this machine has available); with --gpu NAME --predict, that card's memory"),
    time_budget: Optional[str] = typer.Option(
        None, "--time-budget", show_default=False,
        help="measuring stops short of batches that would end past this, e.g. 5m (120s)"),
    batches: str = typer.Option("auto", "--batches", help="auto, or a list like 16,32,64"),
    dataset_size: Optional[int] = typer.Option(None, "--dataset-size",
                                               help="samples per epoch, for the epoch time"),
    alignment: bool = typer.Option(False, "--alignment",
                                   help="measure B against multiples of 8, powers of two, B±1"),
    as_json: bool = option("as_json"), plot: Optional[str] = option("plot"),
    html: Optional[str] = option("html"), debug: bool = option("debug"), words: Any = None,
) -> None:
    """Measure (or predict) throughput against batch size and recommend the fastest batch.

    With --predict, the stack options (--stack, --torch-version, --cuda-version,
    --cudnn-benchmark, --alloc-conf) describe the process on the predicted card, as for
    ``max``; a measured bench runs in this process, with its own torch and settings.
    """
    with errors(debug):
        check_plot(plot)
        outputs.check_outputs(html, None)
        from batchfit.api.measured import bench_words

        if predict:
            with progress("bench", f"predicting {model} on {gpu}"):
                answer = bench_words(model, device=device, gpu=gpu, predict=True, memory=memory,
                                     batches=batches, dataset_size=dataset_size, **words)
        else:
            with bench_progress("bench") as (on_measure, on_point):
                answer = bench_words(model, device=device, gpu=gpu, memory=memory,
                                     **given(time_budget=time_budget), batches=batches,
                                     dataset_size=dataset_size, alignment=alignment,
                                     on_measure=on_measure, on_point=on_point, **words)
        print_notes(answer.notes)
        result = answer.result
        if plot:
            from batchfit.cli.plot import plot_throughput

            plot_throughput(result, plot)
        data = answer.to_dict()
        written = outputs.write_answer_report("bench", data, f"batchfit bench {model}", html)
        if as_json:
            emit_json(data)
            return
        from batchfit.cli.report import render_bench

        out.print(render_bench(result, model))
        for line in ([f"plot written to {plot}"] if plot else []) + written:
            out.print(line, soft_wrap=True, highlight=False)


@app.command("gpus")
def gpus_cmd(as_json: bool = option("as_json"), debug: bool = option("debug")) -> None:
    """List the GPU catalog."""
    with errors(debug):
        from batchfit.device.catalog import list_gpus

        gpus = list_gpus()
        if as_json:
            emit_json({"gpus": [g.to_dict() for g in gpus]})
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
    # bitsandbytes wraps CPU kernels a trace never runs in torch.compile at import, which
    # pulls in torch._inductor (~5 s); this process only traces (engine/workloads/build.py)
    os.environ.setdefault("BATCHFIT_BNB_NO_COMPILE", "1")
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    # The same kind of chatter through torch's logging: transformers imports torchao's
    # quantizer with every model, and torchao registers Enums as pytree constants, which
    # torch.utils._pytree.register_constant logs as deprecated (its only log call).
    logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
    # The cyclic collector would walk the objects torch and the model library create
    # while they import, again and again (batchfit/_gc.py); resolve_step() freezes them once
    # they exist and turns it back on.
    one_command_process()
    exit_on_interrupt()
    try:
        app()
    finally:
        # the command is over (its answer printed): a Ctrl-C now, while the interpreter
        # tears down, would only kill it by the signal, in the middle of that
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        gc.enable()


if __name__ == "__main__":  # pragma: no cover
    main()
