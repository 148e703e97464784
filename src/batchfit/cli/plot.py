"""Matplotlib plots: memory vs batch size against the card, the stacked breakdown, and
the timeline of one step. matplotlib is imported lazily (``pip install 'batchfit[plot]'``)."""

from __future__ import annotations

from typing import Any

from batchfit.errors import InvalidInputError

_GIB = float(1 << 30)


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise InvalidInputError("--plot needs matplotlib: pip install 'batchfit[plot]'") from exc
    return plt


def check_plot_path(path: str) -> None:
    if not str(path).lower().endswith(".png"):
        raise InvalidInputError(f"plot file {path!r} must end in .png")


def byte_unit(largest_bytes: float) -> tuple[str, float]:
    """The unit an axis reaching ``largest_bytes`` reads best in: MiB below 1 GiB."""
    return ("GiB", _GIB) if largest_bytes >= _GIB else ("MiB", float(1 << 20))


def _phase_spans(phases: Any) -> list[tuple[str, int, int]]:
    """``(phase, first event, last event + 1)`` for each run of one phase."""
    spans: list[tuple[str, int, int]] = []
    for i, phase in enumerate(phases):
        if spans and spans[-1][0] == phase.value:
            spans[-1] = (phase.value, spans[-1][1], i + 1)
        else:
            spans.append((phase.value, i, i + 1))
    return spans


def drop_overlapping_labels(fig: Any, labels: list[Any]) -> None:
    """Hide each label whose box overlaps one kept before it (narrow phases of a step)."""
    renderer = fig.canvas.get_renderer()
    kept: list[Any] = []
    for label in labels:
        box = label.get_window_extent(renderer)
        if any(box.overlaps(other) for other in kept):
            label.set_visible(False)
        else:
            kept.append(box)


def _timeline(ax: Any, est: Any) -> None:
    """Memory over one step, its x axis the step's phases (shaded spans, named below) and
    the peak marked with the op and module that reach it."""
    timeline = est.timeline
    series = [("allocated", timeline.allocated_bytes)]
    if est.device.is_cuda:
        series.append(("reserved", timeline.reserved_bytes))
    unit, scale = byte_unit(max(max(values, default=0) for _, values in series))
    for label, values in series:
        ax.plot(range(len(values)), [b / scale for b in values], label=label, lw=1)
    spans = _phase_spans(timeline.phases)
    for k, (_, first, last) in enumerate(spans):
        if k % 2:
            ax.axvspan(first - 0.5, last - 0.5, color="0.92", lw=0, zorder=0)
    ax.set_xticks([(first + last - 1) / 2 for _, first, last in spans],
                  [name for name, _, _ in spans], fontsize=7)
    ax.set_xlim(-0.5, max(len(timeline.phases) - 0.5, 0.5))
    if timeline.allocated_bytes:
        peak = timeline.peak_index
        values = dict(series)["reserved" if est.device.is_cuda else "allocated"]
        where = " in ".join(x for x in (timeline.peak_op, timeline.peak_module) if x)
        ax.plot([peak], [values[peak] / scale], "v", color="black",
                label=f"peak: {where}" if where else "peak")
    ax.set_xlabel("phase of the step")
    ax.set_ylabel(unit)
    ax.set_title(f"one step at B={est.batch_size}")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(0.0, -0.16), ncols=3,
              frameon=False)


def _breakdown(ax: Any, est: Any) -> None:
    """The stacked categories at the peak, the legend beside the bar (never over it)."""
    parts = [(c, size) for c, size in sorted(est.by_category.items(), key=lambda kv: -kv[1])
             if size > 0]
    unit, scale = byte_unit(sum(size for _, size in parts))
    bottom = 0.0
    for category, size in parts:
        ax.bar([0], [size / scale], bottom=bottom, width=0.6,
               label=category.value.replace("_", " "))
        bottom += size / scale
    ax.set_xticks([])
    ax.set_ylabel(unit)
    ax.set_title("at the peak")
    handles, labels = ax.get_legend_handles_labels()
    ax.legend(handles[::-1], labels[::-1], fontsize=7, loc="upper left",
              bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0)


