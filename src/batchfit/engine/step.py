"""The step batchfit predicts: how a training or inference step is run.

The same code runs on fake tensors (the trace) and on real tensors (the
reference measurement and the real-device search), so a prediction and its
check always describe the same step.

Training step (steady state)::

    optimizer.zero_grad(set_to_none=True)  # or in place: TrainConfig.grads_to_none=False
    for each of grad_accum_steps micro-batches:
        with autocast:                   # amp-fp16 / amp-bf16 only
            output = model(*args, **kwargs)
            loss = loss_fn(output, batch) / grad_accum_steps  # divided only if > 1
        (loss * scale).backward()        # scale: GradScaler, amp-fp16 only
    unscale + optimizer.step()

Default loss rules (``TrainConfig.loss_fn`` overrides them):

* an output with a ``.loss`` (Hugging Face models given ``labels``): that loss;
* a 2-D floating output ``(B, C)``: cross-entropy against random integer targets in ``[0, C)``;
* anything else: the sum of ``.float().mean()`` over the floating tensors of the output.

Inference step: ``model.eval()`` and ``torch.no_grad()`` (or ``torch.inference_mode()``
with ``TrainConfig.inference_mode``), forward only.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch
from torch import nn

from batchfit.engine.spec import (
    InputSpec,
    Mode,
    OptimizerName,
    Precision,
    TensorSpec,
    TrainConfig,
)
from batchfit.errors import InvalidInputError

_TORCH_DTYPES = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "float64": torch.float64, "int64": torch.int64, "int32": torch.int32,
    "int16": torch.int16, "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool,
}


def torch_dtype(name: str) -> torch.dtype:
    return _TORCH_DTYPES[name]


def normalize_input_spec(inputs: Any) -> InputSpec:
    """Accept a TensorSpec, a shape tuple, a torch.Tensor (per-sample example), or a
    tuple/dict of those, and return an :data:`InputSpec`."""
    if isinstance(inputs, TensorSpec):
        return inputs
    if isinstance(inputs, torch.Tensor):
        dtype = str(inputs.dtype).removeprefix("torch.")
        return TensorSpec(tuple(inputs.shape), dtype)
    if isinstance(inputs, Mapping):
        return {str(k): normalize_input_spec(v) for k, v in inputs.items()}
    if isinstance(inputs, (tuple, list)):
        if inputs and all(isinstance(d, int) for d in inputs):
            return TensorSpec(tuple(inputs))
        if not inputs:
            raise InvalidInputError("empty input spec: give the per-sample shape, e.g. (3, 224, 224)")
        return tuple(normalize_input_spec(v) for v in inputs)
    raise InvalidInputError(
        f"cannot use {type(inputs).__name__} as an input spec: give a TensorSpec, a shape tuple, "
        "a per-sample example tensor, or a tuple/dict of those")


def make_tensor(spec: TensorSpec, batch_size: int, float_dtype: torch.dtype | None,
                generator: torch.Generator, memory_format: torch.memory_format | None) -> torch.Tensor:
    """A batch tensor for ``spec`` on the current default device (fake or real CPU)."""
    shape = spec.batch_shape(batch_size)
    dtype = torch_dtype(spec.dtype)
    _check_tensor_size(shape, dtype, batch_size)
    if spec.is_integer:
        high = spec.high if spec.high is not None else 2
        if dtype is torch.bool:
            return torch.randint(0, 2, shape, generator=generator).bool()
        return torch.randint(spec.low, high, shape, dtype=dtype, generator=generator)
    if float_dtype is not None and dtype is torch.float32:
        dtype = float_dtype
    tensor = torch.randn(shape, dtype=dtype, generator=generator)
    if memory_format is not None and tensor.dim() == 4:
        tensor = tensor.contiguous(memory_format=memory_format)
    return tensor


_MAX_TENSOR_BYTES = 2**63 - 1  # torch sizes a tensor's storage in int64 bytes


def _check_tensor_size(shape: tuple[int, ...], dtype: torch.dtype, batch_size: int) -> None:
    """A batch whose input alone would pass torch's int64 storage size is a mistyped
    batch size, refused here rather than by torch's overflow error deep in the trace."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes > _MAX_TENSOR_BYTES:
        raise InvalidInputError(
            f"batch size {batch_size:,} makes an input of {nbytes:.3g} bytes, more than a "
            f"tensor can hold (2^63 - 1 bytes): give a smaller batch size")


