"""batchfit against published LLM fine-tuning and serving figures, each with its full settings.

How it asks batchfit: ``batchfit.max_seq_len("hf:...", 1, gpu="A100 80GB", memory="12GiB",
lora=..., quant="nf4-dq", ...)`` and ``batchfit.estimate`` for the Unsloth rows;
``batchfit.serve("hf:...", gpu="A100 40GB", engine="hf", ...)`` (``batchfit serve``'s
words) for the octocoder and vLLM rows.

Every figure names the metric it reports. Nothing in batchfit was fitted to these numbers,
with one exception stated where it applies: the vLLM profile-run rule (transformers keeps the
embedding output alive, vLLM does not) was found on the RTX 3090 log (set "dev"); the other
sets are held out.

1. Unsloth, "Llama 3.3 ... 13x longer context" (https://unsloth.ai/blog/llama3-3, Dec 2024):
   the longest context that fits, "Hugging Face + FA2" column. QLoRA (bitsandbytes NF4 with
   double quantization, as Unsloth's pre-quantized checkpoints), LoRA rank 32 on q, k, v, o,
   gate, up, down; batch 1, sequences padded to the length; bf16; HF gradient checkpointing;
   flash-attention 2; AdamW 8-bit (Unsloth's ``optim="adamw_8bit"``); TRL, which calls peft's
   ``prepare_model_for_kbit_training`` (fp32 embeddings and head) with reentrant
   checkpointing. Metric: maximum context (a fit boundary) per "GPU VRAM"; "OOM" means even
   the shortest did not fit. The blog names sizes, not cards: each is asked as a user
   would, the nearest catalog card of that architecture with the size as its memory
   (``--gpu "A100 80GB" --memory 12GiB``).
   The blog states the model, 4-bit QLoRA, rank 32 on all linear layers, batch 1 and padding
   to the length; the optimizer (8-bit AdamW) and the checkpointing mode are not stated and
   are taken from Unsloth's notebooks. The 70B rows are Llama 3.3 70B Instruct, whose
   architecture is Llama-3.1-70B's (the offline config used).
   The blog does not name its transformers version either; by its date (Dec 2024, after Llama
   3.3's release) it is 4.46 or 4.47, whose causal-LM loss copies the float32 logits
   (batchfit.engine.workloads.hfloss): ``--unsloth-transformers 4.47`` (the default here)
   scores it with that loss, ``installed`` with the installed transformers' loss (at batch 1
   they give the same contexts: the shifted slice is already contiguous). Each card is
   its own ``max_seq_len`` call, as a user asks it (no trace is shared between cards).
   How the table was made: both 8B columns are straight lines in the card's nominal GB
   (``published_line``: HF+FA2 404.73 tokens per GB, zero tokens at 9.70 GB; no figure
   more than 0.4 token off the line over 12-80 GB, nor the Unsloth column's over 8-80 GB),
   as the same authors' previous table (unsloth.ai/blog/long-context, Apr 2024, the same
   eight cards) says of itself: "our maximum context calculation ... Numbers are
   extrapolated based on experiments". Measured maxima would carry the allocator's
   granularity (batchfit's own stray up to ~80 tokens from a line), and a 40 GB A100 and a
   48 GB card would follow the cards' CUDA totals, not the nominal 8 GB between them. So
   each figure is the blog's line evaluated at the card, and the 70B rows were "tested on
   a 80GB A100". Each fitting row is also read as memory: batchfit's device memory for
   the published context (the figure says it needs at most the card's GB), and the
   results' ``_line`` file reads batchfit's own curve the table's way (a line through two
   long contexts, evaluated at each card).
2. Hugging Face, "Optimizing LLMs for Speed and Memory" (transformers docs,
   llm_tutorial_optimization.md): bigcode/octocoder on an A100 40GB, ``pipeline`` with a
   20-token prompt and ``max_new_tokens=60``, batch 1, ``torch.cuda.max_memory_allocated()``:
   bf16; ``load_in_8bit=True`` (LLM.int8, fp16 elsewhere); ``load_in_4bit=True`` (FP4 without
   double quantization, bitsandbytes' default fp32 compute). Metric: allocated.
3. vLLM logs (engine-printed KV blocks, block size 16, gpu_memory_utilization 0.9):
   a. vllm-project/vllm#10517 (vLLM ~0.6.4, V0): Llama-3.1-8B-Instruct on an RTX 3090 whose
      CUDA total is 23.58 GiB, max_model_len 20,000 and 29,000 (chunked prefill off below
      32k: the profile forward is max_model_len tokens over 256 sequences), non-torch memory
      0.35 GiB as printed: "# GPU blocks: 1952" and "1478". Set "dev".
   b. vllm-project/vllm#2031 (vLLM 0.2.x): Llama-2-7B, one A100-80GB (CUDA total 79.15 GiB),
      benchmark_throughput defaults (profile of max(max_model_len, 2048) = 4,096 tokens over
      256 sequences), peak from torch's allocator only (non-torch 0), "Current main:
      # GPU blocks: 7449".
   c. vllm-project/vllm#10511 (vLLM 0.6.5 development, V0, the memory-profiling overhaul;
      youkaichao's sanity check, 2024-12-14): ``vllm serve meta-llama/Meta-Llama-3-8B`` with
      the defaults (gpu_memory_utilization 0.9, max_model_len 8,192, so chunked prefill off
      and the profile forward is 8,192 tokens over 256 sequences) on an H100 whose CUDA
      total is 79.22 GiB; printed: "model weights take 14.96GiB", "non_torch_memory
      1.79GiB" (taken as given), "PyTorch activation peak memory 1.26GiB" (torch's peak
      allocated during the profile run minus the weights), "available_kv_cache_memory
      53.29GiB". Held out.
   a. and c. are vLLM 0.6 (V0): ``vllm_engine="v0"``, whose profile run samples with top-p/top-k
   (a sort of 256 rows of logits; it binds for c. only). b. (vLLM 0.2) keeps the default: its
   sampler code differs, and at 4,096 tokens the forward binds either way.

Usage: nice python benchmarks/llm_published.py [--only unsloth|octocoder|vllm]
       nice python benchmarks/llm_published.py --only unsloth --cards 12,40,80  (a subset)
       nice python benchmarks/llm_published.py --curve 932,1152,2048  (the 8B's memory curve)
Writes benchmarks/results/llm_published.json and .md.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

GiB = 1 << 30
HERE = Path(__file__).parent
RESULTS = HERE / "results"

UNSLOTH_8B = [(8, None), (12, 932), (16, 2551), (24, 5789), (40, 12264), (48, 15502),
              (80, 28454)]
UNSLOTH_70B = [(48, None), (80, 6916)]
# The same table's "Unsloth" column (its own gradient checkpointing and Apple's CCE): not
# scored (batchfit does not model Unsloth's kernels), read only for how the table was made.
UNSLOTH_8B_OWN_COLUMN = [(8, 2972), (12, 21848), (16, 40724), (24, 78475), (40, 153977),
                         (48, 191728), (80, 342733)]
# The same authors' Apr 2024 table (unsloth.ai/blog/long-context: Mistral 7b, QLoRA, rank 32,
# adamw_8bit, batch 1, on the RTX 4060/4070/4080/4090, A100 40GB, A6000 and H100), which
# says of itself "Numbers are extrapolated based on experiments": the yardstick of a
# computed column. Not scored (Mistral 7b v0.2 settings not in full).
APRIL_2024_COLUMNS = {
    "Hugging Face+FA2": [(8, 1696), (12, 4797), (16, 7898), (24, 14099), (40, 26502),
                         (48, 32704), (80, 57510)],
    "Unsloth (Old)": [(8, 3716), (12, 11055), (16, 18394), (24, 33073), (40, 62431),
                      (48, 77110), (80, 135826)],
    "Unsloth (New)": [(8, 7340), (12, 19610), (16, 31880), (24, 56420), (40, 105500),
                      (48, 130040), (80, 228199)]}
# Contexts at which batchfit's own curve is read the way the table reads (a line through
# two points, evaluated at every card): long contexts, where such experiments sit.
LINE_ANCHORS = ((4096, 28672), (8192, 28672), (12288, 28672))


def published_line(points: list[tuple[int, int]]) -> dict:
    """The least-squares line through a published column (card GB -> tokens).

    A measured maximum context carries the caching allocator's granularity (batchfit's own
    predictions stray up to ~80 tokens from a line across these cards); a column computed
    from a line (context = slope x (GB - GB at zero tokens), rounded) strays by a token.

    >>> line = published_line([p for p in UNSLOTH_8B if p[1] is not None])
    >>> round(line["tokens_per_gb"], 1), round(line["gb_at_zero_tokens"], 2), line["max_residual_tokens"]
    (404.7, 9.7, 0.4)
    """
    xs, ys = [g for g, _ in points], [t for _, t in points]
    n, mx, my = len(xs), sum(xs) / len(xs), sum(ys) / len(ys)
    slope = (sum((x - mx) * (y - my) for x, y in zip(xs, ys))
             / sum((x - mx) ** 2 for x in xs))
    intercept = my - slope * mx
    residual = max(abs(y - (intercept + slope * x)) for x, y in zip(xs, ys))
    return {"points": n, "tokens_per_gb": slope, "gb_at_zero_tokens": -intercept / slope,
            "max_residual_tokens": round(residual, 1)}


# The Unsloth step in the user's words: ``batchfit max hf:meta-llama/Llama-3.1-8B --batch-size 1
# --gpu "A100 80GB" --memory 12GiB --lora r=32,alpha=32,targets=all-linear --quant nf4-dq
# --precision amp-bf16 --checkpointing --use-reentrant --optimizer adamw8bit
# --transformers-version 4.47``.
QLORA_WORDS = {"lora": "r=32,alpha=32,targets=all-linear", "quant": "nf4-dq",
               "precision": "amp-bf16", "checkpointing": True, "use_reentrant": True,
               "optimizer": "adamw8bit"}
# The blog names card sizes, not cards; the nearest catalog card of the architecture the
# rows were modelled on (sm80), with the size as its memory (``--memory``).
UNSLOTH_CARD = "A100 80GB"


def _qlora_words(gib: int, transformers_version: str | None) -> dict:
    return {**QLORA_WORDS, "gpu": UNSLOTH_CARD, "memory": f"{gib}GiB",
            "transformers_version": transformers_version}


def unsloth(transformers_version: str | None = "4.47", analysis: dict | None = None,
            cards: set[int] | None = None) -> list[dict]:
    """Each row as ``batchfit max --batch-size 1`` answers it for that card (``cards``: only
    those GB, a subset of the table); its memory reading as ``batchfit estimate`` does."""
    import batchfit

    label = transformers_version or "installed"
    rows = []
    for hub, points in (("meta-llama/Llama-3.1-8B", UNSLOTH_8B),
                        ("meta-llama/Llama-3.1-70B", UNSLOTH_70B)):
        model = f"hf:{hub}"
        for gib, published in points:
            if cards is not None and gib not in cards:
                continue
            words = _qlora_words(gib, transformers_version)
            start = time.perf_counter()
            try:
                predicted = batchfit.max_seq_len(model, 1, **words).max_seq_len
            except batchfit.DoesNotFitError:  # nothing fits
                predicted = None
            row = _row("unsloth", f"{hub.split('/')[1]} QLoRA r32, {gib} GB, "
                       f"transformers {label}", "max context (fit)", published, predicted,
                       time.perf_counter() - start, "held-out")
            if published is not None:  # the same figure read as memory: the published
                # context needs at most the card's GB; batchfit's device memory for it:
                answer = batchfit.estimate(model, 1, seq_len=published, **words)
                memory = answer.total_bytes / GiB
                row["device_gib_at_published"] = round(memory, 3)
                row["memory_error_pct"] = round(100 * (memory - gib) / gib, 2)
            rows.append(row)
            print(json.dumps(rows[-1]), flush=True)
        if analysis is not None and hub.endswith("8B"):
            analysis.update(_line_reading(transformers_version, points))
    return rows


def _line_reading(transformers_version: str | None, points) -> dict:
    """How the table was made, and batchfit's curve read the same way.

    The columns are straight lines in the card's nominal GB (``published_line``); batchfit's
    device memory is not (its modelled allocator slack grows faster from about 2,000 tokens,
    where the float32 logits outgrow the cached blocks). A line through two long contexts
    of batchfit's own curve, evaluated at each card, is what the table's method makes of it.
    """
    fitting = [(g, t) for g, t in points if t is not None]
    lengths = sorted({s for pair in LINE_ANCHORS for s in pair})
    curve = {p["tokens"]: p["device_gib"] for p in unsloth_curve(lengths, transformers_version)}
    readings = []
    for low, high in LINE_ANCHORS:
        slope = (curve[high] - curve[low]) / (high - low)  # GiB per token
        at_zero = curve[low] - slope * low
        readings.append({"anchors": [low, high], "gib_at_zero_tokens": round(at_zero, 3),
                         "mb_per_token": round(slope * GiB / 1e6, 4),
                         "contexts": {str(g): int((g - at_zero) / slope) for g, _ in fitting}})
    return {"published_hf_fa2_line": published_line(fitting),
            "published_unsloth_column_line": published_line(UNSLOTH_8B_OWN_COLUMN),
            "april_2024_extrapolated_lines": {name: published_line(column) for name, column
                                              in APRIL_2024_COLUMNS.items()},
            "batchfit_device_gib": {str(s): round(m, 3) for s, m in curve.items()},
            "batchfit_read_as_a_line": readings}


def unsloth_curve(lengths: list[int], transformers_version: str | None = "4.47") -> list[dict]:
    """batchfit's device memory for the Unsloth 8B step at ``lengths`` tokens on the 80 GB
    card (``batchfit estimate --seq-len N``, one trace each), with the allocated peak and the
    allocator's slack: the curve the table's line is read against (``--curve``)."""
    import batchfit

    words = _qlora_words(80, transformers_version)
    points = []
    for length in lengths:
        est = batchfit.estimate("hf:meta-llama/Llama-3.1-8B", 1, seq_len=length, **words)
        points.append({"tokens": length,
                       "device_gib": round(est.total_bytes / GiB, 3),
                       "allocated_gib": round(est.peak_allocated_bytes / GiB, 3),
                       "slack_gib": round(est.by_category.get(
                           batchfit.Category.ALLOCATOR_SLACK, 0) / GiB, 3),  # reserved but
                       # not allocated, at the peak
                       "peak_phase": str(est.peak_phase)})
        print(json.dumps(points[-1]), flush=True)
    return points


def octocoder() -> list[dict]:
    """Asked as ``batchfit serve hf:DIR --gpu "A100 40GB" --engine hf ...`` asks it: the card
    by its catalog name; the fp4 row's fp32 compute dtype (bitsandbytes' default) is
    ``quant="fp4,compute=fp32"`` (``--quant fp4,compute=fp32``)."""
    import batchfit

    model = f"hf:{HERE / 'data' / 'octocoder'}"
    rows = []
    for label, dtype, quant, published in (
            ("bf16", "bf16", None, 29.0260648727417),
            ("load_in_8bit", "fp16", "int8", 15.219234466552734),
            ("load_in_4bit (fp4, fp32 compute)", "fp16", "fp4,compute=fp32",
             9.543574333190918)):
        start = time.perf_counter()
        words = {"quant": quant} if quant else {}
        result = batchfit.serve(model, gpu="A100 40GB", engine="hf", batch_size=1,
                                prompt_len=20, new_tokens=60, dtype=dtype, **words)
        allocated = max(result.hf["prefill_allocated_bytes"], result.hf["decode_peak_bytes"])
        rows.append(_row("octocoder", f"octocoder generate, {label}", "allocated GiB",
                         published, allocated / GiB, time.perf_counter() - start, "held-out"))
    return rows


def vllm() -> list[dict]:
    """Asked as ``batchfit serve hf:NAME --gpu ... --max-model-len ... --total-memory ...
    --non-torch ...`` asks it; each log's CUDA total and non-torch memory as the log prints
    them (GiB)."""
    import batchfit

    rows = []
    for length, published in ((20000, 1952), (29000, 1478)):
        start = time.perf_counter()
        r = batchfit.serve("hf:meta-llama/Llama-3.1-8B", gpu="RTX 3090",
                           max_model_len=length, max_num_batched_tokens=length,
                           total_memory="23.58GiB", non_torch="0.35GiB", vllm_engine="v0")
        rows.append(_row("vllm", f"Llama-3.1-8B, RTX 3090, max_model_len {length}",
                         "# GPU blocks", published, r.plan.num_blocks,
                         time.perf_counter() - start, "dev"))
    start = time.perf_counter()
    r = batchfit.serve("hf:meta-llama/Llama-2-7b-hf", gpu="A100 80GB", max_model_len=4096,
                       max_num_batched_tokens=4096, total_memory="79.15GiB", non_torch="0")
    rows.append(_row("vllm", "Llama-2-7B, A100-80GB, vLLM 0.2", "# GPU blocks", 7449,
                     r.plan.num_blocks, time.perf_counter() - start, "held-out"))
    start = time.perf_counter()
    r = batchfit.serve("hf:meta-llama/Meta-Llama-3-8B", gpu="H100", max_model_len=8192,
                       max_num_batched_tokens=8192, total_memory="79.22GiB",
                       non_torch="1.79GiB", vllm_engine="v0")
    seconds = time.perf_counter() - start
    case = "Meta-Llama-3-8B, H100, vLLM 0.6.5 (#10511)"
    for metric, published, predicted in (
            ("model weights GiB (allocated)", 14.96, r.weights_bytes / GiB),
            ("activation peak GiB (allocated)", 1.26, r.activation_peak_bytes / GiB),
            ("available KV cache GiB", 53.29, r.kv_cache_bytes / GiB)):
        rows.append(_row("vllm", case, metric, published, predicted, seconds, "held-out"))
    return rows


def _row(source: str, case: str, metric: str, published, predicted, seconds: float,
         split: str) -> dict:
    if published is None or predicted is None:
        error = None
        agrees = published is None and (predicted is None or predicted < 256)
    else:
        error = round(100 * (predicted - published) / published, 2)
        agrees = abs(error) <= 10
    return {"source": source, "case": case, "metric": metric, "published": published,
            "predicted": round(predicted, 3) if isinstance(predicted, float) else predicted,
            "error_pct": error, "within_10pct": agrees, "split": split,
            "seconds": round(seconds, 1)}


def _summary(rows: list[dict]) -> list[str]:
    """How many figures agree (within 10%, or an OOM matched), all and held-out."""
    lines = []
    for label, subset in (("all", rows), ("held-out", [r for r in rows
                                                       if r["split"] == "held-out"])):
        agree = sum(1 for r in subset if r["within_10pct"])
        lines.append(f"- {label}: {agree} of {len(subset)} within 10% or matching the "
                     f"published fit/OOM")
    return lines


def _analysis_lines(analysis: dict) -> list[str]:
    line, own = analysis["published_hf_fa2_line"], analysis["published_unsloth_column_line"]
    out = ["", "## How the Unsloth 8B table was made", "",
           f"- HF+FA2 column: {line['tokens_per_gb']:.3f} tokens per GB, zero tokens at "
           f"{line['gb_at_zero_tokens']:.3f} GB; largest distance of a published figure from "
           f"the line: {line['max_residual_tokens']} tokens over {line['points']} cards",
           f"- Unsloth column: {own['tokens_per_gb']:.3f} tokens per GB, zero at "
           f"{own['gb_at_zero_tokens']:.3f} GB; largest distance {own['max_residual_tokens']} "
           f"tokens over {own['points']} cards",
           "- the Apr 2024 table that says it is extrapolated, largest distances from "
           "its lines: " + ", ".join(f"{name} {line['max_residual_tokens']} tokens"
                                     for name, line in
                                     analysis["april_2024_extrapolated_lines"].items()),
           "- batchfit's device memory (GiB) at: " + ", ".join(
               f"{s} tokens {m}" for s, m in analysis["batchfit_device_gib"].items()), "",
           "batchfit's curve read as a line through two of its points (the table's method):",
           "", "| anchors (tokens) | GiB at 0 tokens | MB per token | contexts per card GB |",
           "|---|---|---|---|"]
    for r in analysis["batchfit_read_as_a_line"]:
        out.append(f"| {r['anchors'][0]:,} and {r['anchors'][1]:,} | {r['gib_at_zero_tokens']} "
                   f"| {r['mb_per_token']} | " + ", ".join(
                       f"{g}: {t:,}" for g, t in r["contexts"].items()) + " |")
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", choices=("unsloth", "octocoder", "vllm"))
    parser.add_argument("--unsloth-transformers", default="4.47",
                        help="the transformers version whose loss the Unsloth rows use, or "
                             "'installed'")
    parser.add_argument("--cards", help="comma-separated card GB: only those Unsloth rows, "
                        "without the line reading (results/llm_published_unsloth_*_cards.json)")
    parser.add_argument("--curve", help="comma-separated contexts: only batchfit's device "
                        "memory for the Unsloth 8B step at each (results/"
                        "llm_published_unsloth_curve.json)")
    args = parser.parse_args()
    version = None if args.unsloth_transformers == "installed" else args.unsloth_transformers
    if args.curve:
        points = unsloth_curve([int(x) for x in args.curve.split(",")], version)
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "llm_published_unsloth_curve.json").write_text(
            json.dumps(points, indent=2) + "\n")
        return
    rows: list[dict] = []
    analysis: dict = {}
    cards = {int(x) for x in args.cards.split(",")} if args.cards else None
    for name, run in (("octocoder", octocoder), ("vllm", vllm),
                      ("unsloth", lambda: unsloth(version, None if cards else analysis,
                                                  cards))):
        if args.only in (None, name):
            rows += run()
            print(json.dumps(rows[-1]), flush=True)
    RESULTS.mkdir(exist_ok=True)
    only = args.only if args.only != "unsloth" else f"unsloth_{args.unsloth_transformers}"
    if cards is not None:
        only += "_cards"
    path = RESULTS / ("llm_published.json" if args.only is None
                      else f"llm_published_{only}.json")
    write_results(path, rows, analysis)


def write_results(path: Path, rows: list[dict], analysis: dict) -> None:
    """The rows as JSON and markdown; the Unsloth analysis, if any, as ``*_line.json``."""
    path.write_text(json.dumps(rows, indent=2) + "\n")
    memory_column = any("device_gib_at_published" in r for r in rows)
    lines = ["| source | case | metric | published | predicted | error | split |"
             + (" device GiB at the published context |" if memory_column else ""),
             "|---|---|---|---|---|---|---|" + ("---|" if memory_column else "")]
    for r in rows:
        error = "n/a" if r["error_pct"] is None else f"{r['error_pct']:+.1f}%"
        memory = ("" if "device_gib_at_published" not in r else
                  f"{r['device_gib_at_published']:.2f} ({r['memory_error_pct']:+.1f}%)")
        lines.append(f"| {r['source']} | {r['case']} | {r['metric']} | "
                     f"{r['published'] if r['published'] is not None else 'OOM'} | "
                     f"{r['predicted'] if r['predicted'] is not None else 'nothing fits'} | "
                     f"{error} | {r['split']} |" + (f" {memory} |" if memory_column else ""))
    lines += ["", "Agreement:", *_summary(rows)]
    if analysis:
        path.with_name(path.stem + "_line.json").write_text(json.dumps(analysis, indent=2)
                                                            + "\n")
        lines += _analysis_lines(analysis)
    path.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
