"""The noise-scale estimator against linear regression's closed form, over many seeds.

How it asks batchfit: ``batchfit.noise_scale(...)``, the public entry point, on the closed-
form model.

Linear regression with Gaussian inputs and noise (tests/stats/noise_models.py: d = 8,
sigma = 1, 200,000 examples): at the current weights |G|^2 = |delta|^2 and
tr(Σ) = (d + 1)|delta|^2 + d sigma^2 exactly. For each method (micro-batches of 8 in a big
batch of 64; per-example gradients in a big batch of 64) and each of ``--seeds`` seeds: a
20-step pilot states the steps for a 10% half-width (``steps_for(0.1)``), then a fresh run of
that many steps is compared with the closed form. Reported: the median stated steps, the
share of runs within 10% of the truth (the claim: all of them, or nearly: a 95% interval),
the share of 95% intervals that hold the truth, and the median error.

Usage: python benchmarks/noise_closed_form.py [--seeds 20]
Writes benchmarks/results/noise_closed_form.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "tests" / "stats"))
from noise_models import half_mse, linear_regression

from batchfit import noise_scale

RESULTS = Path(__file__).parent / "results"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    problem = linear_regression()
    truth = problem.b_simple
    data = (problem.x, problem.y)
    summary: dict = {"truth_b_simple": truth, "seeds": args.seeds, "methods": {}}
    lines = ["# The noise scale against linear regression's closed form", "",
             (f"`python benchmarks/noise_closed_form.py --seeds {args.seeds}`: true B_simple = "
             f"{truth:.2f} (|G|^2 = {problem.grad_sq_norm:.4f}, tr(Σ) = "
             f"{problem.trace_sigma:.3f}); big batch 64."), "",
             ("| method | stated steps (median) | within 10% | 95% interval holds the truth | "
             "median abs error | seconds per run (median) |"), "|---|---:|---:|---:|---:|---:|"]
    for method, small in (("microbatch", 8), ("per-example", 1)):
        rows = []
        for seed in range(args.seeds):
            pilot = noise_scale(problem.model, half_mse, data, batch_small=small, batch_big=64,
                                steps=20, method=method, seed=1000 + seed)
            stated = pilot.steps_for(0.1)
            started = time.perf_counter()
            r = noise_scale(problem.model, half_mse, data, batch_small=small, batch_big=64,
                            steps=stated, method=method, seed=2000 + seed)
            rows.append({"stated": stated, "b_simple": r.b_simple, "ci": [r.ci_low, r.ci_high],
                         "error": r.b_simple / truth - 1,
                         "seconds": time.perf_counter() - started})
        within = sum(abs(r["error"]) <= 0.10 for r in rows) / len(rows)
        covered = sum(r["ci"][0] <= truth <= r["ci"][1] for r in rows) / len(rows)
        m = {"stated_median": statistics.median(r["stated"] for r in rows),
             "within_10_percent": within, "coverage_95": covered,
             "median_abs_error": statistics.median(abs(r["error"]) for r in rows),
             "seconds_median": statistics.median(r["seconds"] for r in rows), "runs": rows}
        summary["methods"][method] = m
        lines.append(f"| {method} (b={small}) | {m['stated_median']:.0f} | {within:.0%} | "
                     f"{covered:.0%} | {m['median_abs_error']:.1%} | {m['seconds_median']:.2f} |")
        print(lines[-1], flush=True)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "noise_closed_form.json").write_text(json.dumps(summary, indent=1))
    (RESULTS / "noise_closed_form.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
