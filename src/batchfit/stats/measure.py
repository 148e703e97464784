"""``noise_scale``: measure the simple gradient noise scale of a model on its data.

Each measured step draws a big batch of ``batch_big`` examples and gets its gradient and
the gradients of small batches inside it, by one of three methods:

* ``microbatch``: ``batch_big / batch_small`` micro-batches, one backward each,
  accumulated as a training loop does; the small-batch norms are read by the same hooks
  :class:`~batchfit.stats.monitor.NoiseScaleMonitor` uses in training. Works for any model.
* ``per-example``: per-example gradients with ``torch.func`` (``vmap`` over ``grad`` of a
  ``functional_call``), so ``b = 1``: the sample variance of the per-example gradients, the
  most information per big batch. Needs a model ``torch.func`` can run per example (no
  BatchNorm in training mode, no data-dependent Python control flow).
* ``ddp``: a ``DistributedDataParallel`` model; call ``noise_scale`` on every rank, as any
  DDP code runs. The ranks draw the same big batch (same seed) and each takes its share,
  so each rank's micro-batches are the small batches and DDP's all-reduced gradient is the
  big one (read before the all-reduce and after it, as in training).

``auto`` picks ``ddp`` for a DDP model, ``per-example`` when ``batch_small`` is 1 and
``microbatch`` otherwise.

The model runs in training mode. With an ``optimizer`` each step also trains on its big
batch, so the estimate follows the weights as they move; without one the weights stay
put and the estimate is of the noise scale at these weights (the default: a plain mean
over the steps, since nothing drifts). Either way the model (parameters, buffers,
gradients, train/eval flags), the optimizer and the RNG states (torch, CUDA, numpy,
``random``) are restored bit for bit afterwards (:func:`batchfit.realrun.state.preserved_state`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from enum import StrEnum
from typing import Any

import torch
from torch import nn

from batchfit.engine.spec import parse_enum
from batchfit.errors import InvalidInputError
from batchfit.stats.data import BatchSource
from batchfit.stats.estimator import NoiseScale, NoiseScaleEstimator, check_ema_decay
from batchfit.stats.loss import LossFn, as_model_loss
from batchfit.stats.monitor import (
    NoiseScaleMonitor,
    NoiseScaleWarning,
    batchnorm_modules,
    batchnorm_note,
    check_trainable,
    ddp_process_group,
)

#: Per-example gradients are computed this many bytes' worth of examples at a time.
PER_EXAMPLE_CHUNK_BYTES = 256 << 20


class PerExampleUnsupported(InvalidInputError):
    """``torch.func`` cannot compute this model's per-example gradients."""


class Method(StrEnum):
    """Where the small-batch gradients come from."""

    AUTO = "auto"
    MICROBATCH = "microbatch"
    PER_EXAMPLE = "per-example"
    DDP = "ddp"


def default_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """``model(**batch).loss`` for a dict batch (Hugging Face models given ``labels``)."""
    if not isinstance(batch, Mapping):
        raise InvalidInputError(
            "no loss_fn: give loss_fn(model, batch) returning the mean loss of the batch (the "
            "default only handles dict batches whose model output has a .loss)")
    loss = getattr(model(**batch), "loss", None)
    if loss is None:
        raise InvalidInputError(
            "the model output has no .loss: give loss_fn(model, batch) returning the mean loss")
    return loss


def checked_loss(loss: Any) -> torch.Tensor:
    """The loss if it is a differentiable floating scalar; else one clear error."""
    if not isinstance(loss, torch.Tensor):
        raise InvalidInputError(
            f"loss_fn returned {type(loss).__name__}, not a tensor: return the batch's mean "
            "loss as a scalar tensor")
    if loss.numel() != 1:
        raise InvalidInputError(
            f"loss_fn returned a tensor of shape {tuple(loss.shape)}, not a scalar: reduce it "
            "to the mean over the batch (e.g. loss.mean())")
    if not loss.is_floating_point():
        raise InvalidInputError(f"loss_fn returned a {loss.dtype} tensor: return a float loss")
    if not bool(torch.isfinite(loss.detach()).all()):
        raise InvalidInputError(
            f"the loss is {loss.item()} on a batch of the data: no gradient noise can be "
            "measured from it; check the data for nan/inf and the model at these weights")
    if not loss.requires_grad:
        raise InvalidInputError(
            "the loss does not depend on any trainable parameter (no grad_fn): check that "
            "loss_fn calls the model it is given")
    return loss.reshape(())


