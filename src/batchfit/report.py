"""Human output: rich tables for estimates and max-batch answers, and matplotlib plots.

The library never prints; the CLI calls these renderers.
"""

from __future__ import annotations

from typing import Any, Sequence

from rich.console import Group
from rich.table import Table
from rich.text import Text


def format_bytes(nbytes: int | float | None) -> str:
    if nbytes is None:
        return "-"
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:,.0f} {unit}" if unit == "B" else f"{value:,.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"  # pragma: no cover


def category_table(by_category: dict[Any, int], total_bytes: int, title: str) -> Table:
    table = Table(title=title, title_justify="left")
    table.add_column("category")
    table.add_column("memory", justify="right")
    table.add_column("share", justify="right")
    for category, size in sorted(by_category.items(), key=lambda kv: -kv[1]):
        if size == 0:
            continue
        name = getattr(category, "value", str(category)).replace("_", " ")
        table.add_row(name, format_bytes(size), f"{size / total_bytes:.1%}" if total_bytes else "-")
    table.add_row(Text("total", style="bold"), Text(format_bytes(total_bytes), style="bold"), "")
    return table


def modules_table(top_modules: Sequence[Any], total_bytes: int) -> Table:
    table = Table(title="Top layers at the peak (activations and temporaries)", title_justify="left")
    table.add_column("module")
    table.add_column("memory", justify="right")
    table.add_column("of peak", justify="right")
    for item in top_modules:
        table.add_row(item.module, format_bytes(item.bytes),
                      f"{item.bytes / total_bytes:.1%}" if total_bytes else "-")
    return table


def render_estimate(est: Any) -> Group:
    """The breakdown, the top layers and one sentence."""
    device = est.device
    where = device.name if device.is_cuda else "cpu"
    head = Text.assemble(
        ("Peak memory ", "bold"), (format_bytes(est.total_bytes), "bold green"),
        f" for one {'training' if est.timeline.phases and 'backward' in {p.value for p in est.timeline.phases} else 'inference'} step at batch {est.batch_size} on {where}",
    )
    lines: list[Any] = [head]
    if device.is_cuda:
        lines.append(Text(
            f"allocated {format_bytes(est.peak_allocated_bytes)}, reserved "
            f"{format_bytes(est.peak_reserved_bytes)}, + CUDA context "
            f"{format_bytes(device.context_bytes)}; card {format_bytes(device.total_memory_bytes)}"))
    if est.first_step_peak_bytes not in (None, est.total_bytes):
        lines.append(Text(f"first step (creates optimizer state): "
                          f"{format_bytes(est.first_step_peak_bytes)}"))
    lines.append(category_table(est.by_category, est.total_bytes, "Where the memory goes at the peak"))
    if est.top_modules:
        lines.append(modules_table(est.top_modules, est.total_bytes))
    lines.append(Text(est.explain(), style="italic"))
    for warning in est.warnings:
        lines.append(Text(f"warning: {warning}", style="yellow"))
    return Group(*lines)


def render_max_batch(result: Any, model: str) -> Group:
    est = result.estimate_at_max
    device = result.device
    where = device.name if device.is_cuda else "cpu"
    head = Text.assemble(
        ("Largest batch: ", "bold"), (f"{result.max_batch_size}", "bold green"),
        f" for {model} on {where} ({format_bytes(result.memory_bytes)})")
    lines: list[Any] = [head]
    budget = Table(show_header=False, box=None)
    budget.add_column()
    budget.add_column(justify="right")
    budget.add_row("device memory", format_bytes(result.memory_bytes))
    if device.is_cuda:
        budget.add_row("- CUDA context", format_bytes(device.context_bytes))
        budget.add_row("- cuBLAS workspaces", format_bytes(device.workspace_bytes))
    if result.margin:
        budget.add_row(f"- margin {result.margin:.0%}", format_bytes(result.memory_bytes * result.margin))
    budget.add_row("= budget for the step", format_bytes(result.budget_bytes))
    budget.add_row(f"needed at B={result.max_batch_size}", format_bytes(result.total_bytes_at_max))
    if result.total_bytes_at_next is not None:
        budget.add_row(f"needed at B={result.max_batch_size + 1}",
                       format_bytes(result.total_bytes_at_next))
    lines.append(budget)
    lines.append(category_table(est.by_category, est.total_bytes,
                                f"Where the memory goes at B={result.max_batch_size}"))
    if est.top_modules:
        lines.append(modules_table(est.top_modules, est.total_bytes))
    lines.append(Text(est.explain(), style="italic"))
    constraint = result.binding_constraint.value
    lines.append(Text(f"binding constraint: {constraint}" + (f" ({result.note})" if result.note else "")
                      + f"; {result.traces} traces"))
    return Group(*lines)


def render_gpus(gpus: Sequence[Any]) -> Table:
    table = Table(title="GPU catalog", title_justify="left")
    for column in ("name", "memory", "SMs", "cc/arch", "bf16 TFLOP/s", "bandwidth"):
        table.add_column(column, justify="left" if column == "name" else "right")
    for gpu in gpus:
        cc = ".".join(map(str, gpu.compute_capability)) if gpu.compute_capability else (gpu.arch or "")
        bf16 = gpu.peak_flops.get("bf16")
        table.add_row(gpu.name, format_bytes(gpu.memory_bytes), str(gpu.sm_count), cc,
                      f"{bf16 / 1e12:,.0f}" if bf16 else "-",
                      f"{gpu.memory_bandwidth_bytes_per_s / 1e9:,.0f} GB/s")
    return table
