"""``plan``'s micro-batch search: the answer a bisection over the divisors gives, from fewer
traces (a line through two needs, confirmed on both sides), and the plan's rows on a small
model equal to tracing every divisor, with the roofline's micro-step as their compute."""

from __future__ import annotations

import random

import pytest
import torch

from batchfit.speed.divisors import largest_fitting_divisor
from batchfit.speed.plan import plan


def bisection(divisors: list[int], need, budget: int) -> tuple[int | None, int]:
    """The search ``plan`` used before (bisection over the divisors), and its trace count."""
    sizes: dict[int, int] = {}

    def ask(batch: int) -> int:
        sizes.setdefault(batch, need(batch))
        return sizes[batch]

    low, high = -1, len(divisors)
    while high - low > 1:
        middle = (low + high) // 2
        if ask(divisors[middle]) <= budget:
            low = middle
        else:
            high = middle
    if low < 0:
        ask(divisors[0])
        return None, len(sizes)
    return divisors[low], len(sizes)


def counted(need):
    asked: list[int] = []

    def wrapped(batch: int) -> int:
        asked.append(batch)
        return need(batch)

    return wrapped, asked


def divisors_of(n: int) -> list[int]:
    return [b for b in range(1, n + 1) if n % b == 0]


@pytest.mark.parametrize("seed", range(300))
def test_the_answer_is_the_bisections(seed):
    # Growing needs of every shape: affine, convex, concave, with steps (the allocator's
    # rounding), and budgets anywhere from below the first to above the last divisor.
    rng = random.Random(seed)
    divisors = divisors_of(rng.choice([1, 2, 12, 64, 96, 128, 360, 1024]))
    base, slope = rng.randint(1, 10**6), rng.randint(1, 10**4)
    power = rng.choice([1.0, 1.0, 0.7, 1.3, 2.0])
    step = rng.choice([1, 1, 512, 20_000])

    def need(b: int) -> int:
        return (base + int(slope * b ** power) + step - 1) // step * step

    budget = rng.randint(base // 2, need(divisors[-1]) + slope)
    # a first guess of the bytes per sample (another layout's): none, right, or far off
    guess = rng.choice([None, slope, slope * rng.uniform(0.05, 20), -1.0])
    wrapped, asked = counted(need)
    answer = largest_fitting_divisor(divisors, wrapped, budget, guess)
    expected, _ = bisection(divisors, need, budget)
    assert answer == expected
    assert len(asked) == len(set(asked))  # each micro-batch traced once


def test_affine_needs_take_at_most_four_traces_and_nothing_fits_takes_one():
    divisors = divisors_of(128)
    for budget in range(10, 500, 7):
        wrapped, asked = counted(lambda b: 13 + 3 * b)
        answer = largest_fitting_divisor(divisors, wrapped, budget)
        assert answer == bisection(divisors, lambda b: 13 + 3 * b, budget)[0]
        assert len(asked) <= (1 if answer is None else 4)
    wrapped, asked = counted(lambda b: 100 + b)
    assert largest_fitting_divisor(divisors, wrapped, 50) is None and asked == [1]
    wrapped, asked = counted(lambda b: 100 + b)  # everything fits: 1, 2, then the largest
    assert largest_fitting_divisor(divisors, wrapped, 10**6) == 128 and asked == [1, 2, 128]
    wrapped, asked = counted(lambda b: 10 + 3 * b)  # another layout's slope: 1, then 16, 32
    assert largest_fitting_divisor(divisors, wrapped, 60, slope=3.0) == 16
    assert asked == [1, 16, 32]


def paired(need):
    """``need`` two at a time, as a pool with a worker runs them: each call is a round."""
    rounds: list[list[int]] = []

    def need_two(batches: list[int]) -> dict[int, int]:
        assert len(batches) == 2
        rounds.append(list(batches))
        return {b: need(b) for b in batches}

    return need_two, rounds


@pytest.mark.parametrize("seed", range(200))
def test_in_pairs_the_answer_is_still_the_bisections(seed):
    rng = random.Random(seed)
    divisors = divisors_of(rng.choice([1, 2, 12, 64, 96, 128, 360, 1024]))
    base, slope = rng.randint(1, 10**6), rng.randint(1, 10**4)
    power = rng.choice([1.0, 0.7, 1.3, 2.0])
    step = rng.choice([1, 512, 20_000])

    def need(b: int) -> int:
        return (base + int(slope * b ** power) + step - 1) // step * step

    budget = rng.randint(base // 2, need(divisors[-1]) + slope)
    single, asked = counted(need)
    need_two, rounds = paired(need)
    answer = largest_fitting_divisor(divisors, single, budget, None, need_two)
    assert answer == bisection(divisors, need, budget)[0]
    traced = asked + [b for pair in rounds for b in pair]
    assert len(traced) == len(set(traced))  # each micro-batch traced once


def test_in_pairs_an_affine_need_takes_two_rounds():
    # round 1: the second and third divisors (the line); round 2: the largest divisor the
    # line fits and the one above it, which settle the bracket (or, where 2 does not fit,
    # the first alone): two traces' time, not four
    divisors = divisors_of(128)
    for budget in range(16, 500, 7):
        single, asked = counted(lambda b: 13 + 3 * b)
        need_two, rounds = paired(lambda b: 13 + 3 * b)
        answer = largest_fitting_divisor(divisors, single, budget, None, need_two)
        assert answer == bisection(divisors, lambda b: 13 + 3 * b, budget)[0]
        assert rounds[0] == [2, 4] and len(rounds) + len(asked) <= 2, (budget, rounds, asked)
    need_two, rounds = paired(lambda b: 13 + 3 * b)  # 16 fits (61), 32 does not (109)
    assert largest_fitting_divisor(divisors, None, 100, None, need_two) == 16
    assert rounds == [[2, 4], [16, 32]]


def test_in_pairs_a_large_model_settles_in_one_round_and_none_fitting_in_two():
    # 13 + 3b: 2 needs 19 and 4 needs 25
    divisors = divisors_of(256)
    single, asked = counted(lambda b: 13 + 3 * b)
    need_two, rounds = paired(lambda b: 13 + 3 * b)
    assert largest_fitting_divisor(divisors, single, 20, None, need_two) == 2
    assert rounds == [[2, 4]] and asked == []  # 2 fits, 4 does not: the bracket is closed
    single, asked = counted(lambda b: 13 + 3 * b)
    need_two, rounds = paired(lambda b: 13 + 3 * b)
    assert largest_fitting_divisor(divisors, single, 15, None, need_two) is None
    assert rounds == [[2, 4]] and asked == [1]  # 1 needs 16: nothing fits
    single, asked = counted(lambda b: 13 + 3 * b)
    need_two, rounds = paired(lambda b: 13 + 3 * b)  # two divisors: both at once
    assert largest_fitting_divisor([1, 2], single, 17, None, need_two) == 1
    assert rounds == [[1, 2]] and asked == []


def test_needs_traced_before_are_not_asked_again():
    # the plan traces a layout's first two variants at 1 together; the next variant's
    # search starts from that need: with another layout's slope, one round (16 and 32)
    divisors = divisors_of(128)
    single, asked = counted(lambda b: 10 + 3 * b)
    need_two, rounds = paired(lambda b: 10 + 3 * b)
    assert largest_fitting_divisor(divisors, single, 60, 3.0, need_two, known={1: 13}) == 16
    assert asked == [] and rounds == [[16, 32]]
    single, asked = counted(lambda b: 10 + 3 * b)  # in sequence, without a slope: 2, 16, 32
    assert largest_fitting_divisor(divisors, single, 60, known={1: 13}) == 16
    assert asked == [2, 16, 32]


@pytest.mark.slow
def test_the_plan_on_a_small_model_equals_tracing_every_divisor():
    # A 16-layer MLP over 2,048 tokens on 16 GB cards: the weights (~0.27 B parameters,
    # AdamW) take a quarter of the card and the activations bind at a micro-batch between
    # the divisors of 64; each row's micro-batch and memory are those of tracing every
    # divisor and taking the largest that fits (the plan's definition).
    from batchfit.answers.ranks import estimate_ranks
    from batchfit.device.catalog import find_gpu
    from batchfit.device.profile import gpu_profile
    from batchfit.engine.spec import TrainConfig

    def mlp() -> torch.nn.Module:
        return torch.nn.Sequential(*[torch.nn.Linear(4096, 4096) for _ in range(16)])

    inputs = (2048, 4096)
    config = TrainConfig(optimizer="adamw", precision="amp-fp16")  # a T4 has no bf16
    result = plan(mlp, inputs, config, gpus="2xT4", global_batch=128,
                  strategies=["ddp", "fsdp"], checkpointing="off", offload="none")
    device = gpu_profile(find_gpu("T4"))
    from batchfit.sharding.layout import Parallelism
    from batchfit.speed.op_costs import step_costs, step_times
    from batchfit.speed.rates import gpu_roofline_profile

    costs = step_costs(mlp, inputs, config, device)
    roofline = gpu_roofline_profile(find_gpu("T4"), config.precision)
    assert costs is not None

    for row in result.rows:
        layout = Parallelism(world_size=2, strategy=row.strategy, rank=0)
        needs = {b: estimate_ranks(mlp, inputs, b, config, device=device, parallel=layout,
                                   first_step=False).total_bytes for b in divisors_of(64)}
        fitting = [b for b, n in needs.items() if n <= device.total_memory_bytes]
        assert row.feasible and row.micro_batch_size == max(fitting), (row, needs)
        assert 1 < row.micro_batch_size < 64
        assert row.memory_per_gpu_bytes == needs[row.micro_batch_size]
        assert row.accumulation_steps == 64 // row.micro_batch_size
        # compute: the roofline's micro-step at that micro-batch, once per micro-step; the
        # MLP's costs are affine in the batch, so the fit through 4, 5 and 8 that
        # ``predict_throughput`` uses gives the same micro-step
        micro_s = step_times(costs, roofline, [row.micro_batch_size])[0].step_s
        assert row.compute_s == pytest.approx(micro_s * row.accumulation_steps, rel=1e-9)


_PLAN_IN_A_FRESH_PROCESS = """
import json
import torch
from batchfit.answers import tracepool
from batchfit.engine.spec import TrainConfig
from batchfit.speed.plan import plan

sent = []
send = tracepool._Worker.send
tracepool._Worker.send = lambda self, request: sent.append(request) or send(self, request)
mlp = lambda: torch.nn.Sequential(*[torch.nn.Linear(4096, 4096) for _ in range(16)])
result = plan(mlp, (2048, 4096), TrainConfig(optimizer="adamw", precision="amp-fp16"),
              gpus="2xT4", global_batch=128, strategies=["ddp", "fsdp"], checkpointing="off",
              offload="none")
print(json.dumps({"sent": len(sent), "rows": [r.to_dict() for r in result.rows]}))
"""


@pytest.mark.slow
def test_the_plan_in_workers_equals_the_plan_in_sequence():
    # The workers are forked before the process's first backward, so this runs where a
    # user runs it: a fresh process (pytest's has run backward passes). The requests the
    # workers are sent are numbers into a table built before the fork; their answers must
    # be the rows the same plan gives traced one at a time here.
    import json
    import os
    import subprocess
    import sys

    def run(parallel: str) -> dict:
        env = {**os.environ, "BATCHFIT_PARALLEL_TRACES": parallel}
        done = subprocess.run([sys.executable, "-c", _PLAN_IN_A_FRESH_PROCESS], env=env,
                              capture_output=True, text=True, timeout=600, check=True)
        return json.loads(done.stdout.strip().splitlines()[-1])

    in_sequence, in_workers = run("0"), run("1")
    assert in_sequence["sent"] == 0
    if in_workers["sent"] == 0:
        pytest.skip("no idle core for the workers on this machine right now")
    assert in_workers["rows"] == in_sequence["rows"]
    assert all(row["feasible"] for row in in_workers["rows"])


def test_plan_precision_follows_a_16_bit_checkpoint_and_the_card():
    from batchfit.device.catalog import find_gpu
    from batchfit.engine.spec import Precision
    from batchfit.speed.plan import plan_precision

    h100, t4 = find_gpu("H100 SXM"), find_gpu("T4")
    # a bfloat16 checkpoint: mixed precision in bfloat16; a T4 (sm75) has none: float16
    assert plan_precision(None, "bfloat16", Precision.FP32, h100) == (
        Precision.AMP_BF16, "checkpoint bfloat16")
    assert plan_precision(None, "bfloat16", Precision.FP32, t4) == (
        Precision.AMP_FP16, "checkpoint bfloat16")
    assert plan_precision(None, "float16", Precision.FP32, h100) == (
        Precision.AMP_FP16, "checkpoint float16")
    # a float32 checkpoint, or a model that is not an LLM: the config's precision
    assert plan_precision(None, "float32", Precision.FP32, h100) == (Precision.FP32, "config")
    assert plan_precision(None, None, Precision.AMP_BF16, h100) == (Precision.AMP_BF16, "config")
    # given: it stands
    assert plan_precision("fp32", "bfloat16", Precision.FP32, h100) == (Precision.FP32, "given")


def test_a_replica_floor_counts_weights_gradients_and_the_optimizer_state():
    # nn.Linear(1000, 10): 10,000 + 10 parameters. In fp32 with AdamW a replica holds the
    # weights, their gradients and two state tensors of each (adam.py's exp_avg and
    # exp_avg_sq): 4 x 10,010 x 4 B.
    from batchfit.answers.replica import replica_floor_bytes
    from batchfit.engine.spec import TrainConfig

    layer = torch.nn.Linear(1000, 10)
    assert replica_floor_bytes(layer, TrainConfig(optimizer="adamw")) == 4 * 10_010 * 4
    # amsgrad's max_exp_avg_sq is a third state
    assert replica_floor_bytes(layer, TrainConfig(optimizer="adamw",
                                                  optimizer_kwargs={"amsgrad": True})) \
        == 5 * 10_010 * 4
    # bf16 holds the weights (so gradients and states) in 2 bytes; amp keeps fp32 weights
    assert replica_floor_bytes(layer, TrainConfig(optimizer="adamw", precision="bf16")) \
        == 4 * 10_010 * 2
    assert replica_floor_bytes(layer, TrainConfig(optimizer="adamw", precision="amp-bf16")) \
        == 4 * 10_010 * 4
    # plain SGD keeps no state; with momentum one buffer (sgd.py's momentum_buffer)
    assert replica_floor_bytes(layer, TrainConfig(optimizer="sgd")) == 2 * 10_010 * 4
    assert replica_floor_bytes(layer, TrainConfig(optimizer="momentum")) == 3 * 10_010 * 4
    # a frozen weight is held but has no gradient and no state: 40,000 B + the bias's 4 x 40
    layer.weight.requires_grad_(False)
    assert replica_floor_bytes(layer, TrainConfig(optimizer="adamw")) == 40_000 + 4 * 40


@pytest.mark.parametrize("precision", ["fp32", "amp-fp16", "bf16"])
def test_a_replica_floor_is_below_the_traced_replica(precision):
    # The floor is a lower bound of what the trace of the same DDP step holds at its peak
    # (the trace adds activations, DDP's buckets, temporaries).
    from batchfit.answers.ranks import estimate_ranks
    from batchfit.answers.replica import replica_floor_bytes
    from batchfit.device.catalog import find_gpu
    from batchfit.device.profile import gpu_profile
    from batchfit.engine.spec import TrainConfig
    from batchfit.sharding.layout import Parallelism

    def mlp() -> torch.nn.Module:
        return torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(4)])

    config = TrainConfig(optimizer="adamw", precision=precision)
    traced = estimate_ranks(mlp, (64, 1024), 1, config, device=gpu_profile(find_gpu("A100")),
                            parallel=Parallelism(world_size=2, strategy="ddp", rank=0),
                            first_step=False).total_bytes
    floor = replica_floor_bytes(mlp(), config)
    assert floor == 4 * (1024 * 1024 + 1024) * (4 if precision != "bf16" else 2) * 4
    assert floor <= traced


