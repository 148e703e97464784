"""DeepSpeed ZeRO 1, 2 and 3: DeepSpeed's own engine on one fake rank.

``deepspeed.initialize`` runs on the fake twin with torch's fake process group as its
communication backend, so the partitions it makes (ZeRO-1/2's flat 16-bit parameter
buffer and fp32 master partition; ZeRO-3's per-parameter partitions), its gradient
buckets (``reduce_bucket_size``, ``allgather_bucket_size``) and ZeRO-3's parameter
gathering (``stage3_prefetch_bucket_size``, ``stage3_max_live_parameters``,
``stage3_param_persistence_threshold``) are traced as DeepSpeed allocates them, with
their lifetimes; ``layout.deepspeed`` overrides any of these ``zero_optimization`` keys.
Two whole steps are traced (``engine.backward`` and ``engine.step``, which runs the
optimizer on the partitions).

Adapters for the fake world (none allocates device memory): the model's
``.to(device)`` (a fake parameter cannot be swapped in place, and the twin is already
where the trace runs) is skipped; ZeRO-3's check that every rank traced the same
submodules, an ``all_gather`` of their ids that a fake collective leaves unfilled, is
skipped; and the ``.item()`` of DeepSpeed's "is the gradient norm finite?" returns
False (the tracer's rule for a boolean in the optimizer phase).

What differs from a GPU: DeepSpeed runs here with its CPU accelerator (what it picks on a
machine without CUDA), so its CUDA-only paths are not taken: ``overlap_comm``'s side
streams and pinned host buffers. Offloading (``offload_optimizer``, ``offload_param``)
puts DeepSpeed's fp32 partitions, optimizer state and (ZeRO-3) parameters in host
memory: the storages DeepSpeed keeps there (found on its optimizer after the first step)
are taken off the device's events (:func:`host_storages`).

Precision: ``bf16``/``amp-bf16`` turn on DeepSpeed's ``bf16`` (16-bit parameters and
gradients, fp32 master weights in the optimizer), ``fp16``/``amp-fp16`` its ``fp16``
(with its loss scaler); ``fp32`` trains in fp32.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from batchfit.engine.spec import Precision
from batchfit.engine.tracer import Category, Tracer
from batchfit.sharding.layout import Offload, Parallelism


def deepspeed_config(layout: Parallelism, precision: Precision) -> dict[str, Any]:
    """The DeepSpeed config of ``layout`` (``layout.deepspeed`` merged into
    ``zero_optimization``)."""
    zero: dict[str, Any] = {"stage": layout.strategy.zero_stage}
    if layout.offload in (Offload.OPTIMIZER, Offload.PARAMS):
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
    if layout.offload is Offload.PARAMS:
        zero["offload_param"] = {"device": "cpu", "pin_memory": False}
    zero.update(layout.deepspeed)
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 1 << 30,
    }
    if precision in (Precision.BF16, Precision.AMP_BF16):
        config["bf16"] = {"enabled": True}
    elif precision in (Precision.FP16, Precision.AMP_FP16):
        config["fp16"] = {"enabled": True}
    return config


@contextlib.contextmanager
def deepspeed_environment(rank: int, world_size: int) -> Iterator[None]:
    """The environment DeepSpeed reads for its rank (restored after)."""
    names = {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": "0",
             "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    saved = {name: os.environ.get(name) for name in names}
    os.environ.update(names)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextlib.contextmanager
def _quiet_deepspeed() -> Iterator[None]:
    """DeepSpeed prints to stdout (its op builds) and logs warnings meant for a training
    job; a prediction's output is the user's (``--json`` is one object on stdout).

    Two more lines reach stderr from a trace and say nothing about it: importing
    DeepSpeed imports torch.utils.cpp_extension, which logs "No CUDA runtime is found"
    when CUDA_HOME has no runtime (nothing is compiled here), and ZeRO's partitioning
    asserts the alignment of ``data_ptr()`` (runtime/zero/stage_1_and_2.py), which torch
    warns about on a fake tensor (c10/core/StorageImpl.cpp)."""
    import io
    import logging
    import warnings

    from batchfit._logs import without_cuda_home_notice

    loggers = [logging.getLogger(name) for name in ("DeepSpeed", "deepspeed")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings(), \
                without_cuda_home_notice():
            warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
            yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


#: What importing DeepSpeed sets for the whole process (deepspeed/__init__.py:
#: ``os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")``).
_NVML_CHECK = "PYTORCH_NVML_BASED_CUDA_CHECK"


def _import_deepspeed() -> Any:
    """Import DeepSpeed (once per process, as any import) with torch's CUDA availability
    check left as it was before.

    Importing DeepSpeed sets ``PYTORCH_NVML_BASED_CUDA_CHECK=1`` for the process, so that
    its import-time probes ask NVML and create no CUDA context (DeepSpeed issue #7918).
    Left set, every later ``torch.cuda.is_available()`` asks NVML again (torch/cuda/
    __init__.py: ``device_count`` loads libnvidia-ml with ctypes and caches nothing before
    CUDA is initialized), and ``FakeTensorMode`` calls it whenever it is entered and on
    every op its cache misses (``avoid_device_init``, torch/_subclasses/fake_tensor.py): a
    trace paid hundreds of library loads, and so did every later trace in the process,
    sharded or not.

    The variable is set while DeepSpeed is imported and while it makes the two decisions
    that read it, which it then keeps for the process: its accelerator
    (``get_accelerator``, cached in ``real_accelerator.ds_accelerator``) and whether Triton
    is usable (``deepspeed.HAS_TRITON``, cached on first access). Then it is put back as
    the user had it, which is how every trace without DeepSpeed runs."""
    if "deepspeed" in sys.modules:
        return sys.modules["deepspeed"]
    saved = os.environ.get(_NVML_CHECK)
    os.environ.setdefault(_NVML_CHECK, "1")
    try:
        import deepspeed
        from deepspeed.accelerator import get_accelerator

        get_accelerator()
        deepspeed.HAS_TRITON  # noqa: B018 (computed and kept on first access)
    finally:
        if saved is None:
            os.environ.pop(_NVML_CHECK, None)
        else:
            os.environ[_NVML_CHECK] = saved
    return deepspeed


@contextlib.contextmanager
def _deepspeed_globals() -> Iterator[None]:
    """DeepSpeed keeps its process groups (and its communication backend) in module
    globals; a trace's groups die with its fake world, so they are put back after."""
    import copy

    import deepspeed.comm.comm as ds_comm
    import deepspeed.utils.groups as ds_groups

    saved = {name: copy.copy(value) for name, value in vars(ds_groups).items()
             if (name.startswith("_") and not name.startswith("__") and name.isupper())
             or name in ("mpu", "mesh_device")}
    backend = ds_comm.cdb
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(ds_groups, name, value)
        ds_comm.cdb = backend


#: What DeepSpeed replaces in torch and leaves replaced ("nn.functional.linear has been
#: overridden with a more memory efficient version. This will persist unless manually
#: reset", runtime/zero/partition_parameters.py): put back after a trace, so the
#: user's process (and later traces) run torch's own.
_TORCH_FUNCTIONS = (
    ("torch.nn.functional", "linear"), ("torch", "tensor"), ("torch", "empty"),
    ("torch", "zeros"), ("torch", "ones"), ("torch", "full"), ("torch", "arange"),
    ("torch", "eye"), ("torch", "randn"), ("torch.Tensor", "__new__"),
    ("torch.nn.Module", "apply"),
)


@contextlib.contextmanager
def _torch_functions_kept() -> Iterator[None]:
    import importlib

    def owner(path: str) -> Any:
        module, _, attribute = path.rpartition(".")
        if path in ("torch.Tensor", "torch.nn.Module"):
            return getattr(importlib.import_module(module), attribute)
        return importlib.import_module(path)

    missing = object()
    saved = [(owner(path), name, vars(owner(path)).get(name, missing))
             for path, name in _TORCH_FUNCTIONS]
    try:
        yield
    finally:
        for target, name, value in saved:
            if value is missing:  # inherited before: drop what DeepSpeed put on top
                if name in vars(target):
                    delattr(target, name)
            elif vars(target).get(name, missing) is not value:
                setattr(target, name, value)


def _no_shm_op() -> None:
    """What ``deepspeed.comm.torch.build_shm_op`` returns where there is no shared-memory
    op: DeepSpeed's backend then runs without one.

    With its CPU accelerator (the one it picks here), DeepSpeed's communication backend
    compiles and loads the ``deepspeed_shm_comm`` C++ extension when it starts
    (``TorchBackend.__init__``, deepspeed/comm/torch.py): a g++ build of two files the
    first time, and again whenever the extension cache was built with other flags. The
    op serves only ``inference_all_reduce`` (DeepSpeed inference's tensor parallelism),
    never a ZeRO training step, allocates no tensor, and does not exist on a GPU (only
    ``op_builder/cpu`` has a ``ShareMemCommBuilder``), so a ZeRO trace has no use for it.
    With ``LOCAL_SIZE`` equal to the world size in the environment it would also map a
    shared-memory segment and wait for the fake world's other ranks to map theirs."""
    return None


def initialize(runner: Any, layout: Parallelism, precision: Precision) -> Any:
    """Hand ``runner``'s model and optimizer to DeepSpeed; the runner then trains
    through DeepSpeed's engine. Returns the engine."""
    import deepspeed

    model = runner.model
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=runner.optimizer,
                                           config=deepspeed_config(layout, precision))
    runner.model = engine
    runner.engine = engine
    runner.scaler = None  # DeepSpeed scales fp16 losses itself
    return engine


