"""Does the measured noise scale predict the steps/batch trade-off of a real training run?

How it asks batchfit: ``batchfit.noise_scale(...)`` and ``batchfit.NoiseScaleMonitor``, the
public entry points, in a real training run.

Task: scikit-learn's bundled digits (1,797 8x8 images, 10 classes; no download), features
standardised, an MLP 64-64-10 (tanh) trained from scratch with plain SGD on the whole set,
batches from a fresh shuffle each epoch. Target: the full-dataset cross-entropy at or below
``--target`` (checked after every step).

(a) The trade-off. For each batch size B (8 ... 512), the learning rate is tuned on a grid
    (factors of sqrt(2)), each (B, lr) run with ``--seeds`` initialisations; S(B) is the least
    mean number of steps to the target over the learning rates at which every seed got there
    (McCandlish et al. 2018 tune the learning rate per batch size too). A least-squares fit
    of S = S_min + S_min B_crit / B (linear in 1/B) gives S_min, B_crit and R^2.
    Claim checked: R^2 >= 0.95.
(b) The noise scale. Each batch size's best run is repeated (seed 0), and at ``CHECKPOINTS``
    evenly spaced steps (the first before any update) ``batchfit.noise_scale`` measures
    B_simple at the current weights (per-example gradients, big batch 128, 10 steps; the
    model and RNG are left as they were, so the run goes on unchanged). Their mean is the
    run's step-averaged noise scale: in the paper's model every step of a run at batch B
    costs (1 + B_noise/B) of an ideal step, so the B_crit of the fit is B_noise averaged over
    the steps of the ideal (large-batch) run. Claim checked: the fitted B_crit is within 2x of
    the step-averaged B_simple of the largest batch's run (the closest to that ideal run) and
    of the median of every batch's step average. Also shown: the in-training monitor
    (:class:`batchfit.stats.NoiseScaleMonitor`, every batch split into 4 accumulated
    micro-batches, ``ema_decay=None``), whose whole-run estimate averages each part over the
    run before the ratio and so weighs the early steps, where |G| is large, the most.

Usage: python benchmarks/noise_tradeoff.py [--target 0.1] [--seeds 2] [--quick]
Writes benchmarks/results/noise_tradeoff.{md,json,png} and prints a summary.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import torch
from torch import nn

from batchfit import NoiseScaleMonitor

RESULTS = Path(__file__).parent / "results"
BATCHES = (8, 16, 32, 64, 128, 256, 512)
LR_GRID = tuple(2 ** (k / 2) for k in range(-8, 9))  # 1/16 ... 16
MAX_STEPS = 6000
MICRO = 4
CHECKPOINTS = 8


def digits() -> tuple[torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32)
    x = (x - x.mean(0)) / (x.std(0) + 1e-6)
    return x, torch.tensor(data.target)


def mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 10))


def full_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return nn.functional.cross_entropy(model(x), y).item()


def batches(n: int, batch_size: int, seed: int):
    g = torch.Generator().manual_seed(10_000 + seed)
    while True:
        order = torch.randperm(n, generator=g)
        for start in range(0, n - batch_size + 1, batch_size):
            yield order[start:start + batch_size]


def snapshot(model: nn.Module, x: torch.Tensor, y: torch.Tensor, seed: int) -> float:
    """B_simple at the current weights, measured by batchfit (the model is left as it was)."""
    from batchfit import noise_scale

    def loss(m: nn.Module, batch) -> torch.Tensor:
        return nn.functional.cross_entropy(m(batch[0]), batch[1])

    return noise_scale(model, loss, (x, y), batch_small=1, batch_big=128, steps=10,
                       seed=seed).b_simple


def train(x, y, batch_size: int, lr: float, seed: int, target: float, *,
          monitor: bool = False, every: int = 0) -> dict:
    """Steps to the target (None if it diverged or ran out); with ``monitor`` the monitor's
    whole-run estimate; with ``every`` B_simple snapshots every that many steps."""
    model = mlp(seed)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    watcher = (NoiseScaleMonitor(model, ema_decay=None, batch_size=batch_size // MICRO,
                                 dataset_size=len(x), keep_history=True) if monitor else None)
    snapshots = [(0, snapshot(model, x, y, 0))] if every else []
    stream = batches(len(x), batch_size, seed)
    steps = None
    for step in range(1, MAX_STEPS + 1):
        idx = next(stream)
        opt.zero_grad(set_to_none=True)
        for part in idx.chunk(MICRO) if monitor else (idx,):
            scale = len(part) / len(idx)
            (nn.functional.cross_entropy(model(x[part]), y[part]) * scale).backward()
        if watcher is not None:
            watcher.step()
        opt.step()
        loss = full_loss(model, x, y)
        if every and step % every == 0 and loss > target:
            snapshots.append((step, snapshot(model, x, y, step)))
        if not math.isfinite(loss) or loss > 20:
            break
        if loss <= target:
            steps = step
            break
    out = {"steps": steps}
    if watcher is not None:
        r = watcher.result()
        watcher.close()
        out.update(b_simple=r.b_simple, ci=(r.ci_low, r.ci_high), measured_steps=r.steps,
                   history=[s.b_simple for s in r.history])
    if every:
        out["snapshots"] = snapshots
    return out


def exact_b_simple(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """tr(Σ)/|G|^2 over the whole dataset from every example's own gradient."""
    from torch.func import functional_call, grad, vmap

    params = {k: v.detach() for k, v in model.named_parameters()}

    def one(p, xi, yi):
        return nn.functional.cross_entropy(functional_call(model, p, (xi[None],)), yi[None])

    per = vmap(grad(one), in_dims=(None, 0, 0))(params, x, y)
    flat = torch.cat([v.reshape(len(x), -1) for v in per.values()], 1)
    mean = flat.mean(0)
    return float(((flat - mean) ** 2).sum(1).mean() / mean.square().sum())


