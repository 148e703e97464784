"""Record one real step of a GPU-bracket row on this machine's GPU and set batchfit's
prediction of it against the allocator's record, allocation by allocation.

How it asks batchfit: ``batchfit.estimate`` on the live card beside the engine's events, set
against a CUDA memory snapshot: a diagnostic harness.

The brackets (``gpu_brackets.py``) say where the emulation misses, not why. A CUDA memory
snapshot of the same step does (:mod:`batchfit.device.snapshot`): which allocation sizes
the GPU made that batchfit does not predict, which batchfit predicts that the GPU never
made, and where their order first differs. This script needs a CUDA GPU; without one it
says so and exits 2 (nothing here is emulated).

What it runs is timm's ``benchmark.py`` step for the row, in this process, with this
machine's torch (not the row's): ``timm.create_model(name)`` with the script's arguments,
fp32 weights, ``torch.backends.cudnn.benchmark = True``, input ``torch.randn(B, 3, H, W)``
(channels_last for nhwc rows), fp16 autocast; inference rows ``eval()`` under
``torch.inference_mode()``, train rows one SGD (Nesterov) step on cross-entropy. Two warm-up
steps (cuDNN's algorithm search and the first step's optimizer state are behind them), then
one step recorded with ``torch.cuda.memory._record_memory_history()``. batchfit predicts the
same step for this card (``live_gpu``) and the installed stack, and compares.

Usage (on a machine with a CUDA GPU):
    python benchmarks/gpu_snapshot.py --row "memory:120:caformer_b36:RTX 4090:2.4.0:nchw"
        [--batch B] [--out DIR]

``--batch`` defaults to the row's ``batch_fit`` scaled to this card's memory, so that the
step runs; give the failing batch to see why it fails (a recorded step that runs out of
memory is kept, ending in the allocator's ``oom`` entry; warm-up steps that do are reported
in one line, exit 3). Writes ``<out>/<row key>.pickle`` (the snapshot: open it in
https://pytorch.org/memory_viz) and ``<out>/<row key>.json`` (the comparison); default out
``benchmarks/results/gpu_snapshots``.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

import gpu_brackets as gb

OUT = Path(__file__).parent / "results" / "gpu_snapshots"
WARMUP_STEPS = 2


def timm_step(row: gb.Row, batch_size: int) -> Any:
    """timm benchmark.py's step for ``row`` on cuda:0, as a zero-argument function."""
    import torch

    model = gb.build_timm(row.model, row.set != "T").cuda()
    layout = torch.channels_last if row.layout == "nhwc" else torch.contiguous_format
    model = model.to(memory_format=layout)
    x = torch.randn(batch_size, 3, row.img_size, row.img_size, device="cuda")
    x = x.contiguous(memory_format=layout)
    autocast = torch.autocast("cuda", dtype=torch.float16)
    if row.set != "T":
        model.eval()

        def infer() -> None:
            with torch.inference_mode(), autocast:
                model(x)
        return infer
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9, nesterov=True)
    loss_fn = torch.nn.CrossEntropyLoss()

    def train() -> None:
        optimizer.zero_grad()
        with autocast:
            output = model(x)
            target = torch.randint(0, output.shape[-1], (batch_size,), device="cuda")
            loss_fn(output, target).backward()
        optimizer.step()
    return train


def record_step(step: Any, path: Path, max_entries: int = 1_000_000,
                stacks: str = "all", context: str = "all") -> dict[str, Any]:
    """Run ``step`` WARMUP_STEPS times, then once with the allocator's history recorded;
    pickle the snapshot to ``path`` and return it. A recorded step that runs out of memory
    is recorded too: the snapshot then ends with the allocator's ``oom`` entry, which is the
    point when the question is why a predicted batch failed. ``max_entries``, ``stacks``
    (``"python"``: no C++ frames) and ``context`` (``"alloc"``: stacks of allocations
    only, the ones the comparison labels) bound the snapshot's size."""
    import torch

    for _ in range(WARMUP_STEPS):
        step()
    torch.cuda.synchronize()
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.cuda.memory._record_memory_history(max_entries=max_entries, stacks=stacks,
                                             context=context)
    try:
        try:
            step()
        except torch.cuda.OutOfMemoryError:
            pass  # in the snapshot as an ``oom`` entry
        torch.cuda.synchronize()
        torch.cuda.memory._dump_snapshot(str(path))
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    from batchfit.device.snapshot import load_snapshot

    return load_snapshot(path)


def default_batch(row: gb.Row, card_bytes: int) -> int:
    """The row's ``batch_fit`` scaled to this card's memory (never above it)."""
    row_bytes = gb.device_for(row).total_memory_bytes
    return max(1, min(row.batch_fit, row.batch_fit * card_bytes // row_bytes))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--row", required=True, help="a row key, as in the results' 'key'")
    parser.add_argument("--batch", type=int, help="batch size (default: see the docstring)")
    parser.add_argument("--out", type=Path, default=OUT, help="where to write the results")
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("gpu_snapshot.py records a real step: this machine has no CUDA GPU "
              "(run it where the card is)", file=sys.stderr)
        return 2
    rows = {r.key: r for r in gb.read_rows(["memory", "nonmemory"])}
    if args.row not in rows:
        print(f"unknown row {args.row!r}: give a key as gpu_brackets.py writes them, e.g. "
              f"{next(iter(rows))!r}", file=sys.stderr)
        return 2
    row = rows[args.row]
    from rich.console import Console

    import batchfit
    from batchfit.cli.report import render_estimate
    from batchfit.device.catalog import live_gpu
    from batchfit.device.profile import gpu_profile

    profile = gpu_profile(live_gpu(0))
    batch_size = args.batch or default_batch(row, profile.total_memory_bytes)
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", row.key)
    torch.backends.cudnn.benchmark = True
    try:
        snapshot = record_step(timm_step(row, batch_size), args.out / f"{slug}.pickle")
    except torch.cuda.OutOfMemoryError:
        print(f"the warm-up steps ran out of memory at batch {batch_size} on {profile.name}: "
              "give a smaller --batch", file=sys.stderr)
        return 3
    settings = gb.row_settings(row)  # already limited to the fields this batchfit has
    settings.pop("stack", None)  # this process's stack, not the row's
    config = batchfit.TrainConfig(**settings)
    est = batchfit.estimate(lambda: gb.build_timm(row.model, row.set != "T"),
                            (3, row.img_size, row.img_size), batch_size, config,
                            device=profile, snapshot=snapshot)
    Console().print(render_estimate(est))
    result = {"row": row.key, "batch_size": batch_size, "gpu": profile.name,
              "torch": torch.__version__, **est.to_dict()}
    (args.out / f"{slug}.json").write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
