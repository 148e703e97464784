"""Trace one step on fake tensors: every storage allocation and free, tagged with its
category, module, op and phase.

The tracer watches storages, not tensors: views share their base's storage, and a
storage is freed when its last tensor dies (a weakref callback on the storage).
Parameters, buffers, inputs and optimizer state are registered up front; every
other storage is created by an aten op seen by a dispatch mode below autograd, so
the tensors autograd saves for backward are exactly the ones still alive.

Known limitations:
    * Memory allocated inside a kernel and freed before it returns (library
      workspaces, oneDNN scratch) is invisible; on CUDA it is modelled in
      :mod:`batchfit.device.profile` as a fixed workspace.
    * Custom ops with a fake implementation are traced by their outputs only; a
      warning names them.
"""

from __future__ import annotations

import contextlib
import itertools
import sys
from dataclasses import dataclass, replace
from enum import IntEnum, StrEnum
from typing import Any, Protocol, Sequence

import torch
from torch import nn

from batchfit._gc import old_objects_frozen
from batchfit.engine import _torch_internals as ti
from batchfit.engine.kernels import (decomposition_for, is_outputs_only, scalar_reads_allowed,
                                     scratch_for, size_fix_for)


class Category(StrEnum):
    """What a byte of device memory is for."""

    PARAMETERS = "parameters"
    BUFFERS = "buffers"
    GRADIENTS = "gradients"
    OPTIMIZER_STATE = "optimizer_state"
    INPUTS = "inputs"
    ACTIVATIONS = "activations"
    AUTOCAST_COPIES = "autocast_copies"
    TEMPORARIES = "temporaries"
    ALLOCATOR_SLACK = "allocator_slack"
    CONTEXT = "context_workspace"
    # multi-GPU (batchfit.sharding)
    GATHERED_PARAMETERS = "gathered_parameters"  # a sharded layer's parameters, all-gathered
    COMMUNICATION = "communication_buffers"  # collective inputs/outputs, DDP's buckets
    NCCL = "nccl"  # NCCL's own buffers, outside the caching allocator


class Phase(StrEnum):
    SETUP = "setup"
    ZERO_GRAD = "zero_grad"
    FORWARD = "forward"
    LOSS = "loss"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"


_LOCAL_SCALAR = torch.ops.aten._local_scalar_dense.default
_EQUAL = torch.ops.aten.equal.default


class EventKind(IntEnum):
    ALLOC = 0
    FREE = 1
    RETAG = 2  # the storage changes category (a temporary becomes a gradient)


@dataclass(frozen=True, slots=True)
class Event:
    """One change to device memory. For RETAG, ``category`` is the new category."""

    kind: EventKind
    key: int
    nbytes: int
    category: Category
    module: str
    op: str
    phase: Phase


_CREATED_AS = {
    Phase.SETUP: Category.TEMPORARIES,
    Phase.ZERO_GRAD: Category.TEMPORARIES,
    Phase.FORWARD: Category.ACTIVATIONS,
    Phase.LOSS: Category.ACTIVATIONS,
    Phase.BACKWARD: Category.TEMPORARIES,
    Phase.OPTIMIZER: Category.TEMPORARIES,
}
_TO_COPY = torch.ops.aten._to_copy.default
_UIDS = itertools.count()  # storage ids, unique across traces so traces can be spliced
#: Decomposed ops of traces for a CUDA target run on meta twins, with recipes shared by
#: every trace of the process (None: every op runs on the fake tensors).
META_TWINS: ti.MetaTwins | None = ti.MetaTwins()
_CUSTOM_NAMESPACES_OK = {"aten", "prims", "_c10d_functional", "c10d_functional", "c10d",
                         "_c10d_functional_autograd", "_dtensor", "fsdp"}
_WAIT_TENSOR = getattr(torch.ops._c10d_functional, "wait_tensor", None)
_WAIT_TENSOR = getattr(_WAIT_TENSOR, "default", None)


