"""Measure the real peak memory of one step on this CPU: the reference for a CPU prediction.

The step is the one :mod:`batchfit.engine.step` defines, run on real CPU tensors the way
:func:`batchfit.engine.trace.trace_step` configures it for ``device="cpu"`` (for-loop
optimizers, CPU autocast for ``amp-*``, the same seeded batch), and measured by
one of two independent instruments:

* ``profiler``: ``torch.profiler`` with ``profile_memory=True``, one session from
  before the model is built to the end of the last step. Every CPU allocator call
  is an event of ``+nbytes`` or ``-nbytes``; their running sum is the absolute
  live total (the model, its state and the batch were all allocated inside the
  session), and a step's peak is its maximum inside the step. It also sees the
  temporaries a kernel allocates and frees internally (oneDNN reorders in
  convolution backward, for one), which no tensor-level trace can.
* ``tracker``: a live-storage tracker on real tensors. It starts each step from the
  unique storages of parameters, buffers, gradients, optimizer state, inputs and
  GradScaler tensors; a dispatch mode adds every new storage an op returns, and a
  weakref on the storage removes it when it dies. It sees what a fake trace
  sees, on real data.

Known limitations:
    * The tracker does not count tensors a model keeps outside ``parameters()`` and
      ``buffers()`` (plain-attribute caches); the profiler does. A gap between the
      two ``baseline_bytes`` points at such tensors.
    * The tracker misses memory allocated and freed inside one op.
    * Only the CPU allocator is seen: process RSS (malloc's own caching, oneDNN
      primitive caches) is not a clean reference: it counts memory the step freed long ago.

Example:
    >>> import torch
    >>> from batchfit import TrainConfig
    >>> from batchfit.realrun.measure import measure_step
    >>> run = measure_step(lambda: torch.nn.Linear(64, 64), (64,), 8, TrainConfig(optimizer="sgd"),
    ...                    method="tracker")
    >>> run.peak_bytes > run.baseline_bytes > 0
    True
"""

from __future__ import annotations

import contextlib
import gc
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Self

import torch
from torch import nn

from batchfit.engine import _torch_internals as ti
from batchfit.engine.spec import Mode, TrainConfig, parse_enum
from batchfit.engine.step import (
    StepRunner,
)
from batchfit.errors import InvalidInputError, ModelSpecError


class MeasureMethod(StrEnum):
    """The instrument that measures a real step."""

    PROFILER = "profiler"
    TRACKER = "tracker"


@dataclass(frozen=True)
class MeasuredStep:
    """The measured memory of a real step on the CPU.

    Attributes:
        peak_bytes: peak live bytes of the steady-state step (the largest over steps
            2..n in training), absolute: parameters, buffers, gradients, optimizer
            state and inputs included.
        first_step_peak_bytes: the same for the first step, which creates the
            optimizer state.
        baseline_bytes: bytes live when the (last) steady step starts.
        method: the instrument used.
        seconds: wall time of the last step, measuring overhead included.
    """

    peak_bytes: int
    first_step_peak_bytes: int
    baseline_bytes: int
    method: MeasureMethod
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return {"peak_bytes": self.peak_bytes, "first_step_peak_bytes": self.first_step_peak_bytes,
                "baseline_bytes": self.baseline_bytes, "method": self.method.value,
                "seconds": round(self.seconds, 4)}


