"""The fastest batch: a measured throughput sweep, its knee, alignment and inference sizing.

:func:`bench` runs the real step (the one :mod:`batchfit.engine.step` defines) at several
batch sizes on a real device and reports samples/s, the step time (median and
interquartile range), and the predicted peak memory at each.

How a point is measured, and why on a shared machine: :mod:`batchfit.speed.timing`.

Which batches (``batches="auto"``). The largest batch that fits comes from
:func:`batchfit.max_batch_size` (a memory budget is required on the CPU). The
candidates lie on a grid of every power of two and the midpoints between them
(1, 2, 3, 4, 6, 8, 12, ...) plus that maximum. The planner measures a few
log-spaced grid points from 1 to the maximum (at least 4; as many as keep the
total fewest); if the best of them lies inside the range (throughput that falls
past a peak, as a small CNN's did here past batch 96), it bisects around it for
the peak; then it bisects (in grid steps) between the knee and the measured
batch below it. At most ``max_points`` (8) batch sizes in all: 6 or 7 for a
maximum of 256 to 1024 on a saturating curve (:func:`next_auto_batch`). On a
curve without noise the knee it finds is the one a dense sweep of the whole grid
finds. On a shared machine one measurement can be caught by a burst of load
(15-45% slow, seen here): before the planner acts on a decision, the batches it
rests on are measured again in interleaved rounds (``TimingConfig.confirm_runs``,
3 measurements each, the fastest counting): the best and the batch above it
before searching for a peak inside the range, and the knee, the batch below it
and the best (:func:`deciding_batches`) at the end, after which the planner goes
on if the knee moved.

The knee. The smallest measured batch whose throughput is within ``tolerance``
(5% by default) of the best measured throughput. The recommended batch is the
knee: past it a larger batch buys less than ``tolerance`` more samples/s and
costs memory and optimizer updates per epoch. With ``alignment=True`` the
recommendation becomes the fastest of its neighbours (see :func:`judge_alignment`).

The timed steps run with the optimizer's learning rate at 0: the same kernels
run, but the repeated batch does not train the model into a degenerate state
(on one fixed batch the loss goes to 0 and gradients to denormal floats, which a
CPU processes up to twice as slowly per step; see ``_freeze_learning_rate``).

Safety. No batch predicted (by a trace) not to fit the budget is ever run. If a
batch runs out of memory anyway, the sweep frees what it can, marks the point
``out_of_memory`` and does not try larger batches. A batch skipped for the time budget
is its own state (``skipped_time_budget``, ``fits`` None): it says nothing about memory.

Noise. Each point keeps the span of its step times (the interquartile interval of each
measurement, joined over repeats); :func:`~batchfit.speed.knee.knee_stability` says which
measured batches a rerun could recommend, and the result says when the recommendation is
within noise of others. The model's parameters,
buffers, gradients, train/eval flags and the RNG states are restored bit for
bit when the sweep ends (a factory-built model is simply discarded).

Known limitations:
    * CPU memory per point is the trace's prediction, not a measurement; on
      CUDA ``measured_peak_bytes`` reports ``torch.cuda.max_memory_reserved``.
    * The restore (:func:`batchfit.realrun.state.preserved_state`) keeps a host copy of
      the parameters, buffers and gradients while the sweep runs.
    * A module that needs another dtype (``bf16``/``fp16``), memory format,
      device or checkpointing is deep-copied and the copy is run.

Example:
    >>> import torch, batchfit
    >>> from batchfit.speed.bench import TimingConfig, bench
    >>> factory = lambda: torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    >>> fast = TimingConfig(warmup_steps=1, min_run_s=0.01, max_run_s=0.05)
    >>> result = bench(factory, (32,), batches=[4, 8], memory_bytes=2**26, optimizer="sgd", timing=fast)
    >>> [p.batch_size for p in result.points], result.knee_batch_size in (4, 8)
    ([4, 8], True)
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from batchfit.engine.spec import Mode, TrainConfig, make_config
from batchfit.errors import DoesNotFitError, InvalidInputError, ModelSpecError, option
from batchfit.speed.bench_result import (
    AlignmentResult,
    BenchResult,
    PointStatus,
    ThroughputPoint,
    _find_point,
)
from batchfit.speed.knee import (
    DEFAULT_MAX_POINTS,
    DEFAULT_TOLERANCE,
    _check_tolerance,
    _peak_batches,
    alignment_candidates,
    batch_grid,
    deciding_batches,
    epoch_seconds,
    find_knee,
    judge_alignment,
    knee_stability,
    next_auto_batch,
)
from batchfit.speed.timing import (
    Clock,
    TimingConfig,
    _free_memory,
    _freeze_keras_learning_rate,
    _freeze_learning_rate,
    _measured_peak,
    _reset_peak,
    _thread_count,
    _time_step,
)

#: The largest batch the sweep considers unless told otherwise.
DEFAULT_MAX_BATCH_LIMIT = 1 << 16
#: Seconds ``bench`` may take by default: enough for 8 points of a model whose largest
#: step takes a few seconds; an inference sweep on a CPU with 8 GiB once ran past 10 minutes.
DEFAULT_TIME_BUDGET_S = 120.0


# -- running real steps ---------------------------------------------------------------------


def _resolve_run_device(device: Any) -> tuple[Any, Any]:
    """``(torch.device, DeviceProfile)`` for ``"cpu"`` or ``"cuda[:N]"``."""
    import torch

    from batchfit.device.profile import DeviceProfile, gpu_profile

    text = str(device if device is not None else "cpu").strip().lower()
    if text == "cpu":
        return torch.device("cpu"), DeviceProfile.cpu()
    if text == "cuda" or (text.startswith("cuda:") and text[5:].isdigit()):
        from batchfit.device.catalog import live_gpu

        index = int(text[5:] or 0) if ":" in text else 0
        return torch.device("cuda", index), gpu_profile(live_gpu(index))
    raise InvalidInputError(
        f"unknown device {device!r}: bench runs on cpu or cuda:N; "
        "to predict for a GPU you don't have, use batchfit.speed.roofline.predict_throughput")


@dataclass
class _Sweep:
    """The real model on the device and what each batch size needs to run on it."""

    model: Any
    inputs: Any
    config: TrainConfig
    torch_device: Any
    profile: Any
    fit_bytes: int
    timing: TimingConfig
    on_measure: Callable[[int], None] | None
    peaks: dict[int, int] = field(default_factory=dict)
    reuse: Any = None  # a batchfit.engine.trace.TraceReuse shared by the per-point traces
    module: Any = None
    optimizer: Any = None
    scaler: Any = None
    measure_s: float = 0.0
    keras: Any = None  # a Keras model's step setup (batchfit.realrun.trial._StepSetup)
    deadline: float | None = None  # time.perf_counter() by which measuring must be done
    on_point: Callable[[ThroughputPoint], None] | None = None
    step_s: dict[int, float] = field(default_factory=dict)  # measured, by batch size

    def open(self) -> None:
        """Build (a factory) or prepare (a module) the real model on the device."""
        import torch
        from torch import nn

        from batchfit.engine import keras_step
        from batchfit.engine.fake import enable_checkpointing
        from batchfit.engine.step import torch_dtype

        config, model = self.config, self.model
        if keras_step.is_keras_model(model):  # the user's Keras model runs on a copy
            model = keras_step.clone_factory(model)
        if isinstance(model, nn.Module):
            # values are restored in place afterwards; a change of dtype, layout, device or
            # checkpointing is not, so it happens on a copy
            module = copy.deepcopy(model) if self._changes_module(model) else model
        elif callable(model):
            torch.manual_seed(0)  # reproducible weights; the caller's RNG is restored after
            with torch.device(self.torch_device), keras_step.build_scope(
                    self.torch_device, config.precision.value):
                module = model()
            if keras_step.is_keras_model(module):  # it runs its own step (realrun.trial)
                from batchfit.realrun.trial import _StepSetup

                self.keras = _StepSetup.of(self.inputs, config, self.torch_device)
                self.module = self.keras.prepare(module)
                return
            if not isinstance(module, nn.Module):
                raise ModelSpecError(
                    f"the model factory returned {type(module).__name__}, not a torch.nn.Module")
        else:
            raise InvalidInputError(
                f"model must be an nn.Module or a factory returning one, not {type(model).__name__}")
        weight = config.precision.weight_dtype
        if weight != "float32":
            module.to(torch_dtype(weight))
        if config.channels_last:
            module.to(memory_format=torch.channels_last)
        module.to(self.torch_device)
        if self._checkpointing:
            enable_checkpointing(module, config.reentrant)
        self.module = module

    def _changes_module(self, module: Any) -> bool:
        devices = {t.device for t in list(module.parameters()) + list(module.buffers())}
        return (self._checkpointing or self.config.channels_last
                or self.config.precision.weight_dtype != "float32"
                or any(d != self.torch_device for d in devices))

    @property
    def _checkpointing(self) -> bool:
        return self.config.checkpointing and self.config.mode is Mode.TRAIN

    def close(self) -> None:
        self.module = self.optimizer = self.scaler = None
        _free_memory(self.torch_device)

    def predicted_peak(self, batch_size: int) -> int:
        if batch_size not in self.peaks:
            from batchfit.answers.estimate import estimate
            from batchfit.engine.trace import TraceReuse

            self.reuse = self.reuse or TraceReuse()
            self.peaks[batch_size] = estimate(self.model, self.inputs, batch_size, self.config,
                                              device=self.profile, reuse=self.reuse,
                                              first_step=False).total_bytes
        return self.peaks[batch_size]

    def runner(self, batch_size: int) -> Any:
        import torch

        from batchfit.engine.step import (
            StepRunner,
            make_batch,
            normalize_input_spec,
            torch_dtype,
        )

        config = self.config
        if self.keras is not None:  # Keras's own step on (x, y)
            runner = self.keras.runner(self.module, None, None)
            runner.batch = self.keras.batch(
                batch_size, torch.Generator(device=self.torch_device).manual_seed(0))
            if self.optimizer is None:
                _freeze_keras_learning_rate(self.module)
                self.optimizer = self.module.optimizer
            return runner
        weight = config.precision.weight_dtype
        float_dtype = None if weight == "float32" else torch_dtype(weight)
        generator = torch.Generator().manual_seed(0)
        batch = make_batch(normalize_input_spec(self.inputs), batch_size, float_dtype, generator,
                           config.channels_last)
        if self.torch_device.type != "cpu":  # made on the CPU with a CPU generator, then moved
            args, kwargs = batch
            batch = (tuple(t.to(self.torch_device) for t in args),
                     {k: t.to(self.torch_device) for k, t in kwargs.items()})
        autocast = None
        if config.precision.autocast_dtype:
            amp = torch_dtype(config.precision.autocast_dtype)
            kind = self.torch_device.type
            autocast = lambda: torch.autocast(kind, dtype=amp)
        runner = StepRunner(self.module, config, batch, autocast=autocast, foreach=None,
                            generator=torch.Generator(device=self.torch_device).manual_seed(0),
                            optimizer=self.optimizer, scaler=self.scaler)
        if self.optimizer is None and runner.optimizer is not None:
            _freeze_learning_rate(runner.optimizer)
        self.optimizer, self.scaler = runner.optimizer, runner.scaler
        return runner

    def step_fn(self, runner: Any) -> Callable[[], None]:
        return runner.train_step if self.config.mode is Mode.TRAIN else runner.infer_step

    def predicted_measure_s(self, batch_size: int) -> float | None:
        """Seconds measuring ``batch_size`` may take: its warm-up steps, the timed run
        (up to ``max_run_s``) and the step that ends past it, the step time predicted from
        the batches measured
        so far (the line through the two largest below or at it, else proportional to the
        batch from the nearest one; a step grows at least linearly with the batch once the
        device is busy). None before anything was measured."""
        if not self.step_s:
            return None
        sizes = sorted(self.step_s)
        below = [b for b in sizes if b <= batch_size]
        slope = 0.0
        if len(below) >= 2:
            b0, b1 = below[-2], below[-1]
            slope = (self.step_s[b1] - self.step_s[b0]) / (b1 - b0)
        if slope > 0:
            step = self.step_s[b1] + slope * (batch_size - b1)
        else:  # one point, or a flat or noisy pair: proportional, the cautious guess
            nearest = below[-1] if below else sizes[0]
            step = self.step_s[nearest] * batch_size / nearest
        timing = self.timing
        return (timing.warmup_steps + 1) * step + timing.max_run_s

    def measure(self, batch_size: int) -> ThroughputPoint:
        """Time ``batch_size`` (never run if predicted not to fit, or to take past the time
        budget; OOM recovered and marked). The time budget is checked first: a batch skipped
        for it needs no trace."""
        cost = self.predicted_measure_s(batch_size)
        if self.deadline is not None and cost is not None and \
                time.perf_counter() + cost > self.deadline:
            return self._report(ThroughputPoint(
                batch_size, PointStatus.SKIPPED_TIME_BUDGET, None, None, None,
                self.peaks.get(batch_size),
                error=f"not run: measuring it would take ~{cost:.0f} s, past the time budget"))
        peak = self.predicted_peak(batch_size)
        if peak > self.fit_bytes:
            return self._report(ThroughputPoint(
                batch_size, PointStatus.PREDICTED_NOT_TO_FIT, None, None, None, peak,
                error=f"predicted to need {peak:,} B > {self.fit_bytes:,} B; not run"))
        if self.on_measure is not None:
            self.on_measure(batch_size)
        error = ""
        start = time.perf_counter()
        try:
            runner = self.runner(batch_size)
            step = self.step_fn(runner)
            _reset_peak(self.torch_device)
            median, iqr, repeats, steps = _time_step(step, self.timing)
            measured_peak = _measured_peak(self.torch_device)
        except Exception as exc:  # only out-of-memory is handled; anything else is re-raised
            from batchfit.realrun.trial import is_out_of_memory, release_exception

            if not is_out_of_memory(exc):
                raise
            error = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
            release_exception(exc)  # its frames hold the failed step's activations
        finally:
            runner = step = None  # drop the batch and activations before the next point
            seconds = time.perf_counter() - start
            self.measure_s += seconds
        if error:
            self._recover()
            return self._report(ThroughputPoint(batch_size, PointStatus.OUT_OF_MEMORY, None,
                                                None, None, peak, error=error,
                                                seconds=seconds))
        self.step_s[batch_size] = min(median, self.step_s.get(batch_size, median))
        return self._report(ThroughputPoint(batch_size, PointStatus.MEASURED, median, iqr,
                                            batch_size / median,
                                            peak, measured_peak, repeats, steps,
                                            seconds=seconds))

    def _report(self, point: ThroughputPoint) -> ThroughputPoint:
        if self.on_point is not None:
            self.on_point(point)
        return point

    def _recover(self) -> None:
        if self.keras is not None:
            for param in self.module.parameters():
                param.grad = None
        elif self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        _free_memory(self.torch_device)



# -- the sweep -------------------------------------------------------------------------------


def _parse_batches(batches: Sequence[int] | str) -> tuple[int, ...] | None:
    """None for ``"auto"``; otherwise the sorted distinct batch sizes."""
    if isinstance(batches, str):
        text = batches.strip().lower()
        if text == "auto":
            return None
        parts = [p for p in text.replace(" ", "").split(",") if p]
        try:
            batches = [int(p) for p in parts]
        except ValueError:
            raise InvalidInputError(
                f"malformed batch list {text!r}: write 'auto' or sizes like 16,32,64") from None
    values = list(batches)
    if not values:
        raise InvalidInputError("empty batch list: give at least one batch size, or 'auto'")
    for b in values:
        if not isinstance(b, int) or isinstance(b, bool) or b < 1:
            raise InvalidInputError(f"batch size {b!r} must be a positive integer")
    return tuple(sorted(set(values)))


def _check_dataset_size(dataset_size: int | None) -> None:
    if dataset_size is not None and (not isinstance(dataset_size, int)
                                     or isinstance(dataset_size, bool) or dataset_size < 1):
        raise InvalidInputError(
            f"dataset size must be a positive number of samples, not {dataset_size!r}")


def _run_auto(sweep: _Sweep, maximum: int, tolerance: float, max_points: int) -> list[ThroughputPoint]:
    """The planner (:func:`next_auto_batch`) over measured batches, each counted by its
    fastest measurement. The batches a decision rests on are measured again
    (``TimingConfig.confirm_runs``) before it is acted on: the best and the batch above it
    before searching for a peak inside the range, and all of :func:`deciding_batches` when
    the planner is done; it goes on if the knee moved."""
    runs: dict[int, list[ThroughputPoint]] = {}
    failed: dict[int, ThroughputPoint] = {}  # out of memory, or predicted not to fit
    skipped: dict[int, ThroughputPoint] = {}  # not run: past the time budget
    confirmed: set[int] = set()
    ceiling = maximum
    while True:
        rates = {b: _merge_runs(b, done).samples_per_s for b, done in runs.items() if b <= ceiling}
        peak = [b for b in _peak_batches(rates) if b not in confirmed]
        if peak:  # throughput seems to fall past the best: check before searching there
            _confirm(sweep, peak, runs)
            confirmed.update(peak)
            continue
        batch = None
        if len(runs) + len(failed) < max_points:
            batch = next_auto_batch(rates, ceiling, tolerance=tolerance, max_points=max_points)
        if batch is not None and batch not in runs and batch not in failed:
            point = sweep.measure(batch)
            if point.measured:
                runs[batch] = [point]
                continue
            if point.status is PointStatus.SKIPPED_TIME_BUDGET:
                # a larger batch takes longer still, and the one below it hardly less: plan
                # below the grid point under it (not batch - 1, which walked down one by one)
                skipped[batch] = point
                ceiling = max((b for b in batch_grid(ceiling) if b < batch), default=0)
            else:  # nothing at or above a batch that failed is tried again
                failed[batch] = point
                ceiling = min(ceiling, batch - 1)
            if ceiling < 1:
                break
            continue
        pending = [b for b in deciding_batches(rates, tolerance) if b not in confirmed] if rates else []
        if not pending:
            break
        _confirm(sweep, pending, runs)
        confirmed.update(pending)
    return ([_merge_runs(b, done) for b, done in runs.items()] + list(failed.values())
            + [p for b, p in skipped.items() if b not in failed])




def _confirm(sweep: _Sweep, batches: Sequence[int], runs: dict[int, list[ThroughputPoint]]) -> None:
    """Measure ``batches`` again, in interleaved rounds, up to ``confirm_runs`` measurements
    each (a batch that fails now keeps the measurements it has)."""
    timing = sweep.timing
    wanted = timing.confirm_runs
    sweep.timing = replace(timing.per_round(wanted), warmup_steps=1)  # the shape ran before
    try:
        todo = [b for b in batches if len(runs[b]) < wanted]
        while todo:
            for b in todo:
                point = sweep.measure(b)
                if point.measured:
                    runs[b].append(point)
                else:  # it keeps the measurements it has
                    batches = [x for x in batches if x != b]
            todo = [b for b in todo if b in batches and len(runs[b]) < wanted]
    finally:
        sweep.timing = timing


def _merge_runs(batch_size: int, runs: Sequence[ThroughputPoint]) -> ThroughputPoint:
    """One point from several measurements of a batch that fit: the fastest (see
    ``TimingConfig.rounds``), with the steps and seconds of them all."""
    if len(runs) == 1:
        return runs[0]
    fastest = min(runs, key=lambda p: p.step_s)
    return replace(fastest, repeats=sum(p.repeats for p in runs), steps=sum(p.steps for p in runs),
                   seconds=sum(p.seconds for p in runs),
                   step_low_s=min(p.step_low_s for p in runs),
                   step_high_s=max(p.step_high_s for p in runs))


def _measure_rounds(sweep: _Sweep, batches: Sequence[int], rounds: int) -> list[ThroughputPoint]:
    """Each batch once per round, in interleaved rounds; each batch's fastest round counts.
    A batch measured in an earlier round and skipped for the time budget in a later one
    keeps its measurement (the budget says nothing about its memory or its speed)."""
    timing = sweep.timing
    runs: dict[int, list[ThroughputPoint]] = {b: [] for b in batches}
    failed: dict[int, ThroughputPoint] = {}
    sweep.timing = timing.per_round(rounds) if rounds > 1 else timing
    try:
        for _ in range(rounds):
            for b in batches:
                if b in failed:
                    continue
                point = sweep.measure(b)
                if point.measured:
                    runs[b].append(point)
                elif not (runs[b] and point.status is PointStatus.SKIPPED_TIME_BUDGET):
                    failed[b] = point
    finally:
        sweep.timing = timing
    return [failed[b] if b in failed else _merge_runs(b, runs[b]) for b in batches]


def _run_alignment(sweep: _Sweep, base: int, ceiling: int) -> AlignmentResult:
    """Measure the candidates around ``base`` in interleaved rounds, then judge."""
    import statistics

    candidates = [b for b in alignment_candidates(base, ceiling)
                  if sweep.predicted_peak(b) <= sweep.fit_bytes]
    points = _measure_rounds(sweep, candidates, sweep.timing.alignment_rounds)
    ok = {p.batch_size: p.samples_per_s for p in points if p.measured}
    noise = statistics.median(p.spread or 0.0 for p in points if p.measured) if ok else 0.0
    if base not in ok:
        raise InvalidInputError(f"the recommended batch {base} could not be re-measured")
    return AlignmentResult(tuple(points), judge_alignment(base, ok, noise), noise)


def bench(model: Any, inputs: Any, config: TrainConfig | None = None, *,
          device: str = "cpu", memory_bytes: int | None = None,
          batches: Sequence[int] | str = "auto", dataset_size: int | None = None,
          tolerance: float = DEFAULT_TOLERANCE, max_points: int = DEFAULT_MAX_POINTS,
          alignment: bool = False, margin: float = 0.0,
          max_batch_limit: int = DEFAULT_MAX_BATCH_LIMIT, timing: TimingConfig | None = None,
          time_budget_s: float | None = DEFAULT_TIME_BUDGET_S,
          on_measure: Callable[[int], None] | None = None,
          on_point: Callable[[ThroughputPoint], None] | None = None,
          **options: Any) -> BenchResult:
    """Measure throughput against batch size on a real device; find the knee.

    Args:
        model: an ``nn.Module`` (run in place, then restored bit-exactly) or a
            zero-argument factory (built on the device, then discarded).
        inputs: the per-sample input spec (as for :func:`batchfit.estimate`).
        config: a :class:`~batchfit.engine.spec.TrainConfig`, or its fields as ``options``
            (``mode="infer"`` sizes inference: no gradients, no optimizer).
        device: ``"cpu"`` or ``"cuda:N"``.
        memory_bytes: the memory budget (default: the card's on CUDA; on the CPU the memory
            the machine has available now, ``MemAvailable``, which the result says in
            ``memory_source``).
        batches: ``"auto"`` (adaptive, at most ``max_points`` sizes) or a list of sizes,
            each of which must fit.
        dataset_size: samples per epoch, for ``epoch_s``.
        tolerance: the knee's tolerance (fraction of the best throughput).
        alignment: also measure the recommended batch against its aligned neighbours.
        margin: fraction of memory kept free (as for :func:`batchfit.max_batch_size`).
        max_batch_limit: the largest batch considered.
        timing: a :class:`TimingConfig`.
        time_budget_s: seconds the whole call may take (None: no limit): a batch whose
            measurement is predicted (from the step times measured so far) to end past it is
            not run, and the sweep goes on below it; the first batch always runs.
        on_measure: called with each batch size before it is measured (progress).
        on_point: called with each batch's :class:`ThroughputPoint` once it is measured or
            skipped (a progress line).

    Raises:
        InvalidInputError: bad input (empty list, a batch above the maximum, a zero
            dataset size, no CPU budget...), one line each.
        DoesNotFitError: nothing fits, or every batch tried ran out of memory.

    Example:
        >>> import torch
        >>> from batchfit.speed.bench import TimingConfig, bench
        >>> fast = TimingConfig(warmup_steps=1, min_run_s=0.01, max_run_s=0.05)
        >>> r = bench(lambda: torch.nn.Linear(16, 4), (16,), batches=[2, 4], mode="infer",
        ...           memory_bytes=2**24, timing=fast)
        >>> r.max_batch_size > 4, r.memory_left_bytes > 0
        (True, True)
    """
    import torch

    from batchfit.answers.maxbatch import max_batch_size

    started = time.perf_counter()
    config = make_config(config, options)
    _check_tolerance(tolerance)
    _check_dataset_size(dataset_size)
    requested = _parse_batches(batches)
    if not isinstance(max_points, int) or max_points < 2:
        raise InvalidInputError(f"max_points must be an integer >= 2, not {max_points!r}")
    timing = timing if timing is not None else TimingConfig()
    torch_device, profile = _resolve_run_device(device)
    if timing.clock is Clock.CPU and torch_device.type != "cpu":
        raise InvalidInputError("clock='cpu' times CPU threads: use clock='wall' on a GPU")
    if time_budget_s is not None and (isinstance(time_budget_s, bool)
                                      or not isinstance(time_budget_s, (int, float))
                                      or not time_budget_s > 0):
        raise InvalidInputError(
            f"time budget must be a positive number of seconds, not {time_budget_s!r}")
    memory_source = "given" if memory_bytes is not None else "device"
    if memory_bytes is None and torch_device.type == "cpu":
        from batchfit.device.profile import available_memory_bytes

        memory_bytes, memory_source = available_memory_bytes(), "available"
        if memory_bytes is None:
            raise InvalidInputError(
                "no memory budget for the CPU and no /proc/meminfo to read what is available: "
                f"give a budget ({option('memory', '16GiB')})")
    limit = max_batch_size(model, inputs, config, device=profile, memory_bytes=memory_bytes,
                           margin=margin, max_batch_limit=max_batch_limit)
    maximum = limit.max_batch_size
    if requested is not None and requested[-1] > maximum:
        over = [b for b in requested if b > maximum]
        raise InvalidInputError(
            f"batch sizes {', '.join(map(str, over))} are above the largest that fits "
            f"({maximum} in {limit.memory_bytes:,} B): drop them or raise the memory budget")
    fit_bytes = int(limit.memory_bytes * (1 - margin))
    is_module = isinstance(model, torch.nn.Module)
    sweep = _Sweep(model, inputs, config, torch_device, profile, fit_bytes, timing, on_measure,
                   deadline=None if time_budget_s is None else started + time_budget_s,
                   on_point=on_point)
    # the solver's traces: allocator bytes (+ workspace and context on CUDA) = total bytes
    outside = profile.context_bytes + profile.workspace_bytes if profile.is_cuda else 0
    sweep.peaks.update({b: needed + outside for b, needed in limit.evaluated})
    from batchfit.realrun.state import preserved_state

    with preserved_state(model if is_module else None):
        try:
            sweep.open()
            if requested is None:
                points = _run_auto(sweep, maximum, tolerance, max_points)
            else:
                points = _measure_rounds(sweep, requested, timing.rounds)
            fitting = [p for p in points if p.measured]
            if not fitting:
                smallest = min((p for p in points if p.fits is False),
                               key=lambda p: p.batch_size)
                raise DoesNotFitError(
                    f"every batch tried ran out of memory (smallest: {smallest.batch_size}: "
                    f"{smallest.error})", smallest.peak_bytes or 0, fit_bytes)
            knee = find_knee([p.batch_size for p in fitting], [p.samples_per_s for p in fitting],
                             tolerance)
            recommended = knee.knee_batch_size
            ceiling = min([maximum] + [p.batch_size - 1 for p in points if p.fits is False])
            aligned = None
            if alignment:
                aligned = _run_alignment(sweep, recommended, max(ceiling, recommended))
                recommended = aligned.verdict.recommended_batch_size
        finally:
            sweep.close()
    result_points = tuple(sorted(points, key=lambda p: p.batch_size))
    stability = knee_stability({p.batch_size: p.samples_per_s for p in fitting},
                               {p.batch_size: p.samples_per_s_range for p in fitting}, tolerance)
    at = _find_point(recommended, result_points, aligned)
    epoch = (epoch_seconds(dataset_size, recommended, at.step_s)
             if dataset_size is not None and at is not None else None)
    left = limit.memory_bytes - sweep.peaks[recommended] if recommended in sweep.peaks else None
    return BenchResult(
        points=result_points, knee_batch_size=knee.knee_batch_size,
        best_batch_size=knee.best_batch_size, best_samples_per_s=knee.best_samples_per_s,
        recommended_batch_size=recommended, max_batch_size=maximum,
        memory_bytes=limit.memory_bytes, memory_left_bytes=left, mode=config.mode,
        device=profile, torch_device=str(torch_device), tolerance=tolerance, timing=timing,
        num_threads=_thread_count(timing), dataset_size=dataset_size, epoch_s=epoch,
        alignment=aligned, elapsed_s=time.perf_counter() - started, measure_s=sweep.measure_s,
        note=_bench_note(limit.note, result_points, time_budget_s), time_budget_s=time_budget_s,
        memory_source=memory_source, stability=stability)


def _bench_note(solver_note: str, points: Sequence[ThroughputPoint],
                time_budget_s: float | None) -> str:
    """The solver's note, and the batches skipped for the time budget, named one by one
    (the rows say the same: a note never speaks of a batch that has a measured row)."""
    notes = [solver_note] if solver_note else []
    skipped = [p.batch_size for p in points if p.status is PointStatus.SKIPPED_TIME_BUDGET]
    if skipped:
        names = ", ".join(map(str, skipped))
        notes.append(f"batch{'es' if len(skipped) > 1 else ''} {names} not measured: "
                     f"{'they' if len(skipped) > 1 else 'it'} would have run past the "
                     f"{time_budget_s:g} s time budget ({option('time_budget')})")
    return "; ".join(notes)


def size_inference(model: Any, inputs: Any, config: TrainConfig | None = None,
                   **kwargs: Any) -> BenchResult:
    """What test batch size fully uses the device: :func:`bench` in ``mode="infer"``.

    The result's ``max_batch_size`` is the largest inference batch that fits (no
    gradients, no optimizer), ``knee_batch_size`` the knee of inference
    throughput, and ``memory_left_bytes`` what is left at the recommended batch.

    Example:
        >>> import torch
        >>> from batchfit.speed.bench import TimingConfig, size_inference
        >>> fast = TimingConfig(warmup_steps=1, min_run_s=0.01, max_run_s=0.05)
        >>> r = size_inference(lambda: torch.nn.Linear(16, 4), (16,), batches=[8],
        ...                    memory_bytes=2**24, timing=fast)
        >>> r.mode.value, r.recommended_batch_size
        ('infer', 8)
    """
    options = {k: kwargs.pop(k) for k in list(kwargs) if k in TrainConfig.__dataclass_fields__}
    config = make_config(config, {**options, "mode": Mode.INFER})
    return bench(model, inputs, config, **kwargs)
