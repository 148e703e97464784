"""The ``batchfit`` command line (typer + rich).

Exit codes: 0 ok; 2 bad input (one line, no traceback unless ``--debug``); 3 nothing fits.
Torch is imported inside the commands, so ``batchfit --help`` stays fast.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import re
import signal
import sys
import warnings
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import typer
from rich.console import Console

from batchfit._gc import freeze_after_imports
from batchfit.cli import outputs
from batchfit.cli.interrupt import exit_on_interrupt
from batchfit.cli.progress import bench_progress, progress, trial_text
from batchfit.cli.target import ATTN as _ATTN
from batchfit.cli.target import check_attn, chosen, print_notes, resolve_target
from batchfit.engine.spec import (
    Mode,
    Precision,
    parse_duration,
    parse_enum,
    parse_shape,
    parse_size,
)
from batchfit.errors import BatchfitError, DoesNotFitError, InvalidInputError

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
    help="sgd, momentum, nesterov, adam, adamw, adagrad, rmsprop, adafactor, lion, adamw8bit, "
         "adam8bit, lion8bit, paged-adamw8bit, paged-adamw32bit, paged-lion8bit (default adamw; "
         "a compiled Keras model: its own)")
PrecOpt = typer.Option(None, "--precision", help="fp32, tf32, amp-fp16, amp-bf16, bf16, fp16 "
                       "(default: the --recipe's; fp32, or amp-bf16 with --quant as peft's)")
CkptOpt = typer.Option(None, "--checkpointing/--no-checkpointing",
                       help="activation checkpointing (default: the --recipe's; off, or on "
                       "with --quant as peft's prepare_model_for_kbit_training does)")
ClOpt = typer.Option(False, "--channels-last", help="channels-last memory format")
StackOpt = typer.Option(None, "--stack",
                        help="torch and CUDA versions the step runs on, e.g. torch2.4+cu124 "
                             "(default: the installed torch)")
TorchVerOpt = typer.Option(None, "--torch-version", help="torch version, e.g. 1.12 or 2.4")
CudaVerOpt = typer.Option(None, "--cuda-version", help="CUDA version of that torch, e.g. 11.3")
InfModeOpt = typer.Option(
    False, "--inference-mode",
    help="--mode infer: the script runs under torch.inference_mode() (Lightning's "
    "validate/test/predict), not torch.no_grad(); from torch 2.11 autocast then keeps no "
    "weight copies")
CudnnBenchOpt = typer.Option(False, "--cudnn-benchmark",
                             help="the script sets torch.backends.cudnn.benchmark = True")
AllocConfOpt = typer.Option(None, "--alloc-conf", metavar="OPTIONS",
                            help="the training process's PYTORCH_CUDA_ALLOC_CONF, e.g. "
                                 "expandable_segments:True (default: a --snapshot's, else "
                                 "this shell's)")
OverheadOpt = typer.Option(
    None, "--overhead",
    help="memory outside the tensors, e.g. 600MiB: the CUDA context (GPU), or the CPU runtime's "
         "overhead (--device cpu; max measures it with one real step unless given)")
KwargsOpt = typer.Option(None, "--model-kwargs", help="key=value passed to the model builder")
LoraOpt = typer.Option(None, "--lora", help="peft LoRA, e.g. r=16,alpha=32,targets=all-linear"
                       "[,dropout=0.05,save=lm_head,dtype=fp32|bf16|base,dora=true]; lists: +")
QuantOpt = typer.Option(None, "--quant", help="bitsandbytes base weights: nf4, nf4-dq, fp4, "
                        "fp4-dq (dq: double quantization) or int8 (LLM.int8)")
LossOpt = typer.Option(None, "--loss", help="standard (the model's own), chunked (Liger's; GPU "
                       "targets), native (litgpt's) or chunked-output (torchtune's)")
RecipeOpt = typer.Option(None, "--recipe", help="peft, litgpt, torchtune, unsloth or axolotl: "
                         "that framework's defaults (torch.compile is not modelled)")
AccumOpt = typer.Option(1, "--grad-accum", help="micro-batches per optimizer step "
                        "(the batch size is the micro-batch)")
ReentrantOpt = typer.Option(False, "--use-reentrant",
                            help="Hugging Face checkpointing with use_reentrant=True")
PackingOpt = typer.Option(False, "--packing", help="several documents per row "
                          "(position_ids restarting per document)")
HfVersionOpt = typer.Option(None, "--transformers-version", help="the causal-LM loss as this "
                            "transformers computes it (4.43: float32 logits and a shifted copy; "
                            "default: the installed one)")
AttnOpt = typer.Option(None, "--attn", help="attention implementation: sdpa (default), eager "
                       "or flash (flash-attention kernels; GPU, fp16/bf16, sm80+)")
JsonOpt = typer.Option(False, "--json", help="print one JSON object")
PlotOpt = typer.Option(None, "--plot", help="write a PNG plot here")
HtmlOpt = typer.Option(None, "--html", help=outputs.HTML_HELP)
SnapshotOutOpt = typer.Option(None, "--export-snapshot", help=outputs.SNAPSHOT_HELP)
DebugOpt = typer.Option(False, "--debug", help="show tracebacks")
WorldOpt = typer.Option(None, "--world-size",
                        help="multi-GPU: GPUs the step is spread over (the batch is per GPU)")
StrategyOpt = typer.Option(None, "--strategy", help="ddp (default), fsdp, fsdp-grad-op, hsdp, "
                           "fsdp1, zero1, zero2, zero3, tp")
OffloadOpt = typer.Option("none", "--offload", help="none, optimizer (ZeRO), params")
TpOpt = typer.Option(1, "--tp", help="tensor-parallel degree (with --strategy tp or fsdp)")
NodesOpt = typer.Option(1, "--nodes", help="machines the GPUs span (HSDP, NCCL, links)")
RankOpt = typer.Option(None, "--rank", help="trace this rank only (default: 0 and the last)")
WrapOpt = typer.Option(None, "--wrap",
                       help="FSDP units: module class names, comma-separated (default: "
                            "every block of a list of repeated blocks)")
NcclOpt = typer.Option(None, "--nccl-memory",
                       help="NCCL's memory per communicator, e.g. 600MiB (default: modelled)")


@contextlib.contextmanager
def _errors(debug: bool, json_head: dict[str, Any] | None = None) -> Iterator[None]:
    """One clear line and an exit code for every error; a traceback only with --debug.
    With ``json_head`` (``--json``), a "nothing fits" answer (exit 3) is still one JSON
    object on stdout: the head's fields and the verdict."""
    try:
        yield
    except typer.Exit:
        raise
    except BatchfitError as exc:
        if json_head is not None and isinstance(exc, DoesNotFitError):
            _emit_json({**json_head, **exc.to_dict()})
        if debug:
            raise
        err.print(f"[red]error:[/red] {exc}", highlight=False, soft_wrap=True)
        raise typer.Exit(exc.exit_code) from None
    except KeyboardInterrupt:  # the library called from a test or a script: same line
        err.print("interrupted", highlight=False)
        raise typer.Exit(130) from None
    except Exception as exc:  # noqa: BLE001 - last resort: still one line
        if debug:
            raise
        line = (str(exc).strip().splitlines() or [""])[0]
        err.print(f"[red]error:[/red] {type(exc).__name__}: {line} (rerun with --debug for details)",
                  highlight=False, soft_wrap=True)
        raise typer.Exit(1) from None




