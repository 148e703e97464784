"""The search: the torch-free loop on synthetic devices (hypothesis), then real searches on a
capped CPU whose answer is derived by hand, with predictions four times off."""

from __future__ import annotations

import hashlib
import math
import os
import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from batchfit.errors import DoesNotFitError, InvalidInputError
from batchfit.realrun.boundary import (
    Outcome,
    SearchLog,
    SearchPlan,
    recommended_batch,
    search_boundary,
)
from batchfit.realrun.search import search_max_batch

pytestmark = pytest.mark.slow  # real steps in capped fresh processes (the real-device search)

MIB = 1 << 20


# --------------------------------------------------------------------------- synthetic devices


def affine_device(intercept: int, per_sample: int, limit: int):
    """A device whose step uses ``intercept + per_sample * B`` bytes: B fits while that is
    within ``limit``; a fitting trial reports its usage, a failing one nothing."""

    def evaluate(batch_size: int) -> Outcome:
        used = intercept + per_sample * batch_size
        fits = used <= limit
        return Outcome(batch_size, fits, used if fits else None)

    return evaluate


def boundary_device(true_max: int):
    """A device that says only fits / does not fit."""
    return lambda batch_size: Outcome(batch_size, batch_size <= true_max)


ANY_FACTOR = st.floats(0.25, 4.0)


@st.composite
def devices(draw, factor=ANY_FACTOR):
    """(true max T, intercept, per-sample bytes, limit, prediction): limit chosen so that T
    is the boundary by construction: T fits, T + 1 is over by at least one byte."""
    true_max = draw(st.integers(1, 5000))
    per_sample = draw(st.integers(1, 10**7))
    intercept = draw(st.integers(0, 10**9))
    limit = intercept + per_sample * true_max + draw(st.integers(0, per_sample - 1))
    predicted = max(1, round(true_max * draw(factor)))
    return true_max, intercept, per_sample, limit, predicted


def log_bound(true_max: int, predicted: int) -> int:
    return 2 * math.ceil(math.log2(max(true_max, predicted) + 1)) + 8


@settings(max_examples=300, deadline=None)
@given(devices(), st.one_of(st.none(), st.floats(0.8, 1.25)))
def test_answer_is_the_exact_boundary_from_any_prediction(device, slope_error):
    true_max, intercept, per_sample, limit, predicted = device
    slope = None if slope_error is None else per_sample * slope_error
    plan = SearchPlan(predicted=predicted, limit_bytes=limit, bytes_per_sample=slope)
    log = search_boundary(affine_device(intercept, per_sample, limit), plan)
    assert log.lower == true_max
    assert len(log.outcomes) <= log_bound(true_max, predicted)
    tried = [o.batch_size for o in log.outcomes]
    assert len(tried) == len(set(tried))  # isolated trials are never repeated


@settings(max_examples=300, deadline=None)
@given(devices(factor=st.floats(0.95, 1.05)), st.floats(0.0, 0.05))
def test_good_prediction_costs_one_failure_and_at_most_four_trials(device, slope_error):
    # The prediction within 5% of the truth and its per-sample slope exact or up to 5%
    # high: the seed (10% below) fits, the model approaches from below, and only the final
    # confirmation (T + 1) fails.
    true_max, intercept, per_sample, limit, predicted = device
    if true_max < 64:  # the seed needs room below T for two distinct measurements
        true_max, limit = true_max + 64, limit + 64 * per_sample
        predicted = max(1, round(predicted * true_max / (true_max - 64)))
    plan = SearchPlan(predicted=predicted, limit_bytes=limit,
                      bytes_per_sample=per_sample * (1 + slope_error))
    log = search_boundary(affine_device(intercept, per_sample, limit), plan)
    assert log.lower == true_max
    assert log.failures == 1
    assert len(log.outcomes) <= 4


