"""The dev-set report's check for models no single scale of the prediction fits
(``benchmarks/gpu_brackets.py``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
gb = pytest.importorskip("gpu_brackets")


def row(gpu: str, fit: int, failed: int, predicted: int, binding: str = "memory",
        model: str = "m") -> dict:
    return {"set": "I", "model": model, "gpu": gpu, "torch": "2.4.0", "layout": "nchw",
            "batch_fit": fit, "batch_failed": failed, "predicted": predicted,
            "binding_constraint": binding, "file": "memory"}


def test_a_model_whose_cards_disagree_has_no_common_scale():
    # 735 on both cards: x1.045 reaches 768 (the first card's fit) but the second failed at
    # 768 (x1.045 is its failed/predicted), so no k satisfies both
    rows = [row("a", 768, 1024, 735), row("b", 512, 768, 735)]
    assert list(gb.without_common_scale(rows)) == ["I m"]


def test_a_model_one_scale_fits_and_rows_a_kernel_limit_binds_are_left_out():
    # k = 1.05: 735 -> 772 in [768, 1024), 700 -> 735 in [700, 1024)
    assert gb.without_common_scale([row("a", 768, 1024, 735), row("b", 700, 1024, 700)]) == {}
    # the second row's answer is a kernel limit, not memory: one memory row is no comparison
    assert gb.without_common_scale([row("a", 768, 1024, 735),
                                    row("b", 512, 768, 735, "int32_indexing")]) == {}


def test_the_report_counts_the_misses_of_those_models():
    rows = [row("a", 768, 1024, 735), row("b", 512, 768, 735),  # one under, one in
            row("a", 256, 384, 300, model="n"), row("b", 256, 384, 310, model="n")]
    text = "\n".join(gb._no_common_scale_lines(rows))
    assert "1 of 2 models with two or more memory-bound rows; 1 of their 2 rows miss" in text
    assert "- I m: a 2.4.0 nchw [768, 1024) vs 735, b 2.4.0 nchw [512, 768) vs 735" in text