def _check_positive_int(value: Any, what: str, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidInputError(f"{what} must be an integer >= {minimum}, not {value!r}")


def _resolve_method(method: Method, model: nn.Module, batch_small: int) -> Method:
    is_ddp = ddp_process_group(model) is not None
    if method is Method.AUTO:
        if is_ddp:
            return Method.DDP
        return Method.PER_EXAMPLE if batch_small == 1 else Method.MICROBATCH
    if method is Method.DDP and not is_ddp:
        raise InvalidInputError(
            "method 'ddp' needs a DistributedDataParallel model (run noise_scale on every rank)")
    if method is not Method.DDP and is_ddp:
        raise InvalidInputError(
            f"a DistributedDataParallel model is measured across its ranks: use method 'ddp' or "
            f"'auto' (or pass model.module to measure '{method.value}' on one rank)")
    return method


def _check_batches(method: Method, batch_small: int, batch_big: int, world_size: int) -> None:
    if method is Method.PER_EXAMPLE:
        return
    per_rank = batch_big // world_size
    if batch_big % world_size or per_rank % batch_small:
        ranks = f" on {world_size} ranks ({world_size} x {per_rank})" if world_size > 1 else ""
        raise InvalidInputError(
            f"the big batch ({batch_big}) must split into micro-batches of {batch_small}{ranks}: "
            f"use a multiple of {batch_small * world_size}")


def noise_scale(model: nn.Module, loss_fn: Callable[..., Any] | None, data: Any, *, batch_small: int = 8,
                batch_big: int = 64, steps: int = 50, method: Method | str = Method.AUTO,
                optimizer: torch.optim.Optimizer | None = None,
                ema_decay: float | None = None, confidence: float = 0.95, seed: int = 0,
                on_step: Callable[[int], None] | None = None) -> NoiseScale:
    """Measure the simple noise scale ``B_simple = tr(Σ)/|G|^2`` of ``model`` on ``data``.

    Args:
        model: the module (any device; batches are moved to its parameters' device).
            Left exactly as it was (see the module docstring).
        loss_fn: ``loss_fn(model, batch) -> scalar`` mean loss of the batch, or a
            ``criterion(output, target)`` such as ``nn.MSELoss()`` for batches
            ``(input..., target)``; told apart by the signature (see
            :mod:`batchfit.stats.loss`). The formulas assume a mean, not a sum. None:
            ``model(**batch).loss`` for dict batches.
        data: a map-style Dataset, a DataLoader over one, or tensors (see
            :mod:`batchfit.stats.data`); it must hold at least ``batch_big`` examples.
        batch_small: the small batch size (``batch_small < batch_big``).
        batch_big: the big batch size (for ``microbatch`` and ``ddp`` it splits into
            small ones).
        steps: measured steps (big batches).
        method: ``auto``, ``microbatch``, ``per-example`` or ``ddp`` (see the module docstring).
        optimizer: also train while measuring (an optimizer over ``model``'s parameters).
        ema_decay: decay of each part's moving average per step; None (default) weighs
            every step the same.
        confidence: level of the interval.
        seed: seed of the batch sampler (the same on every DDP rank).
        on_step: called with the step index after each step (progress).

    Returns:
        A :class:`~batchfit.stats.estimator.NoiseScale` with the interval, the steps it
        rests on and ``steps_for(0.1)``, the steps a 10% half-width would need.

    Raises:
        InvalidInputError: batch_small >= batch_big, a dataset smaller than batch_big, a
            loss that is not a scalar, a model with no trainable parameter, and other bad
            arguments; one line each.

    Example:
        >>> import torch
        >>> g = torch.Generator().manual_seed(0)
        >>> x = torch.randn(4096, 8, generator=g)
        >>> y = x @ torch.ones(8, 1) + torch.randn(4096, 1, generator=g)
        >>> model = torch.nn.Linear(8, 1)
        >>> mse = lambda m, batch: 0.5 * (m(batch[0]) - batch[1]).square().mean()
        >>> r = noise_scale(model, mse, (x, y), batch_small=8, batch_big=64, steps=30)
        >>> r.steps, r.method, r.ci_low < r.b_simple < r.ci_high
        (30, 'microbatch', True)
    """
    if not isinstance(model, nn.Module):
        raise InvalidInputError(f"model must be a torch.nn.Module, not {type(model).__name__}")
    _check_positive_int(batch_small, "batch_small")
    _check_positive_int(batch_big, "batch_big")
    if batch_small >= batch_big:
        raise InvalidInputError(
            f"the small batch ({batch_small}) must be smaller than the big batch ({batch_big})")
    _check_positive_int(steps, "steps", 2)
    check_ema_decay(ema_decay)
    loss_fn = as_model_loss(loss_fn) if loss_fn is not None else default_loss
    check_trainable(model)
    asked = parse_enum(Method, method, "method")
    method = _resolve_method(asked, model, batch_small)
    chosen_for_you = asked is Method.AUTO
    group = ddp_process_group(model)
    world_size = torch.distributed.get_world_size(group) if group is not None else 1
    _check_batches(method, batch_small, batch_big, world_size)
    device = next(p.device for p in model.parameters())
    source = BatchSource(data, seed=seed, device=device)
    source.check_size(batch_big)
    notes = []
    bn = batchnorm_modules(model)
    if bn:
        notes.append(batchnorm_note(bn))
        warnings.warn(notes[-1], NoiseScaleWarning, stacklevel=2)

    from batchfit.realrun.state import preserved_state

    with preserved_state(model, optimizer):
        model.train()
        result = None
        if method is Method.PER_EXAMPLE:
            try:
                result = _per_example(model, loss_fn, source, batch_big, steps, optimizer,
                                      ema_decay, confidence, on_step)
            except PerExampleUnsupported as exc:
                if not chosen_for_you:
                    raise
                notes.append(f"{exc.args[0].split('; use')[0]}: measured with micro-batches of 1")
        if result is None:
            result = _accumulated(model, loss_fn, source, batch_small, batch_big, steps,
                                  optimizer, ema_decay, confidence, on_step, world_size)
    if result.steps == 0:
        raise InvalidInputError(
            f"all {result.skipped_steps} steps had non-finite (nan/inf) gradients, so nothing "
            "was measured: check the loss and the model at these weights")
    if notes:
        from dataclasses import replace

        result = replace(result, notes=tuple(dict.fromkeys(notes + list(result.notes))))
    return result


def _accumulated(model: nn.Module, loss_fn: LossFn, source: BatchSource, batch_small: int,
                 batch_big: int, steps: int, optimizer: torch.optim.Optimizer | None,
                 ema_decay: float | None, confidence: float,
                 on_step: Callable[[int], None] | None, world_size: int) -> NoiseScale:
    """Micro-batches (and DDP ranks) through the training hooks."""
    rank = torch.distributed.get_rank(ddp_process_group(model)) if world_size > 1 else 0
    per_rank = batch_big // world_size
    micro_count = per_rank // batch_small
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NoiseScaleWarning)  # said once, by noise_scale
        monitor = NoiseScaleMonitor(model, ema_decay=ema_decay, confidence=confidence,
                                    batch_size=batch_small, dataset_size=source.size,
                                    keep_history=True)
    no_sync = getattr(model, "no_sync", None)
    try:
        for step in range(steps):
            indices = source.draw(batch_big)[rank * per_rank:(rank + 1) * per_rank]
            model.zero_grad(set_to_none=True)
            for j in range(micro_count):
                batch = source.take(indices[j * batch_small:(j + 1) * batch_small])
                last = j == micro_count - 1
                with no_sync() if (no_sync is not None and not last) else _null():
                    loss = checked_loss(loss_fn(model, batch))
                    (loss / micro_count).backward()
            monitor.step()
            if optimizer is not None:
                optimizer.step()
            if on_step is not None:
                on_step(step)
        return monitor.result()
    finally:
        monitor.close()


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


