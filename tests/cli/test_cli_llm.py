"""The LLM options of the CLI: one clear line and exit 2 for each bad input of issue 15,
and the JSON of a QLoRA estimate."""

from __future__ import annotations

import json
import textwrap

import pytest
from typer.testing import CliRunner

pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")

from batchfit.cli import app  # noqa: E402

runner = CliRunner()
TINY = ["hf:Qwen/Qwen3-0.6B", "--seq-len", "32",
        *[item for kv in ("num_hidden_layers=1", "hidden_size=64", "intermediate_size=128",
                          "num_attention_heads=2", "num_key_value_heads=1", "head_dim=32",
                          "vocab_size=512") for item in ("--model-kwargs", kv)]]


def invoke(*args: str):
    return runner.invoke(app, list(args))


@pytest.fixture()
def conv_file(tmp_path):
    path = tmp_path / "conv.py"
    path.write_text(textwrap.dedent("""
        from torch import nn
        from batchfit import TensorSpec

        def net():
            return nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten()), TensorSpec((3, 8, 8))
    """))
    return path


@pytest.mark.parametrize("extra, fragment", [
    (["--lora", "r=16,rnk=4"], "unknown --lora key 'rnk'"),
    (["--lora", "r=0"], "LoRA rank r=0 must be a positive integer"),
    (["--lora", "r=8,targets=qproj"], "'qproj' matches no module"),
    (["--quant", "nf3", "--lora", "r=8"], "unknown --quant 'nf3'"),
    (["--quant", "nf4"], "nothing would train: add --lora"),
    (["--lora", "r=8", "--loss", "chunked", "--device", "cpu"], "run on GPUs only"),
    (["--lora", "r=8", "--attn", "flash", "--gpu", "T4", "--precision", "amp-fp16"],
     "--attn flash needs an sm80+ GPU"),
    (["--lora", "r=8", "--optimizer", "adamw9bit"], "unknown optimizer 'adamw9bit'"),
    (["--lora", "r=8", "--grad-accum", "0"], "--grad-accum must be a positive integer"),
    (["--lora", "r=8", "--use-reentrant"], "add --checkpointing"),
    (["--lora", "r=8", "--no-use-reentrant"], "add --checkpointing"),
    (["--lora", "r=8", "--transformers-version", "4.x"], "malformed --transformers-version"),
    (["--lora", "r=8", "--transformers-version", "4.20"], "from 4.28"),
    (["--lora", "r=8", "--bitsandbytes-version", "0.41.1"], "add --quant nf4"),
    (["--lora", "r=8", "--quant", "int8", "--bitsandbytes-version", "0.41.1"],
     "add --quant nf4"),
    (["--lora", "r=8", "--quant", "nf4", "--bitsandbytes-version", "new"],
     "malformed --bitsandbytes-version 'new'"),
    (["--lora", "r=8", "--quant", "nf4", "--bitsandbytes-version", "0.38.1"], "from 0.39.0"),
])
def test_bad_llm_input_gets_one_line(extra, fragment):
    result = invoke("estimate", *TINY, "-b", "2", *extra)
    assert result.exit_code == 2, result.output
    assert fragment in result.output and "Traceback" not in result.output
    assert len([line for line in result.output.splitlines() if line.strip()]) == 1


def test_target_error_lists_the_candidates():
    result = invoke("estimate", *TINY, "-b", "2", "--lora", "r=8,targets=qproj")
    assert "did you mean 'q_proj'" in result.output and "gate_proj" in result.output


def test_quant_on_a_model_without_linear_layers(conv_file):
    result = invoke("estimate", f"{conv_file}:net", "-b", "2", "--lora", "r=4", "--quant", "nf4")
    assert result.exit_code == 2, result.output
    assert "no nn.Linear layer to quantize" in result.output


