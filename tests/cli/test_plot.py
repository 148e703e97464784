"""The ``--plot`` figures' structure: legend beside the stacked bar, no overlapping tick
labels, axis units that fit the data, traced points marked as such, the timeline against
the step's phases, and no matplotlib warnings."""

from __future__ import annotations

import warnings

import pytest
from torch import nn

pytest.importorskip("matplotlib")

from batchfit import TensorSpec
from batchfit.answers.maxbatch import max_batch_size
from batchfit.cli.plot import byte_unit, max_batch_figure

MIB = 1 << 20


def _cnn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3),
                         nn.ReLU(), nn.Flatten(), nn.Linear(16 * 30 * 30, 10))


@pytest.fixture(scope="module")
def figure():
    import matplotlib.pyplot as plt

    result = max_batch_size(_cnn, TensorSpec((3, 32, 32)), device="cpu",
                            memory_bytes=64 * MIB, optimizer="adamw")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a layout warning (tight_layout's) fails the test
        fig = max_batch_figure(result)
    yield fig, result
    plt.close(fig)


def _boxes(fig, texts):
    renderer = fig.canvas.get_renderer()
    return [t.get_window_extent(renderer) for t in texts if t.get_visible() and t.get_text()]


def test_byte_unit_follows_the_data():
    assert byte_unit(300 * MIB) == ("MiB", float(MIB))
    assert byte_unit(1023 * MIB)[0] == "MiB"
    assert byte_unit(1 << 30) == ("GiB", float(1 << 30))
    assert byte_unit(43 * (1 << 30))[0] == "GiB"


def test_axes_of_a_small_model_are_in_mib(figure):
    fig, _ = figure
    memory, bar, timeline = fig.axes[:3]
    # a 64 MiB card: nothing reaches 1 GiB
    assert [ax.get_ylabel() for ax in (memory, bar, timeline)] == ["MiB"] * 3


def test_legend_sits_beside_the_stacked_bar(figure):
    fig, _ = figure
    bar = fig.axes[1]
    renderer = fig.canvas.get_renderer()
    legend = bar.get_legend().get_window_extent(renderer)
    for patch in bar.patches:
        assert not legend.overlaps(patch.get_window_extent(renderer))
    assert legend.x0 >= bar.get_window_extent(renderer).x1


def test_traced_points_are_markers_and_the_interpolation_is_labelled(figure):
    fig, result = figure
    lines = {line.get_label(): line for line in fig.axes[0].get_lines()}
    traced = lines[f"traced ({len(result.evaluated)})"]
    assert traced.get_linestyle() == "None" and traced.get_marker() == "o"
    assert len(traced.get_xdata()) == len(result.evaluated) >= 2
    assert lines["interpolated (not traced)"].get_linestyle() == ":"


def test_timeline_is_against_the_phases_with_no_overlapping_labels(figure):
    fig, _ = figure
    timeline = fig.axes[2]
    assert timeline.get_xlabel() == "phase of the step"
    names = [t.get_text() for t in timeline.get_xticklabels()]
    assert {"forward", "backward", "optimizer"} <= set(names)
    for ax in fig.axes:
        boxes = _boxes(fig, ax.get_xticklabels())
        assert not any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1:])
    assert any(line.get_label().startswith("peak") for line in timeline.get_lines())