def measure_step(model_factory: Callable[[], nn.Module], inputs: Any, batch_size: int,
                 config: TrainConfig, *, steps: int = 2,
                 method: MeasureMethod | str = MeasureMethod.PROFILER) -> MeasuredStep:
    """Build the model for real on the CPU, run ``steps`` steps and measure their peaks.

    Only for models that fit in RAM: the weights are materialised. The caller's RNG
    state, grad mode and default dtype are left as they were.

    Args:
        model_factory: a zero-argument callable returning the model.
        inputs: the per-sample input spec (as for :func:`batchfit.estimate`).
        batch_size: the batch size.
        config: the :class:`~batchfit.engine.spec.TrainConfig`.
        steps: steps to run; training needs at least 2 (step 1 creates optimizer state).
        method: ``"profiler"`` or ``"tracker"`` (see :class:`MeasureMethod`).

    Returns:
        A :class:`MeasuredStep`.

    Example:
        >>> import torch
        >>> from batchfit import TrainConfig
        >>> from batchfit.realrun.measure import measure_step
        >>> run = measure_step(lambda: torch.nn.Linear(32, 4), (32,), 4, TrainConfig(mode="infer"))
        >>> run.first_step_peak_bytes >= run.baseline_bytes
        True
    """
    method = parse_enum(MeasureMethod, method, "measurement method")
    _check_arguments(model_factory, batch_size, config, steps)
    if method is MeasureMethod.TRACKER and config.inference_mode:
        # Under inference mode composite ops (aten.conv2d, aten.linear) reach a dispatch
        # mode whole: the tensors made inside them are never returned to the tracker (at
        # batch 64, resnet18 bf16: 24.5 MiB of the 301.9 MiB peak the profiler counts).
        raise InvalidInputError("the live-storage tracker cannot see inside ops under "
                                "torch.inference_mode(): measure this step with "
                                "method='profiler'")
    run = _run_profiled if method is MeasureMethod.PROFILER else _run_tracked
    rng_state = torch.get_rng_state()
    grad_enabled = torch.is_grad_enabled()
    default_dtype = torch.get_default_dtype()
    try:
        torch.default_generator.manual_seed(0)  # reproducible weights; restored below
        gc.collect()  # the caller's cyclic garbage must not be freed while we measure
        windows = run(lambda: _build_runner(model_factory, inputs, batch_size, config), steps)
    finally:
        torch.set_rng_state(rng_state)
        torch.set_grad_enabled(grad_enabled)
        torch.set_default_dtype(default_dtype)
    return MeasuredStep(peak_bytes=max(w.peak_bytes for w in windows[1:] or windows),
                        first_step_peak_bytes=windows[0].peak_bytes,
                        baseline_bytes=windows[-1].baseline_bytes, method=method,
                        seconds=windows[-1].seconds)


@dataclass(frozen=True)
class _Window:
    """One measured step: bytes live at its start, its peak and its wall time."""

    baseline_bytes: int
    peak_bytes: int
    seconds: float


def _run_steps(runner: StepRunner, steps: int, wrap: Callable[[int], Any]) -> list[float]:
    """Run ``steps`` steps, each inside ``wrap(i)``; return their wall times."""
    step = runner.train_step if runner.config.mode is Mode.TRAIN else runner.infer_step
    seconds = []
    for i in range(steps):
        gc.collect()  # no garbage from before may be freed inside the step
        with wrap(i):
            start = time.perf_counter()
            step()
            seconds.append(time.perf_counter() - start)
    return seconds


def _check_arguments(model_factory: Any, batch_size: Any, config: Any, steps: Any) -> None:
    if isinstance(model_factory, nn.Module) or not callable(model_factory):
        raise InvalidInputError(
            "measure_step needs a zero-argument factory that builds the model, e.g. "
            "lambda: MyModel(): each measurement builds a fresh copy")
    if not isinstance(config, TrainConfig):
        raise InvalidInputError(f"config must be a TrainConfig, not {type(config).__name__}")
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise InvalidInputError(f"batch size must be a positive integer, not {batch_size!r}")
    least = 2 if config.mode is Mode.TRAIN else 1
    if not isinstance(steps, int) or steps < least:
        raise InvalidInputError(
            f"steps must be an integer >= {least} in {config.mode.value} mode, not {steps!r}"
            + (" (step 1 creates the optimizer state; step 2 is the steady state)"
               if least == 2 else ""))


def _build_runner(model_factory: Callable[[], nn.Module], inputs: Any, batch_size: int,
                  config: TrainConfig) -> Any:
    """The real model, batch and runner, configured as trace_step does for the CPU (a
    Keras model runs its own step: :class:`batchfit.realrun.trial._StepSetup`)."""
    from batchfit.realrun.trial import _StepSetup

    setup = _StepSetup.of(inputs, config, torch.device("cpu"))
    model = setup.build(model_factory)
    if not isinstance(model, nn.Module):
        raise ModelSpecError(
            f"the model factory returned {type(model).__name__}, not a torch.nn.Module")
    model = setup.prepare(model)
    generator = torch.Generator().manual_seed(0)  # the seed trace_step uses
    runner = setup.runner(model, None, generator)
    runner.batch = setup.batch(batch_size, generator)
    return runner


def _step_storages(runner: Any) -> list[torch.Tensor]:
    """Every tensor live between steps: what the step starts from."""
    return runner.state_tensors() + list(ti.iter_tensors(runner.batch))


def _unique_storages(tensors: Iterable[torch.Tensor]) -> dict[int, Any]:
    """Storages by data pointer (unique among live storages with bytes)."""
    found: dict[int, Any] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if storage.nbytes() > 0:
            found.setdefault(storage.data_ptr(), storage)
    return found


