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


def ranks_table(parallel: Any, rows: Sequence[tuple[int, str, int]], binding_rank: int | None,
                title: str) -> Table:
    """One row per traced rank: ``(rank, its answer, its bytes)``; the binding rank marked."""
    layout = parallel.to_dict()
    table = Table(title=f"{title}: {layout['world_size']} GPUs, {layout['strategy']}"
                        + (f", tp {layout['tp']}" if layout["tp"] > 1 else "")
                        + (f", offload {layout['offload']}" if layout["offload"] != "none" else "")
                        + (f", {layout['nodes']} nodes" if layout["nodes"] > 1 else ""),
                  title_justify="left")
    table.add_column("rank", justify="right")
    table.add_column("answer", justify="right")
    table.add_column("memory", justify="right")
    for rank, answer, nbytes in rows:
        mark = " (binds)" if rank == binding_rank and len(rows) > 1 else ""
        table.add_row(f"{rank}{mark}", answer, format_bytes(nbytes))
    return table


def snapshot_lines(comparison: Any) -> list[Any]:
    """The prediction against a real snapshot: peaks, the allocation sizes whose counts
    differ, and where the order of large allocations first differs."""
    c = comparison

    def error(real: int, predicted: int) -> str:
        return f"{(predicted - real) / real:+.1%}" if real else "-"

    peaks = Table(title="Against the real snapshot", title_justify="left")
    peaks.add_column("")
    peaks.add_column("real", justify="right")
    peaks.add_column("predicted", justify="right")
    peaks.add_column("error", justify="right")
    peaks.add_row("peak allocated", format_bytes(c.real_peak_allocated_bytes),
                  format_bytes(c.predicted_peak_allocated_bytes),
                  error(c.real_peak_allocated_bytes, c.predicted_peak_allocated_bytes))
    peaks.add_row("peak reserved", format_bytes(c.real_peak_reserved_bytes),
                  format_bytes(c.predicted_peak_reserved_bytes),
                  error(c.real_peak_reserved_bytes, c.predicted_peak_reserved_bytes))
    peaks.add_row(f"allocations >= {format_bytes(c.min_bytes)}", str(c.real_allocations),
                  str(c.predicted_allocations), "")
    lines: list[Any] = [peaks]
    if c.oom_count:
        lines.append(Text(f"the recorded window has {c.oom_count} out-of-memory error(s)",
                          style="yellow"))
    if not c.differences:
        lines.append(Text("every allocation size was predicted as often as it happened",
                          style="green"))
        return lines
    sizes = Table(title="Allocation sizes whose counts differ (real - predicted bytes, largest "
                        "first)", title_justify="left")
    for name, justify in (("size", "right"), ("real", "right"), ("predicted", "right"),
                          ("difference", "right"), ("batchfit's op and module", "left"),
                          ("real frame", "left")):
        sizes.add_column(name, justify=justify)  # type: ignore[arg-type]
    for d in c.differences:
        sizes.add_row(format_bytes(d.size_bytes), str(d.real_count), str(d.predicted_count),
                      format_bytes(d.difference_bytes), d.predicted_label or "-",
                      d.real_label or "-")
    lines.append(sizes)
    if c.first_divergence is not None:
        def entry(at: tuple[int, str] | None) -> str:
            return "(none)" if at is None else f"{format_bytes(at[0])} {at[1] or '-'}"

        lines.append(Text(f"the order of large allocations first differs at #{c.first_divergence}"
                          f": real {entry(c.real_at_divergence)}, predicted "
                          f"{entry(c.predicted_at_divergence)}"))
    return lines


#: The most groups shown on each side of a snapshot diff (the JSON has them all).
DIFF_GROUPS_SHOWN = 15


