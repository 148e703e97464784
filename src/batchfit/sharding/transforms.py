"""One rank's step under DDP, FSDP2 or tensor parallel, traced with torch's own classes.

Each transform implements :class:`batchfit.engine.trace.StepTransform`: it makes this
process rank ``r`` of a fake world (:mod:`batchfit.sharding.world`), wraps the model
with ``DistributedDataParallel``, FSDP2's ``fully_shard`` or DTensor's tensor parallel
(:func:`shard_model`, the same code a measured run uses), and lets
:func:`batchfit.engine.trace.trace_step` trace the step on fake tensors (DeepSpeed ZeRO:
:mod:`batchfit.sharding.zero`). Whatever the wrappers allocate
is traced as it happens, with its real lifetime: DDP's gradient buckets, FSDP's
all-gather outputs and gathered parameters (freed by resizing their storages to 0),
its reduce-scatter buffers and sharded gradients.

What the tensors are for is read from the wrappers' own ``record_function`` scopes
(the names torch's profiler shows):

* ``FSDP::all_gather``: the flat all-gather buffer (:attr:`Category.COMMUNICATION`);
* ``FSDP::all_gather_copy_out``: the gathered parameters
  (:attr:`Category.GATHERED_PARAMETERS`);
* ``FSDP::post_backward_reduce``: the reduce-scatter input and output
  (``COMMUNICATION``); the output becomes the sharded gradient (``GRADIENTS``) when
  FSDP hands it to the parameter (it calls the parameter's post-accumulate-grad hooks);
* DDP's buckets, allocated when the model is wrapped (and again when DDP rebuilds them
  in the order gradients became ready, at a second step), are ``COMMUNICATION``, or
  ``GRADIENTS`` with ``gradient_as_bucket_view``.

Adapters for the fake process group (each the least that lets torch's code run; none
allocates device memory): DDP's construction-time check that every rank's parameters
have the same shapes reads tensor data and is skipped; DDP's built-in all-reduce hook
expects the collective's future to carry the bucket, which a fake collective's does not,
so a Python hook does what the built-in one does (divide the bucket in place, all-reduce
it, return it); DDP's bucket rebuild exchanges the new bucket order in a small int32 CPU
tensor it reads back, which runs on real tensors.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from batchfit.engine import _torch_internals as ti
from batchfit.engine.fake import enable_checkpointing, fake_twin, meta_copy
from batchfit.engine.spec import Precision
from batchfit.engine.tracer import Category, Tracer
from batchfit.sharding.layout import Offload, Parallelism, Strategy
from batchfit.sharding.world import World, fake_world
from batchfit.sharding.wrap import sharded_units

_RF_ENTER = torch.ops.profiler._record_function_enter_new.default
_RF_EXIT = torch.ops.profiler._record_function_exit._RecordFunction
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

#: Categories of the storages FSDP creates inside its scopes (see the module docstring).
#: The innermost scope that is listed decides.
_FSDP_SCOPES = {
    "FSDP::all_gather": Category.COMMUNICATION,
    "FSDP::all_gather_copy_out": Category.GATHERED_PARAMETERS,
    "FSDP::post_backward_reduce": Category.COMMUNICATION,
    # FSDP1 (torch/distributed/fsdp/_runtime_utils.py): unsharding gathers the padded flat
    # parameter; the post-backward hook reduce-scatters the flat gradient
    "FullyShardedDataParallel._pre_forward": Category.GATHERED_PARAMETERS,
    "FullyShardedDataParallel._pre_backward_hook": Category.GATHERED_PARAMETERS,
    "FullyShardedDataParallel._pre_forward_prefetch": Category.GATHERED_PARAMETERS,
    "FullyShardedDataParallel._pre_backward_prefetch": Category.GATHERED_PARAMETERS,
    "FullyShardedDataParallel._post_backward_prefetch": Category.GATHERED_PARAMETERS,
    "FullyShardedDataParallel._post_backward_hook": Category.COMMUNICATION,
}


class _Scopes:
    """The ``record_function`` scopes open now, followed through the tracer's ops."""

    def __init__(self, categories: dict[str, Category]) -> None:
        self._categories = categories
        self._open: list[str] = []
        self.override: Category | None = None
        self.on_enter: Callable[[str, str], None] | None = None  # (scope, module path)
        self.on_exit: Callable[[str], None] | None = None

    def observe(self, func: Any, args: tuple, out: Any) -> None:
        # scopes are context managers, so they close in the reverse order they opened
        # (the handle an exit gets is another Python object than the one enter returned)
        if func is _RF_ENTER:
            name, _, fqn = str(args[0]).partition(" (")
            self._open.append(name)
            if self.on_enter is not None:
                self.on_enter(name, fqn[:-1])
        elif func is _RF_EXIT and self._open:
            name = self._open.pop()
            if self.on_exit is not None:
                self.on_exit(name)

    def category(self, func: Any) -> Category | None:
        if self.override is not None:
            return self.override
        for name in reversed(self._open):
            if name in self._categories:
                return self._categories[name]
        return None


