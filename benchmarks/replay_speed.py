"""Speed of the caching-allocator replay, against the trace that produces its events.

How it asks batchfit: the engine's trace and replay directly (a speed harness).

An answer is a trace (fake tensors) then one or more replays of its events through the
model of CUDA's caching allocator (``batchfit.device.allocator``). The replay must stay a
small part of an answer, so each figure is a ratio to its peer in the same run:

1. timm ResNet-50, training with AdamW at batch 64 on an A100 80GB profile: the
   replay of the traced step (``replay_events``, the loop of steady steps an answer
   replays) against the trace itself (``trace_step``); medians of ``--runs``.
2. A synthetic stream of 10,000 events (5,000 blocks of three sizes, small and large
   pool, each kept alive for 50 events; the workload of the former timed unit test) through
   ``replay``: events per second, and the same stream's time against a bare Python loop
   that only walks the events (a floor for any replay written in Python).

Usage: python benchmarks/replay_speed.py [--runs 7]
Writes benchmarks/results/replay_speed.json and prints a summary.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
KiB, MiB = 1 << 10, 1 << 20


def synthetic_events() -> list:
    from batchfit.device.allocator import AllocEvent, FreeEvent

    sizes = [4 * KiB, 3 * MiB, 24 * MiB + 7]
    events: list = []
    for i in range(5000):
        events.append(AllocEvent(i, sizes[i % 3] + i))
        if i >= 50:
            events.append(FreeEvent(i - 50))
    return events


def timed(fn, runs: int) -> list[float]:
    fn()  # warm-up
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def resnet_case(runs: int) -> dict:
    import timm

    from batchfit.device.catalog import find_gpu
    from batchfit.device.profile import gpu_profile
    from batchfit.device.timeline import replay_events
    from batchfit.engine.spec import TrainConfig
    from batchfit.engine.trace import trace_step

    profile = gpu_profile(find_gpu("A100 80GB"))
    config = TrainConfig(optimizer="adamw")
    traced: list = []

    def trace() -> None:
        traced[:] = [trace_step(lambda: timm.create_model("resnet50"), (3, 224, 224), 64,
                                config, profile)]

    trace_s = timed(trace, runs)
    events = traced[0].steady_events
    replay_s = timed(lambda: replay_events(events, profile, top=0), runs)
    return {"events": len(events), "trace_s": trace_s, "replay_s": replay_s,
            "replay_over_trace": statistics.median(replay_s) / statistics.median(trace_s)}


def synthetic_case(runs: int) -> dict:
    from batchfit.device.allocator import replay

    events = synthetic_events()

    def walk() -> None:
        live = {}
        for event in events:
            key = event.key
            if key in live:
                del live[key]
            else:
                live[key] = event

    replay_s = timed(lambda: replay(events), runs)
    walk_s = timed(walk, runs)
    return {"events": len(events), "replay_s": replay_s, "walk_s": walk_s,
            "events_per_s": len(events) / statistics.median(replay_s),
            "replay_over_walk": statistics.median(replay_s) / statistics.median(walk_s)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args(argv)
    load = os.getloadavg()[0]
    result = {"runs": args.runs, "load_before": load,
              "resnet50_b64_a100": resnet_case(args.runs),
              "synthetic_10k": synthetic_case(args.runs),
              "load_after": os.getloadavg()[0]}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "replay_speed.json").write_text(json.dumps(result, indent=2) + "\n")
    resnet, synthetic = result["resnet50_b64_a100"], result["synthetic_10k"]
    print(f"ResNet-50 b64: {resnet['events']} events, replay "
          f"{statistics.median(resnet['replay_s']) * 1e3:.1f} ms, trace "
          f"{statistics.median(resnet['trace_s']):.2f} s: replay/trace "
          f"{resnet['replay_over_trace']:.3f}")
    print(f"synthetic: {synthetic['events']} events, {synthetic['events_per_s']:,.0f} events/s, "
          f"replay/walk {synthetic['replay_over_walk']:.1f}x "
          f"(load {result['load_before']:.1f} -> {result['load_after']:.1f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