@settings(max_examples=300, deadline=None)
@given(devices(factor=st.floats(0.5, 2.0)), st.data())
def test_a_seed_on_the_predicted_line_costs_three_trials(device, data):
    # The CPU's prediction is a line traced from batch 16 on, exact in its slope: a first
    # trial anywhere below the boundary measures the rest (the intercept), the model
    # lands on T, and T + 1 confirms it. Only the seed's position may vary.
    true_max, intercept, per_sample, limit, predicted = device
    seed = data.draw(st.integers(1, true_max))
    plan = SearchPlan(predicted=max(predicted, seed), limit_bytes=limit,
                      bytes_per_sample=per_sample, seed=seed)
    log = search_boundary(affine_device(intercept, per_sample, limit), plan)
    assert log.lower == true_max
    tried = [o.batch_size for o in log.outcomes]
    assert tried == ([seed] if seed < true_max else []) + [true_max, true_max + 1]


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 100_000), st.floats(0.25, 4.0))
def test_without_measurements_the_bracket_search_is_logarithmic(true_max, factor):
    predicted = max(1, round(true_max * factor))
    plan = SearchPlan(predicted=predicted, max_batch_size=1 << 20)
    log = search_boundary(boundary_device(true_max), plan)
    assert log.lower == true_max
    assert len(log.outcomes) <= log_bound(true_max, predicted)


@settings(max_examples=200, deadline=None)
@given(devices(), st.integers(1, 50))
def test_in_process_failures_after_a_failure_are_reverified(device, depth):
    # In-process trials: right after an out-of-memory error the heap is fragmented, and a
    # batch within ``depth`` of the boundary fails although it would fit in a fresh process;
    # the search re-runs such a failure in a clean state (``verify``) before believing it.
    true_max, intercept, per_sample, limit, predicted = device
    fresh = affine_device(intercept, per_sample, limit)
    history: list[bool] = []

    def evaluate(batch_size: int) -> Outcome:
        outcome = fresh(batch_size)
        if outcome.fits and history and not history[-1] and batch_size > true_max - depth:
            outcome = Outcome(batch_size, False)
        history.append(outcome.fits)
        return outcome

    plan = SearchPlan(predicted=predicted, limit_bytes=limit, bytes_per_sample=per_sample,
                      isolated=False)
    log = search_boundary(evaluate, plan, verify=fresh)
    assert log.lower == true_max
    assert log.upper in log.trusted or log.lower >= plan.max_batch_size
    # Each failure after the first costs one clean re-run, no more.
    assert len(log.outcomes) <= 2 * log_bound(true_max, predicted)


def test_batch_limit_caps_the_answer():
    log = search_boundary(boundary_device(10**9), SearchPlan(predicted=100, max_batch_size=512))
    assert log.lower == 512
    assert log.upper is None


def test_nothing_fits_ends_at_batch_one():
    log = search_boundary(boundary_device(0), SearchPlan(predicted=64))
    assert log.lower == 0
    assert log.outcomes[-1] == Outcome(1, False)


def test_bad_plans_are_rejected():
    with pytest.raises(InvalidInputError):
        search_boundary(boundary_device(5), SearchPlan(predicted=0))
    with pytest.raises(InvalidInputError):
        search_boundary(boundary_device(5), SearchPlan(predicted=5, approach=1.5))


def test_recommended_batch_keeps_the_allocator_overhead_free():
    # Limit 1000 B, 10 B per sample, the maximum 90 used 990 B of which 80 B was allocator
    # overhead (more than 5% of the limit, 50 B): keep 80 B free -> usage <= 920 B -> seven
    # samples fewer (990 - 920 = 70 B = 7 samples): 83.
    log = SearchLog(SearchPlan(predicted=90, limit_bytes=1000, bytes_per_sample=10))
    log.record(Outcome(90, True, 990))
    log.record(Outcome(91, False))
    assert recommended_batch(log, overhead_bytes=80, min_headroom=0.05) == 83
    # A small overhead: the 5% floor (50 B) rules -> usage <= 950 B -> 86.
    assert recommended_batch(log, overhead_bytes=10, min_headroom=0.05) == 86
    # No usage model: 5% below the maximum.
    bare = SearchLog(SearchPlan(predicted=90))
    bare.record(Outcome(90, True))
    assert recommended_batch(bare, overhead_bytes=None, min_headroom=0.05) == 85


# --------------------------------------------------------------------------- real capped CPU


