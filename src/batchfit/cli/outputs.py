"""The files the commands write beside their answer: ``--html`` (the interactive report:
:mod:`batchfit.cli.html_report` for ``estimate`` and ``max``, :mod:`batchfit.cli.html_answers`
for ``bench``, ``plan`` and ``serve``) and ``--export-snapshot`` (the predicted step as a
CUDA memory snapshot, :mod:`batchfit.device.snapshot_export`). Paths are checked before any
work, so a result is never lost to a bad path."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from batchfit.errors import InvalidInputError

HTML_HELP = "write an interactive report here: one HTML file that opens offline"
SNAPSHOT_HELP = ("write the predicted step here as a CUDA memory snapshot (.pickle), for "
                 "pytorch.org/memory_viz and torch.cuda._memory_viz")


def check_outputs(html: str | None, snapshot: str | None, sharded: bool = False) -> None:
    """One line, before any work, for a path that cannot be written or a case not covered."""
    if html is not None:
        from batchfit.cli.html_report import check_html_path

        check_html_path(html)
    if snapshot is not None:
        folder = Path(snapshot).expanduser().resolve().parent
        if not folder.is_dir():
            raise InvalidInputError(f"--export-snapshot {snapshot}: the folder {folder} does "
                                    "not exist")
    if sharded and (html is not None or snapshot is not None):
        raise InvalidInputError("--html and --export-snapshot describe one GPU's step: leave "
                                "out --world-size")


def write_outputs(data: dict[str, Any], est: Any, title: str, *, html: str | None = None,
                  snapshot: str | None = None, evaluated: Sequence[tuple[int, int]] = (),
                  budget_bytes: int | None = None,
                  summary: Sequence[tuple[str, str]] = ()) -> list[str]:
    """Write the requested files; returns a line for each written."""
    written = []
    if snapshot is not None:
        from batchfit.device.snapshot_export import write_snapshot

        write_snapshot(est.predicted_snapshot(), snapshot)
        written.append(f"predicted snapshot written to {snapshot}")
    if html is not None:
        from batchfit.cli.html_report import memory_report, write_report

        write_report(memory_report(title, data, est, evaluated, budget_bytes, summary), html)
        written.append(f"report written to {html}")
    return written


def write_answer_report(command: str, data: dict[str, Any], title: str,
                        html: str | None) -> list[str]:
    """``--html`` for ``bench``, ``plan`` or ``serve``: the page of ``data`` (the command's
    JSON); returns a line for the file written."""
    if html is None:
        return []
    from batchfit.cli.html_answers import PAGES
    from batchfit.cli.html_report import write_report

    write_report(PAGES[command](title, data), html)
    return [f"report written to {html}"]


#: The summary rows of each command's report: (label, key of its JSON).
ESTIMATE_SUMMARY = (("device memory needed", "total_bytes"),
                    ("peak allocated", "peak_allocated_bytes"),
                    ("peak reserved", "peak_reserved_bytes"), ("fits", "fits"),
                    ("margin", "margin_bytes"), ("batch size", "batch_size"))
MAX_SUMMARY = (("largest batch", "max_batch_size"), ("binding constraint", "binding_constraint"),
               ("allocator budget", "budget_bytes"), ("needed at the answer", "step_bytes_at_max"),
               ("device memory needed", "total_bytes_at_max"), ("traces", "traces"))