class _LossOf(nn.Module):
    """``loss_fn(model, batch)`` as a module, so ``functional_call`` can swap the model's
    parameters (under the ``model.`` prefix) while ``loss_fn`` calls it."""

    def __init__(self, model: nn.Module, loss_fn: LossFn):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, batch: Any) -> torch.Tensor:
        return self.loss_fn(self.model, batch)


def _per_example_grads(model: nn.Module, loss_fn: LossFn) -> Callable[..., Any]:
    from torch.func import functional_call, grad, vmap
    from torch.utils._pytree import tree_map

    wrapper = _LossOf(model, loss_fn)
    frozen = {f"model.{n}": p.detach() for n, p in model.named_parameters() if not p.requires_grad}
    frozen.update({f"model.{n}": b for n, b in model.named_buffers()})

    def one_example(params: dict[str, torch.Tensor], example: Any) -> torch.Tensor:
        batch = tree_map(lambda t: t.unsqueeze(0) if isinstance(t, torch.Tensor) else t, example)
        loss = functional_call(wrapper, {**frozen, **params}, (batch,))
        return checked_loss_in_vmap(loss)

    return vmap(grad(one_example), in_dims=(None, 0), randomness="different")


def checked_loss_in_vmap(loss: Any) -> torch.Tensor:
    """Inside ``vmap`` a tensor's ``requires_grad`` is not meaningful: check the rest."""
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise InvalidInputError(
            f"loss_fn returned {shape} for one example, not a scalar: reduce it to the mean "
            "over the batch (e.g. loss.mean())")
    return loss.reshape(())