def make_batch(spec: InputSpec, batch_size: int, float_dtype: torch.dtype | None,
               generator: torch.Generator, channels_last: bool = False
               ) -> tuple[tuple[torch.Tensor, ...], dict[str, torch.Tensor]]:
    """Positional and keyword arguments for ``model(*args, **kwargs)``."""
    memory_format = torch.channels_last if channels_last else None

    def build(s: TensorSpec) -> torch.Tensor:
        return make_tensor(s, batch_size, float_dtype, generator, memory_format)

    if isinstance(spec, TensorSpec):
        return (build(spec),), {}
    if isinstance(spec, Mapping):
        return (), {k: build(v) for k, v in spec.items()}
    return tuple(build(s) for s in spec), {}


def default_loss(output: Any, batch: tuple[tuple, dict], generator: torch.Generator) -> torch.Tensor:
    """The documented default loss rules (see the module docstring)."""
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(output, torch.Tensor) and output.dim() == 2 and output.is_floating_point():
        target = torch.randint(0, output.shape[1], (output.shape[0],), generator=generator,
                               device=output.device)
        return nn.functional.cross_entropy(output, target)
    tensors = [t for t in _floating_tensors(output) if t.requires_grad or not torch.is_grad_enabled()]
    if not tensors:
        raise InvalidInputError(
            "the model output has no floating tensor to reduce into a loss: pass loss_fn=...")
    total = tensors[0].float().mean()
    for t in tensors[1:]:
        total = total + t.float().mean()
    return total


def _floating_tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value] if value.is_floating_point() else []
    if isinstance(value, Mapping):
        value = list(value.values())
    elif hasattr(value, "to_tuple"):  # transformers ModelOutput
        value = value.to_tuple()
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _floating_tensors(v)]
    return []


_OPTIMIZERS: dict[OptimizerName, tuple[str, dict[str, Any]]] = {
    OptimizerName.SGD: ("SGD", {"lr": 0.01}),
    OptimizerName.MOMENTUM: ("SGD", {"lr": 0.01, "momentum": 0.9}),
    OptimizerName.NESTEROV: ("SGD", {"lr": 0.01, "momentum": 0.9, "nesterov": True}),
    OptimizerName.ADAM: ("Adam", {"lr": 1e-3}),
    OptimizerName.ADAMW: ("AdamW", {"lr": 1e-3}),
    OptimizerName.ADAGRAD: ("Adagrad", {"lr": 1e-2}),
    OptimizerName.RMSPROP: ("RMSprop", {"lr": 1e-2}),
    OptimizerName.ADAFACTOR: ("Adafactor", {"lr": 1e-2}),
}


