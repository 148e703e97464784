"""Trace a Keras 3 model's step (torch backend): Keras's own ``train_step`` on its
variables rebound to fake tensors, recorded by the same :class:`~batchfit.engine.tracer.Tracer`
as a torch step. :func:`batchfit.engine.driver.drive_step` hands a Keras model here; the
Keras-specific pieces (building on meta, rebinding variables, the step runner, layer
names) are in :mod:`batchfit.engine.keras_step`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from batchfit.engine import _torch_internals as ti
from batchfit.engine.observers import StepObserver, observing
from batchfit.engine.prepare import TraceReuse
from batchfit.engine.spec import TrainConfig
from batchfit.engine.step_trace import SHAPE_WORDS, StepTrace, guarded_run
from batchfit.engine.target import Target
from batchfit.engine.tracer import Category, Phase, Tracer


def prepared_keras(base: Any, is_users: bool, inputs: Any, config: TrainConfig,
                    reuse: TraceReuse | None) -> tuple[Any, Any, Any]:
    """(Keras model on meta, ready to trace; its input spec; its target spec), prepared
    once per :class:`TraceReuse`. The user's own Keras model is never traced: a copy of
    its architecture is built on meta and compiled as it is."""
    from batchfit.engine import keras_step
    from batchfit.engine.fake import build_on_meta
    from batchfit.engine.step import normalize_input_spec
    from batchfit.errors import InvalidInputError

    if reuse is not None and reuse.keras is not None:
        meta, targets = reuse.keras
    else:
        keras_step.check_torch_backend()
        meta = base
        if is_users:
            meta = build_on_meta(keras_step.clone_factory(base), config.precision.value)
        with ti.preserved_global_state(), keras_step.build_scope("meta"):
            keras_step.compile_if_needed(meta, config.optimizer)
            spec = inputs if inputs is not None else keras_step.input_spec(meta)
            if spec is None:
                raise InvalidInputError(
                    "the Keras model declares no fixed input shape (a subclassed model, or "
                    "an Input with a free dimension): give the per-sample input")
            with _input_checked(meta):
                targets = keras_step.target_specs(meta, normalize_input_spec(spec))
                keras_step.prepare(meta, normalize_input_spec(spec), targets)
        if reuse is not None:
            reuse.keras = (meta, targets)
    spec = inputs if inputs is not None else keras_step.input_spec(meta)
    return meta, normalize_input_spec(spec), targets


@contextlib.contextmanager
def _input_checked(meta: Any) -> Iterator[None]:
    """Keras checks the input against the model's declared one while it builds the step
    (symbolically, before any trace) and raises ValueError: the same wrong input a torch
    model reports as :class:`~batchfit.errors.InputShapeError` (exit 2), so the same
    error here, with the input the model declares."""
    from batchfit.engine import keras_step
    from batchfit.engine.spec import TensorSpec
    from batchfit.errors import InputShapeError

    try:
        yield
    except ValueError as exc:
        first_line = (str(exc).strip().splitlines() or [""])[0][:300]
        if not any(word in first_line.lower() for word in SHAPE_WORDS):
            raise
        declared = keras_step.input_spec(meta)
        shape = declared.shape if isinstance(declared, TensorSpec) else None
        hint = (f"; the model declares per-sample input {'x'.join(map(str, shape))} (--input)"
                if shape else "")
        raise InputShapeError(f"input does not fit the Keras model: {first_line}{hint}",
                              expected=shape) from exc


def trace_keras_step(base: Any, is_users: bool, inputs: Any, batch_size: int,
                     config: TrainConfig, device: Target, reuse: TraceReuse | None,
                     observers: Sequence[StepObserver] = ()) -> StepTrace:
    """:func:`~batchfit.engine.driver.drive_step` for a Keras 3 model: Keras's own ``train_step`` once, on its
    variables rebound to fake tensors (:mod:`batchfit.engine.keras_step`), starting from
    the steady state: optimizer and metric state built (as ``fit`` builds them before its
    first step) and the previous step's gradients alive (Keras frees them only after the
    next forward pass). The first step is the same events without those gradients: it
    differs from the steady one in nothing else, so one step is traced, not two (a
    ResNet-50 step is 17,000 fake dispatches). Keras's mixed precision is its own, so no
    autocast is added; on a CUDA target the rest of the CUDA emulation (attention
    kernels, the decomposed ops) applies as for any model. ``observers`` watch the one
    step, which is the steady one."""
    from batchfit.engine import keras_step
    from batchfit.engine.spec import Mode

    meta, spec, targets = prepared_keras(base, is_users, inputs, config, reuse)
    training = config.mode is Mode.TRAIN
    fake_mode = ti.new_fake_mode()
    tracer = Tracer(in_op_scratch=not device.is_cuda, cuda_target=device.is_cuda)
    emulation = None
    if device.is_cuda:
        from batchfit.engine.cuda_emulation import CudaEmulation

        emulation = CudaEmulation(device.compute_capability, autocast_dtype=None)
        emulation.where = tracer.current_module
    with ti.preserved_global_state(), keras_step.fake_variables(meta, fake_mode) as state:
        roles = ((Category.PARAMETERS, state.trainable), (Category.BUFFERS, state.non_trainable),
                 (Category.OPTIMIZER_STATE, state.optimizer), (Category.BUFFERS, state.metrics))
        for category, variables in roles:
            for variable in variables:
                tracer.register(variable.value, category)
        generator = torch.Generator().manual_seed(0)
        with fake_mode:
            batch = keras_step.make_data(spec, targets, batch_size, generator)
            if training:  # the last step's, alive until Keras's zero_grad after forward
                for variable in state.trainable:
                    variable.value.grad = torch.zeros_like(variable.value)
        for t in ti.iter_tensors(batch):
            tracer.register(t, Category.INPUTS)
        for variable in state.trainable:
            if variable.value.grad is not None:
                tracer.register(variable.value.grad, Category.GRADIENTS)
        setup_end = len(tracer.events)
        runner = keras_step.KerasStepRunner(
            meta, config, batch, mark_phases=True,
            on_phase=lambda name: setattr(tracer, "phase", Phase(name)))
        grad_hooks = [v.value.register_post_accumulate_grad_hook(
            lambda q: tracer.retag(q.grad, Category.GRADIENTS)) for v in state.trainable]
        tracer.watch_module(meta, keras_step.layer_paths(meta))
        emulation_ctx = emulation if emulation is not None else contextlib.nullcontext()
        with guarded_run(tracer, meta, grad_hooks), fake_mode, emulation_ctx, tracer, \
                keras_step.trace_device(device.is_cuda), \
                keras_step.garbage_collected_per_layer(meta), observing(observers):
            if training:
                runner.train_step()
            else:
                runner.infer_step()
            end = len(tracer.events)
        del runner, batch
        counts = ([v.value.numel() for v in state.trainable],
                  [v.value.numel() for v in state.non_trainable])
    steady = tuple(tracer.events[:end])
    first = steady
    if training:  # the same step without the last step's gradients
        keys = {e.key for e in steady[:setup_end] if e.category is Category.GRADIENTS}
        first = tuple(e for e in steady if e.key not in keys)
    return StepTrace(
        steady_events=steady, first_events=first, batch_size=batch_size,
        custom_ops=dict(tracer.custom_ops),
        parameter_count=sum(counts[0]) + sum(counts[1]),
        trainable_parameter_count=sum(counts[0]),
        largest_tensor=tracer.largest,
        largest_grid=emulation.largest_grid if emulation is not None else (0, "", ""))
