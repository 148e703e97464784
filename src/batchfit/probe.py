"""Real trials on a real device: run K steps at a batch size, measure them, survive out-of-memory.

A *trial* runs the step of :mod:`batchfit.step` (the one the prediction traces) for
``steps >= 2`` real steps at one batch size and returns a :class:`Trial`: did it fit,
what was its steady-state peak, how long did it take.

Two ways to run one:

* :func:`run_trial`: in this process, on the user's model (CUDA, or the CPU without a
  cap). An out-of-memory error is caught, everything the trial held is released
  (activations, gradients, optimizer state it created, the traceback frames that keep
  them alive) and the process stays usable. Wrap it in :func:`preserved_state` to get
  the user's weights, optimizer and RNG back bit-exactly.
* :func:`run_trial_subprocess`: in a fresh process with a hard memory cap (the CPU
  "device" of DESIGN.md §4). The child builds the model and the optimizer, runs one
  warm-up step at batch 1, drops the warm-up gradients and batch, reads its ``VmData``
  and sets ``RLIMIT_DATA`` to that plus the cap; then it runs the K steps at batch B.

Why ``RLIMIT_DATA`` and not ``RLIMIT_AS``: since Linux 4.7 ``RLIMIT_DATA`` limits
exactly the private writable mappings (brk heap, anonymous mmaps: every tensor the CPU
allocator hands out, whether glibc serves it from the heap or from its own mmap), and
``/proc/self/status`` reports the same counter as ``VmData``, so "usage + cap" is
measured on the scale the kernel enforces. ``RLIMIT_AS`` also counts library text,
``PROT_NONE`` reservations (each glibc thread arena reserves 64 MiB of address space)
and the guard pages of new threads, none of which is memory the step uses.
``RLIMIT_RSS`` is ignored by Linux.

Fresh processes come from a :class:`TrialServer`: a zygote interpreter started with
``python -c`` that imports torch and the model's own library once. Per request (model,
input spec, config, cap) it forks a *template*, which builds the model and the
optimizer, warms up and waits (while the caller computes its prediction); each trial is
a child forked from the template, so it starts from exactly the memory a fresh process
that imported the same libraries and did the same work holds: measured at a boundary
with 144 KiB to spare, the trials and an independent ``python -c`` process needed the
same data segment to the byte. What breaks that equivalence is importing more in the
zygote: ``torch._dynamo`` (a fresh process imports it when it builds its first
optimizer, after the model) or libraries the model does not use each cost one batch
there. A fresh interpreter costs 7-10 s on this machine (``import torch``, then
``torch._dynamo``); the template pays the model's build, warm-up and ``torch._dynamo``
once per request, and a trial costs a fork (milliseconds) and its steps. The zygote and
the template never run a torch op with more than one thread (GNU OpenMP does not
survive a fork after a parallel region: the child hangs), so templates serve trials on
one thread (``OMP_NUM_THREADS=1`` or ``torch.set_num_threads(1)`` in the caller); on
more threads each trial child builds and warms up itself, one prepared ahead.

Measurement (``Trial.peak_bytes``, ``Trial.used_bytes``):

* CUDA: ``torch.cuda.max_memory_allocated`` / ``max_memory_reserved`` over steps 2..K,
  after ``reset_peak_memory_stats``.
* CPU: a live-storage tracker (a dispatch mode adds each storage an op returns, a
  weakref removes it when it dies) gives the live tensor peak; at the same op
  boundaries it samples the data segment (``/proc/self/statm``, 2.5 µs a read), which
  is what the cap limits. Allocations made and freed inside one op (oneDNN scratch)
  are invisible to both.

Known limitations:
    * A child killed by a signal after the cap was set (a library that aborts when
      malloc fails) counts as "does not fit", with the signal in ``Trial.error``.
    * A factory must be picklable: a module-level function, a ``functools.partial``
      (every :func:`batchfit.models.resolve_model` factory is one), an
      ``"module:function"`` string or a ``"file.py:factory"`` spec. An ``nn.Module``
      is pickled with its weights.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import importlib.util
import os
import pickle
import random
import resource
import select
import signal
import struct
import subprocess
import sys
import time
import traceback
import types
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any, BinaryIO, Self

import torch
from torch import nn

from batchfit import _torch_internals as ti
from batchfit._fork import fork_child
from batchfit.errors import InvalidInputError, ModelSpecError, TrialError
from batchfit.spec import InputSpec, Mode, TrainConfig, make_config
from batchfit.step import StepRunner, make_batch, normalize_input_spec, torch_dtype


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
    """

    batch_size: int
    fits: bool
    peak_bytes: int | None
    seconds: float
    error: str | None = None
    used_bytes: int | None = None
    limit_bytes: int | None = None
    baseline_bytes: int | None = None

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
                "baseline_bytes": self.baseline_bytes}


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
    return False


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


# --------------------------------------------------------------------------- user state


