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

    def wide():
        # 64 MiB a sample, in two 32 MiB tensors (the input and the ReLU's output, kept for
        # the Linear's backward): glibc maps each on its own, whatever its dynamic mmap
        # threshold, so a capped search's boundary does not move with the heap's layout
        # (which differs from process to process by tens of MiB: realrun/fresh.py)
        return nn.Sequential(nn.ReLU(), nn.Linear(1024, 16)), TensorSpec((8192, 1024))
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
            "wide": f"{folder}/models.py:wide", "keras": f"{keras_file}:cnn"}


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


# -- measured on the real device: search and bench ---------------------------------------

#: What a run measures: wall times, and the process's own bytes (each trial's VmData, which
#: moves by a few pages between processes). The search chooses its next trial, and the
#: headroom of its recommendation, from those bytes, so the trials and the recommended batch
#: can differ by a batch between two runs; the answer (on a model whose boundary the heap's
#: layout cannot move), the prediction it started from and the boundary are determined by
#: the model, the options and the machine.
SEARCH_MEASURED = {"seconds", "overhead_bytes", "trials", "recommended_batch_size"}
#: A bench's timings differ between two runs on a shared machine (the library has no
#: seam for a fake clock), and so do what follows from them: the knee and the best batch,
#: the recommendation and the memory left at it, the epoch time, the stability verdict.
BENCH_TIMED = {"step_s", "step_iqr_s", "step_low_s", "step_high_s", "samples_per_s",
               "repeats", "steps", "seconds", "knee_batch_size", "best_batch_size",
               "best_samples_per_s", "recommended_batch_size", "memory_left_bytes",
               "epoch_s", "elapsed_s", "measure_s", "stability"}


def _determined(data, measured):
    if isinstance(data, dict):
        return {k: _determined(v, measured) for k, v in data.items() if k not in measured}
    if isinstance(data, list):
        return [_determined(item, measured) for item in data]
    return data


@pytest.mark.slow  # real trials in forked processes
def test_search_in_words_answers_what_the_cli_answers(files):
    from_cli, from_library = _both(
        files, ["search", "{wide}", "--device", "cpu", "--memory-cap", "300MiB",
                "--boundary-runs", "1", "--optimizer", "sgd"],
        "search_max_batch", {"device": "cpu", "memory_cap": "300MiB", "boundary_runs": 1,
                             "optimizer": "sgd"})
    assert _determined(from_library, SEARCH_MEASURED) == _determined(from_cli, SEARCH_MEASURED)
    assert from_cli["memory_cap_bytes"] == 300 << 20 and from_cli["model"] == files["wide"]
    for data in (from_cli, from_library):  # both found the same boundary by real trials
        answer = data["max_batch_size"]
        assert {t["fits"] for t in data["trials"] if t["batch_size"] <= answer} == {True}
        assert {t["fits"] for t in data["trials"] if t["batch_size"] > answer} == {False}
        assert data["recommended_batch_size"] <= answer


@pytest.mark.slow  # real steps, timed
def test_measured_bench_in_words_answers_what_the_cli_answers(files):
    from_cli, from_library = _both(
        files, ["bench", "{conv}", "--device", "cpu", "--memory", "1GiB", "--batches", "1,2",
                "--time-budget", "60s", "--dataset-size", "100"],
        "bench", {"device": "cpu", "memory": "1GiB", "batches": "1,2", "time_budget": "60s",
                  "dataset_size": 100})
    assert _determined(from_library, BENCH_TIMED) == _determined(from_cli, BENCH_TIMED)
    assert [(p["batch_size"], p["status"]) for p in from_cli["points"]] == \
        [(1, "measured"), (2, "measured")]
    assert (from_cli["memory_bytes"], from_cli["memory_source"], from_cli["time_budget_s"]) \
        == (1 << 30, "given", 60)


