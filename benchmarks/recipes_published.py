"""batchfit with ``--recipe`` against published LLM fine-tuning memory (issue 36, item 5).

How it asks batchfit: the ``batchfit`` command line (``python -m batchfit.cli``) with the
source's words and ``--recipe``.

Each row of ``benchmarks/data/recipes_published.csv`` is run as a user would: the CLI words
of the source's stated settings and the preset of its framework (with ``--quant``, the
bitsandbytes the source states, ``bnb 0.41.1``, as ``--bitsandbytes-version``). The split
was fixed in the CSV before any blind row was scored: ``dev`` rows were used while
developing, ``blind`` rows are scored once (``--set blind``).

Metric: litgpt prints ``torch.cuda.max_memory_allocated()`` over the whole run, so a figure is
compared with batchfit's allocated peak of the steady step (``peak_allocated_bytes``), in GB
(1e9 bytes). ``first_step_peak_bytes`` is not an allocated figure (it is the first step's
allocator capacity plus the CUDA context, like ``total_bytes``), so it is reported beside it
(``first_step_total_gb``) but not compared; in these LoRA rows the first step adds only the
adapters' optimizer state. A fit/OOM row agrees when batchfit's ``fits`` matches the outcome.

Usage: nice python benchmarks/recipes_published.py --set dev|blind
Writes benchmarks/results/recipes_published_<set>.json and .md.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).parent
ROOT = HERE.parent


def command(row: dict[str, str]) -> list[str]:
    words = ["estimate", row["model"], "--recipe", row["recipe"], "--lora", row["lora"],
             "-b", row["batch_size"], "--seq-len", row["seq_len"], "--gpu", row["gpu"], "--json"]
    if row["quant"]:
        words += ["--quant", row["quant"]]
        stated = re.search(r"\bbnb (\d+\.\d+(?:\.\d+)?)", row["source"])
        if stated:  # the bitsandbytes the source states (its 4-bit matmul changed since)
            words += ["--bitsandbytes-version", stated.group(1)]
    if row["precision"]:
        words += ["--precision", row["precision"]]
    return words


def run(row: dict[str, str]) -> dict:
    words = command(row)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run([sys.executable, "-m", "batchfit.cli", *words], capture_output=True,
                          text=True, env=env, cwd=ROOT, check=False)
    result = {"id": row["id"], "command": "batchfit " + " ".join(
        f'"{w}"' if " " in w else w for w in words), "exit_code": done.returncode}
    try:
        data = json.loads(done.stdout)
    except json.JSONDecodeError:
        result["error"] = done.stderr.strip().splitlines()[-1:] or ["no output"]
        return result
    peak = data["peak_allocated_bytes"]
    result.update(predicted_gb=round(peak / 1e9, 2), fits=data["fits"],
                  first_step_total_gb=round((data.get("first_step_peak_bytes") or 0) / 1e9, 2))
    if row["published_gb"]:
        published = float(row["published_gb"])
        result.update(published_gb=published,
                      error=round((peak / 1e9 - published) / published, 4))
        result["within_10"] = abs(result["error"]) <= 0.10
    result["outcome_agrees"] = result["fits"] is (row["published_outcome"] == "fit")
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--set", choices=("dev", "blind"), required=True)
    parser.add_argument("--jobs", type=int, default=2)
    args = parser.parse_args()
    with open(HERE / "data" / "recipes_published.csv", newline="") as handle:
        rows = [r for r in csv.DictReader(handle) if r["set"] == args.set]
    with ThreadPoolExecutor(args.jobs) as pool:
        results = list(pool.map(run, rows))
    figures = [r for r in results if "within_10" in r]
    summary = {"set": args.set, "figures": len(figures),
               "within_10": sum(r["within_10"] for r in figures),
               "outcomes": len(results),
               "outcomes_agree": sum(bool(r.get("outcome_agrees")) for r in results),
               "rows": results}
    out = HERE / "results" / f"recipes_published_{args.set}"
    out.with_suffix(".json").write_text(json.dumps(summary, indent=2) + "\n")
    lines = [f"# recipes_published ({args.set})", "",
             (f"{summary['within_10']} of {summary['figures']} figures within 10%; "
              f"{summary['outcomes_agree']} of {summary['outcomes']} fit/OOM outcomes agree."),
             "", "| id | published GB | batchfit GB (allocated, steady step) | error | fits |",
             "|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['id']} | {r.get('published_gb', 'OOM')} | {r.get('predicted_gb')} "
                     f"| {r.get('error', '')} | {r.get('fits')} |")
    lines += ["", "Commands:", ""] + [f"    {r['command']}" for r in results]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(out.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
