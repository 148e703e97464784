"""``batchfit.estimate``: the peak memory of one training or inference step.

Example:
    >>> import torch, batchfit
    >>> model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    >>> est = batchfit.estimate(model, (64,), batch_size=32, optimizer="adamw")
    >>> est.peak_allocated_bytes > 0
    True
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Callable

from torch import nn

from batchfit.device.allocator import AllocatorConfig
from batchfit.device.profile import DeviceProfile, marketed_memory_note, resolve_device
from batchfit.device.snapshot import SnapshotComparison, allocator_config_of, compare_step
from batchfit.device.snapshot_diff import SnapshotDiff, diff_snapshots
from batchfit.device.timeline import ModuleMemory, Timeline, needed_bytes, replay_events
from batchfit.engine.limits import KernelLimit
from batchfit.engine.spec import Precision, TrainConfig, make_config
from batchfit.engine.trace import StepTrace, TraceReuse, trace_step
from batchfit.engine.tracer import Category, Event, Phase
from batchfit.errors import InvalidInputError, option


@dataclass(frozen=True)
class MemoryEstimate:
    """The predicted memory of one step (the steady-state step for training).

    Attributes:
        batch_size: the batch size traced.
        device: the target device profile.
        peak_allocated_bytes: peak bytes of live tensors (on CUDA, with 512 B rounding).
        peak_reserved_bytes: peak bytes the caching allocator holds (= allocated on CPU).
        total_bytes: device memory needed: reserved plus the context (CUDA: the CUDA
            context; CPU: the runtime's overhead, if the profile has one).
        first_step_peak_bytes: the same total for the first step (optimizer state is created);
            None when not computed.
        by_category: bytes by :class:`~batchfit.engine.tracer.Category` at the peak; sums to total_bytes.
        peak_phase, peak_op, peak_module: where the peak happens.
        top_modules: modules holding the most activation/temporary memory at the peak.
        timeline: the per-event timeline of the step (on CUDA, the last of the
            ``timeline.loop_steps`` steps replayed until the allocator repeats a state).
        warnings: things the trace could not see.
        memory_bytes: the memory the step must fit, context included: the card's
            (``--gpu NAME``, ``--gpu NAME --memory SIZE``, a live ``cuda:N``); None on the
            CPU, which has no budget here.
        fits: ``total_bytes <= memory_bytes``; None without a budget.
        margin_bytes: ``memory_bytes - total_bytes``: what the step has to spare
            (negative: what it lacks); None without a budget.
    """

    batch_size: int
    device: DeviceProfile
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    total_bytes: int
    first_step_peak_bytes: int | None
    by_category: dict[Category, int]
    peak_phase: Phase
    peak_op: str
    peak_module: str
    top_modules: tuple[ModuleMemory, ...]
    timeline: Timeline = field(repr=False)
    parameter_count: int = 0
    trainable_parameter_count: int = 0
    warnings: tuple[str, ...] = ()
    largest_tensor: tuple[int, str, str] = (0, "", "")  # (elements, op, module)
    largest_grid: tuple[int, str, str] = (0, "", "")  # (CUDA grid y/z extent, kernel, module)
    #: the launch nearest its kernel's hard limit (32-bit indexing, grid dimension)
    kernel_limit: KernelLimit | None = None
    host_backed_bytes: int = 0  # paged optimizer state in unified memory, outside total_bytes
    #: the step set against a real CUDA memory snapshot of it (``estimate(snapshot=...)``)
    snapshot_comparison: SnapshotComparison | None = None
    #: that snapshot against the predicted one, allocation by allocation (None without a
    #: snapshot, or for expandable segments, which the predicted snapshot does not model)
    snapshot_diff: SnapshotDiff | None = None
    #: the traced steady step's events, which :meth:`predicted_snapshot` replays
    events: tuple[Event, ...] = field(default=(), repr=False, compare=False)

    def predicted_snapshot(self) -> dict[str, Any]:
        """The step as a CUDA memory snapshot (``torch.cuda.memory._snapshot()``'s format),
        for torch's memory viewer: :func:`batchfit.device.snapshot_export.predicted_snapshot`.

        Raises:
            InvalidInputError: the estimate is not for a GPU.
        """
        from batchfit.device.snapshot_export import predicted_snapshot

        return predicted_snapshot(self.events, self.device)

    @property
    def memory_bytes(self) -> int | None:
        return self.device.total_memory_bytes if self.device.is_cuda else None

    @property
    def margin_bytes(self) -> int | None:
        memory = self.memory_bytes
        return None if memory is None else memory - self.total_bytes

    @property
    def fits(self) -> bool | None:
        margin = self.margin_bytes
        return None if margin is None else margin >= 0

    def explain(self) -> str:
        """One sentence saying what dominates the peak."""
        category, size = max(self.by_category.items(), key=lambda kv: kv[1])
        share = size / self.total_bytes if self.total_bytes else 0.0
        text = f"{category.value.replace('_', ' ')} dominate: {share:.0%} at B={self.batch_size}"
        if category in (Category.ACTIVATIONS, Category.TEMPORARIES) and self.top_modules:
            top = self.top_modules[0]
            text = (f"{category.value} of layer {top.module} dominate: "
                    f"{top.bytes / self.total_bytes:.0%} of the peak at B={self.batch_size}; "
                    f"{category.value} in all: {share:.0%}")
        return f"{text} (peak in {self.peak_phase.value}, at {self.peak_op or 'setup'})"

    def to_dict(self, timeline: bool = False) -> dict[str, Any]:
        data: dict[str, Any] = {
            "batch_size": self.batch_size,
            "device": self.device.to_dict(),
            "peak_allocated_bytes": self.peak_allocated_bytes,
            "peak_reserved_bytes": self.peak_reserved_bytes,
            "total_bytes": self.total_bytes,
            "memory_bytes": self.memory_bytes,
            "fits": self.fits,
            "margin_bytes": self.margin_bytes,
            "first_step_peak_bytes": self.first_step_peak_bytes,
            "loop_steps": self.timeline.loop_steps,
            "by_category": {c.value: b for c, b in self.by_category.items()},
            "peak_phase": self.peak_phase.value,
            "peak_op": self.peak_op,
            "peak_module": self.peak_module,
            "top_modules": [m.to_dict() for m in self.top_modules],
            "parameter_count": self.parameter_count,
            "trainable_parameter_count": self.trainable_parameter_count,
            "explanation": self.explain(),
            "warnings": list(self.warnings),
            "largest_tensor_elements": self.largest_tensor[0],
            "largest_grid_dim": self.largest_grid[0],
            "kernel_limit": None if self.kernel_limit is None else {
                "kind": self.kernel_limit.kind.value, "measure": self.kernel_limit.measure,
                "limit": self.kernel_limit.limit, "op": self.kernel_limit.op,
                "kernel": self.kernel_limit.kernel, "module": self.kernel_limit.module},
            "host_backed_bytes": self.host_backed_bytes,
        }
        if self.snapshot_comparison is not None:
            data["snapshot_comparison"] = self.snapshot_comparison.to_dict()
        if self.snapshot_diff is not None:
            data["snapshot_diff"] = self.snapshot_diff.to_dict()
        if timeline:
            data["timeline"] = self.timeline.to_dict()
        return data


def estimate(model: nn.Module | Callable[[], nn.Module], inputs: Any, batch_size: int,
             config: TrainConfig | None = None, *, device: DeviceProfile | str | None = None,
             reuse: TraceReuse | None = None, first_step: bool = True,
             snapshot: dict[str, Any] | None = None, **options: Any) -> MemoryEstimate:
    """Predict the peak memory of one step of ``model`` at ``batch_size``, on fake tensors.

    Args:
        model: an ``nn.Module`` (never modified) or a zero-argument factory that builds one
            (preferred for big models: it is built on the meta device).
        inputs: the per-sample input: a :class:`~batchfit.engine.spec.TensorSpec`, a shape tuple,
            an example tensor without the batch dimension, or a tuple/dict of those.
        batch_size: the batch size to predict.
        config: a :class:`~batchfit.engine.spec.TrainConfig`; or give its fields as ``options``
            (``mode``, ``optimizer``, ``precision``, ``checkpointing``, ...).
        device: ``"cpu"`` (default), a catalog GPU name, or a :class:`DeviceProfile`.
        reuse: a :class:`~batchfit.engine.trace.TraceReuse` shared by estimates of the same
            model, config and device at other batch sizes (builds the model once and
            traces the optimizer step once).
        first_step: also replay the first step (``first_step_peak_bytes``; None if False).
        snapshot: a real CUDA memory snapshot of this step on the target
            (:func:`batchfit.device.snapshot.load_snapshot`): the estimate then carries a
            :class:`~batchfit.device.snapshot.SnapshotComparison` of the two and a
            :class:`~batchfit.device.snapshot_diff.SnapshotDiff` (``snapshot_diff``), and replays
            with the snapshot's allocator options unless ``alloc_conf`` is given.

    Returns:
        A :class:`MemoryEstimate`.

    Example:
        >>> import torch, batchfit
        >>> est = batchfit.estimate(torch.nn.Linear(1024, 1024), (1024,), 64, optimizer="sgd")
        >>> est.by_category[batchfit.Category.PARAMETERS]
        4198400
    """
    config = make_config(config, options)
    alloc_conf = config.alloc_conf
    if alloc_conf is None and snapshot is not None:  # the options the recorded process ran with
        alloc_conf = allocator_config_of(snapshot)
    profile = step_profile(device, config, alloc_conf)
    if snapshot is not None and not profile.is_cuda:
        raise InvalidInputError("a CUDA memory snapshot is compared with a CUDA target: "
                                f"give a GPU ({option('gpu', 'NAME')} or "
                                f"{option('device', 'cuda')})")
    trace = trace_step(model, inputs, batch_size, config, profile, reuse)
    return summarize(trace, profile, first_step=first_step, snapshot=snapshot)


def step_profile(device: DeviceProfile | str | None, config: TrainConfig,
                 alloc_conf: Any = None) -> DeviceProfile:
    """The target a step of ``config`` is predicted on: ``device`` with the CUDA context
    of the config's stack and its caching-allocator options (``alloc_conf`` instead of
    the config's, when given: a snapshot's).

    Raises:
        InvalidInputError: the config computes in bfloat16 on an NVIDIA card without it.
    """
    profile = resolve_device(device)
    check_precision(profile, config.precision)
    return profile.for_stack(config.resolved_stack).with_allocator(
        AllocatorConfig.resolve(config.alloc_conf if alloc_conf is None else alloc_conf))


_BF16 = (Precision.AMP_BF16, Precision.BF16)


def check_precision(profile: DeviceProfile, precision: Precision) -> None:
    """bfloat16 needs an NVIDIA card of compute capability 8.0 or newer (Ampere): earlier
    ones (V100, T4) have no bf16 tensor cores and no bf16 arithmetic, so a bf16 step there
    is not what anyone trains with; fp16 autocast is their mixed precision."""
    cc = profile.compute_capability
    if profile.is_cuda and precision in _BF16 and cc is not None and cc < (8, 0):
        raise InvalidInputError(
            f"{option('precision', precision.value)} needs bfloat16, which {profile.name} "
            f"(compute capability {cc[0]}.{cc[1]}) lacks (it needs 8.0+, Ampere or newer): use "
            f"{option('precision', 'amp-fp16' if precision is Precision.AMP_BF16 else 'fp16')}"
            ", or a newer card")


def summarize(trace: StepTrace, device: DeviceProfile, first_step: bool = True,
              snapshot: dict[str, Any] | None = None) -> MemoryEstimate:
    """Turn a trace into an estimate on ``device`` (and set it against ``snapshot``)."""
    steady = replay_events(trace.steady_events, device)
    comparison = None if snapshot is None else compare_step(
        snapshot, trace.steady_events, steady.peak_allocated_bytes, steady.peak_reserved_bytes)
    overhead = device.outside_allocator_bytes
    diff = None if snapshot is None else _diff(snapshot, trace.steady_events, device)
    if trace.first_events is trace.steady_events:
        first_peak: int | None = steady.peak_reserved_bytes + overhead
    elif first_step:
        first_peak = needed_bytes(trace.first_events, device, loop=False) + overhead
    else:
        first_peak = None
    warnings = tuple(
        f"custom op {op} in module '{module or '<root>'}': only its outputs are traced"
        for op, module in trace.custom_ops.items())
    if (marketed := marketed_memory_note(device)) is not None:
        warnings += (marketed,)
    return MemoryEstimate(
        batch_size=trace.batch_size, device=device,
        peak_allocated_bytes=steady.peak_allocated_bytes,
        peak_reserved_bytes=steady.peak_reserved_bytes,
        total_bytes=steady.peak_reserved_bytes + overhead,
        first_step_peak_bytes=first_peak,
        by_category=steady.by_category, peak_phase=steady.peak_phase, peak_op=steady.peak_op,
        peak_module=steady.peak_module, top_modules=steady.top_modules, timeline=steady,
        parameter_count=trace.parameter_count,
        trainable_parameter_count=trace.trainable_parameter_count, warnings=warnings,
        largest_tensor=trace.largest_tensor, largest_grid=trace.largest_grid,
        kernel_limit=trace.kernel_limit,
        host_backed_bytes=trace.host_backed_bytes, snapshot_comparison=comparison,
        snapshot_diff=diff,
        events=tuple(trace.steady_events))


def _diff(snapshot: dict[str, Any], events: Sequence[Event],
          device: DeviceProfile) -> SnapshotDiff | None:
    """The real snapshot against the predicted one of the steady step (None for expandable
    segments, which the predicted snapshot does not model)."""
    if device.allocator.expandable_segments:
        return None
    from batchfit.device.snapshot_export import predicted_snapshot

    return diff_snapshots(snapshot, predicted_snapshot(events, device))
