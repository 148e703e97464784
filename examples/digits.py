"""A workload for ``batchfit noise`` and ``batchfit recommend``: an MLP on scikit-learn's
bundled digits (1,797 8x8 images; no download), trained with SGD.

    batchfit noise examples/digits.py:build --batch-small 8 --batch-big 64
    batchfit recommend examples/digits.py:build --device cpu --memory 2GiB
"""

import torch
from torch import nn


def build(width: int = 64, lr: float = 0.5):
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32)
    x = (x - x.mean(0)) / (x.std(0) + 1e-6)
    y = torch.tensor(data.target)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, width), nn.Tanh(), nn.Linear(width, 10))

    def loss_fn(model, batch):
        inputs, labels = batch
        return nn.functional.cross_entropy(model(inputs), labels)

    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    return model, (x, y), loss_fn, optimizer
