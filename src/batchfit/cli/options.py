"""The command line's options, each declared once: its flag, its help and its help panel,
keyed by the keyword the library takes (:mod:`batchfit.api`). Commands take a group of
them with :func:`takes`, and :data:`FLAGS` (keyword -> flag) is how library messages name
an option on the command line (:func:`batchfit.errors.option`).

Help texts stay short (they read at 80 columns); the full story of each option is in
``docs/guides/python-api.md`` and the README.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, Optional

import typer

import batchfit.cli.outputs as outputs

MODEL, STEP, TARGET, LLM, MULTI, OUTPUT = (
    "Model", "Step", "Device and stack", "LLM fine-tuning", "Multi-GPU", "Output")

ModelArg = typer.Argument(..., help="timm:NAME, torchvision:NAME, hf:NAME or file.py:factory",
                          show_default=False)


def _opt(default: Any, flag: str, text: str, panel: str, **extra: Any) -> Any:
    return typer.Option(default, flag, help=text, rich_help_panel=panel,
                        show_default=False, **extra)


#: keyword -> (annotation, typer option). The keyword is the library's name of the option.
OPTIONS: dict[str, tuple[Any, Any]] = {
    # what runs
    "model_kwargs": (Optional[list[str]], _opt(None, "--model-kwargs", "key=value for the "
                                               "model builder (repeatable)", MODEL)),
    "input_shape": (Optional[str], _opt(None, "--input", "per-sample shape, e.g. 3x224x224",
                                        MODEL)),
    "seq_len": (Optional[int], _opt(None, "--seq-len", "sequence length (token models)",
                                    MODEL)),
    "mode": (str, _opt("train", "--mode", "train (default) or infer", STEP)),
    "optimizer": (Optional[str], _opt(None, "--optimizer", "adamw (default), sgd, adam, lion, "
                                      "adafactor, adamw8bit... (python-api guide)", STEP)),
    "precision": (Optional[str], _opt(None, "--precision", "fp32 (default; a --recipe's, "
                                      "or amp-bf16 with --quant), tf32, amp-fp16, amp-bf16, "
                                      "bf16, fp16", STEP)),
    "checkpointing": (Optional[bool], _opt(None, "--checkpointing/--no-checkpointing",
                                           "activation checkpointing", STEP)),
    "channels_last": (bool, _opt(False, "--channels-last", "channels-last memory format",
                                 STEP)),
    "inference_mode": (bool, _opt(False, "--inference-mode", "infer under inference_mode, not "
                                  "no_grad", STEP)),
    "zero_grad": (Optional[str], _opt(None, "--zero-grad", "first (default) or "
                                      "after-forward (Lightning's Trainer)", STEP)),
    # where it runs
    "gpu": (Optional[str], _opt(None, "--gpu", "a catalog GPU (batchfit gpus) or auto",
                                TARGET)),
    "device": (Optional[str], _opt(None, "--device", "cpu, or cuda:N (a live GPU)", TARGET)),
    "overhead": (Optional[str], _opt(None, "--overhead", "memory outside tensors, e.g. "
                                     "600MiB", TARGET)),
    "stack": (Optional[str], _opt(None, "--stack", "torch and CUDA, e.g. torch2.4+cu124 "
                                  "(default: installed)", TARGET)),
    "torch_version": (Optional[str], _opt(None, "--torch-version", "torch version, e.g. 2.4",
                                          TARGET)),
    "cuda_version": (Optional[str], _opt(None, "--cuda-version", "its CUDA version, e.g. "
                                         "12.4", TARGET)),
    "cudnn_benchmark": (bool, _opt(False, "--cudnn-benchmark", "the script sets "
                                   "cudnn.benchmark = True", TARGET)),
    "alloc_conf": (Optional[str], _opt(None, "--alloc-conf", "PYTORCH_CUDA_ALLOC_CONF of "
                                       "the run", TARGET, metavar="OPTIONS")),
    # LLM fine-tuning
    "lora": (Optional[str], _opt(None, "--lora", "peft LoRA, e.g. r=16,alpha=32,dtype=bf16",
                                 LLM)),
    "recipe": (Optional[str], _opt(None, "--recipe", "peft, litgpt, torchtune, unsloth, "
                                   "axolotl: its defaults", LLM)),
    "quant": (Optional[str], _opt(None, "--quant", "bitsandbytes base: nf4, nf4-dq, fp4, "
                                  "fp4-dq, int8 (4-bit: ,compute=fp32|bf16|fp16)", LLM)),
    "loss": (Optional[str], _opt(None, "--loss", "standard, chunked (Liger), native "
                                 "(litgpt), chunked-output (torchtune)", LLM)),
    "grad_accum": (int, _opt(1, "--grad-accum", "micro-batches per optimizer step", LLM)),
    "use_reentrant": (Optional[bool], _opt(None, "--use-reentrant/--no-use-reentrant",
                                           "Hugging Face checkpointing's variant (the "
                                           "recipe's, peft's or transformers')", STEP)),
    "packing": (bool, _opt(False, "--packing", "several documents per row", LLM)),
    "attn": (Optional[str], _opt(None, "--attn", "sdpa (default), eager or flash", LLM)),
    "transformers_version": (Optional[str], _opt(None, "--transformers-version",
                                                 "its causal-LM loss, e.g. 4.43", LLM)),
    "bitsandbytes_version": (Optional[str], _opt(None, "--bitsandbytes-version",
                                                 "its 4-bit matmul, e.g. 0.41.1", LLM)),
    "torchtune_version": (Optional[str], _opt(None, "--torchtune-version",
                                              "its QLoRA model build, e.g. 0.1", LLM)),
    # multi-GPU
    "world_size": (Optional[int], _opt(None, "--world-size", "GPUs (the batch is per GPU)",
                                       MULTI)),
    "strategy": (Optional[str], _opt(None, "--strategy", "ddp (default), fsdp, fsdp-grad-op, "
                                     "hsdp, fsdp1, zero1-3, tp", MULTI)),
    "offload": (str, _opt("none", "--offload", "none, optimizer or params", MULTI)),
    "tp": (int, _opt(1, "--tp", "tensor-parallel degree", MULTI)),
    "nodes": (int, _opt(1, "--nodes", "machines the GPUs span", MULTI)),
    "rank": (Optional[int], _opt(None, "--rank", "trace this rank only", MULTI)),
    "wrap": (Optional[str], _opt(None, "--wrap", "FSDP unit classes, comma-separated",
                                 MULTI)),
    "nccl_memory": (Optional[str], _opt(None, "--nccl-memory", "NCCL memory per "
                                        "communicator", MULTI)),
    # output
    "as_json": (bool, _opt(False, "--json", "print one JSON object", OUTPUT)),
    "plot": (Optional[str], _opt(None, "--plot", "write a PNG plot here", OUTPUT)),
    "html": (Optional[str], _opt(None, "--html", outputs.HTML_HELP, OUTPUT)),
    "export_snapshot": (Optional[str], _opt(None, "--export-snapshot",
                                            "write the step as a CUDA memory snapshot",
                                            OUTPUT)),
    "debug": (bool, _opt(False, "--debug", "show tracebacks", OUTPUT)),
}

#: The groups commands take (the library's keyword groups, batchfit.api.answers).
STEP_OPTIONS = ("model_kwargs", "input_shape", "seq_len", "mode", "optimizer", "precision",
                "checkpointing", "channels_last", "inference_mode", "zero_grad")
STACK_OPTIONS = ("stack", "torch_version", "cuda_version", "cudnn_benchmark", "alloc_conf")
LLM_OPTIONS = ("lora", "recipe", "quant", "loss", "grad_accum", "use_reentrant", "packing", "attn",
               "transformers_version", "bitsandbytes_version", "torchtune_version")
MULTI_OPTIONS = ("world_size", "strategy", "offload", "tp", "nodes", "rank", "wrap",
                 "nccl_memory")

#: Options a command declares itself (their meaning differs by command), by keyword.
OWN_FLAGS = {"batch_size": "--batch-size", "memory": "--memory", "margin": "--margin",
             "max_batch_limit": "--max-batch-limit", "snapshot": "--snapshot",
             "dataset_size": "--dataset-size", "batches": "--batches", "gpus": "--gpus",
             "global_batch": "--global-batch", "strategies": "--strategies",
             "network_gbs": "--network-gbs", "predict": "--predict",
             "time_budget": "--time-budget", "alignment": "--alignment",
             "memory_cap": "--memory-cap", "steps_per_trial": "--steps-per-trial",
             "boundary_runs": "--boundary-runs", "train": "--train",
             "noise_scale": "--noise-scale", "current_batch": "--current-batch",
             **{keyword: "--" + keyword.replace("_", "-") for keyword in (  # serve's own
                 "engine", "max_model_len", "gpu_memory_utilization", "dtype", "kv_dtype",
                 "block_size", "max_num_batched_tokens", "max_num_seqs", "non_torch",
                 "total_memory", "prompt_len", "new_tokens", "vllm_engine")}}

#: keyword -> flag: how a library message names an option on the command line.
#: A switch's "off" flag sits under ``"keyword=False"`` (``--no-checkpointing``).
FLAGS = {**{keyword: info.param_decls[0].split("/")[0]
            for keyword, (_, info) in OPTIONS.items()}, **OWN_FLAGS,
         **{f"{keyword}=False": info.param_decls[0].split("/")[1]
            for keyword, (_, info) in OPTIONS.items() if "/" in info.param_decls[0]}}


def takes(*keywords: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Add the options ``keywords`` to a command: typer sees them as parameters; the command
    gets them as one dict, ``words`` (keyword -> value), ready for the library."""

    def decorate(command: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(command, eval_str=True)
        own = [p for p in signature.parameters.values() if p.name != "words"]
        added = [inspect.Parameter(keyword, inspect.Parameter.KEYWORD_ONLY,
                                   default=OPTIONS[keyword][1], annotation=OPTIONS[keyword][0])
                 for keyword in keywords]

        @functools.wraps(command)
        def run(**values: Any) -> Any:
            words = {keyword: values.pop(keyword) for keyword in keywords}
            return command(**values, words=words)

        # the model argument, then the shared options, then the command's own (its outputs
        # last): typer orders the help panels by their first option
        ordered = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY)
                   for p in own[:1] + added + own[1:]]
        run.__signature__ = signature.replace(parameters=ordered)  # type: ignore[attr-defined]
        run.__annotations__ = {**{p.name: p.annotation for p in own},
                               **{p.name: p.annotation for p in added}}
        return run

    return decorate


def option(keyword: str) -> Any:
    """The declared typer option of ``keyword`` (for a command's own parameter list)."""
    return OPTIONS[keyword][1]
