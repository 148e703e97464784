"""Real trials on a real device: run K steps at a batch size, measure them, survive out-of-memory.

A *trial* runs the step of :mod:`batchfit.engine.step` (the one the prediction traces) for
``steps >= 2`` real steps at one batch size and returns a :class:`Trial`: did it fit,
what was its steady-state peak, how long did it take.

Two ways to run one:

* :func:`run_trial`: in this process, on the user's model (CUDA, or the CPU without a
  cap). An out-of-memory error is caught, everything the trial held is released
  (activations, gradients, optimizer state it created, the traceback frames that keep
  them alive) and the process stays usable. Wrap it in
  :func:`~batchfit.realrun.state.preserved_state` to get
  the user's weights, optimizer and RNG back bit-exactly.
* :func:`~batchfit.realrun.trial_server.run_trial_subprocess`: in a fresh process with a hard memory cap (batchfit's
  CPU "device": a process whose data segment is capped). The child builds the model and the optimizer, runs one
  warm-up step at batch 1, drops the warm-up gradients and batch, reads its ``VmData``
  and sets ``RLIMIT_DATA`` to that plus the cap; then it runs the K steps at batch B.

Measurement (``Trial.peak_bytes``, ``Trial.used_bytes``):

* CUDA: ``torch.cuda.max_memory_allocated`` / ``max_memory_reserved`` over steps 2..K,
  after ``reset_peak_memory_stats``.
* CPU: a live-storage tracker (a dispatch mode adds each storage an op returns, a
  weakref removes it when it dies) gives the live tensor peak; at the same op
  boundaries it samples the data segment (``/proc/self/statm``, 2.5 µs a read), which
  is what the cap limits. Allocations made and freed inside one op (oneDNN scratch)
  are invisible to both.
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Self

import torch
from torch import nn

from batchfit.engine import _torch_internals as ti
from batchfit.engine.spec import InputSpec, Mode, TrainConfig, make_config
from batchfit.engine.step import (
    StepRunner,
    make_batch,
    normalize_input_spec,
    torch_dtype,
)
from batchfit.errors import InvalidInputError, ModelSpecError, TrialError


@dataclass(frozen=True)
class Trial:
    """The outcome of K real steps at one batch size.

    Attributes:
        batch_size: the batch size tried.
        fits: every step ran without an out-of-memory error.
        peak_bytes: steady-state peak (steps 2..K) of live tensor bytes, absolute: model
            state, inputs and activations included (CUDA: ``max_memory_allocated``).
            None when the trial did not fit.
        seconds: wall time of the K steps (building and warm-up excluded).
        error: the out-of-memory message, one line, when ``fits`` is False.
        used_bytes: the peak of what the limit applies to: on the CPU the growth of the
            data segment over its value when the cap was set (all K steps, sampled at op
            boundaries); on CUDA ``max_memory_reserved``. None when not measured.
        limit_bytes: the limit the trial ran under (the CPU cap; on CUDA the allocator's
            per-process limit), or None.
        baseline_bytes: live tensor bytes when the trial started (parameters, buffers,
            optimizer state; the CPU child's state after its warm-up).
        process: where it ran: None in this process or a forked trial child (CPU), "exec"
            in an exec'd fresh interpreter that ran the steps untracked, as a training
            script does (:mod:`batchfit.realrun.fresh`; nothing measured but fits).
    """

    batch_size: int
    fits: bool
    peak_bytes: int | None
    seconds: float
    error: str | None = None
    used_bytes: int | None = None
    limit_bytes: int | None = None
    baseline_bytes: int | None = None
    process: str | None = None

    def overhead_bytes(self, usage_is_growth: bool = True) -> int | None:
        """Memory held beyond live tensors at the peak: ``used_bytes`` less the live peak.
        CPU usage is the growth over the trial's start (``usage_is_growth``); CUDA usage
        (reserved) is absolute. None when either was not measured."""
        if self.used_bytes is None or self.peak_bytes is None:
            return None
        live = self.peak_bytes - ((self.baseline_bytes or 0) if usage_is_growth else 0)
        return max(0, self.used_bytes - live)

    def to_dict(self) -> dict[str, Any]:
        return {"batch_size": self.batch_size, "fits": self.fits, "peak_bytes": self.peak_bytes,
                "seconds": round(self.seconds, 4), "error": self.error,
                "used_bytes": self.used_bytes, "limit_bytes": self.limit_bytes,
                "baseline_bytes": self.baseline_bytes, "process": self.process}


# --------------------------------------------------------------------------- out of memory

#: Messages of out-of-memory errors that reach Python as a plain ``RuntimeError``.
_OOM_MESSAGES = (
    "DefaultCPUAllocator: can't allocate memory",  # c10/core/impl/alloc_cpu.cpp
    "could not create a primitive",  # oneDNN, when its scratch allocation fails near a cap
    "CUBLAS_STATUS_ALLOC_FAILED",  # cuBLAS could not allocate its workspace
)


def is_out_of_memory(exc: BaseException) -> bool:
    """True if ``exc`` means the device ran out of memory.

    Types first: ``torch.OutOfMemoryError`` (CUDA caching allocator) and ``MemoryError``
    (Python, or a C++ ``std::bad_alloc`` translated by pybind11). Messages only for the
    errors torch raises as a plain ``RuntimeError`` (exactly that type, so
    ``NotImplementedError`` or ``RecursionError`` never match): the CPU allocator's
    "can't allocate memory", oneDNN's "could not create a primitive" and cuBLAS's
    "CUBLAS_STATUS_ALLOC_FAILED"; and CUDA's "out of memory" from a raw ``cudaMalloc``,
    raised as ``torch.AcceleratorError``.

    Example:
        >>> is_out_of_memory(RuntimeError("DefaultCPUAllocator: can't allocate memory: ..."))
        True
        >>> is_out_of_memory(ValueError("DefaultCPUAllocator: can't allocate memory"))
        False
    """
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is not None and isinstance(exc, accelerator_error):
        return "out of memory" in str(exc)
    if type(exc) is RuntimeError:
        text = str(exc)
        return any(message in text for message in _OOM_MESSAGES)
    return _is_other_backends_out_of_memory(exc)


def _is_other_backends_out_of_memory(exc: BaseException) -> bool:
    """Keras 3 on JAX or TensorFlow (:mod:`batchfit.integrations.keras`): XLA reports an
    allocation failure as a ``jax.errors.JaxRuntimeError`` whose status is
    ``RESOURCE_EXHAUSTED`` (measured on the CPU under ``RLIMIT_DATA``: "RESOURCE_EXHAUSTED:
    Out of memory allocating 486948996 bytes"), TensorFlow as
    ``tf.errors.ResourceExhaustedError``. Checked only if that library is imported."""
    jax = sys.modules.get("jax")
    jax_error = getattr(getattr(jax, "errors", None), "JaxRuntimeError", None)
    if isinstance(jax_error, type) and isinstance(exc, jax_error):
        return "RESOURCE_EXHAUSTED" in str(exc)
    tf = sys.modules.get("tensorflow")
    tf_error = getattr(getattr(tf, "errors", None), "ResourceExhaustedError", None)
    return isinstance(tf_error, type) and isinstance(exc, tf_error)


def release_exception(exc: BaseException) -> None:
    """Drop the frames of ``exc`` (and of its cause and context), which keep every
    local of the failed step alive: activations, the batch, the autograd graph."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if exc.__traceback__ is not None:
            traceback.clear_frames(exc.__traceback__)
            exc.__traceback__ = None
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]


def collect_garbage(device: torch.device | None = None) -> None:
    """``gc.collect()``, then hand cached CUDA blocks back to the driver."""
    gc.collect()
    if device is not None and device.type == "cuda":
        torch.cuda.empty_cache()


def _one_line(exc: BaseException, limit: int = 300) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


# --------------------------------------------------------------------------- measuring


class _DataSegment:
    """The process's data segment in bytes, as RLIMIT_DATA counts it."""

    def __init__(self) -> None:
        self._fd = os.open("/proc/self/statm", os.O_RDONLY)
        self._page = os.sysconf("SC_PAGE_SIZE")

    def read(self) -> int:
        """Field 6 of statm: data + stack pages (the stack part does not move in a step)."""
        return int(os.pread(self._fd, 256, 0).split()[5]) * self._page

    def close(self) -> None:
        os.close(self._fd)


def _data_segment_now() -> int:
    segment = _DataSegment()
    try:
        return segment.read()
    finally:
        segment.close()


def vm_data_bytes() -> int:
    """``VmData`` from /proc/self/status: the counter RLIMIT_DATA is checked against."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmData:"):
                return int(line.split()[1]) * 1024
    raise TrialError("no VmData in /proc/self/status: memory caps need Linux")


class _UsageTracker:
    """Live tensor bytes (storages created by ops, plus those added) and the data
    segment, both sampled at every op boundary while active."""

    def __init__(self, sample_data_segment: bool):
        self.live_bytes = 0
        self.peak_bytes = 0
        self.data_peak = 0
        self._live: dict[int, tuple[int, Any]] = {}
        self._segment = _DataSegment() if sample_data_segment else None
        self._interceptor = ti.OpInterceptor(self._on_output, lambda func, exc: None)

    def add(self, tensor: torch.Tensor) -> None:
        for plain in ti.inner_tensors(tensor):  # a DTensor's memory is its local shard
            found = ti.storage_key(plain)
            if found is None:
                continue
            key, storage = found
            nbytes = storage.nbytes()
            if nbytes == 0 or key in self._live:
                continue
            self._live[key] = (nbytes,
                               ti.watch_storage(storage, lambda k=key: self._on_free(k)))
            self.live_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def _on_free(self, key: int) -> None:
        entry = self._live.pop(key, None)
        if entry is not None:
            self.live_bytes -= entry[0]

    def _on_output(self, func: Any, args: tuple, out: Any) -> None:
        for tensor in ti.iter_tensors(out):
            self.add(tensor)
        if self._segment is not None:
            self.data_peak = max(self.data_peak, self._segment.read())

    def reset_peak(self) -> None:
        self.peak_bytes = self.live_bytes

    def __enter__(self) -> Self:
        self._interceptor.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._interceptor.__exit__(*exc)
        if self._segment is not None:
            self._segment.close()


def _state_tensors(runner: Any) -> list[torch.Tensor]:
    """What lives between steps: parameters, buffers, gradients, optimizer state."""
    return runner.state_tensors()


def _unique_bytes(tensors: list[torch.Tensor]) -> int:
    seen: dict[int, int] = {}
    for tensor in tensors:
        found = ti.storage_key(tensor)
        if found is not None:
            seen[found[0]] = found[1].nbytes()
    return sum(seen.values())


# --------------------------------------------------------------------------- the step


@dataclass
class _StepSetup:
    """How the real step is configured (the same way trace_step configures the trace).

    A Keras model (:mod:`batchfit.engine.keras_step`) runs its own step: it is built on
    the target device by Keras (:meth:`build`), keeps its own dtype policy (no cast, no
    autocast), is prepared as ``fit`` prepares it, and its batches are ``(x, y)`` with
    targets for its compiled loss (``keras_targets``, set by :meth:`prepare`)."""

    spec: InputSpec
    config: TrainConfig
    device: torch.device
    float_dtype: torch.dtype | None
    autocast: Callable[[], Any] | None
    keras_targets: Any = None
    keras: bool = False

    @classmethod
    def of(cls, inputs: Any, config: TrainConfig, device: torch.device) -> _StepSetup:
        precision = config.precision
        weight = precision.weight_dtype
        float_dtype = None if weight == "float32" else torch_dtype(weight)
        autocast = None
        if precision.autocast_dtype:
            amp_dtype = torch_dtype(precision.autocast_dtype)
            autocast = lambda: torch.autocast(device.type, dtype=amp_dtype)
        return cls(normalize_input_spec(inputs), config, device, float_dtype, autocast)

    def build(self, factory: Callable[[], Any]) -> Any:
        """Call ``factory`` for real: a torch model on the CPU (:meth:`prepare` moves it), a
        Keras model by Keras on the target device, with the config's dtype policy."""
        from batchfit.engine import keras_step

        with torch.device("cpu"), keras_step.build_scope(self.device,
                                                         self.config.precision.value):
            return factory()

    def batch(self, batch_size: int, generator: torch.Generator) -> tuple:
        if self.keras:
            from batchfit.engine import keras_step

            with torch.device(self.device):
                return keras_step.make_data(self.spec, self.keras_targets, batch_size,
                                            generator)
        with torch.device(self.device):
            return make_batch(self.spec, batch_size, self.float_dtype, generator,
                              self.config.channels_last)

    def runner(self, model: nn.Module, optimizer: torch.optim.Optimizer | None,
               generator: torch.Generator) -> Any:
        if self.keras:
            from batchfit.engine import keras_step

            return keras_step.KerasStepRunner(model, self.config, ((), {}))
        foreach = False if self.device.type == "cpu" else None  # each device's own default
        return StepRunner(model, self.config, ((), {}), autocast=self.autocast, foreach=foreach,
                          generator=generator, optimizer=optimizer)

    def prepare(self, model: nn.Module) -> nn.Module:
        """A freshly built model in the config's dtype, memory format and checkpointing
        (a Keras model: compiled if it was not, its loss, metrics and optimizer built)."""
        from batchfit.engine import keras_step

        if keras_step.is_keras_model(model):
            keras_step.check_torch_backend()
            self.keras = True
            with keras_step.build_scope(self.device):
                keras_step.compile_if_needed(model, self.config.optimizer)
                self.keras_targets = keras_step.target_specs(model, self.spec)
                keras_step.prepare(model, self.spec, self.keras_targets)
            return model
        if self.float_dtype is not None:
            model = model.to(self.float_dtype)
        if self.config.channels_last:
            model = model.to(memory_format=torch.channels_last)
        config = self.config
        prepared = False
        if config.workload is not None:  # quantized for real by bitsandbytes, adapted by peft
            from batchfit.engine.workloads.build import apply_workload

            model = apply_workload(model, config.workload, precision=config.precision,
                                   checkpointing=config.checkpointing,
                                   use_reentrant=config.reentrant,
                                   training=config.mode is Mode.TRAIN)
            prepared = config.quant is not None and config.quant.prepare
        if config.checkpointing and config.mode is Mode.TRAIN and not prepared:
            from batchfit.engine.fake import enable_checkpointing

            enable_checkpointing(model, config.reentrant)
        return model.to(self.device)


def _check_trial_args(batch_size: Any, steps: Any) -> None:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise InvalidInputError(f"batch size must be a positive integer, not {batch_size!r}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 2:
        raise InvalidInputError(
            f"steps per trial must be an integer >= 2, not {steps!r}: step 1 may create the "
            "optimizer state, the steady-state peak is measured from step 2 on")


def _run_steps(runner: StepRunner, setup: _StepSetup, batch_size: int, steps: int,
               generator: torch.Generator, tracker: _UsageTracker | None) -> int:
    """Run the steps; return the steady-state live peak (CPU) or 0 (CUDA, read elsewhere)."""
    step = runner.train_step if setup.config.mode is Mode.TRAIN else runner.infer_step
    cuda = setup.device.type == "cuda"
    peaks = []
    with tracker if tracker is not None else contextlib.nullcontext():
        runner.batch = setup.batch(batch_size, generator)
        for index in range(steps):
            if index == 1 and cuda:
                torch.cuda.synchronize(setup.device)
                torch.cuda.reset_peak_memory_stats(setup.device)
            if tracker is not None:
                tracker.reset_peak()
            step()
            if tracker is not None:
                peaks.append(tracker.peak_bytes)
        if cuda:
            torch.cuda.synchronize(setup.device)
    runner.batch = ((), {})
    return max(peaks[1:]) if peaks else 0


def run_trial(model: nn.Module | Callable[[], nn.Module], inputs: Any, batch_size: int,
              config: TrainConfig | None = None, *, optimizer: torch.optim.Optimizer | None = None,
              steps: int = 2, device: str | torch.device | None = None,
              **options: Any) -> Trial:
    """Run ``steps`` real steps at ``batch_size`` in this process and measure them.

    The model trains for real (its weights and optimizer move): wrap calls in
    :func:`preserved_state` to undo that. What the trial itself allocates is released
    whether it fits or not: the batch, activations, gradients it created (the
    gradients the model had before are put back), optimizer state it created for
    parameters that had none, and the exception's frames. Errors other than
    out-of-memory propagate unchanged.

    Args:
        model: an ``nn.Module`` on its device, or a factory (built on ``device``).
        inputs: the per-sample input spec.
        batch_size: the batch size.
        config: a :class:`TrainConfig`, or its fields as ``options``.
        optimizer: the user's optimizer instance (its state is used, and what the trial adds
            is dropped); a name or class instead sets the config's optimizer, built for the
            trial and dropped after it.
        steps: steps to run (>= 2); the peak is the largest of steps 2..K.
        device: where to run (default: the model's device).

    Example:
        >>> import torch
        >>> trial = run_trial(torch.nn.Linear(8, 2), (8,), 4, optimizer="sgd")
        >>> trial.fits, trial.peak_bytes > 0
        (True, True)
    """
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        options, optimizer = {**options, "optimizer": optimizer}, None  # a name or a class
    config = make_config(config, options)
    _check_trial_args(batch_size, steps)
    if not isinstance(model, nn.Module):
        if not callable(model):
            raise InvalidInputError(
                f"model must be an nn.Module or a factory, not {type(model).__name__}")
        target = torch.device(device or "cpu")
        setup = _StepSetup.of(inputs, config, target)
        model = setup.prepare(_checked_module(setup.build(model)))
    else:
        target = torch.device(device) if device is not None else _module_device(model)
        setup = _StepSetup.of(inputs, config, target)
    return _trial_in_process(model, setup, batch_size, steps, optimizer)


def _module_device(model: nn.Module) -> torch.device:
    for tensor in model.parameters():
        return tensor.device
    return torch.device("cpu")


def _checked_module(model: Any) -> nn.Module:
    if not isinstance(model, nn.Module):
        raise ModelSpecError(f"the model factory returned {type(model).__name__}, not an nn.Module")
    return model


def _trial_in_process(model: nn.Module, setup: _StepSetup, batch_size: int, steps: int,
                      optimizer: torch.optim.Optimizer | None) -> Trial:
    grads = {id(p): (p, p.grad) for p in model.parameters()}
    had_state = set(optimizer.state) if optimizer is not None else set()
    cuda = setup.device.type == "cuda"
    generator = torch.Generator(device=setup.device).manual_seed(0)
    runner = setup.runner(model, optimizer, generator)
    tracker = None if cuda else _UsageTracker(sample_data_segment=True)
    if tracker is not None:
        for tensor in _state_tensors(runner):
            tracker.add(tensor)
        tracker.data_peak = data_start = _data_segment_now()
    baseline = _unique_bytes(_state_tensors(runner))
    start = time.perf_counter()
    error = None
    try:
        peak = _run_steps(runner, setup, batch_size, steps, generator, tracker)
    except Exception as exc:
        if not is_out_of_memory(exc):
            raise
        error = _one_line(exc)
        release_exception(exc)
    finally:
        seconds = time.perf_counter() - start
        runner.batch = ((), {})
        del runner
        for p, grad in grads.values():
            p.grad = grad
        if optimizer is not None:
            for p in [p for p in optimizer.state if p not in had_state]:
                del optimizer.state[p]
        collect_garbage(setup.device)
    if error is not None:
        return Trial(batch_size, False, None, seconds, error, baseline_bytes=baseline)
    if cuda:
        return Trial(batch_size, True, torch.cuda.max_memory_allocated(setup.device), seconds,
                     used_bytes=torch.cuda.max_memory_reserved(setup.device),
                     limit_bytes=_cuda_limit(setup.device), baseline_bytes=baseline)
    return Trial(batch_size, True, peak, seconds, used_bytes=tracker.data_peak - data_start,
                 baseline_bytes=baseline)


# --------------------------------------------------------------------------- CUDA cap


def _cuda_limit(device: torch.device) -> int | None:
    fraction = getattr(torch.cuda, "get_per_process_memory_fraction", lambda d: 1.0)(device)
    if fraction >= 1.0:
        return None
    return int(fraction * torch.cuda.get_device_properties(device).total_memory)


@contextlib.contextmanager
def cuda_memory_cap(device: str | torch.device, cap_bytes: int | None) -> Iterator[None]:
    """Limit the caching allocator of ``device`` to ``cap_bytes`` reserved bytes (the
    model's state included; the CUDA context is outside the allocator), through
    ``torch.cuda.set_per_process_memory_fraction``; the previous fraction is restored."""
    if cap_bytes is None:
        yield
        return
    device = torch.device(device)
    total = torch.cuda.get_device_properties(device).total_memory
    if not 0 < cap_bytes <= total:
        raise InvalidInputError(
            f"memory cap {cap_bytes} B must be positive and at most the card's {total} B")
    previous = getattr(torch.cuda, "get_per_process_memory_fraction", lambda d: 1.0)(device)
    torch.cuda.set_per_process_memory_fraction(cap_bytes / total, device)
    try:
        yield
    finally:
        torch.cuda.set_per_process_memory_fraction(previous, device)
