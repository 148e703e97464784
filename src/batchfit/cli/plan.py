"""``batchfit plan``: multi-GPU layouts of a global batch ranked by predicted step time
(registered on the app when imported; the engine is :mod:`batchfit.speed.plan`)."""

from __future__ import annotations

from typing import Optional

import typer

from batchfit.cli.app import (
    AllocConfOpt,
    CudaVerOpt,
    CudnnBenchOpt,
    DebugOpt,
    InputOpt,
    JsonOpt,
    KwargsOpt,
    ModelArg,
    NodesOpt,
    OptimOpt,
    PrecOpt,
    SeqOpt,
    StackOpt,
    TorchVerOpt,
    _emit_json,
    _errors,
    _setup,
    _stack_settings,
    app,
    out,
)
from batchfit.cli.progress import progress
from batchfit.errors import InvalidInputError


@app.command("plan")
def plan_cmd(
    model: str = ModelArg,
    gpus: str = typer.Option(..., "--gpus", help='how many GPUs of which card, e.g. 8x"H100 SXM"'),
    global_batch: int = typer.Option(..., "--global-batch", help="samples per optimizer step"),
    nodes: int = NodesOpt,
    strategies: Optional[str] = typer.Option(
        None, "--strategies", help="comma-separated strategies to try (default: ddp, fsdp, "
        "fsdp-grad-op, zero1, zero2, zero3, and hsdp on several nodes)"),
    tp_degrees: Optional[str] = typer.Option(
        None, "--tp", help="tensor-parallel degrees to try with FSDP, e.g. 2,4"),
    checkpointing_policy: str = typer.Option(
        "auto", "--checkpointing", help="off, on, or auto (only where nothing fits without)"),
    offload_policy: str = typer.Option(
        "auto", "--offload", help="none, or auto (only where nothing fits without)"),
    network_gbs: Optional[float] = typer.Option(
        None, "--network-gbs", help="network between nodes per GPU, GB/s each way (default 50)"),
    input_shape: Optional[str] = InputOpt, seq_len: Optional[int] = SeqOpt,
    optimizer: Optional[str] = OptimOpt, precision: Optional[str] = PrecOpt,
    model_kwargs: Optional[list[str]] = KwargsOpt,
    stack: Optional[str] = StackOpt, torch_version: Optional[str] = TorchVerOpt,
    cuda_version: Optional[str] = CudaVerOpt, cudnn_benchmark: bool = CudnnBenchOpt,
    alloc_conf: Optional[str] = AllocConfOpt,
    as_json: bool = JsonOpt, debug: bool = DebugOpt,
) -> None:
    """Rank multi-GPU layouts of a global batch by predicted step time, with memory per GPU."""
    with _errors(debug):
        settings = _stack_settings(stack, torch_version, cuda_version, cudnn_benchmark,
                                   False, alloc_conf)
        with progress("plan", f"resolving {model}") as status:
            spec, inputs, config = _setup(model, input_shape, seq_len, "train", optimizer,
                                          precision, False, False, model_kwargs, **settings)
            from batchfit.models.resolve import checkpoint_dtype
            from batchfit.speed.plan import plan

            def on_layout(label: str) -> None:
                status.update(f"{model}: {label}")

            result = plan(spec.factory, inputs, config, gpus=gpus, global_batch=global_batch,
                          nodes=nodes,
                          strategies=[s.strip() for s in strategies.split(",") if s.strip()]
                          if strategies else None,
                          tp_degrees=_int_list(tp_degrees, "--tp"),
                          checkpointing=checkpointing_policy.strip().lower(),
                          offload=offload_policy.strip().lower(),
                          network_bytes_per_s=network_gbs * 1e9 if network_gbs else None,
                          precision=precision,
                          checkpoint_dtype=checkpoint_dtype(model)
                          if model.strip().startswith("hf:") else None,
                          on_layout=on_layout)
        if as_json:
            _emit_json({"model": model, **result.to_dict()})
            return
        from batchfit.cli.report import render_plan

        out.print(render_plan(result, model))


def _int_list(text: str | None, option: str) -> list[int]:
    if not text:
        return []
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values):
        raise InvalidInputError(f"bad {option} {text!r}: give positive integers, e.g. 2,4")
    return values
