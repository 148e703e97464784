"""Preparing the model a step runs: the user's module or a factory's, built on meta once,
with an LLM workload applied (quantized, prepared, adapted) when the config has one; and
what repeated traces of one model share (:class:`TraceReuse`).

The step driver (:mod:`batchfit.engine.driver`) prepares the module here; a Keras model is
prepared by :func:`batchfit.engine.keras_trace.prepared_keras`, a sharded rank by its
:class:`~batchfit.engine.driver.StepTransform`.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from batchfit.engine import _torch_internals as ti
from batchfit.engine.tracer import Event


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


def workload_model(model: Any, config: Any, reuse: TraceReuse | None) -> tuple[Any, dict]:
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
        meta = meta_model(model, reuse)
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
    if config.transformers_version is not None:
        from batchfit.engine.workloads.hfloss import apply_transformers_loss

        apply_transformers_loss(transformed, config.transformers_version)
    built = (transformed, quant_attributes(transformed) if config.quant is not None else {})
    if reuse is not None:
        reuse.workload_model = built
    return built


def workload_checkpointing(config: Any) -> bool:
    """Whether the workload already turned checkpointing on (peft's
    ``prepare_model_for_kbit_training`` does, with the given ``use_reentrant``)."""
    return config.quant is not None and config.quant.prepare
