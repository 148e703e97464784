"""Linear regression with Gaussian noise, where the noise scale has a closed form.

x ~ N(0, I_d), y = x . w* + e with e ~ N(0, sigma^2), loss 0.5 (x . w - y)^2. With
delta = w - w*, an example's gradient is g = x (x . delta - e), so

    G = E[g] = E[x x^T] delta = delta                         ->  |G|^2 = |delta|^2
    E[g g^T] = E[x x^T (x . delta)^2] + sigma^2 I = |delta|^2 I + 2 delta delta^T + sigma^2 I
               (Isserlis' theorem for the fourth moments of a Gaussian)
    tr(Σ) = tr(E[g g^T]) - |G|^2 = (d + 1) |delta|^2 + d sigma^2

so B_simple = d + 1 + d sigma^2 / |delta|^2 at the current weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LinearRegression:
    x: torch.Tensor
    y: torch.Tensor
    model: torch.nn.Linear
    grad_sq_norm: float
    trace_sigma: float

    @property
    def b_simple(self) -> float:
        return self.trace_sigma / self.grad_sq_norm


def linear_regression(d: int = 8, examples: int = 200_000, sigma: float = 1.0,
                      offset: float = 0.25, seed: int = 0) -> LinearRegression:
    g = torch.Generator().manual_seed(seed)
    w_star = torch.randn(d, generator=g)
    x = torch.randn(examples, d, generator=g)
    y = (x @ w_star + sigma * torch.randn(examples, generator=g)).unsqueeze(1)
    model = torch.nn.Linear(d, 1, bias=False)
    delta = offset * torch.randn(d, generator=g)
    with torch.no_grad():
        model.weight.copy_((w_star + delta).unsqueeze(0))
    dd = float(delta.square().sum())
    return LinearRegression(x, y, model, dd, (d + 1) * dd + d * sigma ** 2)


def half_mse(model: torch.nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return 0.5 * (model(x) - y).square().mean()
