"""The two-batch estimators, their moving averages and Fieller's interval (no torch).

Expected values are worked out by hand from E|G_B|^2 = |G|^2 + f(B) tr(Σ) with
f(B) = 1/B (i.i.d.) or (N-B)/((N-1)B) (without replacement); the interval's coverage is
checked on simulated Gaussian gradients whose |G|^2 and tr(Σ) are known exactly.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchfit.errors import InvalidInputError
from batchfit.stats.estimator import (
    NoiseScaleEstimator,
    batch_variance_factor,
    chi2_quantile,
    fieller_interval,
    t_quantile,
    two_batch_estimates,
)


def test_expected_norms_give_back_the_parts_exactly():
    # |G|^2 = 1, tr(Σ) = 32: E|G_8|^2 = 1 + 32/8 = 5, E|G_64|^2 = 1 + 32/64 = 1.5
    g2, trace = two_batch_estimates(5.0, 1.5, 8, 64)
    assert g2 == pytest.approx(1.0) and trace == pytest.approx(32.0)


def test_finite_population_factor():
    # N = 100: f(10) = 90/990 = 1/11, f(50) = 50/4950 = 1/99
    assert batch_variance_factor(10, 100) == pytest.approx(1 / 11)
    assert batch_variance_factor(50, 100) == pytest.approx(1 / 99)
    # |G|^2 = 2, tr(Σ) = 99: E|G_10|^2 = 2 + 9 = 11, E|G_50|^2 = 2 + 1 = 3
    g2, trace = two_batch_estimates(11.0, 3.0, 10, 50, dataset_size=100)
    assert g2 == pytest.approx(2.0) and trace == pytest.approx(99.0)
    # the whole dataset as the big batch has no sampling noise: f(N) = 0
    assert batch_variance_factor(100, 100) == 0


def test_bad_batch_pair_is_refused():
    with pytest.raises(InvalidInputError, match="smaller than the big batch"):
        two_batch_estimates(1.0, 1.0, 64, 64)


def test_each_part_is_averaged_before_the_ratio():
    est = NoiseScaleEstimator(ema_decay=0.5)
    # per-step parts (|G|^2, tr Σ) chosen through the expectations: (1, 32), (3, 16), (2, 64)
    for g2, trace in [(1, 32), (3, 16), (2, 64)]:
        est.update(g2 + trace / 8, g2 + trace / 64, 8, 64)
    weights = [0.25, 0.5, 1.0]  # decay 0.5: the newest step weighs most
    g_avg = (0.25 * 1 + 0.5 * 3 + 1.0 * 2) / sum(weights)
    s_avg = (0.25 * 32 + 0.5 * 16 + 1.0 * 64) / sum(weights)
    assert est.grad_sq_norm == pytest.approx(g_avg)
    assert est.trace_sigma == pytest.approx(s_avg)
    assert est.b_simple == pytest.approx(s_avg / g_avg)  # not the mean of 32, 16/3, 32
    # n_eff = (Σw)^2 / Σw^2 = 1.75^2 / 1.3125
    assert est.effective_steps == pytest.approx(1.75 ** 2 / 1.3125)


def test_plain_mean_weighs_every_step_the_same():
    est = NoiseScaleEstimator()  # ema_decay=None
    for g2, trace in [(1, 30), (2, 40), (3, 50), (6, 0)]:
        est.update(g2 + trace / 4, g2 + trace / 16, 4, 16)
    assert est.grad_sq_norm == pytest.approx(3.0)
    assert est.trace_sigma == pytest.approx(30.0)
    assert est.effective_steps == pytest.approx(4.0)


def test_non_finite_steps_are_skipped():
    est = NoiseScaleEstimator()
    assert not est.update(math.inf, 1.0, 8, 64)
    assert est.update(5.0, 1.5, 8, 64)
    r = est.result()
    assert (r.steps, r.skipped_steps) == (1, 1)
    assert (r.ci_low, r.ci_high) == (0.0, math.inf)  # one step: no spread to go on


@pytest.mark.parametrize("probability, dof, table", [
    (0.975, 2, 4.303), (0.975, 5, 2.571), (0.975, 10, 2.228), (0.975, 30, 2.042),
    (0.95, 20, 1.725), (0.995, 4, 4.604)])
def test_t_quantile_matches_the_table(probability, dof, table):
    assert t_quantile(probability, dof) == pytest.approx(table, rel=0.01)


@pytest.mark.parametrize("probability, dof, table", [
    (0.2, 19, 13.716), (0.05, 10, 3.940), (0.95, 5, 11.070), (0.5, 30, 29.336)])
def test_chi2_quantile_matches_the_table(probability, dof, table):
    assert chi2_quantile(probability, dof) == pytest.approx(table, rel=0.01)


def test_steps_for_leans_on_the_upper_bound_of_the_spread():
    est = NoiseScaleEstimator()
    for g2, trace in [(1, 30), (2, 40), (3, 50), (6, 0), (2, 20), (1, 35)] * 4:
        est.update(g2 + trace / 4, g2 + trace / 16, 4, 16)
    r = est.result()
    n = r.effective_steps
    plain = n * (r.relative_halfwidth / 0.1) ** 2
    # 80% upper bound on a variance estimated from n = 24 steps: (n - 1) / chi2_0.2(n - 1)
    assert r.steps_for(0.1) == math.ceil(plain * (n - 1) / chi2_quantile(0.2, n - 1))
    assert r.steps_for(0.1, assurance=0.5) < r.steps_for(0.1)


def test_fieller_interval_by_hand():
    # 10/1 with Var(num)=1, Var(den)=0.01, t=2: a = 0.96, b = 10, c = 96, disc = 7.84
    low, high = fieller_interval(10.0, 1.0, 1.0, 0.01, 0.0, 2.0)
    assert low == pytest.approx((10 - 2.8) / 0.96)
    assert high == pytest.approx((10 + 2.8) / 0.96)


def test_fieller_interval_is_unbounded_when_the_denominator_may_be_zero():
    # den 0.1 +- 0.1 (t=2 covers 0): a = 0.01 - 0.04 < 0
    low, high = fieller_interval(1.0, 0.1, 0.01, 0.01, 0.0, 2.0)
    assert high == math.inf and 0 < low < 10


@settings(max_examples=200, deadline=None)
@given(num=st.floats(0.01, 1e3), den=st.floats(1e-3, 1e2), var_num=st.floats(0, 1e2),
       var_den=st.floats(0, 1e2), rho=st.floats(-0.99, 0.99), t=st.floats(0.5, 5))
def test_fieller_interval_always_holds_the_point_estimate(num, den, var_num, var_den, rho, t):
    cov = rho * math.sqrt(var_num * var_den)
    low, high = fieller_interval(num, den, var_num, var_den, cov, t)
    assert low <= num / den * (1 + 1e-9) + 1e-12
    assert high >= num / den * (1 - 1e-9) - 1e-12


def _simulated_run(rng: np.random.Generator, steps: int, grad: np.ndarray, sigma: np.ndarray,
                   batch_small: int, batch_big: int) -> NoiseScaleEstimator:
    """Per-example gradients G + N(0, diag(sigma^2)); micro-batch and big-batch norms."""
    est = NoiseScaleEstimator()
    micro = batch_big // batch_small
    for _ in range(steps):
        examples = grad + rng.standard_normal((batch_big, grad.size)) * sigma
        smalls = examples.reshape(micro, batch_small, -1).mean(1)
        est.update(float((smalls ** 2).sum(1).mean()), float((examples.mean(0) ** 2).sum()),
                   batch_small, batch_big)
    return est


def test_interval_covers_the_true_noise_scale_about_as_often_as_it_says():
    rng = np.random.default_rng(0)
    grad = np.full(16, 0.25)              # |G|^2 = 16 x 0.0625 = 1
    sigma = np.full(16, math.sqrt(2.0))   # tr(Σ) = 16 x 2 = 32: B_simple = 32
    covered, widths = 0, []
    runs = 300
    for _ in range(runs):
        est = _simulated_run(rng, 30, grad, sigma, 8, 64)
        low, high = est.interval()
        covered += low <= 32 <= high
        widths.append(est.result().relative_halfwidth)
    # 95% nominal; 300 runs: a binomial 2-sigma band is about +-2.5%
    assert 0.90 <= covered / runs <= 0.99
    assert all(w < 1 for w in widths)


def test_steps_for_a_target_width_is_met_by_a_fresh_run():
    rng = np.random.default_rng(1)
    grad, sigma = np.full(16, 0.25), np.full(16, math.sqrt(2.0))
    pilot = _simulated_run(rng, 20, grad, sigma, 8, 64).result()
    needed = pilot.steps_for(0.1)
    assert needed is not None and needed > 20
    hits = 0
    for _ in range(20):
        b_simple = _simulated_run(rng, needed, grad, sigma, 8, 64).b_simple
        hits += abs(b_simple - 32) <= 0.1 * 32
    assert hits >= 19  # a 95% half-width of 10%: within 10% in nearly every run


def test_bad_arguments():
    with pytest.raises(InvalidInputError, match="ema_decay"):
        NoiseScaleEstimator(ema_decay=1.0)
    with pytest.raises(InvalidInputError, match="confidence"):
        NoiseScaleEstimator(confidence=95)
    with pytest.raises(InvalidInputError, match="relative_halfwidth"):
        NoiseScaleEstimator().result().steps_for(0)


def test_result_to_dict_has_no_infinities():
    import json

    est = NoiseScaleEstimator()
    est.update(5.0, 1.5, 8, 64)
    data = est.result().to_dict()
    json.dumps(data, allow_nan=False)
    assert data["ci_high"] is None and data["steps"] == 1
