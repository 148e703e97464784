"""The tracer: every storage allocation and free of a step on fake tensors, tagged with
its category, module, op and phase, as :class:`Event` records (the engine's vocabulary, read by
the device replay and every answer). :func:`batchfit.engine.trace.trace_step` drives it.

The tracer watches storages, not tensors: views share their base's storage, and a
storage is freed when its last tensor dies (a weakref callback on the storage).
Parameters, buffers, inputs and optimizer state are registered up front; every
other storage is created by an aten op seen by a dispatch mode below autograd, so
the tensors autograd saves for backward are exactly the ones still alive.

Known limitations:
    * Memory allocated inside a kernel and freed before it returns (library
      workspaces, oneDNN scratch) is invisible unless :mod:`batchfit.engine.kernels`
      (CPU) or :mod:`batchfit.engine.cudnn` (benchmark mode) models it; on CUDA the
      libraries' fixed workspaces are in :mod:`batchfit.device.profile`.
    * Custom ops with a fake implementation are traced by their outputs only; a
      warning names them.
"""

from __future__ import annotations

import contextlib
import itertools
import sys
from dataclasses import dataclass
from enum import IntEnum, StrEnum
from typing import Any, Sequence

import torch
from torch import nn

from batchfit.engine import _torch_internals as ti
from batchfit.engine.cudnn import (
    benchmark_workspace_bytes,
    input_copy_bytes,
    is_routed_to_cudnn,
    search_key,
)
from batchfit.engine.kernels import (
    decomposition_for,
    input_copies_for,
    input_copy_op,
    is_outputs_only,
    scalar_reads_allowed,
    scratch_for,
    size_fix_for,
)
from batchfit.engine.limits import RULES as LIMIT_RULES
from batchfit.engine.limits import KernelLimit, check_op, worst
from batchfit.engine.target import Target

#: The ops a benchmarked cuDNN convolution's workspace is modelled for (engine/cudnn.py).
_CONVOLUTIONS = frozenset({"aten.convolution.default", "aten.convolution_backward.default"})


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
    #: the caching allocator empties its cache here if this is the first event with this
    #: key in the step (a cuDNN benchmark search: engine/cudnn.py); no storage, 0 bytes
    EMPTY_CACHE = 3


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
                 device_type: str | None = None, device: Target | None = None,
                 fake_mode: Any = None, stack: Any = None,
                 cudnn_benchmark: tuple[int, int] | None = None) -> None:
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
        #: the launch nearest its kernel's hard limit (CUDA targets: a stack is given)
        self.kernel_limit: KernelLimit | None = None
        self._stack = stack if cuda_target else None
        #: the target's compute capability when convolutions run cuDNN's benchmark mode
        self._cudnn_benchmark = cudnn_benchmark if cuda_target else None
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
        first_output = len(self.events)  # where copies made before the outputs go
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
        copies = input_copies_for(func, cuda=self._cuda_target)
        before, after = copies(args) if copies is not None else (0, 0)
        if self._stack is not None and (name := str(func)) in LIMIT_RULES:
            outputs = [t for t in ti.iter_tensors(out) if isinstance(t, torch.Tensor)]
            where = module if module is not None else self.current_module()
            self.kernel_limit = worst(self.kernel_limit, check_op(
                name, args, outputs, self._stack, where))
            before += input_copy_bytes(name, args, self._stack)
            if self._cudnn_benchmark is not None and name in _CONVOLUTIONS:
                self._add_cudnn_workspace(name, args, outputs, where)
        if before or after:
            where = module if module is not None else self.current_module()
            # Copied before the outputs (and a workspace) are allocated, or after them;
            # both die when the call returns.
            copied = [self._input_copy(nbytes, where, func, at) for nbytes, at in
                      ((before, first_output), (after, None)) if nbytes]
            for alloc in copied:
                self.events.append(Event(EventKind.FREE, alloc.key, alloc.nbytes,
                                         alloc.category, alloc.module, alloc.op, self.phase))
        scratch = scratch_for(func) if self.in_op_scratch else None
        if scratch is not None and (nbytes := scratch(args)) > 0:
            uid = next(_UIDS)
            where = module if op is not None else self.current_module()
            for kind in (EventKind.ALLOC, EventKind.FREE):
                self.events.append(Event(kind, uid, nbytes, Category.TEMPORARIES, where or "",
                                         str(func), self.phase))

    def _add_cudnn_workspace(self, name: str, args: tuple, outputs: list[torch.Tensor],
                             where: str) -> None:
        """A benchmarked cuDNN convolution's search mark (torch >= 2.0) and workspace,
        allocated and freed in the call."""
        routed = is_routed_to_cudnn(name, args, self._stack)
        if routed and self._stack.cudnn_search_empties_cache:
            # the algorithm search that ends in emptyCache(), if this shape has none yet
            self.events.append(Event(EventKind.EMPTY_CACHE, search_key(name, args), 0,
                                     Category.TEMPORARIES, where,
                                     f"cudnn benchmark search ({name})", self.phase))
        nbytes = benchmark_workspace_bytes(name, args, outputs, self._cudnn_benchmark, routed,
                                           splits_batch=self._stack.cudnn_splits_batch)
        if nbytes > 0:
            self._in_call(nbytes, where, f"cudnn workspace ({name})")

    def _input_copy(self, nbytes: int, where: str, func: Any, at: int | None) -> Event:
        """The dense copy a kernel makes of a strided input (:func:`input_copy_bytes`,
        :func:`~batchfit.engine.kernels.input_copies_for`), allocated at event index ``at``
        (before the op's outputs, as the kernel copies first) or now; the caller frees it
        when the call returns."""
        alloc = Event(EventKind.ALLOC, next(_UIDS), nbytes, Category.TEMPORARIES, where or "",
                      input_copy_op(str(func), cuda=self._cuda_target), self.phase)
        if at is None:
            self.events.append(alloc)
        else:
            self.events.insert(at, alloc)
        return alloc

    def _in_call(self, nbytes: int, where: str, op: str) -> None:
        """A temporary a kernel call allocates and frees inside itself, with no tensor to
        stand for it (a cuDNN workspace; input copies: :meth:`_input_copy`)."""
        uid = next(_UIDS)
        for kind in (EventKind.ALLOC, EventKind.FREE):
            self.events.append(Event(kind, uid, nbytes, Category.TEMPORARIES, where, op,
                                     self.phase))

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
