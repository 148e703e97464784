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
from batchfit.engine.trace import Category, alive_at_end
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