class ZeroTransform:
    """DeepSpeed ZeRO on one fake rank (see the module docstring)."""

    whole_steps = True

    def __init__(self, layout: Parallelism, rank: int, precision: Precision) -> None:
        self.layout = layout
        self.rank = rank
        self.precision = precision
        self.engine: Any = None
        self.tracer: Tracer | None = None
        self._host: set[int] = set()

    @contextlib.contextmanager
    def session(self) -> Iterator[None]:
        with _quiet_deepspeed():
            _import_deepspeed()
            yield from self._session()

    def _session(self) -> Iterator[None]:
        import importlib

        import deepspeed.runtime.zero.partitioned_param_coordinator as coordinator

        from batchfit.sharding.world import fake_world

        # by name: the attribute ``deepspeed.comm.torch`` is torch itself
        ds_torch = importlib.import_module("deepspeed.comm.torch")

        check = coordinator.assert_ints_same_as_other_ranks
        coordinator.assert_ints_same_as_other_ranks = lambda *args, **kwargs: None
        build_shm_op = ds_torch.build_shm_op
        ds_torch.build_shm_op = _no_shm_op
        try:
            with deepspeed_environment(self.rank, self.layout.world_size), \
                    fake_world(self.layout.world_size, self.rank), _deepspeed_globals(), \
                    _torch_functions_kept():
                yield
        finally:
            coordinator.assert_ints_same_as_other_ranks = check
            ds_torch.build_shm_op = build_shm_op

    def build(self, meta_model: nn.Module, fake_mode: Any, tracer: Tracer,
              float_dtype: torch.dtype | None, checkpointing: bool,
              reentrant: bool) -> nn.Module:
        from batchfit.engine.fake import fake_twin
        from batchfit.engine.tracer import Phase

        self.tracer = tracer
        # DeepSpeed's offload checks each gradient for overflow during backward
        tracer.item_phases = tracer.item_phases | {Phase.BACKWARD}
        twin = fake_twin(meta_model, fake_mode, float_dtype, checkpointing, reentrant)
        twin.to = lambda *args, **kwargs: twin  # fake parameters cannot be swapped in place
        return twin

    def watched(self, module: nn.Module) -> nn.Module:
        return module

    def attach(self, runner: Any, tracer: Tracer) -> None:
        self.engine = initialize(runner, self.layout, self.precision)
        self._name_partitions(tracer)

    def before_step(self, index: int) -> None:
        if index == 1:
            self._name_partitions(self.tracer)

    def _name_partitions(self, tracer: Tracer) -> None:
        optimizer = self.engine.optimizer
        for category, tensors in zero_storages(optimizer).items():
            for tensor in tensors:
                tracer.retag(tensor, category)
        if self.layout.offload is not Offload.NONE:  # the fp32 partitions' gradients too
            for master in _tensors_in(getattr(optimizer, "single_partition_of_fp32_groups", ())):
                if master.grad is not None:
                    self._host.update(tracer.uids(master.grad))

    def finish(self, trace: Any) -> Any:
        if self.layout.offload is Offload.NONE:
            return trace
        from batchfit.engine.tracer import Phase
        from batchfit.sharding.offload import on_device

        categories = [Category.OPTIMIZER_STATE]
        if self.layout.offload is Offload.PARAMS:
            categories.append(Category.PARAMETERS)  # ZeRO-3 offload_param: the partitions
        return on_device(trace, categories=categories, phases=(Phase.OPTIMIZER,),
                         host=self._host)


