"""The step driver: one place that prepares a step, runs it on fake tensors and lets
observers watch it, in the manner of torch's ``FlopCounterMode`` and ``MemTracker``
(interception apart from knowledge apart from reporting).

* **Preparers** turn the model and step into what runs: the user's module or a factory's,
  built on meta (:mod:`batchfit.engine.prepare`); with an LLM workload applied
  (:func:`~batchfit.engine.prepare.workload_model`); a Keras model
  (:mod:`batchfit.engine.keras_trace`); one rank of a sharding strategy
  (a :class:`StepTransform`, :mod:`batchfit.sharding`). The library context (transformers'
  mask decisions, the workload's runtime), the stack's optimizer implementation and the
  CUDA emulation of the :class:`Target` are set up here, once, for every observer.
* **Observers** watch the run. The memory tracer (:class:`~batchfit.engine.tracer.Tracer`)
  is always there: it records the events :class:`~batchfit.engine.step_trace.StepTrace`
  holds. Others (:class:`StepObserver`: the op-cost recorder of
  :mod:`batchfit.speed.op_costs`) are entered above it around every part of the run and
  told which parts are the steady step, so one pass gives both.

:func:`batchfit.engine.trace.trace_step` is :func:`drive_step` with no other observer.
Known limitations: see :mod:`batchfit.engine.tracer`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from batchfit._gc import old_objects_frozen
from batchfit.engine import _torch_internals as ti
from batchfit.engine.limits import KernelLimit, attention_grid, worst
from batchfit.engine.observers import StepObserver, mark_steady, observing
from batchfit.engine.prepare import (
    StepTransform,
    TraceReuse,
    meta_model,
    module_preparer,
)
from batchfit.engine.spec import TrainConfig
from batchfit.engine.step_trace import StepTrace, alive_at_end, as_setup, guarded_run
from batchfit.engine.target import Target
from batchfit.engine.tracer import Category, Event, Phase, Tracer


@old_objects_frozen()
def drive_step(model: Any, inputs: Any, batch_size: int, config: TrainConfig, device: Target,
               reuse: TraceReuse | None = None, transform: StepTransform | None = None,
               observers: Sequence[StepObserver] = ()) -> StepTrace:
    """Prepare one step of ``model`` at ``batch_size`` on fake tensors, run it once under
    the memory tracer and ``observers``, and return the memory trace.

    Args:
        model: an ``nn.Module`` (never modified) or a zero-argument factory.
        inputs: a per-sample input spec (see :func:`batchfit.engine.step.normalize_input_spec`).
        batch_size: the batch size.
        config: a :class:`batchfit.engine.spec.TrainConfig`.
        device: a :class:`batchfit.device.profile.DeviceProfile`.
        reuse: share work between traces of the same model at other batch sizes.
        transform: builds and runs the step another way (one rank of a sharded step,
            :mod:`batchfit.sharding`); with its ``whole_steps`` two whole training steps
            are traced, the second being the steady one.
        observers: watch the same run as the memory tracer (the op-cost recorder of
            :mod:`batchfit.speed.op_costs`); each is told which parts are the steady step.
            With observers the optimizer phase is traced even if ``reuse`` holds it.
    """
    from batchfit.engine.spec import Mode
    from batchfit.engine.step import (
        StepRunner,
        make_batch,
        normalize_input_spec,
        torch_dtype,
    )
    from batchfit.errors import InvalidInputError

    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise InvalidInputError(f"batch size must be a positive integer, not {batch_size!r}")
    from batchfit.engine.fake import build_on_meta
    from batchfit.engine.keras_detect import is_keras_model

    workload = config.workload
    base, owned = None, False
    if workload is None:  # a workload's model is built (and transformed) by its preparer
        with ti.preserved_global_state():
            base = meta_model(model, reuse, config.precision.value)
            owned = not isinstance(base, nn.Module) and callable(base)  # a factory, no reuse
            if owned:
                base = build_on_meta(base, config.precision.value)
    if base is not None and is_keras_model(base):
        from batchfit.engine.keras_trace import trace_keras_step

        return trace_keras_step(base, base is model, inputs, batch_size, config, device, reuse,
                                observers)
    spec = normalize_input_spec(inputs)
    precision = config.precision
    float_dtype = None if precision.weight_dtype == "float32" else torch_dtype(precision.weight_dtype)
    training = config.mode is Mode.TRAIN
    stack = config.resolved_stack
    # the previous step lives into the next step's forward: its gradients (zeroed in place,
    # or zeroed after it), or its loss and the graph behind it (a loop that holds the loss)
    step_survives = (not config.zero_grad_to_none or config.zero_grad_after_forward
                     or bool(config.holds_loss))
    fake_mode = ti.new_fake_mode()
    preparer = module_preparer(model, base, owned, config, device, reuse, transform)
    session = transform.session() if transform is not None else contextlib.nullcontext()
    with ti.preserved_global_state(), session:
        scratch = not device.is_cuda and getattr(device, "kernel_scratch", True)
        tracer = Tracer(in_op_scratch=scratch, cuda_target=device.is_cuda, device=device,
                        fake_mode=fake_mode, stack=stack,
                        cudnn_benchmark=device.compute_capability
                        if config.cudnn_benchmark else None)
        prepared = preparer.prepare(fake_mode, tracer, float_dtype, training)
        twin = prepared.module
        params = list(twin.parameters())
        # storages made while building (a transform's) are retagged, others registered
        record = tracer.retag if prepared.built_under_tracer else tracer.register
        for p in params:
            record(p, Category.PARAMETERS)
        for t in prepared.stored_weights:  # absmax blocks, code books: part of the weights
            tracer.register(t, Category.PARAMETERS)
        for b in twin.buffers():
            record(b, Category.BUFFERS)
        generator = torch.Generator().manual_seed(0)
        with fake_mode:
            batch = make_batch(spec, batch_size, float_dtype, generator, config.channels_last)
        for t in ti.iter_tensors(batch):
            tracer.register(t, Category.INPUTS)
        emulation, autocast = _emulation(config, device, tracer)
        with fake_mode:
            runner = StepRunner(twin, config, batch, autocast=autocast, traced=True,
                                foreach=stack.foreach_default if device.is_cuda else False,
                                on_phase=lambda name: setattr(tracer, "phase", Phase(name)),
                                generator=generator,
                                on_paged=tracer.host_backed if device.is_cuda else None)
        _register_scaler(tracer, runner)
        grad_hooks = [p.register_post_accumulate_grad_hook(
            lambda q: tracer.retag(q.grad, Category.GRADIENTS)) for p in params if p.requires_grad]
        tracer.watch_module(transform.watched(twin) if transform is not None else twin)
        setup_end = len(tracer.events)
        marks: list[int] = []
        emulation_ctx = emulation if emulation is not None else contextlib.nullcontext()
        with guarded_run(tracer, twin, grad_hooks):
            with fake_mode, emulation_ctx, tracer, _library_context(config, device), \
                    observing(observers):
                if transform is not None:
                    transform.attach(runner, tracer)
                whole_steps = training and (step_survives or (
                    transform is not None and transform.whole_steps))
                if transform is not None and whole_steps:
                    for index in range(2):  # the first creates state, the second is steady
                        mark_steady(observers, index == 1)
                        transform.before_step(index)
                        runner.train_step()
                        _retag_optimizer_state(runner, tracer)
                        marks.append(len(tracer.events))
                elif training and step_survives:
                    # the previous step survives into the next: trace two whole steps
                    mark_steady(observers, False)
                    runner.forward_backward()
                    runner.optimizer_step()
                    _retag_optimizer_state(runner, tracer)
                    marks.append(len(tracer.events))
                    mark_steady(observers, True)
                    runner.train_step()
                elif training:
                    runner.forward_backward()
                    if config.grad_accum_steps > 1:
                        # a later micro-batch runs with the earlier ones' gradients live
                        runner.forward_backward()
                    marks.append(len(tracer.events))
                else:
                    runner.infer_step()
                end = len(tracer.events)
            optimizer_events = None
            cached = reuse is not None and reuse.optimizer_first is not None and not observers
            if training and not whole_steps and not cached:
                optimizer_events = _trace_optimizer_on_meta(params, config, device, emulation,
                                                            tracer, observers)
                if optimizer_events is None:  # it cannot run on meta tensors: on the fake twin
                    with fake_mode, emulation_ctx, tracer, _library_context(config, device), \
                            observing(observers):
                        _trace_optimizer(runner, tracer, marks, observers)
                        end = len(tracer.events)
    events = tuple(tracer.events)
    if reuse is not None and tracer.host_backed_bytes:
        reuse.host_backed_bytes = tracer.host_backed_bytes
    host_backed = tracer.host_backed_bytes or (reuse.host_backed_bytes if reuse else 0)
    if not training:
        first = steady = tuple(events[:end])
    elif whole_steps:
        first = tuple(events[:marks[0]])
        steady = as_setup(alive_at_end(first)) + tuple(events[marks[0]:end])
    else:
        if cached:
            optimizer_events = reuse.optimizer_first, reuse.optimizer_steady
        elif optimizer_events is None:  # traced on the fake twin, after forward and backward
            optimizer_events = tuple(events[marks[0]:marks[1]]), tuple(events[marks[1]:end])
        if reuse is not None:
            reuse.optimizer_first, reuse.optimizer_steady = optimizer_events
        first, steady = _spliced(events[:marks[0]], setup_end, *optimizer_events)
    traced = StepTrace(
        steady_events=steady, first_events=first, batch_size=batch_size,
        custom_ops=dict(tracer.custom_ops),
        parameter_count=sum(p.numel() for p in params),
        trainable_parameter_count=sum(p.numel() for p in params if p.requires_grad),
        largest_tensor=tracer.largest,
        largest_grid=emulation.largest_grid if emulation is not None else (0, "", ""),
        kernel_limit=_kernel_limit(tracer, emulation),
        host_backed_bytes=host_backed)
    return transform.finish(traced) if transform is not None else traced


def _spliced(forward_backward: tuple[Event, ...], setup_end: int,
             optimizer_first: tuple[Event, ...], optimizer_steady: tuple[Event, ...]
             ) -> tuple[tuple[Event, ...], tuple[Event, ...]]:
    """(first step, steady step) from one forward and backward and the two optimizer steps:
    the steady step starts with the first optimizer step's state alive (as set-up)."""
    first = forward_backward + optimizer_first
    steady = (forward_backward[:setup_end] + as_setup(alive_at_end(optimizer_first))
              + forward_backward[setup_end:] + optimizer_steady)
    return first, steady