# -- the profiler ------------------------------------------------------------------------

_STEP_MARK = "batchfit::measured_step"


def _run_profiled(build: Callable[[], StepRunner], steps: int) -> list[_Window]:
    """One profiler session from before the model exists to the end of the last step.

    The CPU allocator reports a free only for a block it saw allocated while
    profiling (a block from before the session frees silently, and a block
    allocated in an earlier session but freed outside one leaves a stale size
    behind), so profiling each step alone would count step 1's gradients as never
    freed. Building the model inside the session makes every byte live in a step
    one the session saw allocated: the running sum is the absolute live total, with
    no baseline to add.
    """
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        runner = build()
        seconds = _run_steps(runner, steps, lambda i: record_function(f"{_STEP_MARK}.{i}"))
        del runner
    return _profiled_windows(prof, steps, seconds)


def _profiled_windows(prof: Any, steps: int, seconds: list[float]) -> list[_Window]:
    """Each marked step's baseline and peak from one profiler session's allocator events."""
    # prof.events() drops most "[memory]" events; the raw kineto results keep them all.
    events = list(prof.profiler.kineto_results.events())
    spans = _step_spans(events, steps)
    changes = sorted(_memory_events(events), key=lambda e: e[0])
    windows = []
    live, index = 0, 0
    for (begin, end), wall in zip(spans, seconds):
        while index < len(changes) and changes[index][0] < begin:
            live += changes[index][1]
            index += 1
        baseline = peak = live
        while index < len(changes) and changes[index][0] <= end:
            live += changes[index][1]
            peak = max(peak, live)
            index += 1
        windows.append(_Window(baseline, peak, wall))
    return windows


