"""Building a model whose constructor reads tensor values (batchfit.engine.fake).

On meta such a constructor fails (``.tolist()``: "Cannot copy out of meta tensor";
``torch.unique`` has no meta kernel). batchfit then builds it under accelerate's
``init_empty_weights``; the expected values below are counted by hand.
"""

from __future__ import annotations

import random
import sys

import numpy as np
import pytest
import torch
from torch import nn

import batchfit
from batchfit.errors import ModelSpecError

WIDTH = 64
DEPTH = 4
CONFIG = batchfit.TrainConfig(mode="train", optimizer="sgd")


class ReadsTensors(nn.Module):
    """timm 1.0.9's ConvNeXt reads drop-path rates with ``torch.linspace(...).tolist()``;
    timm's RegNet rounds widths with ``torch.unique``. Also draws random numbers."""

    def __init__(self) -> None:
        super().__init__()
        rates = torch.linspace(0, 0.1, DEPTH).tolist()
        widths = torch.unique(torch.tensor([WIDTH, WIDTH // 2, WIDTH])).tolist()
        self.noise = torch.randn(3)
        random.random()
        np.random.rand()
        self.net = nn.Sequential(*[nn.Linear(widths[-1], widths[-1]) for _ in rates])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class Plain(nn.Module):
    """The same layers, built without reading a tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def test_meta_cannot_build_it():
    with torch.device("meta"), pytest.raises(NotImplementedError, match="meta"):
        ReadsTensors()


def test_a_constructor_that_reads_tensors_builds():
    got = batchfit.estimate(ReadsTensors, (WIDTH,), 4, CONFIG, device="cpu")
    # 4 Linear(64, 64): (64 * 64 + 64) * 4 bytes each.
    assert got.by_category[batchfit.Category.PARAMETERS] == DEPTH * (WIDTH * WIDTH + WIDTH) * 4
    plain = batchfit.estimate(Plain, (WIDTH,), 4, CONFIG, device="cpu")
    assert got.total_bytes == plain.total_bytes


def test_the_constructors_random_draws_are_undone():
    torch_state, py_state, np_state = torch.get_rng_state(), random.getstate(), np.random.get_state()
    batchfit.estimate(ReadsTensors, (WIDTH,), 2, CONFIG, device="cpu")
    assert torch.equal(torch.get_rng_state(), torch_state)
    assert random.getstate() == py_state
    after = np.random.get_state()
    assert after[0] == np_state[0] and np.array_equal(after[1], np_state[1]) and after[2:] == np_state[2:]


def test_without_accelerate_the_error_says_how_to_build_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "accelerate", None)  # `import accelerate` raises
    with pytest.raises(ModelSpecError) as exc_info:
        batchfit.estimate(ReadsTensors, (WIDTH,), 2, CONFIG, device="cpu")
    message = str(exc_info.value)
    assert "\n" not in message
    assert message.startswith("the model factory raised NotImplementedError: ")
    assert message.endswith("(pip install accelerate)")


def _bad_factory() -> nn.Module:
    raise TypeError("unexpected keyword argument 'widht'")


def test_a_failing_factory_reports_its_own_error():
    with pytest.raises(ModelSpecError) as exc_info:
        batchfit.estimate(_bad_factory, (WIDTH,), 2, CONFIG, device="cpu")
    assert str(exc_info.value) == (
        "the model factory raised TypeError: unexpected keyword argument 'widht'")
