"""Every torch-private API batchfit touches lives here, so a torch upgrade touches one file.

Private pieces used: ``FakeTensorMode`` and its exceptions, ``TorchDispatchMode``,
``torch._C._current_autograd_node`` and autograd ``Node.metadata``, the traceable
tensor-subclass protocol (``__tensor_flatten__``, for DTensor), and
``torch.UntypedStorage.resize_`` (patched while a trace watches resizes, as torch's own
``MemTracker`` does); for the noise-scale hooks, the autograd engine's ``queue_callback``,
``torch._foreach_norm`` and GradScaler's ``_get_scale_async``.
"""

from __future__ import annotations

import contextlib
import functools
import random
import sys
import weakref
from typing import Any, Callable, Iterator

import torch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
    UnsupportedOperatorException,
)
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    is_traceable_wrapper_subclass,
    is_traceable_wrapper_subclass_type,
)
from torch.utils._pytree import tree_leaves

#: Exceptions a fake trace raises when an op's output depends on tensor data.
DATA_DEPENDENT_ERRORS: tuple[type[BaseException], ...] = (
    DataDependentOutputException,
    DynamicOutputShapeException,
)
#: Raised for ops that have no fake/meta implementation (custom kernels).
UNSUPPORTED_OP_ERRORS: tuple[type[BaseException], ...] = (UnsupportedOperatorException,)

try:  # symbolic-shape guards on data-dependent values (torch >= 2.1)
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    DATA_DEPENDENT_ERRORS += (GuardOnDataDependentSymNode,)
except ImportError:  # pragma: no cover - older torch
    pass

_MODULE_KEY = "batchfit.module"


def is_fake(tensor: Any) -> bool:
    """Whether ``tensor`` is a fake tensor."""
    from torch._subclasses.fake_tensor import is_fake as _is_fake

    return isinstance(tensor, torch.Tensor) and _is_fake(tensor)


def new_fake_mode() -> FakeTensorMode:
    """A fake mode that accepts real tensors met during the trace (constants, buffers)."""
    return FakeTensorMode(allow_non_fake_inputs=True)


def storage_key(tensor: torch.Tensor) -> tuple[int, Any] | None:
    """A stable identity of the tensor's storage, and the storage itself, or None.

    A wrapper subclass (DTensor) has no memory of its own: its inner tensors do
    (:func:`inner_tensors`), so it has no key.
    """
    if is_traceable_wrapper_subclass(tensor):
        return None
    try:
        storage = tensor.untyped_storage()
    except (RuntimeError, NotImplementedError):  # sparse, nested and other exotic layouts
        return None
    return storage._cdata, storage


def inner_tensors(tensor: torch.Tensor) -> Iterator[torch.Tensor]:
    """The plain tensors holding ``tensor``'s memory: itself, or the inner tensors of a
    wrapper subclass (a DTensor's local shard), recursively."""
    if not is_traceable_wrapper_subclass(tensor):
        yield tensor
        return
    names, _ = tensor.__tensor_flatten__()
    for name in names:
        inner = getattr(tensor, name)
        if isinstance(inner, torch.Tensor):  # DTensor also flattens its device mesh
            yield from inner_tensors(inner)


def clear_dtensor_caches() -> None:
    """Forget DTensor's cached sharding decisions and redistribution plans.

    They hold the device meshes they were made for, and a mesh names its process groups;
    an equal mesh of a later fake world would get the earlier world's (destroyed) groups
    back from the cache ("Could not resolve the process group registered under ...").
    """
    try:
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor import _redistribute
        from torch.distributed.tensor._sharding_prop import ShardingPropagator
    except ImportError:  # pragma: no cover - torch without DTensor
        return
    propagator = DTensor._op_dispatcher.sharding_propagator
    for cache in (getattr(propagator, "propagate_op_sharding", None),
                  getattr(ShardingPropagator, "_propagate_tensor_meta_cached", None),
                  getattr(_redistribute, "_gen_transform_infos", None)):
        if hasattr(cache, "cache_clear"):
            cache.cache_clear()
    clear_plans = getattr(_redistribute, "clear_redistribute_planner_cache", None)
    if clear_plans is not None:
        clear_plans()