def _emulation(config: TrainConfig, device: Target, tracer: Tracer) -> tuple[Any, Any]:
    """The CUDA emulation of a GPU target (None on a CPU), and the autocast region factory
    of the config's precision (None without autocast)."""
    from batchfit.engine.step import torch_dtype

    precision = config.precision
    stack = config.resolved_stack
    emulation = None
    # The trace runs an inference_mode step under no_grad (under inference mode a
    # dispatch mode sees composite ops such as aten.linear undecomposed); what
    # inference mode changes in memory is autocast's weight cache, switched off here.
    weight_cache = not config.inference_mode or stack.autocast_caches_in_inference_mode
    if device.is_cuda:
        from batchfit.engine.cuda_emulation import CudaEmulation

        amp = precision.autocast_dtype
        emulation = CudaEmulation(device.compute_capability,
                                  autocast_dtype=torch_dtype(amp) if amp else None,
                                  cudnn_version=stack.cudnn_version,
                                  fused_attention=stack.has_sdpa,
                                  efficient_chunks_batch=stack.efficient_attention_chunks_batch,
                                  math_sdpa_upcasts=stack.math_sdpa_upcasts,
                                  weight_cache=weight_cache,
                                  softmax_saves_input=stack.softmax_saves_input)
        autocast = emulation.autocast_region if amp else None
        emulation.where = tracer.current_module
    elif precision.autocast_dtype:
        amp_dtype = torch_dtype(precision.autocast_dtype)
        autocast = lambda: torch.autocast("cpu", dtype=amp_dtype,
                                          cache_enabled=weight_cache)
    else:
        autocast = None
    return emulation, autocast