def _stack_settings(stack: str | None, torch_version: str | None, cuda_version: str | None,
                    cudnn_benchmark: bool, inference_mode: bool,
                    alloc_conf: str | None = None) -> dict[str, Any]:
    """TrainConfig fields for the stack options and the ones whose effect the stack decides
    (checked now: a bad version or allocator option is one line)."""
    from batchfit.device.allocator import AllocatorConfig

    # None leaves the choice to the library (the shell's variable, or a --snapshot's
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



@dataclass(frozen=True)
class LlmArgs:
    """The LLM options of ``estimate`` and ``max`` (README, "LLM fine-tuning")."""

    lora: str | None = None
    quant: str | None = None
    loss: str | None = None
    grad_accum: int = 1
    use_reentrant: bool = False
    packing: bool = False
    attn: str | None = None
    transformers_version: str | None = None
    recipe: str | None = None



def _parallel(world_size: int | None, strategy: str | None, offload: str, tp: int,
              nodes: int, rank: int | None, wrap: str | None,
              nccl_memory: str | None) -> tuple[Any, Any]:
    """The multi-GPU layout and NCCL model of the options, or (None, None)."""
    if world_size is None:
        given = [name for name, value in (("--strategy", strategy), ("--tp", tp != 1),
                                          ("--nodes", nodes != 1), ("--rank", rank),
                                          ("--wrap", wrap), ("--nccl-memory", nccl_memory),
                                          ("--offload", offload != "none")) if value]
        if given:
            raise InvalidInputError(f"{given[0]} is a multi-GPU option: add --world-size N")
        return None, None
    from batchfit.sharding import NcclMemory, Parallelism

    units = tuple(w.strip() for w in wrap.split(",") if w.strip()) if wrap else None
    layout = Parallelism(world_size=world_size, strategy=strategy or "ddp", offload=offload,
                         tp=tp, nodes=nodes, rank=rank, wrap=units)
    nccl = NcclMemory(per_communicator_bytes=parse_size(nccl_memory, allow_zero=True)) \
        if nccl_memory is not None else None
    return layout, nccl