@contextlib.contextmanager
def around_dtensor_shape_propagation(wrap: Callable[[], Any]) -> Iterator[None]:
    """Run DTensor's output-shape propagation inside the context ``wrap()`` returns.

    To learn an op's output shape DTensor runs the op on fake tensors of the active fake
    mode (``ShardingPropagator._propagate_tensor_meta_non_cached``); in a trace that mode
    is the trace's own, so those throwaway tensors would look like allocations. Patched
    for the block, restored after.
    """
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    original = ShardingPropagator._propagate_tensor_meta_non_cached

    def propagate(self: Any, *args: Any, **kwargs: Any) -> Any:
        with wrap():
            return original(self, *args, **kwargs)

    ShardingPropagator._propagate_tensor_meta_non_cached = propagate  # type: ignore[method-assign]
    try:
        yield
    finally:
        ShardingPropagator._propagate_tensor_meta_non_cached = original  # type: ignore[method-assign]


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (its first inner tensor); any other tensor itself."""
    return next(inner_tensors(tensor), tensor)


@contextlib.contextmanager
def fake_storages_allocated_by_size() -> Iterator[None]:
    """FSDP1 asks whether a storage is allocated by its data pointer
    (``torch.distributed.utils._data_ptr_allocated``, imported by
    ``torch/distributed/fsdp/_flat_param.py``; its ``SHARD_GRAD_OP`` asserts it of the
    unsharded flat parameter it kept after forward). A fake storage's pointer is 0; within
    the block a fake tensor's storage is allocated when its size is not 0 (FSDP1 frees by
    ``resize_(0)``), and a real one's answer is unchanged."""
    from torch._subclasses.fake_tensor import is_fake
    from torch.distributed.fsdp import _flat_param

    original = _flat_param._data_ptr_allocated

    def allocated(tensor: torch.Tensor) -> bool:
        if is_fake(tensor):
            return tensor.untyped_storage().size() > 0
        return original(tensor)

    _flat_param._data_ptr_allocated = allocated
    try:
        yield
    finally:
        _flat_param._data_ptr_allocated = original


@contextlib.contextmanager
def watching_resizes(on_resize: Callable[[Any, int], None]) -> Iterator[None]:
    """Call ``on_resize(storage, nbytes)`` after every ``UntypedStorage.resize_``.

    FSDP frees and re-allocates the memory of its gathered parameters by resizing their
    storages in place (``free_storage``/``alloc_storage`` in
    ``torch/distributed/fsdp/_fully_shard/_fsdp_param.py``; FSDP1's
    ``_free_storage``), which no dispatch mode sees: like torch's ``MemTracker``
    (``_track_resize``) the method is patched for the block, and restored after.
    """
    original = torch.UntypedStorage.resize_

    def resize_(storage: Any, size: int) -> Any:
        result = original(storage, size)
        on_resize(storage, int(size))
        return result

    torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.UntypedStorage.resize_ = original  # type: ignore[method-assign]


def watch_storage(storage: Any, on_free: Callable[[], None]) -> Any:
    """Call ``on_free`` when ``storage`` dies. Returns the weakref, which must be kept."""
    return weakref.ref(storage, lambda _ref: on_free())


def current_backward_module() -> str | None:
    """Dotted module path of the autograd node running now, if it was tagged in forward."""
    node = torch._C._current_autograd_node()
    if node is None:
        return None
    return node.metadata.get(_MODULE_KEY)


