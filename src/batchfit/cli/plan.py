"""``batchfit plan``: multi-GPU layouts of a global batch ranked by predicted step time
(registered on the app when imported; the engine is :mod:`batchfit.speed.plan`)."""

from __future__ import annotations

from typing import Any, Optional

import typer

import batchfit.cli.outputs as outputs
from batchfit.cli.common import emit_json, errors, out
from batchfit.cli.options import STACK_OPTIONS, ModelArg, option, takes
from batchfit.cli.progress import progress
from batchfit.cli.root import app


@app.command("plan")
@takes("input_shape", "seq_len", "optimizer", "precision", "model_kwargs", *STACK_OPTIONS)
def plan_cmd(
    model: str = ModelArg,
    gpus: str = typer.Option(..., "--gpus", help='how many GPUs of which card, e.g. 8x"H100 SXM"'),
    global_batch: int = typer.Option(..., "--global-batch", help="samples per optimizer step"),
    nodes: int = typer.Option(1, "--nodes", help="machines the GPUs span"),
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
    html: Optional[str] = option("html"), as_json: bool = option("as_json"),
    debug: bool = option("debug"), words: Any = None,
) -> None:
    """Rank multi-GPU layouts of a global batch by predicted step time, with memory per GPU."""
    with errors(debug):
        outputs.check_outputs(html, None)
        from batchfit.api.answers import plan_words

        with progress("plan", f"resolving {model}") as status:
            answer = plan_words(model, gpus=gpus, global_batch=global_batch, nodes=nodes,
                                strategies=strategies, tp=tp_degrees,
                                checkpointing=checkpointing_policy, offload=offload_policy,
                                network_gbs=network_gbs, on_status=status.update, **words)
        result = answer.result
        data = answer.to_dict()
        written = outputs.write_answer_report(
            "plan", data, f"batchfit plan {model} on {gpus}, global batch {global_batch}", html)
        if as_json:
            emit_json(data)
            return
        from batchfit.cli.report import render_plan

        out.print(render_plan(result, model))
        for line in written:
            out.print(line, soft_wrap=True, highlight=False)

