"""The interactive report (``--html FILE``) of ``bench``, ``plan`` and ``serve``.

The same self-contained page as ``estimate`` and ``max`` (:mod:`batchfit.cli.html_report`:
plotly inside, the command's JSON embedded, each summary figure tagged with its JSON key),
drawn from the command's JSON alone, so every number on the page is one the JSON holds:

* ``bench``: samples per second against batch size, one marker per batch measured (or
  predicted), with the knee, the recommended batch and the largest batch that fits marked;
* ``plan``: each layout's memory per GPU against the card's memory, and its predicted step
  time split into compute and communication (layouts that do not fit: their reason);
* ``serve``: where the card's memory goes (weights, the profile run, outside torch, the KV
  cache) and, for vLLM, the requests that fit at once against the context per request.
"""

from __future__ import annotations

import html
from collections.abc import Callable
from typing import Any

from batchfit.cli.html_report import PREDICTED, _go, _layout, _page, unit_for

BENCH_SUMMARY = (("recommended batch", "recommended_batch_size"),
                 ("knee", "knee_batch_size"), ("fastest batch", "best_batch_size"),
                 ("its samples per second", "best_samples_per_s"),
                 ("largest batch that fits", "max_batch_size"), ("memory", "memory_bytes"))
PLAN_SUMMARY = (("GPU", "gpu"), ("GPUs", "world_size"), ("global batch", "global_batch_size"),
                ("best strategy", "best.strategy"),
                ("its micro-batch", "best.micro_batch_size"),
                ("its memory per GPU", "best.memory_per_gpu_bytes"),
                ("its step time (s)", "best.step_s"))
SERVE_SUMMARY = (("engine", "engine"), ("context per request", "max_model_len"),
                 ("requests at once", "max_concurrency"), ("KV cache", "kv_cache_bytes"),
                 ("KV bytes per token", "kv_bytes_per_token"), ("KV tokens", "kv_tokens"),
                 ("weights", "weights_bytes"))


def bench_report(title: str, data: dict[str, Any]) -> str:
    """The page of ``bench``'s JSON."""
    go = _go()
    points = [p for p in data.get("points", []) if p.get("samples_per_s")]
    fig = go.Figure(go.Scatter(
        x=[p["batch_size"] for p in points], y=[p["samples_per_s"] for p in points],
        mode="lines+markers", name="samples per second",
        hovertemplate="batch %{x}: %{y:,.1f} samples/s<extra></extra>"))
    top = max((p["samples_per_s"] for p in points), default=1.0)
    for key, label, colour in (("knee_batch_size", "knee", "#8e44ad"),
                               ("recommended_batch_size", "recommended", "#27ae60"),
                               ("max_batch_size", "largest that fits", "#c0392b")):
        # a vertical line as a trace, not a shape: plotly places a shape's annotation at
        # 10**x on a log axis, off the page
        if data.get(key):
            fig.add_trace(go.Scatter(
                x=[data[key], data[key]], y=[0, top], mode="lines", name=f"{label} {data[key]:,}",
                line={"dash": "dot", "color": colour}, hoverinfo="name"))
    xs = [p["batch_size"] for p in points]
    fig.update_xaxes(type="log" if xs and max(xs) > 16 * max(min(xs), 1) else "linear")
    kind = "predicted" if data.get("predicted") else "measured"
    figure = _layout(fig, f"Throughput against batch size ({kind})", "batch size",
                     "samples per second")
    return _page(title, data, BENCH_SUMMARY, [figure],
                 PREDICTED if data.get("predicted") else "throughput measured on this device")


