"""What measuring the noise scale in training costs: the same 50 accumulated steps with and
without :class:`batchfit.stats.NoiseScaleMonitor` (``every=1``: every step measured).

How it asks batchfit: ``batchfit.NoiseScaleMonitor`` in a training loop, timed (a speed
benchmark).

Each model trains with ``MICRO`` accumulated micro-batches per optimizer step (what the
monitor reads) and AdamW. A round times 50 steps without the monitor and 50 with it
(attached at the start, ``result()`` read at the end, so the deferred device reads are
counted), in alternating order; ``--rounds`` rounds, and the claim is on the median over
rounds of the with/without ratio: <= 1.10. Timed by the calling thread's CPU time on one
intra-op thread (CPU backward runs on the calling thread), which other processes on this
shared machine disturb far less than wall time; wall time is reported too.

Models: a small CNN (3x32x32, batch 64 = 4 x 16), a two-layer transformer encoder (d=128,
sequence 64, batch 32 = 4 x 8) and the digits MLP of noise_tradeoff.py (64-64-10, batch 64
= 4 x 16: a step of about a millisecond, the worst case for per-step fixed costs).

Usage: python benchmarks/noise_overhead.py [--rounds 7] [--steps 50]
Writes benchmarks/results/noise_overhead.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from torch import nn

from batchfit import NoiseScaleMonitor

RESULTS = Path(__file__).parent / "results"
MICRO = 4


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1))
        self.head = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))


class SmallTransformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(1000, 128)
        layer = nn.TransformerEncoderLayer(128, 4, 256, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(128, 1000)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(x)))


def workloads() -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "cnn": (SmallCNN, torch.randn(64, 3, 32, 32, generator=g),
                torch.randint(0, 10, (64,), generator=g)),
        "transformer": (SmallTransformer, torch.randint(0, 1000, (32, 64), generator=g),
                        torch.randint(0, 1000, (32, 64), generator=g)),
        "mlp": (lambda: nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 10)),
                torch.randn(64, 64, generator=g), torch.randint(0, 10, (64,), generator=g)),
    }


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out = model(x)
    return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def run(build, x, y, steps: int, monitored: bool) -> tuple[float, float, float]:
    """(thread CPU seconds, wall seconds, B_simple or nan) for ``steps`` optimizer steps."""
    torch.manual_seed(0)
    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for _ in range(2):  # warm up the kernels and the optimizer state, unmeasured
        loss_of(model, x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    cpu, wall = time.thread_time(), time.perf_counter()
    monitor = NoiseScaleMonitor(model, accumulation_steps=MICRO) if monitored else None
    for _ in range(steps):
        for xs, ys in zip(x.chunk(MICRO), y.chunk(MICRO)):
            (loss_of(model, xs, ys) / MICRO).backward()
        if monitor is not None:
            monitor.step()
        opt.step()
        opt.zero_grad(set_to_none=True)
    b_simple = float("nan")
    if monitor is not None:
        b_simple = monitor.result().b_simple
        monitor.close()
    return time.thread_time() - cpu, time.perf_counter() - wall, b_simple


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()
    torch.set_num_threads(1)
    summary: dict = {"steps": args.steps, "rounds": args.rounds, "micro_batches": MICRO,
                     "models": {}}
    lines = ["# Cost of measuring the noise scale in training", "",
             (f"`python benchmarks/noise_overhead.py --rounds {args.rounds} --steps {args.steps}`: "
             f"{args.steps} AdamW steps of {MICRO} accumulated micro-batches, with and without "
             "the monitor, alternating; thread CPU time, one thread."), "",
             ("| model | step without (ms) | step with (ms) | ratio, median of rounds (CPU) | "
             "ratio range | wall-time ratio (median) |"), "|---|---:|---:|---:|---|---:|"]
    for name, (build, x, y) in workloads().items():
        off, on, ratios, wall_ratios = [], [], [], []
        for i in range(args.rounds):
            order = (False, True) if i % 2 == 0 else (True, False)
            timed = {flag: run(build, x, y, args.steps, flag) for flag in order}
            off.append(timed[False][0])
            on.append(timed[True][0])
            ratios.append(timed[True][0] / timed[False][0])
            wall_ratios.append(timed[True][1] / timed[False][1])
        ratio = statistics.median(ratios)
        summary["models"][name] = {
            "step_without_ms": 1e3 * statistics.median(off) / args.steps,
            "step_with_ms": 1e3 * statistics.median(on) / args.steps,
            "ratio_median": ratio, "ratios": ratios, "wall_ratio_median":
            statistics.median(wall_ratios), "ok": ratio <= 1.10}
        m = summary["models"][name]
        lines.append(f"| {name} | {m['step_without_ms']:.2f} | {m['step_with_ms']:.2f} | "
                     f"**{ratio:.3f}** | {min(ratios):.3f}-{max(ratios):.3f} | "
                     f"{m['wall_ratio_median']:.3f} |")
        print(lines[-1], flush=True)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "noise_overhead.json").write_text(json.dumps(summary, indent=1))
    (RESULTS / "noise_overhead.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