class _Transform:
    """What every sharding transform shares: the fake world, resizes, scopes."""

    def __init__(self, layout: Parallelism, rank: int, precision: Precision) -> None:
        self.layout = layout
        self.rank = rank
        self.precision = precision
        self.world: World | None = None
        self.tracer: Tracer | None = None
        self.scopes = _Scopes(_FSDP_SCOPES)
        self.module: nn.Module | None = None

    @contextlib.contextmanager
    def session(self) -> Iterator[None]:
        layout = self.layout
        replicas = layout.nodes if layout.strategy is Strategy.HSDP else 1
        with fake_world(layout.world_size, self.rank, replicas=replicas,
                        tp=layout.tp) as world, ti.watching_resizes(self._on_resize), \
                ti.around_dtensor_shape_propagation(self._muted):
            self.world = world
            try:
                yield
            finally:
                self.world = None
                self.tracer = None

    def _muted(self) -> Any:
        return self.tracer.muted() if self.tracer is not None else contextlib.nullcontext()

    def _on_resize(self, storage: Any, nbytes: int) -> None:
        if self.tracer is not None:
            self.tracer.on_resize(storage, nbytes)

    def _follow(self, tracer: Tracer) -> None:
        self.tracer = tracer
        tracer.observers.append(self.scopes.observe)
        tracer.category_rule = self.scopes.category

    def watched(self, module: nn.Module) -> nn.Module:
        return module

    def attach(self, runner: Any, tracer: Tracer) -> None:
        pass

    def before_step(self, index: int) -> None:
        pass

    def finish(self, trace: Any) -> Any:
        return trace


# ---------------------------------------------------------------------------------- DDP


class DDPTransform(_Transform):
    """``DistributedDataParallel`` on one fake rank (``bucket_cap_mb``,
    ``gradient_as_bucket_view`` from the layout).

    One forward and backward with the optimizer on meta twins, as for one GPU: DDP's
    second step differs from its first only by rebuilding its buckets in the order the
    gradients became ready (same total size; on the test models the same peak to the
    byte). When two whole steps are traced (gradients kept between steps), the rebuild
    runs before the second (:meth:`before_step`)."""

    whole_steps = False

    def build(self, meta_model: nn.Module, fake_mode: Any, tracer: Tracer,
              float_dtype: torch.dtype | None, checkpointing: bool,
              reentrant: bool) -> nn.Module:
        import torch.nn.parallel.distributed as ddp_module

        self._follow(tracer)
        twin = fake_twin(meta_model, fake_mode, float_dtype, checkpointing, reentrant)
        self._bucket_kind = (Category.GRADIENTS if self.layout.gradient_as_bucket_view
                             else Category.COMMUNICATION)
        check = ddp_module._verify_param_shape_across_processes
        ddp_module._verify_param_shape_across_processes = lambda *args, **kwargs: None
        self.scopes.override = self._bucket_kind  # all DDP allocates here is a bucket
        try:
            ddp = shard_model(twin, self.layout, self.world, self.precision)
        finally:
            ddp_module._verify_param_shape_across_processes = check
            self.scopes.override = None
        ddp.register_comm_hook(self.layout.world_size, _allreduce_hook)
        self.module = ddp
        return ddp

    def watched(self, module: nn.Module) -> nn.Module:
        return module.module

    def before_step(self, index: int) -> None:
        if index != 1:
            return
        # DDP rebuilds its buckets at the start of the second step, in the order the
        # gradients became ready; the new buckets are allocated (and the old freed) here
        self.scopes.override = self._bucket_kind
        try:
            with _RealIntegers():
                self.module.reducer._rebuild_buckets()
        finally:
            self.scopes.override = None


