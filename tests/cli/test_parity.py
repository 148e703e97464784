"""The library answers what the CLI answers (issue 40): each case is a command line and the
library call a user would write with the same names (flag ``--seq-len`` -> keyword
``seq_len``), and the two must give identical JSON. The library calls are written out by
hand, in the Python user's words, not derived from the command lines."""

from __future__ import annotations

import json
import textwrap

import pytest
from typer.testing import CliRunner

import batchfit
from batchfit.cli import app

runner = CliRunner()

TINY_QWEN = ["num_hidden_layers=1", "hidden_size=64", "intermediate_size=128",
             "num_attention_heads=2", "num_key_value_heads=1", "head_dim=32", "vocab_size=512"]
QWEN_FLAGS = ["hf:Qwen/Qwen3-0.6B", "--seq-len", "32",
              *[item for kv in TINY_QWEN for item in ("--model-kwargs", kv)]]
QWEN_WORDS = {"seq_len": 32, "model_kwargs": TINY_QWEN}

MODELS = textwrap.dedent("""
    from torch import nn
    from batchfit import TensorSpec

    def conv():
        return nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(),
                             nn.Flatten(), nn.Linear(8 * 30 * 30, 10)), TensorSpec((3, 32, 32))

    def blocks():
        layers = [nn.Linear(64, 64) for _ in range(3)] + [nn.Linear(64, 10)]
        return nn.Sequential(*layers), TensorSpec((64,))
""")
# (id, command line, library function, its keywords); "{conv}", "{blocks}" and "{keras}"
# stand for the model files written by the fixture
CASES = [
    ("cnn-estimate-cpu", ["estimate", "{conv}", "-b", "4", "--device", "cpu"],
     "estimate", {"batch_size": 4, "device": "cpu"}),
    ("cnn-estimate-amp", ["estimate", "{conv}", "-b", "8", "--gpu", "T4", "--precision",
                          "amp-fp16", "--channels-last"],
     "estimate", {"batch_size": 8, "gpu": "T4", "precision": "amp-fp16",
                  "channels_last": True}),
    ("cnn-estimate-infer", ["estimate", "{conv}", "-b", "8", "--gpu", "A100 80GB", "--mode",
                            "infer", "--inference-mode"],
     "estimate", {"batch_size": 8, "gpu": "A100 80GB", "mode": "infer",
                  "inference_mode": True}),
    ("cnn-estimate-stack", ["estimate", "{conv}", "-b", "16", "--gpu", "V100 SXM2 16GB",
                            "--stack", "torch1.10+cu113", "--cudnn-benchmark", "--optimizer",
                            "sgd"],
     "estimate", {"batch_size": 16, "gpu": "V100 SXM2 16GB", "stack": "torch1.10+cu113",
                  "cudnn_benchmark": True, "optimizer": "sgd"}),
    ("cnn-estimate-alloc", ["estimate", "{conv}", "-b", "16", "--gpu", "RTX 4090",
                            "--alloc-conf", "expandable_segments:True", "--memory", "12GiB"],
     "estimate", {"batch_size": 16, "gpu": "RTX 4090", "alloc_conf": "expandable_segments:True",
                  "memory": "12GiB"}),
    ("cnn-estimate-zero-grad", ["estimate", "{conv}", "-b", "4", "--gpu", "T4",
                                "--zero-grad", "after-forward"],
     "estimate", {"batch_size": 4, "gpu": "T4", "zero_grad": "after-forward"}),
    ("cnn-max-gpu", ["max", "{conv}", "--gpu", "T4", "--memory", "2GiB", "--margin", "0.1"],
     "max_batch_size", {"gpu": "T4", "memory": "2GiB", "margin": 0.1}),
    ("cnn-max-cpu", ["max", "{conv}", "--device", "cpu", "--memory", "1GiB", "--overhead",
                     "100MiB"],
     "max_batch_size", {"device": "cpu", "memory": "1GiB", "overhead": "100MiB"}),
    ("cnn-max-limit", ["max", "{conv}", "--gpu", "H100 SXM", "--max-batch-limit", "300"],
     "max_batch_size", {"gpu": "H100 SXM", "max_batch_limit": 300}),
    ("torchvision-estimate", ["estimate", "torchvision:resnet18", "-b", "2", "--gpu",
                              "A100 80GB", "--stack", "torch2.4+cu124"],
     "estimate", {"batch_size": 2, "gpu": "A100 80GB", "stack": "torch2.4+cu124"}),
    ("hf-estimate", ["estimate", "hf:gpt2", "--seq-len", "64", "-b", "2", "--gpu", "RTX 4090",
                     "--model-kwargs", "n_layer=2"],
     "estimate", {"batch_size": 2, "seq_len": 64, "gpu": "RTX 4090",
                  "model_kwargs": {"n_layer": 2}}),
    ("lora-estimate", ["estimate", *QWEN_FLAGS, "-b", "2", "--lora", "r=8", "--gpu",
                       "A100 80GB"],
     "estimate", {"batch_size": 2, "lora": "r=8", "gpu": "A100 80GB", **QWEN_WORDS}),
    ("qlora-estimate", ["estimate", *QWEN_FLAGS, "-b", "2", "--lora", "r=8", "--quant", "nf4",
                        "--gpu", "A100 80GB"],
     "estimate", {"batch_size": 2, "lora": "r=8", "quant": "nf4", "gpu": "A100 80GB",
                  **QWEN_WORDS}),
    ("lora-accum-packing", ["estimate", *QWEN_FLAGS, "-b", "2", "--lora", "r=8",
                            "--grad-accum", "2", "--packing", "--gpu", "A100 80GB"],
     "estimate", {"batch_size": 2, "lora": "r=8", "grad_accum": 2, "packing": True,
                  "gpu": "A100 80GB", **QWEN_WORDS}),
    ("lora-flash", ["estimate", *QWEN_FLAGS, "-b", "2", "--lora", "r=8", "--attn", "flash",
                    "--precision", "amp-bf16", "--gpu", "A100 80GB"],
     "estimate", {"batch_size": 2, "lora": "r=8", "attn": "flash", "precision": "amp-bf16",
                  "gpu": "A100 80GB", **QWEN_WORDS}),
    ("lora-reentrant", ["estimate", *QWEN_FLAGS, "-b", "2", "--lora", "r=8",
                        "--checkpointing", "--use-reentrant", "--gpu", "A100 80GB"],
     "estimate", {"batch_size": 2, "lora": "r=8", "checkpointing": True,
                  "use_reentrant": True, "gpu": "A100 80GB", **QWEN_WORDS}),
    ("qlora-max", ["max", *QWEN_FLAGS, "--lora", "r=8", "--quant", "nf4", "--gpu",
                   "RTX 4090", "--memory", "1GiB"],
     "max_batch_size", {"lora": "r=8", "quant": "nf4", "gpu": "RTX 4090", "memory": "1GiB",
                        **QWEN_WORDS}),
    ("lora-max-seq-len", ["max", *QWEN_FLAGS, "-b", "2", "--lora", "r=8", "--gpu", "T4",
                          "--memory", "1GiB"],
     "max_seq_len", {"batch_size": 2, "lora": "r=8", "gpu": "T4", "memory": "1GiB",
                     **QWEN_WORDS}),
    ("sharded-estimate", ["estimate", "{blocks}", "-b", "4", "--gpu", "A100 80GB",
                          "--world-size", "2", "--strategy", "fsdp"],
     "estimate", {"batch_size": 4, "gpu": "A100 80GB", "world_size": 2, "strategy": "fsdp"}),
    ("sharded-nccl", ["estimate", "{blocks}", "-b", "4", "--gpu", "A100 80GB",
                      "--world-size", "2", "--nccl-memory", "100MiB"],
     "estimate", {"batch_size": 4, "gpu": "A100 80GB", "world_size": 2,
                  "nccl_memory": "100MiB"}),
    ("sharded-max", ["max", "{blocks}", "--gpu", "T4", "--memory", "4GiB", "--world-size", "4",
                     "--strategy", "zero2"],
     "max_batch_size", {"gpu": "T4", "memory": "4GiB", "world_size": 4, "strategy": "zero2"}),
    ("keras-estimate", ["estimate", "{keras}", "-b", "4", "--gpu", "T4"],
     "estimate", {"batch_size": 4, "gpu": "T4"}),
    ("keras-max", ["max", "{keras}", "--gpu", "T4", "--memory", "1GiB", "--optimizer",
                   "adam"],
     "max_batch_size", {"gpu": "T4", "memory": "1GiB", "optimizer": "adam"}),
    ("cnn-bench-predict", ["bench", "{conv}", "--predict", "--gpu", "A100 80GB", "--batches",
                           "16,64", "--precision", "amp-bf16", "--dataset-size", "50000"],
     "predict_throughput", {"gpu": "A100 80GB", "batches": [16, 64], "precision": "amp-bf16",
                            "dataset_size": 50000}),
    ("hf-bench-predict", ["bench", "hf:gpt2", "--seq-len", "64", "--model-kwargs", "n_layer=2",
                          "--predict", "--gpu", "RTX 4090", "--memory", "8GiB", "--batches",
                          "2,4", "--stack", "torch2.4+cu124"],
     "predict_throughput", {"gpu": "RTX 4090", "memory": "8GiB", "batches": [2, 4],
                            "seq_len": 64, "model_kwargs": ["n_layer=2"],
                            "stack": "torch2.4+cu124"}),
    # serve: no option given is the library's default (0.9 of the card, 16-token blocks...)
    ("serve-vllm", ["serve", "hf:Qwen/Qwen2.5-0.5B", "--gpu", "L4", "--max-model-len", "2048",
                    "--max-num-batched-tokens", "256", "--model-kwargs", "num_hidden_layers=2"],
     "serve", {"gpu": "L4", "max_model_len": 2048, "max_num_batched_tokens": 256,
               "model_kwargs": {"num_hidden_layers": 2}}),
    ("serve-vllm-sizes", ["serve", "hf:Qwen/Qwen2.5-0.5B", "--gpu", "A100 80GB",
                          "--max-num-batched-tokens", "512", "--max-num-seqs", "16",
                          "--non-torch", "1GiB", "--total-memory", "79GiB", "--kv-dtype", "fp8",
                          "--gpu-memory-utilization", "0.8", "--vllm-engine", "v0",
                          "--block-size", "32", "--model-kwargs", "num_hidden_layers=2"],
     "serve", {"gpu": "A100 80GB", "max_num_batched_tokens": 512, "max_num_seqs": 16,
               "non_torch": "1GiB", "total_memory": "79GiB", "kv_dtype": "fp8",
               "gpu_memory_utilization": 0.8, "vllm_engine": "v0", "block_size": 32,
               "model_kwargs": ["num_hidden_layers=2"]}),
    ("serve-hf-generate", ["serve", "hf:Qwen/Qwen2.5-0.5B", "--gpu", "T4", "--engine", "hf",
                           "-b", "2", "--prompt-len", "32", "--new-tokens", "16", "--dtype",
                           "fp16", "--model-kwargs", "num_hidden_layers=2"],
     "serve", {"gpu": "T4", "engine": "hf", "batch_size": 2, "prompt_len": 32,
               "new_tokens": 16, "dtype": "fp16", "model_kwargs": {"num_hidden_layers": 2}}),
]

