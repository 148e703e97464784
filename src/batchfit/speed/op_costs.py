"""The ops of a step and what each costs, as functions of the batch size.

The step (the one :mod:`batchfit.engine.step` defines) runs once on fake tensors, in the
step driver (:func:`batchfit.engine.driver.drive_step`) that also records its memory: the
same preparers (LLM workload, Keras, sharding), library context, stack and CUDA emulation.
The op-cost recorder here is one of the driver's observers, counting under
``torch.utils.flop_counter``'s formulas. Every aten op that launches work becomes an
:class:`OpCost`:
its kind (:class:`~batchfit.speed.rates.OpKind`: matmul; convolution forward or backward, at stride 1
or strided; fused attention, batch norm and layer norm, forward or backward;
other), its FLOPs (the counter's formulas), the bytes it moves (its tensor
inputs plus its outputs), the GEMM shapes it runs (convolutions as implicit
GEMMs) and the bytes of each output it allocates. Views and bare allocations
move nothing and launch nothing; they are skipped.

Batch sizes. The per-op costs are affine in the batch size for most models
(M = B x H x W, bytes = a + b x B), so the step is traced at three batch sizes
(4, 5, 8), fitted exactly on the first two and checked on the third; any batch
then costs no trace, which is what lets :func:`predict_throughput` scan every
batch size near the knee for wave boundaries. A model whose costs are not
affine (a B x B similarity matrix) is traced at each requested batch instead.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from batchfit.engine.spec import TrainConfig, make_config
from batchfit.errors import InvalidInputError
from batchfit.speed.gemm import gemm_waves, pad_to, tile_extent
from batchfit.speed.rates import OP_KINDS, OpKind, RooflineProfile, op_kind

if TYPE_CHECKING:
    from batchfit.engine.step_trace import StepTrace

#: The step is traced at these batch sizes to fit costs affine in the batch (see docstring).
FIT_BATCHES = (4, 5, 8)


# -- tracing the ops ---------------------------------------------------------------------------


@dataclass(frozen=True)
class GemmShape:
    """``count`` GEMMs of M x N x K (output M x N, reduction K)."""

    m: int
    n: int
    k: int
    count: int = 1


@dataclass(frozen=True)
class OpCost:
    """One op of the step: its FLOPs, the bytes it moves, the GEMMs it runs and the bytes
    of each output it allocates (in-place results and views allocate nothing)."""

    op: str
    flops: int
    bytes_moved: int
    gemms: tuple[GemmShape, ...] = ()
    allocated: tuple[int, ...] = ()
    kind: OpKind | None = None  #: None: from the op's name (:func:`op_kind`)

    def __post_init__(self) -> None:
        if self.kind is None:
            object.__setattr__(self, "kind", op_kind(self.op))


def _op_sets() -> tuple[set, set, set]:
    import torch

    aten = torch.ops.aten
    free = {aten._unsafe_view.default, aten.empty.memory_format, aten.empty_strided.default,
            aten.empty_like.default, aten.new_empty.default, aten.new_empty_strided.default,
            aten.lift_fresh.default, aten.detach.default, aten.alias.default}
    matmuls = {aten.mm, aten.addmm, aten.bmm, aten.baddbmm}
    convs = {aten.convolution, aten.convolution_backward}
    return free, matmuls, convs


def _extra_flop_formulas() -> dict[Any, Any]:
    """FLOP formulas torch lacks: CPU flash attention counts as the CUDA kernels do."""
    import torch
    from torch.utils import flop_counter

    aten = torch.ops.aten
    found = {}
    for op, like in (("_scaled_dot_product_flash_attention_for_cpu",
                      aten._scaled_dot_product_flash_attention),
                     ("_scaled_dot_product_flash_attention_for_cpu_backward",
                      aten._scaled_dot_product_flash_attention_backward)):
        packet = getattr(aten, op, None)
        if packet is not None and packet not in flop_counter.flop_registry:
            found[packet] = _raw_formula(flop_counter.flop_registry[like])
    return found


def _raw_formula(formula: Any) -> Any:
    """A registered (already shape-wrapped) formula, marked so ``FlopCounterMode`` does not
    wrap it again (the CPU profile counts with the mode)."""
    def count(*args: Any, out_val: Any = None, **kwargs: Any) -> int:
        return formula(*args, out_val=out_val, **kwargs)

    count._get_raw = True  # type: ignore[attr-defined]
    return count


def _tensor_bytes(tensor: Any) -> int:
    nbytes = tensor.numel() * tensor.element_size()
    try:  # an expanded tensor reads its storage, not numel elements
        return min(nbytes, tensor.untyped_storage().nbytes())
    except (RuntimeError, NotImplementedError):
        return nbytes


def _prod(values: Sequence[int]) -> int:
    return math.prod(int(v) for v in values)


def _gemm_shapes(packet: Any, args: tuple, out: Any) -> tuple[GemmShape, ...]:
    """The GEMMs a matmul or a dense convolution runs (implicit GEMM for convolutions)."""
    import torch

    aten = torch.ops.aten
    if packet in (aten.mm, aten.addmm):
        a, b = (args[0], args[1]) if packet is aten.mm else (args[1], args[2])
        return (GemmShape(int(a.shape[0]), int(b.shape[1]), int(a.shape[1])),)
    if packet in (aten.bmm, aten.baddbmm):
        a, b = (args[0], args[1]) if packet is aten.bmm else (args[1], args[2])
        return (GemmShape(int(a.shape[1]), int(b.shape[2]), int(a.shape[2]), int(a.shape[0])),)
    if packet is aten.convolution:
        weight, transposed, groups = args[1], args[6], args[8]
        if transposed or groups != 1:
            return ()
        return (GemmShape(int(out.shape[0]) * _prod(out.shape[2:]), int(weight.shape[0]),
                          _prod(weight.shape[1:])),)
    if packet is aten.convolution_backward:
        grad_out, inp, weight = args[0], args[1], args[2]
        transposed, groups, mask = args[7], args[9], args[10]
        if transposed or groups != 1:
            return ()
        kernel = _prod(weight.shape[2:])
        shapes = []
        if mask[0]:  # data gradient
            shapes.append(GemmShape(int(inp.shape[0]) * _prod(inp.shape[2:]), int(inp.shape[1]),
                                    int(weight.shape[0]) * kernel))
        if mask[1]:  # weight gradient
            shapes.append(GemmShape(int(weight.shape[0]), int(weight.shape[1]) * kernel,
                                    int(grad_out.shape[0]) * _prod(grad_out.shape[2:])))
        return tuple(shapes)
    return ()


class _CostRecorder:
    """The op-cost observer of the step driver (:class:`batchfit.engine.observers.StepObserver`):
    turns each aten op of the steady step into an :class:`OpCost`, its FLOPs from
    ``FlopCounterMode``'s formulas. The formulas are called directly rather than through
    the mode, which decomposes ops it has no formula for: the memory tracer below must see
    the ops the step runs, not their decompositions."""

    def __init__(self) -> None:
        from torch.utils.flop_counter import flop_registry

        from batchfit.engine import _torch_internals as ti

        self.ops: list[OpCost] = []
        self.recording = True
        self._formulas = {**flop_registry, **_extra_flop_formulas()}
        self._free, matmuls, convs = _op_sets()
        self._gemm_ops = matmuls | convs
        self.interceptor = ti.OpInterceptor(self._on_output, lambda func, exc: None)

    def steady(self, flag: bool) -> None:
        self.recording = flag

    @contextlib.contextmanager
    def observing(self) -> Iterator[None]:
        from batchfit.engine.sdpa import watching_fused_attention

        with self.interceptor, watching_fused_attention(self._on_attention):
            yield

    def _on_output(self, func: Any, args: tuple, out: Any) -> None:
        from batchfit.engine import _torch_internals as ti

        if not self.recording or getattr(func, "is_view", False) or func in self._free:
            return
        outputs = list(ti.iter_tensors(out))
        if not outputs:
            return
        inputs = list(ti.iter_tensors(args))
        moved = sum(_tensor_bytes(t) for t in inputs) + sum(_tensor_bytes(t) for t in outputs)
        packet = func.overloadpacket
        formula = self._formulas.get(packet, self._formulas.get(func))
        flops = formula(*args, out_val=out) if formula is not None else 0
        gemms = _gemm_shapes(packet, args, out) if packet in self._gemm_ops else ()
        self.ops.append(OpCost(str(func), int(flops), int(moved), gemms,
                               _allocated_bytes(inputs, outputs),
                               op_kind(str(func), _strided(packet, args))))

    def _on_attention(self, backend: Any, backward: bool, inputs: tuple, outputs: tuple) -> None:
        """A fused attention kernel (:func:`batchfit.engine.sdpa.watching_fused_attention`),
        named and counted as torch's ``_scaled_dot_product_<backend>_attention`` ops."""
        from torch.utils import flop_counter

        if not self.recording:
            return
        if backward:
            grad_out, query, key, value = inputs[:4]
            flops = flop_counter.sdpa_backward_flop_count(grad_out.shape, query.shape, key.shape,
                                                          value.shape)
        else:
            query, key, value = inputs
            flops = flop_counter.sdpa_flop_count(query.shape, key.shape, value.shape)
        name = f"aten._scaled_dot_product_{backend.value}_attention{'_backward' if backward else ''}"
        moved = sum(_tensor_bytes(t) for t in (*inputs, *outputs) if t is not None)
        self.ops.append(OpCost(f"{name}.default", int(flops), int(moved),
                               allocated=tuple(_tensor_bytes(t) for t in outputs)))


