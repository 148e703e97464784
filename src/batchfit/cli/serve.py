"""``batchfit serve``: serving capacity of a language model on a card (registered on the app
when imported; the engine is :mod:`batchfit.answers.serve`)."""

from __future__ import annotations

from typing import Any, Optional

import typer

import batchfit.cli.outputs as outputs
from batchfit.cli.common import emit_json, errors, out
from batchfit.cli.options import option
from batchfit.cli.progress import progress
from batchfit.cli.root import app
from batchfit.engine.spec import parse_size


@app.command("serve")
def serve_cmd(
    model: str = typer.Argument(..., help="hf:NAME (offline table or a config directory)"),
    gpu: str = typer.Option(..., "--gpu", help="a catalog GPU name (batchfit gpus lists them)"),
    engine: str = typer.Option("vllm", "--engine", help="vllm (KV blocks) or hf (model.generate)"),
    max_model_len: Optional[int] = typer.Option(
        None, "--max-model-len", help="context per request (default: the model's)"),
    utilization: float = typer.Option(0.9, "--gpu-memory-utilization",
                                      help="fraction of the card vLLM may use"),
    dtype: str = typer.Option("auto", "--dtype", help="auto (the checkpoint's), bf16, fp16"),
    kv_dtype: str = typer.Option("auto", "--kv-dtype", help="auto, fp16, bf16 or fp8"),
    block_size: int = typer.Option(16, "--block-size", help="tokens per KV block"),
    batched_tokens: int = typer.Option(8192, "--max-num-batched-tokens",
                                       help="tokens of vLLM's profile forward"),
    max_num_seqs: int = typer.Option(256, "--max-num-seqs", help="requests per batch"),
    non_torch: Optional[str] = typer.Option(
        None, "--non-torch", help="memory outside torch's allocator (default 0.35GiB)"),
    total_memory: Optional[str] = typer.Option(
        None, "--total-memory", help="the card's memory as CUDA reports it (default: catalog)"),
    batch_size: int = typer.Option(1, "--batch-size", "-b", help="--engine hf: sequences"),
    prompt_len: Optional[int] = typer.Option(None, "--prompt-len", help="--engine hf: prompt"),
    new_tokens: int = typer.Option(256, "--new-tokens", help="--engine hf: generated tokens"),
    quant: Optional[str] = typer.Option(None, "--quant", help="--engine hf: bitsandbytes "
                                        "weights (nf4, nf4-dq, fp4, fp4-dq, int8)"),
    all_logits: bool = typer.Option(False, "--all-logits", help="--engine hf: the prefill "
                                    "computes every prompt position's logits "
                                    "(transformers < 4.45)"),
    vllm_engine: str = typer.Option("v1", "--vllm-engine", help="v1, or v0 (vLLM <= 0.6: its "
                                    "profile run samples with top-p/top-k, a sort of the "
                                    "logits)"),
    model_kwargs: Optional[list[str]] = option("model_kwargs"),
    html: Optional[str] = option("html"), as_json: bool = option("as_json"), debug: bool = option("debug"),
) -> None:
    """Serving capacity: KV-cache bytes per token, blocks, tokens and concurrent sequences."""
    head = {"model": model, "gpu": gpu, "engine": engine} if as_json else None
    with errors(debug, json_head=head):
        outputs.check_outputs(html, None)
        from batchfit.answers.serve import serve_capacity
        from batchfit.models.resolve import parse_model_kwargs

        with progress("serve", f"tracing {model}'s profile forward on {gpu}"):
            result = serve_capacity(
                model, device=_serve_gpu(gpu), engine=engine, max_model_len=max_model_len,
                gpu_memory_utilization=utilization, dtype=dtype, kv_dtype=kv_dtype,
                block_size=block_size, max_num_batched_tokens=batched_tokens,
                max_num_seqs=max_num_seqs,
                non_torch_bytes=parse_size(non_torch, allow_zero=True) if non_torch else None,
                total_memory_bytes=parse_size(total_memory) if total_memory else None,
                batch_size=batch_size, prompt_len=prompt_len, new_tokens=new_tokens,
                model_kwargs=parse_model_kwargs(model_kwargs or []), quant=quant,
                all_logits=all_logits, vllm_engine=vllm_engine)
        data = {**result.to_dict(), "fits": True}
        written = outputs.write_answer_report("serve", data, f"batchfit serve {model} on {gpu}",
                                              html)
        if as_json:
            emit_json(data)
            return
        from batchfit.cli.report import render_serve

        out.print(render_serve(result))
        for line in written:
            out.print(line, soft_wrap=True, highlight=False)


def _serve_gpu(name: str) -> Any:
    from batchfit.device.catalog import find_gpu
    from batchfit.device.profile import gpu_profile

    return gpu_profile(find_gpu(name))
