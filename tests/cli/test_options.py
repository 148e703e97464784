"""The CLI declared once (issue 40): help that reads at 80 columns, one table of flags for
the library's keywords, messages in the caller's vocabulary, and commands that import no
private helper of ``app.py``."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

import batchfit
from batchfit.api.answers import PARALLEL_WORDS, STACK_WORDS, STEP_WORDS, TARGET_WORDS
from batchfit.cli import app
from batchfit.cli.options import FLAGS
from batchfit.errors import InvalidInputError, option, option_vocabulary

SRC = Path(__file__).resolve().parents[2] / "src"
runner = CliRunner()


def _help(command: str) -> str:
    env = {**os.environ, "COLUMNS": "80", "PYTHONPATH": str(SRC)}
    done = subprocess.run([sys.executable, "-c", "from batchfit.cli import main; main()",
                           command, "--help"], capture_output=True, text=True, env=env,
                          timeout=120, check=True)
    return done.stdout


def _flags(command: str) -> list[str]:
    click_command = typer.main.get_command(app).commands[command]
    return [name for param in click_command.params
            for name in (*param.opts, *param.secondary_opts) if name.startswith("-")]


@pytest.mark.parametrize("command", ["max", "estimate"])
def test_help_reads_at_80_columns(command):
    text = _help(command)
    lines = text.splitlines()
    assert len(lines) <= 120
    assert max(len(line) for line in lines) <= 80
    # every option name in full: as a whole word, never cut with an ellipsis
    for flag in _flags(command):
        assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text), flag
    assert not re.search(r"-[\w-]*…", text)


def test_help_groups_options_in_panels():
    text = _help("max")
    panels = re.findall(r"╭─ ([^─]+?) ─", text)
    assert panels[:1] == ["Arguments"]
    assert {"Model", "Step", "Device and stack", "LLM fine-tuning", "Multi-GPU",
            "Output"} <= set(panels)


def test_every_library_keyword_has_one_flag():
    """The keywords batchfit.api takes are exactly the flags' names, dashes for underscores
    (--input, the one exception, takes input_shape: `input` is a builtin)."""
    keywords = {*STEP_WORDS, *STACK_WORDS, *TARGET_WORDS, *PARALLEL_WORDS, "batch_size",
                "margin", "max_batch_limit", "snapshot"}
    assert keywords <= set(FLAGS)
    declared = set(_flags("max")) | set(_flags("estimate"))
    for keyword in keywords:
        assert FLAGS[keyword] in declared, keyword
        if keyword != "input_shape":
            assert FLAGS[keyword] == "--" + keyword.replace("_", "-")


def test_option_names_follow_the_callers_vocabulary():
    assert option("seq_len") == "seq_len"
    assert option("memory", "16GiB") == "memory='16GiB'"
    with option_vocabulary(FLAGS):
        assert option("seq_len") == "--seq-len"
        assert option("memory", "16GiB") == "--memory 16GiB"
        assert option("checkpointing", True) == "--checkpointing"
        assert option("checkpointing", False) == "--no-checkpointing"
        assert option("use_reentrant", False) == "--no-use-reentrant"
    assert option("use_reentrant", False) == "use_reentrant=False"


def test_a_library_error_names_the_keyword_and_the_cli_the_flag(tmp_path):
    path = tmp_path / "net.py"
    path.write_text("from torch import nn\nfrom batchfit import TensorSpec\n\n"
                    "def net():\n    return nn.Linear(4, 2), TensorSpec((4,))\n")
    with pytest.raises(InvalidInputError, match=r"^grad_accum must be a positive integer"):
        batchfit.estimate(f"{path}:net", batch_size=2, grad_accum=0)
    result = runner.invoke(app, ["estimate", f"{path}:net", "-b", "2", "--grad-accum", "0"])
    assert result.exit_code == 2
    assert "error: --grad-accum must be a positive integer, not 0" in result.output
    assert "Traceback" not in result.output
    with pytest.raises(InvalidInputError, match=r"strategy is a multi-GPU option: add "
                                                r"world_size='N'"):
        batchfit.max_batch_size(f"{path}:net", gpu="T4", strategy="fsdp")
    result = runner.invoke(app, ["max", f"{path}:net", "--gpu", "T4", "--strategy", "fsdp"])
    assert result.exit_code == 2
    assert "--strategy is a multi-GPU option: add --world-size N" in result.output


def test_an_unknown_keyword_names_the_closest():
    with pytest.raises(InvalidInputError, match="unknown keyword 'seqlen': did you mean seq_len"):
        batchfit.estimate("timm:resnet18", batch_size=2, seqlen=128)


def test_commands_import_no_private_helper_of_app():
    for path in (SRC / "batchfit" / "cli").glob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "batchfit.cli.app":
                private = [a.name for a in node.names if a.name.startswith("_")]
                assert not private, f"{path.name} imports {private} from app.py"


def test_the_cli_modules_stay_under_800_lines():
    for path in (SRC / "batchfit" / "cli").glob("*.py"):
        assert len(path.read_text(encoding="utf-8").splitlines()) < 800, path.name