def snapshot_diff_lines(diff: Any) -> list[Any]:
    """The real snapshot against the predicted one: the allocations the prediction lacks
    and adds, by module and op, and the allocator's slack at the peak on each side."""
    slack = Table(title="The allocator's slack against the real snapshot", title_justify="left")
    slack.add_column("")
    for name in ("real", "predicted", "difference"):
        slack.add_column(name, justify="right")
    slack.add_row("reserved - allocated at the allocated peak",
                  format_bytes(diff.real_slack_bytes), format_bytes(diff.predicted_slack_bytes),
                  format_bytes(diff.slack_difference_bytes))
    lines: list[Any] = [slack]
    if not diff.lacking and not diff.adding:
        lines.append(Text(f"all {diff.matched_allocations} allocations >= "
                          f"{format_bytes(diff.min_bytes)} match, in order", style="green"))
        return lines
    for groups, total, title in (
            (diff.lacking, diff.lacking_bytes, "Allocations the prediction lacks (real only)"),
            (diff.adding, diff.adding_bytes, "Allocations the prediction adds (predicted only)")):
        if not groups:
            continue
        table = Table(title=f"{title}: {format_bytes(total)}", title_justify="left")
        for name, justify in (("module", "left"), ("op", "left"), ("count", "right"),
                              ("memory", "right")):
            table.add_column(name, justify=justify)  # type: ignore[arg-type]
        for group in groups[:DIFF_GROUPS_SHOWN]:
            table.add_row(group.module or "<root>", group.op or "-", str(group.count),
                          format_bytes(group.total_bytes))
        if len(groups) > DIFF_GROUPS_SHOWN:
            table.caption = f"{len(groups) - DIFF_GROUPS_SHOWN} more in --json"
        lines.append(table)
    return lines


def unified_memory_note(device: Any) -> Text | None:
    """For a GPU that shares its memory with the CPU (Jetson), what the answer assumes."""
    if not getattr(device, "unified_memory", False):
        return None
    return Text(
        f"note: {device.name} shares its {format_bytes(device.total_memory_bytes)} with the CPU "
        "and the OS (unified memory); this assumes all of it is free for CUDA: give --memory "
        "with what is free before training (MemAvailable in /proc/meminfo)", style="yellow")


def render_estimate(est: Any) -> Group:
    """The breakdown, the top layers and one sentence."""
    device = est.device
    where = device.name if device.is_cuda else "cpu"
    head = Text.assemble(
        ("Peak memory ", "bold"), (format_bytes(est.total_bytes), "bold green"),
        f" for one {'training' if est.timeline.phases and 'backward' in {p.value for p in est.timeline.phases} else 'inference'} step at batch {est.batch_size} on {where}",
    )
    lines: list[Any] = [head]
    if (verdict := fit_verdict(est)) is not None:
        lines.append(verdict)
    if device.is_cuda:
        lines.append(Text(
            f"allocated {format_bytes(est.peak_allocated_bytes)}, reserved "
            f"{format_bytes(est.peak_reserved_bytes)}, + CUDA context "
            f"{format_bytes(device.context_bytes)}"
            + (f" + NCCL {format_bytes(device.nccl_bytes)}" if device.nccl_bytes else "")
            + f"; card {format_bytes(device.total_memory_bytes)}"))
    if (note := unified_memory_note(device)) is not None:
        lines.append(note)
    if device.is_cuda and est.timeline.loop_steps > 1:
        lines.append(Text(f"replayed as a loop: {est.timeline.loop_steps} steps until the "
                          f"caching allocator repeats a state; the peak is the worst step's"))
    if est.first_step_peak_bytes not in (None, est.total_bytes):
        lines.append(Text(f"first step (creates optimizer state): "
                          f"{format_bytes(est.first_step_peak_bytes)}"))
    if getattr(est, "parallel", None) is not None:
        lines.append(ranks_table(est.parallel, [
            (r.rank, r.estimate.peak_phase.value, r.estimate.total_bytes) for r in est.ranks],
            est.binding_rank, "Peak per rank"))
    lines.append(category_table(est.by_category, est.total_bytes, "Where the memory goes at the peak"))
    if est.top_modules:
        lines.append(modules_table(est.top_modules, est.total_bytes))
    lines.append(Text(est.explain(), style="italic"))
    if getattr(est, "host_backed_bytes", 0):
        lines.append(Text(host_backed_note(est.host_backed_bytes), style="cyan"))
    lines.extend(allocator_lines(est.device))
    lines.extend(warning_lines(est.warnings))
    if getattr(est, "snapshot_comparison", None) is not None:
        lines.extend(snapshot_lines(est.snapshot_comparison))
    if getattr(est, "snapshot_diff", None) is not None:
        lines.extend(snapshot_diff_lines(est.snapshot_diff))
    return Group(*lines)