def _kernel_limit(tracer: Tracer, emulation: Any) -> KernelLimit | None:
    """The launch nearest its limit: a traced op's, or a fused attention grid's."""
    found = tracer.kernel_limit
    if emulation is not None and emulation.largest_grid[0]:
        extent, kernel, module = emulation.largest_grid
        backend = kernel.partition("(")[2].rstrip(")") or kernel
        found = worst(found, attention_grid(extent, backend, module))
    return found


def _library_context(config: TrainConfig, device: Target) -> Any:
    """What the libraries must be told while the step runs on fake tensors: transformers'
    value-dependent mask decisions answered as on the real batch, and the workload's own
    (the chunked loss's kernel launches; bitsandbytes' CUDA dispatch); and fake_tensor's
    log of a failing meta kernel left out, since the trace reports the error itself."""
    from batchfit._logs import without_meta_failure_log
    from batchfit.engine.workloads.hfcompat import real_batch_decisions

    stack = contextlib.ExitStack()
    stack.enter_context(without_meta_failure_log())
    stack.enter_context(real_batch_decisions(packing=config.packing))
    if config.workload is not None:
        from batchfit.engine.workloads.runtime import workload_runtime

        stack.enter_context(workload_runtime(config, device))
    return stack


def _register_scaler(tracer: Tracer, runner: Any) -> None:
    """The grad scaler's scale and growth tracker exist before the step (amp-fp16)."""
    if runner.scaler is not None:
        tracer.register(runner.scaler.scale, Category.OPTIMIZER_STATE)
        tracer.register(runner.scaler.growth_tracker, Category.OPTIMIZER_STATE)