def _strided(packet: Any, args: tuple) -> bool:
    """A convolution (forward or backward) with a stride above 1."""
    import torch

    aten = torch.ops.aten
    position = {aten.convolution: 3, aten.convolution_backward: 4}.get(packet)
    if position is None or len(args) <= position:
        return False
    return any(int(step) > 1 for step in args[position])


def _allocated_bytes(inputs: list, outputs: list) -> tuple[int, ...]:
    """Storage bytes of each output that is not the storage of an input (nor a repeat)."""
    from batchfit.engine import _torch_internals as ti

    seen = {key[0] for key in map(ti.storage_key, inputs) if key is not None}
    found = []
    for tensor in outputs:
        key = ti.storage_key(tensor)
        if key is None or key[0] in seen:
            continue
        seen.add(key[0])
        found.append(int(key[1].nbytes()))
    return tuple(found)


def trace_op_costs(model: Any, inputs: Any, batch_size: int, config: TrainConfig | None = None,
                   *, device: Any = None, **options: Any) -> tuple[OpCost, ...]:
    """The ops of one steady-state step at ``batch_size``, traced on fake tensors.

    Training: forward and backward of a step, then an optimizer step whose state
    already exists (the first optimizer step, which creates it, is not recorded).

    Args:
        model: an ``nn.Module`` (never modified), a Keras model or a factory.
        inputs: the per-sample input spec.
        device: ``"cpu"``, a catalog GPU name or a DeviceProfile: a CUDA target runs
            CUDA's autocast policy, attention kernels and the stack's optimizer default,
            as the memory trace does (it is the same pass: :func:`trace_step_and_costs`).

    Example:
        >>> import torch
        >>> ops = trace_op_costs(lambda: torch.nn.Linear(64, 32), (64,), 16, mode="infer")
        >>> [(op.op, op.flops, op.gemms[0]) for op in ops if op.gemms]
        [('aten.addmm.default', 65536, GemmShape(m=16, n=32, k=64, count=1))]
    """
    from batchfit.device.profile import resolve_device

    config = make_config(config, options)
    return trace_step_and_costs(model, inputs, batch_size, config, resolve_device(device))[1]


