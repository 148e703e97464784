"""``batchfit plan``: which multi-GPU layout trains a global batch fastest.

For each candidate layout (strategy, tensor-parallel degree, activation checkpointing,
offload) on ``world`` GPUs of one kind:

1. **Memory and the micro-batch**: the largest per-GPU micro-batch that divides the
   per-replica batch ``global_batch / data_parallel_size`` and fits rank 0 on the card
   (:func:`batchfit.answers.ranks.estimate_ranks`; rank 0 holds the longest shards),
   found from few traces (:mod:`batchfit.speed.divisors`: the line through two needs,
   confirmed on both sides; the answer a bisection over the divisors gives); gradient
   accumulation makes up the rest. None fits: the layout is infeasible, and says so.
2. **Compute**: the roofline of one micro-step on the GPU (:mod:`batchfit.speed.roofline`:
   the ops of the single-GPU step traced at that micro-batch, timed against the card's
   peak FLOP/s and bandwidth), divided by the tensor-parallel degree for tensor-parallel
   layouts.
3. **Communication**: the bytes each GPU moves per step (:func:`communication_bytes`,
   ring collectives: an all-gather or reduce-scatter over ``n`` ranks moves ``(n-1)/n``
   of the data through every rank, an all-reduce twice that), over the link that group
   uses: NVLink or PCIe inside a node (:mod:`batchfit.device.interconnect`), the network
   when a group spans nodes; offloaded state over PCIe.

The predicted step is ``accumulation x micro-step + communication`` (no overlap: a
bound from above; FSDP and DDP overlap much of their communication with compute, so the
ranking favours layouts that communicate less), and layouts are ranked by it.

Example:
    >>> import torch
    >>> mlp = lambda: torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(4)])
    >>> result = plan(mlp, (512,), gpus="2xA100-80GB", global_batch=64, strategies=["ddp", "fsdp"],
    ...               checkpointing="off", precision="amp-bf16")
    >>> [row.strategy for row in result.rows], result.rows[0].micro_batch_size
    (['ddp', 'fsdp'], 32)
"""

from __future__ import annotations

import re
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, replace
from typing import Any, Self

from batchfit.engine.spec import Precision, TrainConfig, make_config, parse_enum
from batchfit.errors import BatchfitError, InvalidInputError, option

_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
#: Strategies a plan tries by default (HSDP joins them on more than one node).
DEFAULT_STRATEGIES = ("ddp", "fsdp", "fsdp-grad-op", "zero1", "zero2", "zero3")


@dataclass(frozen=True)
class LayoutPlan:
    """One candidate layout and its predicted step.

    Attributes:
        strategy, tp, offload, checkpointing: the layout.
        feasible: a micro-batch fits and the global batch divides over the replicas.
        reason: why not, when infeasible.
        micro_batch_size: per-GPU batch of one forward and backward: the largest that
            fits rank 0 and divides the per-replica batch.
        accumulation_steps: micro-steps per optimizer step.
        memory_per_gpu_bytes: rank 0's device memory at the micro-batch used.
        compute_s, communication_s, step_s: predicted seconds per optimizer step.
        samples_per_s: ``global_batch / step_s``.
        communication_bytes: bytes each GPU moves per step.
    """

    strategy: str
    tp: int
    offload: str
    checkpointing: bool
    feasible: bool
    reason: str = ""
    micro_batch_size: int = 0
    accumulation_steps: int = 0
    memory_per_gpu_bytes: int = 0
    compute_s: float = 0.0
    communication_s: float = 0.0
    step_s: float = 0.0
    samples_per_s: float = 0.0
    communication_bytes: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {k: (round(v, 6) if isinstance(v, float) else v)
                for k, v in self.__dict__.items()}


@dataclass(frozen=True)
class PlanResult:
    """Every layout tried, feasible ones first, fastest first."""

    gpu: str
    world_size: int
    nodes: int
    global_batch_size: int
    rows: tuple[LayoutPlan, ...]
    precision: str = Precision.FP32.value
    precision_source: str = "config"
    #: e.g. that the card's marketed memory stands in for CUDA's total
    #: (:func:`~batchfit.device.profile.marketed_memory_note`)
    warnings: tuple[str, ...] = ()

    @property
    def best(self) -> LayoutPlan | None:
        return self.rows[0] if self.rows and self.rows[0].feasible else None

    def to_dict(self) -> dict[str, Any]:
        return {"gpu": self.gpu, "world_size": self.world_size, "nodes": self.nodes,
                "global_batch_size": self.global_batch_size, "precision": self.precision,
                "precision_source": self.precision_source,
                "best": self.best.to_dict() if self.best else None,
                "layouts": [row.to_dict() for row in self.rows],
                "warnings": list(self.warnings)}


