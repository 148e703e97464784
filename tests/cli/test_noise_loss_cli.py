"""``batchfit noise`` with the losses people write (``nn.MSELoss()``, ``lambda out, y``),
and the NaN losses and string datasets it refuses with one line."""

from __future__ import annotations

import json
import textwrap

import pytest
from typer.testing import CliRunner

from batchfit.cli import app

runner = CliRunner()


@pytest.fixture(scope="module")
def factory_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("noise_loss") / "regression.py"
    path.write_text(textwrap.dedent("""
        import torch
        from torch import nn

        def _data(n=50_000, d=4, sigma=2.0, nan=False):
            g = torch.Generator().manual_seed(1)
            x = torch.randn(n, d, generator=g)
            y = x @ torch.ones(d, 1) + sigma * torch.randn(n, 1, generator=g)
            if nan:
                x[:, 0] = float("nan")
            return x, y

        def _model():
            model = nn.Linear(4, 1, bias=False)
            nn.init.zeros_(model.weight)
            return model

        def mse_module():
            return _model(), _data(), nn.MSELoss()

        def mse_lambda():
            return _model(), _data(), lambda out, y: (out - y).square().mean()

        def nan_loss():
            return _model(), _data(n=512, nan=True), nn.MSELoss()

        def string_data():
            return _model(), "data/train.csv", nn.MSELoss()
    """))
    return path


@pytest.mark.parametrize("factory", ["mse_module", "mse_lambda"])
def test_noise_of_a_criterion_matches_the_closed_form(factory_file, factory):
    """B_simple = (d + 1) + d s^2 / |w - w*|^2 = 5 + 4 * 4 / 4 = 9 for this factory (d = 4,
    s = 2, w = 0, w* = 1); the derivation is in
    tests/stats/test_noise_loss.py::test_noise_scale_of_a_criterion_matches_the_closed_form."""
    result = runner.invoke(app, ["noise", f"{factory_file}:{factory}", "--batch-small", "8",
                                 "--batch-big", "128", "--steps", "300", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["b_simple"] == pytest.approx(9.0, rel=0.10)


@pytest.mark.parametrize("factory, message", [
    ("nan_loss", "the loss is nan"),
    ("string_data", "the data is a str"),
])
def test_noise_refuses_with_one_line(factory_file, factory, message):
    result = runner.invoke(app, ["noise", f"{factory_file}:{factory}", "--batch-small", "8",
                                 "--batch-big", "64", "--steps", "4"])
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_noise_help_states_the_factory_contract():
    result = runner.invoke(app, ["noise", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    text = " ".join(result.output.split())
    for phrase in ("loss_fn(model, batch)", "criterion(output, target)", "nn.MSELoss()"):
        assert phrase in text