class Tracer:
    """Records :class:`Event` s while active. One tracer traces one step.

    Use :meth:`register` for storages that exist before the step, set
    :attr:`phase` as the step goes, and :meth:`watch_module` to attribute memory to
    submodules. ``in_op_scratch``: add kernels' scratch (CPU targets).
    ``cuda_target``: run decomposed ops on meta twins, as CUDA runs them
    (:class:`ti.MetaTwins`). ``device_type``: record only tensors on this device type
    (a CUDA target's optimizer phase on meta twins: a CPU tensor there is host memory,
    as Adam's step counts are on a GPU). ``device``: the target profile, for ops traced
    as their kernel's sub-ops (:func:`batchfit.engine.kernels.decomposition_for`).
    Storages declared :meth:`host_backed` (paged optimizer state) are kept out of the
    events; their bytes are in :attr:`host_backed_bytes`. ``fake_mode``: record only fake
    tensors of this mode (DTensor's sharding propagation runs ops under a fake mode of its
    own, which allocate nothing on the device).

    Extension points (:mod:`batchfit.sharding` uses them): ``observers`` are called
    with ``(func, args, output)`` for every op before it is recorded; ``category_rule``
    names the category of an op's new storages (None: the phase's default); and
    :meth:`on_resize` records a storage resized in place (:func:`ti.watching_resizes`).
    """

    def __init__(self, in_op_scratch: bool = False, cuda_target: bool = False,
                 device_type: str | None = None, device: Any = None,
                 fake_mode: Any = None) -> None:
        self.events: list[Event] = []
        self.fake_mode = fake_mode
        self.observers: list[Any] = []
        self.category_rule: Any = None
        #: phases whose unknown ``.item()`` values are answered (see :meth:`_shortcut`)
        self.item_phases: frozenset[Phase] = frozenset({Phase.OPTIMIZER})
        self._muted = 0
        self.in_op_scratch = in_op_scratch  # kernels.py
        self.device_type = device_type
        self.device = device
        self._cuda_target = cuda_target
        self._ignored: set[int] = set()  # storage keys of host-backed buffers
        self.host_backed_bytes = 0
        self.phase = Phase.SETUP
        # storage address -> [nbytes, category, module, weakref, uid]; addresses are reused
        # after a free, so events carry a unique id instead
        self._live: dict[int, list[Any]] = {}
        self._module_stack: list[str] = []
        self._recording = False
        self.failed_op: str | None = None
        self.failed_module: str | None = None
        self.custom_ops: dict[str, str] = {}  # op -> module where first seen
        self.largest: tuple[int, str, str] = (0, "", "")  # (numel, op, module) of the largest output
        self._interceptor = ti.OpInterceptor(self._on_output, self._on_error,
                                             shortcut=self._shortcut, run=self._run)
        self._hooks: list[Any] = []

    # -- lifecycle ---------------------------------------------------------------
    def __enter__(self) -> "Tracer":
        self._recording = True
        self._interceptor.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._interceptor.__exit__(*exc)
        self._recording = False
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()

    # -- storages --------------------------------------------------------------------
    def current_module(self) -> str:
        if self._module_stack:
            return self._module_stack[-1]
        if self.phase is Phase.BACKWARD:
            return ti.current_backward_module() or ""
        return ""

    def register(self, tensor: torch.Tensor, category: Category, module: str = "") -> None:
        """Record an existing storage (a parameter, an input) as allocated now."""
        for plain in ti.inner_tensors(tensor):
            found = ti.storage_key(plain)
            if found is not None and found[0] not in self._live:
                self._add(found[0], found[1], category, module, "")

    def retag(self, tensor: torch.Tensor, category: Category) -> None:
        for plain in ti.inner_tensors(tensor):
            found = ti.storage_key(plain)
            if found is None or found[0] in self._ignored or not self._on_device(plain):
                continue
            entry = self._live.get(found[0])
            if entry is None:
                self._add(found[0], found[1], category, self.current_module(), "")
            elif entry[1] is not category:
                entry[1] = category
                if entry[4] is not None:  # resized to 0: it changes category silently
                    self.events.append(Event(EventKind.RETAG, entry[4], entry[0], category,
                                             entry[2], "", self.phase))

    def on_resize(self, storage: Any, nbytes: int) -> None:
        """A storage resized in place: its old bytes are freed and its new ones allocated
        (FSDP frees a gathered parameter with ``resize_(0)`` and gathers it again into the
        same storage). The category is the rule's for the op running now, else the
        storage's own."""
        key = storage._cdata
        entry = self._live.get(key)
        if entry is None:
            if nbytes > 0 and self._recording:
                self._add(key, storage, self._rule_category(None) or Category.TEMPORARIES,
                          self.current_module(), "resize_", nbytes)
            return
        if entry[0] == nbytes:
            return
        if entry[4] is not None:
            self.events.append(Event(EventKind.FREE, entry[4], entry[0], entry[1], entry[2],
                                     "", self.phase))
        entry[0], entry[4] = nbytes, next(_UIDS) if nbytes > 0 else None
        if nbytes > 0:
            entry[1] = self._rule_category(None) or entry[1]
            entry[2] = self.current_module()
            self.events.append(Event(EventKind.ALLOC, entry[4], nbytes, entry[1], entry[2],
                                     "resize_", self.phase))

    def uids(self, tensor: torch.Tensor) -> list[int]:
        """The event ids of the live allocations holding ``tensor`` (its inner tensors')."""
        found = []
        for plain in ti.inner_tensors(tensor):
            key = ti.storage_key(plain)
            entry = self._live.get(key[0]) if key is not None else None
            if entry is not None and entry[4] is not None:
                found.append(entry[4])
        return found

    def transient(self, nbytes: int, category: Category, op: str) -> int:
        """Record an allocation no tensor stands for (a copy the traced code skips on this
        device); :meth:`release` frees it. Returns its id."""
        uid = next(_UIDS)
        self.events.append(Event(EventKind.ALLOC, uid, nbytes, category,
                                 self.current_module(), op, self.phase))
        return uid

    def release(self, uid: int, nbytes: int, category: Category) -> None:
        self.events.append(Event(EventKind.FREE, uid, nbytes, category, self.current_module(),
                                 "", self.phase))

    def _rule_category(self, func: Any) -> Category | None:
        return self.category_rule(func) if self.category_rule is not None else None

    def host_backed(self, tensor: torch.Tensor) -> None:
        """``tensor``'s storage is host memory the device maps (CUDA unified memory): drop
        its allocation from the events and ignore it from now on."""
        found = ti.storage_key(tensor)
        if found is None:
            return
        entry = self._live.pop(found[0], None)
        if entry is not None:
            for index in range(len(self.events) - 1, -1, -1):
                event = self.events[index]
                if event.key == entry[4] and event.kind is EventKind.ALLOC:
                    del self.events[index]
                    break
        if found[0] not in self._ignored:
            self._ignored.add(found[0])
            self.host_backed_bytes += found[1].nbytes()

    def _run(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """An op's output computed another way (:class:`ti.OpInterceptor`'s ``run``): a
        registered decomposition, traced op by op; on CUDA targets, a meta twin."""
        decompose = decomposition_for(func)
        if decompose is not None:
            with self._interceptor:  # the sub-ops are recorded like any other op
                return decompose(args, kwargs, self.device)
        if self._cuda_target and META_TWINS is not None:
            return META_TWINS(func, args, kwargs)
        return ti.RUN

    def _on_device(self, tensor: torch.Tensor) -> bool:
        return self.device_type is None or tensor.device.type == self.device_type

    def category_of(self, tensor: torch.Tensor) -> Category | None:
        found = ti.storage_key(tensor)
        entry = self._live.get(found[0]) if found else None
        return entry[1] if entry else None

    def _add(self, key: int, storage: Any, category: Category, module: str, op: str,
             nbytes: int | None = None) -> None:
        if nbytes is None:
            nbytes = storage.nbytes()
        uid = next(_UIDS)

        def on_free() -> None:
            entry = self._live.pop(key, None)
            if entry is not None and self._recording and entry[4] is not None:
                self.events.append(Event(EventKind.FREE, entry[4], entry[0], entry[1],
                                         entry[2], "", self.phase))

        ref = ti.watch_storage(storage, on_free)
        self._live[key] = [nbytes, category, module, ref, uid]
        self.events.append(Event(EventKind.ALLOC, uid, nbytes, category, module, op, self.phase))

    @contextlib.contextmanager
    def muted(self) -> Any:
        """Ops in the block allocate nothing on the device (DTensor runs ops on fake
        tensors of the active fake mode to learn output shapes): none is recorded."""
        self._muted += 1
        try:
            yield
        finally:
            self._muted -= 1

    def _on_output(self, func: Any, args: tuple, out: Any) -> None:
        if self._muted:
            return
        for observe in self.observers:
            observe(func, args, out)
        module = None
        op = None
        fix = size_fix_for(func)
        real_sizes = fix(args, {}) if fix is not None else {}
        for index, tensor in enumerate(ti.iter_tensors(out)):
            found = ti.storage_key(tensor)
            if (found is None or found[0] in self._live or found[0] in self._ignored
                    or not self._on_device(tensor)):
                continue
            if self.fake_mode is not None and getattr(tensor, "fake_mode", self.fake_mode) \
                    is not self.fake_mode:
                continue
            if op is None:
                op = str(func)
                module = self.current_module()
                namespace = op.split(".", 1)[0]
                if (namespace not in _CUSTOM_NAMESPACES_OK and op not in self.custom_ops
                        and not is_outputs_only(op)):
                    self.custom_ops[op] = module
            category = self._category_for(func, args)
            self._add(found[0], found[1], category, module, op, real_sizes.get(index))
            numel = tensor.numel()
            if numel > self.largest[0]:
                self.largest = (numel, op, module)
        scratch = scratch_for(func) if self.in_op_scratch else None
        if scratch is not None and (nbytes := scratch(args)) > 0:
            uid = next(_UIDS)
            where = module if op is not None else self.current_module()
            for kind in (EventKind.ALLOC, EventKind.FREE):
                self.events.append(Event(kind, uid, nbytes, Category.TEMPORARIES, where or "",
                                         str(func), self.phase))

    def _category_for(self, func: Any, args: tuple) -> Category:
        if self.category_rule is not None and (ruled := self.category_rule(func)) is not None:
            return ruled
        if self.phase is Phase.BACKWARD:
            # module forwards inside backward are activation-checkpoint recomputation
            return Category.ACTIVATIONS if self._module_stack else Category.TEMPORARIES
        if func is _TO_COPY and args and isinstance(args[0], torch.Tensor):
            if self.category_of(args[0]) in (Category.PARAMETERS, Category.BUFFERS):
                return Category.AUTOCAST_COPIES  # a low-precision copy of a weight
        return _CREATED_AS[self.phase]

    def _shortcut(self, func: Any, args: tuple) -> Any:
        """Ops a fake trace answers without running them (they allocate nothing):

        * in-place multi-tensor ops on arrays (:func:`ti.skippable_in_fake_trace`);
        * in the optimizer phase, ``.item()`` of a tensor whose value a fake tensor does
          not know: optimizers that scale their step by a value (Adafactor's
          ``param.norm().item()``) get 1. The value only sets a scalar, never a shape.
          Values the fake tensor knows (constants: step counts, the grad scaler's
          ``found_inf``) are returned as they are; a meta tensor (the optimizer phase
          runs on meta twins, :func:`_trace_optimizer_on_meta`) has no value and gets 1
          at once; a boolean or a byte gets False or 0 (a check a real step passes:
          DeepSpeed's "is the gradient norm finite?" and its overflow byte decide
          whether the step runs at all).
          Elsewhere it stays an error (a data-dependent shape in forward changes the
          memory), except inside code declared to read values only as scalars
          (:func:`batchfit.engine.kernels.scalar_reads`: Liger's chunked loss counts the
          tokens it averages over, and compares the upstream gradient with 1), where
          ``.item()`` gets 1 and ``torch.equal`` True. A transform may add phases
          (:attr:`item_phases`: DeepSpeed's offload checks gradients for overflow in
          backward);
        * ``wait_tensor`` of a functional collective (DTensor's): eager returns its
          input, where the fake kernel would make a new tensor (as torch's MemTracker
          notes).
        """
        if ti.skippable_in_fake_trace(func, args):
            return None
        if func is _WAIT_TENSOR and func is not None:
            return args[0]
        if scalar_reads_allowed() and (func is _LOCAL_SCALAR or func is _EQUAL):
            if func is _EQUAL:
                return True
            dtype = args[0].dtype
            return 1.0 if dtype.is_floating_point else (True if dtype is torch.bool else 1)
        if func is _LOCAL_SCALAR and self.phase in self.item_phases:
            if not args[0].is_meta:
                try:
                    return func(*args)
                except ti.DataDependentOutputException:
                    pass
            dtype = args[0].dtype
            if dtype.is_floating_point or dtype.is_complex:
                return 1.0
            if dtype is torch.bool:
                return False
            return 0 if dtype is torch.uint8 else 1  # a byte is a flag (DeepSpeed's overflow)
        return ti.RUN

    def _on_error(self, func: Any, exc: BaseException) -> None:
        if self.failed_op is None:
            self.failed_op = str(func)
            self.failed_module = self.current_module()

    # -- modules -----------------------------------------------------------------------
    def watch_module(self, model: nn.Module,
                     named: Sequence[tuple[str, nn.Module]] | None = None) -> None:
        """Attribute allocations to the submodule that runs (forward, and backward);
        ``named``: the ``(path, module)`` pairs to watch instead of ``named_modules()``."""
        for path, module in (named if named is not None else model.named_modules()):
            self._hooks.append(module.register_forward_pre_hook(self._pre_hook(path)))
            self._hooks.append(module.register_forward_hook(self._post_hook(path),
                                                            always_call=True))

    def _pre_hook(self, path: str):
        def hook(module: nn.Module, args: Any) -> None:
            self._module_stack.append(path)
        return hook

    def _post_hook(self, path: str):
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if sys.exc_info()[0] is not None and self.failed_module is None:
                self.failed_module = path  # always_call hooks run while the error propagates
            if self._module_stack and self._module_stack[-1] == path:
                self._module_stack.pop()
            if torch.is_grad_enabled() and self.phase is not Phase.BACKWARD and output is not None:
                ti.tag_graph(output, path)
        return hook



# -- tracing a whole step ------------------------------------------------------------


@dataclass(frozen=True)
class StepTrace:
    """The events of one traced step.

    ``steady_events`` is the steady-state step (optimizer state exists from the
    start, as from the second step on); ``first_events`` is the first step, which
    creates the optimizer state. For inference both are the same.
    """

    steady_events: tuple[Event, ...]
    first_events: tuple[Event, ...]
    batch_size: int
    custom_ops: dict[str, str]
    parameter_count: int
    trainable_parameter_count: int
    largest_tensor: tuple[int, str, str] = (0, "", "")  # (elements, op, module)
    largest_grid: tuple[int, str, str] = (0, "", "")  # (grid y/z extent, kernel, module)
    host_backed_bytes: int = 0  # paged optimizer state: unified memory, not device memory


def _expected_input(model: nn.Module) -> tuple[str, tuple[int, ...] | None]:
    """What the first layer wants, for error messages."""
    for module in model.modules():
        if isinstance(module, nn.modules.conv._ConvNd):
            dims = len(module.kernel_size)
            spatial = ("H", "W", "D")[:dims]
            return f"({module.in_channels}, {', '.join(spatial)})", None
        if isinstance(module, nn.Linear):
            return f"(..., {module.in_features})", None
        if isinstance(module, nn.Embedding):
            return f"integer token ids in [0, {module.num_embeddings})", None
        if isinstance(module, nn.RNNBase):
            return f"(seq_len, {module.input_size})", None
    return "", None


_SHAPE_WORDS = ("shape", "size", "dimension", "expected input", "mat1 and mat2", "channels",
                "must match", "out of range", "index out of", "dtype", "scalar type")


def _translate_error(exc: BaseException, tracer: Tracer, model: nn.Module, phase: Phase) -> Exception:
    from batchfit.errors import InputShapeError, ModelForwardError, UntraceableError

    module = tracer.failed_module if tracer.failed_module is not None else tracer.current_module()
    where = f"module '{module or '<root>'}'"
    op = tracer.failed_op
    at_op = f" at {op}" if op else ""
    first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
    if isinstance(exc, ti.DATA_DEPENDENT_ERRORS):
        return UntraceableError(
            f"{where}{at_op} needs tensor values (data-dependent output), which a fake trace "
            f"cannot know: make the shape static (e.g. pad to a fixed size) or pass a factory "
            f"that avoids .item()/nonzero in forward", module, op)
    if isinstance(exc, ti.UNSUPPORTED_OP_ERRORS):
        return UntraceableError(
            f"{where}{at_op}: the op has no fake-tensor implementation (a custom kernel?): "
            f"register one with torch.library.register_fake, or replace the op", module, op)
    if phase in (Phase.FORWARD, Phase.LOSS):
        text = first_line.lower()
        if isinstance(exc, (RuntimeError, ValueError, IndexError)) and any(
                w in text for w in _SHAPE_WORDS):
            wanted, expected = _expected_input(model)
            hint = f"; the first layer expects per-sample input {wanted}" if wanted else ""
            return InputShapeError(
                f"input does not fit the model in {where}{at_op}: {first_line}{hint}",
                module, op, expected)
        return ModelForwardError(
            f"the model's forward raised {type(exc).__name__} in {where}{at_op}: {first_line}",
            module, op)
    return ModelForwardError(
        f"the {phase.value} phase raised {type(exc).__name__} in {where}{at_op}: {first_line}",
        module, op)


class StepTransform(Protocol):
    """Another way to build and run the traced step: one rank of a sharded step.

    :mod:`batchfit.sharding` implements it (DDP, FSDP, DeepSpeed ZeRO, tensor parallel):
    :func:`trace_step` enters :meth:`session` around the whole trace, builds the module
    with :meth:`build` while the tracer records (so memory created or freed while
    wrapping is seen), calls :meth:`attach` once the step's runner exists and, with
    :attr:`whole_steps`, :meth:`before_step` before each of the two traced steps.
    """

    def session(self) -> contextlib.AbstractContextManager[Any]:
        """The process-wide state the trace needs (a fake process group), undone after."""

    def build(self, meta_model: nn.Module, fake_mode: Any, tracer: Tracer,
              float_dtype: torch.dtype | None, checkpointing: bool) -> nn.Module:
        """The module the step runs, with fake tensors, from a model built on meta (or the
        user's module, which must not be changed: copy it)."""

    def watched(self, module: nn.Module) -> nn.Module:
        """The module whose submodules name memory (DDP's wrapped module)."""

    def attach(self, runner: Any, tracer: Tracer) -> None:
        """Set up what the step needs once its runner (and optimizer) exist."""

    def before_step(self, index: int) -> None:
        """Called before traced training step ``index`` (0: the first, 1: the steady)."""

    def finish(self, trace: StepTrace) -> StepTrace:
        """The trace as the device sees it (an offload takes host memory off it)."""

    #: True: trace two whole training steps (DDP rebuilds its buckets in the second;
    #: DeepSpeed's engine runs its own optimizer). False: one forward and backward, and
    #: the optimizer on meta twins of the (local, sharded) parameters, as for one GPU.
    whole_steps: bool


class TraceReuse:
    """What repeated traces of one model and config (at other batch sizes) can share.

    The model is built on meta once, and the optimizer phase, whose events do not
    depend on the batch size, is traced once and spliced into later traces.
    Use one instance per (model, config, device).
    """

    def __init__(self) -> None:
        self.meta_model: nn.Module | None = None
        self.workload_model: Any = None  # (model, quant attributes) with the workload applied
        self.keras: tuple[Any, Any] | None = None  # a Keras model on meta, and its targets
        self.optimizer_first: tuple[Event, ...] | None = None  # creates the state
        self.optimizer_steady: tuple[Event, ...] | None = None
        self.host_backed_bytes = 0

    def build_model(self, model: Any, config: Any = None) -> None:
        """Build a factory's model on meta now, not at the first trace: a worker forked
        after this inherits it instead of building its own (ResNet-50: ~0.15 s). With an
        LLM workload in ``config``, apply it too (quantization, peft: seconds for an 8B
        model); the config's precision sets a Keras model's dtype policy."""
        with ti.preserved_global_state():
            if config is not None and config.workload is not None:
                _workload_model(model, config, self)
            else:
                _meta_model(model, self, None if config is None else config.precision.value)


def _meta_model(model: Any, reuse: TraceReuse | None, precision: str | None = None) -> Any:
    """The model to copy from: the user's module, or the factory's output built once."""
    from batchfit.engine.fake import build_on_meta

    if reuse is None or isinstance(model, nn.Module) or not callable(model):
        return model
    if reuse.meta_model is None:
        reuse.meta_model = build_on_meta(model, precision)
    return reuse.meta_model


def _workload_model(model: Any, config: Any, reuse: TraceReuse | None) -> tuple[Any, dict]:
    """The meta model with ``config``'s LLM workload applied (quantized, prepared, adapted),
    and the bitsandbytes attributes a fake copy of it must get back; built once per reuse.

    The base weights are cast to the precision's weight dtype first: that is the dtype a
    checkpoint is loaded in before quantization (``from_pretrained(torch_dtype=...)``).
    """
    from batchfit.engine.fake import build_on_meta, meta_copy
    from batchfit.engine.spec import Mode
    from batchfit.engine.step import torch_dtype
    from batchfit.engine.workloads.build import apply_workload
    from batchfit.engine.workloads.quantstate import quant_attributes
    from batchfit.engine.workloads.spec import LossKind

    if reuse is not None and reuse.workload_model is not None:
        return reuse.workload_model
    if isinstance(model, nn.Module):
        meta = meta_copy(model)
    elif reuse is not None:
        meta = _meta_model(model, reuse)
        reuse.meta_model = None  # transformed in place below; not reusable raw
    else:
        meta = build_on_meta(model)
    weight_dtype = config.precision.weight_dtype
    if weight_dtype != "float32":
        meta = meta.to(torch_dtype(weight_dtype))
    transformed = apply_workload(meta, config.workload, precision=config.precision,
                                 checkpointing=config.checkpointing,
                                 use_reentrant=config.use_reentrant,
                                 training=config.mode is Mode.TRAIN)
    if config.loss is LossKind.CHUNKED:
        from batchfit.engine.workloads.runtime import apply_chunked_loss

        apply_chunked_loss(transformed)
    built = (transformed, quant_attributes(transformed) if config.quant is not None else {})
    if reuse is not None:
        reuse.workload_model = built
    return built


def _workload_checkpointing(config: Any) -> bool:
    """Whether the workload already turned checkpointing on (peft's
    ``prepare_model_for_kbit_training`` does, with the given ``use_reentrant``)."""
    return config.quant is not None and config.quant.prepare


@old_objects_frozen()
def trace_step(model: Any, inputs: Any, batch_size: int, config: Any, device: Any,
               reuse: TraceReuse | None = None,
               transform: StepTransform | None = None) -> StepTrace:
    """Trace one step of ``model`` at ``batch_size`` on fake tensors.

    Args:
        model: an ``nn.Module`` (never modified) or a zero-argument factory.
        inputs: a per-sample input spec (see :func:`batchfit.engine.step.normalize_input_spec`).
        batch_size: the batch size.
        config: a :class:`batchfit.engine.spec.TrainConfig`.
        device: a :class:`batchfit.device.profile.DeviceProfile`.
        reuse: share work between traces of the same model at other batch sizes.
        transform: builds and runs the step another way (one rank of a sharded step,
            :mod:`batchfit.sharding`); with its ``whole_steps`` two whole training steps
            are traced, the second being the steady one.
    """
    from batchfit.engine.fake import enable_checkpointing, fake_copy
    from batchfit.engine.spec import Mode
    from batchfit.engine.step import (
        StepRunner,
        make_batch,
        normalize_input_spec,
        torch_dtype,
    )
    from batchfit.errors import BatchfitError, InvalidInputError

    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise InvalidInputError(f"batch size must be a positive integer, not {batch_size!r}")
    from batchfit.engine.fake import build_on_meta
    from batchfit.engine.keras_step import is_keras_model

    workload = config.workload
    base, owned = None, False
    if workload is None:  # a workload's model is built (and transformed) by _workload_model
        with ti.preserved_global_state():
            base = _meta_model(model, reuse, config.precision.value)
            owned = not isinstance(base, nn.Module) and callable(base)  # a factory, no reuse
            if owned:
                base = build_on_meta(base, config.precision.value)
    if base is not None and is_keras_model(base):
        return _trace_keras_step(base, base is model, inputs, batch_size, config, device, reuse)
    spec = normalize_input_spec(inputs)
    precision = config.precision
    float_dtype = None if precision.weight_dtype == "float32" else torch_dtype(precision.weight_dtype)
    training = config.mode is Mode.TRAIN
    fake_mode = ti.new_fake_mode()
    if workload is not None and workload.loss.value == "chunked" and not device.is_cuda:
        raise InvalidInputError(
            "--loss chunked is Liger-Kernel's fused cross-entropy, whose Triton kernels run "
            "on GPUs only: use a GPU target (--gpu NAME) or --loss standard")
    if workload is not None and transform is not None:
        raise InvalidInputError(
            "LLM workloads (--lora, --quant, --loss chunked) are not traced under a sharding "
            "strategy yet: drop --strategy/--world-size, or the workload options")
    session = transform.session() if transform is not None else contextlib.nullcontext()
    with ti.preserved_global_state(), session:
        scratch = not device.is_cuda and getattr(device, "kernel_scratch", True)
        tracer = Tracer(in_op_scratch=scratch, cuda_target=device.is_cuda, device=device,
                        fake_mode=fake_mode)
        quant_state: list[torch.Tensor] = []
        if transform is not None:
            source = base
            try:
                with fake_mode, tracer:
                    twin = transform.build(source, fake_mode, tracer, float_dtype,
                                           config.checkpointing and training)
            except BatchfitError:
                raise
            except Exception as exc:
                raise _translate_error(exc, tracer, source, Phase.SETUP) from exc
        elif workload is None:
            twin = fake_copy(base, fake_mode, float_dtype=float_dtype,
                             channels_last=config.channels_last, owned=owned)
        else:
            from batchfit.engine.workloads.quantstate import install_fake_quant_state

            source, attributes = _workload_model(model, config, reuse)
            twin = fake_copy(source, fake_mode, channels_last=config.channels_last)
            quant_state = install_fake_quant_state(twin, attributes, fake_mode, device.is_cuda)
        if transform is None and config.checkpointing and training and not (
                workload is not None and _workload_checkpointing(config)):
            enable_checkpointing(twin, config.use_reentrant)
        params = list(twin.parameters())
        # storages made while building (a transform's) are retagged, others registered
        record = tracer.register if transform is None else tracer.retag
        for p in params:
            record(p, Category.PARAMETERS)
        for t in quant_state:  # absmax blocks, code books: part of the stored weights
            tracer.register(t, Category.PARAMETERS)
        for b in twin.buffers():
            record(b, Category.BUFFERS)
        generator = torch.Generator().manual_seed(0)
        with fake_mode:
            batch = make_batch(spec, batch_size, float_dtype, generator, config.channels_last)
        for t in ti.iter_tensors(batch):
            tracer.register(t, Category.INPUTS)
        emulation = None
        if device.is_cuda:
            from batchfit.engine.cuda_emulation import CudaEmulation

            amp = precision.autocast_dtype
            emulation = CudaEmulation(device.compute_capability,
                                      autocast_dtype=torch_dtype(amp) if amp else None)
            autocast = emulation.autocast_region if amp else None
            emulation.where = tracer.current_module
        elif precision.autocast_dtype:
            amp_dtype = torch_dtype(precision.autocast_dtype)
            autocast = lambda: torch.autocast("cpu", dtype=amp_dtype)  # noqa: E731
        else:
            autocast = None
        with fake_mode:
            runner = StepRunner(twin, config, batch, autocast=autocast,
                                foreach=True if device.is_cuda else False,
                                on_phase=lambda name: setattr(tracer, "phase", Phase(name)),
                                generator=generator,
                                on_paged=tracer.host_backed if device.is_cuda else None)
        _register_scaler(tracer, runner)
        grad_hooks = [p.register_post_accumulate_grad_hook(
            lambda q: tracer.retag(q.grad, Category.GRADIENTS)) for p in params if p.requires_grad]
        tracer.watch_module(transform.watched(twin) if transform is not None else twin)
        setup_end = len(tracer.events)
        marks: list[int] = []
        emulation_ctx = emulation if emulation is not None else contextlib.nullcontext()
        try:
            with fake_mode, emulation_ctx, tracer, _library_context(config, device):
                if transform is not None:
                    transform.attach(runner, tracer)
                whole_steps = training and (not config.grads_to_none or (
                    transform is not None and transform.whole_steps))
                if transform is not None and whole_steps:
                    for index in range(2):  # the first creates state, the second is steady
                        transform.before_step(index)
                        runner.train_step()
                        _retag_optimizer_state(runner, tracer)
                        marks.append(len(tracer.events))
                elif training and not config.grads_to_none:
                    # gradients survive into the next step: trace two whole steps
                    runner.forward_backward()
                    runner.optimizer_step()
                    marks.append(len(tracer.events))
                    runner.train_step()
                elif training:
                    runner.forward_backward()
                    if config.grad_accum_steps > 1:
                        # a later micro-batch runs with the earlier ones' gradients live
                        runner.forward_backward()
                    marks.append(len(tracer.events))
                else:
                    runner.infer_step()
                end = len(tracer.events)
            optimizer_events = None
            if training and not whole_steps and (reuse is None or reuse.optimizer_first is None):
                optimizer_events = _trace_optimizer_on_meta(params, config, device, emulation,
                                                            tracer)
                if optimizer_events is None:  # it cannot run on meta tensors: on the fake twin
                    with fake_mode, emulation_ctx, tracer, _library_context(config, device):
                        _trace_optimizer(runner, tracer, marks)
                        end = len(tracer.events)
        except BatchfitError:
            raise
        except Exception as exc:  # noqa: BLE001 - translated into one clear line
            raise _translate_error(exc, tracer, twin, tracer.phase) from exc
        finally:
            for hook in grad_hooks:
                hook.remove()
    events = tracer.events
    if reuse is not None and tracer.host_backed_bytes:
        reuse.host_backed_bytes = tracer.host_backed_bytes
    host_backed = tracer.host_backed_bytes or (reuse.host_backed_bytes if reuse else 0)
    if training and whole_steps:
        first = tuple(events[:marks[0]])
        steady = _as_setup(alive_at_end(first)) + tuple(events[marks[0]:end])
    elif training:
        fwd_bwd_end = marks[0]
        if reuse is not None and reuse.optimizer_first is not None:
            opt_first, opt_steady = reuse.optimizer_first, reuse.optimizer_steady
        elif optimizer_events is not None:
            opt_first, opt_steady = optimizer_events
            if reuse is not None:
                reuse.optimizer_first, reuse.optimizer_steady = opt_first, opt_steady
        else:
            opt_first = tuple(events[fwd_bwd_end:marks[1]])
            opt_steady = tuple(events[marks[1]:end])
            if reuse is not None:
                reuse.optimizer_first, reuse.optimizer_steady = opt_first, opt_steady
        first = tuple(events[:fwd_bwd_end]) + opt_first
        steady = (tuple(events[:setup_end]) + _as_setup(alive_at_end(opt_first))
                  + tuple(events[setup_end:fwd_bwd_end]) + opt_steady)
    else:
        first = steady = tuple(events[:end])
    traced = StepTrace(
        steady_events=steady, first_events=first, batch_size=batch_size,
        custom_ops=dict(tracer.custom_ops),
        parameter_count=sum(p.numel() for p in params),
        trainable_parameter_count=sum(p.numel() for p in params if p.requires_grad),
        largest_tensor=tracer.largest,
        largest_grid=emulation.largest_grid if emulation is not None else (0, "", ""),
        host_backed_bytes=host_backed)
    return transform.finish(traced) if transform is not None else traced


def _library_context(config: Any, device: Any) -> Any:
    """What the libraries must be told while the step runs on fake tensors: transformers'
    value-dependent mask decisions answered as on the real batch, and the workload's own
    (the chunked loss's kernel launches; bitsandbytes' CUDA dispatch)."""
    from batchfit.engine.workloads.hfcompat import real_batch_decisions

    stack = contextlib.ExitStack()
    stack.enter_context(real_batch_decisions(packing=config.packing))
    if config.workload is not None:
        from batchfit.engine.workloads.runtime import workload_runtime

        stack.enter_context(workload_runtime(config, device))
    return stack


def _register_scaler(tracer: Tracer, runner: Any) -> None:
    """The grad scaler's scale and growth tracker exist before the step (amp-fp16)."""
    if runner.scaler is not None:
        tracer.register(runner.scaler.scale, Category.OPTIMIZER_STATE)
        tracer.register(runner.scaler.growth_tracker, Category.OPTIMIZER_STATE)


def _prepared_keras(base: Any, is_users: bool, inputs: Any, config: Any,
                    reuse: TraceReuse | None) -> tuple[Any, Any, Any]:
    """(Keras model on meta, ready to trace; its input spec; its target spec), prepared
    once per :class:`TraceReuse`. The user's own Keras model is never traced: a copy of
    its architecture is built on meta and compiled as it is."""
    from batchfit.engine import keras_step
    from batchfit.engine.fake import build_on_meta
    from batchfit.engine.step import normalize_input_spec
    from batchfit.errors import InvalidInputError

    if reuse is not None and reuse.keras is not None:
        meta, targets = reuse.keras
    else:
        keras_step.check_torch_backend()
        meta = base
        if is_users:
            meta = build_on_meta(keras_step.clone_factory(base), config.precision.value)
        with ti.preserved_global_state(), keras_step.build_scope("meta"):
            keras_step.compile_if_needed(meta, config.optimizer)
            spec = inputs if inputs is not None else keras_step.input_spec(meta)
            if spec is None:
                raise InvalidInputError(
                    "the Keras model declares no fixed input shape (a subclassed model, or "
                    "an Input with a free dimension): give the per-sample input")
            targets = keras_step.target_specs(meta, normalize_input_spec(spec))
            keras_step.prepare(meta, normalize_input_spec(spec), targets)
        if reuse is not None:
            reuse.keras = (meta, targets)
    spec = inputs if inputs is not None else keras_step.input_spec(meta)
    return meta, normalize_input_spec(spec), targets


def _trace_keras_step(base: Any, is_users: bool, inputs: Any, batch_size: int, config: Any,
                      device: Any, reuse: TraceReuse | None) -> StepTrace:
    """:func:`trace_step` for a Keras 3 model: Keras's own ``train_step`` once, on its
    variables rebound to fake tensors (:mod:`batchfit.engine.keras_step`), starting from
    the steady state: optimizer and metric state built (as ``fit`` builds them before its
    first step) and the previous step's gradients alive (Keras frees them only after the
    next forward pass). The first step is the same events without those gradients: it
    differs from the steady one in nothing else, so one step is traced, not two (a
    ResNet-50 step is 17,000 fake dispatches). Keras's mixed precision is its own, so no
    autocast is added; on a CUDA target the rest of the CUDA emulation (attention
    kernels, the decomposed ops) applies as for any model."""
    from batchfit.engine import keras_step
    from batchfit.engine.spec import Mode
    from batchfit.errors import BatchfitError

    meta, spec, targets = _prepared_keras(base, is_users, inputs, config, reuse)
    training = config.mode is Mode.TRAIN
    fake_mode = ti.new_fake_mode()
    tracer = Tracer(in_op_scratch=not device.is_cuda, cuda_target=device.is_cuda)
    emulation = None
    if device.is_cuda:
        from batchfit.engine.cuda_emulation import CudaEmulation

        emulation = CudaEmulation(device.compute_capability, autocast_dtype=None)
        emulation.where = tracer.current_module
    with ti.preserved_global_state(), keras_step.fake_variables(meta, fake_mode) as state:
        roles = ((Category.PARAMETERS, state.trainable), (Category.BUFFERS, state.non_trainable),
                 (Category.OPTIMIZER_STATE, state.optimizer), (Category.BUFFERS, state.metrics))
        for category, variables in roles:
            for variable in variables:
                tracer.register(variable.value, category)
        generator = torch.Generator().manual_seed(0)
        with fake_mode:
            batch = keras_step.make_data(spec, targets, batch_size, generator)
            if training:  # the last step's, alive until Keras's zero_grad after forward
                for variable in state.trainable:
                    variable.value.grad = torch.zeros_like(variable.value)
        for t in ti.iter_tensors(batch):
            tracer.register(t, Category.INPUTS)
        for variable in state.trainable:
            if variable.value.grad is not None:
                tracer.register(variable.value.grad, Category.GRADIENTS)
        setup_end = len(tracer.events)
        runner = keras_step.KerasStepRunner(
            meta, config, batch, mark_phases=True,
            on_phase=lambda name: setattr(tracer, "phase", Phase(name)))
        grad_hooks = [v.value.register_post_accumulate_grad_hook(
            lambda q: tracer.retag(q.grad, Category.GRADIENTS)) for v in state.trainable]
        tracer.watch_module(meta, keras_step.layer_paths(meta))
        emulation_ctx = emulation if emulation is not None else contextlib.nullcontext()
        try:
            with fake_mode, emulation_ctx, tracer, keras_step.trace_device(device.is_cuda), \
                    keras_step.garbage_collected_per_layer(meta):
                if training:
                    runner.train_step()
                else:
                    runner.infer_step()
                end = len(tracer.events)
        except BatchfitError:
            raise
        except Exception as exc:  # noqa: BLE001 - translated into one clear line
            raise _translate_error(exc, tracer, meta, tracer.phase) from exc
        finally:
            for hook in grad_hooks:
                hook.remove()
            del runner, batch
        counts = ([v.value.numel() for v in state.trainable],
                  [v.value.numel() for v in state.non_trainable])
    steady = tuple(tracer.events[:end])
    first = steady
    if training:  # the same step without the last step's gradients
        keys = {e.key for e in steady[:setup_end] if e.category is Category.GRADIENTS}
        first = tuple(e for e in steady if e.key not in keys)
    return StepTrace(
        steady_events=steady, first_events=first, batch_size=batch_size,
        custom_ops=dict(tracer.custom_ops),
        parameter_count=sum(counts[0]) + sum(counts[1]),
        trainable_parameter_count=sum(counts[0]),
        largest_tensor=tracer.largest,
        largest_grid=emulation.largest_grid if emulation is not None else (0, "", ""))


def _trace_optimizer(runner: Any, tracer: Tracer, marks: list[int]) -> None:
    """The first optimizer step (creates the state), then a steady one."""
    runner.optimizer_step()
    _retag_optimizer_state(runner, tracer)
    marks.append(len(tracer.events))
    runner.optimizer_step()


def _retag_optimizer_state(runner: Any, tracer: Tracer) -> None:
    """The optimizer's state, made by its first step, is optimizer state from then on."""
    optimizer = runner.optimizer
    states = getattr(optimizer, "state", None)
    if not isinstance(states, dict):
        return
    for state in states.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                tracer.retag(value, Category.OPTIMIZER_STATE)


def _trace_optimizer_on_meta(params: list[torch.Tensor], config: Any, device: Any,
                             emulation: Any, tracer: Tracer
                             ) -> tuple[tuple[Event, ...], tuple[Event, ...]] | None:
    """The optimizer phase of :func:`_trace_optimizer`, run on meta twins of the trained
    parameters and their gradients instead of on the fake ones.

    The phase depends only on the parameters' and gradients' shapes, dtypes and strides
    (never on the batch), and a meta tensor carries exactly those. A meta op goes straight
    to its meta kernel, where a fake op first builds, hashes and looks up a cache key. With
    amp-fp16 AdamW on an RTX 3090 profile the phase took 0.15 s instead of 0.52 s for
    ResNet-50 and 0.05 s instead of 0.18 s for ResNet-18 (medians of 4), and its events
    are the same (kind, bytes, category, op, phase, module) for all 8 optimizers in 4
    precisions, on CPU and CUDA targets (tests/test_estimate.py checks this), but one:
    step counts are real CPU scalars here, as in a real step, so on a CUDA target they
    are host memory and not counted, where the fake twin (all CPU) cannot tell them
    from device tensors. The tracer's largest tensor and custom ops are merged in.

    Returns (first step, steady step), or None when the optimizer cannot run on meta
    tensors (``fused=True`` asks for a real device; a custom optimizer may read values;
    sparse gradients): the caller then traces the phase on the fake twin.
    """
    from torch import nn

    from batchfit.engine.step import StepRunner

    trained = [p for p in params if p.requires_grad]
    if any(p.grad is not None and p.grad.layout is not torch.strided for p in trained):
        return None
    twins = []
    for param in trained:
        # a DTensor (sharded) parameter's optimizer runs on its local shard
        p = ti.local_tensor(param)
        grad = param.grad
        twin = nn.Parameter(torch.empty_strided(p.shape, p.stride(), dtype=p.dtype,
                                                device="meta"))
        if grad is not None:
            g = ti.local_tensor(grad)
            if g.shape != p.shape:  # a DTensor gradient placed unlike its parameter (tensor
                return None  # parallel): the optimizer redistributes it, on the fake twin
            twin.grad = torch.empty_strided(g.shape, g.stride(), dtype=g.dtype, device="meta")
        twins.append(twin)
    # On a GPU, what an optimizer makes without a device (Adam's, Adagrad's, RMSprop's and
    # Adafactor's step counts, unless capturable or fused) is host memory: here it is a
    # real CPU tensor beside the meta ones, and not counted. On a CPU target it counts.
    meta_tracer = Tracer(in_op_scratch=tracer.in_op_scratch,
                         device_type="meta" if device.is_cuda else None, device=device)
    try:
        runner = StepRunner(nn.ParameterList(twins), config, ((), {}),
                            foreach=bool(device.is_cuda),
                            on_phase=lambda name: setattr(meta_tracer, "phase", Phase(name)),
                            on_paged=meta_tracer.host_backed if device.is_cuda else None)
    except Exception:  # noqa: BLE001 - the fake twin's trace reports it
        return None
    for twin in twins:
        meta_tracer.register(twin, Category.PARAMETERS)
        if twin.grad is not None:
            meta_tracer.register(twin.grad, Category.GRADIENTS)
    _register_scaler(meta_tracer, runner)
    start = len(meta_tracer.events)
    marks = [start]
    if emulation is not None:
        where, emulation.where = emulation.where, meta_tracer.current_module
    try:
        with emulation if emulation is not None else contextlib.nullcontext(), meta_tracer:
            _trace_optimizer(runner, meta_tracer, marks)
    except Exception:  # noqa: BLE001 - see above
        return None
    finally:
        if emulation is not None:
            emulation.where = where
    if meta_tracer.largest[0] > tracer.largest[0]:
        tracer.largest = meta_tracer.largest
    tracer.host_backed_bytes += meta_tracer.host_backed_bytes
    for op, module in meta_tracer.custom_ops.items():
        tracer.custom_ops.setdefault(op, module)
    events = meta_tracer.events
    return tuple(events[start:marks[1]]), tuple(events[marks[1]:])


def _as_setup(events: tuple[Event, ...]) -> tuple[Event, ...]:
    """Allocations carried into the steady step: they exist before it starts."""
    return tuple(replace(e, phase=Phase.SETUP) for e in events)


def alive_at_end(events: Sequence[Event]) -> tuple[Event, ...]:
    """Allocations in ``events`` still alive at the end, with their latest category."""
    alive: dict[int, Event] = {}
    category: dict[int, Category] = {}
    for event in events:
        if event.kind is EventKind.ALLOC:
            alive[event.key] = event
            category[event.key] = event.category
        elif event.kind is EventKind.FREE:
            alive.pop(event.key, None)
        else:
            category[event.key] = event.category
    return tuple(Event(EventKind.ALLOC, e.key, e.nbytes, category[e.key], e.module, e.op,
                       e.phase) for e in alive.values())
