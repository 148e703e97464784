"""batchfit with ``--recipe`` against published LLM fine-tuning memory (issue 36, item 5).

How it asks batchfit: the CLI, ``batchfit estimate <model> --recipe <framework> --lora ...
-b B --seq-len S --gpu <card> --json``, in the words of each source's stated settings and
the preset of its framework; a row's ``flags`` column adds what the source states beyond the
preset (``--loss standard --transformers-version 4.40`` for torchtune's 2024 float32 logits,
``--packing --attn flash`` for an axolotl config, ``--memory 48GB`` for a card size).

Each row of ``benchmarks/data/recipes_published.csv`` names its source (repository, path,
commit or URL). The split was fixed in the CSV before any row of it was scored: ``dev`` rows
may be looked into, ``blind`` rows are scored once (``--set blind``). A row whose run needs
something no option says (torch.compile, Unsloth's offloaded checkpointing) is kept with
``expressible`` = ``no: <why>``, listed and counted as not expressible, and not run.

Metrics (the ``metric`` column names what the source printed):

* ``max_memory_allocated`` (litgpt's "Memory used", over the whole run): batchfit's allocated
  peak of the steady step (``first_step_peak_bytes`` is a total, allocator capacity plus the
  CUDA context, like ``total_bytes``: it is kept in the results, not compared);
* ``max_memory_reserved`` (torchtune's "peak memory reserved"): the steady step's reserved
  peak;
* ``vram`` (a figure that names no metric): the total on the card, reserved plus what lies
  outside the allocator.

Figures are GB (1e9 bytes). A fit/OOM outcome agrees when batchfit's ``fits`` matches it.

Usage: nice python benchmarks/recipes_published.py --set dev|blind
Writes benchmarks/results/recipes_published_<set>.json and .md.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shlex
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).parent
ROOT = HERE.parent
CSV = HERE / "data" / "recipes_published.csv"

#: What each published metric is compared with, from ``batchfit estimate --json``.
METRICS: dict[str, Callable[[dict], int]] = {
    "max_memory_allocated": lambda data: data["peak_allocated_bytes"],
    "max_memory_reserved": lambda data: data["peak_reserved_bytes"],
    "vram": lambda data: data["total_bytes"],
}


def read_rows(which: str, path: Path = CSV) -> list[dict[str, str]]:
    """The CSV's rows of set ``which`` (dev or blind)."""
    with open(path, newline="") as handle:
        return [row for row in csv.DictReader(handle) if row["set"] == which]


def expressible(row: dict[str, str]) -> bool:
    """Whether the CLI can say the source's settings (column ``expressible`` is ``yes``)."""
    return row.get("expressible", "yes").strip() in ("", "yes")


def command(row: dict[str, str]) -> list[str]:
    """The ``batchfit`` words of a row: its settings, then its extra ``flags``."""
    words = ["estimate", row["model"], "--recipe", row["recipe"], "--lora", row["lora"],
             "-b", row["batch_size"], "--seq-len", row["seq_len"], "--gpu", row["gpu"], "--json"]
    if row["quant"]:
        words += ["--quant", row["quant"]]
    if row["precision"]:
        words += ["--precision", row["precision"]]
    return words + shlex.split(row.get("flags") or "")


def score(row: dict[str, str], data: dict) -> dict:
    """Compare one ``--json`` answer with the row's published figure and outcome."""
    result: dict = {"fits": data["fits"], "outcome_agrees":
                    data["fits"] is (row["published_outcome"] == "fit"),
                    "answer_bytes": {key: data.get(key) for key in (
                        "peak_allocated_bytes", "peak_reserved_bytes", "total_bytes",
                        "first_step_peak_bytes")}}
    predicted = METRICS[row["metric"]](data) / 1e9
    result["predicted_gb"] = round(predicted, 2)
    if row["published_gb"]:
        published = float(row["published_gb"])
        error = round((predicted - published) / published, 4)
        result.update(published_gb=published, error=error, within_10=abs(error) <= 0.10)
    return result


def run(row: dict[str, str]) -> dict:
    """Run one row through the CLI in a fresh process (or list it as not expressible)."""
    words = command(row)
    result = {"id": row["id"], "metric": row["metric"],
              "published": row["published_gb"] or row["published_outcome"].upper(),
              "command": "batchfit " + " ".join(f'"{w}"' if " " in w else w for w in words)}
    if not expressible(row):
        result["not_expressible"] = row["expressible"].removeprefix("no:").strip()
        return result
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run([sys.executable, "-m", "batchfit.cli", *words], capture_output=True,
                          text=True, env=env, cwd=ROOT, check=False)
    result["exit_code"] = done.returncode
    try:
        data = json.loads(done.stdout)
    except json.JSONDecodeError:
        result["failure"] = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return result
    return {**result, **score(row, data)}


def summarize(which: str, results: list[dict]) -> dict:
    """Totals over a set: figures within 10%, outcomes that agree, rows not expressible."""
    figures = [r for r in results if "within_10" in r]
    scored = [r for r in results if "not_expressible" not in r]
    return {"set": which, "figures": len(figures),
            "within_10": sum(r["within_10"] for r in figures),
            "outcomes": len(scored),
            "outcomes_agree": sum(bool(r.get("outcome_agrees")) for r in scored),
            "not_expressible": len(results) - len(scored), "rows": results}


def markdown(summary: dict) -> str:
    """The set's table, totals first, then the not-expressible rows and the commands."""
    lines = [f"# recipes_published ({summary['set']})", "",
             (f"{summary['within_10']} of {summary['figures']} figures within 10%; "
              f"{summary['outcomes_agree']} of {summary['outcomes']} fit/OOM outcomes agree; "
              f"{summary['not_expressible']} rows not expressible (not run)."),
             "", "| id | metric | published GB | batchfit GB | error % | fits |",
             "|---|---|---|---|---|---|"]
    for r in summary["rows"]:
        if "not_expressible" in r:
            continue
        error = f"{100 * r['error']:+.1f}" if "error" in r else ""
        predicted = r.get("predicted_gb", f"failed: {r.get('failure')}")
        lines.append(f"| {r['id']} | {r['metric']} | {r['published']} "
                     f"| {predicted} | {error} | {r.get('fits')} |")
    skipped = [r for r in summary["rows"] if "not_expressible" in r]
    if skipped:
        lines += ["", "Not expressible:", ""]
        lines += [f"- {r['id']}: {r['not_expressible']}" for r in skipped]
    lines += ["", "Commands:", ""] + [f"    {r['command']}" for r in summary["rows"]]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--set", choices=("dev", "blind"), required=True)
    parser.add_argument("--jobs", type=int, default=1)
    args = parser.parse_args()
    rows = read_rows(args.set)
    with ThreadPoolExecutor(args.jobs) as pool:
        results = []
        for result in pool.map(run, rows):
            results.append(result)
            answer = result.get("predicted_gb", result.get("not_expressible"))
            print(f"[{len(results)}/{len(rows)}] {result['id']}: "
                  f"{answer or result.get('failure')}", file=sys.stderr, flush=True)
    summary = summarize(args.set, results)
    out = HERE / "results" / f"recipes_published_{args.set}"
    out.with_suffix(".json").write_text(json.dumps(summary, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(summary))
    print(out.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