def trace_step_and_costs(model: Any, inputs: Any, batch_size: int, config: TrainConfig,
                         device: Any, reuse: Any = None) -> tuple[StepTrace, tuple[OpCost, ...]]:
    """The memory trace (:class:`~batchfit.engine.trace.StepTrace`) and the op costs of one
    step at ``batch_size``, from one pass of the step driver on ``device`` (a
    :class:`~batchfit.device.profile.DeviceProfile`)."""
    from batchfit.engine.driver import drive_step

    recorder = _CostRecorder()
    traced = drive_step(model, inputs, batch_size, config, device, reuse,
                        observers=(recorder,))
    return traced, tuple(recorder.ops)


# -- costs as functions of the batch size ----------------------------------------------------


@dataclass(frozen=True, eq=False)
class StepCosts:
    """Per-op costs as affine functions of the batch size: ``q(B) = q0 + q1 * B``.

    Arrays (numpy): ``flops`` and ``bytes_moved`` of shape (ops, 2); ``kind`` per op
    (an index into :data:`OP_KINDS`); ``gemm_op`` (gemms,) the op each GEMM belongs
    to; ``gemm_dims`` (gemms, 4, 2): M, N, K, count, each affine; ``alloc_op``
    (allocations,) the op each allocated output belongs to; ``alloc_bytes``
    (allocations, 2) its bytes. ``batch_size`` is None when the costs hold at every
    batch, else the one batch they were traced at.
    """

    ops: tuple[str, ...]
    flops: Any
    bytes_moved: Any
    kind: Any
    gemm_op: Any
    gemm_dims: Any
    alloc_op: Any
    alloc_bytes: Any
    batch_size: int | None = None

    def at(self, batch_size: int) -> tuple[OpCost, ...]:
        """The :class:`OpCost` s at ``batch_size``."""
        if self.batch_size is not None and batch_size != self.batch_size:
            raise InvalidInputError(f"these costs hold at batch {self.batch_size} only")
        gemms: dict[int, list[GemmShape]] = {}
        for op, dims in zip(self.gemm_op.tolist(), self.gemm_dims.tolist()):
            m, n, k, count = (int(a + b * batch_size) for a, b in dims)
            gemms.setdefault(op, []).append(GemmShape(m, n, k, count))
        allocated: dict[int, list[int]] = {}
        for op, (a, b) in zip(self.alloc_op.tolist(), self.alloc_bytes.tolist()):
            allocated.setdefault(op, []).append(int(a + b * batch_size))
        return tuple(
            OpCost(name, int(f[0] + f[1] * batch_size), int(b[0] + b[1] * batch_size),
                   tuple(gemms.get(i, ())), tuple(allocated.get(i, ())), OP_KINDS[kind])
            for i, (name, f, b, kind) in enumerate(
                zip(self.ops, self.flops.tolist(), self.bytes_moved.tolist(), self.kind.tolist())))


