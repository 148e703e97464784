"""Per-rank model-state bytes, derived by hand from how each strategy lays memory out.

The model: three blocks ``Linear(12, 12)`` and a head ``Linear(12, 5)``, fp32, AdamW
(for-loop, as on the CPU), 4 ranks. What is left alive at the end of the steady step
(parameters, gradients, optimizer state, DDP's bucket) is compared per category.

FSDP2 (torch/distributed/fsdp/_fully_shard/_fsdp_param.py, _fsdp_collectives.py):

* each parameter is cut along dim 0 with ``torch.chunk`` into pieces of
  ``ceil(rows / 4)`` rows; every rank stores a piece padded to that size, so a 12-row
  weight costs 3 x 12 = 36 elements and the 5-row head weight 2 x 12 = 24 elements on
  every rank, even rank 3, whose piece of the head is empty (chunks of 2, 2, 1);
* the sharded gradients of one unit are views into one reduce-scatter output of
  ``sum(rows padded to a multiple of 4 x columns) / 4`` elements: (144 + 12) / 4 = 39 per
  block, (8 x 12 + 8) / 4 = 26 for the root's head;
* AdamW's ``exp_avg`` and ``exp_avg_sq`` are ``zeros_like`` the sharded parameter: the
  unpadded piece (rank 0: 143 elements; rank 3: the blocks' 117 only), plus a 4-byte
  float32 step count per parameter.

DDP: every rank holds all 2,132 bytes of parameters, gradients of the same size, the
optimizer state twice that plus the step counts, and one gradient bucket (the model is
far below the 1 MiB first bucket) of the parameters' size.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from batchfit.device.profile import DeviceProfile
from batchfit.engine.spec import TrainConfig
from batchfit.engine.trace import alive_at_end
from batchfit.engine.tracer import Category
from batchfit.sharding.layout import Parallelism
from batchfit.sharding.rank import trace_rank

F32 = 4
STEP = 4  # AdamW's float32 step count, one per parameter
N_PARAMS = 8


class Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(12, 12) for _ in range(3))
        self.head = nn.Linear(12, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _held(strategy: str, rank: int) -> dict[Category, int]:
    layout = Parallelism(world_size=4, strategy=strategy)
    trace = trace_rank(Blocks, (12,), 2, TrainConfig(optimizer="adamw"),
                       DeviceProfile.cpu(kernel_scratch=False), layout, rank)
    held: dict[Category, int] = {}
    for event in alive_at_end(trace.steady_events):
        held[event.category] = held.get(event.category, 0) + event.nbytes
    return held


@pytest.mark.parametrize("rank, unpadded", [(0, 3 * (36 + 3) + 2 * 12 + 2),
                                            (2, 3 * (36 + 3) + 1 * 12 + 1),
                                            (3, 3 * (36 + 3))])
def test_fsdp2_shards(rank: int, unpadded: int) -> None:
    held = _held("fsdp", rank)
    assert held[Category.PARAMETERS] == (3 * (36 + 3) + (24 + 2)) * F32
    assert held[Category.GRADIENTS] == (3 * 39 + 26) * F32
    assert held[Category.OPTIMIZER_STATE] == 2 * unpadded * F32 + N_PARAMS * STEP
    assert Category.GATHERED_PARAMETERS not in held  # resharded after backward


def test_ddp_replicates() -> None:
    size = (3 * (144 + 12) + 60 + 5) * F32
    for rank in (0, 3):
        held = _held("ddp", rank)
        assert held[Category.PARAMETERS] == size
        assert held[Category.GRADIENTS] == size
        assert held[Category.COMMUNICATION] == size  # the bucket
        assert held[Category.OPTIMIZER_STATE] == 2 * size + N_PARAMS * STEP


# DeepSpeed ZeRO (runtime/zero/stage_1_and_2.py, stage3.py), bf16 with AdamW: DeepSpeed
# flattens the 533 parameters into one group padded to a multiple of the world size times
# its 2-element alignment: 536, so each of the 4 ranks owns 134 elements. Every stage
# keeps this rank's fp32 master copy and Adam's two moments of its 134 elements (12
# bytes each) and one step count; ZeRO-1 and 2 keep all 536 bf16 parameters, ZeRO-3 only
# this rank's 134, and ZeRO-3 also this rank's 134 bf16 gradients: 16 bytes x P / N in all
# (16 x 134 = 2,144), as the ZeRO paper counts. Parameters below
# ``stage3_param_persistence_threshold`` stay gathered (DeepSpeed's default, 10^5
# elements, would keep all of this model's): 0 here.
ZERO = {"reduce_bucket_size": 1000, "allgather_bucket_size": 1000,
        "stage3_param_persistence_threshold": 0}
PADDED = 536
OWNED = PADDED // 4
BF16 = 2


@pytest.mark.parametrize("stage", ["zero1", "zero2", "zero3"])
def test_zero_partitions(stage: str) -> None:
    layout = Parallelism(world_size=4, strategy=stage, deepspeed=ZERO)
    trace = trace_rank(Blocks, (12,), 2, TrainConfig(optimizer="adamw", precision="bf16"),
                       DeviceProfile.cpu(kernel_scratch=False), layout, 3)
    held: dict[Category, int] = {}
    for event in alive_at_end(trace.steady_events):
        held[event.category] = held.get(event.category, 0) + event.nbytes
    assert held[Category.OPTIMIZER_STATE] == 3 * OWNED * F32 + STEP
    if stage == "zero3":
        assert held[Category.PARAMETERS] == OWNED * BF16
        assert held[Category.GRADIENTS] == OWNED * BF16
        assert held[Category.PARAMETERS] + held[Category.GRADIENTS] \
            + held[Category.OPTIMIZER_STATE] - STEP == 16 * OWNED
    else:
        assert held[Category.PARAMETERS] == PADDED * BF16


def test_fsdp2_cpu_offload_keeps_model_state_off_the_gpu() -> None:
    # CPUOffloadPolicy: shards, gradients and optimizer state live on the host; each
    # all-gather first copies the unit's padded shards to the GPU: (36 + 3) fp32 elements
    # per block, (24 + 2) for the root's head. Every unit gathers twice, in forward and
    # again in backward (reshard_after_forward=True for every unit, the root included,
    # as torchtitan shards).
    from batchfit.engine.tracer import EventKind
    from batchfit.sharding.offload import COPY_TO_DEVICE

    layout = Parallelism(world_size=4, strategy="fsdp", offload="params")
    trace = trace_rank(Blocks, (12,), 2, TrainConfig(optimizer="adamw"),
                       DeviceProfile.cpu(kernel_scratch=False), layout, 0)
    held = {event.category for event in alive_at_end(trace.steady_events)}
    assert held == {Category.INPUTS}
    copies = sorted(e.nbytes for e in trace.steady_events
                    if e.op == COPY_TO_DEVICE and e.kind is EventKind.ALLOC)
    assert copies == [26 * F32] * 2 + [39 * F32] * 6


def test_a_zero_trace_leaves_no_chatter_on_stderr() -> None:
    """Importing DeepSpeed logs torch.utils.cpp_extension's "No CUDA runtime is found"
    (no CUDA toolkit here), and ZeRO's alignment assert reads ``data_ptr()``, which torch
    warns about on a fake tensor; neither may reach the user's stderr from a trace. A
    fresh process, so DeepSpeed is imported under the trace as in the CLI."""
    import subprocess
    import sys

    pytest.importorskip("deepspeed")
    code = (
        "import torch\n"
        "from torch._subclasses.fake_tensor import FakeTensorMode\n"
        "from batchfit.sharding.zero import _quiet_deepspeed\n"
        "with _quiet_deepspeed():\n"
        "    import deepspeed  # noqa: F401\n"
        "    with FakeTensorMode():\n"
        "        torch.empty(8).data_ptr()\n"
        "print('done')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    assert "No CUDA runtime" not in done.stderr
    assert "data pointer of FakeTensor" not in done.stderr
    assert done.stdout == "done\n"  # DeepSpeed's stdout is kept off the user's


@pytest.mark.parametrize("precision, root_shard", [("fp32", 17), ("amp-bf16", 18)])
def test_fsdp1_cpu_offload_keeps_model_state_off_the_gpu(precision: str, root_shard: int) -> None:
    # FSDP1 CPUOffload(offload_params=True) (torch/distributed/fsdp/_flat_param.py): the
    # sharded flat parameter (_local_shard), the gradient FSDP copies it to (_cpu_grad)
    # and the optimizer live on the host; the reduce-scatter output is freed on the GPU at
    # the end of backward. A unit's flat parameter is its parameters, each starting at a
    # multiple of 16 bytes of the compute dtype (use_orig_params=True), padded to a
    # multiple of the 4 ranks: a block 144 + 12 = 156 elements, 39 per rank; the root's
    # head 60 + 5 = 65 -> 68, 17 per rank in fp32, and in bf16 (8-element alignment) 60 +
    # 4 + 5 = 69 -> 72, 18 per rank. Every gather first copies the fp32 shard to the GPU:
    # without mixed precision that copy is all-gathered (flat_param_to), with it the copy
    # fills the bf16 _mp_shard (_local_shard.to(device)). Each unit gathers in forward and
    # in backward, the root too: FSDP1 keeps the root's gathered parameter after forward
    # but points its flat parameter back at the host shard, so its pre-backward copies
    # again (pre_unshard: flat_param.device != self.device). The model is built on the
    # host; wrapping, FSDP1 flattens one unit at a time on the GPU (a block: 156 fp32
    # elements, the largest) and moves its shard back to the host.
    from batchfit.engine.tracer import EventKind, Phase
    from batchfit.sharding.offload import COPY_TO_DEVICE

    layout = Parallelism(world_size=4, strategy="fsdp1", offload="params")
    trace = trace_rank(Blocks, (12,), 2, TrainConfig(optimizer="adamw", precision=precision),
                       DeviceProfile.cpu(kernel_scratch=False), layout, 0)
    held = {event.category for event in alive_at_end(trace.steady_events) if event.nbytes}
    assert held == {Category.INPUTS}
    copies = sorted(e.nbytes for e in trace.steady_events
                    if e.op == COPY_TO_DEVICE and e.kind is EventKind.ALLOC)
    assert copies == sorted([root_shard * F32] * 2 + [39 * F32] * 6)
    live = setup_peak = 0
    for event in trace.steady_events:
        if event.phase is not Phase.SETUP:
            break
        live += {EventKind.ALLOC: event.nbytes, EventKind.FREE: -event.nbytes}.get(event.kind, 0)
        setup_peak = max(setup_peak, live)
    assert setup_peak == 156 * F32
    plain = trace_rank(Blocks, (12,), 2, TrainConfig(optimizer="adamw", precision=precision),
                       DeviceProfile.cpu(kernel_scratch=False),
                       Parallelism(world_size=4, strategy="fsdp1"), 0)
    kept = {}
    for event in alive_at_end(plain.steady_events):
        kept[event.category] = kept.get(event.category, 0) + event.nbytes
    assert kept[Category.PARAMETERS] == (3 * 39 + root_shard) * F32  # what went to the host