def test_a_replicated_layout_over_the_card_is_answered_without_a_trace(monkeypatch):
    # 64 layers of 8192 x 8192 (+ bias): 4,295,491,584 parameters; with AdamW in amp every
    # DDP rank holds 16 B of each, 64.0 GiB, over a T4: no trace is needed to say so.
    from batchfit.answers import ranks
    from batchfit.engine.spec import TrainConfig

    def no_trace(*args, **kwargs):
        raise AssertionError("traced a layout its floor rules out")

    monkeypatch.setattr(ranks, "estimate_ranks", no_trace)

    def big() -> torch.nn.Module:
        return torch.nn.Sequential(*[torch.nn.Linear(8192, 8192) for _ in range(64)])

    result = plan(big, (16, 8192), TrainConfig(optimizer="adamw", precision="amp-fp16"),
                  gpus="2xT4", global_batch=8, strategies=["ddp"], offload="none")
    (row,) = result.rows
    floor = 64 * (8192 * 8192 + 8192) * 16
    assert not row.feasible and row.checkpointing  # both variants ruled out, the last shown
    assert row.reason == (f"its weights, gradients and optimizer state alone need "
                          f"{floor / 2**30:.1f} GiB on every GPU, over the 16.0 GiB card")


def test_a_round_traces_the_longest_first():
    # ZeRO-3 (DeepSpeed partitions and gathers every parameter) before ZeRO-1/2 before
    # torch's own layouts; within one, checkpointing's recomputation first
    from batchfit.sharding.layout import Strategy
    from batchfit.speed.plan import _trace_length_rank

    keys = [(Strategy(name), 1, None, ckpt) for name in ("ddp", "fsdp", "zero2", "zero3",
                                                         "zero1") for ckpt in (False, True)]
    order = [(key[0].value, key[3]) for key in sorted(keys, key=_trace_length_rank)]
    assert order == [("zero3", True), ("zero3", False), ("zero2", True), ("zero1", True),
                     ("zero2", False), ("zero1", False), ("ddp", True), ("fsdp", True),
                     ("ddp", False), ("fsdp", False)]