def _arrays(ops: Sequence[OpCost]) -> dict[str, Any]:
    import numpy as np

    return {
        "flops": np.array([op.flops for op in ops], dtype=np.int64),
        "bytes_moved": np.array([op.bytes_moved for op in ops], dtype=np.int64),
        "kind": np.array([OP_KINDS.index(op.kind) for op in ops], dtype=np.int8),
        "gemm_op": np.array([i for i, op in enumerate(ops) for _ in op.gemms], dtype=np.int64),
        "gemm_dims": np.array([[g.m, g.n, g.k, g.count] for op in ops for g in op.gemms],
                              dtype=np.int64).reshape(-1, 4),
        "alloc_op": np.array([i for i, op in enumerate(ops) for _ in op.allocated], dtype=np.int64),
        "alloc_bytes": np.array([n for op in ops for n in op.allocated], dtype=np.int64),
    }


#: The per-op quantities that are affine in the batch size.
_AFFINE = ("flops", "bytes_moved", "gemm_dims", "alloc_bytes")


def constant_costs(ops: Sequence[OpCost], batch_size: int) -> StepCosts:
    """Costs traced at one batch size, valid at that batch only."""
    import numpy as np

    arrays = _arrays(ops)
    for name in _AFFINE:
        arrays[name] = np.stack([arrays[name], np.zeros_like(arrays[name])], -1)
    return StepCosts(tuple(op.op for op in ops), batch_size=batch_size, **arrays)


