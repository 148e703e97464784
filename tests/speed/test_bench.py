"""The measured sweep: knee, planner, alignment, state restore, OOM recovery and bad input.

Expected knees are worked out by hand in each test; synthetic curves need no device.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from batchfit.errors import InvalidInputError
from batchfit.speed.bench import ThroughputPoint, _run_auto, bench, size_inference
from batchfit.speed.knee import (
    alignment_candidates,
    batch_grid,
    deciding_batches,
    epoch_seconds,
    find_knee,
    judge_alignment,
    next_auto_batch,
)
from batchfit.speed.timing import TimingConfig

FAST = TimingConfig(warmup_steps=1, min_run_s=0.002, max_run_s=0.01)


def small_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))


def run_planner(rate, max_batch: int, max_points: int = 8) -> dict[int, float]:
    seen: dict[int, float] = {}
    while (b := next_auto_batch(seen, max_batch, max_points=max_points)) is not None:
        seen[b] = rate(b)
    return seen


# -- knee on synthetic curves ----------------------------------------------------------------


def test_knee_of_a_saturating_curve():
    # step time 10 ms + 1 ms per sample: rate(b) = b / (0.01 + 0.001 b).
    # On the grid up to 1024 the best is rate(1024) = 1024 / 1.034 = 990.3; 95% of it is 940.8.
    # rate(b) >= 940.8  <=>  b >= 9.408 / (1 - 0.9408) = 158.9: grid 128 gives 927.5 (no),
    # 192 gives 950.5 (yes). So the knee is 192.
    grid = batch_grid(1024)
    knee = find_knee(list(grid), [b / (0.01 + 0.001 * b) for b in grid])
    assert (knee.knee_batch_size, knee.best_batch_size) == (192, 1024)
    assert knee.threshold_samples_per_s == pytest.approx(0.95 * 1024 / 1.034)


def test_knee_of_a_sawtooth():
    # 129 falls off a wave boundary. Best 155 at 256; 95% of it is 147.25: 96 (120) no, 128 (150) yes.
    rates = {64: 100.0, 96: 120.0, 128: 150.0, 129: 110.0, 192: 152.0, 256: 155.0}
    knee = find_knee(list(rates), list(rates.values()))
    assert (knee.knee_batch_size, knee.best_batch_size) == (128, 256)


def test_knee_of_a_noisy_curve_is_within_one_grid_step():
    # The saturating curve above (knee 192) with +-1% multiplicative noise.
    grid = list(batch_grid(1024))
    noise = random.Random(5)
    rates = [b / (0.01 + 0.001 * b) * (1 + noise.uniform(-0.01, 0.01)) for b in grid]
    knee = find_knee(grid, rates).knee_batch_size
    assert abs(grid.index(knee) - grid.index(192)) <= 1


def test_knee_ties_and_tolerance_zero():
    # With tolerance 0 the knee is the smallest batch reaching the best; ties go to the smaller.
    assert find_knee([8, 16, 32], [5.0, 9.0, 9.0], tolerance=0).knee_batch_size == 16
    assert find_knee([8, 16, 32], [5.0, 9.0, 9.0], tolerance=0).best_batch_size == 16


# -- the planner ------------------------------------------------------------------------------


def test_grid_is_powers_of_two_and_midpoints():
    assert batch_grid(100) == (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 100)
    assert batch_grid(1) == (1,)


def test_planner_finds_the_dense_knee_with_at_most_8_points():
    # Dense knee of the saturating curve is 192 (see above).
    seen = run_planner(lambda b: b / (0.01 + 0.001 * b), 1024)
    assert len(seen) <= 8
    assert find_knee(list(seen), list(seen.values())).knee_batch_size == 192


def test_planner_finds_a_peak_inside_the_range():
    # Measured here (bench_knee, dense sweep): a small CNN whose samples/s peaks at batch 96
    # and falls after it (cache effects). Best 483 at 96; 95% of it is 458.9; 64 gives 447,
    # so the dense knee is 96. A planner that only refines below the knee of its coarse points
    # (1, 6, 24, 64, 256: best 64) would answer 32.
    curve = {1: 155, 2: 202, 3: 256, 4: 267, 6: 255, 8: 297, 12: 338, 16: 358, 24: 393,
             32: 409, 48: 433, 64: 447, 96: 483, 128: 388, 192: 437, 256: 360}
    assert find_knee(list(curve), list(curve.values())).knee_batch_size == 96
    seen = run_planner(lambda b: curve[b], 256)
    assert len(seen) <= 8
    assert find_knee(list(seen), list(seen.values())).knee_batch_size == 96


@settings(max_examples=60, deadline=None)
@given(overhead=st.floats(1e-4, 1.0), per_sample=st.floats(1e-6, 1e-2),
       max_batch=st.integers(1, 1 << 16))
def test_planner_matches_dense_sweep_on_saturating_curves(overhead, per_sample, max_batch):
    def rate(b):
        return b / (overhead + per_sample * b)

    grid = batch_grid(max_batch)
    dense = find_knee(list(grid), [rate(b) for b in grid]).knee_batch_size
    seen = run_planner(rate, max_batch)
    assert len(seen) <= 8
    assert max(seen) == max_batch  # the maximum is always measured
    assert find_knee(list(seen), list(seen.values())).knee_batch_size == dense


# -- confirming the deciding batches (a fake sweep, no device) ----------------------------------


class FakeSweep:
    """Measures a synthetic curve; the first measurement of ``slow_first`` takes 10% longer
    (a burst of load elsewhere on the machine)."""

    def __init__(self, rate, confirm_runs: int, slow_first: int | None = None):
        self.rate, self.slow_first = rate, slow_first
        self.timing = TimingConfig(confirm_runs=confirm_runs)
        self.seen: list[int] = []

    def measure(self, batch_size: int) -> ThroughputPoint:
        self.seen.append(batch_size)
        step_s = batch_size / self.rate(batch_size)
        if batch_size == self.slow_first and self.seen.count(batch_size) == 1:
            step_s *= 1.1
        return ThroughputPoint(batch_size, True, step_s, 0.0, batch_size / step_s, None)


def saturating(b: int) -> float:
    return b / (0.01 + 0.001 * b)


def knee_of(points) -> int:
    return find_knee([p.batch_size for p in points], [p.samples_per_s for p in points]).knee_batch_size


def test_deciding_batches_by_hand():
    # Knee 32 (97 >= 95); the batch below it, 16; the best, 64.
    assert deciding_batches({8: 50.0, 16: 80.0, 32: 97.0, 64: 100.0}) == (16, 32, 64)
    # Best 32 with 64 above it (a peak): the knee is the best itself.
    assert deciding_batches({8: 50.0, 16: 80.0, 32: 100.0, 64: 70.0}) == (16, 32, 64)
    assert deciding_batches({4: 10.0}) == (4,)


def test_the_deciding_batches_are_measured_again_in_rounds():
    # The planner on the saturating curve (max 1024) measures 1, 12, 128, 1024 (coarse), then
    # bisects the knee: 384, 256, 192 (see test_planner_finds_the_dense_knee...). The knee 192
    # rests on 128 (below it) and 1024 (the best): those three get two more runs each,
    # interleaved.
    sweep = FakeSweep(saturating, confirm_runs=3)
    points = _run_auto(sweep, 1024, 0.05, 8)
    assert sweep.seen == [1, 12, 128, 1024, 384, 256, 192] + [128, 192, 1024] * 2
    assert knee_of(points) == 192 and len(points) == 7


def test_a_burst_on_one_measurement_does_not_move_the_knee():
    # The first measurement of 1024 comes out 10% slow: 990.3 -> 900.3 samples/s, below
    # 128's 927.5, so the coarse points show a false peak at 128.
    # Without confirmation the planner searches that peak (48, 384, 768, 512: best 768 at
    # 987.1, threshold 937.7) and runs out of points with knee 384, two grid steps off.
    alone = FakeSweep(saturating, confirm_runs=1, slow_first=1024)
    assert knee_of(_run_auto(alone, 1024, 0.05, 8)) == 384
    assert alone.seen == [1, 12, 128, 1024, 48, 384, 768, 512]
    # Confirming the peak first re-measures 128 and 1024 (1024's median is back to 990.3),
    # and the planner then bisects the knee as on the clean curve.
    confirmed = FakeSweep(saturating, confirm_runs=3, slow_first=1024)
    assert knee_of(_run_auto(confirmed, 1024, 0.05, 8)) == 192
    assert confirmed.seen == ([1, 12, 128, 1024] + [128, 1024] * 2 + [384, 256, 192]
                              + [192] * 2)


def test_confirm_runs_must_be_a_positive_integer():
    with pytest.raises(InvalidInputError, match="confirm_runs"):
        TimingConfig(confirm_runs=0)
    assert TimingConfig(confirm_runs=2).to_dict()["confirm_runs"] == 2


# -- alignment (pure) --------------------------------------------------------------------------


def test_alignment_candidates_by_hand():
    assert alignment_candidates(100, 1000) == (99, 100, 101, 104, 128)
    # 500 below a 510 limit: multiples of 8 at 496 and 504 tie -> 504; 512 does not fit -> 256.
    assert alignment_candidates(500, 510) == (256, 499, 500, 501, 504)
    assert alignment_candidates(128, 128) == (127, 128)
    assert alignment_candidates(1, 10) == (1, 2, 8)


def test_judge_alignment_in_words():
    flat = judge_alignment(128, {127: 100.0, 128: 101.0, 129: 100.5}, noise=0.01)
    assert not flat.matters and flat.recommended_batch_size == 128
    assert "does not matter" in flat.text

    # The public MobileNetV3 case: 127, 128, 129 the same, 100 clearly slower -> keep 128.
    keep = judge_alignment(128, {100: 80.0, 127: 99.5, 128: 100.0, 129: 99.8}, noise=0.005)
    assert keep.matters and keep.recommended_batch_size == 128
    assert "Keep 128" in keep.text

    move = judge_alignment(127, {127: 90.0, 128: 100.0, 129: 91.0}, noise=0.01)
    assert move.recommended_batch_size == 128 and move.gain == pytest.approx(1 / 9)
    assert "Use 128" in move.text


def test_epoch_seconds():
    assert epoch_seconds(1000, 64, 0.5) == math.ceil(1000 / 64) * 0.5


# -- bad input ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, words", [
    ({"batches": []}, "empty batch list"),
    ({"batches": "8,x"}, "malformed batch list"),
    ({"batches": [0, 4]}, "positive integer"),
    ({"dataset_size": 0}, "dataset size"),
    ({"tolerance": 1.5}, "tolerance"),
])
def test_bad_input_is_one_clear_line(kwargs, words):
    with pytest.raises(InvalidInputError) as err:
        bench(small_mlp, (32,), memory_bytes=1 << 24, timing=FAST, **kwargs)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_batches_above_the_maximum_are_refused_before_anything_runs():
    seen = []
    with pytest.raises(InvalidInputError) as err:
        bench(lambda: Recorder(seen), (32,), batches=[8, 1 << 20], memory_bytes=1 << 22,
              timing=FAST)
    assert "above the largest that fits" in str(err.value) and "\n" not in str(err.value)
    assert seen == []


def test_cpu_without_a_budget_uses_the_available_memory():
    # issue 14 item 2: as a GPU defaults to its own memory, the CPU to what it has now
    with open("/proc/meminfo") as meminfo:
        fields = dict(line.split(":", 1) for line in meminfo)
    total = int(fields["MemTotal"].split()[0]) * 1024
    result = bench(small_mlp, (32,), batches=[4], timing=FAST)
    assert result.memory_source == "available"
    assert 0 < result.memory_bytes <= total
    assert result.to_dict()["memory_source"] == "available"


def test_time_budget_must_be_positive():
    with pytest.raises(InvalidInputError, match="time budget"):
        bench(small_mlp, (32,), batches=[4], timing=FAST, time_budget_s=0)


def test_find_knee_rejects_empty_input():
    with pytest.raises(InvalidInputError, match="no throughput points"):
        find_knee([], [])


# -- real runs on the CPU ----------------------------------------------------------------------


class Recorder(nn.Module):
    """An MLP that records the batch size of every real (not fake) forward."""

    def __init__(self, seen: list[int]):
        super().__init__()
        self.seen = seen
        self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))

    def forward(self, x):
        from torch._subclasses.fake_tensor import FakeTensor

        if not isinstance(x, FakeTensor):
            self.seen.append(x.shape[0])
        return self.net(x)


class Stateful(nn.Module):
    """Dropout (uses the RNG), batch norm (buffers change) and weights that AdamW updates."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(),
                                 nn.Dropout(0.5), nn.Linear(32, 4))

    def forward(self, x):
        return self.net(x)