def exact_b_simple_at(x, y, row: dict, step: int, target: float) -> float:
    """The exact B_simple at ``step`` of ``row``'s seed-0 run (replayed up to that step)."""
    model = mlp(0)
    opt = torch.optim.SGD(model.parameters(), lr=row["lr"])
    stream = batches(len(x), row["batch_size"], 0)
    for _ in range(step):
        idx = next(stream)
        opt.zero_grad(set_to_none=True)
        for part in idx.chunk(MICRO):
            (nn.functional.cross_entropy(model(x[part]), y[part]) * len(part) / len(idx)).backward()
        opt.step()
    return exact_b_simple(model, x, y)


def steps_at(x, y, batch_size: int, lr: float, seeds: int, target: float) -> float | None:
    found = []
    for seed in range(seeds):
        steps = train(x, y, batch_size, lr, seed, target)["steps"]
        if steps is None:
            return None
        found.append(steps)
    return statistics.mean(found)


def tune(x, y, batch_size: int, seeds: int, target: float, start: int) -> tuple[float, float]:
    """The least mean steps over the learning-rate grid: a local search from ``start``
    (the previous batch's best index), widening until two worse neighbours on each side."""
    results: dict[int, float | None] = {}

    def at(i: int) -> float:
        if i not in results:
            results[i] = steps_at(x, y, batch_size, LR_GRID[i], seeds, target)
        return math.inf if results[i] is None else results[i]

    best = start
    while True:
        around = [i for i in range(best - 2, best + 3) if 0 <= i < len(LR_GRID)]
        new_best = min(around, key=lambda i: (at(i), i))
        if new_best == best:
            break
        best = new_best
    if math.isinf(at(best)):
        raise RuntimeError(f"no learning rate reaches the target at batch {batch_size}")
    return at(best), LR_GRID[best]


def fit(batch_sizes: list[int], steps: list[float]) -> dict:
    inv = [1 / b for b in batch_sizes]
    n = len(inv)
    mx, my = sum(inv) / n, sum(steps) / n
    slope = sum((a - mx) * (s - my) for a, s in zip(inv, steps)) / sum((a - mx) ** 2 for a in inv)
    intercept = my - slope * mx
    predicted = [intercept + slope * a for a in inv]
    ss_res = sum((s - p) ** 2 for s, p in zip(steps, predicted))
    ss_tot = sum((s - my) ** 2 for s in steps)
    return {"s_min": intercept, "b_crit": slope / intercept, "r2": 1 - ss_res / ss_tot}