def fit_costs(traces: dict[int, Sequence[OpCost]]) -> StepCosts | None:
    """Affine costs from traces at three batch sizes, the first two consecutive; None if
    the ops differ between traces or a cost is not affine in the batch size."""
    import numpy as np

    (b1, ops1), (b2, ops2), (b3, ops3) = sorted(traces.items())[:3]
    if b2 != b1 + 1:
        raise InvalidInputError("fit_costs needs two consecutive batch sizes first, e.g. 4, 5, 8")
    if not len(ops1) == len(ops2) == len(ops3):
        return None
    if any(len({a.op, b.op, c.op}) != 1 or len({len(a.gemms), len(b.gemms), len(c.gemms)}) != 1
           or len({len(a.allocated), len(b.allocated), len(c.allocated)}) != 1
           for a, b, c in zip(ops1, ops2, ops3)):
        return None
    a1, a2, a3 = _arrays(ops1), _arrays(ops2), _arrays(ops3)
    for name in _AFFINE:
        slope = a2[name] - a1[name]  # integer: b2 - b1 = 1
        intercept = a1[name] - slope * b1
        if not np.array_equal(intercept + slope * b3, a3[name]):
            return None
        a1[name] = np.stack([intercept, slope], -1)
    return StepCosts(tuple(op.op for op in ops1), **a1)


def step_costs(model: Any, inputs: Any, config: TrainConfig, device: Any,
               batch_sizes: Sequence[int] = FIT_BATCHES) -> StepCosts | None:
    """Trace at ``batch_sizes`` (default 4, 5, 8) and fit affine costs (None: not affine)."""
    return traced_step_costs(model, inputs, config, device, batch_sizes)[1]


def traced_step_costs(model: Any, inputs: Any, config: TrainConfig, device: Any,
                      batch_sizes: Sequence[int] = FIT_BATCHES
                      ) -> tuple[dict[int, StepTrace], StepCosts | None]:
    """:func:`step_costs`, with the memory trace of each of those passes."""
    from batchfit.device.profile import resolve_device

    profile = resolve_device(device)
    passes = {b: trace_step_and_costs(model, inputs, b, config, profile) for b in batch_sizes}
    return ({b: traced for b, (traced, _) in passes.items()},
            fit_costs({b: ops for b, (_, ops) in passes.items()}))


@dataclass(frozen=True)
class StepTime:
    """Predicted time of one step, and what it is made of (seconds summed over ops).

    ``overhead_s`` is the per-op framework overhead plus each kind's fixed latency;
    ``page_fault_s`` the cost of faulting in fresh mappings (CPU).
    """

    batch_size: int
    step_s: float
    compute_s: float
    memory_s: float
    overhead_s: float
    gemm_efficiency: float  #: useful / scheduled GEMM work (1.0 without quantization)
    ops: int
    page_fault_s: float = 0.0

    @property
    def samples_per_s(self) -> float:
        return self.batch_size / self.step_s


def _kind_rates(costs: StepCosts, profile: RooflineProfile, flops: Any,
                moved: Any) -> tuple[Any, Any, Any]:
    """FLOP/s and bytes/s per (op, batch), and latency per op, from each op's kind."""
    import numpy as np

    kinds = costs.kind.astype(np.int64)
    rate = np.empty(flops.shape)
    bandwidth = np.empty(flops.shape)
    latency = np.zeros(len(kinds))
    intensity = flops / np.maximum(moved, 1)
    for index in np.unique(kinds).tolist():
        kind, rows = OP_KINDS[index], kinds == index
        rate[rows] = profile.flops_rate_for(intensity[rows], kind)
        bandwidth[rows] = profile.bandwidth_for(moved[rows], kind)
        latency[rows] = profile.latency_for(kind)
    return rate, bandwidth, latency