def _trace_optimizer(runner: Any, tracer: Tracer, marks: list[int],
                     observers: Sequence[StepObserver] = ()) -> None:
    """The first optimizer step (creates the state), then a steady one."""
    mark_steady(observers, False)
    runner.optimizer_step()
    _retag_optimizer_state(runner, tracer)
    marks.append(len(tracer.events))
    mark_steady(observers, True)
    runner.optimizer_step()


def _retag_optimizer_state(runner: Any, tracer: Tracer) -> None:
    """The optimizer's state, made by its first step, is optimizer state from then on."""
    optimizer = runner.optimizer
    states = getattr(optimizer, "state", None)
    if not isinstance(states, dict):
        return
    for state in states.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                tracer.retag(value, Category.OPTIMIZER_STATE)


def _trace_optimizer_on_meta(params: list[torch.Tensor], config: TrainConfig, device: Target,
                             emulation: Any, tracer: Tracer,
                             observers: Sequence[StepObserver] = ()
                             ) -> tuple[tuple[Event, ...], tuple[Event, ...]] | None:
    """The optimizer phase of :func:`_trace_optimizer`, run on meta twins of the trained
    parameters and their gradients instead of on the fake ones.

    The phase depends only on the parameters' and gradients' shapes, dtypes and strides
    (never on the batch), and a meta tensor carries exactly those. A meta op goes straight
    to its meta kernel, where a fake op first builds, hashes and looks up a cache key, so
    the phase runs several times faster (``benchmarks/trace_speed.py``), and its events
    are the same (kind, bytes, category, op, phase, module) for all 8 optimizers in 4
    precisions, on CPU and CUDA targets (tests/test_estimate.py checks this), but one:
    step counts are real CPU scalars here, as in a real step, so on a CUDA target they
    are host memory and not counted, where the fake twin (all CPU) cannot tell them
    from device tensors. The tracer's largest tensor and custom ops are merged in.

    Returns (first step, steady step), or None when the optimizer cannot run on meta
    tensors (``fused=True`` asks for a real device; a custom optimizer may read values;
    sparse gradients): the caller then traces the phase on the fake twin.
    """
    from torch import nn

    from batchfit.engine.step import StepRunner

    trained = [p for p in params if p.requires_grad]
    if any(p.grad is not None and p.grad.layout is not torch.strided for p in trained):
        return None
    twins = []
    for param in trained:
        # a DTensor (sharded) parameter's optimizer runs on its local shard
        p = ti.local_tensor(param)
        grad = param.grad
        twin = nn.Parameter(torch.empty_strided(p.shape, p.stride(), dtype=p.dtype,
                                                device="meta"))
        if grad is not None:
            g = ti.local_tensor(grad)
            if g.shape != p.shape:  # a DTensor gradient placed unlike its parameter (tensor
                return None  # parallel): the optimizer redistributes it, on the fake twin
            twin.grad = torch.empty_strided(g.shape, g.stride(), dtype=g.dtype, device="meta")
        twins.append(twin)
    # On a GPU, what an optimizer makes without a device (Adam's, Adagrad's, RMSprop's and
    # Adafactor's step counts, unless capturable or fused) is host memory: here it is a
    # real CPU tensor beside the meta ones, and not counted. On a CPU target it counts.
    meta_tracer = Tracer(in_op_scratch=tracer.in_op_scratch,
                         device_type="meta" if device.is_cuda else None, device=device)
    try:
        runner = StepRunner(nn.ParameterList(twins), config, ((), {}),
                            foreach=bool(device.is_cuda) and config.resolved_stack.foreach_default,
                            on_phase=lambda name: setattr(meta_tracer, "phase", Phase(name)),
                            on_paged=meta_tracer.host_backed if device.is_cuda else None)
    except Exception:  # noqa: BLE001 - the fake twin's trace reports it
        return None
    for twin in twins:
        meta_tracer.register(twin, Category.PARAMETERS)
        if twin.grad is not None:
            meta_tracer.register(twin.grad, Category.GRADIENTS)
    _register_scaler(meta_tracer, runner)
    start = len(meta_tracer.events)
    marks = [start]
    if emulation is not None:
        where, emulation.where = emulation.where, meta_tracer.current_module
    try:
        with emulation if emulation is not None else contextlib.nullcontext(), meta_tracer, \
                observing(observers):
            _trace_optimizer(runner, meta_tracer, marks, observers)
    except Exception:  # noqa: BLE001 - see above
        return None
    finally:
        if emulation is not None:
            emulation.where = where
    if meta_tracer.largest[0] > tracer.largest[0]:
        tracer.largest = meta_tracer.largest
    tracer.host_backed_bytes += meta_tracer.host_backed_bytes
    for op, module in meta_tracer.custom_ops.items():
        tracer.custom_ops.setdefault(op, module)
    events = meta_tracer.events
    return tuple(events[start:marks[1]]), tuple(events[marks[1]:])