def tag_graph(outputs: Any, module_path: str) -> None:
    """Tag every untagged autograd node that produced ``outputs`` with ``module_path``.

    Forward hooks fire innermost module first, so a node is claimed by the innermost
    module that produced it; the walk stops at nodes that are already tagged.
    """
    stack = [t.grad_fn for t in tree_leaves(outputs)
             if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    while stack:
        node = stack.pop()
        metadata = node.metadata
        if _MODULE_KEY in metadata:
            continue
        metadata[_MODULE_KEY] = module_path
        stack.extend(nxt for nxt, _ in node.next_functions if nxt is not None)


#: Returned by an :class:`OpInterceptor` shortcut: run the op as usual.
RUN = object()


class OpInterceptor(TorchDispatchMode):
    """Calls ``on_output(func, args, output)`` after every aten op (below autograd).

    ``shortcut(func, args)``: a value to return instead of running the op, or
    :data:`RUN` to run it (a fake trace's ops whose effect cannot matter).
    ``run(func, args, kwargs)``: the op's output computed another way (the caller
    vouches it is the same), or :data:`RUN`; ``on_output`` sees it as usual.
    """

    def __init__(self, on_output: Callable[[Any, tuple, Any], None],
                 on_error: Callable[[Any, BaseException], None],
                 shortcut: Callable[[Any, tuple], Any] | None = None,
                 run: Callable[[Any, tuple, dict], Any] | None = None):
        super().__init__()
        self._on_output = on_output
        self._on_error = on_error
        self._shortcut = shortcut
        self._run = run

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(is_traceable_wrapper_subclass_type(t) for t in types):
            # A DTensor op: let DTensor run it as ops on its local tensors, which this
            # mode then sees (as torch's MemTracker does).
            return NotImplemented
        if self._shortcut is not None:
            value = self._shortcut(func, args)
            if value is not RUN:
                return value
        kwargs = kwargs or {}
        out = self._run(func, args, kwargs) if self._run is not None else RUN
        if out is not RUN:
            self._on_output(func, args, out)
            return out
        try:
            out = func(*args, **kwargs)
        except BaseException as exc:
            self._on_error(func, exc)
            raise
        self._on_output(func, args, out)
        return out


#: Ops whose fake-tensor path is a Python decomposition from ``torch._decomp`` (they
#: have no meta kernel): FakeTensorMode runs the decomposition on fake tensors, so each
#: of its ~10-40 sub-ops pays a fake dispatch (cache key, lookup, and on a miss the
#: meta kernel). The same decomposition on plain meta tensors is ~3x faster (native
#: batch norm at 553x256x56x56: ~17 ms fake, ~3-5 ms meta). Their decompositions read
#: the device only to treat the CPU apart (batch norm's saved statistics: CUDA keeps
#: them in float32 and, in eval, of the running statistics' shape), so a meta twin
#: behaves as a CUDA tensor does; :class:`MetaTwins` serves CUDA targets only. All
#: return fresh tensors and mutate nothing (checked against the schemas in tests).
_ON_META_TWINS = (
    "native_batch_norm", "native_batch_norm_backward", "_native_batch_norm_legit_no_training",
    "cudnn_batch_norm", "cudnn_batch_norm_backward", "native_layer_norm_backward",
    "native_group_norm_backward", "threshold_backward", "gelu_backward", "silu_backward",
    "sigmoid_backward", "tanh_backward", "hardswish_backward", "hardsigmoid_backward",
    "leaky_relu_backward", "elu_backward", "mish_backward", "_softmax_backward_data",
    "_log_softmax_backward_data", "_log_softmax", "addmm", "nll_loss_forward",
    "nll_loss_backward", "mse_loss", "mse_loss_backward",
    "_to_copy",  # autocast's casts; a copy to another device has a device argument: runs fake
)


@functools.cache
def meta_twin_ops() -> frozenset[Any]:
    """The ``.default`` overloads of :data:`_ON_META_TWINS` this torch has."""
    found = set()
    for name in _ON_META_TWINS:
        packet = getattr(torch.ops.aten, name, None)
        overload = getattr(packet, "default", None) if packet is not None else None
        if overload is not None:
            found.add(overload)
    return frozenset(found)


class _Unhandled(Exception):
    """An argument :class:`MetaTwins` does not key on: the op runs as usual."""


#: Plain argument types a key holds by value (a ``torch.device`` is not one: an op
#: told a device runs on the fake tensors).
_PLAIN = (bool, int, float, str, torch.dtype, torch.memory_format, torch.layout)


class MetaTwins:
    """Runs the ops in :func:`meta_twin_ops` of a fake trace on meta twins, as the
    CUDA device would run them (use it for traces of a CUDA target only).

    The twins have the fake tensors' sizes, strides and dtypes; the op runs on them
    with every mode off (its decomposition then calls meta kernels directly), and its
    outputs come back as fake tensors on the fake device, with the sizes, strides,
    storage offsets, storage sizes and storage sharing the meta run gave. The recipe
    for the outputs is kept per (op, argument signature), so a layer shape met again
    costs one rebuild. Anything it does not expect (a real or meta tensor among the
    arguments, mixed devices or modes, symbolic sizes, an output that aliases an
    input, an op that fails on meta) runs the op on the fake tensors as before. Tests
    check the outputs against the fake path's, op by op and trace by trace.
    """

    def __init__(self, limit: int = 4096) -> None:
        self._recipes: dict[tuple, Any] = {}
        self._limit = limit

    def __call__(self, func: Any, args: tuple, kwargs: dict) -> Any:
        if func not in meta_twin_ops():
            return RUN
        fakes: list[Any] = []
        try:
            key = (func, _signature(args, fakes), _signature(tuple(kwargs.items()), fakes))
            hash(key)
        except (_Unhandled, TypeError):
            return RUN
        if not fakes:
            return RUN
        mode, device = fakes[0].fake_mode, fakes[0].fake_device
        if any(t.fake_mode is not mode or t.fake_device != device for t in fakes):
            return RUN
        recipe = self._recipes.get(key)
        if recipe is None:
            if len(self._recipes) >= self._limit:
                self._recipes.clear()
            recipe = self._recipes[key] = _meta_recipe(func, args, kwargs)
        if recipe is False:
            return RUN
        return _rebuild(recipe, mode, device)


def _signature(value: Any, fakes: list[Any]) -> Any:
    from torch._subclasses.fake_tensor import FakeTensor

    if isinstance(value, FakeTensor):
        fakes.append(value)
        return (tuple(value.shape), value.stride(), value.storage_offset(), value.dtype)
    if isinstance(value, torch.Tensor):
        raise _Unhandled
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, *(_signature(v, fakes) for v in value))
    if value is None or isinstance(value, _PLAIN):
        return (type(value).__name__, value)
    raise _Unhandled


