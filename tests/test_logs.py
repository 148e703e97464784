"""torch.utils.cpp_extension's import-time "No CUDA runtime is found" notice is dropped,
and nothing else its logger says (issue 35, item 11)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"


@pytest.fixture()
def nvcc_env(tmp_path):
    """A CUDA toolkit on the PATH (a fake nvcc) and a torch without CUDA: what makes
    cpp_extension log its notice when it is imported."""
    bin_dir = tmp_path / "cuda" / "bin"
    bin_dir.mkdir(parents=True)
    nvcc = bin_dir / "nvcc"
    nvcc.write_text("#!/bin/sh\nexit 0\n")
    nvcc.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_HOME", "CUDA_PATH")}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}", PYTHONPATH=str(SRC),
               CUDA_VISIBLE_DEVICES="")
    return env


def run(code: str, env: dict[str, str]) -> str:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stderr


def test_the_notice_is_there_without_the_filter(nvcc_env):
    # the environment reproduces the chatter: the other tests can fail
    assert "No CUDA runtime is found" in run("import torch.utils.benchmark", nvcc_env)


def test_the_filter_drops_the_notice_and_only_it(nvcc_env):
    stderr = run("""
        import logging
        from batchfit._logs import without_cuda_home_notice
        with without_cuda_home_notice():
            import torch.utils.benchmark
            logging.getLogger("torch.utils.cpp_extension").warning("a real warning")
        logging.getLogger("torch.utils.cpp_extension").warning(
            "No CUDA runtime is found, after the import")
    """, nvcc_env)
    lines = stderr.splitlines()
    assert not any("CUDA_HOME" in line for line in lines), stderr
    assert "a real warning" in stderr
    assert "after the import" in stderr  # the filter is gone once the import is done


@pytest.mark.slow
def test_a_cpu_bench_prints_no_cuda_notice(nvcc_env, tmp_path):
    model = tmp_path / "model.py"
    model.write_text("from torch import nn\n\ndef mlp():\n    return nn.Linear(8, 2)\n")
    done = subprocess.run(
        [sys.executable, "-c", "from batchfit.cli import main; main()", "bench",
         f"{model}:mlp", "--input", "8", "--device", "cpu", "--batches", "1",
         "--time-budget", "5s", "--memory", "1GiB", "--json"],
        env=nvcc_env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "No CUDA runtime" not in done.stderr, done.stderr
