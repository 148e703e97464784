"""``batchfit.search_max_batch``: the exact largest batch on the real device, in a few real steps.

The analytic prediction (:func:`batchfit.max_batch_size`) says where to look; real
trials (:mod:`batchfit.realrun.trial`) decide. The decision logic is torch-free and lives in :mod:`batchfit.realrun.boundary`
(the strategies, and the recommended batch).

The CPU prediction is two traces, at batch 16 and 32 (:func:`batchfit.estimate`): the
state (parameters, buffers, optimizer state) and the growth at 16 come from the first,
the per-sample slope from both, and the line is solved for the cap. Where the answer is
below 32 the peak need not be affine in the batch (at small batches it can sit in the
optimizer step), and :func:`batchfit.max_batch_size` solves exactly (more traces).

Why each CPU trial is a fresh process: after an out-of-memory error the freed memory
stays in the process (glibc's heap, and whatever the training loop still holds), so a
later, smaller batch can fail in the same process (Lightning's binsearch can see 48 fail
after 64 failed with a true maximum of 63; ``benchmarks/search_vs_peers.py``). A fresh
interpreter costs seconds (``import torch``, then ``torch._dynamo`` at the first
optimizer), so
the trials fork from a zygote that imported torch and the model's library once
(:class:`batchfit.realrun.trial_server.TrialServer`), through a *template*: a child of the zygote that
builds the model and the optimizer and warms up once, while the prediction runs. Each
trial is a child forked from the template, its memory the template's byte for byte, so
a trial costs a fork and its steps. (On one thread only: on more, each trial child
builds and warms up itself, one prepared ahead, as before; see the TrialServer.) The forked
trials find the boundary; the answer is settled in exec'd fresh interpreters (below). On CUDA the
trials run in the user's process (the model is there), an
out-of-memory error is followed by ``empty_cache()``, which hands every cached segment
back, and a failure that followed another failure is re-run before it is believed
(approaching from below, a search rarely has a second failure).

Distributed (``torch.distributed`` initialized, or ``process_group``): every rank runs
every trial on its own device (CPU: its own capped children; CUDA: in its process),
catches its own out-of-memory error, and only then, outside the trial, takes part in
one ``all_reduce(MIN)`` per trial: the batch fits only if it fitted on every rank, and
the usage model follows the rank with the least room left. The loop is deterministic,
so every rank tries the same batch sizes and returns the same answer. A
``DistributedDataParallel`` model runs through its wrapped module, without DDP's
gradient all-reduce, which would leave the ranks that did not run out of memory waiting
in backward (:mod:`batchfit.realrun.distributed`).

The CPU memory cap: ``memory_cap_bytes`` is what a trial may use beyond the process's
own state after building the model and the optimizer and one warm-up step at batch 1
(``RLIMIT_DATA`` = ``VmData`` + cap; see :mod:`batchfit.realrun.trial`). The analytic
prediction is asked for the same thing: its CPU budget is the live state the trace
counts at that point (parameters, buffers, optimizer state) plus the cap.

The process the trials answer for is the user's: a fresh process with the caller's
thread count (torch's default in the CLI) and glibc's allocator as the environment sets it.
glibc's dynamic mmap threshold makes such a process a noisy device: once a freed tensor
raises the threshold, later tensors of that size come from the heap, the heap fragments,
and near the cap the outcome depends on its layout, which is drawn when the interpreter
starts (its hash seed and address layout; :mod:`batchfit.realrun.fresh`). A small CNN under a 128 MiB cap fitted
batch 62 with the threshold pinned at 128 KiB on one thread (what the trials ran before:
every tensor of 128 KiB or more mapped on its own, a sharp and repeatable boundary) and
41 in a plain ``python`` process with torch's defaults, where 42 fitted in 1 of 4 runs and
43 in 2 of 4. So the search first finds a boundary as before (one forked trial per
batch), then settles it in exec'd fresh interpreters, the user's kind of process
(:mod:`batchfit.realrun.fresh`; forks start from the zygote's heap): the
answer must fit in all of ``boundary_runs`` (3) of them (:func:`~batchfit.realrun.fresh.settle_boundary`
gallops and bisects from the forked answer), and ``SearchResult.boundary`` says in how
many the batch above fitted. ``boundary_runs=1`` skips the settling. ``reproducible=True`` brings back the pinned
threshold (a repeatable boundary of a process the user does not run).

What the prediction misses on the CPU (``benchmarks/max_vs_true_cpu.py``): 5-7 MiB of
process memory outside the tensor allocator at any batch (Python and autograd objects,
small allocations, oneDNN's JIT-compiled kernels), and for convolution nets trained
through oneDNN (batch >= 2) about 30 MiB more for ResNet-18 (gone with
``torch.backends.mkldnn.enabled = False``). The search does not depend on the
prediction being right: the first trial measures the real usage.

Known limitations:
    * A sharded model (FSDP2, HSDP, tensor parallel) is searched from its factory with
      ``parallel=`` under ``torch.distributed``, on the CPU only, without a prediction
      (:mod:`batchfit.realrun.sharded_trial`); an FSDP-wrapped model itself is refused.
    * The model takes usage to be affine in the batch size near the boundary; a
      staircase (allocator rounding) only costs extra trials, never a wrong answer.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from batchfit.engine.spec import TrainConfig, make_config
from batchfit.errors import DoesNotFitError, InvalidInputError, UntraceableError, option
from batchfit.realrun.boundary import (
    DEFAULT_MAX_BATCH_LIMIT,
    Outcome,
    SearchPlan,
    _clamp,
    recommended_batch,
    search_boundary,
)

if TYPE_CHECKING:
    from batchfit.realrun.trial import Trial

#: glibc's initial mmap threshold; pinning it disables the dynamic threshold.
PINNED_MMAP_THRESHOLD = 128 * 1024
#: The CPU prediction's two traces: a line through them is solved for the cap.
_LINE_BATCHES = (16, 32)




# --------------------------------------------------------------------------- the result


@dataclass(frozen=True)
class SearchResult:
    """The largest batch that ran on the real device, and the evidence.

    Attributes:
        max_batch_size: the largest batch that fits: it ran, and the next one did not
            (in a fresh process on a capped CPU). 0 never happens: nothing fitting raises.
        recommended_batch_size: the maximum less headroom (rule in the module docstring).
        predicted_max_batch_size: the analytic prediction the search started from.
        prediction_error: ``(predicted - max) / max`` (positive: the prediction was high).
        trials: every trial, in order (distributed: this rank's own, so a trial here can
            fit above the answer when another rank ran out of memory).
        device: ``"cpu"`` or ``"cuda:N"``.
        memory_cap_bytes: the cap the trials ran under (None: the whole device).
        steps_per_trial: real steps per trial.
        seconds: wall time of the whole search (prediction included).
        capped: True when the answer is ``max_batch_limit`` (more may fit).
        overhead_bytes: the allocator's overhead at the maximum (see the docstring;
            distributed: the largest of the ranks').
        world_size: the ranks that searched together (1: a single-process search).
        limiting_rank: distributed: the lowest rank that ran out of memory at the
            batch after the answer (None otherwise).
        boundary: CPU: ``(batch_size, fits, runs)`` for the batches at the boundary, each
            run in ``boundary_runs`` exec'd fresh interpreters: the answer fitted in all of its runs,
            the batch above it in ``fits`` of ``runs`` (flaky when 0 < fits < runs).
    """

    max_batch_size: int
    recommended_batch_size: int
    predicted_max_batch_size: int | None
    prediction_error: float | None
    trials: tuple[Trial, ...]
    device: str
    memory_cap_bytes: int | None
    steps_per_trial: int
    seconds: float
    capped: bool = False
    overhead_bytes: int | None = None
    world_size: int = 1
    limiting_rank: int | None = None
    boundary: tuple[tuple[int, int, int], ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "max_batch_size": self.max_batch_size,
            "recommended_batch_size": self.recommended_batch_size,
            "predicted_max_batch_size": self.predicted_max_batch_size,
            "prediction_error": (None if self.prediction_error is None
                                 else round(self.prediction_error, 6)),
            "trials": [t.to_dict() for t in self.trials],
            "device": self.device,
            "memory_cap_bytes": self.memory_cap_bytes,
            "steps_per_trial": self.steps_per_trial,
            "seconds": round(self.seconds, 3),
            "capped": self.capped,
            "overhead_bytes": self.overhead_bytes,
            "world_size": self.world_size,
            "limiting_rank": self.limiting_rank,
            "boundary": [{"batch_size": b, "fits": k, "runs": n} for b, k, n in self.boundary],
        }


# --------------------------------------------------------------------------- the entry point


def search_max_batch(model: Any, inputs: Any = None, config: TrainConfig | None = None, *,
                     device: str = "cpu", memory_cap_bytes: int | None = None,
                     steps_per_trial: int = 2, predicted: int | None = None,
                     optimizer: Any = None, loader: Any = None,
                     max_batch_limit: int = DEFAULT_MAX_BATCH_LIMIT, min_headroom: float = 0.05,
                     approach: float | None = None, reproducible: bool = False,
                     boundary_runs: int = 3, timeout_s: float | None = None,
                     on_trial: Callable[[Trial], None] | None = None,
                     trial_server: Any = None, process_group: Any = None,
                     parallel: Any = None, **options: Any) -> SearchResult:
    """Find the largest batch size that trains (or infers) on the real device.

    On the CPU every trial is a fresh process capped at ``memory_cap_bytes`` beyond its
    warmed-up state; the user's model, optimizer and loader are never run here. On CUDA
    the trials run in this process on ``model``, under
    ``torch.cuda.set_per_process_memory_fraction`` when a cap is given, and everything
    is restored bit-exactly afterwards (:func:`batchfit.realrun.state.preserved_state`).

    Under ``torch.distributed`` (initialized, or ``process_group`` given) every rank of
    the group must call this: each runs every trial on its own device, and a batch fits
    only if it fits on every rank, so all ranks return the same answer
    (:mod:`batchfit.realrun.distributed`). A ``DistributedDataParallel`` model is searched
    through its wrapped module, without DDP's gradient all-reduce. A sharded model (FSDP2,
    HSDP, tensor parallel) is searched from its unsharded factory and ``parallel``: each
    rank's trial process joins the other ranks' in a gloo group of that trial's own and
    shards the model there; a trial that runs out of memory ends its process, and the
    others' collectives fail at once (CPU only; :mod:`batchfit.realrun.sharded_trial`).

    Args:
        model: an ``nn.Module``, a factory, a :class:`~batchfit.models.resolve.ModelSpec` or a spec
            string (``timm:resnet18``, ``path/file.py:factory``, ``package.module:function``).
        inputs: the per-sample input spec (default: the model spec's own; with a loader and
            no spec, the first tensor of the loader's first batch, without its batch axis).
        config: a :class:`TrainConfig`, or its fields as ``options``.
        device: ``"cpu"`` or ``"cuda"``/``"cuda:N"``.
        memory_cap_bytes: CPU: bytes beyond the warmed-up state (default: the memory the
            machine has available); CUDA: the caching allocator's limit.
        steps_per_trial: real steps per trial (>= 2; the peak is the steady state's).
        predicted: skip the analytic prediction and start here.
        optimizer: the user's optimizer (CUDA: used and restored; CPU: its class and
            hyper-parameters define the trials' optimizer).
        loader: a data loader whose position is kept (it is never iterated, except once
            to read the input spec when ``inputs`` is None; that read is undone).
        max_batch_limit: never try beyond this.
        min_headroom: the least fraction of the limit the recommendation leaves free.
        approach: the first trial's margin below the prediction, as a fraction of the
            limit (default: on the CPU batch 16, where the prediction's line was traced,
            when it predicts more than 32, else 0.25; 0.05 on CUDA; see the module
            docstring).
        reproducible: CPU: trial processes pin glibc's mmap threshold (and a one-thread
            caller makes them single-threaded): a repeatable boundary, but of a process
            the user does not run (a small CNN fitted 62 there and 41 in a plain process).
            By default the trials keep the caller's allocator settings and thread count.
        boundary_runs: CPU: the answer must fit in this many exec'd fresh interpreters, and
            the batch above it is run as often, so its flakiness shows
            (``SearchResult.boundary``); 1: the forked trials' answer, not settled.
        timeout_s: a trial running longer than this raises (CPU).
        on_trial: called with each :class:`~batchfit.realrun.trial.Trial` as it finishes.
        trial_server: CPU: a running :class:`~batchfit.realrun.trial_server.TrialServer` to fork the
            trials from, shared between searches (its environment is then the caller's
            business, ``reproducible`` does not apply); by default one is started
            for this search and stopped after it.
        process_group: the ranks that search together (default: every rank, when
            ``torch.distributed`` is initialized); False: this rank alone.
        parallel: a :class:`batchfit.sharding.Parallelism` (``fsdp``, ``fsdp-grad-op``,
            ``hsdp``, ``tp``; its world size the group's): every trial shards ``model``,
            an unsharded factory, that way across the ranks' trial processes. The batch
            is per rank (each rank's micro-batch); no prediction is traced (the search
            starts from ``predicted`` or from batch 1 up).

    Raises:
        DoesNotFitError: even batch 1 does not fit (distributed: on some rank).
        InvalidInputError: a device that does not exist, a bad cap or step count.
        TrialError: a trial died, timed out, or (distributed) raised on another rank.

    Example:
        >>> import functools, torch
        >>> factory = functools.partial(torch.nn.Linear, 256, 256)
        >>> result = search_max_batch(factory, (256,), device="cpu",
        ...                           memory_cap_bytes=16 * 2**20, optimizer="sgd")
        >>> result.max_batch_size > 0 and result.trials[-1].batch_size >= result.max_batch_size
        True
    """
    started = time.perf_counter()
    from batchfit.realrun.distributed import agreement_for, local_module

    agreement = None if process_group is False else agreement_for(process_group)
    rendezvous = None
    if parallel is not None:
        from batchfit.realrun.sharded_trial import TrialRendezvous

        with _agreed(agreement, "checking the layout"):
            rendezvous = TrialRendezvous.start(agreement, parallel, device)
        rendezvous.share(agreement)
    with _agreed(agreement, "checking the search's arguments"):
        model = local_module(model)
        config = make_config(config, options if not _is_optimizer(optimizer) else
                             {**options, **_optimizer_options(optimizer)})
        if isinstance(optimizer, (str, type)):  # optimizer="sgd" is a config field
            config = make_config(config, {"optimizer": optimizer})
            optimizer = None
        _check_search_args(steps_per_trial, memory_cap_bytes, max_batch_limit, min_headroom)
        target = torch_device_of(device)
    from batchfit.realrun.state import preserved_state

    user_model = model if _is_module(model) else None
    with preserved_state(user_model, optimizer if _is_optimizer(optimizer) else None, loader,
                         tensors=target.type != "cpu") as snapshot:
        search: _Search | None = None
        try:
            with _agreed(agreement, "preparing the search"):
                if inputs is None and loader is not None:
                    inputs = _inputs_from_loader(loader)
                    snapshot.restore()
                if target.type == "cpu":
                    search = _CpuSearch(model, inputs, config, memory_cap_bytes,
                                        steps_per_trial, reproducible, timeout_s, trial_server,
                                        rendezvous)
                else:
                    search = _CudaSearch(model, inputs, config, target, memory_cap_bytes,
                                         steps_per_trial, optimizer, snapshot)
                prediction = (search.predict() if predicted is None
                              else _Prediction(predicted))
            return search.run(prediction, _RunOptions(max_batch_limit, approach, min_headroom,
                                                      on_trial, started, boundary_runs),
                              agreement)
        finally:
            if search is not None:
                search.close()
            if rendezvous is not None:
                rendezvous.close()


def _agreed(agreement: Any, what: str) -> contextlib.AbstractContextManager[None]:
    """``what`` under an agreement: every rank gets through it, or every rank raises."""
    return agreement.stage(what) if agreement is not None else contextlib.nullcontext()


def _check_search_args(steps: Any, cap: Any, limit: Any, headroom: Any) -> None:
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 2:
        raise InvalidInputError(
            f"steps per trial must be an integer >= 2, not {steps!r}: step 1 may create the "
            "optimizer state, the steady-state peak is measured from step 2 on")
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap <= 0):
        raise InvalidInputError(f"memory cap must be a positive number of bytes, not {cap!r}")
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise InvalidInputError(f"max_batch_limit must be a positive integer, not {limit!r}")
    if not 0 <= headroom < 1:
        raise InvalidInputError(f"min_headroom {headroom} must be a fraction in [0, 1)")


def torch_device_of(device: Any) -> Any:
    """The torch device of ``"cpu"`` or ``"cuda:N"``: one line for an unknown name or a GPU
    this machine does not have."""
    import re

    import torch

    text = str(device).strip().lower()
    if text == "cpu":
        return torch.device("cpu")
    if not re.fullmatch(r"cuda(:\d+)?", text):
        raise InvalidInputError(f"unknown device {device!r}: use cpu or cuda:N (e.g. cuda:0)")
    index = int(text.partition(":")[2] or 0)
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if index >= count:
        raise InvalidInputError(
            f"device {device!r} does not exist: this machine has {count} CUDA device(s)"
            + ("" if count else f"; use {option('device', 'cpu')}"))
    return torch.device("cuda", index)


def _is_module(value: Any) -> bool:
    from torch import nn

    return isinstance(value, nn.Module)


def _is_optimizer(value: Any) -> bool:
    import torch

    return isinstance(value, torch.optim.Optimizer)


def _optimizer_options(optimizer: Any) -> dict[str, Any]:
    """The config fields that rebuild ``optimizer`` in a fresh process: its class and the
    defaults its constructor accepts (AdamW's ``defaults`` carry ``decoupled_weight_decay``,
    which ``AdamW()`` rejects)."""
    import inspect

    cls = type(optimizer)
    accepted = inspect.signature(cls.__init__).parameters
    open_ended = any(p.kind is p.VAR_KEYWORD for p in accepted.values())
    kwargs = {k: v for k, v in optimizer.defaults.items()
              if (open_ended or k in accepted)
              and (k not in ("differentiable", "capturable", "foreach", "fused")
                   or v not in (False, None))}
    return {"optimizer": cls, "optimizer_kwargs": kwargs}


def _inputs_from_loader(loader: Any) -> Any:
    import torch

    batch = next(iter(loader))
    if isinstance(batch, (tuple, list)):
        batch = batch[0]
    if isinstance(batch, dict):
        return {k: v[0] for k, v in batch.items() if isinstance(v, torch.Tensor)}
    if isinstance(batch, torch.Tensor):
        return batch[0]
    raise InvalidInputError(
        f"cannot read an input spec from a {type(batch).__name__} batch: give inputs")


def machine_memory_bytes() -> tuple[int, int]:
    """(MemTotal, MemAvailable) in bytes."""
    found: dict[str, int] = {}
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            key, _, value = line.partition(":")
            if key in ("MemTotal", "MemAvailable"):
                found[key] = int(value.split()[0]) * 1024
    return found["MemTotal"], found.get("MemAvailable", found["MemTotal"])


@dataclass(frozen=True)
class _Prediction:
    """What the analytic prediction tells the search (all optional but the batch)."""

    max_batch_size: int | None
    bytes_per_sample: float | None = None
    needed_bytes: int | None = None  # at batch 1, for the "nothing fits" error
    seed: int | None = None  # a first trial better than ``approach`` gives


@dataclass(frozen=True)
class _RunOptions:
    max_batch_limit: int
    approach: float | None
    min_headroom: float
    on_trial: Callable[[Trial], None] | None
    started: float
    boundary_runs: int = 1


class _Search:
    """What differs between devices: how a trial runs and what the prediction's budget is."""

    steps: int
    limit_bytes: int | None = None
    device_name: str = "cpu"
    cap_bytes: int | None = None
    isolated: bool = True
    usage_is_growth: bool = True
    default_approach: float = 0.25

    def close(self) -> None:
        pass

    def predict(self) -> _Prediction:
        raise NotImplementedError

    def trial(self, batch_size: int) -> Trial:
        raise NotImplementedError

    def confirm(self, batch_size: int, count: int, until_failure: bool) -> list[Trial]:
        """``count`` more runs at ``batch_size`` for the boundary (fewer after a failure
        with ``until_failure``)."""
        trials = []
        while len(trials) < count and not (until_failure and not all(t.fits for t in trials)):
            trials.append(self.trial(batch_size))
        return trials

    def start_confirming(self, runs: int) -> None:
        """Get the boundary's ``runs`` ready (while the search's trials run)."""

    def measure(self, trial: Trial) -> tuple[bool, int | None, int | None, int | None]:
        """``(fits, room left under the limit, live peak, allocator overhead)``."""
        slack = (None if trial.used_bytes is None or self.limit_bytes is None
                 else self.limit_bytes - trial.used_bytes)
        return trial.fits, slack, trial.peak_bytes, trial.overhead_bytes(self.usage_is_growth)

    def run(self, prediction: _Prediction, options: _RunOptions,
            agreement: Any = None) -> SearchResult:
        """Search from ``prediction``; with an ``agreement``, together with the other ranks."""
        predicted, per_sample = prediction.max_batch_size, prediction.bytes_per_sample
        needed, limit = prediction.needed_bytes, self.limit_bytes
        seed = prediction.seed if options.approach is None else None
        max_batch = options.max_batch_limit
        if agreement is not None:
            agreed = agreement.plan(predicted, per_sample, limit, seed, max_batch, needed)
            predicted, per_sample, limit = (agreed.predicted, agreed.bytes_per_sample,
                                            agreed.limit_bytes)
            seed, max_batch, needed = agreed.seed, agreed.max_batch_size, agreed.needed_bytes
        trials: list[Trial] = []
        agreed_trials: list[Any] = []

        def run_one(batch_size: int) -> Trial:
            trial = self.trial(batch_size)
            trials.append(trial)
            if options.on_trial is not None:
                options.on_trial(trial)
            return trial

        def evaluate(batch_size: int) -> Outcome:
            if agreement is None:
                trial = run_one(batch_size)
                return Outcome(batch_size, trial.fits, trial.used_bytes)
            _, outcome = agreement.trial(batch_size, lambda: run_one(batch_size), self.measure)
            agreed_trials.append(outcome)
            used = (None if outcome.slack_bytes is None or limit is None
                    else limit - outcome.slack_bytes)
            return Outcome(batch_size, outcome.fits, used if outcome.fits else None)

        approach = self.default_approach if options.approach is None else options.approach
        plan = SearchPlan(
            predicted=_clamp(predicted or 1, 1, max_batch), limit_bytes=limit,
            bytes_per_sample=per_sample, max_batch_size=max_batch, isolated=self.isolated,
            approach=approach if predicted else 0.0,
            slope_margin=0.0 if self.isolated else 0.02,
            seed=seed if predicted and seed is not None and seed <= predicted else None)
        settling = self.isolated and agreement is None and options.boundary_runs > 1
        if settling:
            self.start_confirming(options.boundary_runs)
        log = search_boundary(evaluate, plan)
        if agreement is not None:
            agreement.end(len(log.outcomes))
        answer = log.lower
        if answer == 0:
            self._nothing_fits(trials, agreed_trials, needed)
        boundary: tuple[tuple[int, int, int], ...] = ()
        if settling and answer < max_batch:
            from batchfit.realrun.fresh import settle_boundary

            def confirm(batch_size: int, count: int, until_failure: bool) -> list[Trial]:
                runs = self.confirm(batch_size, count, until_failure)
                for trial in runs:
                    trials.append(trial)
                    if options.on_trial is not None:
                        options.on_trial(trial)
                return runs

            answer, boundary = settle_boundary(answer, confirm, options.boundary_runs,
                                               max_batch)
        measured = [t for t in trials if t.fits and t.batch_size == answer]
        overhead = (next((t.overhead_bytes(self.usage_is_growth) for t in reversed(measured)
                          if t.peak_bytes is not None), None)
                    if agreement is None else
                    next(a for a in reversed(agreed_trials) if a.fits and a.batch_size == answer
                         ).overhead_bytes)
        limiting = next((a.limiting_rank for a in reversed(agreed_trials)
                         if not a.fits and a.batch_size == log.upper), None)
        if boundary:  # the spread was measured, not inferred from one run's overhead
            recommended = max(1, math.floor(answer * (1 - options.min_headroom)))
        else:
            recommended = recommended_batch(log, overhead, options.min_headroom)
        return SearchResult(
            max_batch_size=answer,
            recommended_batch_size=recommended,
            predicted_max_batch_size=predicted,
            prediction_error=(predicted - answer) / answer if predicted else None,
            trials=tuple(trials), device=self.device_name, memory_cap_bytes=self.cap_bytes,
            steps_per_trial=self.steps, seconds=time.perf_counter() - options.started,
            capped=answer >= max_batch, overhead_bytes=overhead,
            world_size=agreement.world_size if agreement is not None else 1,
            boundary=boundary,
            limiting_rank=limiting)

    def _nothing_fits(self, trials: list[Trial], agreed_trials: list[Any],
                      needed: int | None) -> None:
        own = next(t for t in trials if t.batch_size == 1)
        where = self.device_name
        if agreed_trials:
            rank = next(a for a in agreed_trials if a.batch_size == 1).limiting_rank
            where = f"rank {rank}'s {self.device_name}"
        raise DoesNotFitError(
            f"even batch 1 does not fit on {where}"
            + (f" with a cap of {self.cap_bytes} B" if self.cap_bytes and own.error else "")
            + (f": {own.error}" if own.error else ""), needed_bytes=needed or 0,
            available_bytes=self.cap_bytes or self.limit_bytes or 0)


class _CpuSearch(_Search):
    """Every trial in a fresh process forked from a zygote, capped with RLIMIT_DATA."""

    def __init__(self, model: Any, inputs: Any, config: TrainConfig, cap_bytes: int | None,
                 steps: int, reproducible: bool, timeout_s: float | None,
                 server: Any = None, rendezvous: Any = None):
        import os
        from dataclasses import replace

        from batchfit.realrun.trial_server import (
            TrialServer,
            factory_of,
            model_source,
            preloads_for,
            trial_request,
        )

        total, available = machine_memory_bytes()
        if cap_bytes is not None and cap_bytes > total:
            raise InvalidInputError(
                f"memory cap {cap_bytes} B is larger than this machine's {total} B of memory")
        self.cap_bytes = cap_bytes if cap_bytes is not None else available
        self.limit_bytes = self.cap_bytes
        self.model, self.config, self.steps, self.timeout_s = model, config, steps, timeout_s
        self.source, spec_inputs, loss_fn = model_source(model)
        self.factory = factory_of(self.source)  # what the trace in this process builds
        self.inputs = inputs if inputs is not None else spec_inputs
        if self.inputs is None:
            raise InvalidInputError("no input spec: give inputs, e.g. (3, 224, 224)")
        if loss_fn is not None and config.loss_fn is None:
            self.config = replace(config, loss_fn=loss_fn)
        self.request = trial_request(self.source, self.inputs, 1, self.config, self.cap_bytes,
                                     steps)
        self.rendezvous = rendezvous
        if rendezvous is not None:  # every trial shards the model in a group of its own
            self.request = replace(self.request, parallel=rendezvous.parallel)
        self.owns_server = server is None
        if server is None:
            environment = dict(os.environ)
            if reproducible:
                environment.setdefault("MALLOC_MMAP_THRESHOLD_", str(PINNED_MMAP_THRESHOLD))
            server = TrialServer(preloads_for(self.source), env=environment)
        self.server = server
        if rendezvous is None:  # a sharded trial's child builds in its group, not ahead
            self.server.prepare(self.request)  # the first child warms up during the prediction
        from batchfit.realrun.fresh import FreshPool

        self.fresh = FreshPool(self.request, server.env, timeout_s=timeout_s)
        self.available = available

    def close(self) -> None:
        self.fresh.close()
        if self.owns_server:
            self.server.close()

    def confirm(self, batch_size: int, count: int, until_failure: bool) -> list[Trial]:
        """Runs in exec'd fresh interpreters: the user's process (:mod:`batchfit.realrun.fresh`).

        Until a failure, one interpreter goes first and the rest (at once when memory
        allows) only if it fitted: one failure is enough to reject a batch, and most
        batches the settling tries do not hold (it gallops and bisects down to the
        answer), so a batch that fails costs one interpreter, not a wave of ``count``
        run side by side on the same cores. The next run's interpreters are started ahead
        (:meth:`FreshPool.start`), so the sequence costs no extra start-up."""
        if not until_failure or count == 1:
            return self.fresh.run(batch_size, count, until_failure=until_failure)
        first = self.fresh.run(batch_size, 1)
        if not first[0].fits:
            return first
        return first + self.fresh.run(batch_size, count - 1, until_failure=True)

    def start_confirming(self, runs: int) -> None:
        """All of a batch's ``runs`` at once when memory allows (an interpreter's start,
        ``import torch``, is most of a run's time), started now, during the search."""
        from batchfit.realrun.fresh import parallel_runs

        self.fresh.parallel = parallel_runs(self.cap_bytes, self.available, at_most=runs)
        self.fresh.start()

    def predict(self) -> _Prediction:
        """Two traces (batch 16 and 32) give the state, the growth at 16 and the slope;
        the line is solved for the cap. Below 32 the peak need not be affine (it can sit
        in the optimizer step), so there :func:`batchfit.max_batch_size` solves exactly."""
        from batchfit.answers.estimate import estimate
        from batchfit.engine.trace import TraceReuse
        from batchfit.engine.tracer import Category

        if self.rendezvous is not None:
            # the trials find the boundary from batch 1 up; each rank's prediction is
            # batchfit.max_batch_size(..., parallel=) for the GPU the ranks will use
            return _Prediction(None)
        small, large = _LINE_BATCHES
        reuse = TraceReuse()
        try:
            at_small, at_large = (estimate(self.factory, self.inputs, b, self.config,
                                           device="cpu", reuse=reuse, first_step=False)
                                  for b in (small, large))
        except UntraceableError:
            return _Prediction(None)
        state = sum(at_small.by_category.get(c, 0) for c in
                    (Category.PARAMETERS, Category.BUFFERS, Category.OPTIMIZER_STATE))
        slope = (at_large.total_bytes - at_small.total_bytes) / (large - small)
        growth = at_small.total_bytes - state  # beyond the warmed-up state, as the cap
        needed = max(0, round(growth - slope * (small - 1)))
        if slope <= 0:  # nothing grows with the batch: no line to solve
            return _Prediction(None, needed_bytes=needed)
        predicted = small + math.floor((self.cap_bytes - growth) / slope)
        if predicted > large:  # start where the line was traced: cheap, and on the line
            return _Prediction(predicted, slope, needed, seed=small)
        return self._predict_exactly(state, needed)

    def _predict_exactly(self, state: int, needed: int) -> _Prediction:
        from batchfit.answers.maxbatch import max_batch_size
        from batchfit.answers.solve import NothingFits

        try:
            result = max_batch_size(self.factory, self.inputs, self.config, device="cpu",
                                    memory_bytes=state + self.cap_bytes)
        except NothingFits:
            return _Prediction(1, needed_bytes=needed)
        except UntraceableError:
            return _Prediction(None, needed_bytes=needed)
        per_sample = None
        if result.total_bytes_at_next is not None:
            per_sample = float(result.total_bytes_at_next - result.total_bytes_at_max)
        return _Prediction(result.max_batch_size, per_sample or None, needed)

    def trial(self, batch_size: int) -> Trial:
        from dataclasses import replace

        request = replace(self.request, batch_size=batch_size)
        if self.rendezvous is not None:
            request = replace(request, group=self.rendezvous.next_group(self.timeout_s))
        return self.server.run(request, timeout_s=self.timeout_s)


class _InProcessSearch(_Search):
    """Trials in this process on the user's model, state restored after each (the CUDA
    search below; on the CPU, where an uncapped in-process trial measures nothing
    useful, only the distributed tests use it directly)."""

    isolated = False
    default_approach = 0.05

    def __init__(self, model: Any, inputs: Any, config: TrainConfig, device: Any, steps: int,
                 optimizer: Any, snapshot: Any):
        import torch

        from batchfit.realrun.trial import _checked_module, _StepSetup
        from batchfit.realrun.trial_server import model_source

        source, spec_inputs, loss_fn = model_source(model)
        self.inputs = inputs if inputs is not None else spec_inputs
        if self.inputs is None:
            raise InvalidInputError("no input spec: give inputs, e.g. (3, 224, 224)")
        if loss_fn is not None and config.loss_fn is None:
            from dataclasses import replace

            config = replace(config, loss_fn=loss_fn)
        self.config, self.steps, self.device = config, steps, device
        self.device_name = str(device)
        self.optimizer = optimizer if _is_optimizer(optimizer) else None
        self.snapshot = snapshot
        if _is_module(source):
            self.model = source
        else:
            setup = _StepSetup.of(self.inputs, config, device)
            with torch.device("cpu"):
                self.model = setup.prepare(_checked_module(source()))

    def predict(self) -> _Prediction:
        return _Prediction(None)

    def trial(self, batch_size: int) -> Trial:
        from batchfit.realrun.trial import run_trial

        try:
            return run_trial(self.model, self.inputs, batch_size, self.config,
                             optimizer=self.optimizer, steps=self.steps, device=self.device)
        finally:
            self.snapshot.restore()


class _CudaSearch(_InProcessSearch):
    """In-process trials on a GPU, under the caching allocator's cap when one is given."""

    usage_is_growth = False

    def __init__(self, model: Any, inputs: Any, config: TrainConfig, device: Any,
                 cap_bytes: int | None, steps: int, optimizer: Any, snapshot: Any):
        import torch

        from batchfit.realrun.trial import cuda_memory_cap

        super().__init__(model, inputs, config, device, steps, optimizer, snapshot)
        self.cap_bytes = cap_bytes
        self._cap = contextlib.ExitStack()
        self._cap.enter_context(cuda_memory_cap(device, cap_bytes))
        free, _ = torch.cuda.mem_get_info(device)
        self.limit_bytes = cap_bytes if cap_bytes is not None else \
            free + torch.cuda.memory_reserved(device)

    def close(self) -> None:
        self._cap.close()

    def predict(self) -> _Prediction:
        from batchfit.answers.maxbatch import max_batch_size
        from batchfit.answers.solve import NothingFits
        from batchfit.device.catalog import live_gpu
        from batchfit.device.profile import gpu_profile

        profile = gpu_profile(live_gpu(self.device.index or 0))
        memory = self.limit_bytes + profile.context_bytes
        try:
            result = max_batch_size(self.model, self.inputs, self.config, device=profile,
                                    memory_bytes=memory)
        except NothingFits as exc:
            return _Prediction(1, needed_bytes=exc.needed_bytes)
        except UntraceableError:
            return _Prediction(None)
        per_sample = None
        if result.total_bytes_at_next is not None:
            per_sample = float(result.total_bytes_at_next - result.total_bytes_at_max)
        return _Prediction(result.max_batch_size, per_sample or None)


def summarize_trials(trials: Sequence[Trial]) -> str:
    """``"96 ok, 130 OOM, 129 ok"``: a one-line history for logs and reports."""
    return ", ".join(f"{t.batch_size} {'ok' if t.fits else 'OOM'}" for t in trials)
