"""The dev-set harness builds each row's model with the timm release that produced the
row's file (``benchmarks/gpu_brackets.py``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
gb = pytest.importorskip("gpu_brackets")


def make_row(source_file: str, set_: str = "I") -> gb.Row:
    return gb.Row(file="memory", index=0, set=set_, model="m", img_size=224, gpu="RTX 4090",
                  torch="2.4.0", layout="nchw", batch_fit=1, batch_failed=2,
                  source_file=source_file)


@pytest.mark.parametrize("source_file, release", [
    # pt240 files were committed to pytorch-image-models/results just after v1.0.9,
    # the pt291 files in the commit tagged v1.0.24
    ("benchmark-infer-amp-nchw-pt240-cu124-rtx4090.csv", "1.0.9"),
    ("benchmark-infer-amp-nhwc-pt240-cu124-rtx3090.csv", "1.0.9"),
    ("benchmark-infer-amp-nchw-pt291-cu130-pro6000maxq.csv", "1.0.24"),
    # timm 0.6 (2022) does not import on Python 3.11: the installed timm
    ("benchmark-train-amp-nchw-pt112-cu113-rtx3090.csv", None),
])
def test_the_release_of_each_file(source_file, release):
    assert make_row(source_file).timm_release == release


def test_missing_releases_are_named(tmp_path):
    (tmp_path / "1.0.9" / "timm").mkdir(parents=True)
    rows = [make_row("benchmark-infer-amp-nchw-pt240-cu124-rtx4090.csv"),
            make_row("benchmark-infer-amp-nchw-pt291-cu128-4090.csv"),
            make_row("benchmark-train-amp-nchw-pt112-cu113-rtx3090.csv", "T")]
    assert gb.missing_timm_releases(rows, tmp_path) == ["1.0.24"]


def test_a_row_imports_its_release_in_place_of_the_loaded_timm(tmp_path):
    release = tmp_path / "9.9.9" / "timm"
    release.mkdir(parents=True)
    (release / "__init__.py").write_text("__version__ = '9.9.9'\n")
    script = (f"import sys; sys.path.insert(0, {str(BENCHMARKS)!r}); import timm; "
              "import gpu_brackets as gb; from pathlib import Path; "
              f"gb.use_timm_release('9.9.9', Path({str(tmp_path)!r})); "
              "import timm as again; print(timm.__version__ != again.__version__, again.__version__)")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "9.9.9"]


def test_a_run_installs_the_releases_it_lacks(tmp_path, monkeypatch):
    installed = []

    def install(timm_dir):
        installed.append(timm_dir)
        raise subprocess.CalledProcessError(1, ["pip"])  # stop before predicting anything

    monkeypatch.setattr(gb, "install_timm_releases", install)
    with pytest.raises(SystemExit):
        gb.main(["--set", "I", "--files", "memory", "--models", "^convnext_small$",
                 "--tag", "never-written", "--timm-dir", str(tmp_path)])
    assert installed == [tmp_path]


def test_when_the_install_fails_the_run_stops_in_one_line(tmp_path, monkeypatch, capsys):
    def install(timm_dir):
        raise subprocess.CalledProcessError(1, ["pip", "install"])

    monkeypatch.setattr(gb, "install_timm_releases", install)
    with pytest.raises(SystemExit) as exc_info:
        gb.main(["--set", "I", "--files", "memory", "--models", "^convnext_small$",
                 "--tag", "never-written", "--timm-dir", str(tmp_path)])
    assert exc_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("timm 1.0.24 (the release the rows ran) could not be installed into ")
    assert err.endswith("install it with --install-timm, or pass --timm installed")
    assert "\n" not in err


def test_a_model_that_builds_only_for_real_is_built_on_the_cpu(monkeypatch):

    real = gb.build_timm

    def needs_real_tensors(name, fused_attn):
        # like timm 1.0.9's hybrid embedding, which runs its backbone on a zero CPU image:
        # fails on meta and with empty (meta) weights alike
        model = real(name, fused_attn)
        if next(model.parameters()).device.type != "cpu":
            raise RuntimeError("Tensor on device meta is not on the expected device cpu!")
        return model

    monkeypatch.setattr(gb, "build_timm", needs_real_tensors)
    row = gb.Row(file="memory", index=0, set="I", model="test_resnet", img_size=32,
                 gpu="RTX 4090", torch="2.4.0", layout="nchw", batch_fit=1, batch_failed=2,
                 source_file="benchmark-infer-amp-nchw-pt240-cu124-rtx4090.csv")
    got = gb.predict_row(row)
    assert got["built"] == "cpu"
    assert got["predicted"] == row.start_size  # a tiny model fills no card: the start size
