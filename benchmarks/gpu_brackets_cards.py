"""Do two cards with the same software stack agree? timm's public benchmark files, compared.

How it asks batchfit: it does not predict: it reads the catalog's CUDA totals (``find_gpu``)
beside timm's published files.

Every answer of ``batchfit max --gpu`` depends on the card only through what the engine
knows of it (CUDA's total memory, compute capability, SM count). Where two cards run the
same torch and CUDA and CUDA gives them almost the same memory, an answer can differ
between them only through a card-dependent mechanism. This script measures how often the
real brackets differ in that situation, from the files the dev set was sampled from
(timm's ``results/benchmark-{mode}-{precision}-{layout}-pt{torch}-cu{cuda}-{gpu}.csv``,
public in huggingface/pytorch-image-models; the dev set holds 40 rows of six of them).

For two files of the same mode, precision, layout, torch and CUDA, each model and image
size in both is counted once:

* ``first runs more``: the first card ran a batch that failed on the second, which ran
  less (the second's value is below its start batch, so the next step of timm's decay
  sequence failed there);
* ``second runs more``: the other way round;
* ``equal``: both ran the same batch, below both files' start batches.

A file's start batch is its largest value (``benchmark.py`` starts every model there and
only ever decays), and a value at the start has no upper bound, so it never counts as the
smaller one. Compiled (``-dynamo``) and CPU files are left out.

Each pair shows the memory CUDA gives each card (batchfit's catalog, ``cuda_total_mib``).
``--dev-results`` adds, for each dev row of a pair whose cards' memories are within 1%
of each other, the batch the other card ran where that contradicts the row's bracket (by
the same rule), and where the engine's answer (the same for both cards up to that 1%)
lies against the bracket.

    cd benchmarks && python gpu_brackets_cards.py --timm-results PATH/pytorch-image-models/results \\
        --dev-results results/gpu_brackets/s14_I120.jsonl results/gpu_brackets/s14_other.jsonl
"""

from __future__ import annotations

import argparse
import csv
import itertools
import re
import sys
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_brackets import load_cache, outcome

RESULTS = Path(__file__).resolve().parent / "results" / "gpu_brackets"
_NAME = re.compile(r"benchmark-(?P<mode>infer|train)-(?P<precision>[a-z0-9_]+)-(?P<layout>nchw|nhwc)"
                   r"-pt(?P<torch>\d+)-cu(?P<cuda>\d+)-(?P<gpu>[a-z0-9_]+)\.csv")
FIRST, SECOND, EQUAL = "first runs more", "second runs more", "equal"
#: Two cards whose CUDA memories differ by at most this ratio count as equal in memory.
SAME_MEMORY_RATIO = 1.01


@dataclass(frozen=True)
class BenchmarkFile:
    """One of timm's benchmark result files: its stack, card and batches."""

    path: Path
    mode: str
    precision: str
    layout: str
    torch: str
    cuda: str
    gpu: str

    @property
    def memory_mib(self) -> int | None:
        """What CUDA gives the card, from batchfit's catalog (None for a card it lacks)."""
        from batchfit.device.catalog import find_gpu
        from batchfit.errors import InvalidInputError

        try:
            return find_gpu(self.gpu).usable_memory_bytes >> 20
        except InvalidInputError:
            return None

    @property
    def stack(self) -> tuple[str, str, str, str, str]:
        return (self.mode, self.precision, self.layout, self.torch, self.cuda)

    def batches(self) -> dict[tuple[str, str], int]:
        """``{(model, image size): batch that ran}`` for the file's rows."""
        with self.path.open(newline="") as handle:
            rows = list(csv.DictReader(handle))
        return {(row["model"], row[f"{self.mode}_img_size"]): int(row[f"{self.mode}_batch_size"])
                for row in rows}


def parse_file_name(path: Path) -> BenchmarkFile | None:
    """The file's stack and card from its name; None for compiled, CPU or other files."""
    match = _NAME.fullmatch(path.name)
    if match is None:
        return None
    return BenchmarkFile(path=path, **match.groupdict())


def compare(first: dict[tuple[str, str], int], second: dict[tuple[str, str], int]) -> Counter:
    """Count the models both files measured by which card ran more (see the module text)."""
    start_first, start_second = max(first.values()), max(second.values())
    counts: Counter = Counter()
    for key in first.keys() & second.keys():
        a, b = first[key], second[key]
        if a > b and b < start_second:
            counts[FIRST] += 1
        elif b > a and a < start_first:
            counts[SECOND] += 1
        elif a == b and a < min(start_first, start_second):
            counts[EQUAL] += 1
    return counts


