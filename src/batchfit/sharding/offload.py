"""Offloading: what lives in host memory comes off the GPU's events.

The trace runs on fake CPU tensors, where the GPU and the host are the same device, so
an offloaded step is traced with the wrapper's own offload code (FSDP2's
``CPUOffloadPolicy``, DeepSpeed's ``offload_optimizer``/``offload_param``) and the
storages that code keeps on the host are then taken off the device's events:

* FSDP2 ``CPUOffloadPolicy`` (torch/distributed/fsdp/_fully_shard/_fsdp_param.py,
  _fsdp_collectives.py): the sharded parameters and the optimizer state live on the
  host, and the optimizer steps there; each all-gather first copies the unit's shards
  to the GPU (``sharded_local_tensor.to(device)``), a copy freed once the all-gather
  buffer is filled; the reduce-scatter output, on the GPU, becomes the sharded gradient
  and is copied to the host (``new_sharded_grad.to("cpu")``) right there.
* DeepSpeed ``offload_optimizer`` (ZeRO-Offload): the fp32 master partition, its
  gradient and the optimizer state live on the host and the optimizer steps there;
  ``offload_param`` (ZeRO-3): this rank's parameter partition too.

Known limitation: the optimizer phase is taken off whole, so the small device copies
DeepSpeed makes to bring the updated partition back are not counted.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import replace

from batchfit.engine.trace import StepTrace
from batchfit.engine.tracer import Category, Event, EventKind, Phase

#: The H2D copy of a unit's shards (FSDP2 ``CPUOffloadPolicy``), as its events name it.
COPY_TO_DEVICE = "cpu_offload.copy_to_device"


def on_device(trace: StepTrace, *, categories: Iterable[Category] = (),
              phases: Iterable[Phase] = (), host: Iterable[int] = (),
              leave_at_retag: Iterable[int] = ()) -> StepTrace:
    """``trace`` without what lives on the host.

    Args:
        trace: the traced step.
        categories: storages whose last category is one of these are host memory.
        phases: storages allocated in these phases are host memory (the optimizer step,
            when it runs on the host).
        host: event ids of host storages.
        leave_at_retag: event ids of storages made on the device and copied to the host
            when they change category (FSDP's offloaded gradients): freed there.
    """
    rules = (frozenset(categories), frozenset(phases), frozenset(host),
             frozenset(leave_at_retag))
    return replace(trace, steady_events=_filter(trace.steady_events, *rules),
                   first_events=_filter(trace.first_events, *rules))


def _filter(events: Sequence[Event], categories: frozenset[Category], phases: frozenset[Phase],
            host: frozenset[int], leave_at_retag: frozenset[int]) -> tuple[Event, ...]:
    final: dict[int, Category] = {}
    born: dict[int, Phase] = {}
    for event in events:
        final[event.key] = event.category
        if event.kind is EventKind.ALLOC:
            born.setdefault(event.key, event.phase)
    gone = {key for key, category in final.items() if category in categories}
    gone |= {key for key, phase in born.items() if phase in phases}
    gone |= host
    left: set[int] = set()
    kept = []
    for event in events:
        key = event.key
        if key in gone or key in left:
            continue
        if key in leave_at_retag and event.kind is EventKind.RETAG:
            kept.append(replace(event, kind=EventKind.FREE))
            left.add(key)
            continue
        kept.append(event)
    return tuple(kept)
