"""``--recipe`` on the CLI (issue 36): bad input gets one line and exit 2, the recipe's
defaults reach the JSON, torchtune's recipe says torch.compile is not modelled."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")

from tests.cli.test_cli_llm import TINY

from batchfit.cli import app

runner = CliRunner()


@pytest.mark.parametrize("extra, fragment", [
    (["--lora", "r=8", "--recipe", "tune"], "unknown recipe 'tune': choose one of peft, litgpt"),
    (["--recipe", "litgpt"], "--recipe litgpt is a LoRA/QLoRA fine-tuning recipe: add --lora"),
    (["--lora", "r=8", "--quant", "nf4", "--recipe", "litgpt", "--precision", "amp-bf16"],
     "litgpt raises 'Quantization and mixed precision is not supported'"),
    (["--lora", "r=8", "--quant", "fp4", "--recipe", "torchtune"],
     "--recipe torchtune quantizes with torchao's NF4 only, not fp4"),
    (["--lora", "r=8,dtype=half"], "LoRA dtype='half': use fp32"),
    (["--lora", "r=8", "--loss", "chunky"],
     "unknown loss 'chunky': choose one of standard, chunked, native, chunked-output"),
])
def test_bad_recipe_input_gets_one_line(extra, fragment):
    result = runner.invoke(app, ["estimate", *TINY, "-b", "2", *extra])
    assert result.exit_code == 2, result.output
    assert fragment in result.output and "Traceback" not in result.output
    assert len([line for line in result.output.splitlines() if line.strip()]) == 1


def test_recipe_reaches_the_json_and_explicit_flags_win():
    args = ["estimate", *TINY, "-b", "2", "--gpu", "A100 80GB", "--lora", "r=8",
            "--quant", "nf4", "--recipe", "litgpt", "--json"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["recipe"]["recipe"] == "litgpt" and data["recipe"]["kbit_prepare"] is False
    # litgpt holds the embedding and head in bf16: fewer parameter bytes than peft's recipe,
    # which upcasts them to fp32
    peft = json.loads(runner.invoke(app, args[:-3] + ["--json"]).stdout)
    assert data["by_category"]["parameters"] < peft["by_category"]["parameters"]
    assert "recipe" not in peft


def test_torchtune_says_compile_is_not_modelled():
    result = runner.invoke(app, ["estimate", *TINY, "-b", "2", "--gpu", "A100 80GB",
                                 "--lora", "r=8", "--recipe", "torchtune"])
    assert result.exit_code == 0, result.output
    assert "torch.compile is not modelled" in result.output