def measure_keras_fit(build: Callable[[], Any], x: Any, y: Any, *, steps: int = 3
                      ) -> MeasuredStep:
    """The reference for a Keras model: its own ``model.fit`` on real CPU tensors, measured
    by the profiler's allocator events, one step per epoch.

    ``build()`` returns the compiled Keras model (built inside the profiler session, so
    every byte live in a step is one the session saw allocated); ``x`` and ``y`` are one
    batch (torch tensors, or a list/dict of them for several inputs), which ``fit`` gets
    with ``batch_size`` = their length, ``shuffle=False`` and ``epochs=steps``. Each step
    is the span between Keras's ``on_train_batch_begin`` and ``on_train_batch_end``
    callbacks, so fit's own data handling before and after the step is outside it, as the
    batch is outside a predicted step; the cyclic garbage collector runs just before each
    step (fit's per-epoch data iterator leaves the previous batch in a reference cycle,
    which would otherwise be alive in some runs' steps and not in others'). Steps 2..n are
    the steady state (step 1 has no gradients from a previous step yet).

    Example (with ``KERAS_BACKEND=torch``):
        >>> import keras, torch
        >>> def build():
        ...     model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
        ...     model.compile(optimizer="sgd", loss="mse")
        ...     return model
        >>> run = measure_keras_fit(build, torch.randn(16, 8), torch.randn(16, 4))
        >>> run.peak_bytes > run.baseline_bytes > 0
        True
    """
    import keras
    from torch.profiler import ProfilerActivity, profile, record_function

    first = keras.tree.flatten(x)[0]
    batch_size = int(first.shape[0])
    seconds: list[float] = []

    class _Marks(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
            gc.collect()  # the last epoch's data iterator and batch are cyclic garbage
            self.mark = record_function(f"{_STEP_MARK}.{len(seconds)}")
            self.mark.__enter__()
            self.started = time.perf_counter()

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            seconds.append(time.perf_counter() - self.started)
            self.mark.__exit__(None, None, None)

    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        model = build()
        model.fit(x, y, batch_size=batch_size, epochs=steps, shuffle=False, verbose=0,
                  callbacks=[_Marks()])
        del model
    windows = _profiled_windows(prof, steps, seconds)
    return MeasuredStep(peak_bytes=max(w.peak_bytes for w in windows[1:] or windows),
                        first_step_peak_bytes=windows[0].peak_bytes,
                        baseline_bytes=windows[-1].baseline_bytes,
                        method=MeasureMethod.PROFILER, seconds=windows[-1].seconds)


def _event_name(event: Any) -> str:
    try:
        return event.name()
    except UnicodeDecodeError:  # some kineto event names are not valid UTF-8
        return ""


def _step_spans(events: Iterable[Any], steps: int) -> list[tuple[int, int]]:
    """``(start_ns, end_ns)`` of each step's record_function mark, in step order."""
    spans: dict[int, tuple[int, int]] = {}
    for event in events:
        name = _event_name(event)
        if name.startswith(_STEP_MARK + "."):
            spans[int(name.rsplit(".", 1)[1])] = (event.start_ns(), event.end_ns())
    if sorted(spans) != list(range(steps)):
        raise RuntimeError(f"the profiler lost the step marks: found steps {sorted(spans)}")
    return [spans[i] for i in range(steps)]


def _memory_events(events: Iterable[Any]) -> list[tuple[int, int]]:
    """``(start_ns, nbytes)`` of the CPU allocator events (nbytes < 0 for a free)."""
    from torch.autograd import DeviceType

    found = []
    for event in events:
        nbytes = event.nbytes()
        if nbytes != 0 and event.device_type() == DeviceType.CPU \
                and _event_name(event) in ("[memory]", ""):
            found.append((event.start_ns(), nbytes))
    return found


# -- the live-storage tracker ------------------------------------------------------------


class _StorageTracker:
    """Live bytes of real storages: ones added up front, and ones ops create while active.

    A DTensor's ops are seen as the ops on its local tensors (the interceptor lets
    DTensor unwrap them), and a storage resized in place (FSDP frees and re-gathers its
    parameters so) changes the live bytes by the difference, as torch's MemTracker counts
    it (:func:`ti.watching_resizes`, active with the tracker).
    """

    def __init__(self) -> None:
        self.live_bytes = 0
        self.peak_bytes = 0
        self._live: dict[int, list[Any]] = {}  # storage id -> [nbytes, weakref]
        self._interceptor = ti.OpInterceptor(self._on_output, lambda func, exc: None)
        self._resizes: Any = None

    def add(self, storage: Any) -> None:
        key, nbytes = storage._cdata, storage.nbytes()
        if nbytes == 0 or key in self._live:
            return
        self._live[key] = [nbytes, weakref.ref(storage, lambda _ref: self._on_free(key))]
        self.live_bytes += nbytes

    def resized(self, storage: Any, nbytes: int) -> None:
        entry = self._live.get(storage._cdata)
        if entry is None:
            self.add(storage)
        else:
            self.live_bytes += nbytes - entry[0]
            entry[0] = nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def _on_free(self, key: int) -> None:
        entry = self._live.pop(key, None)
        if entry is not None:
            self.live_bytes -= entry[0]

    def _on_output(self, func: Any, args: tuple, out: Any) -> None:
        for tensor in ti.iter_tensors(out):
            found = ti.storage_key(tensor)
            if found is not None:
                self.add(found[1])
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def __enter__(self) -> Self:
        self.peak_bytes = self.live_bytes
        self._resizes = ti.watching_resizes(self.resized)
        self._resizes.__enter__()
        self._interceptor.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._interceptor.__exit__(*exc)
        self._resizes.__exit__(*exc)


def _run_tracked(build: Callable[[], StepRunner], steps: int) -> list[_Window]:
    """A fresh tracker per step, seeded with the storages live between steps."""
    runner = build()
    trackers: list[_StorageTracker] = []
    baselines: list[int] = []

    def wrap(i: int) -> _StorageTracker:
        tracker = _StorageTracker()
        for storage in _unique_storages(_step_storages(runner)).values():
            tracker.add(storage)
        trackers.append(tracker)
        baselines.append(tracker.live_bytes)
        return tracker

    seconds = _run_steps(runner, steps, wrap)
    return [_Window(b, t.peak_bytes, s) for b, t, s in zip(baselines, trackers, seconds)]


def run_tracked_session(build: Callable[[], StepRunner], steps: int) -> list[_Window]:
    """One tracker from before the model is built to the end of the last step.

    Everything the wrappers of a sharded model allocate (DDP's gradient buckets, FSDP's
    shards) is seen when it is made, as the profiler's session sees it
    (:func:`_run_profiled`), where :func:`_run_tracked` starts each step from the
    storages it knows (parameters, gradients, optimizer state, inputs).
    """
    tracker = _StorageTracker()
    with tracker:
        runner = build()
    baselines: list[int] = []
    peaks: list[int] = []

    @contextlib.contextmanager
    def wrap(i: int) -> Iterator[None]:
        baselines.append(tracker.live_bytes)
        with tracker:
            yield
        peaks.append(tracker.peak_bytes)

    seconds = _run_steps(runner, steps, wrap)
    return [_Window(b, p, t) for b, p, t in zip(baselines, peaks, seconds)]
