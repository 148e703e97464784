"""How one training step is spread over GPUs: the strategy, the world and each strategy's knobs.

Nothing here imports torch: a :class:`Parallelism` is plain data, checked when it is
made, so a bad world size or an offload the strategy lacks is one clear line before
any trace starts.

Example:
    >>> layout = Parallelism(world_size=8, strategy="fsdp")
    >>> layout.strategy, layout.ranks_to_trace()
    (<Strategy.FSDP: 'fsdp'>, (0, 7))
    >>> Parallelism(world_size=6, strategy="tp", tp=4)
    Traceback (most recent call last):
    ...
    batchfit.errors.InvalidInputError: world size 6 is not divisible by --tp 4: the tensor-parallel groups must tile the world (e.g. --world-size 8 --tp 4)
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from batchfit.engine.spec import parse_enum
from batchfit.errors import InvalidInputError, option


class Strategy(StrEnum):
    """How a training step is spread over the ranks.

    * ``ddp``: ``DistributedDataParallel``: every rank holds the whole model, gradients
      are all-reduced in buckets.
    * ``fsdp``: FSDP2 ``fully_shard`` per layer, parameters resharded after forward
      (ZeRO-3-like).
    * ``fsdp-grad-op``: FSDP2 with ``reshard_after_forward=False``: a layer's gathered
      parameters stay from its forward to its backward (FSDP1's ``SHARD_GRAD_OP``).
    * ``hsdp``: FSDP2 on a 2-D mesh: sharded within a node, replicated across nodes.
    * ``fsdp1``: the FSDP1 ``FullyShardedDataParallel`` wrapper (flat parameters).
    * ``zero1``, ``zero2``, ``zero3``: DeepSpeed ZeRO stages.
    * ``tp``: tensor (and sequence) parallel through DTensor's ``parallelize_module``;
      when the world is larger than ``tp``, FSDP2 shards across the remaining dimension.
    """

    DDP = "ddp"
    FSDP = "fsdp"
    FSDP_GRAD_OP = "fsdp-grad-op"
    HSDP = "hsdp"
    FSDP1 = "fsdp1"
    ZERO1 = "zero1"
    ZERO2 = "zero2"
    ZERO3 = "zero3"
    TP = "tp"

    @property
    def is_zero(self) -> bool:
        return self in (Strategy.ZERO1, Strategy.ZERO2, Strategy.ZERO3)

    @property
    def zero_stage(self) -> int:
        return {Strategy.ZERO1: 1, Strategy.ZERO2: 2, Strategy.ZERO3: 3}.get(self, 0)


class Offload(StrEnum):
    """What lives in host memory instead of on the GPU.

    * ``none``.
    * ``optimizer``: the optimizer state and the fp32 master weights (DeepSpeed
      ``offload_optimizer``, ZeRO 1-3).
    * ``params``: parameters, gradients and optimizer state (FSDP2 ``CPUOffloadPolicy``,
      FSDP1 ``CPUOffload(offload_params=True)``,
      DeepSpeed ZeRO-3 ``offload_param``
      together with ``offload_optimizer``).
    """

    NONE = "none"
    OPTIMIZER = "optimizer"
    PARAMS = "params"


#: The offloads each strategy has (DeepSpeed's ``offload_param`` is ZeRO-3's only).
_OFFLOADS: dict[Strategy, frozenset[Offload]] = {
    Strategy.DDP: frozenset({Offload.NONE}),
    Strategy.FSDP: frozenset({Offload.NONE, Offload.PARAMS}),
    Strategy.FSDP_GRAD_OP: frozenset({Offload.NONE, Offload.PARAMS}),
    Strategy.HSDP: frozenset({Offload.NONE, Offload.PARAMS}),
    Strategy.FSDP1: frozenset({Offload.NONE, Offload.PARAMS}),  # FSDP1's CPUOffload
    Strategy.ZERO1: frozenset({Offload.NONE, Offload.OPTIMIZER}),
    Strategy.ZERO2: frozenset({Offload.NONE, Offload.OPTIMIZER}),
    Strategy.ZERO3: frozenset({Offload.NONE, Offload.OPTIMIZER, Offload.PARAMS}),
    Strategy.TP: frozenset({Offload.NONE}),
}
#: Strategies that combine with tensor parallelism (FSDP2 over the data-parallel dimension).
_WITH_TP = frozenset({Strategy.TP, Strategy.FSDP, Strategy.FSDP_GRAD_OP})


def _positive_int(value: Any, what: str, hint: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidInputError(f"{what} must be a positive integer, not {value!r}{hint}")
    return value


@dataclass(frozen=True)
class Parallelism:
    """One training step spread over ``world_size`` GPUs.

    Args:
        world_size: the number of ranks (GPUs).
        strategy: a :class:`Strategy` or its name.
        offload: an :class:`Offload` or its name (checked against the strategy).
        tp: the tensor-parallel degree (``strategy="tp"``, or FSDP with ``tp > 1``: 2-D).
        nodes: how many machines the ranks span (``world_size / nodes`` GPUs each): HSDP
            shards within a node and replicates across nodes; NCCL's buffers and the
            planner's link bandwidth depend on it.
        bucket_cap_mb: DDP's gradient bucket size (torch's default 25 MB; the first
            bucket is 1 MiB, ``torch.distributed._DEFAULT_FIRST_BUCKET_BYTES``).
        gradient_as_bucket_view: DDP's option: gradients are views into the buckets.
        reshard_after_forward: FSDP's option; None: the strategy's (True for ``fsdp``,
            False for ``fsdp-grad-op``).
        wrap: which modules are sharded units: None (each block of the model's largest
            ``ModuleList``/``Sequential`` of repeated blocks, e.g. transformer layers),
            a tuple of module classes, or a callable ``(module, path) -> bool``. The root
            is always a unit.
        prefetch: FSDP2 explicit prefetching: the next ``prefetch`` layers are
            all-gathered ahead in forward and backward (0: FSDP2's default, implicit).
        param_dtype, reduce_dtype: FSDP2 ``MixedPrecisionPolicy`` dtypes (``"bfloat16"``,
            ``"float16"``, ``"float32"``); None: from the precision (``amp-bf16`` and
            ``bf16``: bf16 compute with float32 gradient reduction, torchtitan's recipe).
        deepspeed: overrides merged into the DeepSpeed config's ``zero_optimization``
            (``reduce_bucket_size``, ``allgather_bucket_size``,
            ``stage3_prefetch_bucket_size``, ``stage3_max_live_parameters``...).
        rank: trace only this rank (None: rank 0 and the last rank; see
            :meth:`ranks_to_trace`).
    """

    world_size: int = 1
    strategy: Strategy | str = Strategy.DDP
    offload: Offload | str = Offload.NONE
    tp: int = 1
    nodes: int = 1
    bucket_cap_mb: float = 25.0
    gradient_as_bucket_view: bool = False
    reshard_after_forward: bool | None = None
    wrap: Any = None
    prefetch: int = 0
    param_dtype: str | None = None
    reduce_dtype: str | None = None
    deepspeed: Mapping[str, Any] = field(default_factory=dict)
    rank: int | None = None

    def __post_init__(self) -> None:
        strategy = parse_enum(Strategy, self.strategy, "strategy")
        offload = parse_enum(Offload, self.offload, "offload")
        object.__setattr__(self, "strategy", strategy)
        object.__setattr__(self, "offload", offload)
        object.__setattr__(self, "deepspeed", dict(self.deepspeed))
        world = _positive_int(self.world_size, "world size", ": the number of GPUs, e.g. 8")
        tp = _positive_int(self.tp, option("tp"), ": the tensor-parallel degree, e.g. 2")
        nodes = _positive_int(self.nodes, option("nodes"), ": the number of machines, e.g. 2")
        if world % tp:
            raise InvalidInputError(
                f"world size {world} is not divisible by {option('tp', tp)}: the "
                "tensor-parallel groups must tile the world (e.g. "
                f"{option('world_size', tp * max(1, world // tp + 1))} {option('tp', tp)})")
        if world % nodes:
            raise InvalidInputError(
                f"world size {world} is not divisible by {option('nodes', nodes)}: give every node "
                "the same number of GPUs")
        if strategy is Strategy.TP and tp == 1:
            raise InvalidInputError(
                f"{option('strategy', 'tp')} needs a tensor-parallel degree: add "
                f"{option('tp', 'N')} (N > 1)")
        if tp > 1 and strategy not in _WITH_TP:
            raise InvalidInputError(
                f"{option('tp', tp)} combines with {option('strategy', 'tp')} or fsdp (2-D: "
                "tensor parallel within "
                f"a group, FSDP across groups), not with {strategy.value}")
        if offload not in _OFFLOADS[strategy]:
            has = ", ".join(o.value for o in sorted(_OFFLOADS[strategy]) if o is not Offload.NONE)
            raise InvalidInputError(
                f"{option('strategy', strategy.value)} has no "
                f"{option('offload', offload.value)}"
                + (f": it offers {has}" if has else ": it offloads nothing")
                + (" (DeepSpeed offloads parameters only in ZeRO-3)" if strategy.is_zero else ""))
        if strategy is Strategy.HSDP and nodes == 1:
            raise InvalidInputError(
                f"{option('strategy', 'hsdp')} shards within a node and replicates across "
                f"nodes: give {option('nodes', 'M')} (M > 1), or use "
                f"{option('strategy', 'fsdp')} on one node")
        if strategy.is_zero and importlib.util.find_spec("deepspeed") is None:
            raise InvalidInputError(
                f"{option('strategy', strategy.value)} needs DeepSpeed: pip install deepspeed "
                "(or pip install 'batchfit[deepspeed]')")
        if not isinstance(self.prefetch, int) or isinstance(self.prefetch, bool) \
                or self.prefetch < 0:
            raise InvalidInputError(f"prefetch must be an integer >= 0, not {self.prefetch!r}")
        if not self.bucket_cap_mb > 0:
            raise InvalidInputError(f"bucket_cap_mb must be positive, not {self.bucket_cap_mb!r}")
        if self.rank is not None and not (isinstance(self.rank, int) and 0 <= self.rank < world):
            raise InvalidInputError(
                f"rank {self.rank!r} is not a rank of a world of {world}: use 0..{world - 1}")
        for name in ("param_dtype", "reduce_dtype"):
            value = getattr(self, name)
            if value is not None and value not in ("float32", "bfloat16", "float16"):
                raise InvalidInputError(
                    f"{name} {value!r}: use float32, bfloat16 or float16")

    @property
    def gpus_per_node(self) -> int:
        return self.world_size // self.nodes

    @property
    def data_parallel_size(self) -> int:
        """Ranks that see different samples (the world divided by the tensor-parallel degree)."""
        return self.world_size // self.tp

    @property
    def shard_size(self) -> int:
        """Ranks a parameter is sharded over: the world (FSDP, ZeRO), a node (HSDP), the
        data-parallel dimension (FSDP with tensor parallel), 1 (DDP, pure TP)."""
        if self.strategy is Strategy.DDP:
            return 1
        if self.strategy is Strategy.HSDP:
            return self.gpus_per_node
        return self.data_parallel_size

    @property
    def resharded_after_forward(self) -> bool:
        if self.reshard_after_forward is not None:
            return bool(self.reshard_after_forward)
        return self.strategy is not Strategy.FSDP_GRAD_OP

    def ranks_to_trace(self) -> tuple[int, ...]:
        """The ranks a prediction traces: ``rank`` if given, else rank 0 and the last rank.

        Ranks differ only in their shards: with torch's ``chunk`` (FSDP) and DeepSpeed's
        padded partitions, every rank but the last holds full chunks and the last holds
        the remainder (its gradients and optimizer state can be smaller); the
        tensor-parallel and replicated ranks are alike. So rank 0 and the last rank bound
        all the others.
        """
        if self.rank is not None:
            return (self.rank,)
        return (0,) if self.world_size == 1 else (0, self.world_size - 1)

    def to_dict(self) -> dict[str, Any]:
        return {
            "world_size": self.world_size, "strategy": self.strategy.value,
            "offload": self.offload.value, "tp": self.tp, "nodes": self.nodes,
            "gpus_per_node": self.gpus_per_node, "shard_size": self.shard_size,
            "reshard_after_forward": self.resharded_after_forward,
        }
