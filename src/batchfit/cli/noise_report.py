"""Tables and figures for ``batchfit noise`` and ``batchfit recommend`` (the library never
prints; the CLI renders). matplotlib is imported lazily."""

from __future__ import annotations

import math
from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

from batchfit.cli.plot import _pyplot, check_plot_path
from batchfit.cli.report import format_bytes


def _num(value: float, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if math.isinf(value):
        return "unbounded"
    return f"{value:,.{digits}g}" if abs(value) < 1e4 else f"{value:,.0f}"


def _compact(value: float) -> str:
    for limit, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if value >= limit:
            return f"{value / limit:.3g}{suffix}"
    return f"{value:.3g}"


def noise_lines(noise: Any) -> list[Any]:
    """The noise scale, its interval and what it rests on, in a few lines."""
    if noise.method == "given":
        return [Text.assemble(("Gradient noise scale B_simple ", "bold"),
                              (f"{_num(noise.b_simple)}", "bold green"),
                              " examples (given, not measured)")]
    pct = round(noise.confidence * 100)
    head = Text.assemble(
        ("Gradient noise scale B_simple ", "bold"), (f"{_num(noise.b_simple)}", "bold green"),
        f" examples ({pct}% interval {_num(noise.ci_low)} - {_num(noise.ci_high)})")
    table = Table(show_header=False, box=None, pad_edge=False)
    table.add_column(style="dim")
    table.add_column()
    needed = noise.steps_for(0.1)
    table.add_row("|G|^2 (true gradient)", _num(noise.grad_sq_norm))
    table.add_row("tr(Σ) (per-example variance)", _num(noise.trace_sigma))
    table.add_row("batches", f"small {noise.batch_small}, big {noise.batch_big} ({noise.method})")
    table.add_row("steps", f"{noise.steps} measured"
                  + (f", {noise.skipped_steps} skipped" if noise.skipped_steps else "")
                  + (f"; about {needed} for a ±10% interval" if needed else
                     "; the interval is unbounded: measure more steps or use a larger big batch"))
    lines: list[Any] = [head, table]
    lines += [Text(f"note: {n}", style="yellow") for n in noise.notes]
    return lines


def render_noise(noise: Any, workload: str) -> Group:
    meaning = Text(
        "Batches well below B_simple waste optimizer steps, batches well above it waste "
        "examples (twice the minimum at B = B_simple). It is a proxy for the critical batch "
        "and grows as the loss falls. `batchfit recommend` combines it with the throughput "
        "curve.", style="italic")
    return Group(Text(workload, style="bold"), *noise_lines(noise), meaning)


def render_recommendation(rec: Any, noise: Any, workload: str, predicted: bool) -> Group:
    table = Table(title=f"Time to a target loss for {workload} "
                        f"({'predicted' if predicted else 'measured'} step times)",
                  title_justify="left")
    for column in ("batch", "samples/s", "step ms", "steps", "examples", "time", "memory", ""):
        table.add_column(column, justify="right", no_wrap=True)
    for option in rec.options:
        marks = []
        if option.batch_size == rec.recommended_batch_size:
            marks.append("◀ best")
        if option.batch_size == rec.current_batch_size:
            marks.append("now")
        style = "bold green" if option.batch_size == rec.recommended_batch_size else None
        approx = "" if option.measured else "~"
        table.add_row(str(option.batch_size), _compact(option.samples_per_s),
                      f"{approx}{option.step_s * 1e3:.3g}", f"{option.steps_factor:.2f}×",
                      f"{option.samples_factor:.2f}×", f"{option.relative_time:.3g}×",
                      format_bytes(option.peak_bytes).replace(" ", ""), " ".join(marks),
                      style=style)
    lines: list[Any] = [table, Text(
        "steps: S/S_min = 1 + B_noise/B; examples: E/E_min = 1 + B/B_noise; time: "
        "(1 + B_noise/B) x step time, relative to the best; ~ interpolated between "
        "timed batches", style="dim")]
    head = Text.assemble(("Recommended batch: ", "bold"),
                         (str(rec.recommended_batch_size), "bold green"))
    low, high = rec.range_batch_sizes
    if (low, high) != (rec.recommended_batch_size,) * 2:
        head.append(f" ({low}-{high} over the noise scale's interval)")
    if rec.speedup_vs_current is not None and rec.current_batch_size != rec.recommended_batch_size:
        head.append(f"; {rec.speedup_vs_current:.2f}× sooner to the target than batch "
                    f"{rec.current_batch_size}")
    lines.append(head)
    two_x = rec.samples_2x_batch_size
    if two_x is not None:
        fits = ("fits" if rec.samples_2x_fits
                else f"does not fit: the memory limit is {rec.max_batch_size}")
        lines.append(Text(f"Examples needed reach twice the minimum at B = B_noise = {two_x} "
                          f"({fits})."))
    lines.append(Text(f"Learning rate: {rec.learning_rate.text}. Rules: "
                      f"{rec.learning_rate.rule}: {rec.learning_rate.citation}; noise-aware: "
                      f"{rec.learning_rate.noise_aware_citation}.", style="dim"))
    lines += noise_lines(noise)
    lines.append(Text(rec.caveat, style="italic"))
    return Group(*lines)


def plot_noise(noise: Any, path: str) -> None:
    """The running B_simple over the measured steps, and each step's two estimates."""
    check_plot_path(path)
    plt = _pyplot()
    history = noise.history
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True,
                                     layout="constrained")
    steps = [s.step for s in history]
    top.plot(steps, [s.b_simple if math.isfinite(s.b_simple) else math.nan for s in history],
             color="tab:blue", label="running B_simple")
    if math.isfinite(noise.ci_high):
        top.axhspan(noise.ci_low, noise.ci_high, color="tab:blue", alpha=0.15,
                    label=f"{round(noise.confidence * 100)}% interval at the end")
    top.set_ylabel("B_simple (examples)")
    top.legend(fontsize=8)
    top.set_title(f"noise scale: small batch {noise.batch_small}, big {noise.batch_big} "
                  f"({noise.method})")
    bottom.plot(steps, [s.trace_sigma for s in history], ".", color="tab:orange",
                label="tr(Σ), one step")
    twin = bottom.twinx()
    twin.plot(steps, [s.grad_sq_norm for s in history], ".", color="tab:green",
              label="|G|², one step")
    bottom.set_xlabel("measured step")
    bottom.set_ylabel("tr(Σ)")
    twin.set_ylabel("|G|²")
    handles = bottom.get_legend_handles_labels()[0] + twin.get_legend_handles_labels()[0]
    bottom.legend(handles, [h.get_label() for h in handles], fontsize=8)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_recommendation(rec: Any, path: str) -> None:
    """samples/s, the steps-to-target factor and the time to target against batch size,
    with the memory limit and the recommendation marked."""
    check_plot_path(path)
    plt = _pyplot()
    options = rec.options
    batches = [o.batch_size for o in options]
    measured = [o for o in options if o.measured]
    fig, axes = plt.subplots(3, 1, figsize=(8, 8.5), sharex=True, layout="constrained")
    panels = ((axes[0], "samples/s", lambda o: o.samples_per_s),
              (axes[1], "steps to target / S_min", lambda o: o.steps_factor),
              (axes[2], "time to target (relative)", lambda o: o.relative_time))
    for ax, label, value in panels:
        ax.plot(batches, [value(o) for o in options], "-", color="tab:blue", lw=1)
        ax.plot([o.batch_size for o in measured], [value(o) for o in measured], "o",
                color="tab:blue", ms=4)
        ax.axvline(rec.recommended_batch_size, color="green", ls=":",
                   label=f"recommended {rec.recommended_batch_size}")
        if rec.max_batch_size <= 2 * batches[-1]:  # else far off the curve's right end
            ax.axvline(rec.max_batch_size, color="red", ls="--",
                       label=f"memory limit {rec.max_batch_size}")
        if math.isfinite(rec.b_noise):
            ax.axvline(rec.b_noise, color="grey", ls="-.", lw=1,
                       label=f"B_noise {rec.b_noise:,.0f}")
        ax.set_ylabel(label)
        ax.set_xscale("log", base=2)
    axes[1].set_yscale("log")
    axes[0].legend(fontsize=8)
    axes[2].set_xlabel("batch size")
    axes[0].set_title("throughput x statistical efficiency: (1 + B_noise/B) x step time")
    fig.savefig(path, dpi=120)
    plt.close(fig)
