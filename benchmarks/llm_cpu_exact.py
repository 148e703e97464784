"""Issue 15's CPU exactness check, with its numbers: the predicted CPU peak of LoRA, QLoRA
(bitsandbytes' CPU kernels), LLM.int8 + LoRA and 8-bit optimizers on tiny Llama and Qwen3
configs, against the torch profiler on the same real step (``measure_step``, steady state,
batch 4 x 64 tokens, one thread). The cases are tests/engine/test_workloads.py's CPU_CASES
(the test asserts < 2%).

How it asks batchfit: the engine's ``estimate`` with the tests' TrainConfigs against
``measure_step``: an exactness harness.

Usage: nice python benchmarks/llm_cpu_exact.py
Writes benchmarks/results/llm_cpu_exact.json and .md.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent / "tests" / "engine"))


def main() -> None:
    from test_workloads import CPU_CASES, SPEC

    from batchfit.answers.estimate import estimate
    from batchfit.engine.spec import TrainConfig
    from batchfit.realrun.measure import measure_step

    torch.set_num_threads(1)
    rows = []
    for case, (factory, options) in CPU_CASES.items():
        config = TrainConfig(**options)
        predicted = estimate(factory, SPEC, 4, config, device="cpu").peak_allocated_bytes
        measured = measure_step(factory, SPEC, 4, config, steps=2).peak_bytes
        rows.append({"case": case, "model": factory.__name__, "options": options,
                     "predicted_bytes": predicted, "profiler_bytes": measured,
                     "error_pct": round(100 * (predicted - measured) / measured, 4)})
        print(json.dumps(rows[-1]), flush=True)
    out = HERE / "results" / "llm_cpu_exact.json"
    out.write_text(json.dumps(rows, indent=2) + "\n")
    lines = ["| case | model | predicted bytes | profiler bytes | error |", "|---|---|---|---|---|"]
    lines += [f"| {r['case']} | {r['model']} | {r['predicted_bytes']:,} | "
              f"{r['profiler_bytes']:,} | {r['error_pct']:+.4f}% |" for r in rows]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