def state_hash(model: nn.Module) -> str:
    digest = hashlib.sha256()
    for name, tensor in list(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().reshape(-1).view(torch.uint8).numpy().tobytes())
    for param in model.parameters():
        grad = param.grad
        digest.update(b"none" if grad is None else grad.reshape(-1).view(torch.uint8).numpy().tobytes())
    digest.update(torch.get_rng_state().numpy().tobytes())
    digest.update(repr([m.training for m in model.modules()]).encode())
    return digest.hexdigest()


def test_bench_restores_model_state_and_rng_exactly():
    torch.manual_seed(1)
    model = Stateful()
    model(torch.randn(8, 16)).sum().backward()  # gradients exist before the sweep
    model.eval()
    before = state_hash(model)
    result = bench(model, (16,), batches=[4, 8], memory_bytes=1 << 24, optimizer="adamw",
                   timing=FAST)
    assert all(p.fits for p in result.points)
    assert state_hash(model) == before


def test_auto_never_runs_a_batch_predicted_not_to_fit():
    seen: list[int] = []
    result = bench(lambda: Recorder(seen), (32,), memory_bytes=200_000, timing=FAST,
                   optimizer="sgd")
    measured = [p.batch_size for p in result.points]
    assert len(measured) <= 8 and max(measured) == result.max_batch_size
    assert seen and max(seen) <= result.max_batch_size
    assert all(p.peak_bytes <= 200_000 for p in result.points)