def _meta_recipe(func: Any, args: tuple, kwargs: dict) -> Any:
    """How to rebuild ``func``'s outputs: (single, storage sizes, per-output layout),
    or False when they cannot be rebuilt (not fresh tensors, or the op failed)."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.utils._pytree import tree_map_only

    twins: list[torch.Tensor] = []

    def twin(t: Any) -> torch.Tensor:
        made = torch.empty_strided(tuple(t.shape), t.stride(), dtype=t.dtype, device="meta")
        twins.append(made)
        return made

    try:
        with no_dispatch_modes(), torch._C.DisableTorchFunction():
            meta_args, meta_kwargs = tree_map_only(FakeTensor, twin, (args, kwargs))
            out = func(*meta_args, **meta_kwargs)
    except Exception:  # noqa: BLE001 - the fake path runs it, and raises its own error
        return False
    single = isinstance(out, torch.Tensor)
    outputs = (out,) if single else out
    if not isinstance(outputs, (tuple, list)):
        return False
    taken = {t.untyped_storage()._cdata for t in twins}
    storages: dict[int, int] = {}
    sizes: list[int] = []
    layouts: list[Any] = []
    for t in outputs:
        if t is None:
            layouts.append(None)
            continue
        if not isinstance(t, torch.Tensor) or not t.is_meta:
            return False
        storage = t.untyped_storage()
        if storage._cdata in taken:
            return False
        if storage._cdata not in storages:
            storages[storage._cdata] = len(sizes)
            sizes.append(storage.nbytes())
        layouts.append((storages[storage._cdata], tuple(t.shape), t.stride(),
                        t.storage_offset(), t.dtype))
    return single, tuple(sizes), tuple(layouts)


def _rebuild(recipe: Any, mode: Any, device: torch.device) -> Any:
    from torch._subclasses.fake_tensor import FakeTensor

    single, sizes, layouts = recipe
    with no_dispatch_modes():
        storages = [torch.empty(n, dtype=torch.uint8, device="meta").untyped_storage()
                    for n in sizes]
        outputs = []
        for layout in layouts:
            if layout is None:
                outputs.append(None)
                continue
            index, shape, stride, offset, dtype = layout
            meta = torch.empty(0, dtype=dtype, device="meta").set_(storages[index], offset,
                                                                    shape, stride)
            outputs.append(FakeTensor(mode, meta, device))
    return outputs[0] if single else tuple(outputs)


#: Multi-tensor kernels that update their inputs in place and return nothing.
_IN_PLACE_MULTI_TENSOR = ("_foreach_", "_fused_", "_amp_foreach_")


@functools.cache
def _in_place_multi_tensor(func: Any) -> bool:
    schema = getattr(func, "_schema", None)
    if schema is None or schema.returns:
        return False
    name = schema.name.split("::")[-1]
    return name.startswith(_IN_PLACE_MULTI_TENSOR) and name.endswith("_")


def skippable_in_fake_trace(func: Any, args: tuple) -> bool:
    """An in-place multi-tensor op with no result (``_foreach_add_``, ``_fused_adamw_``)
    whose tensors are all arrays.

    It allocates no tensor, so a fake trace loses nothing by not running it; under fake
    tensors each costs one fake dispatch per tensor in its lists (161 for ResNet-50's
    AdamW), a sizeable share of a trace's time (``benchmarks/trace_speed.py``).
    Ops that touch a scalar (0-d) tensor
    still run: a fake scalar can keep its value, and later code reads it (Adam's step
    counts, whose bias correction divides by ``1 - beta ** step``; the grad scaler's
    ``found_inf``, which decides whether the optimizer steps at all). The ops that return
    results (``_foreach_sqrt``) allocate, and always run.
    """
    if not _in_place_multi_tensor(func):
        return False
    return all(t.dim() > 0 for t in iter_tensors(args))


def no_dispatch_modes():
    """Run real kernels from inside a trace: no fake mode, no interceptor."""
    from torch.utils._python_dispatch import _disable_current_modes

    return _disable_current_modes()


def iter_tensors(value: Any) -> Iterator[torch.Tensor]:
    for leaf in tree_leaves(value):
        if isinstance(leaf, torch.Tensor):
            yield leaf


@contextlib.contextmanager
def preserved_global_state() -> Iterator[None]:
    """Restore torch's global state (grad mode, default dtype, CPU RNG) and the ``random``
    and numpy (if imported) RNG states after the block: a model's constructor may draw
    from any of them."""
    grad_enabled = torch.is_grad_enabled()
    default_dtype = torch.get_default_dtype()
    rng = torch.get_rng_state()
    py_rng = random.getstate()
    numpy = sys.modules.get("numpy")
    np_rng = numpy.random.get_state() if numpy is not None else None
    try:
        yield
    finally:
        torch.set_grad_enabled(grad_enabled)
        torch.set_default_dtype(default_dtype)
        torch.set_rng_state(rng)
        random.setstate(py_rng)
        if np_rng is not None:
            numpy.random.set_state(np_rng)


def queue_autograd_callback(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the current backward pass ends, after the callbacks queued
    before it (DDP queues its gradient reduction this way). Call it during backward.

    ``Variable._execution_engine.queue_callback``: DDP, FSDP and AdaptDL rely on it.
    """
    _ENGINE.queue_callback(callback)


_ENGINE = torch.autograd.Variable._execution_engine


def foreach_norms(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each tensor's L2 norm in float32 (0-d tensors), in one call per list of tensors on
    one device: ``torch._foreach_norm``, what ``clip_grad_norm_`` uses."""
    return list(torch._foreach_norm(tensors, 2, dtype=torch.float32))


def grad_scaler_scale(grad_scaler: Any) -> torch.Tensor | float:
    """A GradScaler's current scale without a device sync (a copy, since ``update()``
    changes it in place), from the private ``_get_scale_async``; else ``get_scale()``."""
    async_scale = getattr(grad_scaler, "_get_scale_async", None)
    scale = async_scale() if async_scale is not None else None
    if isinstance(scale, torch.Tensor):
        return scale.detach().clone()
    return float(grad_scaler.get_scale())
