"""``batchfit noise`` and ``batchfit recommend`` asked in words (issue 40): the library,
given a workload file and the commands' option names, answers what the command answers, and
names its options in the caller's vocabulary."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

import batchfit
from batchfit.cli import app
from tests.cli.test_noise_cli import workload_file  # noqa: F401 - the shared fixture

runner = CliRunner()


def _cli(*args: str) -> dict:
    result = runner.invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_noise_in_words_is_the_command(workload_file):  # noqa: F811
    workload = f"{workload_file}:trains"
    cli = _cli("noise", workload, "--steps", "12", "--batch-small", "4", "--batch-big", "32")
    answer = batchfit.noise_scale(workload, steps=12, batch_small=4, batch_big=32)
    assert answer.to_dict() == cli
    assert answer.b_simple == cli["b_simple"] > 0  # the result reads through the answer


def test_recommend_in_words_is_the_command(workload_file):  # noqa: F811
    """The command and the library make the same one call (the command adds a progress
    display per phase) and give the same JSON: the factory's SGD, the data's size as the
    batch limit, fp32 and the current batch defaulting to batch_big."""
    workload = f"{workload_file}:trains"
    cli = _cli("recommend", workload, "--steps", "12", "--gpu", "A100", "--predict",
               "--batches", "8,64,512")
    answer = batchfit.recommend_batch_size(workload, steps=12, gpu="A100", predict=True,
                                           batches="8,64,512")
    assert answer.to_dict() == cli
    assert cli["current_batch_size"] == 64 and cli["learning_rate"]["rule"] == "linear"
    assert cli["noise"]["method"] != "given" and cli["predicted"] is True


@pytest.mark.parametrize(("call", "words", "line"), [
    ("recommend", {"predict": True}, "predict=True needs gpu='NAME'"),
    ("recommend", {"gpu": "A100"}, "gpu goes with predict=True"),
    ("recommend", {"noise_scale": -3}, "noise_scale must be a positive number"),
    ("recommend", {"current_batch": 0}, "current_batch must be a positive integer"),
    ("recommend", {"stack": "torch1.12+cu113"}, "stack describes a predicted process"),
    ("noise", {"train": True}, "train=True needs an optimizer"),
])
def test_library_messages_name_keywords(workload_file, call, words, line):  # noqa: F811
    function = batchfit.recommend_batch_size if call == "recommend" else batchfit.noise_scale
    with pytest.raises(batchfit.InvalidInputError) as info:
        function(f"{workload_file}:build", **words)
    assert line in str(info.value) and "--" not in str(info.value)


def test_the_engine_forms_still_answer():
    """A noise scale and a curve (not a workload name) still reach the engine's function."""
    rec = batchfit.recommend_batch_size(32.0, [(8, 0.01), (64, 0.02)], max_batch_size=64,
                                        current_batch_size=8)
    assert isinstance(rec, batchfit.Recommendation) and rec.b_noise == 32.0
    assert 8 <= rec.recommended_batch_size <= 64


def test_recommend_builds_the_workload_once(tmp_path):
    """The command measures the noise and then the curve on one loaded workload, as the
    library's one call does (it used to build a large factory twice), and still shows
    the noise phase's progress (the prediction's spinner prints only when it lasts)."""
    calls = tmp_path / "calls.txt"
    path = tmp_path / "counted.py"
    path.write_text(
        "import torch\nfrom torch import nn\n\n"
        "def counted():\n"
        f"    with open({str(calls)!r}, 'a') as f:\n"
        "        f.write('built\\n')\n"
        "    torch.manual_seed(0)\n"
        "    x = torch.randn(512, 8, generator=torch.Generator().manual_seed(0))\n"
        "    model = nn.Linear(8, 1)\n"
        "    loss = lambda m, b: 0.5 * (m(b[0]) - b[1]).square().mean()\n"
        "    return model, (x, x.sum(1, keepdim=True)), loss, "
        "torch.optim.SGD(model.parameters(), lr=0.05)\n")
    args = ["recommend", f"{path}:counted", "--steps", "6", "--gpu", "A100", "--predict",
            "--batches", "8,64"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert calls.read_text().count("built") == 1
    assert "measuring the noise scale: step 6 of 6" in result.output
    calls.unlink()
    cli = _cli(*args)
    answer = batchfit.recommend_batch_size(f"{path}:counted", steps=6, gpu="A100",
                                           predict=True, batches="8,64")
    assert calls.read_text().count("built") == 2  # one each: the command, the library
    assert answer.to_dict() == cli