def _setup(model: str, input_shape: str | None, seq_len: int | None, mode: str,
           optimizer: str | None, precision: str | None, checkpointing: bool | None,
           channels_last: bool, model_kwargs: list[str] | None,
           llm: LlmArgs | None = None, **settings: Any) -> tuple[Any, Any, Any]:
    from dataclasses import replace

    from batchfit.engine.spec import TrainConfig, parse_optimizer
    from batchfit.models.resolve import parse_model_kwargs, resolve_model

    llm = llm or LlmArgs()
    if llm.grad_accum < 1:
        raise InvalidInputError(f"--grad-accum must be a positive integer, not {llm.grad_accum}")
    config = TrainConfig(
        mode=parse_enum(Mode, mode, "mode"),
        optimizer=parse_optimizer(optimizer) if optimizer else None, recipe=llm.recipe,
        precision=parse_enum(Precision, precision, "precision") if precision else None,
        checkpointing=checkpointing, channels_last=channels_last,
        lora=llm.lora, quant=llm.quant, loss=llm.loss, grad_accum_steps=llm.grad_accum,
        use_reentrant=llm.use_reentrant, transformers_version=llm.transformers_version,
        **settings,
        # flash attention takes packed rows as varlen sequences and builds no mask
        packing=llm.packing and _ATTN.get((llm.attn or "sdpa").strip().lower()) != "flash")
    if config.quant is not None and config.lora is None and config.mode is Mode.TRAIN:
        raise InvalidInputError(
            f"--quant {config.quant.method.value} freezes the quantized base weights, so "
            "nothing would train: add --lora (QLoRA), or use --mode infer")
    if llm.use_reentrant and not config.checkpointing:
        raise InvalidInputError("--use-reentrant applies to checkpointing: add --checkpointing")
    if seq_len is not None and seq_len < 1:
        raise InvalidInputError(f"--seq-len must be a positive integer, not {seq_len}")
    shape = parse_shape(input_shape) if input_shape is not None else None
    kwargs = parse_model_kwargs(model_kwargs or [])
    if llm.attn is not None:
        attn = _ATTN.get(llm.attn.strip().lower())
        if attn is None:
            raise InvalidInputError(f"unknown --attn {llm.attn!r}: use sdpa, eager or flash")
        if "attn_implementation" in kwargs:
            raise InvalidInputError("give --attn or --model-kwargs attn_implementation=..., "
                                    "not both")
        # flash: the SDPA path, with the target's flash kernel required (checked later)
        kwargs["attn_implementation"] = "sdpa" if attn == "flash" else attn
    spec = resolve_model(model, model_kwargs=kwargs, seq_len=seq_len, input_shape=shape,
                         packing=llm.packing)
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
    """The --plot file is checked before any work: a result is never lost to a bad path."""
    if path is not None:
        from batchfit.cli.plot import check_plot_path

        check_plot_path(path)
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
            raise InvalidInputError(f"cannot write --plot {path}: {folder} is not a folder "
                                    "this user can write to; create it or give another path")


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
    mode: str = ModeOpt, optimizer: Optional[str] = OptimOpt, precision: Optional[str] = PrecOpt,
    checkpointing: Optional[bool] = CkptOpt, channels_last: bool = ClOpt,
    overhead: Optional[str] = OverheadOpt, model_kwargs: Optional[list[str]] = KwargsOpt,
    stack: Optional[str] = StackOpt, torch_version: Optional[str] = TorchVerOpt,
    cuda_version: Optional[str] = CudaVerOpt, cudnn_benchmark: bool = CudnnBenchOpt,
    inference_mode: bool = InfModeOpt, alloc_conf: Optional[str] = AllocConfOpt,
    lora: Optional[str] = LoraOpt, quant: Optional[str] = QuantOpt, loss: Optional[str] = LossOpt,
    grad_accum: int = AccumOpt, use_reentrant: bool = ReentrantOpt,
    packing: bool = PackingOpt, attn: Optional[str] = AttnOpt,
    transformers_version: Optional[str] = HfVersionOpt, recipe: Optional[str] = RecipeOpt,
    world_size: Optional[int] = WorldOpt, strategy: Optional[str] = StrategyOpt,
    offload: str = OffloadOpt, tp: int = TpOpt, nodes: int = NodesOpt,
    rank: Optional[int] = RankOpt, wrap: Optional[str] = WrapOpt,
    nccl_memory: Optional[str] = NcclOpt,
    snapshot: Optional[str] = typer.Option(
        None, "--snapshot", help="a CUDA memory snapshot of this step on the GPU "
        "(torch.cuda.memory._dump_snapshot): set the prediction against it, allocation by "
        "allocation"),
    as_json: bool = JsonOpt, plot: Optional[str] = PlotOpt, html: Optional[str] = HtmlOpt,
    export_snapshot: Optional[str] = SnapshotOutOpt, debug: bool = DebugOpt,
) -> None:
    """Predict the peak memory of one step at a batch size (per GPU with --world-size)."""
    with _errors(debug):
        if batch_size < 1:
            raise InvalidInputError(f"--batch-size must be a positive integer, not {batch_size}")
        _check_plot(plot)
        outputs.check_outputs(html, export_snapshot, sharded=world_size is not None)
        real = None
        if snapshot is not None:
            from batchfit.device.snapshot import load_snapshot

            if world_size is not None:
                raise InvalidInputError("--snapshot compares one GPU's step: leave out "
                                        "--world-size")
            real = load_snapshot(snapshot)
        settings = _stack_settings(stack, torch_version, cuda_version, cudnn_benchmark,
                                   inference_mode, alloc_conf)
        if memory is not None and not gpu:
            raise InvalidInputError(
                "estimate --memory goes with --gpu NAME, as that card's memory; an estimate "
                "on --device uses the device as it is (max --memory sets a budget)")
        parallel, nccl = _parallel(world_size, strategy, offload, tp, nodes, rank, wrap,
                                   nccl_memory)
        profile, _ = resolve_target(gpu, device, memory, overhead, need_budget=False)
        if "stack" in settings:
            profile.for_stack(settings["stack"])
        with progress("estimate", f"tracing {model} at batch {batch_size}"):
            llm = LlmArgs(lora, quant, loss, grad_accum, use_reentrant, packing, attn,
                          transformers_version, recipe)
            spec, inputs, config = _setup(model, input_shape, seq_len, mode, optimizer, precision,
                                          checkpointing, channels_last, model_kwargs, llm,
                                          **settings)
            check_attn(llm.attn, config, profile)
            notes, said = chosen(gpu, spec, config)
            if parallel is None:
                from batchfit.answers.estimate import estimate

                est = estimate(spec.factory, inputs, batch_size, config, device=profile,
                               snapshot=real)
            else:
                from batchfit.answers.ranks import estimate_ranks

                est = estimate_ranks(spec.factory, inputs, batch_size, config, device=profile,
                                     parallel=parallel, nccl=nccl)
        print_notes(said, err)
        if plot:
            from batchfit.cli.plot import plot_estimate

            plot_estimate(est, plot)
        data = {"model": model, **notes, **est.to_dict()}
        written = outputs.write_outputs(
            data, est, f"batchfit estimate {model} at batch {batch_size}", html=html,
            snapshot=export_snapshot, summary=outputs.ESTIMATE_SUMMARY)
        if as_json:
            _emit_json(data)
            return
        from batchfit.cli.report import render_estimate

        out.print(render_estimate(est))
        for line in ([f"plot written to {plot}"] if plot else []) + written:
            out.print(line, soft_wrap=True, highlight=False)


