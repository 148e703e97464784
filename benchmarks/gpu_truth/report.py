"""Scoring a committed run, and the side-by-side of the CUDA paths.

Scorer (issue 39's check): on the exact rows of a ``boundaries.csv`` (``failed_at ==
boundary + 1``, with a prediction), an answer is *in* when ``0.95 x boundary <=
predicted <= boundary``, *above* when ``predicted >= failed_at`` (the user crashes), and
*below* otherwise (too cautious by more than 5%). One table row per run folder: device,
stack, rows, in / above / below.

Usage:
    python3 -m benchmarks.gpu_truth.report benchmarks/results/gpu/*/boundaries.csv
"""

from __future__ import annotations

import csv
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

IN_FRACTION = 0.95


def outcome(boundary: int, failed_at: int, predicted: int) -> str:
    """``in``, ``above`` or ``below`` for one exact row (see the module docstring)."""
    if predicted >= failed_at:
        return "above"
    if IN_FRACTION * boundary <= predicted <= boundary:
        return "in"
    return "below"


def _int(text: Any) -> int | None:
    try:
        return int(text)
    except (TypeError, ValueError):
        return None


@dataclass(frozen=True)
class RunScore:
    """One run's exact rows, counted by outcome."""

    device: str
    stack: str
    rows: int
    in_rows: int
    above_rows: int
    below_rows: int

    def percent(self, count: int) -> float:
        return 100.0 * count / self.rows if self.rows else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"device": self.device, "stack": self.stack, "rows": self.rows,
                "in_rows": self.in_rows, "above_rows": self.above_rows,
                "below_rows": self.below_rows}


def score_csv(path: Path) -> RunScore:
    with path.open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    counts = {"in": 0, "above": 0, "below": 0}
    for row in rows:
        boundary, failed_at, predicted = (_int(row.get(k)) for k in
                                          ("boundary", "failed_at", "predicted"))
        if boundary is None or failed_at is None or predicted is None:
            continue
        if failed_at != boundary + 1 or boundary < 1:
            continue
        counts[outcome(boundary, failed_at, predicted)] += 1
    device = next((r["device_name"] for r in rows if r.get("device_name")), "?")
    stack = next((f"torch {r['torch_version']}" for r in rows if r.get("torch_version")), "?")
    return RunScore(device, stack, sum(counts.values()), counts["in"], counts["above"],
                    counts["below"])


def markdown(scores: list[RunScore]) -> str:
    lines = ["| device | stack | exact rows | in | above | below |",
             "| --- | --- | ---: | ---: | ---: | ---: |"]
    for s in scores:
        lines.append(f"| {s.device} | {s.stack} | {s.rows} | {s.in_rows} "
                     f"({s.percent(s.in_rows):.0f}%) | {s.above_rows} "
                     f"({s.percent(s.above_rows):.0f}%) | {s.below_rows} "
                     f"({s.percent(s.below_rows):.0f}%) |")
    return "\n".join(lines) + "\n"


def compare_paths(paths: dict[str, dict[str, Any]], rows: list[dict[str, Any]]
                  ) -> dict[str, Any]:
    """``search`` and Lightning's binsearch against the kit's boundary of the same row;
    ``bench``'s measured throughput against its prediction, per batch size."""
    boundaries = {r["key"]: r for r in rows}
    searches = []
    for name, path in paths.items():
        if not name.startswith("search:"):
            continue
        model = name.partition(":")[2]
        peer = paths.get(f"lightning:{model}", {})
        ours, theirs = path.get("answer") or {}, peer.get("answer") or {}
        kit = boundaries.get(path.get("row"), {})
        searches.append({
            "row": path.get("row"), "kit_boundary": kit.get("boundary"),
            "kit_failed_at": kit.get("failed_at"),
            "search": {"answer": ours.get("max_batch_size"),
                       "trials": len(ours.get("trials", [])), "seconds": path.get("seconds")},
            "lightning_binsearch": {"answer": theirs.get("answer"),
                                    "trials": len(theirs.get("trials", [])),
                                    "wall_s": theirs.get("wall_s"),
                                    "seconds": peer.get("seconds")}})
    return {"search_vs_lightning": searches, "bench_error": bench_error(paths)}


def bench_error(paths: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """measured / predicted samples per second - 1, per batch size both have."""
    def points(name: str) -> dict[int, float]:
        answer = (paths.get(name) or {}).get("answer") or {}
        return {p["batch_size"]: p["samples_per_s"] for p in answer.get("points", [])
                if p.get("samples_per_s")}

    measured, predicted = points("bench:measured"), points("bench:predicted")
    return [{"batch_size": b, "measured_samples_per_s": measured[b],
             "predicted_samples_per_s": predicted[b],
             "error": round(measured[b] / predicted[b] - 1, 4)}
            for b in sorted(set(measured) & set(predicted))]


def main(argv: list[str] | None = None) -> int:
    paths = [Path(p) for p in (sys.argv[1:] if argv is None else argv)]
    if not paths:
        print("usage: python3 -m benchmarks.gpu_truth.report RUN/boundaries.csv ...",
              file=sys.stderr)
        return 2
    scores = [score_csv(p) for p in paths]
    sys.stdout.write(markdown(scores))
    sys.stdout.write(json.dumps([s.to_dict() for s in scores]) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