class OutOfMemoryAbove(nn.Module):
    """Asks the real CPU allocator for 2**50 bytes when the batch exceeds ``limit``."""

    def __init__(self, seen: list[int], limit: int):
        super().__init__()
        self.seen, self.limit = seen, limit
        self.net = nn.Linear(8, 4)

    def forward(self, x):
        from torch._subclasses.fake_tensor import FakeTensor

        if not isinstance(x, FakeTensor):
            self.seen.append(x.shape[0])
            if x.shape[0] > self.limit:
                torch.empty(1 << 48, dtype=torch.float32)  # 2**50 bytes: the allocator fails
        return self.net(x)


def test_out_of_memory_points_are_recovered_and_marked():
    seen: list[int] = []
    model = OutOfMemoryAbove(seen, limit=20)
    before = state_hash(model)
    # The budget (2**52 B) lets the trace accept every batch up to the cap of 64.
    result = bench(model, (8,), memory_bytes=1 << 52, max_batch_limit=64, timing=FAST,
                   optimizer="sgd")
    failed = [p for p in result.points if not p.fits]
    assert failed and all(p.batch_size > 20 for p in failed)
    assert all("can't allocate memory" in p.error for p in failed)
    assert all(p.fits for p in result.points if p.batch_size <= 20)
    for i, batch in enumerate(seen):  # after a failure, only smaller batches are tried
        if batch > 20:
            assert all(later < batch for later in seen[i + 1:])
    assert result.knee_batch_size <= 20 and len(result.points) <= 8
    assert state_hash(model) == before


