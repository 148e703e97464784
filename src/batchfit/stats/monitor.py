"""Measure the gradient noise scale inside a training loop, from the gradients it computes.

:class:`NoiseScaleMonitor` needs two or more gradients per optimizer step, which a loop
already has when it accumulates micro-batches or runs data-parallel ranks: each
micro-batch's gradient on each rank is a *small* batch (size ``b``), their average (what
the optimizer steps on) is the *big* batch (``B = b x micro-batches x ranks``). Nothing is
recomputed; per step the monitor reads each gradient once more for its norm.

How (the design of AdaptDL's ``GradientNoiseScale``, Qiao et al., OSDI 2021):

* a tensor hook on every trainable parameter sees the micro-batch's own gradient as
  autograd delivers it, *before* it is added into ``.grad`` and before DDP all-reduces it,
  and adds its squared norm to the micro-batch's sum;
* at the end of that backward pass a callback queued on the autograd engine closes the
  micro-batch and queues a second callback, which runs after DDP's own end-of-backward
  reduction (queued in between) and reads the norm of ``.grad``: the accumulated,
  all-reduced gradient, *before* the loop unscales (AMP) or clips it;
* :meth:`NoiseScaleMonitor.step`, once per optimizer step, turns the step's norms into the
  two-batch estimates (:mod:`batchfit.stats.estimator`); on DDP it sums the ranks' small
  norms with one asynchronous all-reduce of two numbers.

Scales undone: the AMP ``GradScaler``'s scale as it was at each backward, and the factor
the loop multiplied the mean loss by before backward (``loss_scale``; by default ``1/k``
for ``k`` micro-batches, which is what Lightning, the Hugging Face Trainer and
accelerate do). ``B_simple`` is a ratio and does not depend on either; ``|G|^2`` and
``tr(Σ)`` do.

Known limitations:
    * One gradient per step on one process (no accumulation, no DDP) has no small batch to
      compare with: :meth:`step` raises. Split the batch into two accumulated micro-batches
      (the same update, except for BatchNorm), or use :func:`batchfit.noise_scale`.
    * Sharded gradients (FSDP, DeepSpeed ZeRO) are refused: a rank holds part of them.
    * BatchNorm in training mode makes each example's gradient depend on its micro-batch;
      a warning says so and the estimate describes training at that micro-batch size.
    * Extra backward passes (``torch.autograd.grad`` for a gradient penalty, say) count as
      micro-batches while the monitor is armed.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Self

import torch
from torch import nn

from batchfit.engine._torch_internals import (
    foreach_norms,
    grad_scaler_scale,
    queue_autograd_callback,
)
from batchfit.errors import InvalidInputError
from batchfit.stats.estimator import NoiseScale, NoiseScaleEstimator, check_ema_decay

#: Fold pending device-side measurements into the estimate after this many steps.
_FLUSH_EVERY = 64


class NoiseScaleWarning(UserWarning):
    """A caveat about a noise-scale measurement (BatchNorm, skipped steps)."""


def scale_tensor(grad_scaler: Any) -> torch.Tensor | float:
    """The GradScaler's current scale (a device copy, no sync), or 1.0 without one."""
    if grad_scaler is None or not getattr(grad_scaler, "is_enabled", lambda: True)():
        return 1.0
    return grad_scaler_scale(grad_scaler)


def batchnorm_modules(model: nn.Module) -> list[str]:
    """Dotted paths of BatchNorm layers (their training-mode gradients depend on the batch)."""
    return [name for name, module in model.named_modules()
            if isinstance(module, nn.modules.batchnorm._BatchNorm)]


def batchnorm_note(names: list[str]) -> str:
    shown = ", ".join(n or "<root>" for n in names[:3]) + (" ..." if len(names) > 3 else "")
    return (f"the model has BatchNorm ({shown}): in training mode an example's gradient "
            "depends on the other examples of its micro-batch, so the noise scale describes "
            "training at this micro-batch size (GroupNorm or LayerNorm have no such effect)")


def check_trainable(model: nn.Module) -> list[nn.Parameter]:
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise InvalidInputError(
            "the model has no trainable parameter (requires_grad=True): there is no gradient "
            "to measure; unfreeze the layers you train")
    return params


def _check_not_sharded(model: nn.Module) -> None:
    names = {type(m).__name__ for m in model.modules()} | {type(model).__name__}
    sharded = names & {"FullyShardedDataParallel", "FSDPModule", "DeepSpeedEngine"}
    if sharded:
        raise InvalidInputError(
            f"{min(sharded)} shards the gradients across ranks, so no rank holds a "
            "micro-batch's whole gradient: measure the noise scale with DistributedDataParallel "
            "or on one process")


