"""Preparers: what turns the user's model into the fake module a traced step runs.

The step driver (:mod:`batchfit.engine.driver`) asks :func:`module_preparer` for one
:class:`ModulePreparer` and runs whatever it prepares:

* :class:`PlainModule`: the user's module or a factory's, built on meta once, as a fake copy;
* :class:`WorkloadModule`: the same with an LLM workload applied (quantized, prepared,
  adapted: :func:`workload_model`);
* :class:`ShardedModule`: one rank of a sharding strategy, built by its
  :class:`StepTransform` (:mod:`batchfit.sharding`) while the tracer records.

A Keras model has its own step and is prepared by
:func:`batchfit.engine.keras_trace.prepared_keras`. :class:`TraceReuse` holds what
repeated traces of one model share.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from batchfit.engine import _torch_internals as ti
from batchfit.engine.spec import TrainConfig
from batchfit.engine.step_trace import StepTrace, translate_error
from batchfit.engine.target import Target
from batchfit.engine.tracer import Event, Phase, Tracer


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

    def build_model(self, model: Any, config: TrainConfig | None = None) -> None:
        """Build a factory's model on meta now, not at the first trace: a worker forked
        after this inherits it instead of building its own (ResNet-50: ~0.15 s). With an
        LLM workload in ``config``, apply it too (quantization, peft: seconds for an 8B
        model); the config's precision sets a Keras model's dtype policy."""
        with ti.preserved_global_state():
            if config is not None and config.workload is not None:
                workload_model(model, config, self)
            else:
                meta_model(model, self, None if config is None else config.precision.value)


def meta_model(model: Any, reuse: TraceReuse | None, precision: str | None = None) -> Any:
    """The model to copy from: the user's module, or the factory's output built once."""
    from batchfit.engine.fake import build_on_meta

    if reuse is None or isinstance(model, nn.Module) or not callable(model):
        return model
    if reuse.meta_model is None:
        reuse.meta_model = build_on_meta(model, precision)
    return reuse.meta_model


def workload_model(model: Any, config: TrainConfig, reuse: TraceReuse | None) -> tuple[Any, dict]:
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
    from batchfit.engine.workloads.recipes import Recipe
    from batchfit.engine.workloads.spec import LossKind

    if reuse is not None and reuse.workload_model is not None:
        return reuse.workload_model
    if isinstance(model, nn.Module):
        meta = meta_copy(model)
    elif reuse is not None:
        meta = meta_model(model, reuse)
        reuse.meta_model = None  # transformed in place below; not reusable raw
    else:
        meta = build_on_meta(model)
    weight_dtype = config.precision.weight_dtype
    if weight_dtype != "float32":
        meta = meta.to(torch_dtype(weight_dtype))
    transformed = apply_workload(meta, config.workload, precision=config.precision,
                                 checkpointing=config.checkpointing,
                                 use_reentrant=config.reentrant,
                                 training=config.mode is Mode.TRAIN)
    if config.loss is LossKind.CHUNKED:
        from batchfit.engine.workloads.runtime import apply_chunked_loss

        apply_chunked_loss(transformed)
    if config.loss in (LossKind.NATIVE, LossKind.CHUNKED_OUTPUT):
        from batchfit.engine.workloads.losses import apply_framework_loss

        apply_framework_loss(transformed, config.loss)
    if config.transformers_version is not None:
        from batchfit.engine.workloads.hfloss import apply_transformers_loss

        apply_transformers_loss(transformed, config.transformers_version)
    if config.recipe is Recipe.LITGPT and config.mode is Mode.TRAIN:
        from batchfit.engine.workloads.litgpt import fabric_logits

        fabric_logits(transformed, chunked=config.loss is LossKind.NATIVE)
    built = (transformed, quant_attributes(transformed) if config.quant is not None else {})
    if reuse is not None:
        reuse.workload_model = built
    return built


def workload_checkpointing(config: TrainConfig) -> bool:
    """Whether the workload already turned checkpointing on (peft's
    ``prepare_model_for_kbit_training`` does, with the given ``use_reentrant``)."""
    return config.quant is not None and config.quant.prepare


class StepTransform(Protocol):
    """Another way to build and run the traced step: one rank of a sharded step.

    :mod:`batchfit.sharding` implements it (DDP, FSDP, DeepSpeed ZeRO, tensor parallel):
    :func:`~batchfit.engine.driver.drive_step` enters :meth:`session` around the whole trace, builds the module
    with :meth:`build` while the tracer records (so memory created or freed while
    wrapping is seen), calls :meth:`attach` once the step's runner exists and, with
    :attr:`whole_steps`, :meth:`before_step` before each of the two traced steps.
    """

    def session(self) -> contextlib.AbstractContextManager[Any]:
        """The process-wide state the trace needs (a fake process group), undone after."""

    def build(self, meta_model: nn.Module, fake_mode: Any, tracer: Tracer,
              float_dtype: torch.dtype | None, checkpointing: bool,
              reentrant: bool) -> nn.Module:
        """The module the step runs, with fake tensors, from a model built on meta (or the
        user's module, which must not be changed: copy it); ``reentrant``: the
        checkpointing variant (:attr:`~batchfit.engine.spec.TrainConfig.reentrant`)."""

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


@dataclass
class PreparedModule:
    """The fake module a step runs, and how its storages came to be."""

    module: nn.Module
    #: quantized weights' state outside the parameters (absmax blocks, code books)
    stored_weights: list[torch.Tensor] = field(default_factory=list)
    #: built while the tracer recorded: its storages are known and only change category
    built_under_tracer: bool = False


class ModulePreparer(Protocol):
    """Turns the model into the fake module the traced step runs."""

    def prepare(self, fake_mode: Any, tracer: Tracer, float_dtype: torch.dtype | None,
                training: bool) -> PreparedModule:
        """The module, with fake tensors, in ``float_dtype`` (None: as built)."""


@dataclass
class PlainModule:
    """A fake copy of the model built on meta (``owned``: built for this trace alone, so
    it may be consumed), with activation checkpointing if the config asks."""

    base: nn.Module
    owned: bool
    config: TrainConfig

    def prepare(self, fake_mode: Any, tracer: Tracer, float_dtype: torch.dtype | None,
                training: bool) -> PreparedModule:
        from batchfit.engine.fake import enable_checkpointing, fake_copy

        twin = fake_copy(self.base, fake_mode, float_dtype=float_dtype,
                         channels_last=self.config.channels_last, owned=self.owned)
        if self.config.checkpointing and training:
            enable_checkpointing(twin, self.config.reentrant)
        return PreparedModule(twin)


@dataclass
class WorkloadModule:
    """The model with the config's LLM workload applied (:func:`workload_model`), as a
    fake copy with its quantization state; checkpointing as the config asks, unless the
    workload's preparation turned it on already."""

    model: Any
    config: TrainConfig
    device: Target
    reuse: TraceReuse | None

    def prepare(self, fake_mode: Any, tracer: Tracer, float_dtype: torch.dtype | None,
                training: bool) -> PreparedModule:
        from batchfit.engine.fake import enable_checkpointing, fake_copy
        from batchfit.engine.workloads.quantstate import install_fake_quant_state
        from batchfit.engine.workloads.torchtune_build import builds_on_device, record_build

        source, attributes = workload_model(self.model, self.config, self.reuse)
        twin = fake_copy(source, fake_mode, channels_last=self.config.channels_last)
        stored = install_fake_quant_state(twin, attributes, fake_mode, self.device.is_cuda)
        if self.device.is_cuda and builds_on_device(self.config):
            record_build(twin, tracer, self.config.torchtune_version)
        if self.config.checkpointing and training and not workload_checkpointing(self.config):
            enable_checkpointing(twin, self.config.reentrant)
        return PreparedModule(twin, stored)


@dataclass
class ShardedModule:
    """One rank of a sharding strategy: its :class:`StepTransform` builds (and wraps) the
    module while the tracer records, so memory made or freed while wrapping is seen."""

    base: nn.Module
    transform: StepTransform
    config: TrainConfig

    def prepare(self, fake_mode: Any, tracer: Tracer, float_dtype: torch.dtype | None,
                training: bool) -> PreparedModule:
        from batchfit.errors import BatchfitError

        try:
            with fake_mode, tracer:
                twin = self.transform.build(self.base, fake_mode, tracer, float_dtype,
                                            self.config.checkpointing and training,
                                            self.config.reentrant)
        except BatchfitError:
            raise
        except Exception as exc:
            raise translate_error(exc, tracer, self.base, Phase.SETUP) from exc
        return PreparedModule(twin, built_under_tracer=True)


def module_preparer(model: Any, base: Any, owned: bool, config: TrainConfig, device: Target,
                    reuse: TraceReuse | None, transform: StepTransform | None
                    ) -> ModulePreparer:
    """The preparer for this step: ``base`` is the model built on meta (None with an LLM
    workload, which builds its own from ``model``)."""
    from batchfit.errors import InvalidInputError

    workload = config.workload
    if workload is not None and workload.loss.value == "chunked" and not device.is_cuda:
        raise InvalidInputError(
            "--loss chunked is Liger-Kernel's fused cross-entropy, whose Triton kernels run "
            "on GPUs only: use a GPU target (--gpu NAME) or --loss standard")
    if workload is not None and transform is not None:
        raise InvalidInputError(
            "LLM workloads (--lora, --quant, --loss chunked) are not traced under a sharding "
            "strategy yet: drop --strategy/--world-size, or the workload options")
    if transform is not None:
        return ShardedModule(base, transform, config)
    if workload is not None:
        return WorkloadModule(model, config, device, reuse)
    return PlainModule(base, owned, config)
