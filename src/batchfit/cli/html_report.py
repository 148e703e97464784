"""A self-contained interactive HTML report of a memory answer (``--html FILE``).

One file that opens offline: plotly's JavaScript is written into the page (no CDN), with
the answer's JSON (the command's ``--json`` output) in a ``<script type="application/json"
id="batchfit-json">`` element. Every figure in the summary table carries the JSON path it
shows (``data-json``) and its exact value (``data-value``), so a test (or a reader) can
check the page against the JSON.

Figures, each drawn from the result as predicted, never interpolated as if measured:

* memory against batch size: one marker per traced batch (``max``), the budget as a line;
* the breakdown at the peak by category;
* the modules holding the most activation and temporary memory at the peak;
* the step's timeline: allocated and reserved memory over the step's events, with the
  phases as bands and each point's op and module on hover (the highest value of each
  bucket of events where the step has more events than points drawn);
* on a GPU, the segments when the predicted steady step's allocated memory peaks (the
  predicted memory snapshot: :mod:`batchfit.device.snapshot_export`), each block coloured
  by what holds it.
* with a real snapshot (``estimate --snapshot``), the allocations the prediction lacks
  and adds, by module and op (:mod:`batchfit.device.snapshot_diff`), and both slacks in
  the summary table.

plotly is an optional dependency (``pip install 'batchfit[report]'``).
"""

from __future__ import annotations

import html
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from batchfit.errors import InvalidInputError

#: The most points the timeline draws; a longer step is bucketed (highest value kept).
TIMELINE_POINTS = 2000
#: The most segments drawn (largest first).
SEGMENTS_DRAWN = 40
_PHASE_COLOURS = {"setup": "#eeeeee", "zero_grad": "#f6e8c3", "forward": "#d9ecf7",
                  "loss": "#f9d8d8", "backward": "#dcefdc", "optimizer": "#e8dcf3"}
_UNITS = ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB"), (1, "B"))


def unit_for(values: Sequence[float]) -> tuple[int, str]:
    """The largest binary unit in which the biggest of ``values`` is at least 1 (bytes)."""
    largest = max((abs(v) for v in values), default=0)
    return next(((scale, name) for scale, name in _UNITS if largest >= scale), (1, "B"))


def check_html_path(path: str) -> None:
    """Fail before any work when the report cannot be written there."""
    folder = Path(path).expanduser().resolve().parent
    if not folder.is_dir():
        raise InvalidInputError(f"--html {path}: the folder {folder} does not exist")
    if not path.lower().endswith((".html", ".htm")):
        raise InvalidInputError(f"--html {path}: give a file name ending in .html")


def memory_report(title: str, data: dict[str, Any], est: Any,
                  evaluated: Sequence[tuple[int, int]] = (), budget_bytes: int | None = None,
                  summary: Sequence[tuple[str, str]] = ()) -> str:
    """The page for ``estimate`` or ``max``.

    Args:
        title: the page's heading (the command and model).
        data: the command's JSON output, embedded as is.
        est: the :class:`~batchfit.answers.estimate.MemoryEstimate` the figures are drawn from.
        evaluated: ``max``'s traced (batch size, allocator bytes) pairs.
        budget_bytes: the allocator budget those pairs are compared with.
        summary: (label, JSON key) rows of the summary table, each a number in ``data``.
    """
    figures = [_breakdown(est), _top_modules(est), _timeline(est)]
    if evaluated:
        figures.insert(0, _memory_vs_batch(evaluated, budget_bytes, data.get("max_batch_size")))
    if est.device.is_cuda and est.events:
        figures.append(_segments(est.predicted_snapshot()["batchfit"]["peak_segments"]))
    if getattr(est, "snapshot_diff", None) is not None:
        summary = [*summary, *DIFF_SUMMARY]
        figures.append(_snapshot_diff(est.snapshot_diff))
    return _page(title, data, summary, [f for f in figures if f is not None])


