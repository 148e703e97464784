"""``batchfit noise`` and ``batchfit recommend``: the JSON contract, the plots, and one line
with exit code 2 for each bad input."""

from __future__ import annotations

import json
import textwrap

import pytest
from typer.testing import CliRunner

from batchfit.cli import app

runner = CliRunner()


@pytest.fixture(scope="module")
def workload_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("noise") / "workload.py"
    path.write_text(textwrap.dedent("""
        import torch
        from torch import nn

        def _data(n=2048):
            g = torch.Generator().manual_seed(0)
            x = torch.randn(n, 8, generator=g)
            return x, x.sum(1, keepdim=True) + torch.randn(n, 1, generator=g)

        def mse(model, batch):
            return 0.5 * (model(batch[0]) - batch[1]).square().mean()

        def build(n: int = 2048):
            torch.manual_seed(0)
            return nn.Linear(8, 1), _data(n), mse

        def trains():
            model, data, loss = build()
            return model, data, loss, torch.optim.SGD(model.parameters(), lr=0.05)

        def as_dict():
            model, data, loss = build()
            return {"model": model, "data": data, "loss_fn": loss}

        def per_example_loss():
            model, data, _ = build()
            return model, data, lambda m, b: (m(b[0]) - b[1]).square()

        def frozen():
            model, data, loss = build()
            return model.requires_grad_(False), data, loss

        def only_model():
            return nn.Linear(8, 1)
    """))
    return path


def invoke(*args: str):
    return runner.invoke(app, list(args))


def test_noise_json_contract(workload_file):
    result = invoke("noise", f"{workload_file}:build", "--batch-small", "4", "--batch-big", "16",
                    "--steps", "6", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    for key in ("b_simple", "grad_sq_norm", "trace_sigma", "ci_low", "ci_high", "confidence",
                "steps", "effective_steps", "steps_for_10_percent", "batch_small", "batch_big",
                "method", "history", "notes", "dataset_size"):
        assert key in data
    assert (data["steps"], data["batch_small"], data["batch_big"]) == (6, 4, 16)
    assert data["method"] == "microbatch" and data["dataset_size"] == 2048
    assert len(data["history"]) == 6 and data["b_simple"] > 0


def test_noise_human_output_and_plot(workload_file, tmp_path):
    plot = tmp_path / "noise.png"
    result = invoke("noise", f"{workload_file}:as_dict", "--batch-small", "1",
                    "--batch-big", "16", "--steps", "4", "--plot", str(plot))
    assert result.exit_code == 0, result.output
    assert "Gradient noise scale B_simple" in result.stdout and "per-example" in result.stdout
    assert plot.stat().st_size > 10_000


def test_noise_trains_when_the_factory_returns_an_optimizer(workload_file):
    trained = json.loads(invoke("noise", f"{workload_file}:trains", "--steps", "5",
                                "--batch-small", "4", "--batch-big", "16", "--json").stdout)
    fixed = json.loads(invoke("noise", f"{workload_file}:trains", "--steps", "5", "--no-train",
                              "--batch-small", "4", "--batch-big", "16", "--json").stdout)
    # same batches (same seed): the first step is at the same weights, later ones are not
    assert trained["history"][0] == fixed["history"][0]
    assert trained["history"][-1] != fixed["history"][-1]


@pytest.mark.parametrize("args, message", [
    (["--batch-small", "16", "--batch-big", "16"], "smaller than the big batch"),
    (["--batch-small", "32", "--batch-big", "16"], "smaller than the big batch"),
    (["--batch-big", "4096"], "fewer than the big batch"),
    (["--batch-small", "5"], "multiple of 5"),
    (["--method", "sideways"], "unknown method"),
    (["--device", "tpu"], "unknown device"),
    (["--train"], "--train needs an optimizer"),
    (["--plot", "noise.svg"], "must end in .png"),
], ids=lambda v: v if isinstance(v, str) else " ".join(v))
def test_noise_bad_options_exit_2_with_one_line(workload_file, args, message):
    result = invoke("noise", f"{workload_file}:build", *args)
    assert result.exit_code == 2, result.output
    assert message in result.output and len(result.output.strip().splitlines()) <= 2
    assert "Traceback" not in result.output


@pytest.mark.parametrize("factory, message", [
    ("per_example_loss", "not a scalar"),
    ("frozen", "no trainable parameter"),
    ("only_model", "return (model, data, loss_fn)"),
    ("missing", "has no factory"),
])
def test_noise_bad_workloads_exit_2_with_one_line(workload_file, factory, message):
    result = invoke("noise", f"{workload_file}:{factory}", "--steps", "2")
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output


def test_recommend_json_contract_with_measured_step_times(workload_file, tmp_path):
    plot = tmp_path / "recommend.png"
    result = invoke("recommend", f"{workload_file}:trains", "--noise-scale", "32",
                    "--device", "cpu", "--memory", "256MiB", "--batches", "8,32,128",
                    "--current-batch", "8", "--json", "--plot", str(plot))
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    for key in ("recommended_batch_size", "range_batch_sizes", "b_noise", "samples_2x_batch_size",
                "max_batch_size", "current_batch_size", "speedup_vs_current", "options",
                "learning_rate", "caveat", "noise", "throughput", "predicted"):
        assert key in data
    assert data["b_noise"] == 32 and data["predicted"] is False
    measured = [o["batch_size"] for o in data["options"] if o["measured"]]
    assert measured == [8, 32, 128]
    assert data["learning_rate"]["rule"] == "linear"  # the factory's SGD
    assert "proxy" in data["caveat"]
    assert plot.stat().st_size > 10_000


def test_recommend_human_output_with_predicted_step_times(workload_file):
    result = invoke("recommend", f"{workload_file}:build", "--noise-scale", "32",
                    "--gpu", "A100", "--predict", "--batches", "8,64,512")
    assert result.exit_code == 0, result.output
    assert "Recommended batch" in result.stdout and "predicted step times" in result.stdout
    assert "Malladi" in result.stdout  # the default AdamW: the square-root rule


def test_recommend_predict_takes_the_stack_and_memory_as_bench_does(workload_file):
    # The predicted card is the one bench --predict runs on: torch 1.12 + CUDA 11.3 loads
    # every kernel eagerly, a T4's context 1,343 MiB (the V100's measured eager context)
    # instead of 512 MiB lazily; --memory gives the card that much memory.
    def throughput(*args: str) -> dict:
        result = invoke("recommend", f"{workload_file}:build", "--noise-scale", "32",
                        "--gpu", "T4", "--predict", "--batches", "8,64", *args, "--json")
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout)["throughput"]

    old = throughput("--stack", "torch1.12+cu113", "--memory", "2GiB")
    assert old["device"]["context_bytes"] == 1343 * 2**20
    assert old["device"]["total_memory_bytes"] == 2 * 2**30
    assert old["stack"]["torch_version"] == "1.12"
    assert throughput()["device"]["context_bytes"] == 512 * 2**20


@pytest.mark.parametrize("args, message", [
    (["--predict"], "--predict needs --gpu"),
    (["--gpu", "A100"], "--gpu goes with --predict"),
    (["--stack", "torch1.12+cu113"], "add --predict"),
    (["--gpu", "T4", "--predict", "--torch-version", "0.3"], "unknown --torch-version"),
    (["--noise-scale", "-3"], "must be a positive number"),
    (["--current-batch", "0"], "--current-batch must be a positive integer"),
], ids=lambda v: v if isinstance(v, str) else " ".join(v))
def test_recommend_bad_options_exit_2_with_one_line(workload_file, args, message):
    result = invoke("recommend", f"{workload_file}:build", *args)
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output