SLOW_CASES = [
    # the demo (make demo)
    ("demo", ["max", "timm:resnet50", "--gpu", "RTX 3090", "--precision", "amp-fp16"],
     "max_batch_size", {"gpu": "RTX 3090", "precision": "amp-fp16"}),
]
# issue 40's example: QLoRA of a 1B model on a 24 GB card
ISSUE_40 = (["max", "hf:meta-llama/Llama-3.2-1B", "--gpu", "RTX 4090", "--seq-len", "512",
             "--lora", "r=8", "--quant", "nf4"],
            "max_batch_size", {"gpu": "RTX 4090", "seq_len": 512, "lora": "r=8", "quant": "nf4"})


@pytest.fixture(scope="module")
def files(tmp_path_factory, keras_file):
    folder = tmp_path_factory.mktemp("parity")
    (folder / "models.py").write_text(MODELS)
    return {"conv": f"{folder}/models.py:conv", "blocks": f"{folder}/models.py:blocks",
            "keras": f"{keras_file}:cnn"}


def _both(files, argv, function, words):
    argv = [arg.format(**files) for arg in argv]
    result = runner.invoke(app, [*argv, "--json"])
    assert result.exit_code == 0, result.output
    from_cli = json.loads(result.stdout)
    answer = getattr(batchfit, function)(argv[1], **words)
    from_library = json.loads(json.dumps(answer.to_dict()))
    return from_cli, from_library


