"""``batchfit serve``: serving capacity of a language model on a card (registered on the app
when imported; the engine is :mod:`batchfit.answers.serve`)."""

from __future__ import annotations

from typing import Optional

import typer

import batchfit.cli.outputs as outputs
from batchfit.cli.common import emit_json, errors, out, print_notes
from batchfit.cli.options import option
from batchfit.cli.progress import progress
from batchfit.cli.root import app


@app.command("serve")
def serve_cmd(
    model: str = typer.Argument(..., help="hf:NAME (offline table or a config directory)"),
    gpu: str = typer.Option(..., "--gpu", help="a catalog GPU name (batchfit gpus lists them)"),
    engine: Optional[str] = typer.Option(None, "--engine",
                                         help="vllm (KV blocks; default) or hf (model.generate)"),
    max_model_len: Optional[int] = typer.Option(
        None, "--max-model-len", help="context per request (default: the model's)"),
    utilization: Optional[float] = typer.Option(
        None, "--gpu-memory-utilization", help="fraction of the card vLLM may use (default 0.9)"),
    dtype: Optional[str] = typer.Option(None, "--dtype",
                                        help="auto (the checkpoint's; default), bf16, fp16"),
    kv_dtype: Optional[str] = typer.Option(None, "--kv-dtype",
                                           help="auto (default), fp16, bf16 or fp8"),
    block_size: Optional[int] = typer.Option(None, "--block-size",
                                             help="tokens per KV block (default 16)"),
    batched_tokens: Optional[int] = typer.Option(
        None, "--max-num-batched-tokens", help="tokens of vLLM's profile forward (default 8192)"),
    max_num_seqs: Optional[int] = typer.Option(None, "--max-num-seqs",
                                               help="requests per batch (default 256)"),
    non_torch: Optional[str] = typer.Option(
        None, "--non-torch", help="memory outside torch's allocator (default 0.35GiB)"),
    total_memory: Optional[str] = typer.Option(
        None, "--total-memory", help="the card's memory as CUDA reports it (default: catalog)"),
    batch_size: Optional[int] = typer.Option(None, "--batch-size", "-b",
                                             help="--engine hf: sequences (default 1)"),
    prompt_len: Optional[int] = typer.Option(None, "--prompt-len", help="--engine hf: prompt"),
    new_tokens: Optional[int] = typer.Option(None, "--new-tokens",
                                             help="--engine hf: generated tokens (default 256)"),
    quant: Optional[str] = typer.Option(None, "--quant", help="--engine hf: bitsandbytes "
                                        "weights (nf4, nf4-dq, fp4, fp4-dq, int8; 4-bit: "
                                        ",compute=fp32|bf16|fp16)"),
    all_logits: bool = typer.Option(False, "--all-logits", help="--engine hf: the prefill "
                                    "computes every prompt position's logits "
                                    "(transformers < 4.45)"),
    vllm_engine: Optional[str] = typer.Option(None, "--vllm-engine", help="v1 (default), or v0 "
                                              "(vLLM <= 0.6: its profile run samples with "
                                              "top-p/top-k, a sort of the logits)"),
    model_kwargs: Optional[list[str]] = option("model_kwargs"),
    html: Optional[str] = option("html"), as_json: bool = option("as_json"), debug: bool = option("debug"),
) -> None:
    """Serving capacity: KV-cache bytes per token, blocks, tokens and concurrent sequences."""
    from batchfit.answers.serve import DEFAULT_ENGINE

    head = ({"model": model, "gpu": gpu, "engine": engine or DEFAULT_ENGINE.value}
            if as_json else None)
    with errors(debug, json_head=head):
        outputs.check_outputs(html, None)
        from batchfit.api.serving import serve_words

        given = {"engine": engine, "max_model_len": max_model_len,
                 "gpu_memory_utilization": utilization, "dtype": dtype, "kv_dtype": kv_dtype,
                 "block_size": block_size, "max_num_batched_tokens": batched_tokens,
                 "max_num_seqs": max_num_seqs, "non_torch": non_torch,
                 "total_memory": total_memory, "batch_size": batch_size,
                 "prompt_len": prompt_len, "new_tokens": new_tokens, "quant": quant,
                 "all_logits": all_logits or None, "vllm_engine": vllm_engine}
        with progress("serve", f"tracing {model}'s profile forward on {gpu}"):
            answer = serve_words(model, gpu=gpu, model_kwargs=model_kwargs,
                                 **{k: v for k, v in given.items() if v is not None})
        print_notes(answer.notes)
        data = answer.to_dict()
        written = outputs.write_answer_report("serve", data, f"batchfit serve {model} on {gpu}",
                                              html)
        if as_json:
            emit_json(data)
            return
        from batchfit.cli.report import render_serve

        out.print(render_serve(answer.result))
        for line in written:
            out.print(line, soft_wrap=True, highlight=False)
