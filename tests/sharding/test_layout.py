"""Bad layouts are one clear line (InvalidInputError, exit code 2) before any trace."""

from __future__ import annotations

import importlib.util

import pytest

from batchfit.errors import InvalidInputError
from batchfit.sharding.layout import Offload, Parallelism, Strategy


@pytest.mark.parametrize("kwargs, words", [
    ({"world_size": 0}, "world size must be a positive integer"),
    ({"world_size": 6, "strategy": "tp", "tp": 4}, "not divisible by tp=4"),
    ({"world_size": 8, "nodes": 3}, "not divisible by nodes=3"),
    ({"world_size": 8, "strategy": "tp"}, "needs a tensor-parallel degree"),
    ({"world_size": 8, "strategy": "ddp", "tp": 2}, "combines with strategy='tp' or fsdp"),
    ({"world_size": 8, "strategy": "ddp", "offload": "params"}, "has no offload='params'"),
    ({"world_size": 8, "strategy": "zero2", "offload": "params"}, "only in ZeRO-3"),
    ({"world_size": 8, "strategy": "fsdp", "offload": "optimizer"}, "has no offload='optimizer'"),
    ({"world_size": 8, "strategy": "hsdp"}, "give nodes='M'"),
    ({"world_size": 8, "strategy": "sharded"}, "unknown strategy"),
    ({"world_size": 8, "rank": 8}, "is not a rank of a world of 8"),
])
def test_bad_layouts_say_what_is_wrong(kwargs: dict, words: str) -> None:
    with pytest.raises(InvalidInputError, match=words) as caught:
        Parallelism(**kwargs)
    assert "\n" not in str(caught.value)


def test_zero_without_deepspeed_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "deepspeed" else real(name, *a))
    with pytest.raises(InvalidInputError, match="pip install deepspeed"):
        Parallelism(world_size=8, strategy="zero3")


def test_dimensions_follow_the_strategy() -> None:
    hsdp = Parallelism(world_size=16, strategy="hsdp", nodes=2)
    assert (hsdp.gpus_per_node, hsdp.shard_size, hsdp.data_parallel_size) == (8, 8, 16)
    two_d = Parallelism(world_size=16, strategy="tp", tp=4)
    assert (two_d.shard_size, two_d.data_parallel_size) == (4, 4)
    assert Parallelism(world_size=8, strategy="ddp").shard_size == 1
    assert not Parallelism(world_size=8, strategy="fsdp-grad-op").resharded_after_forward
    assert Parallelism(world_size=8, strategy="fsdp").ranks_to_trace() == (0, 7)
    assert Parallelism(world_size=8, strategy="fsdp", rank=3).ranks_to_trace() == (3,)
    assert Parallelism(world_size=8, strategy="zero3", offload="params").offload \
        is Offload.PARAMS
    assert Strategy.ZERO2.zero_stage == 2
