"""The CLI contract: JSON keys, exit codes, and one clear line for each bad input."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap

import pytest
from typer.testing import CliRunner

from batchfit.cli import app

runner = CliRunner()
MIB = 1 << 20


@pytest.fixture()
def factory_file(tmp_path):
    path = tmp_path / "mlp.py"
    path.write_text(textwrap.dedent("""
        import torch
        from torch import nn
        from batchfit import TensorSpec

        def mlp(width: int = 256):
            return nn.Sequential(nn.Linear(128, width), nn.ReLU(), nn.Linear(width, 10))

        def with_spec():
            return mlp(), TensorSpec((128,))

        def heavy():
            # batch 1 allocates 32 MiB activations per layer: a 1 KiB cap cannot hold them
            return nn.Sequential(nn.Linear(4096, 4096), nn.ReLU()), TensorSpec((2048, 4096))

        def broken():
            raise RuntimeError("cannot build this")
    """))
    return path


def invoke(*args: str):
    return runner.invoke(app, list(args))


def test_estimate_json_contract(factory_file):
    result = invoke("estimate", f"{factory_file}:mlp", "--batch-size", "32", "--input", "128",
                    "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    for key in ("batch_size", "peak_allocated_bytes", "peak_reserved_bytes", "total_bytes",
                "by_category", "top_modules", "peak_phase", "loop_steps"):
        assert key in data
    assert data["batch_size"] == 32
    assert data["loop_steps"] == 1  # the CPU replay is not looped
    # params (128*256+256 + 256*10+10)*4 = 142,376 bytes
    assert data["by_category"]["parameters"] == 142_376


def test_estimate_on_a_gpu_says_how_many_steps_its_loop_ran(factory_file):
    # A CUDA step is replayed until the allocator repeats a state; the second step is the
    # first whose state can repeat the first's, so the loop runs at least two.
    result = invoke("estimate", f"{factory_file}:mlp", "--batch-size", "32", "--input", "128",
                    "--gpu", "A100", "--json")
    assert result.exit_code == 0, result.output
    steps = json.loads(result.stdout)["loop_steps"]
    assert 2 <= steps <= 8
    result = invoke("estimate", f"{factory_file}:mlp", "--batch-size", "32", "--input", "128",
                    "--gpu", "A100")
    assert f"replayed as a loop: {steps} steps" in " ".join(result.stdout.split())


def test_estimate_human_output_explains(factory_file):
    result = invoke("estimate", f"{factory_file}:with_spec", "-b", "8")
    assert result.exit_code == 0, result.output
    assert "Where the memory goes" in result.stdout
    assert "dominate" in result.stdout


def test_max_json_contract_and_exactness(factory_file):
    result = invoke("max", f"{factory_file}:with_spec", "--device", "cpu", "--memory", "8MiB",
                    "--overhead", "0", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    for key in ("max_batch_size", "budget_bytes", "total_bytes_at_max", "total_bytes_at_next",
                "device", "traces", "by_category", "binding_constraint"):
        assert key in data
    assert data["budget_bytes"] == 8 * MIB
    assert data["total_bytes_at_max"] <= 8 * MIB < data["total_bytes_at_next"]


def test_max_with_batch_size_finds_the_longest_sequence():
    result = invoke("max", "hf:gpt2", "--model-kwargs", "n_layer=1", "--device", "cpu",
                    "--memory", "1GiB", "--overhead", "0", "-b", "2", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["batch_size"] == 2
    assert 0 < data["max_seq_len"] <= 1024  # GPT-2's learned positions end at 1024
    assert data["total_bytes_at_max"] <= data["budget_bytes"]


@pytest.mark.slow
def test_bench_json_contract(factory_file):
    result = invoke("bench", f"{factory_file}:with_spec", "--device", "cpu", "--memory", "64MiB",
                    "--batches", "4,16", "--dataset-size", "1000", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert [p["batch_size"] for p in data["points"]] == [4, 16]
    for key in ("knee_batch_size", "best_batch_size", "recommended_batch_size", "device"):
        assert key in data
    for point in data["points"]:
        assert point["samples_per_s"] == pytest.approx(point["batch_size"] / point["step_s"])


def test_bench_above_the_maximum_is_refused(factory_file):
    result = invoke("bench", f"{factory_file}:with_spec", "--device", "cpu", "--memory", "4MiB",
                    "--batches", "1000000", "--json")
    assert result.exit_code == 2
    assert "above the largest that fits" in result.output


def test_bench_predict_needs_no_device(factory_file):
    result = invoke("bench", f"{factory_file}:with_spec", "--gpu", "A100", "--predict", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["predicted"] is True and data["recommended_batch_size"] >= 1


@pytest.mark.slow
def test_search_json_contract(factory_file):
    # one run per batch: the boundary's exec'd runs (tests/realrun/test_search.py) would
    # cost minutes at this answer (thousands of samples, a heap lottery over many of them)
    result = invoke("search", f"{factory_file}:with_spec", "--device", "cpu", "--memory-cap",
                    "48MiB", "--boundary-runs", "1", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    for key in ("max_batch_size", "recommended_batch_size", "predicted_max_batch_size"):
        assert key in data
    trials = data["trials"]
    assert {"batch_size", "fits", "peak_bytes", "seconds"} <= set(trials[0])
    fitting = [t["batch_size"] for t in trials if t["fits"]]
    failing = [t["batch_size"] for t in trials if not t["fits"]]
    # the answer ran, the batch above it did not
    assert data["max_batch_size"] in fitting and data["max_batch_size"] + 1 in failing
    # issue 35 item 10: stderr is not a terminal here, so one plain progress line per trial
    # (and, when it runs past START_DELAY_S, one for the prediction before them), while
    # stdout stays pure JSON
    lines = progress_lines(result.stderr, "search")
    trial_lines = [line for line in lines if re.search(r": batch \d+ ", line)]
    others = [line for line in lines if line not in trial_lines]
    assert len(others) <= 1 and all("predicting" in line for line in others)
    assert [int(re.search(r": batch (\d+) ", line)[1]) for line in trial_lines] == \
        [t["batch_size"] for t in trials]


@pytest.mark.slow
def test_search_exit_3_when_nothing_fits(factory_file):
    result = invoke("search", f"{factory_file}:heavy", "--device", "cpu", "--memory-cap",
                    "1KiB")
    assert result.exit_code == 3, result.output


def test_gpus_json():
    result = invoke("gpus", "--json")
    assert result.exit_code == 0
    names = {g["name"] for g in json.loads(result.stdout)["gpus"]}
    assert len(names) >= 30


def test_gpus_lists_the_new_cards():
    result = invoke("gpus", "--json")
    cards = {g["name"]: g for g in json.loads(result.stdout)["gpus"]}
    for name in ("NVIDIA RTX PRO 6000 Blackwell Max-Q Workstation Edition",
                 "NVIDIA RTX PRO 6000 Blackwell Server Edition", "NVIDIA GeForce RTX 5070 Ti",
                 "NVIDIA H20", "NVIDIA B300", "AMD Instinct MI355X", "NVIDIA Jetson AGX Orin 64GB"):
        assert name in cards, name
    assert cards["NVIDIA Jetson AGX Orin 64GB"]["unified_memory"] is True
    table = invoke("gpus")
    assert table.exit_code == 0 and "MI355X" in table.stdout and "Orin" in table.stdout


def test_gpu_with_memory_keeps_the_card_and_takes_the_memory_as_given(factory_file):
    """`--gpu NAME --memory SIZE`: the Max-Q's architecture with SIZE as its whole memory.

    SIZE here is nvidia-smi's 97,887 MiB total, which counts what the driver keeps; the
    catalog's own figure for this card is CUDA's smaller total. Given explicitly, it is
    taken as it is."""
    result = invoke("max", f"{factory_file}:with_spec", "--gpu", "RTX PRO 6000 Blackwell Max-Q",
                    "--memory", "97887MiB", "--max-batch-limit", "1024", "--json")
    assert result.exit_code == 0, result.output
    device = json.loads(result.stdout)["device"]
    assert device["name"] == "NVIDIA RTX PRO 6000 Blackwell Max-Q Workstation Edition"
    assert (device["compute_capability"], device["sm_count"]) == ([12, 0], 188)
    assert device["total_memory_bytes"] == 97_887 * MIB


def test_a_unified_memory_card_says_what_its_answer_assumes(factory_file):
    result = invoke("max", f"{factory_file}:with_spec", "--gpu", "AGX Orin",
                    "--max-batch-limit", "1024")
    assert result.exit_code == 0, result.output
    text = " ".join(result.stdout.split())
    assert "shares its 64.0 GiB with the CPU and the OS" in text and "MemAvailable" in text


def test_a_card_without_a_cuda_total_says_its_marketed_memory_stands_in(factory_file):
    # The H800's CUDA total has no public report: its marketed 80 GiB stands in, and
    # estimate, max and plan each say so (a card with a report, and a card whose memory
    # is given, do not)
    said = "the catalog has no public report of what CUDA reports as its total"
    for command in (["estimate", f"{factory_file}:with_spec", "--batch-size", "8"],
                    ["max", f"{factory_file}:with_spec", "--max-batch-limit", "64"],
                    ["plan", f"{factory_file}:with_spec", "--global-batch", "8",
                     "--strategies", "ddp", "--checkpointing", "off", "--offload", "none"]):
        where = ["--gpus", "2xH800"] if command[0] == "plan" else ["--gpu", "H800"]
        text = " ".join(invoke(*command, *where).stdout.split())
        assert f"warning: NVIDIA H800 SXM5 80GB: {said}" in text and "80.00 GiB" in text, text
        data = json.loads(invoke(*command, *where, "--json").stdout)
        assert any(said in warning for warning in data["warnings"]), data
        other = ["--gpus", "2xH100 SXM"] if command[0] == "plan" else ["--gpu", "H100 SXM"]
        assert said not in " ".join(invoke(*command, *other).stdout.split())
        if command[0] != "plan":
            given = invoke(*command, "--gpu", "H800", "--memory", "79GiB")
            assert given.exit_code == 0 and said not in " ".join(given.stdout.split())


def test_max_on_a_named_gpu(factory_file):
    result = invoke("max", f"{factory_file}:with_spec", "--gpu", "T4", "--json",
                    "--max-batch-limit", "4096")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["max_batch_size"] == 4096 and data["binding_constraint"] == "max_batch_limit"


GIB = 1 << 30


def test_gpu_with_memory_is_that_card_with_that_memory(factory_file):
    """--gpu NAME --memory SIZE: the card's architecture, SIZE as its memory."""
    result = invoke("max", f"{factory_file}:with_spec", "--gpu", "RTX 5090", "--memory", "2GiB",
                    "--max-batch-limit", "10000000", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    device = data["device"]
    # From the card (RTX Blackwell whitepaper: sm_120, 170 SMs; cuBLAS + cuBLASLt keep
    # 32 MiB each from sm90 on) ...
    assert device["compute_capability"] == [12, 0] and device["sm_count"] == 170
    assert device["name"] == "NVIDIA GeForce RTX 5090"
    assert device["workspace_bytes"] == 2 * 32 * MIB
    # ... and the memory from the flag, in the device and in the budget.
    assert device["total_memory_bytes"] == data["memory_bytes"] == 2 * GIB
    assert data["budget_bytes"] == 2 * GIB - 512 * MIB - 64 * MIB
    assert data["binding_constraint"] == "memory"
    assert data["total_bytes_at_max"] <= 2 * GIB < data["total_bytes_at_next"]


def test_gpu_with_its_own_memory_answers_as_the_catalog_card(factory_file):
    # a card the catalog has no CUDA total for, so its marketed memory is its memory
    args = ("max", f"{factory_file}:with_spec", "--gpu", "H800", "--max-batch-limit", "10000000",
            "--json")
    plain = json.loads(invoke(*args).stdout)
    given = json.loads(invoke(*args, "--memory", "80GiB").stdout)  # H800: 80 GB, read as GiB
    # the same answer; only the plain one warns that the marketed memory stands in
    assert [w.split(":")[0] for w in plain.pop("warnings")] == ["NVIDIA H800 SXM5 80GB"]
    assert given.pop("warnings") == []
    assert given == plain


def test_gpu_with_memory_and_overhead(factory_file):
    result = invoke("max", f"{factory_file}:with_spec", "--gpu", "RTX 5090", "--memory",
                    "256MiB", "--overhead", "100MiB", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["device"]["context_bytes"] == 100 * MIB
    assert data["budget_bytes"] == (256 - 100 - 64) * MIB


def test_estimate_on_a_gpu_with_memory(factory_file):
    result = invoke("estimate", f"{factory_file}:with_spec", "-b", "8", "--gpu", "A100",
                    "--memory", "40GiB", "--json")
    assert result.exit_code == 0, result.output
    device = json.loads(result.stdout)["device"]
    assert device["compute_capability"] == [8, 0] and device["sm_count"] == 108
    assert device["total_memory_bytes"] == 40 * GIB


def _snapshot_of_heavy_at_2(path, extra_bytes: int) -> None:
    """A hand-written snapshot of ``heavy`` at batch 2 in inference: the Linear's and the
    ReLU's outputs (2 x 2048 x 4096 fp32 = 64 MiB each), plus one allocation of
    ``extra_bytes`` that the model does not make, each in its own new segment. Before the
    window the weight (64 MiB) and the input (64 MiB) are live."""
    import pickle

    out = 2 * 2048 * 4096 * 4
    sizes = [out, out, extra_bytes]
    trace = []
    for addr, size in enumerate(sizes, 1):
        trace += [{"action": "segment_alloc", "addr": addr, "size": size},
                  {"action": "alloc", "addr": addr, "size": size, "frames": [
                      {"filename": "/home/me/heavy.py", "line": 10 + addr, "name": "forward"}]}]
    trace += [{"action": "free_completed", "addr": addr, "size": size}
              for addr, size in enumerate(sizes, 1)]
    live = [{"device": 0, "total_size": 64 * MIB, "blocks": [
        {"size": 64 * MIB, "requested_size": 64 * MIB, "state": "active_allocated"}]}] * 2
    cached = [{"device": 0, "total_size": size, "blocks": [
        {"size": size, "requested_size": 0, "state": "inactive"}]} for size in sizes]
    path.write_bytes(pickle.dumps({"segments": live + cached, "device_traces": [trace]}))


def test_estimate_against_a_real_snapshot_names_the_allocation_it_misses(factory_file, tmp_path):
    snap = tmp_path / "heavy.pickle"
    _snapshot_of_heavy_at_2(snap, 48 * MIB)
    result = invoke("estimate", f"{factory_file}:heavy", "-b", "2", "--gpu", "RTX 4090",
                    "--mode", "infer", "--snapshot", str(snap), "--json")
    assert result.exit_code == 0, result.output
    cmp = json.loads(result.stdout)["snapshot_comparison"]
    # the two 64 MiB outputs are predicted; the 48 MiB is not
    assert (cmp["real_allocations"], cmp["predicted_allocations"]) == (3, 2)
    assert [(d["size_bytes"], d["real_count"], d["predicted_count"])
            for d in cmp["differences"]] == [(48 * MIB, 1, 0)]
    assert cmp["differences"][0]["real_label"] == "heavy.py:13 forward"
    assert cmp["first_divergence"] == 2
    # weight + input before the window, then 64 + 64 + 48 MiB live at once
    assert cmp["real_peak_allocated_bytes"] == (128 + 176) * MIB
    assert cmp["real_peak_reserved_bytes"] == (128 + 176) * MIB
    human = invoke("estimate", f"{factory_file}:heavy", "-b", "2", "--gpu", "RTX 4090",
                   "--mode", "infer", "--snapshot", str(snap))
    assert human.exit_code == 0, human.output
    assert "Against the real snapshot" in human.output and "heavy.py:13" in human.output


@pytest.mark.parametrize("extra, message", [
    (["--world-size", "2"], "leave out --world-size"),
    (["--device", "cpu"], "CUDA target"),
])
def test_a_snapshot_needs_one_cuda_target(factory_file, tmp_path, extra, message):
    snap = tmp_path / "heavy.pickle"
    _snapshot_of_heavy_at_2(snap, 48 * MIB)
    result = invoke("estimate", f"{factory_file}:heavy", "-b", "2", "--mode", "infer",
                    "--snapshot", str(snap), *extra)
    assert result.exit_code == 2
    assert message in result.output and "Traceback" not in result.output


def test_bench_predict_on_a_gpu_with_memory(factory_file):
    result = invoke("bench", f"{factory_file}:with_spec", "--gpu", "RTX 5090", "--predict",
                    "--memory", "1GiB", "--batches", "4,16", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["memory_bytes"] == data["device"]["total_memory_bytes"] == GIB
    assert data["device"]["compute_capability"] == [12, 0]


def test_plot_is_written(factory_file, tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "m.png"
    result = invoke("max", f"{factory_file}:with_spec", "--device", "cpu", "--memory", "4MiB",
                    "--overhead", "0", "--plot", str(png))
    assert result.exit_code == 0, result.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_nothing_fits_exits_3(factory_file):
    result = invoke("max", f"{factory_file}:with_spec", "--device", "cpu", "--memory", "100KiB",
                    "--overhead", "0")
    assert result.exit_code == 3
    assert "budget" in result.output


BAD = [
    # (arguments, exit code, a piece of the one-line message)
    (["max", "timm:resnet18", "--gpu", "RTX 3009"], 2, "did you mean 'RTX 3090'"),
    (["max", "timm:resnet18", "--device", "cpu", "--memory", "24 parsecs"], 2, "malformed size"),
    (["max", "timm:resnet18", "--device", "cpu", "--memory", "-3GiB"], 2, "malformed size"),
    (["estimate", "timm:resnet18", "-b", "2", "--input", "3xfoo"], 2, "malformed shape"),
    (["estimate", "timm:resnet18", "-b", "2", "--input", "3x0x224"], 2, "malformed shape"),
    (["estimate", "timm:resnet5", "-b", "2"], 2, "resnet50"),
    (["estimate", "torchvision:resnet500", "-b", "2"], 2, "unknown torchvision model"),
    (["estimate", "hf:gpt-9000", "-b", "2"], 2, "hf:path/to/dir"),
    (["estimate", "nowhere/model.py:build", "-b", "2"], 2, "not found"),
    (["estimate", "{factory}:missing", "-b", "2"], 2, "missing"),
    (["estimate", "{factory}:broken", "-b", "2", "--input", "128"], 2, "cannot build this"),
    (["estimate", "timm:resnet18", "-b", "-4"], 2, "--batch-size"),
    (["estimate", "timm:resnet18", "-b", "0"], 2, "--batch-size"),
    (["estimate", "{factory}:heavy", "-b", "2", "--gpu", "RTX 4090", "--snapshot",
      "nowhere.pickle"], 2, "cannot read the snapshot nowhere.pickle"),
    (["estimate", "{factory}:heavy", "-b", "2", "--gpu", "RTX 4090", "--snapshot",
      "{factory}"], 2, "is not a pickled CUDA memory snapshot"),
    # --gpu with --memory: a malformed size, and a memory the context and workspaces fill.
    # T4 (sm75): context 512 MiB + cuBLAS workspaces 2 x 8.125 MiB = 553,910,272 B.
    (["max", "timm:resnet18", "--gpu", "T4", "--memory", "16 parsecs"], 2, "like 24GiB"),
    (["max", "timm:resnet18", "--gpu", "T4", "--memory", "256MiB"], 2,
     "below the 553,910,272 B"),
    (["max", "timm:resnet18", "--gpu", "T4", "--memory", "16MiB", "--overhead", "0"], 2,
     "16,777,216 B is below the 17,039,360 B"),
    (["estimate", "timm:resnet18", "-b", "2", "--gpu", "T4", "--memory", "0.1GiB"], 2, "below"),
    (["estimate", "timm:resnet18", "-b", "2", "--memory", "8GiB"], 2, "goes with --gpu"),
    (["bench", "{factory}:with_spec", "--gpu", "T4", "--predict", "--memory", "256MiB"], 2,
     "below the 553,910,272 B"),
    (["max", "timm:resnet18", "--gpu", "T4", "--device", "cpu"], 2, "not both"),
    (["estimate", "timm:resnet18", "-b", "2", "--optimizer", "adamx"], 2, "unknown optimizer"),
    (["estimate", "timm:resnet18", "-b", "2", "--precision", "fp8"], 2, "unknown precision"),
    (["estimate", "timm:resnet18", "-b", "2", "--mode", "eval"], 2, "unknown mode"),
    (["max", "timm:resnet18"], 2, "give a budget"),
    (["max", "timm:resnet18", "--device", "cpu"], 2, "--memory"),
    (["max", "timm:resnet18", "--gpu", "T4", "--margin", "1.5"], 2, "margin"),
    (["estimate", "timm:resnet18", "-b", "2", "--device", "tpu"], 2, "unknown device"),
    (["estimate", "timm:resnet18", "-b", "2", "--device", "cuda:3"], 2, "CUDA"),
    (["estimate", "timm:resnet18", "-b", "2", "--plot", "out.jpg"], 2, ".png"),
    (["estimate", "timm:resnet18", "-b", "2", "--overhead", "lots"], 2, "size"),
    (["estimate", "timm:resnet18", "-b", "2", "--input", "1x64x64"], 2, "(3, H, W)"),
    (["estimate", "{factory}:mlp", "-b", "2"], 2, "--input"),
    (["estimate", "resnet50x", "-b", "2"], 2, "unknown model"),
    (["estimate", "timm:resnet18", "-b", "2", "--seq-len", "0"], 2, "seq"),
    (["estimate", "timm:resnet18", "-b", "2", "--model-kwargs", "oops"], 2, "key=value"),
    (["max", "timm:resnet18", "--gpu", "T4", "-b", "8"], 2, "takes no token sequence"),
    (["bench", "{factory}:with_spec", "--predict"], 2, "--predict needs --gpu"),
    (["bench", "{factory}:with_spec", "--batches", ","], 2, "bad --batches"),
    (["bench", "{factory}:with_spec", "--dataset-size", "0"], 2, "--dataset-size"),
    (["bench", "{factory}:with_spec", "--gpu", "A100"], 2, "--predict"),
    (["search", "{factory}:with_spec", "--device", "cuda:7"], 2, "CUDA"),
    (["search", "{factory}:with_spec", "--device", "npu"], 2, "unknown device"),
    (["search", "{factory}:with_spec", "--memory-cap", "64TiB"], 2, "larger than this machine"),
    (["search", "{factory}:with_spec", "--steps-per-trial", "0"], 2, "--steps-per-trial"),
    (["max", "timm:resnet18", "--gpu", "T4", "--torch-version", "3.1"], 2, "unknown --torch-version"),
    (["max", "timm:resnet18", "--gpu", "T4", "--torch-version", "new"], 2, "malformed --torch-version"),
    (["max", "timm:resnet18", "--gpu", "T4", "--cuda-version", "11.4"], 2, "unknown --cuda-version"),
    (["estimate", "timm:resnet18", "-b", "2", "--stack", "2.4"], 2, "malformed --stack"),
    # CUDA 11.3 has no lazy module loading: a 1,343 MiB context + 2 x 8.125 MiB (T4)
    (["max", "timm:resnet18", "--gpu", "T4", "--memory", "1GiB", "--stack", "torch1.12+cu113"],
     2, "below the 1,425,276,928 B"),
    (["estimate", "timm:resnet18", "-b", "2", "--gpu", "T4", "--memory", "1GiB",
      "--cuda-version", "11.3", "--torch-version", "1.12"], 2, "below the 1,425,276,928 B"),
    (["estimate", "timm:resnet18", "-b", "2", "--stack", "torch2.4+cu124",
      "--torch-version", "2.4"], 2, "not both"),
    (["max", "timm:resnet18", "--gpu", "T4", "--alloc-conf", "max_split_size_mb:16"], 2,
     "must be > 20"),
    (["estimate", "timm:resnet18", "-b", "2", "--gpu", "T4", "--alloc-conf",
      "backend:cudaMallocAsync"], 2, "not modelled"),
    # the stack options describe a predicted process: a measured bench refuses them
    (["bench", "{factory}:with_spec", "--stack", "torch1.12+cu113"], 2, "add --predict"),
    (["bench", "{factory}:with_spec", "--device", "cpu", "--cudnn-benchmark"], 2,
     "--cudnn-benchmark describes a predicted process"),
    (["bench", "{factory}:with_spec", "--gpu", "T4", "--predict", "--torch-version", "3.1"], 2,
     "unknown --torch-version"),
    (["bench", "{factory}:with_spec", "--gpu", "T4", "--predict", "--memory", "1GiB", "--stack",
      "torch1.12+cu113"], 2, "below the 1,425,276,928 B"),
    (["plan", "{factory}:with_spec", "--gpus", "2xT4", "--global-batch", "8", "--alloc-conf",
      "max_split_size_mb:16"], 2, "must be > 20"),
]


@pytest.mark.parametrize("args,code,fragment", BAD, ids=[" ".join(a[:3]) + f"-{i}"
                                                          for i, (a, _, _) in enumerate(BAD)])
def test_bad_input_gets_one_clear_line(args, code, fragment, factory_file):
    args = [a.replace("{factory}", str(factory_file)) for a in args]
    result = invoke(*args)
    assert result.exit_code == code, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1, result.output
    assert "Traceback" not in result.output
    assert fragment.lower() in result.output.lower().replace("\n", " "), result.output


def test_stack_sets_the_context_in_json(factory_file):
    # torch 1.12 + CUDA 11.3 loads every kernel eagerly: 1,343 MiB of context; the
    # installed torch (CUDA >= 12.2) loads lazily: 512 MiB.
    old = invoke("max", f"{factory_file}:with_spec", "--gpu", "T4", "--stack", "torch1.12+cu113",
                 "--max-batch-limit", "64", "--json")
    new = invoke("max", f"{factory_file}:with_spec", "--gpu", "T4", "--max-batch-limit", "64",
                 "--json")
    assert old.exit_code == 0 and new.exit_code == 0, old.output + new.output
    assert json.loads(old.stdout)["device"]["context_bytes"] == 1343 * MIB
    assert json.loads(new.stdout)["device"]["context_bytes"] == 512 * MIB
    assert json.loads(old.stdout)["stack"]["torch_version"] == "1.12"
    # on an RTX 3090 (8.6) the eager context is that card's measurement (1,687 MiB with
    # a 2 MiB tensor, pytorch/pytorch#55277), in the device and the stack alike
    ampere = invoke("max", f"{factory_file}:with_spec", "--gpu", "RTX 3090", "--stack",
                    "torch1.12+cu113", "--max-batch-limit", "64", "--json")
    assert ampere.exit_code == 0, ampere.output
    data = json.loads(ampere.stdout)
    assert data["device"]["context_bytes"] == data["stack"]["context_bytes"] == 1685 * MIB


def test_bench_predict_takes_the_stack_as_max_does(factory_file):
    # ``heavy`` in inference holds 96 MiB per sample at its peak (the 32 MiB input, the
    # Linear's and the ReLU's 32 MiB outputs). torch 1.12 + CUDA 11.3 loads every kernel
    # eagerly: a T4's context grows from 512 to 1,343 MiB, and 831 MiB is 8.7 samples, so
    # the largest batch drops by 8 or 9; bench --predict and max agree on it.
    def answer(command: str, *stack: str) -> dict:
        extra = ("--predict", "--batches", "1") if command == "bench" else ()
        result = invoke(command, f"{factory_file}:heavy", "--gpu", "T4", "--mode", "infer",
                        *extra, *stack, "--json")
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout)

    old = ("--stack", "torch1.12+cu113")
    bench_new, bench_old = answer("bench"), answer("bench", *old)
    assert bench_old["device"]["context_bytes"] == 1343 * MIB
    assert bench_new["device"]["context_bytes"] == 512 * MIB
    assert bench_old["stack"]["torch_version"] == "1.12"
    assert bench_old["max_batch_size"] == answer("max", *old)["max_batch_size"]
    assert bench_new["max_batch_size"] == answer("max")["max_batch_size"]
    assert 8 <= bench_new["max_batch_size"] - bench_old["max_batch_size"] <= 9


def test_sharded_estimate_and_plan_take_the_stack(factory_file):
    # A rank's estimate on another stack carries that stack's context: on an RTX 3090
    # (8.6) torch 1.12 + CUDA 11.3 loads eagerly, 1,685 MiB (pytorch/pytorch#55277)
    # instead of 512 MiB lazily, 1,173 MiB more; inference of the MLP changes nothing else.
    def ranks(*stack: str) -> dict:
        result = invoke("estimate", f"{factory_file}:with_spec", "-b", "64", "--mode", "infer",
                        "--gpu", "RTX 3090", "--world-size", "2", "--strategy", "ddp", *stack,
                        "--json")
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout)

    old, new = ranks("--stack", "torch1.12+cu113"), ranks()
    assert old["total_bytes"] - new["total_bytes"] == (1685 - 512) * MIB
    assert [r["total_bytes"] for r in old["ranks"]] == [old["total_bytes"]] * 2

    # plan: each layout's memory per GPU is the rank estimate on the stack it was given
    from batchfit.answers.ranks import estimate_ranks
    from batchfit.engine.spec import TrainConfig
    from batchfit.engine.stack import Stack
    from batchfit.models.resolve import resolve_model
    from batchfit.sharding.layout import Parallelism

    def plan(*stack: str) -> dict:
        result = invoke("plan", f"{factory_file}:with_spec", "--gpus", "2xT4", "--global-batch",
                        "8", "--strategies", "ddp", "--checkpointing", "off", "--offload", "none",
                        *stack, "--json")
        assert result.exit_code == 0, result.output
        (row,) = json.loads(result.stdout)["layouts"]
        return row

    row_old, row_new = plan("--stack", "torch1.12+cu113"), plan()
    assert row_old["micro_batch_size"] == row_new["micro_batch_size"] == 4
    spec = resolve_model(f"{factory_file}:with_spec")
    config = TrainConfig(optimizer="adamw", stack=Stack.parse(stack="torch1.12+cu113"))
    expected = estimate_ranks(spec.factory, spec.input_spec, 4, config, device="T4",
                              parallel=Parallelism(world_size=2, strategy="ddp", rank=0),
                              first_step=False).total_bytes
    assert row_old["memory_per_gpu_bytes"] == expected
    # at least the T4's larger eager context (1,343 - 512 MiB) above the default stack
    assert row_old["memory_per_gpu_bytes"] - row_new["memory_per_gpu_bytes"] >= 831 * MIB


def test_alloc_conf_from_the_option_and_from_the_environment(factory_file, monkeypatch,
                                                             tmp_path):
    # The answer states the allocator options it assumed; --alloc-conf wins over the
    # shell's PYTORCH_CUDA_ALLOC_CONF, which is read when the option is left out.
    args = ("max", f"{factory_file}:with_spec", "--gpu", "T4", "--max-batch-limit", "64",
            "--json")
    default = json.loads(invoke(*args).output)["device"]["allocator"]
    given = json.loads(invoke(*args, "--alloc-conf", "max_split_size_mb:64").output)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    from_env = json.loads(invoke(*args).output)
    overridden = json.loads(invoke(*args, "--alloc-conf", "").output)
    assert default == "default" and overridden["device"]["allocator"] == "default"
    assert given["device"]["allocator"] == "max_split_size_mb:64"
    assert from_env["device"]["allocator"] == "expandable_segments:True"
    human = invoke("max", f"{factory_file}:with_spec", "--gpu", "T4", "--max-batch-limit", "64")
    assert "allocator: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in human.output
    # estimate --snapshot: the recorded process's options, over the shell's
    import pickle

    snapshot = tmp_path / "step.pickle"
    trace = [{"action": "alloc", "addr": 0, "size": 4 << 20, "frames": []},
             {"action": "free_completed", "addr": 0, "size": 4 << 20, "frames": []}]
    snapshot.write_bytes(pickle.dumps({"segments": [], "device_traces": [trace],
                                       "allocator_settings": {"max_split_size": 64 << 20}}))
    recorded = invoke("estimate", f"{factory_file}:with_spec", "-b", "8", "--gpu", "T4",
                      "--snapshot", str(snapshot), "--json")
    assert recorded.exit_code == 0, recorded.output
    assert json.loads(recorded.stdout)["device"]["allocator"] == "max_split_size_mb:64"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segment:True")
    bad = invoke(*args)
    assert bad.exit_code == 2 and "PYTORCH_CUDA_ALLOC_CONF: unknown allocator option" in bad.output


def test_debug_shows_the_traceback():
    result = invoke("max", "timm:resnet18", "--gpu", "RTX 3009", "--debug")
    assert result.exit_code != 0
    assert result.exception is not None


@pytest.mark.slow
def test_bench_cpu_without_memory_uses_available_memory_within_its_time_budget(factory_file):
    # issue 14 items 2 and 3: no --memory on the CPU means the memory the machine has
    # available (said on stderr and in the JSON); inference of a small MLP fits tens of
    # thousands of samples there, and the time budget keeps the sweep short; one progress
    # line per measurement on stderr in --json mode
    result = invoke("bench", f"{factory_file}:mlp", "--input", "128", "--device", "cpu",
                    "--mode", "infer", "--time-budget", "20s", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["memory_source"] == "available" and data["time_budget_s"] == 20
    assert data["max_batch_size"] > 10_000
    measured = [p for p in data["points"] if p["fits"]]
    assert 1 <= len(measured) <= 8
    # the sweep stops short of points predicted to end past the budget; the last point
    # may overrun its prediction (a loaded machine slows it), but not by a whole budget
    assert data["elapsed_s"] <= 2 * 20
    assert "this machine has available" in result.stderr
    lines = [line for line in result.stderr.splitlines()
             if re.match(r"batchfit bench \[ *[\d.]+ s\]: batch \d+: ", line)]
    assert len(lines) >= len(data["points"])  # each measurement (confirmations too), skips


def test_bench_time_budget_zero_is_bad_input(factory_file):
    result = invoke("bench", f"{factory_file}:mlp", "--input", "128", "--device", "cpu",
                    "--time-budget", "0")
    assert result.exit_code == 2
    assert "must be positive" in result.output


def test_library_deprecation_logs_stay_off_stderr(tmp_path):
    # transformers imports torchao's quantizer with every model it builds; torchao then
    # registers Enums as pytree constants, which torch logs as deprecated on stderr (a
    # warning per Enum, outside Python's warnings). The CLI keeps that chatter out.
    pytest.importorskip("torchao")
    factory = tmp_path / "quantized_import.py"
    factory.write_text(
        "import transformers.quantizers.quantizer_torchao  # noqa: F401 (as hf: models do)\n"
        "from torch import nn\n\n"
        "def build():\n"
        "    return nn.Linear(8, 8)\n")
    done = subprocess.run(
        [sys.executable, "-c", "from batchfit.cli import main; main()", "estimate",
         f"{factory}:build", "--batch-size", "2", "--input", "8", "--json"],
        capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    assert "register_constant" not in done.stderr
    json.loads(done.stdout)


def test_bench_says_skipped_for_the_time_budget_not_out_of_memory(factory_file):
    # issue 35 item 2: with a 1 s budget, batch 1 runs first (always) and its timing alone
    # takes up to 3 s (TimingConfig.max_run_s), so 2-16 are skipped. Before, the text said
    # "out of memory" for them and the JSON "fits": false.
    args = ("bench", f"{factory_file}:mlp", "--input", "128", "--device", "cpu",
            "--memory", "1GiB", "--batches", "1,2,4,8,16", "--time-budget", "1s")
    result = invoke(*args, "--json")
    assert result.exit_code == 0, result.output
    points = json.loads(result.stdout)["points"]
    assert [p["status"] for p in points] == ["measured"] + ["skipped_time_budget"] * 4
    assert [p["fits"] for p in points] == [True, None, None, None, None]
    assert json.loads(result.stdout)["stability"]["candidate_batch_sizes"] == [1]
    text = invoke(*args)
    assert text.exit_code == 0, text.output
    flat = " ".join(text.stdout.split())
    assert "out of memory" not in flat and flat.count("skipped: time budget") == 4
    assert "batches 2, 4, 8, 16 not measured" in flat


def progress_lines(stderr: str, command: str) -> list[str]:
    return [line for line in stderr.splitlines()
            if re.match(rf"batchfit {command} \[ *[\d.]+ s\]: ", line)]


def test_max_prints_a_progress_line_per_trace_when_stderr_is_not_a_terminal(factory_file,
                                                                            monkeypatch):
    # issue 35 item 10: before, a piped `max` said nothing until its answer. The JSON lists
    # the traced batches (evaluated): a line each, after the line for resolving the model.
    # (A start line shows once its work has run START_DELAY_S; this MLP's traces are
    # faster than that, so the delay is 0 here.)
    from batchfit.cli import progress as progress_module

    monkeypatch.setattr(progress_module, "START_DELAY_S", 0)
    result = invoke("max", f"{factory_file}:with_spec", "--device", "cpu", "--memory",
                    "64MiB", "--overhead", "0", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    traced = [line for line in progress_lines(result.stderr, "max") if "tracing" in line]
    assert len(traced) == len(data["evaluated"]) >= 2
    assert progress_lines(result.stderr, "max")[0].endswith("resolving " + f"{factory_file}:with_spec")


def test_progress_is_a_spinner_on_a_terminal_and_lines_elsewhere(monkeypatch, capsys):
    from rich.console import Console

    import time

    from batchfit.cli import progress as progress_module

    monkeypatch.setattr(progress_module, "START_DELAY_S", 0.05)
    with progress_module.progress("estimate", "tracing") as status:
        pass  # over at once: a bad input's error line would stand alone
    assert capsys.readouterr().err == ""
    with progress_module.progress("estimate", "tracing") as status:
        time.sleep(0.3)  # ran past the delay: shown
        status.done("traced batch 2")
    plain = capsys.readouterr().err.splitlines()
    assert [line.split(": ", 1)[1] for line in plain] == ["tracing", "traced batch 2"]
    steps = []
    with progress_module.counted_progress("noise", "measuring", 20) as on_step:
        for index in range(20):
            on_step(index)
            steps.append(index)
    counted = capsys.readouterr().err.splitlines()  # every 2nd step of 20 (the start line
    assert len(counted) == 10 and counted[-1].endswith("step 20 of 20")  # gave way at once)
    monkeypatch.setattr(progress_module, "_err", Console(stderr=True, force_terminal=True))
    with progress_module.progress("estimate", "tracing") as status:
        status.update("tracing at batch 2")
    assert "batchfit estimate [" not in capsys.readouterr().err
