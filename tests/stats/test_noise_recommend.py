"""The recommendation: T(B) = (1 + B_noise/B) step_time(B) within memory, and the
learning-rate rules. Every expected value is computed by hand in the test."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from batchfit.errors import InvalidInputError
from batchfit.stats.estimator import NoiseScale
from batchfit.stats.recommend import (
    PROXY_CAVEAT,
    CurvePoint,
    OptimizerFamily,
    curve_points,
    learning_rate_change,
    recommend_batch_size,
)

#: step time grows linearly past a fixed cost: t(B) = 0.008 + 0.00025 B
LINEAR = [(b, 0.008 + 0.00025 * b) for b in (4, 8, 16, 32, 64, 128, 256)]


def test_the_batch_with_the_least_time_to_target_wins():
    # T(B) = (1 + 64/B)(0.008 + 0.00025 B) is least at B = sqrt(64 x 0.008 / 0.00025) = 45.25;
    # on the grid: T(32) = 3 x 0.016 = 0.048, T(48) = (1 + 4/3) x 0.020 = 0.04667,
    # T(64) = 2 x 0.024 = 0.048
    r = recommend_batch_size(64.0, LINEAR, max_batch_size=256, current_batch_size=8)
    assert r.recommended_batch_size == 48
    assert not r.option(48).measured and r.option(64).measured
    assert r.option(48).step_s == pytest.approx(0.020)  # interpolated between 32 and 64
    assert r.option(48).time_factor == pytest.approx(7 / 3 * 0.020)
    # current: T(8) = 9 x 0.010 = 0.090
    assert r.speedup_vs_current == pytest.approx(0.090 / (7 / 3 * 0.020))
    assert r.option(64).steps_factor == pytest.approx(2.0)
    assert r.option(64).samples_factor == pytest.approx(2.0)
    assert r.samples_2x_batch_size == 64 and r.samples_2x_fits
    assert r.caveat == PROXY_CAVEAT


def test_the_memory_limit_caps_the_choice():
    # with B_noise = 1000 the optimum sqrt(1000 x 32) = 179 is above the limit of 100:
    # the largest candidate that fits, 96 (grid) wins over 64
    r = recommend_batch_size(1000.0, LINEAR, max_batch_size=100, current_batch_size=8)
    assert max(o.batch_size for o in r.options) == 64  # no extrapolation past 64
    assert r.recommended_batch_size == 64
    assert r.samples_2x_batch_size == 1000 and not r.samples_2x_fits


def test_failed_points_lower_the_limit():
    bench = SimpleNamespace(max_batch_size=256, points=[
        SimpleNamespace(batch_size=b, step_s=t, peak_bytes=b * 10, fits=True) for b, t in LINEAR
        if b <= 64] + [SimpleNamespace(batch_size=128, step_s=None, peak_bytes=None, fits=False)])
    points, limit = curve_points(bench)
    assert limit == 127 and [p.batch_size for p in points] == [4, 8, 16, 32, 64]
    assert points[0] == CurvePoint(4, pytest.approx(0.009), 40)


def test_the_interval_gives_a_range():
    # B_noise in [16, 256]: argmins sqrt(16 x 32) = 22.6 -> 24 on the grid
    # (T(24) = (1 + 16/24) x 0.014 = 0.02333 < T(16) = 2 x 0.012 = 0.024, T(32) = 1.5 x 0.016);
    # sqrt(256 x 32) = 90.5 -> 96 (T(96) = (1 + 8/3) x 0.032 = 0.11733 < T(64) = 5 x 0.024,
    # T(128) = 3 x 0.040)
    noise = NoiseScale(b_simple=64.0, grad_sq_norm=1.0, trace_sigma=64.0, ci_low=16.0,
                       ci_high=256.0, confidence=0.95, steps=50, effective_steps=50.0,
                       batch_small=8, batch_big=64)
    r = recommend_batch_size(noise, LINEAR, max_batch_size=256, current_batch_size=48)
    assert r.range_batch_sizes == (24, 96)
    assert r.b_noise_ci == (16.0, 256.0)
    # an unbounded interval: the top of the range is the largest batch that fits
    unbounded = recommend_batch_size(64.0, LINEAR, max_batch_size=256, current_batch_size=48,
                          b_noise_ci=(16.0, math.inf))
    assert unbounded.range_batch_sizes == (24, 256)


def test_learning_rate_rules():
    sgd = learning_rate_change(32, 128, 64.0, "momentum")
    assert (sgd.rule, sgd.factor) == ("linear", 4.0)
    assert sgd.noise_aware_factor == pytest.approx((1 + 64 / 32) / (1 + 64 / 128))
    assert "Goyal" in sgd.citation and "McCandlish" in sgd.noise_aware_citation
    adam = learning_rate_change(32, 128, 64.0, "adamw")
    assert (adam.rule, adam.factor) == ("sqrt", 2.0)
    assert adam.noise_aware_factor == pytest.approx(math.sqrt(3 / 1.5))
    assert "Malladi" in adam.citation
    # far below B_noise the noise-aware rule is the linear one: (1 + 1e6/8)/(1 + 1e6/16) ~ 2
    assert learning_rate_change(8, 16, 1e6, "sgd").noise_aware_factor == pytest.approx(2, rel=1e-4)
    down = learning_rate_change(64, 16, 32.0, "sgd")
    assert down.noise_aware_factor == pytest.approx(1.5 / 3) and "multiply" in down.text
    assert "keep" in learning_rate_change(16, 16, 32.0, "sgd").text


def test_optimizer_families():
    import torch

    assert OptimizerFamily.of("nesterov") is OptimizerFamily.SGD
    assert OptimizerFamily.of(torch.optim.AdamW) is OptimizerFamily.ADAM
    assert OptimizerFamily.of("Adafactor") is OptimizerFamily.ADAM
    with pytest.raises(InvalidInputError, match="unknown optimizer"):
        OptimizerFamily.of("shampoo")


def test_current_batch_outside_the_curve_has_no_speedup():
    r = recommend_batch_size(64.0, LINEAR, max_batch_size=256, current_batch_size=1024)
    assert r.speedup_vs_current is None
    assert r.learning_rate.from_batch_size == 1024


@pytest.mark.parametrize("kwargs, match", [
    ({"b_noise": 0.0}, "positive"),
    ({"b_noise": math.nan}, "positive"),
    ({"max_batch_size": 0}, "max_batch_size"),
    ({"current_batch_size": 2.5}, "current_batch_size"),
    ({"max_batch_size": 2}, "no throughput point"),
])
def test_bad_input(kwargs, match):
    args = {"b_noise": 64.0, "points": LINEAR, "max_batch_size": 256, "current_batch_size": 8,
            **kwargs}
    with pytest.raises(InvalidInputError, match=match):
        recommend_batch_size(args.pop("b_noise"), args.pop("points"), **args)


def test_to_dict_is_json():
    import json

    r = recommend_batch_size(64.0, LINEAR, max_batch_size=256, current_batch_size=8,
                  b_noise_ci=(30.0, math.inf))
    data = json.loads(json.dumps(r.to_dict(), allow_nan=False))
    assert data["recommended_batch_size"] == 48 and data["b_noise_ci"] == [30.0, None]
    assert data["learning_rate"]["rule"] == "linear"
