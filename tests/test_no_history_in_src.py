"""Docstrings and comments say what the code does and why, not how a run went.

Measured timings, run tags of past benchmark runs, "on this machine" and references to
files outside the repository belong in `benchmarks/results/` and the docs' accuracy
pages; this test finds them in `src/`.
"""

from __future__ import annotations

import re
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src" / "batchfit"

PATTERNS = {
    "a file outside the repository": re.compile(r"DESIGN\.md"),
    "a benchmark run's tag": re.compile(r"\bs\d{1,2}_(?:[TI]\d*|other|nonmemory|after|before)(?:\b|_)"),
    "a measurement on the machine it ran on": re.compile(
        r"on this machine|measured here|measured on this CPU|\b\d-core\b"),
    "a measured timing": re.compile(
        r"\btook \d|\d ?(?:s|ms)\b[^\n.]{0,20}\bhere\b|instead of \d+(?:\.\d+)? ?(?:s|ms)\b"
        r"|medians? of \d+\)"),
}

# Files other engineers edit in this round; their remaining hits are scrubbed after the
# merge, and the lead empties this set then.
_PENDING: set[str] = set()


def _hits() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for path in sorted(SRC.rglob("*.py")):
        name = path.relative_to(SRC).as_posix()
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for what, pattern in PATTERNS.items():
                if pattern.search(line):
                    found.setdefault(name, []).append(f"{name}:{number}: {what}: {line.strip()}")
    return found


def test_no_measurement_history_or_outside_file_in_src():
    hits = {name: lines for name, lines in _hits().items() if name not in _PENDING}
    assert not hits, "\n".join(line for lines in hits.values() for line in lines)


def test_the_patterns_find_what_they_are_for():
    samples = {
        "see DESIGN.md §3": "a file outside the repository",
        "results in s11_T_other_after": "a benchmark run's tag",
        "A fresh interpreter costs 7-10 s on this machine": "a measurement on the machine it ran on",
        "the phase took 0.15 s": "a measured timing",
        "``torch._inductor`` (about 5 s here)": "a measured timing",
        "a step took 34 ms instead of 19 ms": "a measured timing",
    }
    for text, what in samples.items():
        assert PATTERNS[what].search(text), text
    for text in ("one line per trace running longer than 5 s", "timed as the median of 5 blocks",
                 "split into s1_x pieces"):
        assert not any(p.search(text) for p in PATTERNS.values()), text


def test_pending_files_exist_and_still_have_hits():
    """An entry that no longer matches anything is stale: remove it from _PENDING."""
    hits = _hits()
    for name in _PENDING:
        assert (SRC / name).exists(), name
        assert name in hits, f"{name} is clean now: remove it from _PENDING"