def _figure(plt: Any, widths: list[float], size: tuple[float, float]) -> tuple[Any, Any]:
    """A figure laid out by matplotlib's constrained layout, which makes room for legends
    outside the axes (``tight_layout`` cannot, and warns)."""
    return plt.subplots(1, len(widths), figsize=size, layout="constrained",
                        gridspec_kw={"width_ratios": widths})


def _laid_out(fig: Any) -> Any:
    """Lay the figure out, then hide the tick labels that still overlap."""
    fig.canvas.draw()
    for ax in fig.axes:
        drop_overlapping_labels(fig, [t for t in ax.get_xticklabels() if t.get_text()])
    return fig


def _save(plt: Any, fig: Any, path: str) -> None:
    fig.savefig(path, dpi=120)
    plt.close(fig)


def estimate_figure(est: Any) -> Any:
    """The timeline of one step and the breakdown at its peak (a matplotlib Figure)."""
    fig, (left, right) = _figure(_pyplot(), [3, 1], (11, 4))
    _timeline(left, est)
    _breakdown(right, est)
    return _laid_out(fig)


def plot_estimate(est: Any, path: str) -> None:
    check_plot_path(path)
    _save(_pyplot(), estimate_figure(est), path)


def _memory_vs_batch(ax: Any, result: Any) -> None:
    """Traced points as markers; between them a dotted line, the interpolation: the need
    is a max of affine pieces in the batch (convex), so it lies on or below it."""
    overhead = result.device.context_bytes + result.device.workspace_bytes \
        if result.device.is_cuda else 0
    points = sorted(result.evaluated)
    totals = [v + overhead for _, v in points]
    unit, scale = byte_unit(max([*totals, result.memory_bytes]))
    batches = [b for b, _ in points]
    if len(points) > 1:
        ax.plot(batches, [t / scale for t in totals], ":", color="tab:blue", lw=1,
                label="interpolated (not traced)")
    ax.plot(batches, [t / scale for t in totals], "o", color="tab:blue", ls="none",
            label=f"traced ({len(points)})")
    ax.axhline(result.memory_bytes / scale, color="red", ls="--", label="device memory")
    ax.axvline(result.max_batch_size, color="green", ls=":",
               label=f"max batch {result.max_batch_size}")
    ax.set_xlabel("batch size")
    ax.set_ylabel(unit)
    ax.set_title("memory vs batch size")
    ax.legend(fontsize=7, loc="lower right")


def max_batch_figure(result: Any) -> Any:
    """Memory vs batch size with the card's line, the breakdown at B*, and the timeline."""
    fig, axes = _figure(_pyplot(), [2, 1, 3], (16, 4.5))
    _memory_vs_batch(axes[0], result)
    _breakdown(axes[1], result.estimate_at_max)
    _timeline(axes[2], result.estimate_at_max)
    return _laid_out(fig)


def plot_max_batch(result: Any, path: str) -> None:
    check_plot_path(path)
    _save(_pyplot(), max_batch_figure(result), path)


def plot_throughput(result: Any, path: str) -> None:
    """Throughput and memory against batch size on one figure."""
    check_plot_path(path)
    plt = _pyplot()
    points = [p.to_dict() for p in result.points]
    fitting = [p for p in points if p.get("fits", True)]
    fig, ax = plt.subplots(figsize=(8, 4.5), layout="constrained")
    ax.plot([p["batch_size"] for p in fitting], [p["samples_per_s"] for p in fitting], "o-",
            color="tab:blue", label="samples/s")
    ax.axvline(result.recommended_batch_size, color="green", ls=":",
               label=f"recommended {result.recommended_batch_size}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size")
    ax.set_ylabel("samples/s")
    mem = ax.twinx()
    peaks = [p.get("peak_bytes") or 0 for p in fitting]
    unit, scale = byte_unit(max(peaks, default=0))
    mem.plot([p["batch_size"] for p in fitting], [b / scale for b in peaks], "s--",
             color="tab:orange", label="memory")
    mem.set_ylabel(unit)
    handles = ax.get_legend_handles_labels()[0] + mem.get_legend_handles_labels()[0]
    ax.legend(handles, [h.get_label() for h in handles], fontsize=8, loc="lower right")
    ax.set_title("throughput and memory vs batch size")
    _save(plt, _laid_out(fig), path)