def fit_verdict(est: Any) -> Text | None:
    """Whether the step fits the card, with what it spares or lacks; None without a budget."""
    if est.fits is None:
        return None
    memory = f"{est.device.name}'s {format_bytes(est.memory_bytes)}"
    if est.fits:
        return Text.assemble(("fits", "bold green"),
                             f" {memory}, {format_bytes(est.margin_bytes)} to spare")
    return Text.assemble(("does not fit", "bold red"),
                         f" {memory}: {format_bytes(-est.margin_bytes)} short")


def allocator_lines(device: Any) -> list[Text]:
    """The allocator options the answer assumed, when they are not torch's defaults."""
    if not device.is_cuda or str(device.allocator) == "default":
        return []
    return [Text(f"allocator: PYTORCH_CUDA_ALLOC_CONF={device.allocator}", style="dim")]


def host_backed_note(nbytes: int) -> str:
    """One line on paged optimizer state (unified memory), which the total leaves out."""
    return (f"paged optimizer state: {format_bytes(nbytes)} in unified memory, not counted "
            "above: it lives in host RAM and pages onto the GPU only while optimizer.step "
            "touches it, into memory the allocator leaves free (never an out-of-memory error; "
            "PCIe traffic instead)")


def render_max_batch(result: Any, model: str) -> Group:
    est = result.estimate_at_max
    device = result.device
    where = device.name if device.is_cuda else "cpu"
    head = Text.assemble(
        ("Largest batch: ", "bold"), (f"{result.max_batch_size}", "bold green"),
        f" for {model} on {where} ({format_bytes(result.memory_bytes)})")
    lines: list[Any] = [head]
    if (note := unified_memory_note(device)) is not None:
        lines.append(note)
    budget = Table(show_header=False, box=None)
    budget.add_column()
    budget.add_column(justify="right")
    budget.add_row("device memory", format_bytes(result.memory_bytes))
    if device.is_cuda:
        budget.add_row("- CUDA context", format_bytes(device.context_bytes))
        budget.add_row("- cuBLAS workspaces", format_bytes(device.workspace_bytes))
    if device.nccl_bytes:
        budget.add_row("- NCCL buffers", format_bytes(device.nccl_bytes))
    if result.margin:
        budget.add_row(f"- margin {result.margin:.0%}", format_bytes(result.memory_bytes * result.margin))
    budget.add_row("= budget for the step", format_bytes(result.budget_bytes))
    # what the device needs, context and workspaces included: compared with "device
    # memory" (the step alone is compared with the budget)
    budget.add_row(f"device memory needed at B={result.max_batch_size}",
                   format_bytes(result.total_bytes_at_max))
    if result.total_bytes_at_next is not None:
        budget.add_row(f"device memory needed at B={result.max_batch_size + 1}",
                       format_bytes(result.total_bytes_at_next))
    lines.append(budget)
    stack = getattr(result, "stack", None)
    if device.is_cuda and stack is not None:
        loading = "lazy" if stack.lazy_module_loading else "eager"
        lines.append(Text(f"stack: {stack.label}, {loading} module loading", style="dim"))
    lines.extend(allocator_lines(device))
    if result.parallel is not None:
        lines.append(ranks_table(result.parallel, [(rank, f"batch {batch}", nbytes)
                                                   for rank, batch, nbytes in result.ranks],
                                 result.binding_rank, "Largest per-GPU batch per rank"))
    lines.append(category_table(est.by_category, est.total_bytes,
                                f"Where the memory goes at B={result.max_batch_size}"))
    if est.top_modules:
        lines.append(modules_table(est.top_modules, est.total_bytes))
    lines.append(Text(est.explain(), style="italic"))
    if getattr(est, "host_backed_bytes", 0):
        lines.append(Text(host_backed_note(est.host_backed_bytes), style="cyan"))
    constraint = result.binding_constraint.value
    lines.append(Text(f"binding constraint: {constraint}" + (f" ({result.note})" if result.note else "")
                      + f"; {result.traces} traces"))
    lines.extend(warning_lines(est.warnings))
    return Group(*lines)