class Broadcast(nn.Module):
    """Each sample becomes ``2**20`` float32 values (4 MiB) scaled by one parameter. A
    training step's peak, by hand: the broadcast tensor (4 MiB, saved by the multiply),
    mean's full-size gradient (4 MiB) and ``grad * big`` (4 MiB) in backward: 12 MiB per
    sample, plus bytes. Under a 100 MiB cap: 8 samples (96 MiB) fit, 9 (108 MiB) cannot."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        big = x.unsqueeze(-1).expand(-1, 1, 2**20).contiguous()
        return self.scale * big


CAP = 100 * MIB
TRUE_MAX = 8


@pytest.fixture(scope="module")
def server():
    from batchfit.realrun.trial_server import TrialServer

    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "OMP_NUM_THREADS": "1"}
    with TrialServer([__name__], env=env) as running:
        yield running


def _digest(model: nn.Module, optimizer: torch.optim.Optimizer) -> str:
    parts = [p.detach().numpy().tobytes() for p in model.parameters()]
    parts += [b.detach().numpy().tobytes() for b in model.buffers()]
    parts += [p.grad.numpy().tobytes() for p in model.parameters() if p.grad is not None]
    for state in optimizer.state.values():
        parts += [v.numpy().tobytes() for v in state.values() if isinstance(v, torch.Tensor)]
    parts += [repr(g) .encode() for g in optimizer.param_groups]
    parts += [torch.get_rng_state().numpy().tobytes(), repr(np.random.get_state()).encode(),
              repr(random.getstate()).encode(), repr(model.training).encode()]
    return hashlib.sha256(b"".join(parts)).hexdigest()


@pytest.mark.parametrize("predicted", [4 * TRUE_MAX, TRUE_MAX // 4])
def test_prediction_four_times_off_still_finds_the_true_maximum(server, predicted):
    result = search_max_batch(Broadcast, (1,), device="cpu", memory_cap_bytes=CAP,
                              optimizer="sgd", predicted=predicted, trial_server=server,
                              boundary_runs=1)
    assert result.max_batch_size == TRUE_MAX
    assert len(result.trials) <= 6
    outcomes = {t.batch_size: t.fits for t in result.trials}
    assert outcomes[TRUE_MAX] and not outcomes[TRUE_MAX + 1]
    assert result.prediction_error == pytest.approx((predicted - TRUE_MAX) / TRUE_MAX)
    assert 1 <= result.recommended_batch_size <= TRUE_MAX
    data = result.to_dict()
    assert data["max_batch_size"] == TRUE_MAX
    assert set(data["trials"][0]) >= {"batch_size", "fits", "peak_bytes", "seconds"}


def test_search_from_the_analytic_prediction_leaves_the_user_state_untouched(server):
    torch.manual_seed(0)
    model = Broadcast()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 1)).mean().backward()
    optimizer.step()
    np.random.seed(1)
    random.seed(2)
    before = _digest(model, optimizer)
    result = search_max_batch(model, (1,), device="cpu", memory_cap_bytes=CAP,
                              optimizer=optimizer, trial_server=server, boundary_runs=1)
    assert _digest(model, optimizer) == before
    assert result.max_batch_size == TRUE_MAX
    # The trace predicts 12 MiB per sample and the budget is the state plus the cap: 8.
    assert result.predicted_max_batch_size == TRUE_MAX
    assert len(result.trials) <= 3


class WideBroadcast(Broadcast):
    """Broadcast with 2**18 values per sample: 1 MiB per tensor, 3 MiB per sample at the
    peak (the same three tensors as Broadcast's 12 MiB, a quarter the size)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.scale * x.unsqueeze(-1).expand(-1, 1, 2**18).contiguous()


def test_a_large_answer_starts_on_the_predicted_line_and_takes_three_trials(server):
    # 122 MiB cap, 3 MiB per sample: 40 samples (120 MiB) fit with 2 MiB for what is not
    # a tensor; 41 (123 MiB) cannot. The prediction's line (traced at 16 and 32) puts the
    # answer above 32, so the search starts at 16, on the line, and needs 16, 40, 41.
    result = search_max_batch(WideBroadcast, (1,), device="cpu", memory_cap_bytes=122 * MIB,
                              optimizer="sgd", trial_server=server, boundary_runs=1)
    at_max = next(t for t in result.trials if t.batch_size == 40)
    assert at_max.used_bytes - (at_max.peak_bytes - at_max.baseline_bytes) < 2 * MIB
    assert result.max_batch_size == 40
    assert [(t.batch_size, t.fits) for t in result.trials] == [(16, True), (40, True),
                                                               (41, False)]


def test_the_answer_fits_in_every_boundary_run_and_the_next_shows_its_spread(server):
    # the default on the CPU: the answer and the batch above it each run in 3 fresh
    # processes; on this deterministic (pinned, one-thread) device the spread is 3/3, 0/3
    result = search_max_batch(Broadcast, (1,), device="cpu", memory_cap_bytes=CAP,
                              optimizer="sgd", predicted=TRUE_MAX, trial_server=server)
    assert result.max_batch_size == TRUE_MAX
    assert result.boundary == ((TRUE_MAX, 3, 3), (TRUE_MAX + 1, 0, 3))
    # the boundary's runs are exec'd fresh interpreters (the user's process), not forks
    confirming = [t for t in result.trials if t.process == "exec"]
    assert sorted((t.batch_size, t.fits) for t in confirming) == \
        [(TRUE_MAX, True)] * 3 + [(TRUE_MAX + 1, False)] * 3
    assert result.to_dict()["boundary"][1] == {"batch_size": TRUE_MAX + 1, "fits": 0, "runs": 3}


def _fake_trial(batch_size: int, fits: bool):
    from batchfit.realrun.trial import Trial

    return Trial(batch_size, fits, None, 0.0)


def _fake_confirm(plans: dict[int, list[bool]]):
    """``confirm(batch, count, until_failure)`` serving each batch's planned outcomes in order,
    one at a time (none after a failure with ``until_failure``)."""
    served: dict[int, int] = {}

    def confirm(batch_size: int, count: int, until_failure: bool):
        trials = []
        while len(trials) < count and not (until_failure and not all(t.fits for t in trials)):
            index = served.get(batch_size, 0)
            served[batch_size] = index + 1
            trials.append(_fake_trial(batch_size, plans[batch_size][index]))
        return trials

    return confirm


def test_settle_steps_down_from_a_flaky_answer_and_reports_the_spread():
    from batchfit.realrun.fresh import settle_boundary

    # a heap-layout lottery: 12 fits in 1 run of 3, 11 in 2 of 3, 10 always, 13 never.
    # The search answered 11: 11's runs stop at its first failure (its 2nd run), 10 fits
    # in 3 of 3, then 11 gets its third run (it fits: 2 of 3); 12 is never run.
    plans = {10: [True] * 9, 11: [True, False, True], 12: [False, True, False],
             13: [False] * 9}
    answer, boundary = settle_boundary(11, _fake_confirm(plans), runs=3)
    assert answer == 10
    assert boundary == ((10, 3, 3), (11, 2, 3))
    # from far above: 40 fails, then 39, 37, 33 (galloping down), 25 holds; bisection
    # 29 (no), 27 (no), 26 (no): 25, and 26 gets its three runs
    far = {b: ([True] * 3 if b <= 25 else [False] * 3) for b in range(1, 41)}
    answer, boundary = settle_boundary(40, _fake_confirm(far), runs=3)
    assert (answer, boundary) == (25, ((25, 3, 3), (26, 0, 3)))


def test_settle_steps_up_when_the_batch_above_fits_every_time():
    from batchfit.realrun.fresh import settle_boundary

    # the search (forked trials) answered 9, but 10 fits in 3 of 3 fresh processes and 11
    # in 2 of 3: 9 holds, 10 holds, 12 (two up) fails, 11 fails in its 2nd run and gets
    # its 3rd: the answer is 10
    plans = {9: [True] * 9, 10: [True] * 9, 11: [True, False, True], 12: [False] * 9}
    answer, boundary = settle_boundary(9, _fake_confirm(plans), runs=3)
    assert answer == 10
    assert boundary == ((10, 3, 3), (11, 2, 3))
    # capped by the search's limit: 10 is the limit, nothing above it runs
    answer, boundary = settle_boundary(9, _fake_confirm(plans), runs=3, max_batch=10)
    assert (answer, boundary) == (10, ((10, 3, 3),))


def test_nothing_fits_raises_does_not_fit(server):
    with pytest.raises(DoesNotFitError, match="even batch 1"):
        search_max_batch(Broadcast, (1,), device="cpu", memory_cap_bytes=4 * MIB,
                         optimizer="sgd", predicted=1, trial_server=server)


@pytest.mark.parametrize("kwargs, message", [
    ({"device": "cuda:7"}, "does not exist"),
    ({"device": "tpu"}, "unknown device"),
    ({"steps_per_trial": 0}, "steps per trial"),
    ({"memory_cap_bytes": 1 << 60}, "larger than this machine"),
])
def test_bad_input_is_one_clear_error(kwargs, message):
    options = {"device": "cpu", "memory_cap_bytes": CAP, **kwargs}
    with pytest.raises(InvalidInputError, match=message):
        search_max_batch(Broadcast, (1,), optimizer="sgd", predicted=1, **options)


def test_a_missing_gpu_names_the_device_option_in_the_callers_words():
    # a Python caller reads device='cpu' (before: the command's --device cpu); on a machine
    # with a CUDA device the message lists how many there are instead
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    with pytest.raises(InvalidInputError) as info:
        search_max_batch(Broadcast, (1,), optimizer="sgd", predicted=1, device="cuda:7",
                         memory_cap_bytes=CAP)
    assert "use device='cpu'" in str(info.value) and "--" not in str(info.value)


def test_optimizer_options_rebuild_adamw():
    # torch's AdamW keeps ``decoupled_weight_decay`` in ``defaults`` but its constructor
    # rejects it: the options must rebuild the same optimizer class with the same lr.
    import torch

    from batchfit.realrun.search import _optimizer_options

    params = [torch.nn.Parameter(torch.zeros(2))]
    options = _optimizer_options(torch.optim.AdamW(params, lr=3e-4, weight_decay=0.1))
    rebuilt = options["optimizer"](params, **options["optimizer_kwargs"])
    assert type(rebuilt) is torch.optim.AdamW
    assert rebuilt.defaults["lr"] == 3e-4 and rebuilt.defaults["weight_decay"] == 0.1


class _WavePool:
    """FreshPool.run's contract on a fake device (``fits(batch)``): ``count`` runs in waves
    of ``parallel`` interpreters side by side, none after a wave with a failure when
    ``until_failure``; it counts the interpreters and the waves."""

    def __init__(self, fits, parallel: int = 3):
        self.fits, self.parallel = fits, parallel
        self.interpreters = self.waves = 0

    def run(self, batch_size: int, count: int, *, until_failure: bool = False):
        trials = []
        while len(trials) < count:
            wave = min(self.parallel, count - len(trials))
            self.interpreters, self.waves = self.interpreters + wave, self.waves + 1
            trials += [_fake_trial(batch_size, self.fits(batch_size)) for _ in range(wave)]
            if until_failure and not all(t.fits for t in trials):
                break
        return trials


def test_settling_tries_a_batch_in_one_interpreter_before_the_rest():
    # issue 35 item 10: a small CNN under a 1 GiB cap: forked answer 500, the plain
    # processes' boundary 469 (seen here). Each batch the settling tried ran a wave of 3
    # interpreters side by side, so each of the 9 batches that failed cost 3: 500, 499, 497,
    # 493, 485 (galloping down), 469 (holds: 3), 477, 473, 471, 470 (bisecting): 30.
    # Now one interpreter goes first and the other two only if it fitted: 9 failures of
    # one run, 469's 1 + 2, and 470's two more runs for the boundary's spread: 14.
    from batchfit.realrun.fresh import settle_boundary
    from batchfit.realrun.search import _CpuSearch

    search = object.__new__(_CpuSearch)
    search.fresh = _WavePool(lambda b: b <= 469)
    answer, boundary = settle_boundary(500, search.confirm, runs=3)
    assert (answer, boundary) == (469, ((469, 3, 3), (470, 0, 3)))  # the same answer
    assert search.fresh.interpreters == 14
    # a batch that holds still runs its other runs side by side (one wave, not two)
    search.fresh = _WavePool(lambda b: True)
    assert [t.fits for t in search.confirm(8, 3, True)] == [True] * 3
    assert search.fresh.waves == 2
