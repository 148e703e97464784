"""Each rank's predicted peak against real sharded runs on this CPU, 2 and 4 processes.

How it asks batchfit: ``trace_rank`` with a tensors-only CPU ``DeviceProfile`` and tiny
DDP/DeepSpeed buckets no option sets: an exactness harness of the sharded trace.

For every (world size, strategy, model): ``world`` real processes talk over gloo
(:func:`batchfit.realrun.sharded.measure_sharded_steps`: the real model, sharded by
torch's DDP / FSDP2 / DTensor tensor parallel or DeepSpeed's engine, measured by a
live-storage tracker from before the model is built, 3 steps, steady peak = the larger of
steps 2 and 3), twice; then every rank is traced on torch's fake process group in this process
(:func:`batchfit.sharding.rank.trace_rank`, counting tensors as the tracker does). The
error is (predicted - measured) / measured per rank, against the smaller of the two
real runs; the issue's target is 2% on every rank.

Why two runs: gloo runs each collective on a worker thread, which drops its reference
to the collective's buffer a moment after the Python side is told the collective is
done. With 4 processes on this machine's 2 cores that moment can come after the step's
peak, and the buffer (an FSDP unit's all-gather output, 50-130 KB here) then counts in
it: seen in 2 of 84 rank runs of one full benchmark, never twice for the same job. The
smaller of two runs is what the step's own tensors need; both runs are in the results.

Models (tests/sharded_models.py): a small transformer (embedding of 97 tokens, 3 MLP
blocks with LayerNorm, head), a CNN with BatchNorm (3 conv stages), and a 2-layer
Hugging Face Llama for tensor parallel. DeepSpeed buckets are 10^5 elements (its default
5 x 10^8 would allocate 2 GB per rank on this machine).

Usage: python benchmarks/sharded_vs_gloo.py [--worlds 2,4]
Writes benchmarks/results/sharded_vs_gloo.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

RESULTS = Path(__file__).parent / "results"
BUCKETS = {"reduce_bucket_size": 100_000, "allgather_bucket_size": 100_000}


def jobs_for(world: int) -> list:
    import sharded_models as sm
    from batchfit.engine.spec import TrainConfig
    from batchfit.realrun.sharded import ShardedJob
    from batchfit.sharding.layout import Parallelism

    config = TrainConfig(optimizer="adamw")
    jobs = []
    models = [(sm.TinyTransformer, sm.transformer_inputs(), 8), (sm.TinyCNN, sm.CNN_INPUTS, 8)]
    for factory, inputs, batch in models:
        for strategy in ("ddp", "fsdp", "fsdp-grad-op", "fsdp1", "zero1", "zero2", "zero3"):
            layout = Parallelism(world_size=world, strategy=strategy, bucket_cap_mb=0.05,
                                 deepspeed=BUCKETS if strategy.startswith("zero") else {})
            jobs.append(ShardedJob(factory, inputs, batch, config, layout))
    if world >= 2:
        jobs.append(ShardedJob(sm.tiny_llama, sm.llama_inputs(), 4, config,
                               Parallelism(world_size=world, strategy="tp", tp=2)))
        jobs.append(ShardedJob(sm.tiny_llama, sm.llama_inputs(), 4, config,
                               Parallelism(world_size=world, strategy="fsdp")))
    return jobs


def main() -> None:
    from batchfit.device.profile import DeviceProfile
    from batchfit.device.timeline import replay_events
    from batchfit.realrun.sharded import measure_sharded_steps
    from batchfit.sharding.rank import trace_rank

    parser = argparse.ArgumentParser()
    parser.add_argument("--worlds", default="2,4")
    args = parser.parse_args()
    tensors_only = DeviceProfile.cpu(kernel_scratch=False)
    rows = []
    for world in (int(w) for w in args.worlds.split(",")):
        jobs = jobs_for(world)
        start = time.perf_counter()
        runs = [measure_sharded_steps(jobs, steps=3) for _ in range(2)]
        print(f"world {world}: {len(jobs)} real runs twice in {time.perf_counter() - start:.0f} s")
        for index, job in enumerate(jobs):
            for rank in range(world):
                both = [run[index][rank].peak_bytes for run in runs]
                real = min(both)
                trace = trace_rank(job.model_factory, job.inputs, job.batch_size, job.config,
                                   tensors_only, job.layout, rank)
                predicted = replay_events(trace.steady_events, tensors_only).peak_allocated_bytes
                error = (predicted - real) / real
                rows.append({"world_size": world, "strategy": job.layout.strategy.value,
                             "tp": job.layout.tp, "model": job.model_factory.__name__,
                             "rank": rank, "measured_bytes": real, "runs_bytes": both,
                             "predicted_bytes": predicted, "error": error})
                print(f"  {job.model_factory.__name__:16s} {job.layout.strategy.value:13s} "
                      f"rank {rank}: measured {both} predicted {predicted:>10,} ({error:+.3%})")
    worst = max(abs(r["error"]) for r in rows)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "sharded_vs_gloo.json").write_text(json.dumps(
        {"rows": rows, "worst_abs_error": worst, "target": 0.02}, indent=2) + "\n")
    lines = ["| world | strategy | model | rank | measured (2 runs) | predicted | error |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['world_size']} | {r['strategy']}{' tp' + str(r['tp']) if r['tp'] > 1 else ''}"
              f" | {r['model']} | {r['rank']} | {' / '.join(f'{b:,}' for b in r['runs_bytes'])} | "
              f"{r['predicted_bytes']:,} | {r['error']:+.3%} |" for r in rows]
    lines.append(f"\nWorst |error| over {len(rows)} ranks: {worst:.3%} (target 2%).")
    (RESULTS / "sharded_vs_gloo.md").write_text("\n".join(lines) + "\n")
    print(f"worst |error| {worst:.3%} over {len(rows)} ranks")


if __name__ == "__main__":
    main()