# each check the commands made in the CLI, made by the library: (command line, library
# function and keywords, the flag-worded and the keyword-worded fragment of the message)
MEASURED_CHECKS = [
    (["search", "--steps-per-trial", "1"], "search_max_batch", {"steps_per_trial": 1},
     "--steps-per-trial must be at least 2", "steps_per_trial must be at least 2"),
    (["search", "--boundary-runs", "0"], "search_max_batch", {"boundary_runs": 0},
     "--boundary-runs must be at least 1", "boundary_runs must be at least 1"),
    (["search", "--memory-cap", "100TiB"], "search_max_batch", {"memory_cap": "100TiB"},
     "--memory-cap 100TiB is larger than this machine's memory",
     "memory_cap='100TiB' is larger than this machine's memory"),
    (["search", "--device", "npu"], "search_max_batch", {"device": "npu"},
     "unknown device 'npu'", "unknown device 'npu'"),
    (["bench", "--time-budget", "soon"], "bench", {"time_budget": "soon"},
     "bad --time-budget soon", "bad time_budget='soon'"),
    (["bench", "--dataset-size", "0"], "bench", {"dataset_size": 0},
     "--dataset-size must be a positive integer", "dataset_size must be a positive integer"),
    (["bench", "--batches", "0,4"], "bench", {"batches": "0,4"},
     "bad --batches 0,4", "bad batches='0,4'"),
    (["bench", "--predict"], "bench", {"predict": True},
     "--predict needs --gpu NAME", "predict=True needs gpu='NAME'"),
    (["bench", "--gpu", "T4"], "bench", {"gpu": "T4"},
     "--gpu goes with --predict", "gpu goes with predict=True"),
    (["bench", "--stack", "torch2.4+cu124"], "bench", {"stack": "torch2.4+cu124"},
     "--stack describes a predicted process: add --predict --gpu NAME",
     "stack describes a predicted process: add predict=True gpu='NAME'"),
]


@pytest.mark.parametrize(("argv", "function", "words", "flagged", "keyworded"),
                         MEASURED_CHECKS, ids=[" ".join(c[0]) for c in MEASURED_CHECKS])
def test_measured_checks_name_the_option_in_the_callers_words(files, argv, function, words,
                                                              flagged, keyworded):
    command, *flags = argv
    result = runner.invoke(app, [command, files["wide"], *flags])
    assert result.exit_code == 2, result.output
    assert flagged in " ".join(result.output.split())
    assert result.exception is None or isinstance(result.exception, SystemExit)
    with pytest.raises(batchfit.InvalidInputError) as raised:
        getattr(batchfit, function)(files["wide"], **words)
    assert keyworded in str(raised.value)


@pytest.mark.slow  # real steps, timed
def test_bench_without_memory_says_so_in_a_note(files):
    """No memory= on the CPU: the library chooses the memory available now and says so in
    the answer's notes (before, the CLI alone printed that line); the CLI prints it."""
    answer = batchfit.bench(files["blocks"], device="cpu", batches="1,2", time_budget="30s",
                            mode="infer")
    assert answer.memory_source == "available"
    assert [n for n in answer.notes if n.startswith("bench: no memory: using the ")]
    result = runner.invoke(app, ["bench", files["blocks"], "--batches", "1,2", "--time-budget",
                                 "30s", "--mode", "infer"])
    assert result.exit_code == 0, result.output
    assert "bench: no --memory: using the " in result.stderr


def test_a_spec_string_with_the_engines_keywords_still_reaches_the_engine(monkeypatch, files):
    """batchfit.search_max_batch took a spec string with the engine's keywords before the
    words form existed (``memory_cap_bytes=``, positional inputs): those calls still go to
    :func:`batchfit.realrun.search.search_max_batch`; the command's words go to the words
    form."""
    from batchfit.api import measured
    from batchfit.realrun import search

    seen = []
    monkeypatch.setattr(search, "search_max_batch", lambda *a, **k: seen.append("engine"))
    monkeypatch.setattr(measured, "search_words", lambda *a, **k: seen.append("words"))
    batchfit.search_max_batch(files["wide"], None, device="cpu", memory_cap_bytes=1 << 26)
    batchfit.search_max_batch(files["wide"], device="cpu", memory_cap_bytes=1 << 26)
    batchfit.search_max_batch(files["wide"], device="cpu", memory_cap="64MiB")
    assert seen == ["engine", "engine", "words"]
