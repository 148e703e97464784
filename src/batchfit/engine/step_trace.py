"""What a traced step is (:class:`StepTrace`), and the one clear line a failing step becomes.

The step driver (:mod:`batchfit.engine.driver`) produces a :class:`StepTrace` for every
preparer (a torch module, an LLM workload, a Keras model, a sharded rank); its events come
from :class:`batchfit.engine.tracer.Tracer`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

from torch import nn

from batchfit.engine import _torch_internals as ti
from batchfit.engine.limits import KernelLimit
from batchfit.engine.tracer import Category, Event, EventKind, Phase, Tracer


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
    #: the launch nearest its kernel's hard limit (:mod:`batchfit.engine.limits`)
    kernel_limit: KernelLimit | None = None
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


SHAPE_WORDS = ("shape", "size", "dimension", "expected input", "mat1 and mat2", "channels",
                "must match", "out of range", "index out of", "dtype", "scalar type")


def translate_error(exc: BaseException, tracer: Tracer, model: nn.Module, phase: Phase) -> Exception:
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
                w in text for w in SHAPE_WORDS):
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


@contextlib.contextmanager
def guarded_run(tracer: Tracer, model: Any, hooks: Sequence[Any] = ()) -> Iterator[None]:
    """Around the traced run of a step, for every preparer (a torch module, a Keras model):
    an error the model raises becomes :func:`translate_error`'s one line, at the phase the
    tracer is in (batchfit's own errors pass as they are), and ``hooks`` (the gradient
    hooks that tag gradients) are removed however the run ends, so the model keeps none."""
    from batchfit.errors import BatchfitError

    try:
        yield
    except BatchfitError:
        raise
    except Exception as exc:
        raise translate_error(exc, tracer, model, tracer.phase) from exc
    finally:
        for hook in hooks:
            hook.remove()


def as_setup(events: tuple[Event, ...]) -> tuple[Event, ...]:
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
        elif event.kind is EventKind.RETAG:
            category[event.key] = event.category
    return tuple(Event(EventKind.ALLOC, e.key, e.nbytes, category[e.key], e.module, e.op,
                       e.phase) for e in alive.values())
