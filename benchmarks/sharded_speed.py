"""Speed and memory of multi-GPU answers (issue 16), each in a fresh process as a user runs it.

How it asks batchfit: ``batchfit estimate``/``batchfit plan`` in fresh processes, as a user
runs them (a speed harness; the peer builds its own FSDP step).

1. One Llama-3-70B FSDP2 rank of 64 GPUs (H100 SXM, seq 8192, micro-batch 1, amp-bf16,
   AdamW, activation checkpointing): ``batchfit estimate ... --world-size 64 --strategy
   fsdp`` wall time and peak RSS. Target: <= 60 s and <= 3 GB.
   Peer, in the same run: torch's own ``FSDPMemTracker`` on the same rank (the same
   Llama-3-70B config, ``fully_shard`` per decoder layer and at the root on the fake process
   group, the same mixed-precision policy, parameters made fake with ``to_empty`` under
   ``FakeTensorMode``, one forward, backward and AdamW step). It answers less (allocated bytes
   only; no allocator, context or NCCL) and is the closest existing tool; the ratio is
   batchfit's time over its time.
2. ``batchfit plan hf:meta-llama/Meta-Llama-3-8B --gpus 8x"H100 SXM" --global-batch 1024
   --seq-len 8192 --strategies ddp,fsdp,fsdp-grad-op,zero3`` (4 layouts) wall time and peak
   RSS. Target: <= 2 minutes. Its peer, in the same round: the same plan with the search
   it had before (a bisection over the divisors, each trace building the model anew:
   ``--peer-plan``, which swaps that search back in); and one 70B rank's trace, as a
   multiple.

Medians of ``--runs`` (default 3) interleaved runs; this machine is shared and noisy: the
one-minute load average before and after each run is recorded with it. The peers run
``--peer-runs`` times (default 1: they take minutes here), in the first rounds.

Usage: python benchmarks/sharded_speed.py [--runs 3] [--peer-runs 1] [--only ROWS]
       [--from-log OUTPUT.txt]
Writes benchmarks/results/sharded_speed.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
BATCHFIT = str(Path(sys.executable).parent / "batchfit")

ESTIMATE_70B = [BATCHFIT, "estimate", "hf:meta-llama/Meta-Llama-3-70B", "--seq-len", "8192",
                "--batch-size", "1", "--gpu", "H100 SXM", "--world-size", "64", "--strategy", "fsdp",
                "--precision", "amp-bf16", "--optimizer", "adamw", "--checkpointing", "--json"]
PLAN_8B = [BATCHFIT, "plan", "hf:meta-llama/Meta-Llama-3-8B", "--gpus", '8x"H100 SXM"',
           "--global-batch", "1024", "--seq-len", "8192", "--precision", "amp-bf16",
           "--optimizer", "adamw", "--strategies", "ddp,fsdp,fsdp-grad-op,zero3", "--json"]


def bisection_plan_cli() -> None:
    """``batchfit plan`` with the micro-batch search it had before (commit 3c61069): a
    bisection over the divisors, one rank-0 trace each, each building the model anew, in
    sequence (no traces in pairs)."""
    import batchfit.speed.plan as plan_module
    from batchfit.cli import main as cli_main

    def bisection(needs, layout, config, per_replica):
        from batchfit.answers.ranks import estimate_ranks

        yield []  # the plan's searches are generators; this one traces here, one at a time

        divisors = [b for b in range(1, per_replica + 1) if per_replica % b == 0]
        sizes: dict[int, int] = {}
        device = needs.device

        def need(batch: int) -> int:
            if batch not in sizes:
                sizes[batch] = estimate_ranks(needs.model, needs.inputs, batch, config,
                                              device=device, parallel=layout,
                                              first_step=False).total_bytes
            return sizes[batch]

        low, high = -1, len(divisors)
        while high - low > 1:
            middle = (low + high) // 2
            if need(divisors[middle]) <= device.total_memory_bytes:
                low = middle
            else:
                high = middle
        if low < 0:
            return None, need(divisors[0])
        return divisors[low], need(divisors[low])

    plan_module._Needs.largest_divisor_that_fits = bisection
    sys.argv = ["batchfit", *PLAN_8B[1:]]
    cli_main()


def run(command: list[str]) -> dict:
    """``command`` under a wrapper that reports its child's wall time and ru_maxrss, and
    the one-minute load average before and after it."""
    import os

    load_before = os.getloadavg()[0]
    wrapper = ("import json, resource, subprocess, sys, time; c = json.loads(sys.argv[1]); "
               "t = time.perf_counter(); p = subprocess.run(c, capture_output=True, text=True); "
               "s = time.perf_counter() - t; "
               "r = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024; "
               "print(json.dumps({'rc': p.returncode, 'seconds': s, 'max_rss_bytes': r, "
               "'stdout': p.stdout, 'stderr': p.stderr[-3000:]}))")
    done = subprocess.run([sys.executable, "-c", wrapper, json.dumps(command)],
                          capture_output=True, text=True, check=True)
    result = json.loads(done.stdout)
    result["load_before"], result["load_after"] = load_before, os.getloadavg()[0]
    if result["rc"] != 0:
        raise RuntimeError(f"{' '.join(command[:3])} exited {result['rc']}: {result['stderr']}")
    return result


def peer_fsdp_memtracker() -> None:
    """Item 1's peer (run in its own process): FSDPMemTracker on the same 70B rank."""
    import resource

    import torch
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from batchfit.models.resolve import resolve_model

    start = time.perf_counter()
    spec = resolve_model("hf:meta-llama/Meta-Llama-3-70B", seq_len=8192)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=64)
    mesh = init_device_mesh("cpu", (64,))
    with torch.device("meta"):
        model = spec.factory()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    with FakeTensorMode(allow_non_fake_inputs=True):
        model.to_empty(device="cpu")
        optimizer = torch.optim.AdamW(model.parameters(), foreach=True)
        tracker = FSDPMemTracker(model, optimizer)
        ids = torch.randint(0, model.config.vocab_size, (1, 8192))
        with tracker:
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        peak = max(tracker.get_tracker_snapshot("peak")[torch.device("cpu")].values())
    print(json.dumps({"seconds_inside": time.perf_counter() - start, "peak_bytes": peak,
                      "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))


def write_results(rows: dict[str, list[dict]], runs: int, complete: bool,
                  stem: str = "sharded_speed") -> str:
    """Medians so far to benchmarks/results/STEM.{json,md} (written after every run: a run
    cut short keeps what it measured)."""
    summary: dict[str, dict] = {}
    for name, results in rows.items():
        ok = [r for r in results if "error" not in r]
        if not ok:
            summary[name] = {"error": results[0]["error"]} if results else {"runs": []}
            continue
        summary[name] = {"median_seconds": statistics.median(r["seconds"] for r in ok),
                         "median_max_rss_gb": statistics.median(r["max_rss_bytes"] for r in ok) / 1e9,
                         "runs": [{"seconds": r["seconds"], "max_rss_gb": r["max_rss_bytes"] / 1e9,
                                   "load_before": r.get("load_before"),
                                   "load_after": r.get("load_after")} for r in ok]}
    est, peer, plan, old = (summary.setdefault(k, {"runs": []}) for k in
                            ("estimate_70b", "peer_fsdp_memtracker", "plan_8b",
                             "peer_plan_bisection"))
    if "median_seconds" in est:
        est["meets_60s_3gb"] = est["median_seconds"] <= 60 and est["median_max_rss_gb"] <= 3
        if "median_seconds" in peer:
            # the peer's own round: batchfit's run of the same round over the peer's
            est["ratio_to_peer_same_round"] = (est["runs"][0]["seconds"]
                                               / peer["runs"][0]["seconds"])
    if "median_seconds" in plan:
        plan["meets_2min"] = plan["median_seconds"] <= 120
        if "median_seconds" in est:
            plan["ratio_to_one_70b_rank_same_round"] = (plan["runs"][0]["seconds"]
                                                        / est["runs"][0]["seconds"])
        if "median_seconds" in old:
            plan["ratio_to_bisection_same_round"] = (plan["runs"][0]["seconds"]
                                                     / old["runs"][0]["seconds"])
    out = {"commands": {"estimate_70b": ESTIMATE_70B[1:], "plan_8b": PLAN_8B[1:],
                        "peer": "python benchmarks/sharded_speed.py --peer",
                        "peer_plan": "python benchmarks/sharded_speed.py --peer-plan"},
           "runs_planned": runs, "complete": complete, "summary": summary}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{stem}.json").write_text(json.dumps(out, indent=2) + "\n")
    lines = [("| what | runs (s) [load average before-after] | median s | median peak RSS GB | "
              "target | met | ratio to its peer (same round) |"),
             "|---|---|---|---|---|---|---|"]
    for name, target, key, ratio in (
            ("estimate_70b", "<= 60 s, <= 3 GB", "meets_60s_3gb", "ratio_to_peer_same_round"),
            ("peer_fsdp_memtracker", "-", None, None),
            ("plan_8b", "<= 120 s", "meets_2min", "ratio_to_bisection_same_round"),
            ("peer_plan_bisection", "-", None, None)):
        row = summary[name]
        if "median_seconds" not in row:
            lines.append(f"| {name} | {row.get('error', 'not run')[:80]} | | | {target} | | |")
            continue
        times = ", ".join(f"{r['seconds']:.0f}" + (
            f" [{r['load_before']:.1f}-{r['load_after']:.1f}]" if r.get("load_before") is not None
            else "") for r in row["runs"])
        met = row.get(key, "") if key else ""
        lines.append(f"| {name} | {times} | {row['median_seconds']:.1f} | "
                     f"{row['median_max_rss_gb']:.2f} | {target} | {met} | "
                     f"{row[ratio]:.2f} |" if ratio and ratio in row else
                     f"| {name} | {times} | {row['median_seconds']:.1f} | "
                     f"{row['median_max_rss_gb']:.2f} | {target} | {met} | |")
    if not complete:
        lines.append("\nIncomplete: the run stopped before all rounds finished.")
    text = "\n".join(lines) + "\n"
    (RESULTS / f"{stem}.md").write_text(text)
    return text


def from_log(path: str) -> dict[str, list[dict]]:
    """The runs a cut-short benchmark printed ("run K NAME: S s, R GB")."""
    import re

    rows: dict[str, list[dict]] = {"estimate_70b": [], "peer_fsdp_memtracker": [], "plan_8b": [],
                                   "peer_plan_bisection": []}
    for line in Path(path).read_text().splitlines():
        found = re.match(r"run \d+ (\w+): ([\d.]+) s, ([\d.]+) GB(?:, load ([\d.]+)-([\d.]+))?",
                         line)
        if found:
            rows[found[1]].append({"seconds": float(found[2]),
                                   "max_rss_bytes": float(found[3]) * 1e9,
                                   "load_before": float(found[4]) if found[4] else None,
                                   "load_after": float(found[5]) if found[5] else None})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--peer-runs", type=int, default=1,
                        help="runs of the peer (FSDPMemTracker takes minutes per run here)")
    parser.add_argument("--from-log", help="rebuild the results from a cut-short run's output")
    parser.add_argument("--only", help="comma-separated rows to run (estimate_70b, "
                        "peer_fsdp_memtracker, plan_8b, peer_plan_bisection); the results "
                        "go to sharded_speed_ROWS.{json,md}")
    parser.add_argument("--peer", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--peer-plan", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.peer:
        peer_fsdp_memtracker()
        return
    if args.peer_plan:
        bisection_plan_cli()
        return
    if args.from_log:
        print(write_results(from_log(args.from_log), args.runs, complete=False))
        return
    stem = "sharded_speed" + ("_" + args.only.replace(",", "_") if args.only else "")
    peer_command = [sys.executable, __file__, "--peer"]
    plan_peer = [sys.executable, __file__, "--peer-plan"]
    rows: dict[str, list[dict]] = {"estimate_70b": [], "peer_fsdp_memtracker": [], "plan_8b": [],
                                   "peer_plan_bisection": []}
    for index in range(args.runs):
        for name, command in (("estimate_70b", ESTIMATE_70B),
                              ("peer_fsdp_memtracker", peer_command), ("plan_8b", PLAN_8B),
                              ("peer_plan_bisection", plan_peer)):
            if name.startswith("peer") and index >= args.peer_runs:
                continue
            if args.only and name not in args.only.split(","):
                continue
            try:
                result = run(command)
            except RuntimeError as exc:
                result = {"error": str(exc)[-1500:]}
            print(f"run {index + 1} {name}: {result.get('seconds', float('nan')):.1f} s, "
                  f"{result.get('max_rss_bytes', 0) / 1e9:.2f} GB, load "
                  f"{result.get('load_before', 0):.2f}-{result.get('load_after', 0):.2f}",
                  flush=True)
            rows[name].append(result)
            write_results(rows, args.runs, complete=False, stem=stem)
    print(write_results(rows, args.runs, complete=True, stem=stem))


if __name__ == "__main__":
    main()