def _allreduce_hook(world_size, bucket):  # no annotations: DDP checks that of bucket
    """What DDP's built-in all-reduce does to a bucket, returning the bucket itself (a
    fake collective's future carries nothing)."""
    import torch.distributed as dist

    buffer = bucket.buffer()
    buffer.div_(world_size)
    dist.all_reduce(buffer)
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(buffer)
    return future


class _RealIntegers(ti.TorchDispatchMode):
    """Run integer tensor ops on real CPU tensors (DDP's bucket-order exchange reads the
    values back); everything else goes on to the fake mode."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = list(ti.iter_tensors((args, kwargs)))
        integer = kwargs.get("dtype") in (torch.int32, torch.int64) if not tensors else all(
            not t.dtype.is_floating_point and not ti.is_fake(t) for t in tensors)
        if integer:
            with ti.no_dispatch_modes():
                return func(*args, **kwargs)
        return func(*args, **kwargs)


# ---------------------------------------------------------------------------------- FSDP2


def mixed_precision(layout: Parallelism, precision: Precision) -> tuple[Any, Any, bool]:
    """FSDP's ``(param_dtype, reduce_dtype, keep_autocast)`` for ``precision``.

    ``amp-bf16``/``bf16`` (and ``amp-fp16``/``fp16``) train with FSDP's
    ``MixedPrecisionPolicy``: layers compute in 16 bits on gathered 16-bit copies of
    the (fp32, for ``amp-*``) sharded parameters, and gradients are reduced in fp32 (the
    recipe of torchtitan and of torch's FSDP2 tutorial); there is then no autocast. An
    explicit ``param_dtype`` of float32 keeps fp32 parameters and the autocast region.
    """
    if layout.param_dtype is not None or layout.reduce_dtype is not None:
        param = _DTYPES.get(layout.param_dtype) if layout.param_dtype else None
        reduce = _DTYPES.get(layout.reduce_dtype) if layout.reduce_dtype else None
        keep = param in (None, torch.float32)
        return param, reduce, keep
    if precision is Precision.AMP_BF16:
        return torch.bfloat16, torch.float32, False
    if precision is Precision.AMP_FP16:
        return torch.float16, torch.float32, False
    if precision in (Precision.BF16, Precision.FP16):
        return None, torch.float32, True
    return None, None, True


class FSDP2Transform(_Transform):
    """FSDP2 (and tensor parallel) on one fake rank (:func:`shard_model`).

    The model is sharded on the meta device (outside the fake mode: a meta op there is a
    fake op, at ~40x the cost) and then given fake storage with ``to_empty``, FSDP2's
    documented way to shard a model too large to build: no full parameter ever exists.
    FSDP's lazy initialisation, which its first forward runs, runs here (it re-pads the
    last rank's short shards). The step is then one forward and backward, and the
    optimizer on meta twins of the local shards (the engine's single-GPU path): FSDP2's
    second step differs from its first only by that initialisation."""

    whole_steps = False

    def build(self, meta_model: nn.Module, fake_mode: Any, tracer: Tracer,
              float_dtype: torch.dtype | None, checkpointing: bool,
              reentrant: bool) -> nn.Module:
        self._follow(tracer)
        with ti.no_dispatch_modes():  # real meta tensors, not fake ones on the meta device
            model = meta_copy(meta_model, float_dtype)
            if checkpointing:
                enable_checkpointing(model, reentrant)
            shard_model(model, self.layout, self.world, self.precision)
        model.to_empty(device="cpu")
        self._groups = {}
        for module in model.modules():
            state = _fsdp_state(module)
            if state is not None:
                state._lazy_init()
                break
        for module in model.modules():
            state = _fsdp_state(module)
            if state is not None and state._fsdp_param_group is not None:
                group = state._fsdp_param_group
                self._groups[group._module_fqn or ""] = group
        self.scopes.on_enter = self._entered
        self.scopes.on_exit = self._exited
        self._copies: list[tuple[int, int]] = []
        self._offloaded_grads: set[int] = set()
        if self.layout.offload is Offload.PARAMS:
            for param in model.parameters():
                param.register_post_accumulate_grad_hook(self._offloaded)
        self.module = model
        return model

    def _entered(self, name: str, fqn: str) -> None:
        if self.tracer is None:
            return
        group = self._groups.get(fqn)
        states = group.fsdp_params if group is not None else ()
        if name == "FSDP::post_backward_reduce":
            # FSDP hands the unsharded gradients to the reduce-scatter: they are gradients
            for state in states:
                grad = getattr(getattr(state, "_unsharded_param", None), "grad", None)
                if grad is not None:
                    self.tracer.retag(grad, Category.GRADIENTS)
        elif name == "FSDP::all_gather" and self.layout.offload is Offload.PARAMS:
            # CPUOffloadPolicy: the unit's host shards are copied to the GPU to be gathered
            nbytes = sum(s._sharded_param_data.untyped_storage().nbytes() for s in states)
            from batchfit.sharding.offload import COPY_TO_DEVICE

            self._copies.append((self.tracer.transient(nbytes, Category.COMMUNICATION,
                                                       COPY_TO_DEVICE), nbytes))

    def _exited(self, name: str) -> None:
        if name == "FSDP::all_gather" and self._copies and self.tracer is not None:
            uid, nbytes = self._copies.pop()
            self.tracer.release(uid, nbytes, Category.COMMUNICATION)

    def _offloaded(self, param: nn.Parameter) -> None:
        if self.tracer is not None and param.grad is not None:
            self._offloaded_grads.update(self.tracer.uids(param.grad))

    def finish(self, trace: Any) -> Any:
        if self.layout.offload is not Offload.PARAMS:
            return trace
        from batchfit.engine.tracer import Phase
        from batchfit.sharding.offload import on_device

        return on_device(trace, categories=(Category.PARAMETERS, Category.OPTIMIZER_STATE),
                         phases=(Phase.OPTIMIZER,), leave_at_retag=self._offloaded_grads)


def _fsdp_state(module: nn.Module) -> Any:
    from torch.distributed.fsdp import FSDPModule

    return module._get_fsdp_state() if isinstance(module, FSDPModule) else None


class FSDP1Transform(_Transform):
    """FSDP1's ``FullyShardedDataParallel`` on one fake rank (flat parameters,
    ``use_orig_params=True``), wrapping the units of :func:`sharded_units`.

    FSDP1 flattens and shards a materialised module, so it wraps the fake twin (as DDP
    does); it frees and re-gathers its padded flat parameter by resizing storages. One
    forward and backward, the optimizer on meta twins of the local shards.

    ``CPUOffload(offload_params=True)`` (``offload="params"``) runs FSDP1's own offload
    code; what a CPU trace cannot see, because its compute device is the host, is added
    and taken off as on a GPU (:mod:`batchfit.sharding.fsdp1_offload`). With
    :attr:`host_is_device` the trace is that of a run whose compute device is the host
    (a real gloo run on this CPU, which checks it): nothing is added or taken off."""

    whole_steps = False
    #: True: trace the step as it runs when the compute device is the host (gloo on CPU).
    host_is_device = False

    @contextlib.contextmanager
    def session(self) -> Iterator[None]:
        with super().session(), ti.fake_storages_allocated_by_size():
            yield

    def build(self, meta_model: nn.Module, fake_mode: Any, tracer: Tracer,
              float_dtype: torch.dtype | None, checkpointing: bool,
              reentrant: bool) -> nn.Module:
        import warnings

        self._follow(tracer)
        mark = len(tracer.events)
        twin = fake_twin(meta_model, fake_mode, float_dtype, checkpointing, reentrant)
        offload = self.layout.offload is Offload.PARAMS and not self.host_is_device
        built: set[int] = set()
        if offload:
            # the model is built on the host (FSDP1 moves each unit's parameters to the GPU
            # as it wraps it, and the shard back: fsdp1_offload's module docstring); the
            # buffers it moves stay on the GPU
            from batchfit.engine.tracer import EventKind

            built = {e.key for e in tracer.events[mark:] if e.kind is EventKind.ALLOC}
            built |= {uid for p in twin.parameters() for uid in tracer.uids(p)}
            built -= {uid for b in twin.buffers() for uid in tracer.uids(b)}
        with warnings.catch_warnings():  # FSDP1 compares storage pointers (fake: 0)
            warnings.simplefilter("ignore", UserWarning)
            self.module = shard_model(twin, self.layout, self.world, self.precision)
        self._offload = None
        if offload:
            from batchfit.sharding.fsdp1_offload import HostOffload

            self._offload = HostOffload(self.module, tracer, built)
        return self.module

    def finish(self, trace: Any) -> Any:
        return self._offload.on_device(trace) if self._offload is not None else trace


def _fsdp1(model: nn.Module, layout: Parallelism, precision: Precision) -> nn.Module:
    import functools

    from torch.distributed.fsdp import (
        CPUOffload,
        FullyShardedDataParallel,
        MixedPrecision,
        ShardingStrategy,
    )
    from torch.distributed.fsdp.wrap import lambda_auto_wrap_policy

    units = {id(unit) for _, unit in sharded_units(model, layout.wrap)}
    policy = functools.partial(lambda_auto_wrap_policy, lambda_fn=lambda m: id(m) in units)
    param, reduce, _ = mixed_precision(layout, precision)
    strategy = (ShardingStrategy.FULL_SHARD if layout.resharded_after_forward
                else ShardingStrategy.SHARD_GRAD_OP)
    offload = layout.offload is Offload.PARAMS
    wrapped = FullyShardedDataParallel(
        model, auto_wrap_policy=policy, device_id=torch.device("cpu"), use_orig_params=True,
        sharding_strategy=strategy, cpu_offload=CPUOffload(offload_params=offload),
        mixed_precision=MixedPrecision(param_dtype=param, reduce_dtype=reduce)
        if param is not None or reduce is not None else None)
    if offload:
        from batchfit.sharding.fsdp1_offload import run_on_this_host

        run_on_this_host(wrapped)
    return wrapped


def _set_prefetch(units: list[nn.Module], count: int) -> None:
    if count <= 0:
        return
    for index, unit in enumerate(units):
        ahead = units[index + 1: index + 1 + count]
        behind = units[max(0, index - count): index][::-1]
        if ahead:
            unit.set_modules_to_forward_prefetch(ahead)
        if behind:
            unit.set_modules_to_backward_prefetch(behind)


def shard_model(model: nn.Module, layout: Parallelism, world: World,
                precision: Precision) -> nn.Module:
    """Apply ``layout`` to ``model`` with torch's classes, as a training script does: the
    same code shards the fake twin of a trace and the real model of a measured run.

    DDP returns the ``DistributedDataParallel`` wrapper; FSDP2 (and tensor parallel)
    shard ``model`` in place (``fully_shard`` of each :func:`sharded_units` unit and of
    the root, on the data-parallel mesh: 2-D for HSDP) and return it.
    """
    if layout.strategy is Strategy.DDP:
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, bucket_cap_mb=layout.bucket_cap_mb,
                                       gradient_as_bucket_view=layout.gradient_as_bucket_view)
    if layout.strategy is Strategy.FSDP1:
        return _fsdp1(model, layout, precision)
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    units = sharded_units(model, layout.wrap)
    if layout.tp > 1:
        from batchfit.sharding.tensor_parallel import parallelize

        parallelize(model, world.tp_mesh)
    if layout.data_parallel_size == 1 and layout.strategy is Strategy.TP:
        return model
    param, reduce, _ = mixed_precision(layout, precision)
    options: dict[str, Any] = {
        "mesh": world.dp_mesh,
        "reshard_after_forward": layout.resharded_after_forward,
        "mp_policy": MixedPrecisionPolicy(param_dtype=param, reduce_dtype=reduce),
    }
    if layout.offload is Offload.PARAMS:
        options["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
    for _, unit in units:
        fully_shard(unit, **options)
    fully_shard(model, **options)
    _set_prefetch([unit for _, unit in units], layout.prefetch)
    return model


def transform_for(layout: Parallelism, rank: int, precision: Precision) -> Any:
    """The :class:`~batchfit.engine.trace.StepTransform` of ``layout`` for ``rank``."""
    strategy = layout.strategy
    if strategy is Strategy.DDP:
        return DDPTransform(layout, rank, precision)
    if strategy.is_zero:
        from batchfit.sharding.zero import ZeroTransform

        return ZeroTransform(layout, rank, precision)
    if strategy is Strategy.FSDP1:
        return FSDP1Transform(layout, rank, precision)
    return FSDP2Transform(layout, rank, precision)