@app.command("max")
def max_cmd(
    model: str = ModelArg,
    gpu: Optional[str] = GpuOpt, device: Optional[str] = DeviceOpt,
    memory: Optional[str] = typer.Option(
        None, "--memory", help="memory budget, e.g. 24GiB; with --gpu NAME, that card's memory"),
    input_shape: Optional[str] = InputOpt, seq_len: Optional[int] = SeqOpt,
    mode: str = ModeOpt, optimizer: Optional[str] = OptimOpt, precision: Optional[str] = PrecOpt,
    checkpointing: Optional[bool] = CkptOpt, channels_last: bool = ClOpt,
    margin: float = typer.Option(0.0, "--margin", help="fraction of memory kept free, e.g. 0.05"),
    overhead: Optional[str] = OverheadOpt, model_kwargs: Optional[list[str]] = KwargsOpt,
    max_limit: int = typer.Option(65536, "--max-batch-limit", help="largest batch considered"),
    batch_size: Optional[int] = typer.Option(
        None, "--batch-size", "-b",
        help="token models: fix the batch and find the longest --seq-len that fits"),
    stack: Optional[str] = StackOpt, torch_version: Optional[str] = TorchVerOpt,
    cuda_version: Optional[str] = CudaVerOpt, cudnn_benchmark: bool = CudnnBenchOpt,
    inference_mode: bool = InfModeOpt, alloc_conf: Optional[str] = AllocConfOpt,
    lora: Optional[str] = LoraOpt, quant: Optional[str] = QuantOpt, loss: Optional[str] = LossOpt,
    grad_accum: int = AccumOpt, use_reentrant: bool = ReentrantOpt,
    packing: bool = PackingOpt, attn: Optional[str] = AttnOpt,
    transformers_version: Optional[str] = HfVersionOpt, recipe: Optional[str] = RecipeOpt,
    world_size: Optional[int] = WorldOpt, strategy: Optional[str] = StrategyOpt,
    offload: str = OffloadOpt, tp: int = TpOpt, nodes: int = NodesOpt,
    rank: Optional[int] = RankOpt, wrap: Optional[str] = WrapOpt,
    nccl_memory: Optional[str] = NcclOpt,
    as_json: bool = JsonOpt, plot: Optional[str] = PlotOpt, html: Optional[str] = HtmlOpt,
    export_snapshot: Optional[str] = SnapshotOutOpt, debug: bool = DebugOpt,
) -> None:
    """The largest batch size that fits the GPU (or a memory budget).

    With --batch-size, the longest sequence length that fits at that batch instead. With
    --world-size, the largest per-GPU (micro-)batch that fits every rank.
    """
    with _errors(debug, {"model": model} if as_json else None):
        parallel, nccl = _parallel(world_size, strategy, offload, tp, nodes, rank, wrap,
                                   nccl_memory)
        if parallel is not None and batch_size is not None:
            raise InvalidInputError("--batch-size (longest --seq-len) is single-GPU only: "
                                    "drop it, or drop --world-size")
        if not 0 <= margin < 1:
            raise InvalidInputError(f"--margin {margin} must be a fraction in [0, 1), e.g. 0.05")
        if max_limit < 1:
            raise InvalidInputError("--max-batch-limit must be positive")
        _check_plot(plot)
        outputs.check_outputs(html, export_snapshot, sharded=world_size is not None)
        if batch_size is not None and (html or export_snapshot):
            raise InvalidInputError("--html and --export-snapshot go with the largest batch: "
                                    "drop --batch-size, or estimate at the length found")
        settings = _stack_settings(stack, torch_version, cuda_version, cudnn_benchmark,
                                   inference_mode, alloc_conf)
        profile, memory_bytes = resolve_target(gpu, device, memory, overhead, need_budget=True)
        if "stack" in settings:  # the stack's context must leave room (checked before tracing)
            profile.for_stack(settings["stack"])
        if not profile.is_cuda and memory_bytes is None:
            raise InvalidInputError("--device cpu needs --memory SIZE as the budget")
        with progress("max", f"resolving {model}") as status:
            llm = LlmArgs(lora, quant, loss, grad_accum, use_reentrant, packing, attn,
                          transformers_version, recipe)
            spec, inputs, config = _setup(model, input_shape, seq_len, mode, optimizer, precision,
                                          checkpointing, channels_last, model_kwargs, llm,
                                          **settings)
            check_attn(llm.attn, config, profile)
            notes, said = chosen(gpu, spec, config)
            if not profile.is_cuda and overhead is None:
                status.update(f"measuring the CPU runtime's overhead: one real step of {model}")
                profile = profile.with_overheads(
                    context_bytes=_measure_cpu_overhead(spec, inputs, config))
            if batch_size is not None:
                _max_seq_len({"model": model, **notes}, spec, inputs, config, profile,
                             memory_bytes, margin, batch_size, as_json, status)
                print_notes(said, err)
                return
            from batchfit.answers.maxbatch import max_batch_size

            def on_trace(batch: int) -> None:
                status.update(f"tracing {model} at batch {batch}")

            # LLM fine-tuning: the weights fill most of the card and the answer is small;
            # tracing batches 1 and 2 first makes them the confirming pair of an answer of
            # 1 (one round of traces); when 2 fits, the step is interpolated from 2 and 3
            small = config.lora is not None or config.quant is not None
            result = max_batch_size(spec.factory, inputs, config, device=profile,
                                    memory_bytes=memory_bytes, margin=margin,
                                    max_batch_limit=max_limit, on_trace=on_trace,
                                    fit_batches=(1, 2) if small else None,
                                    parallel=parallel, nccl=nccl)
        print_notes(said, err)
        if plot:
            from batchfit.cli.plot import plot_max_batch

            plot_max_batch(result, plot)
        data = {"model": model, **notes, **result.to_dict()}
        written = outputs.write_outputs(
            data, result.estimate_at_max, f"batchfit max {model} on {result.device.name}",
            html=html, snapshot=export_snapshot, evaluated=result.evaluated,
            budget_bytes=result.budget_bytes, summary=outputs.MAX_SUMMARY)
        if as_json:
            _emit_json(data)
            return
        from batchfit.cli.report import render_max_batch

        out.print(render_max_batch(result, model))
        for line in ([f"plot written to {plot}"] if plot else []) + written:
            out.print(line, soft_wrap=True, highlight=False)


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
    """The model's maximum positions, from its config (HF specs carry it; other models are
    built on meta to read it)."""
    from batchfit.engine.fake import build_on_meta
    from batchfit.models.resolve import _max_positions

    if getattr(spec, "max_positions", None):
        return spec.max_positions
    built = build_on_meta(spec.factory)
    config = getattr(built, "config", None)
    return _max_positions(config) if config is not None else None