#: The summary rows of a diff against a real snapshot (dotted: a key inside ``data``).
DIFF_SUMMARY = (("peak allocated, real", "snapshot_comparison.real_peak_allocated_bytes"),
                ("peak reserved, real", "snapshot_comparison.real_peak_reserved_bytes"),
                ("slack at the peak, real", "snapshot_diff.real_slack_bytes"),
                ("slack at the peak, predicted", "snapshot_diff.predicted_slack_bytes"),
                ("real allocations the prediction lacks", "snapshot_diff.lacking_bytes"),
                ("predicted allocations the GPU never made", "snapshot_diff.adding_bytes"),
                ("allocations matched", "snapshot_diff.matched_allocations"))


def write_report(page: str, path: str) -> Path:
    """Write ``page`` to ``path``."""
    target = Path(path).expanduser()
    try:
        target.write_text(page, encoding="utf-8")
    except OSError as exc:
        raise InvalidInputError(f"cannot write {path}: {exc.strerror}") from exc
    return target


# --------------------------------------------------------------------------- figures


def _go() -> Any:
    try:
        import plotly.graph_objects as go
    except ImportError as exc:
        raise InvalidInputError("--html needs plotly: pip install 'batchfit[report]'") from exc
    return go


def _layout(fig: Any, title: str, x: str, y: str, height: int = 420) -> Any:
    fig.update_layout(title={"text": title, "y": 0.98, "yanchor": "top"}, xaxis_title=x,
                      yaxis_title=y, height=height, template="plotly_white",
                      margin={"l": 70, "r": 30, "t": 90, "b": 60})
    if fig.layout.legend.y is None:  # figures that set their own legend keep it
        fig.update_layout(legend={"orientation": "h", "yanchor": "bottom", "y": 1.0, "x": 0})
    return fig


def _memory_vs_batch(evaluated: Sequence[tuple[int, int]], budget: int | None,
                     answer: int | None) -> Any:
    go = _go()
    points = sorted(evaluated)
    scale, unit = unit_for([b for _, b in points] + ([budget] if budget else []))
    fig = go.Figure(go.Scatter(
        x=[b for b, _ in points], y=[n / scale for _, n in points], mode="markers",
        name="traced batch", marker={"size": 10, "symbol": "circle"},
        hovertemplate=f"batch %{{x}}: %{{y:,.2f}} {unit}<extra>traced</extra>"))
    if budget:
        fig.add_hline(y=budget / scale, line_dash="dash", line_color="#c0392b",
                      annotation_text=f"budget {budget / scale:,.2f} {unit}")
    if answer:
        # a vertical line as a trace, not a shape: plotly places a shape's annotation at
        # 10**x on a log axis, off the page
        top = max([n for _, n in points] + ([budget] if budget else [])) / scale
        fig.add_trace(go.Scatter(x=[answer, answer], y=[0, top], mode="lines",
                                 name=f"answer {answer:,}", hoverinfo="name",
                                 line={"dash": "dot", "color": "#27ae60"}))
    fig.update_xaxes(type="log" if points and points[-1][0] > 16 * max(points[0][0], 1)
                     else "linear")
    return _layout(fig, "Memory against batch size (traced batches only)", "batch size",
                   f"allocator memory needed ({unit})")


def _breakdown(est: Any) -> Any:
    go = _go()
    items = sorted(((c.value, b) for c, b in est.by_category.items() if b), key=lambda kv: kv[1])
    scale, unit = unit_for([b for _, b in items])
    fig = go.Figure(go.Bar(
        x=[b / scale for _, b in items], y=[name.replace("_", " ") for name, _ in items],
        orientation="h", text=[f"{b / scale:,.2f} {unit}" for _, b in items],
        textposition="auto", hovertemplate=f"%{{y}}: %{{x:,.2f}} {unit}<extra></extra>"))
    return _layout(fig, f"What the peak holds ({est.peak_phase.value}, {est.peak_op or 'setup'})",
                   f"memory ({unit})", "", height=max(300, 40 * len(items) + 120))


