"""``plan``'s micro-batch search: the answer a bisection over the divisors gives, from fewer
traces (a line through two needs, confirmed on both sides), and the plan's rows on a small
model equal to tracing every divisor."""

from __future__ import annotations

import random

import pytest
import torch

from batchfit.speed.plan import largest_fitting_divisor, plan


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
    config = TrainConfig(optimizer="adamw", precision="amp-bf16")
    result = plan(mlp, inputs, config, gpus="2xT4", global_batch=128,
                  strategies=["ddp", "fsdp"], checkpointing="off", offload="none")
    device = gpu_profile(find_gpu("T4"))
    from batchfit.sharding.layout import Parallelism

    for row in result.rows:
        layout = Parallelism(world_size=2, strategy=row.strategy, rank=0)
        needs = {b: estimate_ranks(mlp, inputs, b, config, device=device, parallel=layout,
                                   first_step=False).total_bytes for b in divisors_of(64)}
        fitting = [b for b, n in needs.items() if n <= device.total_memory_bytes]
        assert row.feasible and row.micro_batch_size == max(fitting), (row, needs)
        assert 1 < row.micro_batch_size < 64
        assert row.memory_per_gpu_bytes == needs[row.micro_batch_size]
        assert row.accumulation_steps == 64 // row.micro_batch_size
