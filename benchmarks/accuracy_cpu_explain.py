"""Where one accuracy_cpu.py case's real step departs from the engine's trace, op by op.

How it asks batchfit: it does not ask as a user: a diagnostic, it traces the step with the
engine (``trace_step``, replayed on the CPU profile) and instruments the real run with the
live-storage tracker's internals, to set the two side by side allocation by allocation.

The step is the one the case's words name (``zoo.Case.step``, resolved as
``batchfit.estimate`` resolves them), so the diagnosis is of the question
``benchmarks/accuracy_cpu.py`` asks. It prints the allocations whose sizes differ between
the fake trace and the real run, and the memory kernels allocate and free inside one op
(seen by the profiler only).

Usage: ``python benchmarks/accuracy_cpu_explain.py lstm``
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
MiB = 2**20


def explain(name: str, top: int = 8) -> None:
    """Print where the real step's memory departs from the trace (see the module docstring).

    Diagnostic only: it leans on private helpers of batchfit.realrun.measure and aligns the
    profiler's clock with time.time_ns(), which is good to a few microseconds.
    """
    import bisect
    import gc
    from collections import Counter

    import torch
    from torch.profiler import ProfilerActivity, profile, record_function
    from zoo import BY_NAME

    from batchfit.device.profile import resolve_device
    from batchfit.engine.trace import trace_step
    from batchfit.engine.tracer import EventKind
    from batchfit.realrun import measure

    case = BY_NAME[name]
    trace = trace_step(case.factory, case.inputs, case.batch_size, case.config,
                       resolve_device("cpu"))
    traced = Counter((e.phase.value, e.op, e.nbytes) for e in trace.steady_events
                     if e.kind is EventKind.ALLOC and e.op and e.phase.value != "setup")
    real: Counter = Counter()
    log: list[tuple[int, int, str, str]] = []  # (time_ns, tracker live bytes, op, phase)
    phase = ["setup"]
    torch.manual_seed(0)
    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        runner = measure._build_runner(case.factory, case.inputs, case.batch_size, case.config)
        runner.on_phase = lambda p: phase.__setitem__(0, p)
        step = runner.train_step if case.config.mode.value == "train" else runner.infer_step
        step()
        gc.collect()
        tracker = measure._StorageTracker()
        for storage in measure._unique_storages(measure._step_storages(runner)).values():
            tracker.add(storage)
        on_output = tracker._on_output

        def logged(func, args, out):
            before = set(tracker._live)
            on_output(func, args, out)
            for key in set(tracker._live) - before:
                real[(phase[0], str(func), tracker._live[key][0])] += 1
            log.append((time.time_ns(), tracker.live_bytes, str(func), phase[0]))

        tracker._interceptor._on_output = logged
        with record_function("steady"), tracker:
            step()
    changes = sorted(measure._memory_events(prof.profiler.kineto_results.events()))
    times = [t for t, _ in changes]
    level, live = [], 0
    for _, nbytes in changes:
        live += nbytes
        level.append(live)
    print(f"{name}: predicted {trace_peak(trace) / MiB:,.2f} MiB, tracker {tracker.peak_bytes / MiB:,.2f}"
          f" MiB, profiler {max(level[bisect.bisect_right(times, log[0][0]):] or [0]) / MiB:,.2f} MiB")
    print("allocations whose size differs, fake trace vs real run (phase, op, bytes) x count:")
    for label, diff in (("  only traced", traced - real), ("  only real  ", real - traced)):
        for key, count in sorted(diff.items(), key=lambda kv: -kv[0][2] * kv[1])[:top]:
            print(f"{label} {key} x{count}")
    scratch: dict[tuple[str, str], int] = {}
    for (t0, live0, _, _), (t1, live1, op, ph) in itertools.pairwise(log):
        i0, i1 = bisect.bisect_right(times, t0), bisect.bisect_right(times, t1)
        if i1 > i0:
            hidden = max(level[i0:i1]) - max(live0, live1)
            scratch[(ph, op)] = max(scratch.get((ph, op), 0), hidden)
    print("memory allocated and freed inside one op (profiler only), largest per op:")
    for (ph, op), hidden in sorted(scratch.items(), key=lambda kv: -kv[1])[:top]:
        if hidden > 0:
            print(f"  {hidden / MiB:9.2f} MiB  {ph:9s} {op}")


def trace_peak(trace) -> int:
    from batchfit.device.profile import resolve_device
    from batchfit.device.timeline import replay_events

    return replay_events(trace.steady_events, resolve_device("cpu"), top=0).peak_allocated_bytes


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(HERE))
    from zoo import BY_NAME

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("case", choices=list(BY_NAME), metavar="CASE",
                        help=f"one of: {', '.join(BY_NAME)}")
    explain(parser.parse_args(argv).case)
    return 0


if __name__ == "__main__":
    sys.exit(main())