def _top_modules(est: Any) -> Any:
    if not est.top_modules:
        return None
    go = _go()
    modules = list(reversed(est.top_modules))
    scale, unit = unit_for([m.bytes for m in modules])
    fig = go.Figure(go.Bar(
        x=[m.bytes / scale for m in modules], y=[m.module or "<root>" for m in modules],
        orientation="h", hovertemplate=f"%{{y}}: %{{x:,.2f}} {unit}<extra></extra>"))
    fig.update_yaxes(type="category")  # module paths like "1" and "3" are names, not numbers
    return _layout(fig, "Modules holding the most activations and temporaries at the peak",
                   f"memory ({unit})", "", height=max(300, 32 * len(modules) + 120))


def _timeline(est: Any) -> Any:
    timeline, events = est.timeline, est.events
    count = len(timeline.allocated_bytes)
    if not count:
        return None
    go = _go()
    size = -(-count // TIMELINE_POINTS)
    xs, allocated, reserved, labels = [], [], [], []
    for start in range(0, count, size):
        stop = min(start + size, count)
        top = max(range(start, stop), key=timeline.allocated_bytes.__getitem__)
        xs.append(top)
        allocated.append(timeline.allocated_bytes[top])
        reserved.append(max(timeline.reserved_bytes[start:stop]))
        event = events[top] if top < len(events) else None
        labels.append(html.escape(f"{event.op} {event.module}".strip()) if event else "")
    scale, unit = unit_for(reserved + allocated)
    fig = go.Figure()
    for number, (phase, start, stop) in enumerate(_phase_runs(timeline.phases)):
        # labels alternate top and bottom, so that a short phase's does not cover the next
        fig.add_vrect(x0=start - 0.5, x1=stop - 0.5, fillcolor=_PHASE_COLOURS.get(phase, "#fff"),
                      opacity=0.6, line_width=0, layer="below", annotation_text=phase,
                      annotation_position="top left" if number % 2 == 0 else "bottom left")
    fig.add_trace(go.Scatter(x=xs, y=[r / scale for r in reserved], name="reserved",
                             mode="lines", line={"color": "#8e44ad"}, hoverinfo="skip"))
    fig.add_trace(go.Scatter(x=xs, y=[a / scale for a in allocated], name="allocated",
                             mode="lines", line={"color": "#2980b9"}, text=labels,
                             hovertemplate=f"%{{y:,.2f}} {unit}<br>%{{text}}<extra></extra>"))
    fig.update_xaxes(showticklabels=False)
    return _layout(fig, "The step's memory, event by event (phases shaded; hover for the op)",
                   "the step's allocations and frees, in order", f"memory ({unit})")


def _phase_runs(phases: Sequence[Any]) -> list[tuple[str, int, int]]:
    runs: list[tuple[str, int, int]] = []
    for index, phase in enumerate(phases):
        name = getattr(phase, "value", str(phase))
        if runs and runs[-1][0] == name:
            runs[-1] = (name, runs[-1][1], index + 1)
        else:
            runs.append((name, index, index + 1))
    return runs


def _segments(segments: Sequence[dict[str, Any]]) -> Any:
    go = _go()
    segments = sorted(segments, key=lambda s: -s["total_size"])[:SEGMENTS_DRAWN]
    if not segments:
        return None
    scale, unit = unit_for([s["total_size"] for s in segments])
    names = [f"segment {i + 1} ({s['segment_type']})" for i, s in enumerate(segments)]
    traces: dict[str, dict[str, list]] = {}
    for name, segment in zip(names, segments):
        for block in segment["blocks"]:
            frames = block.get("frames") or []
            kind = (frames[1]["name"].split(": ", 1)[-1] if len(frames) > 1
                    else "free (cached)" if block["state"] == "inactive" else "workspace")
            what = " ".join(f"{f['name']} {f['filename']}" for f in frames[:1])
            trace = traces.setdefault(kind, {"x": [], "y": [], "text": []})
            trace["x"].append(block["size"] / scale)
            trace["y"].append(name)
            trace["text"].append(html.escape(what or kind))
    fig = go.Figure([go.Bar(x=t["x"], y=t["y"], name=kind.replace("_", " "), orientation="h",
                            text=t["text"], textposition="none",
                            hovertemplate=f"%{{x:,.2f}} {unit}: %{{text}}<extra>{kind}</extra>")
                     for kind, t in traces.items()])
    fig.update_layout(barmode="stack")
    fig.update_yaxes(categoryorder="array", categoryarray=names, autorange="reversed")
    return _layout(fig, "Segments at the step's allocated peak (largest first)",
                   f"memory ({unit})", "", height=max(320, 26 * len(segments) + 180))


def _snapshot_diff(diff: Any) -> Any:
    """The unmatched allocations of both sides, by module and op (most bytes first)."""
    groups = [("lacks (real only)", g) for g in diff.lacking[:SEGMENTS_DRAWN]]
    groups += [("adds (predicted only)", g) for g in diff.adding[:SEGMENTS_DRAWN]]
    if not groups:
        return None
    go = _go()
    scale, unit = unit_for([g.total_bytes for _, g in groups])
    fig = go.Figure()
    for side, colour in (("lacks (real only)", "#c0392b"), ("adds (predicted only)", "#2980b9")):
        mine = [g for name, g in groups if name == side]
        if mine:
            fig.add_trace(go.Bar(
                x=[g.total_bytes / scale for g in mine],
                y=[f"{g.op or '-'} in {g.module or '<root>'}" for g in mine], orientation="h",
                name=f"the prediction {side}", marker_color=colour,
                text=[f"{g.count}x" for g in mine], textposition="auto",
                hovertemplate=f"%{{y}}: %{{x:,.2f}} {unit} (%{{text}})<extra></extra>"))
    fig.update_yaxes(autorange="reversed")
    fig.update_layout(showlegend=True)  # plotly hides a lone trace's: it says which side
    return _layout(fig, "Against the real snapshot: allocations on one side only",
                   f"memory ({unit})", "", height=max(300, 30 * len(groups) + 140))


# --------------------------------------------------------------------------- the page


PREDICTED = "a prediction from a traced step, not a measurement"


def _page(title: str, data: dict[str, Any], summary: Sequence[tuple[str, str]],
          figures: Sequence[Any], source: str = PREDICTED) -> str:
    from plotly.offline import get_plotlyjs

    from batchfit.cli.report import format_bytes

    rows = []
    for label, key in summary:
        value = _lookup(data, key)
        shown = ("-" if value is None else ("yes" if value else "no") if isinstance(value, bool)
                 else format_bytes(value) if "bytes" in key and isinstance(value, int)
                 else f"{value:,}" if isinstance(value, int) else _number(value)
                 if isinstance(value, float) else str(value))
        rows.append(f'<tr><th>{html.escape(label)}</th><td data-json="{html.escape(key)}" '
                    f'data-value="{html.escape(json.dumps(value))}">{html.escape(shown)}</td></tr>')
    body = "\n".join(
        f'<section class="figure">{fig.to_html(full_html=False, include_plotlyjs=False)}</section>'
        for fig in figures)
    payload = json.dumps(data, indent=1).replace("</", "<\\/")
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1100px; color: #222; }}
table.summary {{ border-collapse: collapse; margin-bottom: 1.5em; }}
table.summary th {{ text-align: left; padding: 4px 16px 4px 0; font-weight: 600; }}
table.summary td {{ padding: 4px 0; font-variant-numeric: tabular-nums; }}
section.figure {{ margin: 1em 0 2em; }}
footer {{ color: #777; font-size: 0.85em; }}
</style>
<script>{get_plotlyjs()}</script></head>
<body>
<h1>{html.escape(title)}</h1>
<table class="summary">
{chr(10).join(rows)}
</table>
{body}
<footer>batchfit: {html.escape(source)}. The answer's JSON is
embedded in this page (element <code>batchfit-json</code>).</footer>
<script type="application/json" id="batchfit-json">{payload}</script>
</body></html>
"""


def _lookup(data: dict[str, Any], key: str) -> Any:
    """``data[key]``, or for a dotted key the value inside nested objects (None if absent)."""
    value: Any = data
    for part in key.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def _number(value: float) -> str:
    """A float as people read it: grouped with one decimal from 100 up, else 4 figures."""
    return f"{value:,.1f}" if abs(value) >= 100 else f"{value:.4g}"