def _per_example(model: nn.Module, loss_fn: LossFn, source: BatchSource, batch_big: int,
                 steps: int, optimizer: torch.optim.Optimizer | None,
                 ema_decay: float | None, confidence: float,
                 on_step: Callable[[int], None] | None) -> NoiseScale:
    """``b = 1`` from per-example gradients (``torch.func``), in memory-bounded chunks."""
    named = {f"model.{n}": p for n, p in model.named_parameters() if p.requires_grad}
    params = {n: p.detach() for n, p in named.items()}
    numel = sum(p.numel() for p in params.values())
    chunk = max(1, min(batch_big, PER_EXAMPLE_CHUNK_BYTES // (4 * numel)))
    grads_of = _per_example_grads(model, loss_fn)
    estimator = NoiseScaleEstimator(ema_decay=ema_decay, confidence=confidence,
                                    dataset_size=source.size)
    checked = False
    for step in range(steps):
        indices = source.draw(batch_big)
        if not checked:  # a plain call first: its errors are clearer than vmap's
            checked_loss(loss_fn(model, source.take(indices[:2])))
            model.zero_grad(set_to_none=True)
            checked = True
        total = {n: torch.zeros_like(p, dtype=torch.float32) for n, p in params.items()}
        small = torch.zeros((), dtype=torch.float64, device=next(iter(params.values())).device)
        for start in range(0, batch_big, chunk):
            try:
                per_example = grads_of(params, source.take(indices[start:start + chunk]))
            except InvalidInputError:
                raise
            except Exception as exc:
                raise PerExampleUnsupported(
                    f"per-example gradients (torch.func) failed for this model: "
                    f"{_one_line(exc)}; use method 'microbatch'") from exc
            norms = sum(g.flatten(1).float().square().sum(1) for g in per_example.values())
            small += norms.sum(dtype=torch.float64)
            for n, g in per_example.items():
                total[n] += g.float().sum(0)
        mean = {n: t / batch_big for n, t in total.items()}
        big = sum(m.square().sum(dtype=torch.float64) for m in mean.values())
        estimator.update(float(small) / batch_big, float(big), 1, batch_big)
        if optimizer is not None:
            for n, p in named.items():
                p.grad = mean[n].to(p.dtype)
            optimizer.step()
            params = {n: p.detach() for n, p in named.items()}
        if on_step is not None:
            on_step(step)
    return estimator.result(method=Method.PER_EXAMPLE.value)


def _one_line(exc: BaseException, limit: int = 200) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."

