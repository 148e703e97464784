"""Why a plain capped CPU process is not a repeatable device: the peak ``VmData`` of the
same training step, run by strace, in fresh interpreters under different start-up seeds.

How it asks batchfit: it does not: it measures the capped CPU device itself.

``RLIMIT_DATA`` limits ``VmData`` (the kernel's ``data_vm``: private writable mappings and
the brk heap). This rebuilds ``data_vm`` from every ``mmap``/``munmap``/``mprotect``/
``mremap``/``brk`` of the process (``strace -f``), so each run gives its peak over the
capped steps as a number, not a fit/OOM bit. The process is ``max_vs_true_cpu.py``'s
truth child (build, AdamW, warm-up at batch 1, drop its gradients and batch, then the
steps), uncapped, with an ``umask`` call as a marker where the cap would be set and after
each step. A batch fits under a cap ``C`` when its peak above the marker is at most ``C``.

Conditions (each run is a fresh ``python -c``; no ``MALLOC_MMAP_THRESHOLD_``, no
``OMP_NUM_THREADS`` unless the condition says so):

* ``plain``: torch's defaults, what a user's training script is;
* ``seed0+noaslr``, ``seed7+noaslr``: ``PYTHONHASHSEED`` fixed and ASLR off (``setarch -R``);
* ``seed0``: only the hash seed fixed; ``noaslr``: only ASLR off;
* ``1thread``: ``OMP_NUM_THREADS=1``, seeds random;
* ``seed0+noaslr+1thread``: all three fixed.

Run: ``python benchmarks/cpu_peak_spread.py [--model cnn] [--runs 3] [--batch 40]
[--curve 32,36,44,48] [--cap-mib 128]``. Needs ``strace`` and ``setarch``. Writes
``benchmarks/results/cpu_peak_spread.{md,json}``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import max_vs_true_cpu as device

PAGE = 4096
CONDITIONS = {
    "plain": ({}, []),
    "seed0+noaslr": ({"PYTHONHASHSEED": "0"}, ["setarch", "-R"]),
    "seed7+noaslr": ({"PYTHONHASHSEED": "7"}, ["setarch", "-R"]),
    "seed0": ({"PYTHONHASHSEED": "0"}, []),
    "noaslr": ({}, ["setarch", "-R"]),
    "1thread": ({"OMP_NUM_THREADS": "1"}, []),
    "seed0+noaslr+1thread": ({"PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1"}, ["setarch", "-R"]),
}


def child_code() -> str:
    code = device.TRUTH_CHILD.replace("start = time.perf_counter()",
                                      "import os\nos.umask(0o022)\nstart = time.perf_counter()")
    return code.replace("        runner.train_step()\n    fits",
                        "        runner.train_step()\n        os.umask(0o022)\n    fits")


class DataVm:
    """Private writable mappings, as ``[start, end, writable]`` segments, plus the brk heap."""

    def __init__(self) -> None:
        self.segments: list[tuple[int, int, bool]] = []
        self.brk0: int | None = None
        self.brk = 0

    def _cut(self, a: int, b: int, keep_inside) -> None:
        out = []
        for s, e, w in self.segments:
            if e <= a or s >= b:
                out.append((s, e, w))
                continue
            if s < a:
                out.append((s, a, w))
            if e > b:
                out.append((b, e, w))
            inside = keep_inside(max(s, a), min(e, b), w)
            if inside:
                out.append(inside)
        self.segments = sorted(out)

    def map(self, a: int, b: int, writable: bool | None) -> None:
        self._cut(a, b, lambda s, e, w: None)
        if writable is not None:
            self.segments = sorted([*self.segments, (a, b, writable)])

    def protect(self, a: int, b: int, writable: bool) -> None:
        self._cut(a, b, lambda s, e, w: (s, e, writable))

    def total(self) -> int:
        heap = self.brk - self.brk0 if self.brk0 is not None else 0
        return heap + sum(e - s for s, e, w in self.segments if w)


def _pages(text: str) -> int:
    return (int(text, 0) + PAGE - 1) // PAGE * PAGE


def peak_above_marker(trace: str) -> tuple[float, list[float]]:
    """(peak over the steps, value at each marker), in bytes above the first marker."""
    vm, pending, marks, peak = DataVm(), {}, [], None
    for raw in trace.splitlines():
        pid, _, rest = raw.partition(" ")
        rest = rest.strip()
        if rest.endswith("<unfinished ...>"):
            pending[pid] = rest[: -len("<unfinished ...>")].rstrip()
            continue
        resumed = re.match(r"^<\.\.\. \w+ resumed>(.*)", rest)
        if resumed:
            rest = pending.pop(pid, "") + resumed.group(1)
        call = re.match(r"^(\w+)\((.*)\)\s+=\s+(-?\w+)", rest)
        if not call or call.group(3).startswith("-"):
            continue
        name, args, ret = call.group(1), [a.strip() for a in call.group(2).split(",")], call.group(3)
        if name == "umask":
            marks.append(vm.total())
        elif name == "mmap":
            start = int(ret, 16)
            vm.map(start, start + _pages(args[1]),
                   "PROT_WRITE" in args[2] and "MAP_PRIVATE" in args[3])
        elif name == "munmap":
            start = int(args[0], 16)
            vm.map(start, start + _pages(args[1]), None)
        elif name == "mprotect":
            start = int(args[0], 16)
            vm.protect(start, start + _pages(args[1]), "PROT_WRITE" in args[2])
        elif name == "mremap":
            old, new = int(args[0], 16), int(ret, 16)
            writable = any(w for s, e, w in vm.segments if s <= old < e)
            vm.map(old, old + _pages(args[1]), None)
            vm.map(new, new + _pages(args[2]), writable)
        elif name == "brk":
            value = int(ret, 16)
            if vm.brk0 is None:
                vm.brk0 = value
            vm.brk = value
        if marks and len(marks) <= device.STEPS:
            peak = vm.total() if peak is None else max(peak, vm.total())
    base = marks[0]
    return peak - base, [m - base for m in marks]


def run(name: str, batch_size: int, condition: str) -> dict:
    extra_env, prefix = CONDITIONS[condition]
    entry = device.MODELS[name]
    args = {k: entry[k] for k in ("spec", "model_kwargs", "seq_len", "input_shape") if k in entry}
    args.update(batch_size=batch_size, cap=1 << 50, steps=device.STEPS, optimizer=device.OPTIMIZER)
    env = {k: v for k, v in os.environ.items()
           if k not in ("MALLOC_MMAP_THRESHOLD_", "OMP_NUM_THREADS", "PYTHONHASHSEED")}
    env.update(extra_env)
    with tempfile.NamedTemporaryFile("r", suffix=".strace") as log:
        done = subprocess.run(
            [*prefix, "strace", "-f", "-qq", "--seccomp-bpf", "-e", "trace=memory,umask",
             "-o", log.name, sys.executable, "-c", child_code(), json.dumps(args)],
            cwd=device.ROOT, env=env, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(done.stderr[-2000:])
        peak, marks = peak_above_marker(log.read())
    child = json.loads(done.stdout.strip().splitlines()[-1])
    return {"condition": condition, "batch_size": batch_size, "peak_mib": peak / 2**20,
            "after_steps_mib": [m / 2**20 for m in marks[1:]], "fits_uncapped": child["fits"]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="cnn")
    parser.add_argument("--batch", type=int, default=40)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--curve", default="32,36,44,48",
                        help="more batches run plain --runs times each")
    parser.add_argument("--cap-mib", type=float, default=128)
    parser.add_argument("--conditions", default=",".join(CONDITIONS))
    parser.add_argument("--append", action="store_true", help="add to the results' runs")
    args = parser.parse_args()
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    load = os.getloadavg()
    jobs = [(c, args.batch) for c in args.conditions.split(",")]
    jobs += [("plain", int(b)) for b in args.curve.split(",") if b]
    path = device.RESULTS / "cpu_peak_spread.json"
    rows = json.loads(path.read_text()) if args.append and path.exists() else []
    for condition, batch in jobs:
        for _ in range(args.runs):
            rows.append(run(args.model, batch, condition))
            print(f"{condition} B={batch}: peak {rows[-1]['peak_mib']:.2f} MiB", flush=True)
    if args.append and rows:
        started += " (appended to an earlier run)"
    write(rows, args, started, load, os.getloadavg())


def write(rows: list[dict], args, started: str, load0, load1) -> None:
    device.RESULTS.mkdir(parents=True, exist_ok=True)
    (device.RESULTS / "cpu_peak_spread.json").write_text(json.dumps(rows, indent=2) + "\n")
    groups: dict[tuple[str, int], list[float]] = {}
    for r in rows:
        groups.setdefault((r["condition"], r["batch_size"]), []).append(r["peak_mib"])
    lines = ["# Peak VmData of the same capped step in fresh interpreters (strace)", "",
             (f"{args.model}, AdamW, {device.STEPS} steps; peak `data_vm` over the steps above "
              f"the point where the cap is set; fits at {args.cap_mib:g} MiB when peak <= cap. "
              f"{started}, load average {load0[0]:.1f} -> {load1[0]:.1f}."), "",
             "| condition | batch | runs | peaks MiB | range MiB | fits at cap |",
             "|---|---|---|---|---|---|"]
    for (condition, batch), peaks in groups.items():
        fits = sum(p <= args.cap_mib for p in peaks)
        lines.append(f"| {condition} | {batch} | {len(peaks)} | "
                     f"{', '.join(f'{p:.1f}' for p in peaks)} | {max(peaks) - min(peaks):.1f} | "
                     f"{fits}/{len(peaks)} |")
    (device.RESULTS / "cpu_peak_spread.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
