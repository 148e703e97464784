"""The user's data as a source of random batches for the noise-scale measurement.

Accepted: a map-style ``Dataset`` (with ``len``), a ``DataLoader`` over one (its dataset
and ``collate_fn`` are used; its sampler and batch size are not), a ``TensorDataset``, a
tensor, or a tuple/list/dict of tensors with a common first dimension. Batches are drawn
with batchfit's own ``torch.Generator``, so the user's loader, sampler and global RNG are
never advanced.

Each step's big batch is a uniform sample *without replacement* (a slice of a fresh
permutation), the setting of the finite-population factor in
:func:`batchfit.stats.estimator.batch_variance_factor`; its micro-batches are consecutive
pieces of it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from batchfit.errors import InvalidInputError


def _tensor_columns(data: Any) -> tuple[str, Any] | None:
    """``(kind, columns)`` for data indexable column by column, else None."""
    from torch.utils.data import TensorDataset

    if isinstance(data, TensorDataset):
        data = data.tensors
    if isinstance(data, torch.Tensor):
        return "tensor", data
    if isinstance(data, (tuple, list)) and data and all(isinstance(t, torch.Tensor) for t in data):
        return "tuple", tuple(data)
    if (isinstance(data, Mapping) and data
            and all(isinstance(t, torch.Tensor) for t in data.values())):
        return "dict", dict(data)
    return None


class BatchSource:
    """Random batches of a dataset, drawn with a private generator.

    Args:
        data: see the module docstring.
        seed: the generator's seed (the same seed on every DDP rank draws the same big
            batch, which the ranks split).
        device: where batches go (None leaves them where they are).
    """

    def __init__(self, data: Any, *, seed: int = 0, device: torch.device | None = None):
        self.device = device
        self.generator = torch.Generator().manual_seed(seed)
        self._collate: Callable[[list], Any] | None = None
        columns = _tensor_columns(data)
        if columns is not None:
            self._kind, self._columns = columns
            sizes = {len(t) for t in self._iter_columns()}
            if len(sizes) != 1 or 0 in {t.dim() for t in self._iter_columns()}:
                raise InvalidInputError(
                    "the data tensors must share their first (example) dimension; got lengths "
                    f"{sorted(sizes)}")
            self.size = sizes.pop()
            return
        if isinstance(data, (str, bytes)):
            raise InvalidInputError(
                f"the data is a {type(data).__name__} ({str(data)[:40]!r}): return a Dataset, a "
                "DataLoader or tensors from the factory, not a path or a name")
        self._kind = "dataset"
        dataset, collate = data, None
        from torch.utils.data import DataLoader, IterableDataset

        if isinstance(data, DataLoader):
            dataset, collate = data.dataset, data.collate_fn
        if isinstance(dataset, IterableDataset) or not (hasattr(dataset, "__getitem__")
                                                         and hasattr(dataset, "__len__")):
            raise InvalidInputError(
                f"cannot draw random batches from {type(dataset).__name__}: give a map-style "
                "Dataset (with __len__ and __getitem__), a DataLoader over one, or tensors")
        from torch.utils.data import default_collate

        self._dataset = dataset
        self._collate = collate or default_collate
        self.size = len(dataset)

    def _iter_columns(self) -> Sequence[torch.Tensor]:
        if self._kind == "tensor":
            return (self._columns,)
        if self._kind == "dict":
            return tuple(self._columns.values())
        return self._columns

    def check_size(self, batch_big: int) -> None:
        if self.size < batch_big:
            raise InvalidInputError(
                f"the dataset has {self.size} examples, fewer than the big batch ({batch_big}): "
                "lower the big batch or give more data")

    def draw(self, batch_size: int) -> torch.Tensor:
        """Indices of a uniform sample of ``batch_size`` examples without replacement, in
        random order."""
        if batch_size * 4 > self.size:
            return torch.randperm(self.size, generator=self.generator)[:batch_size]
        # a permutation of a large dataset per step is slow (17 ms for 200,000 examples);
        # the distinct values of i.i.d. draws are a uniform subset by symmetry
        while True:
            drawn = torch.randint(self.size, (batch_size + batch_size // 4 + 8,),
                                  generator=self.generator).unique()
            if len(drawn) >= batch_size:
                return drawn[torch.randperm(len(drawn), generator=self.generator)[:batch_size]]

    def take(self, indices: torch.Tensor) -> Any:
        """The batch of these examples, collated and on the device."""
        if self._kind == "tensor":
            batch: Any = self._columns[indices]
        elif self._kind == "tuple":
            batch = tuple(t[indices] for t in self._columns)
        elif self._kind == "dict":
            batch = {k: t[indices] for k, t in self._columns.items()}
        else:
            batch = self._collate([self._dataset[int(i)] for i in indices])
        return to_device(batch, self.device)


def to_device(batch: Any, device: torch.device | None) -> Any:
    if device is None:
        return batch
    from torch.utils._pytree import tree_map

    return tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, batch)