def test_qlora_estimate_json():
    result = invoke("estimate", *TINY, "-b", "2", "--gpu", "A100 80GB", "--lora",
                    "r=8,alpha=16,targets=all-linear", "--quant", "nf4-dq",
                    "--optimizer", "paged_adamw_8bit", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    # 7 adapted layers of r=8: q 64->64, k/v 64->32, o 64->64, gate/up 64->128, down 128->64
    assert data["trainable_parameter_count"] == 8 * (128 + 96 + 96 + 128 + 192 * 3)
    assert data["host_backed_bytes"] == 0  # no adapter has the 100,000 elements paging needs
    assert data["total_bytes"] > data["peak_reserved_bytes"] > 0


def test_the_checkpointing_variant_is_told_and_can_be_switched():
    """QLoRA with peft's preparation checkpoints as torch's default does (reentrant): the
    answer says so and names the switch (that the variants trace differently is
    tests/engine/test_reentrant_default.py's)."""
    args = ("estimate", *TINY, "-b", "2", "--gpu", "A100 80GB", "--lora", "r=8",
            "--quant", "nf4")
    told = invoke(*args)
    assert told.exit_code == 0, told.output
    assert "checkpointing is reentrant (peft's prepare_model_for_kbit_training" in told.output
    assert "--no-use-reentrant for the other variant" in told.output
    default, on, off = (json.loads(invoke(*args, *extra, "--json").stdout)
                        for extra in ((), ("--use-reentrant",), ("--no-use-reentrant",)))
    assert default["use_reentrant"] is True
    assert "use_reentrant" not in on and "use_reentrant" not in off  # the user's own choice
    assert default["peak_reserved_bytes"] == on["peak_reserved_bytes"]


def test_llm_options_on_a_keras_model(tmp_path):
    """A bitsandbytes optimizer or peft/bitsandbytes adapters on a Keras model: one line."""
    pytest.importorskip("keras")
    path = tmp_path / "km.py"
    path.write_text(textwrap.dedent("""
        def net():
            import keras
            model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
            model.compile(optimizer="adam", loss="mse")
            return model
    """))
    for extra, fragment in ((["--optimizer", "adamw8bit"], "trains with a Keras optimizer"),
                            (["--lora", "r=4"], "is a Keras model"),
                            (["--quant", "nf4", "--lora", "r=4"], "is a Keras model")):
        result = invoke("estimate", f"{path}:net", "-b", "4", *extra)
        assert result.exit_code == 2, result.output
        assert fragment in result.output and "Traceback" not in result.output
        assert len([line for line in result.output.splitlines() if line.strip()]) == 1


def test_transformers_version_changes_the_loss():
    # transformers 4.46's loss copies the float32 logits (engine/workloads/hfloss.py): the
    # forward's peak at the loss grows by the shifted copy and its log-softmax
    runs = {}
    for version in (None, "4.46"):
        extra = ["--transformers-version", version] if version else []
        result = invoke("estimate", *TINY, "-b", "4", "--lora", "r=8", "--json", *extra)
        assert result.exit_code == 0, result.output
        runs[version] = json.loads(result.stdout)["peak_allocated_bytes"]
    assert runs["4.46"] > runs[None]


def test_bitsandbytes_version_keeps_the_4bit_inputs():
    # bitsandbytes < 0.43.2 keeps each 4-bit layer's input for backward
    # (engine/workloads/runtime.py): the step's activations grow, the weights do not.
    # Without checkpointing every layer's saved tensors are alive at the peak (the
    # reentrant checkpoint of peft's default saves nothing in its no-grad forward).
    runs = {}
    for version in (None, "0.41.1"):
        extra = ["--bitsandbytes-version", version] if version else []
        result = invoke("estimate", *TINY, "-b", "4", "--lora", "r=8", "--quant", "nf4",
                        "--no-checkpointing", "--json", *extra)
        assert result.exit_code == 0, result.output
        runs[version] = json.loads(result.stdout)["by_category"]
    assert runs["0.41.1"]["activations"] > runs[None]["activations"]
    assert runs["0.41.1"]["parameters"] == runs[None]["parameters"]