def plot(rows: list[dict], fitted: dict, b_simple: float, median: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    bs = [r["batch_size"] for r in rows]
    left.loglog(bs, [r["steps"] for r in rows], "o", label="measured S(B) (best lr)")
    grid = [2 ** (k / 8) for k in range(8 * 3, 8 * 9 + 1)]
    left.loglog(grid, [fitted["s_min"] * (1 + fitted["b_crit"] / b) for b in grid], "-",
                label=f"S_min (1 + B_crit/B): B_crit = {fitted['b_crit']:.0f}, "
                      f"R² = {fitted['r2']:.3f}")
    left.axvline(fitted["b_crit"], color="C1", ls=":", lw=1)
    left.axvline(b_simple, color="C2", ls="--", lw=1,
                 label=f"step-averaged B_simple, largest batch's run = {b_simple:.0f}")
    left.axvline(median, color="C3", ls="-.", lw=1,
                 label=f"median over the runs = {median:.0f}")
    left.set_xlabel("batch size B")
    left.set_ylabel("steps to the target loss")
    left.legend(fontsize=8)
    for r in rows:
        steps, values = zip(*r["snapshots"])
        right.plot([s / r["run_steps"] for s in steps], values, "o-", lw=1, ms=3,
                   label=f"B={r['batch_size']}")
    right.set_yscale("log")
    right.set_xlabel("fraction of the run to the target")
    right.set_ylabel("B_simple at the weights (batchfit.noise_scale)")
    right.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=float, default=0.1)
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="batches 16..256, one seed")
    args = parser.parse_args()
    torch.set_num_threads(1)
    started = time.perf_counter()
    x, y = digits()
    batch_sizes = [b for b in BATCHES if not args.quick or 16 <= b <= 256]
    seeds = 1 if args.quick else args.seeds
    rows, start = [], LR_GRID.index(1.0)
    for batch_size in batch_sizes:
        steps, lr = tune(x, y, batch_size, seeds, args.target, start)
        start = LR_GRID.index(lr)
        run = train(x, y, batch_size, lr, 0, args.target, monitor=True)
        every = max(1, math.ceil(run["steps"] / CHECKPOINTS))
        snaps = train(x, y, batch_size, lr, 0, args.target, every=every)["snapshots"]
        averaged = statistics.mean(v for _, v in snaps)
        rows.append({"batch_size": batch_size, "lr": lr, "steps": steps,
                     "run_steps": run["steps"], "step_averaged_b_simple": averaged,
                     "snapshots": snaps, "monitor_b_simple": run["b_simple"],
                     "monitor_ci": run["ci"], "history": run["history"]})
        print(f"B={batch_size:4d} lr={lr:.3g} S={steps:.1f} step-averaged B_simple={averaged:.1f} "
              f"monitor {run['b_simple']:.1f} [{run['ci'][0]:.1f}, {run['ci'][1]:.1f}]  "
              f"{time.perf_counter() - started:.0f} s", flush=True)
    fitted = fit([r["batch_size"] for r in rows], [r["steps"] for r in rows])
    largest = rows[-1]
    b_simple = largest["step_averaged_b_simple"]
    ratio = fitted["b_crit"] / b_simple
    median = statistics.median(r["step_averaged_b_simple"] for r in rows)
    median_ratio = fitted["b_crit"] / median
    exact = [(step, exact_b_simple_at(x, y, largest, step, args.target))
             for step, _ in largest["snapshots"]]
    summary = {
        "target_loss": args.target, "seeds": seeds, "micro_batches": MICRO,
        "fit": fitted, "step_averaged_b_simple": b_simple,
        "step_averaged_at_batch": largest["batch_size"], "b_crit_over_b_simple": ratio,
        "median_step_averaged_b_simple": median, "b_crit_over_median": median_ratio,
        "r2_ok": fitted["r2"] >= 0.95,
        "within_2x": 0.5 <= ratio <= 2.0 and 0.5 <= median_ratio <= 2.0,
        "exact_b_simple_along_largest_run": exact,
        "rows": [{k: v for k, v in r.items() if k != "history"} for r in rows],
        "seconds": round(time.perf_counter() - started, 1),
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "noise_tradeoff.json").write_text(json.dumps(
        {**summary, "histories": {r["batch_size"]: r["history"] for r in rows}}, indent=1))
    plot(rows, fitted, b_simple, median, RESULTS / "noise_tradeoff.png")
    lines = [
        "# Steps to a target loss against batch size, and the measured noise scale",
        "",
        (f"`python benchmarks/noise_tradeoff.py --target {args.target} --seeds {seeds}"
        f"{' --quick' if args.quick else ''}` (digits, MLP 64-64-10, plain SGD, lr tuned per "
        f"batch; {summary['seconds']:.0f} s)"),
        "",
        ("| batch | best lr | steps S(B) | fit S_min(1+B_crit/B) | step-averaged B_simple "
        "(snapshots) | monitor, whole run (95% CI) |"),
        "|---:|---:|---:|---:|---|---|",
    ]
    for r in rows:
        predicted = fitted["s_min"] * (1 + fitted["b_crit"] / r["batch_size"])
        snaps = ", ".join(f"{v:.0f}" for _, v in r["snapshots"])
        low, high = r["monitor_ci"]
        lines.append(f"| {r['batch_size']} | {r['lr']:.3g} | {r['steps']:.1f} | {predicted:.1f} | "
                     f"{r['step_averaged_b_simple']:.1f} ({snaps}) | "
                     f"{r['monitor_b_simple']:.1f} ({low:.1f}-{high:.1f}) |")
    lines += [
        "",
        (f"Fit: S_min = {fitted['s_min']:.2f}, **B_crit = {fitted['b_crit']:.1f}**, "
        f"**R² = {fitted['r2']:.4f}** (claim: >= 0.95: {'yes' if summary['r2_ok'] else 'NO'})."),
        (f"Step-averaged B_simple of the B={largest['batch_size']} run = **{b_simple:.1f}**: "
         f"B_crit / B_simple = **{ratio:.2f}**; median over the batch sizes **{median:.1f}**: "
         f"B_crit / B_simple = **{median_ratio:.2f}** (claim: both within 2x: "
         f"{'yes' if summary['within_2x'] else 'NO'})."),
        f"Exact B_simple (all 1,797 per-example gradients) at the same snapshots of the "
        f"B={largest['batch_size']} run: " + ", ".join(f"step {s}: {v:.0f}" for s, v in exact)
        + " (batchfit's 10-step snapshots: " + ", ".join(
            f"{v:.0f}" for _, v in largest["snapshots"]) + ").",
        "",
        "![trade-off](noise_tradeoff.png)",
    ]
    (RESULTS / "noise_tradeoff.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
