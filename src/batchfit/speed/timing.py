"""Timing one step: steady-state steps, a clock, threads, and what a timed step must not change.

How a point is measured. ``warmup_steps`` untimed steps first (the first
training step creates the optimizer state, and oneDNN/cuDNN pick kernels for
each new shape), then ``torch.utils.benchmark.Timer.adaptive_autorange``: blocks
of steps until the interquartile range is below ``target_spread`` of the median
(at least 4 blocks) or ``max_run_s`` is spent. The Timer synchronises the
accelerator around each block. Only steady-state steps are timed.

Noise. On a shared CPU, wall time includes whatever else runs. ``Clock.CPU``
times the calling thread's CPU time (``time.thread_time``) with one intra-op
thread, which other processes disturb far less than the wall clock. They still
slow it down through the caches and memory they share: the same step can run much
slower from one minute to the next, and a single measurement well above its
neighbours. Hence interleaved rounds, the
fastest of repeated measurements, and re-measuring the batches a knee rests on
(below). ``Clock.CPU`` measures the step on one core, not the wall time you would
see with every core; use it to compare batch sizes, not to promise a wall time.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any

from batchfit._logs import without_cuda_home_notice
from batchfit.engine.spec import parse_enum
from batchfit.errors import InvalidInputError


class Clock(StrEnum):
    """What a step's time is measured with."""

    WALL = "wall"  #: wall time, accelerator synchronised (torch.utils.benchmark's default timer)
    CPU = "cpu"  #: the calling thread's CPU time, one intra-op thread (CPU only; robust to load)


@dataclass(frozen=True)
class TimingConfig:
    """How each batch size is timed.

    Attributes:
        warmup_steps: untimed steps before timing (>= 1; training wants >= 2).
        min_run_s: timed seconds before the spread is checked.
        max_run_s: timed seconds after which a point stops, even if still noisy.
        target_spread: stop once IQR / median is below this.
        clock: :class:`Clock` (``wall`` or ``cpu``).
        rounds: interleaved rounds over an explicit batch list: each round times every
            batch once (with ``min_run_s``/``max_run_s`` split between rounds) and a
            point's step time is its fastest round, so a change of load part-way
            through hits every batch alike instead of bending the curve (load from
            other processes only ever slows a step down: the fastest round is the least
            disturbed, as ``timeit``'s documentation advises for repeats).
        alignment_rounds: the same for the alignment candidates.
        confirm_runs: with ``batches="auto"``, the batches the knee rests on (the knee,
            the measured batch below it and the best; :func:`deciding_batches`) are
            measured this many times in all, the repeats in interleaved rounds (each with
            ``1 / confirm_runs`` of the run time and one warm-up step), and count by
            their fastest: one measurement caught by a burst of load elsewhere on the
            machine cannot move the knee. 1 turns this off.
    """

    warmup_steps: int = 2
    min_run_s: float = 0.3
    max_run_s: float = 3.0
    target_spread: float = 0.05
    clock: Clock | str = Clock.WALL
    rounds: int = 1
    alignment_rounds: int = 3
    confirm_runs: int = 3

    def __post_init__(self) -> None:
        object.__setattr__(self, "clock", parse_enum(Clock, self.clock, "clock"))
        if not isinstance(self.warmup_steps, int) or self.warmup_steps < 1:
            raise InvalidInputError(f"warmup_steps must be a positive integer, not {self.warmup_steps!r}")
        if not 0 < self.min_run_s <= self.max_run_s:
            raise InvalidInputError(
                f"need 0 < min_run_s <= max_run_s, not {self.min_run_s} and {self.max_run_s}")
        if not 0 < self.target_spread < 1:
            raise InvalidInputError(f"target_spread {self.target_spread} must be in (0, 1), e.g. 0.05")
        for name in ("rounds", "alignment_rounds", "confirm_runs"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidInputError(f"{name} must be a positive integer, not {value!r}")

    def per_round(self, rounds: int) -> TimingConfig:
        """This timing with the run time split over ``rounds`` rounds."""
        return replace(self, min_run_s=self.min_run_s / rounds, max_run_s=self.max_run_s / rounds)

    def to_dict(self) -> dict[str, Any]:
        return {"warmup_steps": self.warmup_steps, "min_run_s": self.min_run_s,
                "max_run_s": self.max_run_s, "target_spread": self.target_spread,
                "clock": self.clock.value, "rounds": self.rounds,
                "alignment_rounds": self.alignment_rounds, "confirm_runs": self.confirm_runs}



def _freeze_keras_learning_rate(model: Any) -> None:
    """:func:`_freeze_learning_rate` for a Keras model's optimizer (a fixed learning rate
    is a Keras variable; a schedule is left as it is)."""
    rate = getattr(getattr(model, "optimizer", None), "learning_rate", None)
    if hasattr(rate, "assign"):
        rate.assign(0.0)


def _freeze_learning_rate(optimizer: Any) -> None:
    """Learning rate 0: the same kernels run, but the repeated batch trains nothing.

    Stepping on one fixed batch drives the loss to 0 and the gradients and Adam's
    second moments into denormal floats, which x86 CPUs process far slower (an
    AdamW step slows down by a large factor).
    """
    for group in optimizer.param_groups:
        if hasattr(group["lr"], "fill_"):
            group["lr"].fill_(0.0)
        else:
            group["lr"] = 0.0


def _free_memory(torch_device: Any) -> None:
    from batchfit.realrun.trial import collect_garbage

    collect_garbage(torch_device)


def _reset_peak(torch_device: Any) -> None:
    import torch

    if torch_device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(torch_device)


def _measured_peak(torch_device: Any) -> int | None:
    import torch

    if torch_device.type == "cuda":
        return int(torch.cuda.max_memory_reserved(torch_device))
    return None


@contextlib.contextmanager
def _threads(count: int) -> Iterator[None]:
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _thread_count(timing: TimingConfig) -> int:
    import torch

    return 1 if timing.clock is Clock.CPU else torch.get_num_threads()


def _time_step(step: Callable[[], None], timing: TimingConfig) -> tuple[float, float, int, int]:
    """``(median_s, iqr_s, blocks, steps)`` of steady-state steps, by torch.utils.benchmark."""
    with without_cuda_home_notice():
        from torch.utils.benchmark import Timer

    threads = _thread_count(timing)
    with _threads(threads):
        for _ in range(timing.warmup_steps):
            step()
    kwargs: dict[str, Any] = {}
    if timing.clock is Clock.CPU:
        kwargs["timer"] = time.thread_time
    timer = Timer(stmt="step()", globals={"step": step}, num_threads=threads, **kwargs)
    measurement = timer.adaptive_autorange(threshold=timing.target_spread,
                                           min_run_time=timing.min_run_s,
                                           max_run_time=timing.max_run_s)
    blocks = len(measurement.times)
    return (float(measurement.median), float(measurement.iqr), blocks,
            blocks * measurement.number_per_run)



