"""The roofline on this CPU: predicted step times against bench_knee.py's dense sweep.

How it asks batchfit: a harness of the engine, not an answer a user can ask. The roofline's
rates are measured on this CPU (``batchfit.speed.cpu_profile.measure_cpu_profile``, once
before each of the dense sweep's rounds, combined kernel by kernel into the fastest by
``fastest_profile``, as the dense sweep keeps each batch's fastest round, so both see the
same load), and ``batchfit.speed.roofline.predict_throughput`` is given that profile: in
words, throughput is predicted for catalog GPUs only (``batchfit bench --predict --gpu
NAME``). The sweeps themselves are ``bench_knee.py``'s, asked in the user's words.

Prediction: the measured profile's roofline against the dense measurement, point by point.
Goal: median step-time error within 25%; and does the predicted knee match the measured one
(within one grid step)? Also shown, as a diagnostic of what is left: the residual scale
(median measured / predicted) of the *other* models' points and the error after applying it
(leave one model out); no prediction uses it.

Usage: python benchmarks/bench_knee_roofline.py [--models mlp,cnn,transformer] [--quick]
Writes benchmarks/results/bench_knee_roofline.md and .json (section (a) is bench_knee.py's
table of the same sweeps).
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_knee

from batchfit.engine.spec import TrainConfig
from batchfit.speed.cpu_profile import fastest_profile, measure_cpu_profile
from batchfit.speed.rates import MEMORY_KINDS, OpKind
from batchfit.speed.roofline import predict_throughput


def run_model(name: str, timing, scale: float) -> dict:
    """bench_knee's sweeps of ``name``, the CPU profiled before each dense round, and the
    roofline's prediction at the dense sweep's batches."""
    profiles, profile_s = [], [0.0]

    def profile_round() -> None:
        started = time.perf_counter()
        profiles.append(measure_cpu_profile(clock=timing.clock))
        profile_s[0] += time.perf_counter() - started

    result = bench_knee.run_model(name, timing, scale, on_dense_round=profile_round)
    factory, inputs, _ = bench_knee.MODELS[name]
    profile = fastest_profile(profiles)
    predicted = predict_throughput(factory, inputs, TrainConfig(optimizer="adamw"),
                                   profile=profile, memory_bytes=result["memory_bytes"],
                                   batches=result["grid"])
    rows = []
    for m, p in zip(result["dense_points"], predicted.points):
        rows.append({"batch_size": m.batch_size, "measured_step_s": m.step_s,
                     "measured_spread": m.spread, "predicted_step_s": p.step_s,
                     "error": p.step_s / m.step_s - 1, "compute_s": p.compute_s,
                     "memory_s": p.memory_s, "overhead_s": p.overhead_s,
                     "page_fault_s": p.page_fault_s})
    errors = [abs(r["error"]) for r in rows]
    grid = tuple(result["grid"])
    result["prediction"] = {
        "points": rows, "median_abs_error": statistics.median(errors),
        "max_abs_error": max(errors), "knee": predicted.knee_batch_size,
        "knee_grid_steps": bench_knee.grid_steps(grid, predicted.knee_batch_size,
                                                 result["dense"]["knee"]),
        "profile": profile.to_dict(), "profile_s": profile_s[0], "profiles": len(profiles)}
    return result


def add_calibrated_errors(results: list[dict]) -> None:
    """Leave-one-model-out: scale each model's prediction by the median measured/predicted
    ratio of the other models' points (a scale does not move the predicted knee)."""
    for r in results:
        others = [p["measured_step_s"] / p["predicted_step_s"] for o in results if o is not r
                  for p in o["prediction"]["points"]]
        if not others:
            continue
        scale = statistics.median(others)
        errors = [scale * p["predicted_step_s"] / p["measured_step_s"] - 1
                  for p in r["prediction"]["points"]]
        r["prediction"]["loo_scale"] = scale
        r["prediction"]["loo_median_abs_error"] = statistics.median(abs(e) for e in errors)