def _check(files, argv, function, words):
    from_cli, from_library = _both(files, argv, function, words)
    assert from_library == from_cli
    return from_cli


@pytest.mark.parametrize(("argv", "function", "words"),
                         [case[1:] for case in CASES], ids=[case[0] for case in CASES])
def test_library_answers_what_the_cli_answers(files, argv, function, words):
    _check(files, argv, function, words)


@pytest.mark.slow
@pytest.mark.parametrize(("argv", "function", "words"),
                         [case[1:] for case in SLOW_CASES], ids=[case[0] for case in SLOW_CASES])
def test_library_answers_what_the_cli_answers_slow(files, argv, function, words):
    _check(files, argv, function, words)


@pytest.mark.slow
def test_issue_40_example_is_25_both_ways(files):
    """The number from the issue (the CLI's answer before this change)."""
    data = _check(files, *ISSUE_40)
    assert data["max_batch_size"] == 25


def test_serve_by_hand_is_the_library_default():
    """The serve answer a user gets without options is vLLM's defaults, derived by hand: 90%
    of the card requested, 0.35 GiB outside torch, 16-token blocks, and the result says it
    fits (before, the library's to_dict lacked the CLI's ``fits``)."""
    answer = batchfit.serve("hf:Qwen/Qwen2.5-0.5B", gpu="L4", max_model_len=2048,
                            max_num_batched_tokens=256, model_kwargs={"num_hidden_layers": 2})
    data = answer.to_dict()
    assert data["requested_bytes"] == -(-answer.device.total_memory_bytes * 9 // 10)
    assert data["non_torch_bytes"] == int(0.35 * (1 << 30))
    assert data["block_size"] == 16 and data["fits"] is True
    assert data["engine"] == "vllm" and data["vllm_engine"] == "v1"


def test_zero_grad_after_forward_reaches_the_step(files):
    """Lightning's loop order is a user option (before, only TrainConfig's field said it)."""
    from batchfit.api.step import resolve_step

    assert resolve_step(files["conv"], zero_grad="after-forward").config \
        .zero_grad_after_forward
    assert not resolve_step(files["conv"], zero_grad="first").config.zero_grad_after_forward
    assert not resolve_step(files["conv"]).config.zero_grad_after_forward
    with pytest.raises(batchfit.InvalidInputError, match="use first or after-forward"):
        resolve_step(files["conv"], zero_grad="late")


def test_serve_says_which_card_a_short_name_is():
    """"H100" is three catalog cards (SXM5, PCIe, NVL): the answer names the one taken and the
    note the others, as max and estimate do (before, serve said nothing of its choice)."""
    kwargs = {"max_model_len": 2048, "max_num_batched_tokens": 256,
              "model_kwargs": {"num_hidden_layers": 2}}
    h100 = batchfit.serve("hf:Qwen/Qwen2.5-0.5B", gpu="H100", **kwargs)
    assert h100.to_dict()["gpu_choice"]["name"] == "NVIDIA H100 SXM5 80GB"
    (note,) = h100.notes
    assert "NVIDIA H100 PCIe" in note and "NVIDIA H100 NVL" in note
    t4 = batchfit.serve("hf:Qwen/Qwen2.5-0.5B", gpu="T4", **kwargs)
    assert t4.to_dict()["gpu_choice"]["name"] == "NVIDIA Tesla T4" and t4.notes == ()


def test_serve_names_an_unknown_keyword():
    from batchfit.errors import InvalidInputError

    with pytest.raises(InvalidInputError, match="did you mean max_num_batched_tokens"):
        batchfit.serve("hf:Qwen/Qwen2.5-0.5B", gpu="L4", max_num_batched_token=256)


@pytest.mark.parametrize(("words", "line"), [
    ({"kv_dtype": "int3"}, "unknown kv_dtype 'int3': use auto, fp16, bf16 or fp8"),
    ({"max_model_len": 40000}, "max_model_len=40000 is above hf:Qwen/Qwen2.5-0.5B's context "
                               "of 32768 tokens (max_position_embeddings): use "
                               "max_model_len=32768 or less"),
    ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization=1.5 must be in (0, 1]"),
    ({"block_size": 0}, "block_size must be a positive integer, not 0"),
    ({"engine": "tgi"}, "unknown engine 'tgi': use vllm or hf"),
])
def test_serve_names_keywords_to_a_python_caller(words, line):
    """A Python caller reads its own keywords (before: the command's flags, --kv-dtype...);
    the command line keeps its flags (tests/answers/test_serve.py)."""
    from batchfit.errors import InvalidInputError

    with pytest.raises(InvalidInputError) as info:
        batchfit.serve("hf:Qwen/Qwen2.5-0.5B", gpu="L4", **words)
    assert line in str(info.value) and "--" not in str(info.value)


def test_qlora_defaults_reach_the_library():
    """quant= switches the library's step to amp-bf16 with checkpointing, as --quant did on
    the CLI alone (before, the library ran fp32 without checkpointing)."""
    from batchfit.api.step import resolve_step

    step = resolve_step("hf:Qwen/Qwen3-0.6B", lora="r=8", quant="nf4", **QWEN_WORDS)
    assert step.config.precision.value == "amp-bf16" and step.config.checkpointing


def test_llm_max_probes_batches_one_and_two_first(monkeypatch, files):
    """max with lora= traces batches 1 and 2 first, as the CLI's max did (the library
    probed 16 and 32)."""
    from batchfit.answers import maxbatch

    seen = []
    original = maxbatch.max_batch_size

    def spy(*args, **kwargs):
        seen.append(kwargs.get("fit_batches"))
        return original(*args, **kwargs)

    monkeypatch.setattr(maxbatch, "max_batch_size", spy)
    batchfit.max_batch_size("hf:Qwen/Qwen3-0.6B", lora="r=8", gpu="T4", memory="1GiB",
                            **QWEN_WORDS)
    batchfit.max_batch_size(files["conv"], gpu="T4", memory="1GiB")
    assert seen == [(1, 2), None]


def test_both_measure_the_cpu_overhead_when_it_is_not_given(monkeypatch, files):
    """max on the CPU without --overhead / overhead= measures the runtime's overhead with one
    real step, from the CLI and from the library alike (the CLI alone did before). The real
    measurement varies by a few pages from run to run, so it is replaced by a fixed one
    here: the test checks the decision and what follows from it."""
    from types import SimpleNamespace

    from batchfit.realrun import cpu_overhead

    calls = []

    def measured(spec, inputs, config):
        calls.append(spec.name)
        return SimpleNamespace(overhead_bytes=50 << 20)

    monkeypatch.setattr(cpu_overhead, "measure_cpu_overhead", measured)
    data = _check(files, ["max", "{conv}", "--device", "cpu", "--memory", "1GiB"],
                  "max_batch_size", {"device": "cpu", "memory": "1GiB"})
    assert len(calls) == 2
    assert data["device"]["context_bytes"] == 50 << 20


def test_plan_chooses_the_checkpoint_dtype_in_the_library(files):
    """plan of a Hugging Face model without --precision / precision= trains in its
    checkpoint's 16-bit dtype, decided by the library (the CLI alone decided it before, so
    the library planned in fp32). Qwen3's config.json stores bfloat16; a T4 (compute
    capability 7.5) has no bfloat16, so the step computes in float16 (amp-fp16)."""
    data = _check(files, ["plan", *QWEN_FLAGS, "--gpus", "2xT4", "--global-batch", "4",
                          "--strategies", "ddp", "--checkpointing", "off", "--offload", "none"],
                  "plan", {"gpus": "2xT4", "global_batch": 4, "strategies": ["ddp"],
                           "checkpointing": "off", "offload": "none", **QWEN_WORDS})
    assert (data["precision"], data["precision_source"]) == ("amp-fp16", "checkpoint bfloat16")
    assert [row["strategy"] for row in data["layouts"]] == ["ddp"]