def warning_lines(warnings: Sequence[str]) -> list[Text]:
    """Each warning of an answer (a custom op traced by its outputs only, a card whose
    marketed memory stands in for CUDA's total) on its own line."""
    return [Text(f"warning: {warning}", style="yellow") for warning in warnings]


def render_plan(result: Any, model: str) -> Group:
    """The layouts, fastest first, then the infeasible ones with their reasons."""
    table = Table(title=f"{model} on {result.world_size} x {result.gpu}"
                        + (f" ({result.nodes} nodes)" if result.nodes > 1 else "")
                        + f", global batch {result.global_batch_size}", title_justify="left")
    for column in ("layout", "micro x accum", "memory/GPU", "compute", "comms", "step",
                   "samples/s"):
        table.add_column(column, justify="left" if column == "layout" else "right")
    notes = []
    for row in result.rows:
        name = (f"{row.strategy}{f' tp{row.tp}' if row.tp > 1 else ''}"
                f"{' +ckpt' if row.checkpointing else ''}"
                f"{f' +offload {row.offload}' if row.offload != 'none' else ''}")
        if not row.feasible:
            table.add_row(Text(name, style="dim"), "-", "-", "-", "-", "-", "-")
            notes.append(Text(f"{name}: {row.reason}", style="dim"))
            continue
        table.add_row(name, f"{row.micro_batch_size} x {row.accumulation_steps}",
                      format_bytes(row.memory_per_gpu_bytes), f"{row.compute_s:.3f} s",
                      f"{row.communication_s:.3f} s", f"{row.step_s:.3f} s",
                      f"{row.samples_per_s:,.1f}")
    source = {"given": "--precision", "config": "the default; --precision to change"}.get(
        result.precision_source, f"the model's {result.precision_source.split()[-1]} "
        "checkpoint; --precision to change")
    lines: list[Any] = [table, *notes, Text(f"precision: {result.precision} ({source})")]
    if result.best is not None:
        best = result.best
        lines.append(Text(f"fastest: {best.strategy}, micro-batch {best.micro_batch_size} x "
                          f"{best.accumulation_steps} accumulation steps "
                          f"({best.step_s:.3f} s per step, no overlap of compute and "
                          "communication assumed)", style="italic"))
    lines.extend(warning_lines(result.warnings))
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


#: How a batch that was not measured reads in the bench table (by ``PointStatus`` value).
_UNMEASURED = {"out_of_memory": "out of memory", "predicted_not_to_fit": "predicted not to fit",
               "skipped_time_budget": "skipped: time budget"}


def render_bench(result: Any, model: str) -> Group:
    """Throughput per batch size with its timing spread, the knee, the recommendation and
    whether it stands out of the noise."""
    predicted = result.to_dict().get("predicted", False)
    table = Table(title=f"{'Predicted' if predicted else 'Measured'} throughput of {model}",
                  title_justify="left")
    for column in ("batch", "samples/s", "step", "IQR", "memory"):
        table.add_column(column, justify="right")
    for point in result.points:
        data = point.to_dict()
        status = data.get("status", "measured")
        if status != "measured":
            table.add_row(str(data["batch_size"]), _UNMEASURED.get(status, status), "-", "-",
                          format_bytes(data.get("peak_bytes")))
            continue
        mark = " ◀" if data["batch_size"] == result.recommended_batch_size else ""
        spread = point.spread if hasattr(point, "spread") else None
        table.add_row(f"{data['batch_size']}{mark}", f"{data['samples_per_s']:,.1f}",
                      f"{data['step_s'] * 1e3:,.1f} ms",
                      "-" if spread is None else f"{spread:.1%}",
                      format_bytes(data.get("peak_bytes")))
    largest = "largest that fits" if predicted else "largest predicted to fit"
    lines: list[Any] = [table, Text(
        f"knee {result.knee_batch_size}, best {result.best_batch_size} "
        f"({result.best_samples_per_s:,.1f} samples/s), recommended "
        f"{result.recommended_batch_size}; {largest} {result.max_batch_size}")]
    stability = getattr(result, "stability", None)
    if stability is not None:
        lines.append(Text(stability.text, style="bold yellow" if stability.within_noise else ""))
    if getattr(result, "epoch_s", None):
        lines.append(Text(f"epoch of {result.dataset_size:,} samples: {result.epoch_s:,.1f} s"))
    if getattr(result, "note", ""):
        lines.append(Text(f"note: {result.note}", style="italic"))
    alignment = getattr(result, "alignment", None)
    if alignment is not None:
        lines.append(Text(alignment.verdict.text, style="italic"))
    boundaries = getattr(result, "wave_boundaries", ())
    if boundaries:
        lines.append(Text("wave boundaries: " + ", ".join(
            str(getattr(b, "batch_size", b)) for b in boundaries[:10])))
    return Group(*lines)