def _page_faults(costs: StepCosts, profile: RooflineProfile, chunk: Any) -> Any:
    """Seconds per (op, batch) spent faulting in outputs of at least the mmap threshold."""
    import numpy as np

    found = np.zeros((len(costs.ops), len(chunk)))
    threshold = profile.mmap_threshold_bytes
    if threshold is None or not profile.page_fault_s_per_byte or len(costs.alloc_op) == 0:
        return found
    sizes = costs.alloc_bytes[:, :1] + costs.alloc_bytes[:, 1:] * chunk[None, :]
    np.add.at(found, costs.alloc_op, np.where(sizes >= threshold, sizes, 0)
              * profile.page_fault_s_per_byte)
    return found


def step_times(costs: StepCosts, profile: RooflineProfile,
               batch_sizes: Sequence[int]) -> list[StepTime]:
    """Predicted :class:`StepTime` at each batch size (vectorised over batches)."""
    import numpy as np

    found: list[StepTime] = []
    n_ops = len(costs.ops)
    for start in range(0, len(batch_sizes), 256):
        chunk = np.asarray(batch_sizes[start:start + 256], dtype=np.int64)
        if costs.batch_size is not None and np.any(chunk != costs.batch_size):
            raise InvalidInputError(f"these costs hold at batch {costs.batch_size} only")
        flops = costs.flops[:, :1] + costs.flops[:, 1:] * chunk[None, :]
        moved = costs.bytes_moved[:, :1] + costs.bytes_moved[:, 1:] * chunk[None, :]
        factor, efficiency = _quantization(costs, profile, chunk)
        rates, bandwidth, latency = _kind_rates(costs, profile, flops, moved)
        compute = flops * factor / rates
        memory = moved / bandwidth
        faults = _page_faults(costs, profile, chunk)
        per_op = np.maximum(compute, memory) + latency[:, None] + faults
        overhead = profile.launch_overhead_s
        per_op = np.maximum(per_op, overhead) if profile.async_launch else per_op + overhead
        for j, b in enumerate(chunk.tolist()):
            found.append(StepTime(b, float(per_op[:, j].sum()), float(compute[:, j].sum()),
                                  float(memory[:, j].sum()), overhead * n_ops + float(latency.sum()),
                                  float(efficiency[j]), n_ops, float(faults[:, j].sum())))
    return found


def _quantization(costs: StepCosts, profile: RooflineProfile, chunk: Any) -> tuple[Any, Any]:
    """Per-op factors (ops, batches) scheduled/useful GEMM work, and the overall efficiency."""
    import numpy as np

    n_ops, n_b = len(costs.ops), len(chunk)
    factor = np.ones((n_ops, n_b))
    if profile.sm_count is None or profile.tile is None or len(costs.gemm_op) == 0:
        return factor, np.ones(n_b)
    dims = costs.gemm_dims[:, :, :1] + costs.gemm_dims[:, :, 1:] * chunk[None, None, :]
    m, n, k, count = dims[:, 0], dims[:, 1], dims[:, 2], dims[:, 3]
    useful = (count * m * n * k).astype(np.float64)
    waves = gemm_waves(m, n, profile.sm_count, profile.tile, count)
    tile_work = (tile_extent(m, profile.tile[0]) * tile_extent(n, profile.tile[1])
                 * pad_to(k, profile.alignment))
    scheduled = (waves * profile.sm_count).astype(np.float64) * tile_work
    op_useful = np.zeros((n_ops, n_b))
    op_scheduled = np.zeros((n_ops, n_b))
    np.add.at(op_useful, costs.gemm_op, useful)
    np.add.at(op_scheduled, costs.gemm_op, scheduled)
    has = op_useful > 0
    factor[has] = op_scheduled[has] / op_useful[has]
    total_useful, total_scheduled = useful.sum(0), scheduled.sum(0)
    efficiency = np.where(total_scheduled > 0, total_useful / np.maximum(total_scheduled, 1), 1.0)
    return factor, efficiency