def parse_gpus(text: str) -> tuple[int, str]:
    """``"8xH100 SXM"`` -> (8, "H100 SXM")."""
    match = re.fullmatch(r"\s*(\d+)\s*[x×*]\s*(.+?)\s*", str(text))
    if not match or int(match.group(1)) < 1:
        raise InvalidInputError(
            f"malformed {option('gpus', text)}: write the count and the card, "
            f"e.g. 8x\"H100 SXM\"")
    return int(match.group(1)), match.group(2)


@dataclass(frozen=True)
class _Model:
    """What the communication model needs to know about the model."""

    parameters: int
    layers: int | None
    hidden: int | None
    tokens_per_sample: int
    #: what a whole replica holds at any micro-batch
    #: (:func:`~batchfit.answers.replica.replica_floor_bytes`), or None
    replica_floor: int | None = None


def plan(model: Any, inputs: Any, config: TrainConfig | None = None, *, gpus: str,
         global_batch: int, nodes: int = 1, strategies: Sequence[str] | None = None,
         tp_degrees: Sequence[int] = (), checkpointing: str = "auto",
         offload: str = "auto", network_bytes_per_s: float | None = None,
         precision: Precision | str | None = None, checkpoint_dtype: str | None = None,
         on_layout: Callable[[str], None] | None = None, **options: Any) -> PlanResult:
    """Rank multi-GPU layouts of one training step by predicted step time.

    Args:
        model, inputs, config, options: as for :func:`batchfit.estimate`.
        gpus: ``"NxNAME"``: how many GPUs of which catalog card (all nodes together).
        global_batch: samples per optimizer step over all GPUs.
        nodes: machines the GPUs span (equal shares).
        strategies: which to try (default :data:`DEFAULT_STRATEGIES`, and ``hsdp`` on
            more than one node).
        tp_degrees: tensor-parallel degrees to try with FSDP (Llama-family models).
        checkpointing: ``"off"``, ``"on"`` or ``"auto"`` (with it only where a layout
            fits no micro-batch without it).
        offload: ``"none"`` or ``"auto"`` (the strategy's offload only where nothing
            fits without it).
        network_bytes_per_s: the network between nodes, per GPU and each way (default
            :data:`~batchfit.device.interconnect.DEFAULT_NETWORK_BYTES_PER_S`).
        precision: the step's precision; None: :func:`plan_precision` chooses it from
            ``checkpoint_dtype`` (an LLM's), else the config's.
        checkpoint_dtype: the dtype the model's checkpoint is stored in (``"bfloat16"``,
            ``"float16"``; :func:`batchfit.models.resolve.checkpoint_dtype` for ``hf:NAME``).
        on_layout: called with each layout's name before it is evaluated (progress).
    """
    from batchfit.device.catalog import find_gpu
    from batchfit.device.interconnect import DEFAULT_NETWORK_BYTES_PER_S
    from batchfit.device.profile import gpu_profile, marketed_memory_note
    from batchfit.sharding.layout import Parallelism

    config = make_config(config, options)
    count, name = parse_gpus(gpus)
    card = find_gpu(name)
    chosen, source = plan_precision(precision, checkpoint_dtype, config.precision, card)
    config = replace(config, precision=chosen)
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
        raise InvalidInputError(f"{option('global_batch')} must be a positive integer, "
                                f"not {global_batch!r}")
    if checkpointing not in ("off", "on", "auto") or offload not in ("none", "auto"):
        raise InvalidInputError("checkpointing is off, on or auto; offload is none or auto")
    Parallelism(world_size=count, nodes=nodes)  # checks the world and the nodes
    network = network_bytes_per_s or DEFAULT_NETWORK_BYTES_PER_S
    names = _strategy_names(strategies, nodes)
    layouts = [(strategy, tp, _layout(strategy, count, nodes, tp)) for strategy in names
               for tp in ([1] if strategy != "fsdp" else [1, *tp_degrees])]
    _check_global_batch(global_batch, count, [layout for _, _, layout in layouts])
    # each searchable layout's variants, in the order _best_variant tries them
    searches = [[(replace(layout, offload=off), replace(config, checkpointing=ckpt))
                 for ckpt, off in _variants(layout, checkpointing, offload)]
                for _, _, layout in layouts
                if not isinstance(layout, str) and global_batch % layout.data_parallel_size == 0]
    requests = [(variant, variant_config, micro) for variants in searches
                for variant, variant_config in variants
                for micro in _divisors(global_batch // variant.data_parallel_size)]
    device = gpu_profile(card)
    with _Needs(model, inputs, device, requests, config) as needs:
        # one model built on meta for the facts, the memory traces and the roofline's
        facts = _model_facts(model, inputs, needs.meta_model, config)
        needs.speed = _Speed(model, inputs, card, needs.meta_model)  # before the fork
        tasks = [_searched_row(needs, config, card, layout, global_batch, facts, network,
                               checkpointing, offload)
                 for _, _, layout in layouts if not isinstance(layout, str)]
        if tasks:
            needs.queue.start()  # forks the workers now, before this process's first backward
        # every layout's search at once: each trace goes to the first free worker
        searched = iter(needs.queue.run(
            tasks, rank=needs.rank if needs.queue.parallel else None,
            on_start=None if on_layout is None else lambda n: on_layout(needs.label(n))))
        rows = [LayoutPlan(strategy, tp, "none", False, False, layout)
                if isinstance(layout, str) else next(searched)
                for strategy, tp, layout in layouts]
    rows.sort(key=lambda r: (not r.feasible, r.step_s if r.feasible else 0.0))
    marketed = marketed_memory_note(device)
    return PlanResult(card.name, count, nodes, global_batch, tuple(rows), chosen.value, source,
                      (marketed,) if marketed else ())


#: The first compute capability with bfloat16 (Ampere).
_BF16_FROM_CC = (8, 0)


def plan_precision(precision: Precision | str | None, checkpoint_dtype: str | None,
                   configured: Precision, card: Any) -> tuple[Precision, str]:
    """The precision a plan trains in, and where it comes from (``"given"``,
    ``"checkpoint <dtype>"`` or ``"config"``).

    A given precision stands. Otherwise a model whose checkpoint is 16-bit (an LLM's
    ``config.json`` ``torch_dtype``) trains in mixed precision in that dtype, as Hugging
    Face's Trainer (``bf16=True``/``fp16=True``) and FSDP's ``MixedPrecision`` run it: float32
    master weights and optimizer state, 16-bit compute (``amp-bf16``/``amp-fp16``); a
    bfloat16 checkpoint on a card without bfloat16 (compute capability below 8.0) computes in
    float16. Anything else keeps ``configured`` (float32 unless the config says otherwise).

    Example:
        >>> from batchfit.device.catalog import find_gpu
        >>> plan_precision(None, "bfloat16", Precision.FP32, find_gpu("H100 SXM"))
        (<Precision.AMP_BF16: 'amp-bf16'>, 'checkpoint bfloat16')
    """
    if precision is not None:
        return parse_enum(Precision, precision, "precision"), "given"
    if checkpoint_dtype == "bfloat16":
        cc = card.compute_capability
        has_bf16 = cc is None or tuple(cc) >= _BF16_FROM_CC
        return (Precision.AMP_BF16 if has_bf16 else Precision.AMP_FP16), "checkpoint bfloat16"
    if checkpoint_dtype == "float16":
        return Precision.AMP_FP16, "checkpoint float16"
    return configured, "config"


def _strategy_names(strategies: Sequence[str] | None, nodes: int) -> list[str]:
    """The strategies to try, each a known one (else one line naming the valid ones)."""
    from batchfit.engine.spec import parse_enum
    from batchfit.sharding.layout import Strategy

    if not strategies:
        return list(DEFAULT_STRATEGIES + (("hsdp",) if nodes > 1 else ()))
    return list(dict.fromkeys(parse_enum(Strategy, name, "strategy").value
                              for name in strategies))


def _check_global_batch(global_batch: int, gpus: int, layouts: Sequence[Any]) -> None:
    """Every data-parallel replica takes ``global_batch / data_parallel_size`` samples, so
    the global batch must be a multiple of the data-parallel size (the GPUs, divided by the
    tensor-parallel degree) of at least one layout."""
    sizes = sorted({layout.data_parallel_size for layout in layouts
                    if not isinstance(layout, str)})
    if sizes and all(global_batch % size for size in sizes):
        listed = " or ".join(str(size) for size in sizes)
        raise InvalidInputError(
            f"the global batch ({global_batch}) must be a multiple of the data-parallel size "
            f"({listed} on {gpus} GPUs), so each replica gets a whole number of samples: "
            f"use e.g. --global-batch {sizes[0] * max(1, -(-global_batch // sizes[0]))}")


def _divisors(n: int) -> list[int]:
    return [b for b in range(1, n + 1) if n % b == 0]


def _layout(strategy: str, world: int, nodes: int, tp: int) -> Any:
    from batchfit.sharding.layout import Parallelism

    try:
        return Parallelism(world_size=world, strategy="tp" if tp > 1 else strategy,
                           tp=tp, nodes=nodes, rank=0)
    except InvalidInputError as exc:
        return str(exc)


def _variants(layout: Any, checkpointing: str, offload: str) -> list[tuple[bool, str]]:
    from batchfit.sharding.layout import _OFFLOADS, Offload

    offloads = ["none"]
    if offload == "auto":
        offloads += [o.value for o in sorted(_OFFLOADS[layout.strategy]) if o is not Offload.NONE]
    steps = {"off": [False], "on": [True], "auto": [False, True]}[checkpointing]
    return [(ckpt, off) for off in offloads for ckpt in steps]


#: What a layout's search yields and is sent: the requests it needs traced next, then
#: their results (:meth:`batchfit.answers.tracepool.TraceQueue.run`).
_Search = Generator[list[int], dict[int, Any], Any]


def _searched_row(needs: _Needs, config: TrainConfig, card: Any, layout: Any,
                  global_batch: int, facts: _Model, network: float, checkpointing: str,
                  offload: str) -> _Search:
    """The layout's row: its first variant that fits (:func:`_best_variant`), with the
    compute of its micro-step (:func:`_timed`)."""
    row = yield from _best_variant(needs, config, card, layout, global_batch, facts,
                                   network, checkpointing, offload)
    row_config = replace(config, checkpointing=row.checkpointing)
    if row.feasible:
        yield from needs.micro_step(row_config, row.micro_batch_size)
    return _timed(row, row_config, needs.speed, global_batch)


def _best_variant(needs: _Needs, config: TrainConfig, card: Any, layout: Any,
                  global_batch: int, facts: _Model, network: float,
                  checkpointing: str, offload: str) -> _Search:
    """The first variant (least checkpointing and offload) that fits, else why none does."""
    last: LayoutPlan | None = None
    for ckpt, off in _variants(layout, checkpointing, offload):
        last = yield from _evaluate(needs, replace(config, checkpointing=ckpt), card,
                                    replace(layout, offload=off), global_batch, facts,
                                    network)
        if last.feasible:
            return last
    return last


def _variant_label(layout: Any, config: TrainConfig) -> str:
    """``zero3``, ``fsdp tp2 +checkpointing``, ``zero2 +offload optimizer``..."""
    off = layout.offload.value
    return (f"{layout.strategy.value}{f' tp{layout.tp}' if layout.tp > 1 else ''}"
            f"{' +checkpointing' if config.checkpointing else ''}"
            f"{f' +offload {off}' if off != 'none' else ''}")


def _evaluate(needs: _Needs, config: TrainConfig, card: Any, layout: Any, global_batch: int,
              facts: _Model, network: float) -> _Search:
    """The layout variant's micro-batch, memory and communication (its compute comes from
    the roofline of its micro-step: :func:`_timed`)."""
    base = LayoutPlan(layout.strategy.value, layout.tp, layout.offload.value,
                      config.checkpointing, False)
    replicas = layout.data_parallel_size
    if global_batch % replicas:
        return replace(base, reason=f"the global batch {global_batch} does not divide over "
                                    f"{replicas} data-parallel ranks")
    per_replica = global_batch // replicas
    floor = _floor_over(layout, facts, needs.device)
    if floor is not None:  # a replicated layout over the card is answered without a trace
        return replace(base, reason=f"its weights, gradients and optimizer state alone need "
                                    f"{floor / 2**30:.1f} GiB on every GPU, over the "
                                    f"{card.memory_bytes / 2**30:.1f} GiB card")
    try:
        micro, memory = yield from needs.largest_divisor_that_fits(layout, config, per_replica)
    except BatchfitError as exc:
        return replace(base, reason=str(exc).split(":")[0])
    if micro is None:
        return replace(base, reason=f"a micro-batch of 1 needs {memory / 2**30:.1f} GiB per "
                                    f"GPU, over the {card.memory_bytes / 2**30:.1f} GiB card")
    accumulation = per_replica // micro
    volume, pcie_volume = communication_bytes(layout, facts, config.precision, micro,
                                              accumulation)
    seconds = volume / _bandwidth(layout, card, network) + pcie_volume / _pcie(card)
    return replace(base, feasible=True, micro_batch_size=micro, accumulation_steps=accumulation,
                   memory_per_gpu_bytes=memory, communication_s=seconds,
                   communication_bytes=int(volume + pcie_volume))


def _timed(row: LayoutPlan, config: TrainConfig, speed: _Speed,
           global_batch: int) -> LayoutPlan:
    """A feasible row with its compute (the roofline's micro-step, split over the
    tensor-parallel degree, once per micro-step) and its step time."""
    if not row.feasible:
        return row
    compute = speed.micro_step_s(config, row.micro_batch_size) / row.tp * row.accumulation_steps
    step = compute + row.communication_s
    return replace(row, compute_s=compute, step_s=step, samples_per_s=global_batch / step)


class _Needs:
    """Rank 0's device memory for each (layout variant, micro-batch) the plan asks for: one
    trace each (:func:`~batchfit.answers.ranks.estimate_ranks`, the steady step), and the
    roofline of each micro-step a row uses; two at a time where the machine allows.

    The traces run in a :class:`~batchfit.answers.tracepool.TraceQueue`'s two workers,
    forked before any trace (a child forked after a backward cannot run one); so every
    request the plan can make (``requests``: each layout variant at each divisor of its
    per-replica batch; then :attr:`rooflines`) is numbered before, and a worker is sent
    the number. Every layout's search runs at once, each waiting on its own traces, and
    each free worker takes the longest trace waiting; the answer never depends on the
    workers (see the queue).

    A variant's traces share one :class:`~batchfit.engine.trace.TraceReuse` (the optimizer
    phase traced once, as ``max`` shares it); all variants share the model built on meta
    once (each copies it; none changes it). Traced one at a time (no workers), the
    layouts' searches run one after another, and a variant whose search has one need
    takes as its slope the bytes per sample an earlier one with the same checkpointing
    measured (the activations per sample are much alike across strategies; the answer is
    still confirmed by tracing it and the divisor above).
    """

    def __init__(self, model: Any, inputs: Any, device: Any,
                 requests: list[tuple[Any, TrainConfig, int]], config: TrainConfig) -> None:
        from batchfit.answers.tracepool import TraceQueue
        from batchfit.engine.trace import TraceReuse

        self.model, self.inputs, self.device = model, inputs, device
        self.requests = requests
        self._ids = {(_variant_key(layout, config), micro): n
                     for n, (layout, config, micro) in enumerate(requests)}
        # the roofline micro-steps a row can use, numbered after the rank traces
        self.rooflines = list({(config.checkpointing, micro): (config, micro)
                               for _, config, micro in requests}.values())
        self._roofline_ids = {key: len(requests) + n for n, key in enumerate(
            (config.checkpointing, micro) for config, micro in self.rooflines)}
        self.speed: _Speed | None = None
        self._meta = TraceReuse()
        if config.workload is None:
            self._meta.build_model(model)  # before the fork: the workers inherit it
        self._reuse: dict[tuple[Any, ...], Any] = {}
        self.sizes: dict[tuple[Any, ...], dict[int, int]] = {}
        self.slopes: dict[bool, float] = {}
        self.queue = TraceQueue(self._trace, allowed=device.is_cuda)

    @property
    def meta_model(self) -> Any:
        """The model the traces copy: the user's module, or the factory's built on meta
        once (None with an LLM workload, whose preparer builds its own)."""
        return self._meta.meta_model if self._meta.meta_model is not None else (
            self.model if hasattr(self.model, "parameters") else None)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.queue.close()

    def _trace(self, request: int) -> int | float | BatchfitError:
        from batchfit.answers.ranks import estimate_ranks
        from batchfit.engine.trace import TraceReuse

        if (roofline := self._roofline(request)) is not None:  # its seconds
            assert self.speed is not None
            return self.speed.micro_step_s(*roofline)
        layout, config, micro = self.requests[request]
        key = _variant_key(layout, config)
        if key not in self._reuse:
            self._reuse[key] = TraceReuse()
            if config.workload is None:
                self._reuse[key].meta_model = self._meta.meta_model
        try:
            return estimate_ranks(self.model, self.inputs, micro, config, device=self.device,
                                  parallel=layout, first_step=False,
                                  reuse=self._reuse[key]).total_bytes
        except BatchfitError as exc:  # the variant's answer, if the search asks for it
            return exc

    def _roofline(self, request: int) -> tuple[TrainConfig, int] | None:
        """The (config, micro-batch) of a roofline request (numbered after the rank
        traces); None for a rank trace."""
        return self.rooflines[request - len(self.requests)] \
            if request >= len(self.requests) else None

    def rank(self, request: int) -> tuple[int, bool]:
        """Which waiting trace a free worker takes first: the longest
        (:func:`_trace_length_rank`; a roofline's runs as long as torch's own layouts)."""
        if (roofline := self._roofline(request)) is not None:
            return len(_TRACE_LENGTH), not roofline[0].checkpointing
        layout, config, _ = self.requests[request]
        return _trace_length_rank(_variant_key(layout, config))

    def label(self, request: int) -> str:
        """What a trace is, for progress: ``zero3 at a micro-batch of 2``."""
        if (roofline := self._roofline(request)) is not None:
            config, micro = roofline
            what = f"the roofline{' +checkpointing' if config.checkpointing else ''}"
        else:
            layout, config, micro = self.requests[request]
            what = _variant_label(layout, config)
        return f"{what} at a micro-batch of {micro}"

    def micro_step(self, config: TrainConfig, micro: int) -> _Search:
        """Trace the roofline's micro-step at ``micro`` (once however many rows use it)
        and keep its seconds in :attr:`speed`."""
        assert self.speed is not None
        key = (config.checkpointing, micro)
        if key not in self.speed.seconds:
            request = self._roofline_ids[key]
            traced = yield [request]
            self.speed.seconds[key] = traced[request]

    def largest_divisor_that_fits(self, layout: Any, config: TrainConfig,
                                  per_replica: int) -> Generator[list[int], dict[int, Any],
                                                                 tuple[int | None, int]]:
        """The largest micro-batch that divides ``per_replica`` and fits rank 0, and its
        bytes (None and the bytes at 1 when none fits):
        :func:`~batchfit.speed.divisors.divisor_search`, in pairs when the queue has
        workers.

        A trace that fails (its error, a :class:`~batchfit.errors.BatchfitError`) answers
        for the variant, as the search in sequence meets it: the smallest failing
        micro-batch's error is raised, once the first divisor (where the search in
        sequence begins) is traced too (over the card, it is the answer: none fits); a
        failure above a micro-batch already over the card cannot move the answer, so it
        counts as over the card."""
        key = _variant_key(layout, config)
        sizes = self.sizes.setdefault(key, {})
        divisors = _divisors(per_replica)
        budget = self.device.total_memory_bytes
        from batchfit.speed.divisors import divisor_search

        search = divisor_search(divisors, budget, lambda: self.slopes.get(config.checkpointing),
                                self.queue.parallel)
        try:
            asked = next(search)
            while True:
                traced = yield [self._ids[key, b] for b in asked]
                needs = {}
                for b in sorted(asked):
                    result = traced[self._ids[key, b]]
                    if not isinstance(result, BatchfitError):
                        sizes[b] = needs[b] = result
                    elif any(n > budget for m, n in sizes.items() if m < b):
                        needs[b] = budget + 1  # moot: a smaller one is over the card
                    else:
                        one = divisors[0]
                        if one < b and one not in sizes:
                            earlier = (yield [self._ids[key, one]])[self._ids[key, one]]
                            if isinstance(earlier, BatchfitError):
                                raise earlier
                            sizes[one] = earlier
                            if earlier > budget:  # nothing fits: the answer in sequence
                                return None, earlier
                        raise result
                asked = search.send(needs)
        except StopIteration as stop:
            answer = stop.value
        measured = _slope(sizes, answer)
        if measured is not None:
            self.slopes[config.checkpointing] = measured
        return answer, sizes[answer if answer is not None else divisors[0]]


def _variant_key(layout: Any, config: TrainConfig) -> tuple[Any, ...]:
    return (layout.strategy, layout.tp, layout.offload, config.checkpointing)


#: Which strategies' traces run longest, for the order of a round: DeepSpeed's ZeRO-3
#: partitions every parameter and gathers it for each use, ZeRO-1/2 run DeepSpeed's
#: engine over flat buffers; FSDP2, DDP and TP trace torch's own modules.
_TRACE_LENGTH = {"zero3": 0, "zero2": 1, "zero1": 1}


def _trace_length_rank(key: tuple[Any, ...]) -> tuple[int, bool]:
    """Sort key, longest trace first: by strategy, then checkpointing's recomputation."""
    return _TRACE_LENGTH.get(key[0].value, len(_TRACE_LENGTH)), not key[3]


def _slope(sizes: dict[int, int], answer: int | None) -> float | None:
    """Bytes per sample where the budget was crossed: between the answer and the traced
    micro-batch above it that did not fit (the nearest below when none above was traced)."""
    if answer is None or len(sizes) < 2:
        return None
    above = [b for b in sizes if b > answer]
    other = min(above) if above else max(b for b in sizes if b < answer)
    rise = (sizes[other] - sizes[answer]) / (other - answer)
    return rise if rise > 0 else None


def communication_bytes(layout: Any, facts: _Model, precision: Precision, micro: int,
                        accumulation: int) -> tuple[float, float]:
    """Bytes one GPU moves per optimizer step: (over GPU links or the network, over PCIe).

    ``P`` parameters, gathered in ``bp`` bytes each (2 with 16-bit compute), gradients
    reduced in ``bg`` (4: fp32 reduction, FSDP's recipe and DeepSpeed's; 2 for DDP in
    16-bit), ``n`` ranks in the group, ``a`` micro-steps:

    * DDP: one all-reduce of the gradients per step, ``2(n-1)/n P bg`` (no sync while
      accumulating);
    * FSDP (ZeRO-3-like) and ZeRO-3: an all-gather in forward and again in backward and a
      reduce-scatter, every micro-step: ``a (n-1)/n P (2 bp + bg)``; ``fsdp-grad-op``
      gathers once: ``a (n-1)/n P (bp + bg)``;
    * ZeRO-1: a reduce-scatter of the accumulated gradients and an all-gather of the
      updated parameters per step, ``(n-1)/n P (bg + bp)`` (DDP's volume, as the ZeRO
      paper counts it); ZeRO-2 reduces every micro-step: ``(n-1)/n P (a bg + bp)``;
    * HSDP: FSDP within a node, plus an all-reduce of each shard's gradients across the
      ``r`` replicas, ``a 2(r-1)/r P/n bg``;
    * tensor parallel (degree ``t``): FSDP over ``P/t`` on the data-parallel ranks, plus
      Megatron's four all-reduces of the activations per layer and micro-step (two in
      forward, two in backward), ``4 L B S H 2(t-1)/t`` bytes in 16 bits;
    * offload: FSDP2's shards copied to the GPU at each all-gather and its gradients
      back, ``a P/n (2 x 4 + 4)`` over PCIe; DeepSpeed's gradient partition down and its
      updated parameters up, ``P/n (4 + bp)`` per step.
    """
    from batchfit.sharding.layout import Offload, Strategy

    params = facts.parameters
    sixteen = precision in (Precision.AMP_BF16, Precision.AMP_FP16, Precision.BF16,
                            Precision.FP16)
    bp = 2 if sixteen else 4
    bg = 4
    strategy, a = layout.strategy, accumulation
    n = layout.shard_size
    ring = (n - 1) / n if n > 1 else 0.0
    pcie = 0.0
    if strategy is Strategy.DDP:
        d = layout.data_parallel_size
        grads = 2 if precision in (Precision.BF16, Precision.FP16) else 4
        return 2 * (d - 1) / d * params * grads, 0.0
    if strategy in (Strategy.ZERO1, Strategy.ZERO2):
        times = 1 if strategy is Strategy.ZERO1 else a
        volume = ring * params * (times * bg + bp)
        if layout.offload is not Offload.NONE:
            pcie = params / n * (4 + bp)
        return volume, pcie
    gathers = 1 if not layout.resharded_after_forward else 2
    shard_params = params / layout.tp
    volume = a * ring * shard_params * (gathers * bp + bg)
    if strategy is Strategy.HSDP:
        r = layout.nodes
        volume += a * 2 * (r - 1) / r * shard_params / n * bg
    if layout.tp > 1:
        if facts.layers is None or facts.hidden is None:
            raise InvalidInputError("tensor parallel needs the model's layers and hidden size")
        t = layout.tp
        volume += (a * 4 * facts.layers * micro * facts.tokens_per_sample * facts.hidden * 2
                   * 2 * (t - 1) / t)
    if layout.offload is not Offload.NONE:
        pcie = a * shard_params / n * (2 * 4 + 4) if strategy is not Strategy.ZERO3 else \
            params / n * (4 + bp)
    return volume, pcie


def _bandwidth(layout: Any, card: Any, network: float) -> float:
    """The slowest link of the layout's collectives: the network if a group spans nodes."""
    from batchfit.device.interconnect import link_for

    intra = link_for(card).gpu_to_gpu_bytes_per_s
    if layout.nodes == 1:
        return intra
    from batchfit.sharding.nccl import communicators

    spans = any(c.crosses_nodes and c.ranks > 1 for c in communicators(layout))
    return min(intra, network) if spans else intra


def _pcie(card: Any) -> float:
    capability = card.compute_capability or (0, 0)
    return 63e9 if capability >= (9, 0) else 31.5e9 if capability >= (8, 0) else 15.75e9


class _Speed:
    """The roofline of the single-GPU micro-step, traced once at each (checkpointing,
    micro-batch) a layout uses: the ops at the batch itself, not an affine fit through
    three other batches (one trace where the fit takes three; a plan's layouts share
    few micro-batches)."""

    def __init__(self, model: Any, inputs: Any, card: Any, meta: Any = None) -> None:
        self.model, self.inputs, self.card, self.meta = model, inputs, card, meta
        self.seconds: dict[tuple[bool, int], float] = {}  # (checkpointing, micro-batch)

    def micro_step_s(self, config: TrainConfig, batch_size: int) -> float:
        from batchfit.device.profile import gpu_profile
        from batchfit.speed.op_costs import constant_costs, step_times, trace_step_and_costs
        from batchfit.speed.rates import gpu_roofline_profile

        key = (config.checkpointing, batch_size)
        if key not in self.seconds:
            _, ops = trace_step_and_costs(self.model, self.inputs, batch_size, config,
                                          gpu_profile(self.card), self._reuse())
            roofline = gpu_roofline_profile(self.card, config.precision)
            self.seconds[key] = step_times(constant_costs(ops, batch_size), roofline,
                                           [batch_size])[0].step_s
        return self.seconds[key]

    def _reuse(self) -> Any:
        """A fresh :class:`~batchfit.engine.trace.TraceReuse` holding the plan's model built
        on meta (each trace copies it; none changes it), or None to build one in the trace:
        with a workload, or for a Keras model (built in the config's dtype policy)."""
        from batchfit.engine.keras_detect import is_keras_model
        from batchfit.engine.trace import TraceReuse

        if self.meta is None or is_keras_model(self.meta):
            return None
        reuse = TraceReuse()
        reuse.meta_model = self.meta
        return reuse


def _floor_over(layout: Any, facts: _Model, device: Any) -> int | None:
    """The replica floor of ``layout`` where it exceeds the device, else None: DDP (every
    rank holds the whole module, ``DistributedDataParallel``'s design) without tensor
    parallelism or offload."""
    from batchfit.sharding.layout import Offload, Strategy

    if (facts.replica_floor is None or layout.strategy is not Strategy.DDP or layout.tp > 1
            or layout.offload is not Offload.NONE):
        return None
    return facts.replica_floor if facts.replica_floor > device.total_memory_bytes else None


def _model_facts(model: Any, inputs: Any, meta: Any = None,
                 config: TrainConfig | None = None) -> _Model:
    """Parameters, layers, hidden size, tokens per sample and (given ``config``) the
    replica floor, from the model built on meta (``meta``, or built here when None)."""
    from batchfit.engine.fake import build_on_meta
    from batchfit.engine.spec import TensorSpec
    from batchfit.engine.step import normalize_input_spec

    built = meta if meta is not None else (
        model if not callable(model) or hasattr(model, "parameters") else build_on_meta(model))
    parameters = sum(p.numel() for p in built.parameters())
    hf = getattr(built, "config", None)
    layers = getattr(hf, "num_hidden_layers", None)
    hidden = getattr(hf, "hidden_size", None)
    spec = normalize_input_spec(inputs)
    first = spec if isinstance(spec, TensorSpec) else (
        next(iter(spec.values())) if isinstance(spec, dict) else spec[0])
    tokens = first.shape[0] if first.shape else 1
    from batchfit.answers.replica import replica_floor_bytes

    floor = replica_floor_bytes(built, config) if config is not None else None
    return _Model(parameters, layers, hidden, tokens, floor)