def plan_report(title: str, data: dict[str, Any]) -> str:
    """The page of ``plan``'s JSON."""
    go = _go()
    layouts = data.get("layouts", [])
    names = [_layout_name(row) for row in layouts]
    fitting = [(name, row) for name, row in zip(names, layouts) if row.get("feasible")]
    memory = [row["memory_per_gpu_bytes"] for row in layouts if row.get("memory_per_gpu_bytes")]
    card = data.get("memory_bytes")
    scale, unit = unit_for(memory + ([card] if card else []))
    mem = go.Figure(go.Bar(
        x=names, y=[(row.get("memory_per_gpu_bytes") or 0) / scale for row in layouts],
        marker_color=["#2980b9" if row.get("feasible") else "#c0392b" for row in layouts],
        text=[html.escape(row.get("reason") or "fits") for row in layouts],
        hovertemplate=f"%{{x}}: %{{y:,.2f}} {unit} (%{{text}})<extra></extra>",
        name="memory per GPU"))
    if card:
        mem.add_hline(y=card / scale, line_dash="dash", line_color="#c0392b",
                      annotation_text=f"card {card / scale:,.2f} {unit}")
    figures = [_layout(mem, "Memory per GPU of each layout (red: does not fit)", "layout",
                       f"memory per GPU ({unit})")]
    if fitting:
        time = go.Figure([go.Bar(x=[n for n, _ in fitting], y=[row[key] for _, row in fitting],
                                 name=label, hovertemplate="%{x}: %{y:.6f} s<extra></extra>")
                          for key, label in (("compute_s", "compute"),
                                             ("communication_s", "communication (exposed)"))])
        time.add_trace(go.Scatter(x=[n for n, _ in fitting], y=[r["step_s"] for _, r in fitting],
                                  mode="markers", name="step", marker={"size": 10},
                                  hovertemplate="%{x}: step %{y:.6f} s<extra></extra>"))
        time.update_layout(barmode="stack")
        figures.append(_layout(time, "Predicted step time of the layouts that fit", "layout",
                               "seconds per optimizer step"))
    return _page(title, data, PLAN_SUMMARY, figures)


def serve_report(title: str, data: dict[str, Any]) -> str:
    """The page of ``serve``'s JSON."""
    go = _go()
    parts = [(label, data.get(key) or 0) for label, key in (
        ("KV cache", "kv_cache_bytes"), ("outside torch", "non_torch_bytes"),
        ("profile run (activations)", "activation_peak_bytes"), ("weights", "weights_bytes"))]
    scale, unit = unit_for([n for _, n in parts])
    split = go.Figure(go.Bar(
        x=[n / scale for _, n in parts], y=[label for label, _ in parts], orientation="h",
        text=[f"{n / scale:,.2f} {unit}" for _, n in parts], textposition="auto",
        hovertemplate=f"%{{y}}: %{{x:,.2f}} {unit}<extra></extra>"))
    figures = [_layout(split, "Where the card's memory goes", f"memory ({unit})", "",
                       height=320)]
    curve = data.get("concurrency_by_context") or []
    if curve:
        fig = go.Figure(go.Scatter(
            x=[c["max_model_len"] for c in curve], y=[c["max_concurrency"] for c in curve],
            mode="lines+markers", name="requests at once",
            hovertemplate="context %{x:,}: %{y:,.2f} requests<extra></extra>"))
        fig.update_xaxes(type="log", tickvals=[c["max_model_len"] for c in curve],
                         tickformat=",d")
        fig.update_yaxes(type="log")
        figures.append(_layout(fig, "Requests that fit at once against the context per request "
                                    "(same KV cache)", "context per request (tokens)",
                               "requests at once"))
    return _page(title, data, SERVE_SUMMARY, figures)


def _layout_name(row: dict[str, Any]) -> str:
    parts = [row["strategy"]]
    if row.get("tp", 1) > 1:
        parts.append(f"tp{row['tp']}")
    if row.get("offload", "none") != "none":
        parts.append(f"offload {row['offload']}")
    if row.get("checkpointing"):
        parts.append("ckpt")
    return " + ".join(parts)


#: The page of each command, from its JSON.
PAGES: dict[str, Callable[[str, dict[str, Any]], str]] = {
    "bench": bench_report, "plan": plan_report, "serve": serve_report}