def _max_seq_len(head: dict[str, Any], spec: Any, inputs: Any, config: Any, profile: Any,
                 memory_bytes: int | None, margin: float, batch_size: int, as_json: bool,
                 status: Any) -> None:
    from batchfit.answers.maxbatch import max_seq_len

    model = head["model"]
    if batch_size < 1:
        raise InvalidInputError(f"--batch-size must be a positive integer, not {batch_size}")
    if not spec.is_token_model:
        raise InvalidInputError(
            f"{model} takes no token sequence: --batch-size with max solves for --seq-len; "
            "drop --batch-size to find the largest batch")

    def on_trace(length: int) -> None:
        status.update(f"tracing {model} at sequence length {length}")

    limit = _context_length(spec) or 131072
    result = max_seq_len(spec.factory, inputs, batch_size, config, device=profile,
                         memory_bytes=memory_bytes, margin=margin, max_len=limit,
                         on_trace=on_trace)
    if as_json:
        _emit_json({**head, **result.to_dict()})
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
    mode: str = ModeOpt, optimizer: Optional[str] = OptimOpt, precision: Optional[str] = PrecOpt,
    checkpointing: Optional[bool] = CkptOpt, channels_last: bool = ClOpt,
    model_kwargs: Optional[list[str]] = KwargsOpt, inference_mode: bool = InfModeOpt,
    as_json: bool = JsonOpt, debug: bool = DebugOpt,
) -> None:
    """Find the exact largest batch on the real device, starting from the prediction."""
    with _errors(debug, {"model": model} if as_json else None):
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
                                      checkpointing, channels_last, model_kwargs,
                                      inference_mode=inference_mode)
        from batchfit.realrun.search import search_max_batch

        with progress("search", f"predicting {model}'s largest batch (two traces), then "
                      f"trials on {device}") as status:
            def on_trial(trial: Any) -> None:
                status.done(trial_text(trial))

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
    mode: str = ModeOpt, optimizer: Optional[str] = OptimOpt, precision: Optional[str] = PrecOpt,
    checkpointing: Optional[bool] = CkptOpt, channels_last: bool = ClOpt,
    model_kwargs: Optional[list[str]] = KwargsOpt, inference_mode: bool = InfModeOpt,
    stack: Optional[str] = StackOpt, torch_version: Optional[str] = TorchVerOpt,
    cuda_version: Optional[str] = CudaVerOpt, cudnn_benchmark: bool = CudnnBenchOpt,
    alloc_conf: Optional[str] = AllocConfOpt,
    as_json: bool = JsonOpt, plot: Optional[str] = PlotOpt, debug: bool = DebugOpt,
) -> None:
    """Measure (or predict) throughput against batch size and recommend the fastest batch.

    With --predict, the stack options (--stack, --torch-version, --cuda-version,
    --cudnn-benchmark, --alloc-conf) describe the process on the predicted card, as for
    ``max``; a measured bench runs in this process, with its own torch and settings.
    """
    with _errors(debug):
        _check_plot(plot)
        if dataset_size is not None and dataset_size < 1:
            raise InvalidInputError(f"--dataset-size must be a positive integer, not {dataset_size}")
        if predict and not gpu:
            raise InvalidInputError("--predict needs --gpu NAME: the card to predict for")
        if gpu is not None and not predict:
            raise InvalidInputError("--gpu goes with --predict; to measure, use --device cpu|cuda:N")
        _predicted_only(predict, "bench", stack, torch_version, cuda_version, cudnn_benchmark,
                        alloc_conf)
        batch_list = _parse_batches(batches)
        memory_bytes = parse_size(memory) if memory is not None else None
        budget_s = parse_duration(time_budget)
        settings = _stack_settings(stack, torch_version, cuda_version, cudnn_benchmark,
                                   inference_mode, alloc_conf)
        card = _predicted_card(gpu, memory_bytes, settings.get("stack")) if predict else None
        spec, inputs, config = _setup(model, input_shape, seq_len, mode, optimizer, precision,
                                      checkpointing, channels_last, model_kwargs, **settings)
        notes, said = chosen(gpu, spec)
        if predict:
            from batchfit.speed.roofline import predict_throughput

            with progress("bench", f"predicting {model} on {gpu}"):
                result = predict_throughput(spec.factory, inputs, config, gpu=card,
                                            batches=batch_list, dataset_size=dataset_size)
        else:
            from batchfit.speed.bench import bench

            with bench_progress("bench") as (on_measure, on_point):
                result = bench(spec.factory, inputs, config, device=device or "cpu",
                               memory_bytes=memory_bytes, batches=batch_list,
                               dataset_size=dataset_size, alignment=alignment,
                               time_budget_s=budget_s, on_measure=on_measure,
                               on_point=on_point)
            if result.memory_source == "available":
                from batchfit.cli.report import format_bytes

                err.print(f"bench: no --memory: using the {format_bytes(result.memory_bytes)} "
                          "this machine has available now", highlight=False)
        print_notes(said, err)
        if plot:
            from batchfit.cli.plot import plot_throughput

            plot_throughput(result, plot)
        if as_json:
            _emit_json({"model": model, **notes, **result.to_dict()})
            return
        from batchfit.cli.report import render_bench

        out.print(render_bench(result, model))
        if plot:
            out.print(f"plot written to {plot}")