def test_explicit_list_alignment_json_and_epoch_time():
    seen: list[int] = []
    result = bench(lambda: Recorder(seen), (32,), batches="4, 16", memory_bytes=1 << 24,
                   timing=FAST, dataset_size=1000, optimizer="sgd", alignment=True)
    aligned = result.alignment
    base = aligned.verdict.base_batch_size
    assert [p.batch_size for p in aligned.points] == list(alignment_candidates(base, 1 << 20))
    assert aligned.verdict.text.endswith(f"{result.recommended_batch_size}.")
    assert set(seen) == {4, 16} | {p.batch_size for p in aligned.points}
    data = json.loads(json.dumps(result.to_dict()))
    assert [p["batch_size"] for p in data["points"]] == [4, 16]
    for point in data["points"]:
        assert point["samples_per_s"] == pytest.approx(point["batch_size"] / point["step_s"])
        assert point["peak_bytes"] > 0
    assert data["recommended_batch_size"] in [p.batch_size for p in aligned.points]
    assert {"knee_batch_size", "best_batch_size", "device"} <= set(data)
    step = result.point(result.recommended_batch_size).step_s
    assert result.epoch_s == pytest.approx(math.ceil(1000 / result.recommended_batch_size) * step)


def test_rounds_interleave_the_batches():
    seen: list[int] = []
    result = bench(lambda: Recorder(seen), (32,), batches=[4, 16], memory_bytes=1 << 24,
                   timing=replace(FAST, rounds=2), optimizer="sgd")
    runs = [b for i, b in enumerate(seen) if i == 0 or seen[i - 1] != b]
    assert runs == [4, 16, 4, 16]
    assert all(p.repeats >= 2 for p in result.points)  # at least one timed block per round


def test_inference_sizing_reports_the_maximum_and_memory_left():
    budget = 1 << 22
    result = size_inference(small_mlp, (32,), batches=[8, 32], memory_bytes=budget, timing=FAST)
    trained = bench(small_mlp, (32,), batches=[8], memory_bytes=budget, timing=FAST,
                    optimizer="adamw")
    assert result.mode.value == "infer"
    assert result.max_batch_size > trained.max_batch_size  # no gradients, no optimizer state
    peak = result.point(result.recommended_batch_size).peak_bytes
    assert result.memory_left_bytes == budget - peak > 0