def render_search(result: Any, model: str) -> Group:
    """The exact maximum found on the device, the recommendation and every trial."""
    table = Table(title=f"Trials of {model} on {result.device}", title_justify="left")
    for column in ("batch", "result", "peak", "seconds"):
        table.add_column(column, justify="right")
    for trial in result.trials:
        data = trial.to_dict()
        table.add_row(str(data["batch_size"]), "fits" if data["fits"] else "out of memory",
                      format_bytes(data.get("peak_bytes")), f"{data['seconds']:.1f}")
    head = Text.assemble(("Largest batch on the device: ", "bold"),
                         (str(result.max_batch_size), "bold green"),
                         f"; recommended {result.recommended_batch_size} (with headroom)")
    lines: list[Any] = [head, table]
    if result.predicted_max_batch_size is not None and result.prediction_error is not None:
        lines.append(Text(f"predicted {result.predicted_max_batch_size} "
                          f"({result.prediction_error:+.1%} vs the device)"))
    boundary = getattr(result, "boundary", ())
    if boundary:
        lines.append(Text("in fresh processes: " + ", ".join(
            f"batch {b} fits in {k} of {n}" for b, k, n in boundary)))
    return Group(*lines)


def render_serve(result: Any) -> Group:
    """Serving capacity: the memory budget, the KV layout and the answer."""
    head_value = (f"{result.max_concurrency:.2f} requests of {result.max_model_len:,} tokens"
                  if result.engine.value == "vllm" else
                  f"peak {format_bytes(result.hf['total_bytes'])}, largest batch "
                  f"{result.hf['max_batch_size']}")
    lines: list[Any] = [Text.assemble(
        ("Serving ", "bold"), f"{result.model} on {result.device.name} ({result.engine.value}): ",
        (head_value, "bold green"))]
    table = Table(show_header=False, box=None)
    table.add_column()
    table.add_column(justify="right")
    table.add_row("card memory", format_bytes(result.device.total_memory_bytes))
    if result.engine.value == "vllm":
        table.add_row("x gpu_memory_utilization", format_bytes(result.requested_bytes))
        table.add_row(f"- weights ({result.dtype})", format_bytes(result.weights_bytes))
        table.add_row("- profile-run activation peak", format_bytes(result.activation_peak_bytes))
        table.add_row("- non-torch memory", format_bytes(result.non_torch_bytes))
        table.add_row("= KV cache", format_bytes(result.kv_cache_bytes))
    else:
        table.add_row(f"weights ({result.dtype})", format_bytes(result.weights_bytes))
        table.add_row("prefill peak", format_bytes(result.hf["prefill_peak_bytes"]))
        table.add_row("decode peak", format_bytes(result.hf["decode_peak_bytes"]))
        table.add_row(f"KV cache at batch {result.hf['batch_size']}",
                      format_bytes(result.kv_cache_bytes))
    table.add_row(f"KV bytes per token ({result.kv_dtype})",
                  format_bytes(result.kv_bytes_per_token))
    if result.state_bytes_per_sequence:
        table.add_row("state per sequence (Mamba)", format_bytes(result.state_bytes_per_sequence))
    lines.append(table)
    kinds = ", ".join(f"{n} {k}" for k, n in result.layer_kinds.items())
    lines.append(Text(f"layers: {kinds}"))
    if result.plan is not None:
        plan = result.plan
        lines.append(Text(
            f"{plan.num_blocks:,} blocks of {plan.block_size} tokens = {plan.tokens:,} tokens of KV "
            f"cache; {plan.blocks_per_request:,} blocks per request of {result.max_model_len:,} "
            f"tokens -> maximum concurrency {result.max_concurrency:.2f}x"))
    lines.extend(Text(f"note: {note}", style="dim") for note in result.notes)
    return Group(*lines)