def ddp_process_group(model: nn.Module) -> Any:
    """The process group of a DistributedDataParallel model (None otherwise)."""
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        return model.process_group
    return None


def first_batch_dim(args: tuple, kwargs: dict) -> int | None:
    """The leading dimension of the first tensor among a forward call's arguments."""
    if args and isinstance(args[0], torch.Tensor) and args[0].dim() > 0:
        return int(args[0].shape[0])
    from torch.utils._pytree import tree_leaves

    for leaf in tree_leaves((args, kwargs)):
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return int(leaf.shape[0])
    return None


@dataclass
class _Micro:
    """One backward pass: each parameter's gradient norm (0-d device tensors, still scaled)."""

    norms: list[torch.Tensor]
    amp_scale: torch.Tensor | float
    batch_size: int | None


@dataclass
class _PendingStep:
    """A measured step, still on the device: folded into the estimate later, many steps to
    one device read (a step itself adds no tensor op beyond the norms)."""

    micro: list[_Micro]
    big_norms: list[torch.Tensor]
    big_amp: torch.Tensor | float
    loss_scale: float
    batch_small: int
    ddp_sum: torch.Tensor | None = None  # [unscaled small squared norms summed, count]
    work: Any = None  # the asynchronous all-reduce of ddp_sum


class NoiseScaleMonitor:
    """The gradient noise scale of a training run, from its own micro-batch or DDP gradients.

    Args:
        model: the module your loop calls backward through (a ``DistributedDataParallel``
            wrapper counts its ranks).
        every: measure one optimizer step in ``every`` (hooks do nothing on the others).
        ema_decay: decay per measured step of each part's moving average (None: plain mean).
        confidence: level of the interval in :meth:`result`.
        grad_scaler: the ``torch.amp.GradScaler`` the loop uses, if any.
        loss_scale: what the loop multiplies each micro-batch's *mean* loss by before
            ``backward`` (besides AMP): a number or a zero-argument callable; None means
            ``1/k`` for ``k`` micro-batches per step (the usual accumulation).
        batch_size: examples per micro-batch per rank; None reads it from the leading
            dimension of the first tensor passed to ``model``'s forward.
        accumulation_steps: micro-batches per optimizer step, if known (a number or a
            zero-argument callable): the accumulated gradient is then read once per step,
            after its last micro-batch, instead of after every one.
        process_group: the ranks that average the gradients, when ``model`` is not the
            ``DistributedDataParallel`` wrapper itself (default: the wrapper's group, else
            one process).
        dataset_size: examples per epoch, for the finite-population factor (optional).
        keep_history: keep each measured step's estimates (for plots).

    Example:
        >>> import torch
        >>> model = torch.nn.Linear(4, 1)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> monitor = NoiseScaleMonitor(model)
        >>> g = torch.Generator().manual_seed(0)
        >>> for step in range(20):
        ...     for micro in range(4):   # 4 accumulated micro-batches of 8
        ...         x = torch.randn(8, 4, generator=g)
        ...         y = x.sum(1, keepdim=True) + torch.randn(8, 1, generator=g)
        ...         loss = torch.nn.functional.mse_loss(model(x), y) / 4
        ...         loss.backward()
        ...     _ = monitor.step()
        ...     opt.step(); opt.zero_grad()
        >>> r = monitor.result()
        >>> r.steps, r.batch_small, r.batch_big, r.b_simple > 0
        (20, 8, 32, True)
        >>> monitor.close()
    """

    def __init__(self, model: nn.Module, *, every: int = 1, ema_decay: float | None = 0.99,
                 confidence: float = 0.95, grad_scaler: Any = None,
                 loss_scale: float | Callable[[], float] | None = None,
                 batch_size: int | None = None, dataset_size: int | None = None,
                 accumulation_steps: int | Callable[[], int] | None = None,
                 process_group: Any = None, keep_history: bool = False):
        if not isinstance(every, int) or every < 1:
            raise InvalidInputError(f"every must be a positive integer, not {every!r}")
        if batch_size is not None and (not isinstance(batch_size, int) or batch_size < 1):
            raise InvalidInputError(f"batch_size must be a positive integer, not {batch_size!r}")
        check_ema_decay(ema_decay)
        _check_not_sharded(model)
        self.model = model
        self.params = check_trainable(model)
        self.every = every
        self.grad_scaler = grad_scaler
        self.loss_scale = loss_scale
        self.batch_size = batch_size
        self.accumulation_steps = accumulation_steps
        self._is_ddp = ddp_process_group(model) is not None
        self.process_group = process_group or ddp_process_group(model)
        self.world_size = _world_size(self.process_group)
        self.estimator = NoiseScaleEstimator(ema_decay=ema_decay, confidence=confidence,
                                             dataset_size=dataset_size, keep_history=keep_history)
        self.notes: list[str] = []
        bn = batchnorm_modules(model)
        if bn:
            self.notes.append(batchnorm_note(bn))
            warnings.warn(self.notes[-1], NoiseScaleWarning, stacklevel=2)
        self.method = "ddp" if self.world_size > 1 else "microbatch"
        self.optimizer_steps = 0
        self._armed = True
        self._parts: list[torch.Tensor] = []
        self._micro: list[_Micro] = []
        self._big: tuple[torch.Tensor, torch.Tensor | float] | None = None
        self._queued = False
        self._pending: list[_PendingStep] = []
        self._last_batch: int | None = None
        self._told_batch = False
        # a hook per parameter reads each gradient as it arrives and keeps nothing (torch's
        # multi-grad hook, one call per backward, holds every gradient until the last one
        # and measured slower here on small models)
        self._handles = [p.register_hook(self._on_grad) for p in self.params]
        self._handles.append(model.register_forward_pre_hook(self._on_forward, with_kwargs=True))

    # ------------------------------------------------------------------ hooks
    def set_batch_size(self, batch_size: int) -> None:
        """The examples in the micro-batch about to run, for loops where ``model``'s
        forward does not see the batch (or its first dimension is not the batch); from
        then on the forward is not looked at."""
        self._told_batch = True
        self._last_batch = batch_size

    def _on_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self._armed and not self._told_batch and torch.is_grad_enabled():
            self._last_batch = first_batch_dim(args, kwargs)

    def _on_grad(self, grad: torch.Tensor) -> None:
        """One parameter's gradient of one backward pass, before accumulation."""
        if not self._armed:
            return
        if grad.is_sparse:
            grad = grad.coalesce().values()
        if grad.dtype == torch.float32:
            self._parts.append(torch.linalg.vector_norm(grad.detach()))
        else:
            self._parts.append(torch.linalg.vector_norm(grad.detach(), dtype=torch.float32))
        if not self._queued:
            self._queued = True
            queue_autograd_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        self._queued = False
        if not self._parts:
            return
        self._micro.append(_Micro(self._parts, scale_tensor(self.grad_scaler), self._last_batch))
        self._parts = []
        if self._is_last_micro_batch():
            queue_autograd_callback(self._after_reduction)

    def _is_last_micro_batch(self) -> bool:
        """Whether this backward may be the step's last: always, unless the loop said how
        many micro-batches a step has (or DDP says this backward does not synchronise)."""
        if self._is_ddp and not self.model.require_backward_grad_sync:
            return False
        steps = self.accumulation_steps
        steps = steps() if callable(steps) else steps
        return steps is None or len(self._micro) >= steps

    def _after_reduction(self) -> None:
        grads = [p.grad for p in self.params if p.grad is not None]
        self._big = (grad_norms(grads), scale_tensor(self.grad_scaler))

    # ------------------------------------------------------------------ steps
    def step(self, batch_size: int | None = None) -> bool:
        """Close one optimizer step: call it after the step's last backward (before or
        after clipping and ``optimizer.step()``, before ``zero_grad``).

        Args:
            batch_size: examples per micro-batch per rank, if not given at construction
                and not readable from the model's inputs.

        Returns:
            True when this step was measured (it may still be skipped later if its
            gradients turn out non-finite).

        Raises:
            InvalidInputError: one gradient per step on one process (nothing to compare),
                or a batch size that cannot be told.
        """
        measured = self._armed and bool(self._micro)
        if measured:
            self._close_step(batch_size)
        self._micro = []
        self._parts = []
        self._big = None
        self.optimizer_steps += 1
        self._armed = self.optimizer_steps % self.every == 0
        if len(self._pending) >= _FLUSH_EVERY:
            self._flush()
        return measured

    def _close_step(self, batch_size: int | None) -> None:
        micro_count = len(self._micro)
        if micro_count * self.world_size < 2:
            raise InvalidInputError(
                "one gradient per optimizer step on one process: the noise scale needs two or "
                "more (accumulate the batch as 2+ micro-batches, or run DDP ranks), or measure "
                "it apart with batchfit.noise_scale(...)")
        if self._big is None:
            self.estimator.skip()
            return
        sizes = {batch_size or self.batch_size or m.batch_size for m in self._micro}
        if None in sizes:
            raise InvalidInputError(
                "cannot tell the micro-batch size: pass batch_size= to NoiseScaleMonitor or step()")
        if len(sizes) > 1:  # a short last batch: the two-batch formulas need equal sizes
            self.estimator.skip()
            return
        loss_scale = self._loss_scale(micro_count)
        pending = _PendingStep(self._micro, *self._big, loss_scale, sizes.pop())
        if self.world_size > 1:  # the ranks' small norms, summed while training goes on
            import torch.distributed as dist

            small = sum(torch.stack(m.norms).double().square().sum()
                        / (m.amp_scale * loss_scale) ** 2 for m in self._micro)
            pending.ddp_sum = torch.stack([small, torch.full_like(small, micro_count)])
            pending.work = dist.all_reduce(pending.ddp_sum, group=self.process_group,
                                           async_op=True)
        self._pending.append(pending)

    def _loss_scale(self, micro_count: int) -> float:
        value = self.loss_scale() if callable(self.loss_scale) else self.loss_scale
        value = 1.0 / micro_count if value is None else float(value)
        if not (math.isfinite(value) and value > 0):
            raise InvalidInputError(f"loss_scale must be a positive number, not {value!r}")
        return value

    def _flush(self) -> None:
        """Fold the pending steps into the estimate: one device read for all of them."""
        if not self._pending:
            return
        scalars: list[torch.Tensor] = []
        for pending in self._pending:
            if pending.work is not None:
                pending.work.wait()
                scalars.extend(pending.ddp_sum.float())
            for micro in pending.micro:
                scalars.extend(micro.norms)
                scalars.extend(_tensor_scales(micro.amp_scale))
            scalars.extend(pending.big_norms)
            scalars.extend(_tensor_scales(pending.big_amp))
        try:  # all float32 on one device, almost always
            stacked = torch.stack(scalars)
        except RuntimeError:  # a model spread over devices
            stacked = torch.stack([t.float().cpu() for t in scalars])
        values = iter(stacked.tolist())
        for pending in self._pending:
            small_sum, count = (next(values), next(values)) if pending.work is not None else (0, 0)
            for micro in pending.micro:
                sq = sum(next(values) ** 2 for _ in micro.norms)
                amp = _read_scale(micro.amp_scale, values)
                if pending.work is None:
                    small_sum += sq / (amp * pending.loss_scale) ** 2
                    count += 1
            big_sq = sum(next(values) ** 2 for _ in pending.big_norms)
            big_amp = _read_scale(pending.big_amp, values)
            micro_count = len(pending.micro)
            big = big_sq / (big_amp * pending.loss_scale * micro_count) ** 2
            self.estimator.update(small_sum / count, big, pending.batch_small,
                                  pending.batch_small * round(count))
        self._pending.clear()

    # ------------------------------------------------------------------ results
    def result(self) -> NoiseScale:
        """The estimate so far (folds in pending steps: one device sync)."""
        self._flush()
        notes = list(self.notes)
        if self.estimator.skipped_steps:
            notes.append(f"{self.estimator.skipped_steps} step(s) skipped (non-finite gradients "
                         "or unequal micro-batches)")
        return self.estimator.result(method=self.method, notes=tuple(notes))

    def metrics(self) -> dict[str, float]:
        """Scalars to log: ``b_simple``, ``grad_sq_norm``, ``trace_sigma`` (and the
        interval's ends when finite)."""
        self._flush()
        est = self.estimator
        low, high = est.interval()
        values = {"b_simple": est.b_simple, "grad_sq_norm": est.grad_sq_norm,
                  "trace_sigma": est.trace_sigma, "b_simple_ci_low": low,
                  "b_simple_ci_high": high}
        return {k: v for k, v in values.items() if math.isfinite(v)}

    def close(self) -> None:
        """Remove the hooks (the estimate stays readable)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._armed = False

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _world_size(process_group: Any) -> int:
    if process_group is None:
        return 1
    import torch.distributed as dist

    return dist.get_world_size(process_group)


def grad_norms(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """Each tensor's L2 norm in float32 (0-d device tensors); sparse ones by their values;
    one call per device."""
    tensors = [t.coalesce().values() if t.is_sparse else t for t in tensors]
    device = tensors[0].device if tensors else None
    if all(t.device == device for t in tensors):
        return foreach_norms(tensors) if tensors else []
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        by_device.setdefault(t.device, []).append(t)
    return [norm for group in by_device.values() for norm in foreach_norms(group)]


def _tensor_scales(scale: torch.Tensor | float) -> list[torch.Tensor]:
    return [scale.reshape(())] if isinstance(scale, torch.Tensor) else []


def _read_scale(scale: torch.Tensor | float, values: Iterator[float]) -> float:
    return next(values) if isinstance(scale, torch.Tensor) else scale
