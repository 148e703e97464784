"""``batchfit.max_batch_size``: the largest batch (or sequence length) that fits a budget.

The budget is the device memory as CUDA sees it, minus the CUDA context and the
library workspaces (on the CPU: the runtime's overhead beyond tensors, see
:mod:`batchfit.realrun.cpu_overhead`), minus an optional safety margin (0 by default: the traces
already model the caching allocator's reserved memory). Each candidate batch is
one fake trace; :mod:`batchfit.answers.solve` picks the candidates and confirms the
answer by tracing B* (fits) and B*+1 (does not).

Non-memory limits: some CUDA kernels refuse a launch whatever the memory: the native
depthwise convolution indexes with 32-bit integers, fused attention cannot launch a
grid dimension above 65,535. The rules, per kernel and per stack, live in
:mod:`batchfit.engine.limits`; each trace records the launch nearest its limit. When
that limit binds before memory does, the answer is lowered to the largest batch that
respects it, ``binding_constraint`` says which kind, and ``note`` names the op, the
kernel, the size and the source of the rule.

Example:
    >>> import torch, batchfit
    >>> model = lambda: torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 10))
    >>> result = batchfit.max_batch_size(model, (256,), device="cpu", memory_bytes=64 * 2**20)
    >>> result.max_batch_size > 1000
    True
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any, Callable, Mapping, Sequence

from batchfit._gc import old_objects_frozen
from batchfit.answers.estimate import MemoryEstimate, estimate, step_profile, summarize
from batchfit.answers.solve import (
    NothingFits,
    default_seq_len_probes,
    solve_max_batch,
    solve_max_seq_len,
)
from batchfit.answers.tracepool import TracePool
from batchfit.device.profile import DeviceProfile, marketed_memory_note
from batchfit.device.timeline import fits_within, needed_bytes, peak_live_bytes
from batchfit.engine.spec import TensorSpec, TrainConfig, make_config
from batchfit.engine.trace import StepTrace, TraceReuse, trace_step
from batchfit.engine.tracer import Event
from batchfit.errors import InvalidInputError, option

#: The largest batch size the solver will report (tiny models fit absurd batches).
DEFAULT_MAX_BATCH_LIMIT = 1 << 16


class Constraint(StrEnum):
    MEMORY = "memory"
    INT32_INDEXING = "int32_indexing"
    GRID_DIM = "grid_dim"
    LIMIT = "max_batch_limit"


@dataclass(frozen=True)
class MaxBatchResult:
    """The largest batch size that fits, with the estimates at B* and B*+1.

    Attributes:
        max_batch_size: the answer.
        budget_bytes: memory available to the step (memory - margin - context - NCCL -
            workspaces); compare ``step_bytes_at_max``/``step_bytes_at_next``, which leave
            the same fixed overheads out.
        memory_bytes: the device memory the budget was derived from.
        total_bytes_at_max: device bytes needed at the answer (incl. the context, NCCL and
            workspaces); compare ``total_budget_bytes``, which includes them too.
        total_bytes_at_next: device bytes needed at ``next_batch_size`` (None when capped).

    The properties ``total_budget_bytes`` (memory - margin), ``step_bytes_at_max``,
    ``step_bytes_at_next`` (what the step asks of the allocator beyond its fixed
    workspaces) and ``next_batch_size`` (the batch ``*_at_next`` describe; None when it
    was not traced) are in ``to_dict()`` too.
        traces: how many batch sizes were traced.
        binding_constraint: what stops a larger batch (memory, int32 indexing, the cap).
        estimate_at_max: the full estimate at the answer (breakdown, top modules).
        evaluated: (batch size, allocator bytes) per trace, in order.
    """

    max_batch_size: int
    budget_bytes: int
    memory_bytes: int
    margin: float
    total_bytes_at_max: int
    total_bytes_at_next: int | None
    traces: int
    binding_constraint: Constraint
    estimate_at_max: MemoryEstimate
    estimate_at_next: MemoryEstimate | None
    evaluated: tuple[tuple[int, int], ...]
    device: DeviceProfile
    note: str = ""
    stack: Any = None  # the Stack the step was predicted for (batchfit.engine.stack)
    parallel: Any = None  # a batchfit.sharding.Parallelism: the answer is per rank
    ranks: tuple[tuple[int, int, int], ...] = ()  # (rank, max batch, bytes at it)
    binding_rank: int | None = None

    @property
    def total_budget_bytes(self) -> int:
        return self.budget_bytes + _fixed_bytes(self.device)

    @property
    def step_bytes_at_max(self) -> int:
        return budget_bytes_needed(self.estimate_at_max)

    @property
    def step_bytes_at_next(self) -> int | None:
        return None if self.estimate_at_next is None else budget_bytes_needed(self.estimate_at_next)

    @property
    def next_batch_size(self) -> int | None:
        return None if self.estimate_at_next is None else self.estimate_at_next.batch_size

    def to_dict(self) -> dict[str, Any]:
        est = self.estimate_at_max
        data = self._to_dict(est)
        if self.parallel is not None:
            data.update(parallel=self.parallel.to_dict(), binding_rank=self.binding_rank,
                        ranks=[{"rank": r, "max_batch_size": b, "total_bytes_at_max": t}
                               for r, b, t in self.ranks])
        return data

    def _to_dict(self, est: MemoryEstimate) -> dict[str, Any]:
        return {
            "max_batch_size": self.max_batch_size,
            "budget_bytes": self.budget_bytes,
            "memory_bytes": self.memory_bytes,
            "margin": self.margin,
            "total_bytes_at_max": self.total_bytes_at_max,
            "total_bytes_at_next": self.total_bytes_at_next,
            "total_budget_bytes": self.total_budget_bytes,
            "step_bytes_at_max": self.step_bytes_at_max,
            "step_bytes_at_next": self.step_bytes_at_next,
            "next_batch_size": self.next_batch_size,
            "device": self.device.to_dict(),
            "traces": self.traces,
            "binding_constraint": self.binding_constraint.value,
            "by_category": {c.value: b for c, b in est.by_category.items()},
            "top_modules": [m.to_dict() for m in est.top_modules],
            "peak_phase": est.peak_phase.value,
            "explanation": est.explain(),
            "evaluated": [list(pair) for pair in self.evaluated],
            "note": self.note,
            "stack": (self.stack.to_dict(self.device.compute_capability)
                      if self.stack is not None else None),
            "host_backed_bytes": est.host_backed_bytes,
            "warnings": list(est.warnings),
        }


@dataclass(frozen=True)
class MaxSeqLenResult:
    """The longest sequence length that fits at a fixed batch size.

    ``budget_bytes`` leaves the context, NCCL and workspaces out, as ``MaxBatchResult``'s
    does; ``total_bytes_at_*`` include them, as does ``total_budget_bytes``.
    ``total_bytes_at_next`` is at ``next_seq_len`` (None when it was not traced).
    """

    max_seq_len: int
    batch_size: int
    budget_bytes: int
    total_bytes_at_max: int
    total_bytes_at_next: int | None
    traces: int
    capped: bool
    device: DeviceProfile
    next_seq_len: int | None = None

    @property
    def total_budget_bytes(self) -> int:
        return self.budget_bytes + _fixed_bytes(self.device)

    def to_dict(self) -> dict[str, Any]:
        return {
            "max_seq_len": self.max_seq_len, "batch_size": self.batch_size,
            "budget_bytes": self.budget_bytes, "total_budget_bytes": self.total_budget_bytes,
            "total_bytes_at_max": self.total_bytes_at_max,
            "total_bytes_at_next": self.total_bytes_at_next, "next_seq_len": self.next_seq_len,
            "traces": self.traces, "capped": self.capped, "device": self.device.to_dict(),
            "warnings": list(self.warnings),
        }

    @property
    def warnings(self) -> tuple[str, ...]:
        """That the card's marketed memory stands in for CUDA's total, where it does
        (:func:`~batchfit.device.profile.marketed_memory_note`)."""
        note = marketed_memory_note(self.device)
        return (note,) if note else ()


def _budget(profile: DeviceProfile, memory_bytes: int | None, margin: float) -> tuple[int, int]:
    if not 0 <= margin < 1:
        raise InvalidInputError(f"margin {margin} must be a fraction in [0, 1), e.g. 0.05")
    memory = memory_bytes if memory_bytes is not None else profile.total_memory_bytes
    if memory is None:
        raise InvalidInputError(
            f"no memory budget for the CPU: give {option('memory', '16GiB')} or a GPU")
    overhead = _fixed_bytes(profile)
    budget = int(memory * (1 - margin)) - overhead
    if budget <= 0:
        raise NothingFits(overhead, int(memory * (1 - margin)), smallest=0)
    return memory, budget


def _fixed_bytes(profile: DeviceProfile) -> int:
    """What the device holds whatever the batch: the context, NCCL and the workspaces."""
    return profile.outside_allocator_bytes + profile.workspace_bytes


def budget_bytes_needed(est: MemoryEstimate) -> int:
    """What the step needs from the budget: reserved memory less the fixed workspace."""
    device = est.device
    if device.is_cuda:
        return est.peak_reserved_bytes - device.workspace_bytes
    return est.peak_allocated_bytes


@old_objects_frozen()
def max_batch_size(model: Any, inputs: Any, config: TrainConfig | None = None, *,
                   device: DeviceProfile | str | None = None, memory_bytes: int | None = None,
                   margin: float = 0.0, max_batch_limit: int = DEFAULT_MAX_BATCH_LIMIT,
                   on_trace: Callable[[int], None] | None = None,
                   fit_batches: tuple[int, int] | None = None, parallel: Any = None,
                   nccl: Any = None, **options: Any) -> MaxBatchResult:
    """The largest batch size whose step fits the device.

    Args:
        model: an ``nn.Module`` or a factory (see :func:`batchfit.estimate`).
        inputs: the per-sample input spec.
        config: a :class:`TrainConfig`, or its fields as ``options``.
        device: ``"cpu"``, a catalog GPU name, or a :class:`DeviceProfile`.
        memory_bytes: overrides the device's memory (required for the CPU).
        margin: a fraction of memory kept free on top of the model (default 0).
        max_batch_limit: the largest answer reported; ``binding_constraint`` says when it binds.
        on_trace: called with each batch size before it is traced (progress display).
        fit_batches: the two batch sizes traced first to interpolate the step (default 16
            and 32). A workload whose answer is likely small (LLM fine-tuning at long
            context: the weights fill the card) saves traces with ``(1, 2)``: that pair
            is traced first (as one round of the pool) and settles an answer of 0 or 1 at
            once (batch 2 over the budget: it is the confirming pair); when batch 2 fits,
            the step is interpolated from 2 and 3 (batch 1 cannot pair with 2 for LLMs:
            its trace has one clone fewer, so its events are not affine with theirs).
        parallel: a :class:`batchfit.sharding.Parallelism`: the answer is the per-GPU
            (micro-)batch that fits every rank; ``binding_rank`` names the rank that
            limits it (:mod:`batchfit.answers.ranks`).
        nccl: a :class:`batchfit.sharding.NcclMemory` (NCCL's buffers; with ``parallel``).

    Raises:
        NothingFits: batch 1 does not fit (``needed_bytes`` vs ``budget_bytes``).
    """
    config = make_config(config, options)
    profile = step_profile(device, config)
    if parallel is not None:
        return _max_batch_per_rank(model, inputs, config, profile, parallel, nccl,
                                   memory_bytes, margin, max_batch_limit, on_trace, fit_batches)
    return _max_batch(model, inputs, config, profile, memory_bytes, margin, max_batch_limit,
                      on_trace, None, fit_batches)


def _max_batch_per_rank(model: Any, inputs: Any, config: TrainConfig, profile: DeviceProfile,
                        parallel: Any, nccl: Any, memory_bytes: int | None, margin: float,
                        max_batch_limit: int, on_trace: Callable[[int], None] | None,
                        fit_batches: tuple[int, int] | None) -> MaxBatchResult:
    """The smallest of the traced ranks' answers (:meth:`Parallelism.ranks_to_trace`)."""
    from batchfit.answers.ranks import rank_profile
    from batchfit.sharding.rank import trace_config
    from batchfit.sharding.transforms import transform_for

    ranked = rank_profile(profile, parallel, nccl)
    run_config = trace_config(config, parallel)
    results = []
    for rank in parallel.ranks_to_trace():
        def make_transform(rank: int = rank) -> Any:
            return transform_for(parallel, rank, config.precision)

        results.append((rank, _max_batch(model, inputs, run_config, ranked, memory_bytes,
                                         margin, max_batch_limit, on_trace, make_transform,
                                         fit_batches)))
    binding_rank, binding = min(results, key=lambda pair: (pair[1].max_batch_size, pair[0]))
    return replace(binding, parallel=parallel, binding_rank=binding_rank, ranks=tuple(
        (rank, r.max_batch_size, r.total_bytes_at_max) for rank, r in results))


def _max_batch(model: Any, inputs: Any, config: TrainConfig, profile: DeviceProfile,
               memory_bytes: int | None, margin: float, max_batch_limit: int,
               on_trace: Callable[[int], None] | None,
               make_transform: Callable[[], Any] | None,
               fit_batches: tuple[int, int] | None = None) -> MaxBatchResult:
    memory, budget = _budget(profile, memory_bytes, margin)
    estimates: dict[int, MemoryEstimate] = {}
    traces: dict[int, StepTrace] = {}
    reuse = TraceReuse()

    def trace(batch_size: int) -> tuple[StepTrace, MemoryEstimate]:
        """The trace and its summary (a worker summarises its own, in parallel)."""
        transform = make_transform() if make_transform is not None else None
        traced = trace_step(model, inputs, batch_size, config, profile, reuse,
                            transform=transform)
        return traced, summarize(traced, profile, first_step=False)

    pool = _trace_pool(trace, model, profile, reuse, config)

    def prefetch(*batch_sizes: int) -> None:
        for batch_size, (traced, summary) in _trace_new(pool, batch_sizes, estimates,
                                                        on_trace).items():
            traces[batch_size] = traced
            estimates[batch_size] = summary

    def peak(batch_size: int) -> int:
        prefetch(batch_size)
        return budget_bytes_needed(estimates[batch_size])

    with pool:
        answer = _answer_from_interpolation(peak, prefetch, traces, profile, budget,
                                            max_batch_limit, fit_batches or _FIT_BATCHES)
        if answer is None:
            answer = solve_max_batch(peak, budget,
                                     max_batch_limit=max_batch_limit).max_batch_size
    capped = answer == max_batch_limit
    constraint = Constraint.LIMIT if capped else Constraint.MEMORY
    note = f"capped at max_batch_limit={max_batch_limit}; more may fit" if capped else ""
    if profile.is_cuda and _exceeded(estimates[answer]):
        answer = _limit_safe_batch(answer, estimates, peak)
        hit = estimates[answer + 1].kernel_limit
        assert hit is not None  # _limit_safe_batch stops below the first batch that exceeds
        constraint = Constraint(hit.kind.value)
        note = f"at batch {answer + 1}, {hit.describe()} ({hit.source})"
    at_max = estimates[answer]
    if at_max.first_step_peak_bytes is None:  # the solver's traces skip the first step
        at_max = replace(at_max, first_step_peak_bytes=profile.outside_allocator_bytes + needed_bytes(
            traces[answer].first_events, profile, loop=False))
    at_next = estimates.get(answer + 1)
    return MaxBatchResult(
        max_batch_size=answer, budget_bytes=budget, memory_bytes=memory, margin=margin,
        total_bytes_at_max=at_max.total_bytes,
        total_bytes_at_next=at_next.total_bytes if at_next else None,
        traces=len(estimates), binding_constraint=constraint,
        estimate_at_max=at_max, estimate_at_next=at_next,
        evaluated=tuple((b, budget_bytes_needed(e)) for b, e in estimates.items()),
        device=profile, note=note, stack=config.resolved_stack)


def _trace_pool(trace: Callable[[int], Any], model: Any, profile: DeviceProfile,
                reuse: TraceReuse, config: TrainConfig) -> TracePool:
    """A pool that traces two at a time for CUDA targets; a factory's model is built on
    meta first (with its LLM workload applied), so the worker forked later inherits it
    instead of building its own."""
    if profile.is_cuda:
        reuse.build_model(model, config)
    return TracePool(trace, allowed=profile.is_cuda)


def _trace_new(pool: TracePool, sizes: Sequence[int], done: Mapping[int, Any],
               on_trace: Callable[[int], None] | None) -> dict[int, Any]:
    """Trace the sizes not in ``done``, two at a time where the machine allows."""
    todo = [n for n in dict.fromkeys(sizes) if n not in done]
    for size in todo:
        if on_trace is not None:
            on_trace(size)
    return pool.map(todo)


#: Batch sizes traced to fit the per-event sizes: moderate batches, where per-sample
#: tensors already dominate the fixed ones, so a line through them extrapolates far
#: better than one through 1 and 2 (the docs' accuracy notes give the measurement).
_FIT_BATCHES = (16, 32)


def _answer_from_interpolation(peak: Callable[[int], int], prefetch: Callable[..., None],
                               traces: dict[int, StepTrace], device: DeviceProfile, budget: int,
                               limit: int, fit_batches: tuple[int, int] = _FIT_BATCHES
                               ) -> int | None:
    """Solve on events interpolated from two traces, then confirm B* and B*+1 by tracing.

    When the step's op sequence does not depend on the batch size, every event of a
    trace at B has a size affine in B, so two traces give the whole step at any B and
    the allocator replay finds B* without tracing it, above the traced sizes or below
    them (a large model whose B* is under 16; its confirming pair then runs as a pair,
    not one trace after another). Returns None when the traces differ in structure,
    the guess fails its confirmation, nothing may fit (the solver then traces B=1 and
    says so), or the range is too small.
    """
    small, large = fit_batches
    if small == 1 and limit > large:
        # the confirming pair of a small answer first: 1 fits and 2 does not ends the
        # search; 1 over the budget leaves it to the solver, which raises NothingFits
        # from the cached trace; else interpolate from 2 and 3 (see max_batch_size)
        prefetch(1, large)
        if peak(1) > budget:
            return None
        if peak(large) > budget:
            return 1
        small, large = large, large + 1
    if limit <= large:
        return None
    prefetch(small, large)
    events_at = _interpolator(traces[small].steady_events, traces[large].steady_events,
                              small, large)
    if events_at is None:
        return None
    limit_bytes = budget + device.workspace_bytes if device.is_cuda else budget

    def fits(batch_size: int) -> bool:
        return fits_within(events_at(batch_size), device, limit_bytes)

    if peak(large) <= budget:
        if peak(small) > budget:  # more batch, less memory: not for interpolation
            return None
        answer = _largest_fitting(fits, large, limit,
                                  _guess(events_at, peak(large), large, budget, limit))
    elif peak(large) > peak(small):
        low = small if peak(small) <= budget else 1
        if low == 1 and not fits(1):
            return None
        line = small + (budget - peak(small)) * (large - small) // (peak(large) - peak(small))
        answer = _largest_fitting(fits, low, large - 1, min(max(line, low), large - 1))
    else:
        return None
    prefetch(answer, min(answer + 1, limit))
    if peak(answer) > budget:
        return None
    if answer < limit and peak(answer + 1) <= budget:
        return None
    return answer


def _guess(events_at: Callable[[int], list[Event]], peak_at_large: int, large: int,
           budget: int, limit: int) -> int:
    """Where the live bytes' peak plus the allocator's overhead at ``large`` meets the budget.

    The peak of live bytes is a max of lines in B and costs one pass over the events
    (no allocator), so a few secant steps from ``large`` find where it crosses; the
    overhead beyond live bytes (rounding, cached blocks) is taken as at ``large``. For
    ResNet-50 amp-fp16 on an RTX 3090 it guessed 552 for the answer 553, where a line
    through the allocator peaks at 16 and 32 said 509.
    """
    live_large = peak_live_bytes(events_at(large))
    target = budget - (peak_at_large - live_large)
    guess = min(2 * large, limit)
    for _ in range(3):
        rise = peak_live_bytes(events_at(guess)) - live_large
        if rise <= 0:
            return limit
        guess = min(limit, max(large, large + int((target - live_large) * (guess - large) / rise)))
        if guess == large:
            break
    return guess


def _largest_fitting(fits: Callable[[int], bool], low: int, high: int, guess: int) -> int:
    """The largest ``b`` in ``[low, high]`` with ``fits(b)``, given ``fits(low)`` and that
    ``fits`` turns False once and stays False (more batch, more memory).

    Starts at ``guess`` and doubles its step away from it until the answer is bracketed,
    then bisects: ``~2 log2(|error of the guess|) + 2`` calls, each one replay of the
    step; a good guess from :func:`_guess` makes that a handful.
    """
    lo, hi = low, high + 1  # fits(lo); hi is past the answer (fails, or beyond the range)
    probe = min(max(guess, low + 1), high)
    step = 1
    while lo + 1 < hi and lo < probe < hi:
        if fits(probe):
            lo = probe
            probe += step
        else:
            hi = probe
            probe -= step
        step *= 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


def _interpolator(first: Sequence[Event], second: Sequence[Event], at_first: int,
                  at_second: int) -> Callable[[int], list[Event]] | None:
    """Events at any batch size from two traces of the same structure, else None."""
    if len(first) != len(second):
        return None
    span = at_second - at_first
    slopes = []
    for a, b in zip(first, second):
        if a.kind is not b.kind or a.category is not b.category or a.op != b.op:
            return None
        slopes.append((b.nbytes - a.nbytes) / span)

    def events_at(batch_size: int) -> list[Event]:
        delta = batch_size - at_first
        return [Event(e.kind, e.key, max(0, round(e.nbytes + slope * delta)), e.category,
                      e.module, e.op, e.phase) for e, slope in zip(first, slopes)]

    return events_at


def _exceeded(est: MemoryEstimate) -> bool:
    return est.kernel_limit is not None and est.kernel_limit.exceeded


def _limit_safe_batch(answer: int, estimates: dict[int, MemoryEstimate],
                      peak: Callable[[int], int]) -> int:
    """Largest batch whose launches all stay within their kernels' limits (each measure, a
    tensor's elements or a grid dimension, grows about linearly in B), confirmed by
    tracing B and B+1 as for memory."""
    hit = estimates[answer].kernel_limit
    assert hit is not None
    guess = max(1, min(answer - 1, int(answer * hit.limit // hit.measure)))
    while True:
        for b in (guess, guess + 1):
            if b not in estimates:
                peak(b)
        if _exceeded(estimates[guess]) and guess > 1:
            guess -= 1
        elif not _exceeded(estimates[guess + 1]):
            guess += 1
        else:
            return guess


@old_objects_frozen()
def max_seq_len(model: Any, inputs: Any, batch_size: int, config: TrainConfig | None = None, *,
                device: DeviceProfile | str | None = None, memory_bytes: int | None = None,
                margin: float = 0.0, max_len: int = 131072, multiple_of: int = 1,
                on_trace: Callable[[int], None] | None = None, **options: Any) -> MaxSeqLenResult:
    """The longest sequence length that fits at ``batch_size`` (token models).

    Every integer input of ``inputs`` with a sequence axis (its first per-sample
    dimension) gets the candidate length.
    """
    config = make_config(config, options)
    profile = step_profile(device, config)
    _, budget = _budget(profile, memory_bytes, margin)
    totals: dict[int, MemoryEstimate] = {}
    reuse = TraceReuse()

    def trace(seq_len: int) -> MemoryEstimate:
        return estimate(model, with_seq_len(inputs, seq_len), batch_size, config,
                        device=profile, reuse=reuse)

    pool = _trace_pool(trace, model, profile, reuse, config)

    def prefetch(*lengths: int) -> None:
        totals.update(_trace_new(pool, lengths, totals, on_trace))

    def peak(seq_len: int) -> int:
        prefetch(seq_len)
        return budget_bytes_needed(totals[seq_len])

    with pool:
        if profile.is_cuda:
            _prefetch_first_lengths(prefetch, max_len, multiple_of)
        solved = solve_max_seq_len(peak, budget, max_len=max_len, multiple_of=multiple_of)
    at_next = solved.max_seq_len + multiple_of
    return MaxSeqLenResult(
        max_seq_len=solved.max_seq_len, batch_size=batch_size, budget_bytes=budget,
        total_bytes_at_max=totals[solved.max_seq_len].total_bytes,
        total_bytes_at_next=totals[at_next].total_bytes if at_next in totals else None,
        traces=len(totals), capped=solved.capped, device=profile,
        next_seq_len=at_next if at_next in totals else None)


def _prefetch_first_lengths(prefetch: Callable[..., None], max_len: int,
                            multiple_of: int) -> None:
    """Trace, two at a time, the lengths :func:`solve_max_seq_len` evaluates first: the
    shortest, its probes at a quarter and a half of ``max_len``, and ``max_len``
    itself (which ends the search at once when it fits, as for GPT-2 at its 1,024
    context). Speculative: a length that fails to trace here is traced again, and
    reported, only if the solver asks for it."""
    lengths = (multiple_of, *default_seq_len_probes(max_len, multiple_of),
               max_len // multiple_of * multiple_of)
    first = [n for n in lengths if n >= multiple_of]
    for pair in (first[:2], first[2:]):
        try:
            prefetch(*pair)
        except Exception:  # noqa: BLE001 - the solver's own evaluation raises it if needed
            continue


def with_seq_len(inputs: Any, seq_len: int) -> Any:
    """``inputs`` with every sequence-shaped tensor spec set to ``seq_len``."""
    if isinstance(inputs, TensorSpec):
        return inputs.with_seq_len(seq_len) if inputs.shape else inputs
    if isinstance(inputs, dict):
        return {k: with_seq_len(v, seq_len) for k, v in inputs.items()}
    if isinstance(inputs, tuple):
        return tuple(with_seq_len(v, seq_len) for v in inputs)
    raise InvalidInputError("the sequence length axis needs TensorSpec inputs")
