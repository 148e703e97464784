"""The engine's inference trace against torch's own CUDA dispatch, model by model.

How it asks batchfit: the engine's trace (``trace_step``) against torch's CUDA dispatch: an
exactness harness.

batchfit traces a step on fake *CPU* tensors and emulates what CUDA does differently
(the CUDA autocast policy, the kernel a convolution or attention runs, copies made
inside kernels). A forward pass needs no autograd, so it can also run on fake *CUDA*
tensors on a machine without a GPU, with torch's real CUDA autocast switched on at the
C++ level (``torch.set_autocast_enabled("cuda", True)``): every cast, composite and
output layout is then the one torch's CUDA dispatcher gives, not our emulation of it.
Counting the storages alive at each dispatched op gives the live peak of that run.

For each inference model of the GPU brackets' dev set (one per model, image size, timm
release, layout and no_grad/inference_mode) this compares, at one batch size:

* ``engine``: the peak of live bytes of ``batchfit``'s trace of the same forward (the
  row's settings on the installed torch, so both sides run one torch's rules), less what
  the engine adds below the dispatcher on purpose: cuDNN workspaces and the contiguous
  copies kernels make of strided inputs (:mod:`batchfit.engine.kernels`), which no
  dispatched op shows;
* ``cuda``: the peak of the forward on fake CUDA tensors (parameters, buffers and input
  included, as in the trace).

Equal peaks mean the dev set's misses are not in the emulated dispatch (autocast lists,
decompositions, memory formats) but below it (kernels' own allocations), in the
allocator replay or outside the allocator. Where they differ by design the row says why:
``F.scaled_dot_product_attention`` runs the math path on fake tensors (the engine
substitutes the kernel the target GPU runs, :mod:`batchfit.engine.sdpa`).

What the reference cannot see: allocations inside kernels (hence left out of the
engine's side); without a GPU, cuDNN's channels-last output for an NCHW input with a
channels-last weight (``_select_conv_backend`` picks no cuDNN for fake CUDA tensors
either); and under ``inference_mode``, where the fake run dispatches composite ops whole,
what they make inside: a LayerNorm's mean and rstd (``aten.layer_norm``; 2 floats a row,
against the output's C) and max pooling's int64 indices (``aten.max_pool2d``; CUDA's one
max-pool kernel, ``max_pool2d_with_indices_out_cuda`` in DilatedMaxPool2d.cu, writes
them), both of which the engine counts.

Usage:
    python benchmarks/gpu_brackets_dispatch.py [--batch 8] [--models REGEX]
        [--layout nchw|nhwc] [--tag NAME] [--timeout S]

Writes ``benchmarks/results/gpu_brackets/dispatch_<tag>.{jsonl,md}``.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_brackets

#: How close the two peaks must be to count as equal (relative).
TOLERANCE = 1e-3
#: Ops the engine allocates below the dispatcher on purpose (no dispatched op shows them).
BELOW_DISPATCH_OPS = ("cudnn workspace", "contiguous input copy")


def fake_cuda_forward_peak(model: Any, input_shape: tuple[int, ...], *,
                           channels_last: bool = False, inference_mode: bool = False,
                           autocast_dtype: Any = None) -> tuple[int, bool]:
    """The live-bytes peak of ``model``'s forward on fake CUDA tensors, and whether the
    forward called ``F.scaled_dot_product_attention``.

    ``model`` (built on the CPU or on meta; its tensors' values are never read) gets fake
    CUDA parameters and buffers of the same shapes and dtypes, in place
    (:func:`batchfit.engine.fake.swap_to_fake`). The peak counts parameters, buffers, the
    fp32 input and every storage a dispatched op creates while it is alive (views share
    their base's storage), with the project's live-storage tracker.
    ``autocast_dtype`` switches torch's CUDA autocast on at the C++ level for the call
    (the Python context manager refuses without a GPU) and restores it after.
    """
    import torch
    import torch.nn.functional as F
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.overrides import TorchFunctionMode

    from batchfit.engine.fake import swap_to_fake
    from batchfit.realrun.measure import _StorageTracker

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    swap_to_fake(model, mode, channels_last=channels_last, device="cuda")
    with mode:
        x = torch.empty(input_shape, device="cuda")
        if channels_last and x.dim() == 4:
            x = x.contiguous(memory_format=torch.channels_last)
    tracker = _StorageTracker()
    for tensor in (*model.parameters(), *model.buffers(), x):
        tracker.add(tensor.untyped_storage())

    class AttentionCalls(TorchFunctionMode):
        called = False

        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is F.scaled_dot_product_attention:
                AttentionCalls.called = True
            return func(*args, **(kwargs or {}))

    enabled, dtype = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
    grad_mode = torch.inference_mode() if inference_mode else torch.no_grad()
    try:
        if autocast_dtype is not None:
            torch.set_autocast_enabled("cuda", True)
            torch.set_autocast_dtype("cuda", autocast_dtype)
        with mode, grad_mode, tracker, AttentionCalls():
            output = model(x)
        del output
    finally:
        torch.set_autocast_enabled("cuda", enabled)
        torch.set_autocast_dtype("cuda", dtype)
        torch.clear_autocast_cache()
    return tracker.peak_bytes, AttentionCalls.called


def engine_forward_peak(events: list[Any]) -> int:
    """The live-bytes peak of a traced step, less the engine's below-dispatch allocations."""
    from batchfit.device.timeline import peak_live_bytes

    return peak_live_bytes([e for e in events if not e.op.startswith(BELOW_DISPATCH_OPS)])


def compare_row(row: gpu_brackets.Row, batch: int) -> dict[str, Any]:
    """Both peaks for one row's model, in this process."""
    import functools

    import torch

    import batchfit
    from batchfit.engine.fake import build_on_meta
    from batchfit.engine.spec import Precision
    from batchfit.engine.trace import trace_step

    settings = gpu_brackets.row_settings(row)
    settings.pop("stack", None)  # the installed torch, whose CUDA dispatch runs below
    config = batchfit.TrainConfig(**settings)
    device = gpu_brackets.device_for(row)
    build = functools.partial(gpu_brackets.build_timm, row.model, True)
    shape = (3, row.img_size, row.img_size)
    try:
        trace = trace_step(build, shape, batch, config, device)
    except batchfit.ModelSpecError:
        # constructors that need real tensors (timm 1.0.9's ViTamin), as gpu_brackets
        # builds them: on the CPU
        build = functools.partial(gpu_brackets.build_timm_on_cpu, row.model, True)
        trace = trace_step(build, shape, batch, config, device)
    engine = engine_forward_peak(list(trace.steady_events))
    try:
        model = build_on_meta(build)
    except batchfit.ModelSpecError:  # a constructor that reads its tensors' values
        model = gpu_brackets.build_timm_on_cpu(row.model, True)
    model.eval()
    amp = {Precision.AMP_FP16: torch.float16, Precision.AMP_BF16: torch.bfloat16}
    cuda, uses_sdpa = fake_cuda_forward_peak(
        model, (batch, *shape), channels_last=config.channels_last,
        inference_mode=config.inference_mode, autocast_dtype=amp.get(config.precision))
    return {"engine_bytes": engine, "cuda_bytes": cuda,
            "ratio": engine / cuda if cuda else None, "uses_sdpa": uses_sdpa,
            "batch": batch}


def grad_mode(row: gpu_brackets.Row) -> str:
    """``inference_mode`` or ``no_grad``, as the row's run used."""
    return "inference_mode" if gpu_brackets.row_settings(row).get("inference_mode") else "no_grad"


def distinct_rows(rows: list[gpu_brackets.Row]) -> list[gpu_brackets.Row]:
    """One row per model, image size, timm release, layout and grad mode."""
    seen: set[tuple] = set()
    chosen = []
    for row in rows:
        key = (row.model, row.img_size, row.timm_release, row.layout, grad_mode(row))
        if key not in seen:
            seen.add(key)
            chosen.append(row)
    return chosen


def classify(result: dict[str, Any]) -> str:
    if "error" in result:
        return "error"
    if abs(result["ratio"] - 1.0) <= TOLERANCE:
        return "equal"
    return "attention kernel substituted" if result["uses_sdpa"] else "different"


def report(results: list[dict[str, Any]], tag: str) -> str:
    counts: dict[str, int] = {}
    for result in results:
        counts[classify(result)] = counts.get(classify(result), 0) + 1
    lines = [f"## gpu_brackets_dispatch: {tag}", "",
             f"{len(results)} models; " + ", ".join(f"{k}: {v}" for k, v in sorted(counts.items())),
             "", "| model | layout | grad mode | engine MiB | CUDA dispatch MiB | ratio | class |",
             "|---|---|---|---|---|---|---|"]
    for r in sorted(results, key=lambda r: (classify(r) == "equal", r["model"])):
        if "error" in r:
            lines.append(f"| {r['model']} | {r['layout']} | {r['grad_mode']} | | | | {r['error'][:80]} |")
            continue
        lines.append(f"| {r['model']} | {r['layout']} | {r['grad_mode']} | "
                     f"{r['engine_bytes'] / 2**20:,.1f} | {r['cuda_bytes'] / 2**20:,.1f} | "
                     f"{r['ratio']:.4f} | {classify(r)} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--models", help="models matching this regex only")
    parser.add_argument("--layout", choices=("nchw", "nhwc"))
    parser.add_argument("--tag", default="dev")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per model")
    args = parser.parse_args(argv)
    rows = [r for r in gpu_brackets.read_rows(["memory", "nonmemory"]) if r.set == "I"
            and (args.layout is None or r.layout == args.layout)
            and (args.models is None or re.search(args.models, r.model))]
    missing = gpu_brackets.missing_timm_releases(rows, gpu_brackets.TIMM_DIR)
    if missing:
        gpu_brackets.install_timm_releases(gpu_brackets.TIMM_DIR)
    path = gpu_brackets.RESULTS / f"dispatch_{args.tag}.jsonl"
    done = gpu_brackets.load_cache(path)
    results = list(done.values())
    for row in distinct_rows(rows):
        if row.key in done:
            continue
        result = gpu_brackets.run_in_child(
            row, args.timeout, timm_dir=gpu_brackets.TIMM_DIR,
            predict=lambda r: compare_row(r, args.batch))
        result.update(key=row.key, model=row.model, img_size=row.img_size,
                      layout=row.layout, timm=row.timm_release, grad_mode=grad_mode(row))
        results.append(result)
        with path.open("a") as handle:
            handle.write(json.dumps(result) + "\n")
        print(f"{row.model:40} {row.layout} {classify(result):30} "
              f"{result.get('ratio') or result.get('error', '')}", flush=True)
    text = report(results, args.tag)
    path.with_suffix(".md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