def build_optimizer(config: TrainConfig, params: list[nn.Parameter], foreach: bool | None,
                    on_paged: Callable[[torch.Tensor], None] | None = None
                    ) -> torch.optim.Optimizer:
    """The optimizer of ``config`` over ``params``.

    ``foreach`` picks the implementation: True is CUDA's default (multi-tensor),
    False the CPU default (for-loop). ``fused=True`` in ``optimizer_kwargs`` wins.
    bitsandbytes optimizers (``adamw8bit``, ``paged-adamw8bit``...) are bitsandbytes' own
    classes; ``on_paged`` receives the state buffers a GPU would page
    (:mod:`batchfit.engine.workloads.optim`).
    """
    if not isinstance(config.optimizer, type) and config.optimizer.is_bitsandbytes:
        from batchfit.engine.workloads.optim import build_bnb_optimizer

        try:
            return build_bnb_optimizer(config.optimizer.value, params,
                                       dict(config.optimizer_kwargs), on_paged)
        except (TypeError, ValueError) as exc:
            raise InvalidInputError(
                f"cannot build bitsandbytes {config.optimizer.value} with "
                f"{dict(config.optimizer_kwargs)}: {exc}") from exc
    if isinstance(config.optimizer, type):
        cls, kwargs = config.optimizer, {}
        if not issubclass(cls, torch.optim.Optimizer):
            raise InvalidInputError(f"{cls.__name__} is not a torch.optim.Optimizer subclass")
    else:
        cls_name, kwargs = _OPTIMIZERS[config.optimizer]
        cls = getattr(torch.optim, cls_name, None)
        if cls is None:
            raise InvalidInputError(
                f"optimizer {config.optimizer.value!r} needs a newer torch (torch.optim.{cls_name})")
    kwargs = {**kwargs, **config.optimizer_kwargs}
    if foreach is not None and not kwargs.get("fused") and "foreach" not in kwargs:
        if "foreach" in _init_params(cls):
            kwargs["foreach"] = foreach
    try:
        return cls(params, **kwargs)
    except (TypeError, ValueError) as exc:
        raise InvalidInputError(f"cannot build {cls.__name__} with {kwargs}: {exc}") from exc


def _init_params(cls: type) -> set[str]:
    import inspect

    return set(inspect.signature(cls.__init__).parameters)


class _GradScalerSteps:
    """What ``torch.amp.GradScaler`` does to memory, without its ``.item()`` sync.

    GradScaler reads ``found_inf.item()`` to decide whether to skip the step; that
    is data-dependent on fake tensors, so the step always runs here.
    """

    def __init__(self, device: torch.device):
        self.scale = torch.full((), 65536.0, dtype=torch.float32, device=device)
        self.growth_tracker = torch.zeros((), dtype=torch.int32, device=device)

    def scaled(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        inv_scale = self.scale.double().reciprocal().float()
        found_inf = torch.zeros((), dtype=torch.float32, device=self.scale.device)
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
        for grads in by_dtype.values():
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)
        self._found_inf = found_inf

    def update(self) -> None:
        torch._amp_update_scale_(self.scale, self.growth_tracker, self._found_inf, 2.0, 0.5, 2000)
        del self._found_inf


