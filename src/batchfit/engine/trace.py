"""Trace one step on fake tensors: build the fake twin of the model (or hand a Keras model
to :mod:`batchfit.engine.keras_trace`, a sharded rank to its :class:`StepTransform`), run
the step under :class:`batchfit.engine.tracer.Tracer`, which records every storage
allocation and free with its category, module, op and phase, and split the events into
the first step and the steady one (:class:`StepTrace`).

Known limitations: see :mod:`batchfit.engine.tracer`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from typing import Any, Protocol, Sequence

import torch
from torch import nn

from batchfit._gc import old_objects_frozen
from batchfit.engine import _torch_internals as ti
from batchfit.engine.limits import KernelLimit, attention_grid, worst
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


_SHAPE_WORDS = ("shape", "size", "dimension", "expected input", "mat1 and mat2", "channels",
                "must match", "out of range", "index out of", "dtype", "scalar type")


def _translate_error(exc: BaseException, tracer: Tracer, model: nn.Module, phase: Phase) -> Exception:
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
                w in text for w in _SHAPE_WORDS):
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


class StepTransform(Protocol):
    """Another way to build and run the traced step: one rank of a sharded step.

    :mod:`batchfit.sharding` implements it (DDP, FSDP, DeepSpeed ZeRO, tensor parallel):
    :func:`trace_step` enters :meth:`session` around the whole trace, builds the module
    with :meth:`build` while the tracer records (so memory created or freed while
    wrapping is seen), calls :meth:`attach` once the step's runner exists and, with
    :attr:`whole_steps`, :meth:`before_step` before each of the two traced steps.
    """

    def session(self) -> contextlib.AbstractContextManager[Any]:
        """The process-wide state the trace needs (a fake process group), undone after."""

    def build(self, meta_model: nn.Module, fake_mode: Any, tracer: Tracer,
              float_dtype: torch.dtype | None, checkpointing: bool) -> nn.Module:
        """The module the step runs, with fake tensors, from a model built on meta (or the
        user's module, which must not be changed: copy it)."""

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
                _workload_model(model, config, self)
            else:
                _meta_model(model, self, None if config is None else config.precision.value)


def _meta_model(model: Any, reuse: TraceReuse | None, precision: str | None = None) -> Any:
    """The model to copy from: the user's module, or the factory's output built once."""
    from batchfit.engine.fake import build_on_meta

    if reuse is None or isinstance(model, nn.Module) or not callable(model):
        return model
    if reuse.meta_model is None:
        reuse.meta_model = build_on_meta(model, precision)
    return reuse.meta_model


def _workload_model(model: Any, config: Any, reuse: TraceReuse | None) -> tuple[Any, dict]:
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
        meta = _meta_model(model, reuse)
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
    if config.loss in (LossKind.NATIVE, LossKind.CHUNKED_OUTPUT):
        from batchfit.engine.workloads.losses import apply_framework_loss

        apply_framework_loss(transformed, config.loss)
    if config.transformers_version is not None:
        from batchfit.engine.workloads.hfloss import apply_transformers_loss

        apply_transformers_loss(transformed, config.transformers_version)
    built = (transformed, quant_attributes(transformed) if config.quant is not None else {})
    if reuse is not None:
        reuse.workload_model = built
    return built


def _workload_checkpointing(config: Any) -> bool:
    """Whether the workload already turned checkpointing on (peft's
    ``prepare_model_for_kbit_training`` does, with the given ``use_reentrant``)."""
    return config.quant is not None and config.quant.prepare


@old_objects_frozen()
def trace_step(model: Any, inputs: Any, batch_size: int, config: Any, device: Any,
               reuse: TraceReuse | None = None,
               transform: StepTransform | None = None) -> StepTrace:
    """Trace one step of ``model`` at ``batch_size`` on fake tensors.

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
    """
    from batchfit.engine.fake import enable_checkpointing, fake_copy
    from batchfit.engine.spec import Mode
    from batchfit.engine.step import (
        StepRunner,
        make_batch,
        normalize_input_spec,
        torch_dtype,
    )
    from batchfit.errors import BatchfitError, InvalidInputError

    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise InvalidInputError(f"batch size must be a positive integer, not {batch_size!r}")
    from batchfit.engine.fake import build_on_meta
    from batchfit.engine.keras_step import is_keras_model

    workload = config.workload
    base, owned = None, False
    if workload is None:  # a workload's model is built (and transformed) by _workload_model
        with ti.preserved_global_state():
            base = _meta_model(model, reuse, config.precision.value)
            owned = not isinstance(base, nn.Module) and callable(base)  # a factory, no reuse
            if owned:
                base = build_on_meta(base, config.precision.value)
    if base is not None and is_keras_model(base):
        from batchfit.engine.keras_trace import trace_keras_step

        return trace_keras_step(base, base is model, inputs, batch_size, config, device, reuse)
    spec = normalize_input_spec(inputs)
    precision = config.precision
    float_dtype = None if precision.weight_dtype == "float32" else torch_dtype(precision.weight_dtype)
    training = config.mode is Mode.TRAIN
    stack = config.resolved_stack
    # gradients live into the next step's forward (zeroed in place, or zeroed after it)
    grads_survive = not config.zero_grad_to_none or config.zero_grad_after_forward
    fake_mode = ti.new_fake_mode()
    if workload is not None and workload.loss.value == "chunked" and not device.is_cuda:
        raise InvalidInputError(
            "--loss chunked is Liger-Kernel's fused cross-entropy, whose Triton kernels run "
            "on GPUs only: use a GPU target (--gpu NAME) or --loss standard")
    if workload is not None and transform is not None:
        raise InvalidInputError(
            "LLM workloads (--lora, --quant, --loss chunked) are not traced under a sharding "
            "strategy yet: drop --strategy/--world-size, or the workload options")
    session = transform.session() if transform is not None else contextlib.nullcontext()
    with ti.preserved_global_state(), session:
        scratch = not device.is_cuda and getattr(device, "kernel_scratch", True)
        tracer = Tracer(in_op_scratch=scratch, cuda_target=device.is_cuda, device=device,
                        fake_mode=fake_mode, stack=stack,
                        cudnn_benchmark=device.compute_capability
                        if config.cudnn_benchmark else None)
        quant_state: list[torch.Tensor] = []
        if transform is not None:
            source = base
            try:
                with fake_mode, tracer:
                    twin = transform.build(source, fake_mode, tracer, float_dtype,
                                           config.checkpointing and training)
            except BatchfitError:
                raise
            except Exception as exc:
                raise _translate_error(exc, tracer, source, Phase.SETUP) from exc
        elif workload is None:
            twin = fake_copy(base, fake_mode, float_dtype=float_dtype,
                             channels_last=config.channels_last, owned=owned)
        else:
            from batchfit.engine.workloads.quantstate import install_fake_quant_state

            source, attributes = _workload_model(model, config, reuse)
            twin = fake_copy(source, fake_mode, channels_last=config.channels_last)
            quant_state = install_fake_quant_state(twin, attributes, fake_mode, device.is_cuda)
        if transform is None and config.checkpointing and training and not (
                workload is not None and _workload_checkpointing(config)):
            enable_checkpointing(twin, config.use_reentrant)
        params = list(twin.parameters())
        # storages made while building (a transform's) are retagged, others registered
        record = tracer.register if transform is None else tracer.retag
        for p in params:
            record(p, Category.PARAMETERS)
        for t in quant_state:  # absmax blocks, code books: part of the stored weights
            tracer.register(t, Category.PARAMETERS)
        for b in twin.buffers():
            record(b, Category.BUFFERS)
        generator = torch.Generator().manual_seed(0)
        with fake_mode:
            batch = make_batch(spec, batch_size, float_dtype, generator, config.channels_last)
        for t in ti.iter_tensors(batch):
            tracer.register(t, Category.INPUTS)
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
            autocast = lambda: torch.autocast("cpu", dtype=amp_dtype,  # noqa: E731
                                              cache_enabled=weight_cache)
        else:
            autocast = None
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
        try:
            with fake_mode, emulation_ctx, tracer, _library_context(config, device):
                if transform is not None:
                    transform.attach(runner, tracer)
                whole_steps = training and (grads_survive or (
                    transform is not None and transform.whole_steps))
                if transform is not None and whole_steps:
                    for index in range(2):  # the first creates state, the second is steady
                        transform.before_step(index)
                        runner.train_step()
                        _retag_optimizer_state(runner, tracer)
                        marks.append(len(tracer.events))
                elif training and grads_survive:
                    # gradients survive into the next step: trace two whole steps
                    runner.forward_backward()
                    runner.optimizer_step()
                    _retag_optimizer_state(runner, tracer)
                    marks.append(len(tracer.events))
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
            if training and not whole_steps and (reuse is None or reuse.optimizer_first is None):
                optimizer_events = _trace_optimizer_on_meta(params, config, device, emulation,
                                                            tracer)
                if optimizer_events is None:  # it cannot run on meta tensors: on the fake twin
                    with fake_mode, emulation_ctx, tracer, _library_context(config, device):
                        _trace_optimizer(runner, tracer, marks)
                        end = len(tracer.events)
        except BatchfitError:
            raise
        except Exception as exc:  # noqa: BLE001 - translated into one clear line
            raise _translate_error(exc, tracer, twin, tracer.phase) from exc
        finally:
            for hook in grad_hooks:
                hook.remove()
    events = tracer.events
    if reuse is not None and tracer.host_backed_bytes:
        reuse.host_backed_bytes = tracer.host_backed_bytes
    host_backed = tracer.host_backed_bytes or (reuse.host_backed_bytes if reuse else 0)
    if training and whole_steps:
        first = tuple(events[:marks[0]])
        steady = _as_setup(alive_at_end(first)) + tuple(events[marks[0]:end])
    elif training:
        fwd_bwd_end = marks[0]
        if reuse is not None and reuse.optimizer_first is not None:
            opt_first, opt_steady = reuse.optimizer_first, reuse.optimizer_steady
        elif optimizer_events is not None:
            opt_first, opt_steady = optimizer_events
            if reuse is not None:
                reuse.optimizer_first, reuse.optimizer_steady = opt_first, opt_steady
        else:
            opt_first = tuple(events[fwd_bwd_end:marks[1]])
            opt_steady = tuple(events[marks[1]:end])
            if reuse is not None:
                reuse.optimizer_first, reuse.optimizer_steady = opt_first, opt_steady
        first = tuple(events[:fwd_bwd_end]) + opt_first
        steady = (tuple(events[:setup_end]) + _as_setup(alive_at_end(opt_first))
                  + tuple(events[setup_end:fwd_bwd_end]) + opt_steady)
    else:
        first = steady = tuple(events[:end])
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


def _kernel_limit(tracer: Tracer, emulation: Any) -> KernelLimit | None:
    """The launch nearest its limit: a traced op's, or a fused attention grid's."""
    found = tracer.kernel_limit
    if emulation is not None and emulation.largest_grid[0]:
        extent, kernel, module = emulation.largest_grid
        backend = kernel.partition("(")[2].rstrip(")") or kernel
        found = worst(found, attention_grid(extent, backend, module))
    return found


def _library_context(config: Any, device: Any) -> Any:
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


def _trace_optimizer(runner: Any, tracer: Tracer, marks: list[int]) -> None:
    """The first optimizer step (creates the state), then a steady one."""
    runner.optimizer_step()
    _retag_optimizer_state(runner, tracer)
    marks.append(len(tracer.events))
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


def _trace_optimizer_on_meta(params: list[torch.Tensor], config: Any, device: Any,
                             emulation: Any, tracer: Tracer
                             ) -> tuple[tuple[Event, ...], tuple[Event, ...]] | None:
    """The optimizer phase of :func:`_trace_optimizer`, run on meta twins of the trained
    parameters and their gradients instead of on the fake ones.

    The phase depends only on the parameters' and gradients' shapes, dtypes and strides
    (never on the batch), and a meta tensor carries exactly those. A meta op goes straight
    to its meta kernel, where a fake op first builds, hashes and looks up a cache key. With
    amp-fp16 AdamW on an RTX 3090 profile the phase took 0.15 s instead of 0.52 s for
    ResNet-50 and 0.05 s instead of 0.18 s for ResNet-18 (medians of 4), and its events
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
        with emulation if emulation is not None else contextlib.nullcontext(), meta_tracer:
            _trace_optimizer(runner, meta_tracer, marks)
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


def _as_setup(events: tuple[Event, ...]) -> tuple[Event, ...]:
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
