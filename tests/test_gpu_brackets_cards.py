"""``benchmarks/gpu_brackets_cards.py``: two cards with one stack compared, on hand-written
files in timm's format.

The counts follow the rule in the module's text, applied by hand: a card "runs more" when
the other one ran less and that other value is below its own file's start batch (its
largest value: the next step of timm's decay sequence failed there); values at a file's
start are lower bounds only.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
cards = pytest.importorskip("gpu_brackets_cards")

A = "benchmark-infer-amp-nchw-pt240-cu124-rtx3090.csv"
B = "benchmark-infer-amp-nchw-pt240-cu124-rtx4090.csv"
# model: (first card, second card); both files start at 1024.
BATCHES = {
    "m_first": (768, 512),     # the 4090 failed 768, which the 3090 ran
    "m_start": (1024, 768),    # the 3090 at its start (a lower bound) ran what failed on the 4090
    "m_second": (384, 512),    # the other way round
    "m_equal": (512, 512),
    "m_both_start": (1024, 1024),  # no upper bound on either card: no information
    "m_bounded": (768, 1024),  # the 4090's 1024 is its start; the 3090 failed 1024: second runs more
}


def _write(folder: Path, name: str, column: int, extra: dict[str, int] | None = None) -> None:
    lines = ["model,infer_img_size,infer_samples_per_sec,infer_batch_size"]
    lines += [f"{model},224,1.0,{pair[column]}" for model, pair in BATCHES.items()]
    lines += [f"{model},224,1.0,{batch}" for model, batch in (extra or {}).items()]
    (folder / name).write_text("\n".join(lines) + "\n")


def test_file_names_give_the_stack_and_card(tmp_path: Path) -> None:
    parsed = cards.parse_file_name(tmp_path / "benchmark-infer-amp-nhwc-pt291-cu128-4090.csv")
    assert (parsed.mode, parsed.precision, parsed.layout, parsed.torch, parsed.cuda, parsed.gpu) == (
        "infer", "amp", "nhwc", "291", "128", "4090")
    assert cards.parse_file_name(tmp_path / "benchmark-infer-amp-nchw-pt291-cu128-4090-dynamo.csv") is None
    assert cards.parse_file_name(tmp_path / "benchmark-infer-fp32-nchw-pt240-cpu-i7_12700h-dynamo.csv") is None


def test_compare_counts_by_the_decay_rule(tmp_path: Path) -> None:
    _write(tmp_path, A, 0, extra={"only_first": 256})
    _write(tmp_path, B, 1)
    first = cards.parse_file_name(tmp_path / A).batches()
    second = cards.parse_file_name(tmp_path / B).batches()
    counts = cards.compare(first, second)
    assert counts[cards.FIRST] == 2       # m_first, m_start
    assert counts[cards.SECOND] == 2      # m_second, m_bounded
    assert counts[cards.EQUAL] == 1       # m_equal; m_both_start and only_first not counted


def test_only_files_of_one_stack_pair_up(tmp_path: Path) -> None:
    names = [A, B, "benchmark-infer-amp-nchw-pt291-cu128-4090.csv",
             "benchmark-infer-amp-nhwc-pt240-cu124-rtx4090.csv"]
    files = [cards.parse_file_name(tmp_path / name) for name in names]
    pairs = cards.same_stack_pairs(files)
    assert [(a.path.name, b.path.name) for a, b in pairs] == [(A, B)]


def test_report_places_dev_rows_of_equal_memory_pairs(tmp_path: Path) -> None:
    _write(tmp_path, A, 0)
    _write(tmp_path, B, 1)
    results = tmp_path / "dev.jsonl"
    rows = [  # the 3090's m_first row: bracket [768, 1024), the 4090 ran 512
        {"key": "memory:1:m_first", "model": "m_first", "img_size": 224, "gpu": "RTX 3090",
         "source_file": A,
         "batch_fit": 768, "batch_failed": 1024, "predicted": 700},
        # the 4090's m_equal row: the 3090 ran the same batch, so it is not listed
        {"key": "memory:2:m_equal", "model": "m_equal", "img_size": 224, "gpu": "RTX 4090",
         "source_file": B,
         "batch_fit": 512, "batch_failed": 768, "predicted": 600}]
    results.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    files = [cards.parse_file_name(tmp_path / A), cards.parse_file_name(tmp_path / B)]
    text = cards.report(files, [results])
    # 3090 and 4090: 24,268 and 24,248 MiB in the catalog, within 1%.
    assert "| rtx3090 (24,268) | rtx4090 (24,248) | 2 | 2 | 1 |" in text
    assert "| m_first | 224 | RTX 3090 | [768, 1024) | 512 (rtx4090) | 700 | under |" in text
    assert "m_equal" not in text.split("Dev rows")[1]


@pytest.mark.parametrize(("ran", "start", "contradicts"), [
    (512, 1024, True),    # the other card failed 768, which this one ran
    (512, 512, False),    # 512 was the other file's start: it never tried 768
    (1024, 1024, True),   # the other card ran 1024, which failed here
    (768, 1024, False),   # the same bracket
])
def test_a_bracket_is_contradicted_by_the_decay_rule(ran: int, start: int, contradicts: bool
                                                       ) -> None:
    assert cards._disagrees(ran, start, 768, 1024) is contradicts


def test_a_card_the_catalog_lacks_is_shown_and_not_paired_for_dev_rows(tmp_path: Path) -> None:
    first, second = (tmp_path / "benchmark-infer-amp-nchw-pt240-cu124-rtx3090.csv",
                     tmp_path / "benchmark-infer-amp-nchw-pt240-cu124-nosuchcard.csv")
    _write(tmp_path, first.name, 0)
    _write(tmp_path, second.name, 1)
    results = tmp_path / "dev.jsonl"
    results.write_text(json.dumps({"key": "memory:1:m_first", "model": "m_first",
                                   "img_size": 224, "gpu": "RTX 3090",
                                   "source_file": first.name, "batch_fit": 768,
                                   "batch_failed": 1024, "predicted": 700}) + "\n")
    text = cards.report([cards.parse_file_name(first), cards.parse_file_name(second)], [results])
    # pairs list their cards by name: nosuchcard first, so its "runs more" counts lead
    assert "| nosuchcard (not in the catalog) | rtx3090 (24,268) | 2 | 2 | 1 |" in text
    assert "m_first" not in text


def test_a_missing_folder_is_one_line_and_exit_2(tmp_path: Path, capsys) -> None:
    assert cards.main(["--timm-results", str(tmp_path / "nope"), "--out",
                       str(tmp_path / "o.md")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is not a folder" in err