def _predicted_only(predict: bool, command: str, stack: str | None, torch_version: str | None,
                    cuda_version: str | None, cudnn_benchmark: bool,
                    alloc_conf: str | None) -> None:
    """The stack options describe the process on a predicted card: refused on a measurement
    (which runs in this process, with its own torch and settings)."""
    given = [name for name, value in (
        ("--stack", stack), ("--torch-version", torch_version),
        ("--cuda-version", cuda_version), ("--cudnn-benchmark", cudnn_benchmark or None),
        ("--alloc-conf", alloc_conf)) if value is not None]
    if given and not predict:
        raise InvalidInputError(
            f"{given[0]} describes a predicted process: add --predict --gpu NAME (a "
            f"measured {command} runs with this process's torch and settings)")


def _predicted_card(gpu: str, memory_bytes: int | None, stack: Any = None) -> Any:
    """The catalog card ``bench --predict`` runs on; with ``--memory``, its architecture with
    that memory. Checked against the context (the stack's, if given) and workspaces as
    ``max`` checks it: one clear line if the memory cannot hold them."""
    from batchfit.device.catalog import find_gpu
    from batchfit.device.profile import gpu_profile

    card = find_gpu(gpu)
    profile = gpu_profile(card, memory_bytes)
    if stack is not None:
        profile.for_stack(stack)
    return card if memory_bytes is None else card.with_memory(memory_bytes)


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
    # while they import, again and again (0.64 s in 6 walks of a 12 s `max`); _setup()
    # freezes them once they exist and turns it back on (batchfit/_gc.py).
    gc.disable()
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