@dataclass
class StateSnapshot:
    """An in-memory copy of everything a trial can change, restored by :meth:`restore`.

    Tensors are copied to host memory (so a snapshot does not eat the device memory the
    trials measure) and copied back into the *same* tensor objects, so references the
    user holds (an optimizer's param list, a tied weight) stay valid.

    What is saved: every parameter and buffer (values, ``requires_grad``, the parameter
    and buffer objects in each module slot), gradients (the tensor objects and their
    values), each module's train/eval flag, the optimizer's ``state`` and its
    ``param_groups`` (hyper-parameters), grad mode, the default dtype, the RNG states
    of torch (CPU and every CUDA device when CUDA is initialised), numpy and Python's
    ``random``, and a data loader's position (see :func:`preserved_state`).
    """

    slots: list[tuple[nn.Module, str, str, torch.Tensor | None]]
    values: dict[int, torch.Tensor]
    requires_grad: dict[int, bool]
    grads: dict[int, tuple[torch.Tensor | None, torch.Tensor | None]]
    training: list[tuple[nn.Module, bool]]
    optimizer: torch.optim.Optimizer | None
    optimizer_state: dict[Any, dict[str, tuple[Any, Any]]]
    param_groups: list[dict[str, Any]]
    globals: dict[str, Any]
    loader: Any = None
    loader_state: Any = None
    tensors: dict[int, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def take(cls, model: nn.Module | None, optimizer: torch.optim.Optimizer | None = None,
             loader: Any = None, *, tensors: bool = True) -> StateSnapshot:
        slots: list[tuple[nn.Module, str, str, torch.Tensor | None]] = []
        objects: dict[int, torch.Tensor] = {}
        training: list[tuple[nn.Module, bool]] = []
        for module in (model.modules() if model is not None else ()):
            training.append((module, module.training))
            for kind in ("_parameters", "_buffers"):
                for name, tensor in getattr(module, kind).items():
                    slots.append((module, kind, name, tensor))
                    if tensor is not None:
                        objects[id(tensor)] = tensor
        values = {key: _host_copy(t) for key, t in objects.items()} if tensors else {}
        grads = {}
        for key, t in objects.items():
            grad = t.grad if isinstance(t, nn.Parameter) else None
            grads[key] = (grad, _host_copy(grad) if tensors and grad is not None else None)
        state: dict[Any, dict[str, tuple[Any, Any]]] = {}
        groups: list[dict[str, Any]] = []
        if optimizer is not None:
            state = {p: {k: (v, _host_copy(v) if isinstance(v, torch.Tensor) else _copy_value(v))
                         for k, v in s.items()} for p, s in optimizer.state.items()}
            groups = [{k: _copy_value(v) for k, v in g.items() if k != "params"}
                      for g in optimizer.param_groups]
        return cls(slots=slots, values=values,
                   requires_grad={k: t.requires_grad for k, t in objects.items()},
                   grads=grads, training=training, optimizer=optimizer,
                   optimizer_state=state, param_groups=groups, globals=_global_state(),
                   loader=loader, loader_state=_loader_state(loader), tensors=objects)

    def restore(self) -> None:
        """Put everything back as it was when the snapshot was taken."""
        with torch.no_grad():
            for module, kind, name, tensor in self.slots:
                getattr(module, kind)[name] = tensor
            for key, tensor in self.tensors.items():
                if key in self.values:
                    _copy_into(tensor, self.values[key])
                if tensor.requires_grad != self.requires_grad[key]:
                    tensor.requires_grad_(self.requires_grad[key])
                grad, saved = self.grads[key]
                if saved is not None:
                    _copy_into(grad, saved)
                if isinstance(tensor, nn.Parameter):
                    tensor.grad = grad
        for module, flag in self.training:
            module.training = flag
        if self.optimizer is not None:
            restored: defaultdict[Any, dict[str, Any]] = defaultdict(dict)
            with torch.no_grad():
                for p, entries in self.optimizer_state.items():
                    restored[p] = {k: _restored_value(original, saved)
                                   for k, (original, saved) in entries.items()}
            self.optimizer.state = restored
            for group, saved in zip(self.optimizer.param_groups, self.param_groups):
                for k in [k for k in group if k != "params" and k not in saved]:
                    del group[k]
                group.update({k: _copy_value(v) for k, v in saved.items()})
        _set_global_state(self.globals)
        _set_loader_state(self.loader, self.loader_state)


def _host_copy(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().to("cpu", copy=True)


def _copy_into(target: torch.Tensor, saved: torch.Tensor) -> None:
    if target.shape == saved.shape and target.dtype == saved.dtype:
        target.detach().copy_(saved)
    else:  # the trial resized it in place: give it its old storage back
        target.data = saved.to(target.device, copy=True)


def _restored_value(original: Any, saved: Any) -> Any:
    """The original state tensor with its saved values, or a copy of a plain value."""
    if isinstance(original, torch.Tensor):
        _copy_into(original, saved)
        return original
    return _copy_value(saved)


def _copy_value(value: Any) -> Any:
    import copy

    return value.clone() if isinstance(value, torch.Tensor) else copy.deepcopy(value)


def _global_state() -> dict[str, Any]:
    state: dict[str, Any] = {
        "grad_enabled": torch.is_grad_enabled(), "default_dtype": torch.get_default_dtype(),
        "torch": torch.get_rng_state(), "random": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        state["numpy"] = numpy.random.get_state()
    return state


def _set_global_state(state: dict[str, Any]) -> None:
    torch.set_grad_enabled(state["grad_enabled"])
    torch.set_default_dtype(state["default_dtype"])
    torch.set_rng_state(state["torch"])
    random.setstate(state["random"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        sys.modules["numpy"].random.set_state(state["numpy"])


def _loader_generators(loader: Any) -> list[torch.Generator]:
    found = []
    for owner in (loader, getattr(loader, "sampler", None), getattr(loader, "batch_sampler", None),
                  getattr(getattr(loader, "batch_sampler", None), "sampler", None)):
        generator = getattr(owner, "generator", None)
        if isinstance(generator, torch.Generator) and all(generator is not g for g in found):
            found.append(generator)
    return found


def _loader_state(loader: Any) -> Any:
    if loader is None:
        return None
    if callable(getattr(loader, "state_dict", None)):  # torchdata's StatefulDataLoader
        return ("state_dict", _copy_value(loader.state_dict()))
    return ("generators", [g.get_state() for g in _loader_generators(loader)])


def _set_loader_state(loader: Any, saved: Any) -> None:
    if loader is None or saved is None:
        return
    kind, value = saved
    if kind == "state_dict":
        loader.load_state_dict(value)
    else:
        for generator, state in zip(_loader_generators(loader), value):
            generator.set_state(state)


@contextlib.contextmanager
def preserved_state(model: nn.Module | None, optimizer: torch.optim.Optimizer | None = None,
                    loader: Any = None, *, tensors: bool = True) -> Iterator[StateSnapshot]:
    """Snapshot the user's training state, yield it, restore it bit-exactly on exit.

    The snapshot lives in host memory; nothing is written to disk. Call
    ``snapshot.restore()`` to go back mid-way (after each trial).

    Data loader position: batchfit never iterates the user's loader (trials make their
    own batches from the input spec), so its position cannot move; what iterating
    would change is the sampler's random generator (and, for a sampler without its own
    generator, torch's global RNG, restored anyway). Both are saved; a loader with
    ``state_dict()`` (torchdata's ``StatefulDataLoader``) is saved through it.

    Args:
        model: the module (None when there is none to protect).
        optimizer: its optimizer, if any.
        loader: a ``DataLoader`` whose position to keep.
        tensors: False to skip copying tensor values (for callers that never run the
            model in this process, as the CPU subprocess search).

    Example:
        >>> import torch
        >>> model = torch.nn.Linear(4, 2)
        >>> before = model.weight.clone()
        >>> with preserved_state(model):
        ...     _ = model.weight.data.add_(1.0)
        >>> torch.equal(model.weight, before)
        True
    """
    snapshot = StateSnapshot.take(model, optimizer, loader, tensors=tensors)
    try:
        yield snapshot
    finally:
        snapshot.restore()


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
        found = ti.storage_key(tensor)
        if found is None:
            return
        key, storage = found
        nbytes = storage.nbytes()
        if nbytes == 0 or key in self._live:
            return
        self._live[key] = (nbytes, ti.watch_storage(storage, lambda: self._on_free(key)))
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


def _state_tensors(runner: StepRunner) -> list[torch.Tensor]:
    """What lives between steps: parameters, buffers, gradients, optimizer state."""
    tensors = list(runner.model.parameters()) + list(runner.model.buffers())
    tensors += [p.grad for p in runner.model.parameters() if p.grad is not None]
    if runner.optimizer is not None:
        for state in runner.optimizer.state.values():
            tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
    if runner.scaler is not None:
        tensors += [runner.scaler.scale, runner.scaler.growth_tracker]
    return tensors


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
    """How the real step is configured (the same way trace_step configures the trace)."""

    spec: InputSpec
    config: TrainConfig
    device: torch.device
    float_dtype: torch.dtype | None
    autocast: Callable[[], Any] | None

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

    def batch(self, batch_size: int, generator: torch.Generator) -> tuple[tuple, dict]:
        with torch.device(self.device):
            return make_batch(self.spec, batch_size, self.float_dtype, generator,
                              self.config.channels_last)

    def runner(self, model: nn.Module, optimizer: torch.optim.Optimizer | None,
               generator: torch.Generator) -> StepRunner:
        foreach = False if self.device.type == "cpu" else None  # each device's own default
        return StepRunner(model, self.config, ((), {}), autocast=self.autocast, foreach=foreach,
                          generator=generator, optimizer=optimizer)

    def prepare(self, model: nn.Module) -> nn.Module:
        """A freshly built model in the config's dtype, memory format and checkpointing."""
        if self.float_dtype is not None:
            model = model.to(self.float_dtype)
        if self.config.channels_last:
            model = model.to(memory_format=torch.channels_last)
        if self.config.checkpointing and self.config.mode is Mode.TRAIN:
            from batchfit.fake import enable_checkpointing

            enable_checkpointing(model)
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
        with torch.device("cpu"):
            model = setup.prepare(_checked_module(model()))
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


# --------------------------------------------------------------------------- subprocess trials


@dataclass(frozen=True)
class TrialRequest:
    """What a child process needs to run one capped trial (pickled to it)."""

    model: Any  # a picklable factory, an nn.Module, or an importable "module:function"
    inputs: Any
    config: TrainConfig
    batch_size: int
    cap_bytes: int | None
    steps: int
    num_threads: int

    def preparation(self) -> bytes:
        """The request without its batch size, pickled: what a child can do in advance.
        Equal bytes mean the same preparation (one pickling per request object)."""
        return pickle.dumps(replace(self, batch_size=0))


def model_source(model: Any) -> tuple[Any, Any, Any]:
    """``(source, input_spec, loss_fn)`` for a model given as a ModelSpec, a spec string
    (``timm:NAME``, ``file.py:factory``, ``package.module:function``), a factory or a module."""
    from batchfit.models import ModelSpec, resolve_model

    if isinstance(model, str):
        module_name, sep, attr = model.partition(":")
        if (sep and attr.isidentifier() and not module_name.endswith(".py")
                and module_name not in ("timm", "torchvision", "hf")
                and importlib.util.find_spec(module_name) is not None):
            return model, None, None
        model = resolve_model(model)
    if isinstance(model, ModelSpec):
        return model.factory, model.input_spec, model.loss_fn
    if isinstance(model, nn.Module) or callable(model):
        return model, None, None
    raise InvalidInputError(
        f"cannot run {type(model).__name__} as a model: give an nn.Module, a factory, "
        "a ModelSpec or a spec string")


def _check_picklable(request: TrialRequest) -> bytes:
    try:
        return request.preparation()
    except Exception as exc:
        raise InvalidInputError(
            f"the model cannot be sent to a fresh process ({type(exc).__name__}: "
            f"{_one_line(exc, 120)}): give a module-level function, a functools.partial, "
            "'package.module:function' or 'path/to/file.py:factory'") from exc


def preloads_for(source: Any) -> list[str]:
    """Modules a zygote for ``source`` imports once: torch, batchfit and the model's own
    library (timm, torchvision, transformers, the factory's module), and nothing else; a
    fresh process that trains the model imports those too. Importing more moves the heap
    (measured: a zygote that also imported timm and transformers lost one batch of a
    plain CNN at a 128 MiB cap)."""
    names = ["torch", "batchfit.probe", "batchfit.fake"]
    func = source.func if hasattr(source, "func") else source
    module = (source.partition(":")[0] if isinstance(source, str)
              else getattr(func, "__module__", None) or type(source).__module__)
    if module and module != "__main__":
        names.append(module)
    libraries = {"_build_timm": "timm", "_build_torchvision": "torchvision",
                 "_build_hf": "transformers"}
    for part in (func, *getattr(source, "args", ())):  # resolve_model's partials name their builder
        library = libraries.get(getattr(part, "__name__", ""))
        if library is not None:
            names.append(library)
    return names


def trial_request(model: Any, inputs: Any, batch_size: int, config: TrainConfig,
                  cap_bytes: int | None, steps: int) -> TrialRequest:
    """A checked, picklable :class:`TrialRequest` (see :func:`run_trial_subprocess`)."""
    _check_trial_args(batch_size, steps)
    if cap_bytes is not None and (isinstance(cap_bytes, bool) or not isinstance(cap_bytes, int)
                                  or cap_bytes <= 0):
        raise InvalidInputError(f"memory cap must be a positive number of bytes, not {cap_bytes!r}")
    source, spec_inputs, loss_fn = model_source(model)
    inputs = inputs if inputs is not None else spec_inputs
    if inputs is None:
        raise InvalidInputError("no input spec: give inputs, e.g. (3, 224, 224)")
    if loss_fn is not None and config.loss_fn is None:
        config = replace(config, loss_fn=loss_fn)
    request = TrialRequest(source, inputs, config, batch_size, cap_bytes, steps,
                           torch.get_num_threads())
    _check_picklable(request)
    return request


def run_trial_subprocess(model: Any, inputs: Any, batch_size: int,
                         config: TrainConfig | None = None, cap_bytes: int | None = None,
                         steps: int = 2, *, server: TrialServer | None = None,
                         timeout_s: float | None = None, **options: Any) -> Trial:
    """Run one trial in a fresh process whose memory is capped ``cap_bytes`` above its
    state after a warm-up step.

    The child builds the model and the optimizer on the CPU, runs one step at batch 1
    (batch 2 if the model cannot train on one sample; this creates the optimizer state
    and starts the thread pool), frees that step's gradients and batch, reads
    ``VmData`` and sets ``RLIMIT_DATA`` to ``VmData + cap_bytes`` (soft limit; see the
    module docstring for why DATA and not AS). Then it runs ``steps`` steps at
    ``batch_size``; an out-of-memory error ends the trial with ``fits=False``. Any other
    error is re-raised here, unchanged, with the child's traceback as a note.

    Args:
        model: a ModelSpec, a spec string (``timm:NAME``, ``path/file.py:factory``,
            ``package.module:function``), a picklable factory or an ``nn.Module``.
        inputs: the per-sample input spec (default: the spec's own).
        batch_size: the batch size.
        config: a :class:`TrainConfig`, or its fields as ``options``.
        cap_bytes: bytes available beyond the warmed-up state (None: no cap).
        steps: steps at ``batch_size`` (>= 2).
        server: a running :class:`TrialServer` to fork from; by default a fresh one is
            started for this trial and stopped after it.
        timeout_s: kill the child after this long and raise :class:`TrialError`.

    Example:
        >>> import functools, torch
        >>> factory = functools.partial(torch.nn.Linear, 16, 4)
        >>> trial = run_trial_subprocess(factory, (16,), 8, cap_bytes=64 * 2**20, optimizer="sgd")
        >>> trial.fits
        True
    """
    request = trial_request(model, inputs, batch_size, make_config(config, options), cap_bytes,
                            steps)
    if server is not None:
        return server.run(request, timeout_s=timeout_s)
    with TrialServer(preloads_for(request.model), prepare_next=False) as fresh:
        return fresh.run(request, timeout_s=timeout_s)


def _frame(stream: BinaryIO, data: bytes) -> None:
    stream.write(struct.pack("<Q", len(data)) + data)
    stream.flush()


def _read_exact(stream: BinaryIO, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = stream.read(size - len(data))
        if not chunk:
            raise EOFError
        data += chunk
    return data


def _unframe(stream: BinaryIO) -> bytes:
    (size,) = struct.unpack("<Q", _read_exact(stream, 8))
    return _read_exact(stream, size)


class TrialServer:
    """A zygote process that forks one fresh, warmed-up process per capped trial.

    Start it once per search: it pays for ``import torch`` (and the model's libraries,
    ``preload``) once. For each request (a model, input spec, config and cap; any batch
    size) the zygote forks a *template*: a child that builds the model and the optimizer,
    runs the warm-up step at batch 1 and drops its gradients and batch, exactly what a
    fresh process does before its cap is set, then waits. Each trial is a child forked
    from the template at that point: its memory is the template's, byte for byte, so it
    is what a fresh process that imported those libraries and did that work holds (the
    zygote imports nothing else: a fresh process imports ``torch._dynamo`` when it builds
    its first optimizer, after the model; importing it in the zygote moves the heap's free
    space and, measured, changed the largest batch by one). A trial then costs a fork
    and its steps: the model's build, its warm-up and the ``torch._dynamo`` import (2-5 s
    on this machine) are paid once per request, by the template, which :meth:`prepare`
    starts while the caller computes its prediction. The template is kept while requests
    repeat, so a second search of the same request on the same server starts at once.

    Templates need one thread: GNU OpenMP does not survive a fork after a parallel
    region (the child hangs), and a template warmed up on one thread for a trial on more
    is not a fresh process (measured on a small convnet on two threads: 1 MiB more
    overhead, the largest batch two lower). A request on more threads (a request
    carries the caller's ``torch.get_num_threads()``) gets what a fresh process on that
    many threads does: each trial is a child that builds, warms up (starting its thread
    team and the workers' malloc arenas before the cap) and runs, the next one prepared
    ahead while the current one runs.

    Args:
        preload: module names to import in the zygote (torch and batchfit are always).
        env: the zygote's environment (default: this process's); glibc reads
            ``MALLOC_*`` variables from it at start-up.
        prepare_next: keep the template between trials of the same request; False builds
            a new one for every trial (each trial then pays the build and the warm-up).
    """

    def __init__(self, preload: list[str] | tuple[str, ...] = (), *,
                 env: dict[str, str] | None = None, prepare_next: bool = True):
        self.preload = list(dict.fromkeys(["torch", "batchfit.probe", *preload]))
        env = dict(os.environ) if env is None else env
        self._process = subprocess.Popen(
            [sys.executable, "-c", "from batchfit.probe import zygote_main; zygote_main()"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        # Read through the unbuffered stream, so that select() sees every pending byte.
        self._output = self._process.stdout.raw
        _frame(self._process.stdin, pickle.dumps({
            "preload": self.preload, "sys_path": sys.path, "main_path": _main_path(),
            "keep_template": prepare_next}))
        self._ready = False
        self._keys: list[tuple[TrialRequest, bytes]] = []

    def wait_ready(self) -> None:
        """Block until the zygote has imported its modules."""
        if not self._ready:
            reply = pickle.loads(self._receive(None))
            if "error" in reply:
                raise TrialError(f"the trial process could not start: {reply['error']}")
            self._ready = True

    def _key(self, request: TrialRequest) -> bytes:
        """The request's preparation, pickled once per request object, so that requests
        that differ only in batch size send equal bytes."""
        template = replace(request, batch_size=0)
        for known, data in self._keys:
            if known is template or known == template:
                return data
        data = template.preparation()
        self._keys.append((template, data))
        return data

    def prepare(self, request: TrialRequest) -> None:
        """Start building the template for ``request`` now (no batch size needed yet)."""
        _frame(self._process.stdin, self._key(request))
        _frame(self._process.stdin, struct.pack("<q", 0))

    def run(self, request: TrialRequest, *, timeout_s: float | None = None) -> Trial:
        """Run one trial in a child forked from the request's template."""
        self.wait_ready()
        _frame(self._process.stdin, self._key(request))
        _frame(self._process.stdin, struct.pack("<q", request.batch_size))
        child = pickle.loads(self._receive(None))["child"]
        try:
            messages = self._receive(timeout_s)
        except TimeoutError:
            if child:  # None: the template died before it could fork
                with contextlib.suppress(ProcessLookupError):
                    os.kill(child, signal.SIGKILL)
            self._receive(None)
            self._receive(None)
            raise TrialError(f"the trial did not finish within {timeout_s} s") from None
        (status,) = struct.unpack("<q", self._receive(None))
        return _trial_from_reply(_decode_messages(messages), status, request)

    def _receive(self, timeout_s: float | None) -> bytes:
        if timeout_s is not None:
            ready, _, _ = select.select([self._output], [], [], timeout_s)
            if not ready:
                raise TimeoutError
        try:
            return _unframe(self._output)
        except EOFError:
            code = self._process.wait()
            raise TrialError(f"the trial process exited unexpectedly (code {code})") from None

    def close(self) -> None:
        if self._process.poll() is None:
            with contextlib.suppress(BrokenPipeError, OSError):
                self._process.stdin.close()
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _main_path() -> str | None:
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    return os.path.abspath(path) if path and path.endswith(".py") else None


def _decode_messages(data: bytes) -> list[tuple[str, Any]]:
    """The trial child's ``(kind, value)`` messages, from its raw framed output."""
    import io

    stream, messages = io.BytesIO(data), []
    with contextlib.suppress(EOFError, pickle.UnpicklingError):
        while True:
            messages.append(pickle.loads(_unframe(stream)))
    return messages


def _trial_from_reply(messages: list[tuple[str, Any]], status: int,
                      request: TrialRequest) -> Trial:
    kinds = dict(messages)
    if "result" in kinds:
        return Trial(**kinds["result"])
    if "error" in kinds:
        exc, text = kinds["error"]
        exc.add_note(f"raised in the trial process (batch {request.batch_size}):\n{text}")
        raise exc
    how = (f"signal {signal.Signals(os.WTERMSIG(status)).name}" if os.WIFSIGNALED(status)
           else f"exit code {os.WEXITSTATUS(status)}")
    if "capped" in kinds:  # it died under the cap: a library that aborts when malloc fails
        return Trial(request.batch_size, False, None, 0.0,
                     f"the trial process died ({how}) under the memory cap",
                     limit_bytes=request.cap_bytes, baseline_bytes=kinds["capped"]["baseline"])
    raise TrialError(f"the trial process died ({how}) before its memory cap was set")


# --------------------------------------------------------------------------- in the zygote / template / trial


def _read_all(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 1 << 16):
        chunks.append(chunk)
    os.close(fd)
    return b"".join(chunks)


@dataclass
class _Template:
    """A forked template (in the zygote): ``control`` carries batch sizes to it, ``output``
    brings back, per trial, three frames: ``{"child": pid}``, the trial child's raw
    messages, and its wait status."""

    key: bytes
    pid: int
    control: int
    output: BinaryIO

    def run(self, batch_size: int, relay: Callable[[bytes], None]) -> bool:
        """Start one trial and relay its three frames as they come (the caller's timeout
        needs the first at once); False if the template is gone."""
        relayed = 0
        try:
            os.write(self.control, struct.pack("<q", batch_size))
            while relayed < 3:
                relay(_unframe(self.output))
                relayed += 1
        except (EOFError, BrokenPipeError, OSError):
            _, status = os.waitpid(self.pid, 0)
            self.pid = 0
            for frame in [pickle.dumps({"child": None}), b"",
                          struct.pack("<q", status)][relayed:]:
                relay(frame)
        return self.pid != 0

    def discard(self) -> None:
        if self.pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
        with contextlib.suppress(OSError):
            os.close(self.control)
        self.output.close()


def _fork_template(key: bytes, main_path: str | None, closing: list[Any]) -> _Template:
    pid, control_write, output_read = fork_child(
        closing, lambda control, output: _template_main(key, control, output, main_path))
    return _Template(key, pid, control_write, os.fdopen(output_read, "rb", buffering=0))


def zygote_main() -> None:
    """Entry point of the zygote: import, then fork templates on request (internal)."""
    proto_in = os.fdopen(os.dup(0), "rb")
    proto_out = os.fdopen(os.dup(1), "wb")
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(2, 1)  # anything a model prints goes to stderr, never into the protocol
    setup = pickle.loads(_unframe(proto_in))
    sys.path[:] = setup["sys_path"]
    try:
        for name in setup["preload"]:
            importlib.import_module(name)
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        _frame(proto_out, pickle.dumps({"error": f"importing {name}: {_one_line(exc)}"}))
        return
    torch.set_num_threads(1)  # never start an OpenMP team here: forked children would hang
    gc.collect()  # free the imports' garbage here, as a fresh process's collection would
    gc.freeze()  # children's gc.collect() skips (and never copies) the zygote's objects
    _frame(proto_out, pickle.dumps({"ready": True}))
    template: _Template | None = None
    closing = [proto_in, proto_out]
    try:
        while True:
            try:
                key = _unframe(proto_in)
                (batch_size,) = struct.unpack("<q", _unframe(proto_in))
            except EOFError:
                return
            if template is not None and template.key != key:
                template.discard()
                template = None
            if template is None:
                template = _fork_template(key, setup["main_path"], closing)
            if batch_size == 0:  # prepare only
                continue
            alive = template.run(batch_size, lambda frame: _frame(proto_out, frame))
            if not alive or not setup["keep_template"]:
                template.discard()
                template = None
    finally:
        if template is not None:
            template.discard()


def _template_main(key: bytes, control: int, output: int, main_path: str | None) -> None:
    """Serve one request: fork one trial child per batch size received, one kept ready.

    On one thread the template builds the model and warms up once, and its children
    start from that state. With more threads it cannot (GNU OpenMP does not survive a
    fork after a parallel region), so each child builds and warms up itself with the
    request's threads, as a fresh process does; the ready one does it ahead.
    """
    failure, prepared, request = None, None, None
    try:
        request = _load_request(key, main_path)
        if request.num_threads == 1:
            prepared = _PreparedTrial.build(request)
    except BaseException as exc:  # noqa: BLE001 - sent back with each trial request
        failure = _frame_bytes(pickle.dumps(("error", _packed_exception(exc))))
    with os.fdopen(control, "rb", buffering=0) as requests, os.fdopen(output, "wb") as out:
        closing = [requests, out]
        ready = None if failure is not None else _fork_ready(prepared, request, closing)
        try:
            while True:
                try:
                    (batch_size,) = struct.unpack("<q", _read_exact(requests, 8))
                except EOFError:
                    return
                if ready is None:
                    for frame in (pickle.dumps({"child": None}), failure, struct.pack("<q", 0)):
                        _frame(out, frame)
                    continue
                child, ready = ready, None
                child.go(batch_size)
                ready = _fork_ready(prepared, request, closing)
                _frame(out, pickle.dumps({"child": child.pid}))
                messages, status = child.collect()
                _frame(out, messages)
                _frame(out, struct.pack("<q", status))
        finally:
            if ready is not None:
                ready.discard()


@dataclass
class _ReadyChild:
    """A trial child waiting for its batch size on ``control``; it writes to ``result``."""

    pid: int
    control: int
    result: int

    def go(self, batch_size: int) -> None:
        with contextlib.suppress(BrokenPipeError, OSError):  # it died preparing: see result
            os.write(self.control, struct.pack("<q", batch_size))
        os.close(self.control)

    def collect(self) -> tuple[bytes, int]:
        messages = _read_all(self.result)
        _, status = os.waitpid(self.pid, 0)
        return messages, status

    def discard(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        os.close(self.control)
        os.close(self.result)
        os.waitpid(self.pid, 0)


def _fork_ready(prepared: _PreparedTrial | None, request: TrialRequest,
                closing: list[Any]) -> _ReadyChild:
    pid, control_write, result_read = fork_child(
        closing, lambda control, result: _trial_main(prepared, request, control, result))
    return _ReadyChild(pid, control_write, result_read)


def _frame_bytes(data: bytes) -> bytes:
    return struct.pack("<Q", len(data)) + data


def _trial_main(prepared: _PreparedTrial | None, request: TrialRequest, control: int,
                output: int) -> None:
    with os.fdopen(output, "wb") as out:
        def emit(kind: str, value: Any) -> None:
            _frame(out, pickle.dumps((kind, value)))

        try:
            if prepared is None:
                prepared = _PreparedTrial.build(request)
            with os.fdopen(control, "rb", buffering=0) as pipe:
                try:
                    (batch_size,) = struct.unpack("<q", _read_exact(pipe, 8))
                except EOFError:  # discarded before use
                    return
            emit("result", prepared.run(batch_size, lambda info: emit("capped", info)))
        except BaseException as exc:  # noqa: BLE001 - sent back and re-raised in the parent
            emit("error", _packed_exception(exc))


def _load_request(payload: bytes, main_path: str | None) -> TrialRequest:
    try:
        return pickle.loads(payload)
    except AttributeError:
        if main_path is None:
            raise
    # The factory lives in the user's __main__: import that script as multiprocessing's
    # spawn does (its ``if __name__ == "__main__"`` block does not run).
    import runpy

    main = types.ModuleType("__mp_main__")
    main.__dict__.update(runpy.run_path(main_path, run_name="__mp_main__"))
    sys.modules["__main__"] = sys.modules["__mp_main__"] = main
    return pickle.loads(payload)


def _packed_exception(exc: BaseException) -> tuple[BaseException, str]:
    text = "".join(traceback.format_exception(exc))
    release_exception(exc)
    try:
        clone = pickle.loads(pickle.dumps(exc))
    except Exception:  # noqa: BLE001 - unpicklable exception: keep its type name and text
        clone = RuntimeError(f"{type(exc).__name__}: {exc}")
    return clone, text


def factory_of(source: Any) -> Any:
    """A module or a callable for an importable ``"module:function"`` string or a factory."""
    if isinstance(source, str):
        module_name, _, attr = source.partition(":")
        return getattr(importlib.import_module(module_name), attr)
    return source


def _build_from_source(source: Any) -> nn.Module:
    source = factory_of(source)
    return source if isinstance(source, nn.Module) else _checked_module(source())


def _warm_up(runner: StepRunner, setup: _StepSetup, generator: torch.Generator) -> None:
    """One step at batch 1, or at batch 2 for models that cannot train on one sample
    (BatchNorm over a single value per channel raises)."""
    step = runner.train_step if setup.config.mode is Mode.TRAIN else runner.infer_step
    try:
        runner.batch = setup.batch(1, generator)
        step()
    except Exception:  # noqa: BLE001 - retried once; a second failure is the user's error
        if runner.optimizer is not None:
            runner.optimizer.zero_grad(set_to_none=True)
        runner.batch = setup.batch(2, generator)
        step()


@dataclass
class _PreparedTrial:
    """After the build and the warm-up, waiting for a batch size: what a fresh process
    that built the model and the optimizer and ran one step at batch 1 holds."""

    request: TrialRequest
    setup: _StepSetup
    runner: StepRunner
    generator: torch.Generator

    @classmethod
    def build(cls, request: TrialRequest) -> _PreparedTrial:
        torch.set_num_threads(request.num_threads)  # a template: 1 (see _template_main)
        torch.manual_seed(0)
        setup = _StepSetup.of(request.inputs, request.config, torch.device("cpu"))
        model = setup.prepare(_build_from_source(request.model))
        generator = torch.Generator().manual_seed(0)
        runner = setup.runner(model, None, generator)
        _warm_up(runner, setup, generator)
        if runner.optimizer is not None:
            runner.optimizer.zero_grad(set_to_none=True)
        runner.batch = ((), {})
        gc.collect()
        return cls(request, setup, runner, generator)

    def run(self, batch_size: int, on_capped: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
        """Cap the data segment, run the steps at ``batch_size``, measure them."""
        cap = self.request.cap_bytes
        tracker = _UsageTracker(sample_data_segment=True)
        for tensor in _state_tensors(self.runner):
            tracker.add(tensor)
        baseline = tracker.live_bytes
        start_data = vm_data_bytes()
        if cap is not None:
            _, hard = resource.getrlimit(resource.RLIMIT_DATA)
            if hard != resource.RLIM_INFINITY and start_data + cap > hard:
                raise InvalidInputError(f"memory cap exceeds the hard RLIMIT_DATA of {hard} B")
            resource.setrlimit(resource.RLIMIT_DATA, (start_data + cap, hard))
        tracker.data_peak = segment_start = _data_segment_now()
        on_capped({"baseline": baseline, "vm_data": start_data})
        result = {"batch_size": batch_size, "fits": True, "peak_bytes": None, "error": None,
                  "used_bytes": None, "limit_bytes": cap, "baseline_bytes": baseline}
        start = time.perf_counter()
        try:
            result["peak_bytes"] = _run_steps(self.runner, self.setup, batch_size,
                                              self.request.steps, self.generator, tracker)
            result["used_bytes"] = tracker.data_peak - segment_start
        except Exception as exc:
            if not is_out_of_memory(exc):
                raise
            result.update(fits=False, error=_one_line(exc))
            release_exception(exc)
        result["seconds"] = time.perf_counter() - start
        return result