#: Where DeepSpeed's ZeRO optimizers keep their partitions (runtime/zero/stage_1_and_2.py,
#: runtime/zero/stage3.py): attribute -> what it holds.
_ZERO_ATTRIBUTES = {
    "bit16_groups_flat": Category.PARAMETERS,  # ZeRO-1/2: the flat 16-bit parameters
    "fp16_partitioned_groups_flat": Category.PARAMETERS,  # ZeRO-3: this rank's partition
    "single_partition_of_fp32_groups": Category.OPTIMIZER_STATE,  # fp32 master partition
    "fp32_partitioned_groups_flat": Category.OPTIMIZER_STATE,
    "averaged_gradients": Category.GRADIENTS,
    "grads_in_partition": Category.GRADIENTS,
    "grad_partitions_flat_buffer": Category.GRADIENTS,
    "ipg_buffer": Category.COMMUNICATION,
}


def zero_storages(optimizer: Any) -> dict[Category, list[torch.Tensor]]:
    """The tensors a ZeRO optimizer keeps, by category (see :data:`_ZERO_ATTRIBUTES`)."""
    found: dict[Category, list[torch.Tensor]] = {}
    for name, category in _ZERO_ATTRIBUTES.items():
        value = getattr(optimizer, name, None)
        found.setdefault(category, []).extend(_tensors_in(value))
    inner = getattr(optimizer, "optimizer", None)
    for state in getattr(inner, "state", {}).values():
        found.setdefault(Category.OPTIMIZER_STATE, []).extend(
            v for v in state.values() if isinstance(v, torch.Tensor))
    return found


def _tensors_in(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors_in(v)]
    return []