def same_stack_pairs(files: Iterable[BenchmarkFile]) -> list[tuple[BenchmarkFile, BenchmarkFile]]:
    """Every pair of files with the same mode, precision, layout, torch and CUDA."""
    by_stack: dict[tuple, list[BenchmarkFile]] = {}
    for item in files:
        by_stack.setdefault(item.stack, []).append(item)
    return [pair for group in by_stack.values()
            for pair in itertools.combinations(sorted(group, key=lambda f: f.gpu), 2)]


def _mib(item: BenchmarkFile) -> str:
    memory = item.memory_mib
    return "not in the catalog" if memory is None else f"{memory:,}"


def _disagrees(ran: int, start: int, low: int, high: int) -> bool:
    """Whether the other card's batch ``ran`` (its file starting at ``start``) contradicts
    the bracket ``[low, high)``: it ran ``high`` or more, or failed ``low`` (it ran less,
    below its start)."""
    return ran >= high or (ran < low and ran < start)


def _dev_lines(pairs: list[tuple[BenchmarkFile, BenchmarkFile]],
               batches: dict[Path, dict[tuple[str, str], int]], dev_results: Sequence[Path]
               ) -> list[str]:
    """The dev rows of equal-memory pairs whose other card contradicts their bracket."""
    title = "Dev rows whose other card (same stack, memory within 1%) contradicts their bracket:"
    lines = [title, "", "| model | size | card | bracket | other card ran | answer | side |",
             "|---|---|---|---|---|---|---|"]
    partner = {}
    for pair in pairs:
        memories = [f.memory_mib for f in pair]
        if None in memories:
            continue
        low, high = sorted(memories)
        if high <= SAME_MEMORY_RATIO * low:
            for this, other in (pair, pair[::-1]):
                theirs = batches[other.path]
                partner[this.path.name] = (other.gpu, theirs, max(theirs.values()))
    rows = [row for path in dev_results for row in load_cache(path).values()]
    for row in sorted(rows, key=lambda r: (r["model"], r["gpu"])):
        if row.get("source_file") not in partner:
            continue
        gpu, theirs, start = partner[row["source_file"]]
        ran = theirs.get((row["model"], str(row["img_size"])))
        low, high = row["batch_fit"], row["batch_failed"]
        if ran is not None and _disagrees(ran, start, low, high):
            lines.append(f"| {row['model']} | {row['img_size']} | {row['gpu']} | [{low}, {high}) "
                         f"| {ran} ({gpu}) | {row.get('predicted')} | {outcome(row)} |")
    return lines


def report(files: list[BenchmarkFile], dev_results: Sequence[Path] = ()) -> str:
    """The markdown report: one line per same-stack pair, then the dev rows in them."""
    pairs = same_stack_pairs(files)
    batches = {f.path: f.batches() for pair in pairs for f in pair}  # each paired file, once
    lines = [("| stack | first card (MiB) | second card (MiB) | first runs more | "
              "second runs more | equal |"), "|---|---|---|---|---|---|"]
    for first, second in pairs:
        counts = compare(batches[first.path], batches[second.path])
        stack = f"{first.mode} {first.precision} {first.layout} torch {first.torch} cu{first.cuda}"
        lines.append(f"| {stack} | {first.gpu} ({_mib(first)}) | {second.gpu} ({_mib(second)}) "
                     f"| {counts[FIRST]} | {counts[SECOND]} | {counts[EQUAL]} |")
    if dev_results:
        lines += [""] + _dev_lines(pairs, batches, dev_results)
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timm-results", type=Path, required=True,
                        help="the results/ folder of a pytorch-image-models checkout")
    parser.add_argument("--dev-results", type=Path, nargs="*", default=(),
                        help="gpu_brackets.py results (.jsonl) to place against the pairs")
    parser.add_argument("--out", type=Path, default=RESULTS / "cards.md")
    args = parser.parse_args(argv)
    if not args.timm_results.is_dir():
        print(f"error: {args.timm_results} is not a folder; give the results/ folder of a "
              "pytorch-image-models checkout", file=sys.stderr)
        return 2
    files = [f for f in map(parse_file_name, sorted(args.timm_results.glob("*.csv"))) if f]
    text = report(files, args.dev_results)
    args.out.write_text(text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