@pytest.mark.parametrize("case", ["moot above the card", "fails at 2", "nothing fits"])
def test_a_failing_trace_answers_alike_in_pairs_and_in_sequence(case, monkeypatch):
    # Pairs begin at micro-batches 2 and 4, where the search in sequence begins at 1: a
    # trace that fails (here from micro-batch 4 up, or from 2) must give the row the search
    # in sequence gives. The rank traces are stubbed (needs in GiB of a 16 GiB card).
    from types import SimpleNamespace

    from batchfit.answers import ranks, tracepool
    from batchfit.engine.spec import TrainConfig
    from batchfit.errors import InvalidInputError

    gib = 1 << 30
    over_from, fail_from = {"moot above the card": (2, 4), "fails at 2": (4, 2),
                            "nothing fits": (1, 2)}[case]
    traced: list[int] = []

    def stub(model, inputs, micro, config, **kw):
        traced.append(micro)
        if micro >= fail_from:
            raise InvalidInputError(f"no kernel for micro-batch {micro}: a stand-in failure")
        return SimpleNamespace(total_bytes=(20 if micro >= over_from else 10) * gib)

    monkeypatch.setattr(ranks, "estimate_ranks", stub)
    mlp = lambda: torch.nn.Sequential(torch.nn.Linear(64, 64))

    def row(pairs: bool):
        traced.clear()
        monkeypatch.setattr(tracepool.TraceQueue, "parallel", property(lambda self: pairs))
        monkeypatch.setattr(tracepool, "_can_fork", lambda: False)  # traced here, in order
        result = plan(mlp, (64,), TrainConfig(optimizer="sgd"), gpus="2xT4", global_batch=32,
                      strategies=["ddp"], checkpointing="off", offload="none")
        return result.rows[0].to_dict(), list(traced)

    (in_pairs, pairs_traced), (in_sequence, sequence_traced) = row(True), row(False)
    for field in ("feasible", "micro_batch_size", "memory_per_gpu_bytes", "reason"):
        assert in_pairs[field] == in_sequence[field], (field, in_pairs, in_sequence)
    assert pairs_traced[:2] == [2, 4] and sequence_traced[0] == 1
    if case == "moot above the card":  # 2 is over, 4 fails: the answer is 1, as in sequence
        assert in_pairs["feasible"] and in_pairs["micro_batch_size"] == 1
    elif case == "fails at 2":  # 1 fits, 2 fails: the failure is the answer
        assert not in_pairs["feasible"] and "micro-batch 2" in in_pairs["reason"]
    else:  # 1 is over the card: none fits, whatever 2 says
        assert not in_pairs["feasible"] and in_pairs["reason"].startswith("a micro-batch of 1")