@dataclass
class StepRunner:
    """Runs the phases of one step; ``on_phase(name)`` is called as each phase starts.

    Args:
        model: the module (fake or real), already in its final dtype and memory format.
        config: the training config.
        batch: ``(args, kwargs)`` for the forward call.
        autocast: a context-manager factory for the forward region, or None.
        foreach: the optimizer implementation (see :func:`build_optimizer`).
        engine: a training engine that owns backward and the optimizer step, as
            DeepSpeed's does (``engine.backward(loss)``; ``engine.step()``, which also
            zeroes the gradients); None: ``loss.backward()`` and ``optimizer.step()``.
        traced: a dispatch-mode trace runs the step (memory, FLOPs); an inference-mode
            step then runs under ``no_grad``, whose op stream the trace's rules know (under
            inference mode composite ops such as ``aten.linear`` reach a dispatch mode
            undecomposed). The memory trace applies inference mode's one memory effect,
            on the autocast cache, itself (:mod:`batchfit.engine.trace`).
    """

    model: nn.Module
    config: TrainConfig
    batch: tuple[tuple, dict]
    autocast: Callable[[], Any] | None = None
    foreach: bool | None = None
    on_paged: Callable[[torch.Tensor], None] | None = None
    on_phase: Callable[[str], None] = lambda phase: None
    generator: torch.Generator = field(default_factory=torch.Generator)
    optimizer: torch.optim.Optimizer | None = None
    scaler: _GradScalerSteps | None = None
    engine: Any = None
    traced: bool = False
    held_loss: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.config.mode is Mode.TRAIN:
            self.model.train()
            params = [p for p in self.model.parameters() if p.requires_grad]
            if not params:
                raise InvalidInputError(
                    "the model has no trainable parameter: use mode='infer' or unfreeze some")
            if self.optimizer is None:
                self.optimizer = build_optimizer(self.config, params, self.foreach,
                                                 self.on_paged)
            if self.config.precision is Precision.AMP_FP16 and self.scaler is None:
                self.scaler = _GradScalerSteps(params[0].device)
        else:
            self.model.eval()

    def _region(self):
        return self.autocast() if self.autocast is not None else contextlib.nullcontext()

    def forward_loss(self) -> torch.Tensor | Any:
        args, kwargs = self.batch
        self.on_phase("forward")
        with self._region():
            output = self.model(*args, **kwargs)
            if self.config.mode is Mode.INFER:
                return output
            self.on_phase("loss")
            loss_fn = self.config.loss_fn
            if loss_fn is None:
                loss = default_loss(output, self.batch, self.generator)
            else:
                loss = loss_fn(output, self.batch)
        del output
        return loss

    def zero_grad(self) -> None:
        self.on_phase("zero_grad")
        if self.engine is None:  # an engine zeroes the gradients in its step
            self.optimizer.zero_grad(set_to_none=self.config.zero_grad_to_none)

    def forward_backward(self) -> None:
        self.backward(self._held(self.forward_loss()))

    def _held(self, loss: torch.Tensor) -> torch.Tensor:
        """With ``config.holds_loss``, ``loss`` replaces (and so frees) the previous step's
        only now, after this forward, as a loop variable does."""
        if self.config.holds_loss:
            self.held_loss = loss
        return loss

    def backward(self, loss: torch.Tensor) -> None:
        self.on_phase("backward")
        if self.engine is not None:  # DeepSpeed scales by its own accumulation steps
            self.engine.backward(loss)
            return
        if self.config.grad_accum_steps > 1:
            loss = loss / self.config.grad_accum_steps  # as transformers' Trainer scales it
        if self.scaler is not None:
            loss = self.scaler.scaled(loss)
        loss.backward()

    def optimizer_step(self) -> None:
        self.on_phase("optimizer")
        if self.engine is not None:
            self.engine.step()
            return
        if self.scaler is not None:
            self.scaler.unscale(self.optimizer)
        self.optimizer.step()
        if self.scaler is not None:
            self.scaler.update()

    def train_step(self) -> None:
        """One optimizer step: ``grad_accum_steps`` micro-batches, then the update (with
        ``zero_grad_after_forward``, the first micro-batch's forward before ``zero_grad``)."""
        micro_batches = self.config.grad_accum_steps
        if self.config.zero_grad_after_forward:
            loss = self._held(self.forward_loss())
            self.zero_grad()
            self.backward(loss)
            micro_batches -= 1
        else:
            self.zero_grad()
        for _ in range(micro_batches):
            self.forward_backward()
        self.optimizer_step()

    def infer_step(self) -> None:
        real_inference_mode = self.config.inference_mode and not self.traced
        with torch.inference_mode() if real_inference_mode else torch.no_grad():
            output = self.forward_loss()
        del output

    def state_tensors(self) -> list[torch.Tensor]:
        """What lives between steps: parameters, buffers, gradients, optimizer state and
        the grad scaler's tensors (the batch is not included)."""
        tensors = list(self.model.parameters()) + list(self.model.buffers())
        tensors += [p.grad for p in self.model.parameters() if p.grad is not None]
        if self.optimizer is not None:
            for state in self.optimizer.state.values():
                tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
        if self.scaler is not None:
            tensors += [self.scaler.scale, self.scaler.growth_tracker]
        return tensors

    def drop_gradients(self) -> None:
        """Free the gradients a step left (after a warm-up, or a failed step)."""
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