def render(results: list[dict], timing, elapsed_s: float) -> str:
    lines = bench_knee.render(results, timing, elapsed_s).rstrip("\n").splitlines()
    lines[0] = "# Throughput knee on this CPU, and the roofline measured here"
    lines += ["", ("Errors are predicted / measured step time - 1 (+: predicted slower).")]
    lines += ["", "## (b) Roofline prediction (CPU profile measured here) vs dense measurement", "",
              ("| model | points | median abs error | max abs error | median signed error | "
               "measured knee | predicted knee | grid steps apart | (diagnostic) residual scale "
               "of the other models | median abs error after it |"),
              "|---|---|---|---|---|---|---|---|---|---|"]
    every = []
    for r in results:
        pred = r["prediction"]
        every += [abs(p["error"]) for p in pred["points"]]
        scaled = (f"{pred['loo_scale']:.2f} | {pred['loo_median_abs_error']:.0%}"
                  if "loo_scale" in pred else "- | -")
        signed_model = statistics.median(p["error"] for p in pred["points"])
        lines.append(f"| {r['model']} | {len(pred['points'])} | {pred['median_abs_error']:.0%} | "
                     f"{pred['max_abs_error']:.0%} | {signed_model:+.0%} | {r['dense']['knee']} | "
                     f"{pred['knee']} | {pred['knee_grid_steps']} | {scaled} |")
    signed = statistics.median(p["error"] for r in results for p in r["prediction"]["points"])
    lines += ["", (f"All points: median abs error {statistics.median(every):.0%} over "
                   f"{len(every)} points (median signed error {signed:+.0%})."),
              "", "### CPU profiles (fastest of the profiles measured between the dense rounds)", "",
              ("| model | matmul GFLOP/s (by FLOPs/byte) | conv fwd ; bwd GFLOP/s (stride 1) | "
               "conv fwd ; bwd GFLOP/s (stride 2) | attention fwd ; bwd GFLOP/s | batch norm fwd ; "
               "bwd GB/s | layer norm fwd ; bwd GB/s | elementwise GB/s (by bytes per op) | "
               "latency conv / other us | overhead us/op | page faults ns/B |"),
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        p = r["prediction"]["profile"]
        kinds = p["kinds"]

        def rates(*pair: OpKind, kinds: dict = kinds) -> str:
            key = "bytes_per_s" if pair[0] in MEMORY_KINDS else "flops_per_s"
            return " ; ".join(" / ".join(f"{rate / 1e9:.0f}" for _, rate in kinds[kind.value][key])
                              for kind in pair)

        lines.append(
            f"| {r['model']} | {rates(OpKind.MATMUL)} | "
            f"{rates(OpKind.CONV, OpKind.CONV_BACKWARD)} | "
            f"{rates(OpKind.CONV_STRIDED, OpKind.CONV_BACKWARD_STRIDED)} | "
            f"{rates(OpKind.ATTENTION, OpKind.ATTENTION_BACKWARD)} | "
            f"{rates(OpKind.BATCH_NORM, OpKind.BATCH_NORM_BACKWARD)} | "
            f"{rates(OpKind.LAYER_NORM, OpKind.LAYER_NORM_BACKWARD)} | {rates(OpKind.OTHER)} | "
            f"{kinds['conv']['latency_s'] * 1e6:.0f} / {kinds['other']['latency_s'] * 1e6:.0f} | "
            f"{p['launch_overhead_s'] * 1e6:.1f} | {p['page_fault_s_per_byte'] * 1e9:.2f} |")
    lines += ["", "### Per point", "",
              ("| model | batch | measured ms (IQR) | predicted ms (compute / memory / overhead / "
               "page faults) | error |"), "|---|---|---|---|---|"]
    for r in results:
        for p in r["prediction"]["points"]:
            lines.append(
                f"| {r['model']} | {p['batch_size']} | {p['measured_step_s'] * 1e3:.2f} "
                f"({p['measured_spread']:.0%}) | {p['predicted_step_s'] * 1e3:.2f} "
                f"({p['compute_s'] * 1e3:.2f} / {p['memory_s'] * 1e3:.2f} / "
                f"{p['overhead_s'] * 1e3:.2f} / {p['page_fault_s'] * 1e3:.2f}) | {p['error']:+.0%} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    names, timing, scale = bench_knee.parse_args()
    started = time.perf_counter()
    results = [run_model(n, timing, scale) for n in names]
    elapsed = time.perf_counter() - started
    add_calibrated_errors(results)
    path = bench_knee.write_results(results, timing, elapsed, "bench_knee_roofline", render)
    for r in results:
        pred = r["prediction"]
        print(f"{r['model']:12s} knee dense {r['dense']['knee']:4d} | roofline median err "
              f"{pred['median_abs_error']:.0%} "
              f"({pred.get('loo_median_abs_error', float('nan')):.0%} after scale), "
              f"knee {pred['knee']} ({pred['knee_grid_steps']} steps)")
    print(f"wrote {path} ({elapsed / 60:.1f} min)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
