"""batchfit against published LLM fine-tuning and serving figures, each with its full settings.

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
   the shortest did not fit. The cards are modelled as sm80 GPUs with that many GiB.
   The blog states the model, 4-bit QLoRA, rank 32 on all linear layers, batch 1 and padding
   to the length; the optimizer (8-bit AdamW) and the checkpointing mode are not stated and
   are taken from Unsloth's notebooks. The 70B rows are Llama 3.3 70B Instruct, whose
   architecture is Llama-3.1-70B's (the offline config used).
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

Usage: nice python benchmarks/llm_published.py [--only unsloth|octocoder|vllm]
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


def _qlora_config():
    from batchfit.engine.spec import TrainConfig

    return TrainConfig(lora="r=32,alpha=32,targets=all-linear", quant="nf4-dq",
                       precision="amp-bf16", checkpointing=True, use_reentrant=True,
                       optimizer="adamw8bit")


def unsloth() -> list[dict]:
    from batchfit.answers.maxbatch import max_seq_len
    from batchfit.device.profile import DeviceProfile
    from batchfit.errors import DoesNotFitError
    from batchfit.models.resolve import resolve_model

    rows = []
    for hub, points, context in (("meta-llama/Llama-3.1-8B", UNSLOTH_8B, 131072),
                                 ("meta-llama/Llama-3.1-70B", UNSLOTH_70B, 131072)):
        spec = resolve_model(f"hf:{hub}", seq_len=1024)
        for gib, published in points:
            card = DeviceProfile.cuda(gib * GiB, (8, 0), name=f"{gib} GiB sm80")
            start = time.perf_counter()
            try:
                result = max_seq_len(spec.factory, spec.input_spec, 1, _qlora_config(),
                                     device=card, max_len=context)
                predicted = result.max_seq_len
            except DoesNotFitError:
                predicted = None
            rows.append(_row("unsloth", f"{hub.split('/')[1]} QLoRA r32, {gib} GB",
                             "max context (fit)", published, predicted,
                             time.perf_counter() - start, "held-out"))
            print(json.dumps(rows[-1]), flush=True)
    return rows


def octocoder() -> list[dict]:
    from batchfit.answers.serve import serve_capacity
    from batchfit.device.profile import DeviceProfile
    from batchfit.engine.workloads.spec import QuantSpec

    a100 = DeviceProfile.cuda(40 * GiB, (8, 0), name="A100 40GB")
    model = f"hf:{HERE / 'data' / 'octocoder'}"
    rows = []
    for label, dtype, quant, published in (
            ("bf16", "bf16", None, 29.0260648727417),
            ("load_in_8bit", "fp16", QuantSpec("int8"), 15.219234466552734),
            ("load_in_4bit (fp4, fp32 compute)", "fp16",
             QuantSpec("fp4", compute_dtype="float32"), 9.543574333190918)):
        start = time.perf_counter()
        result = serve_capacity(model, device=a100, engine="hf", batch_size=1, prompt_len=20,
                                new_tokens=60, dtype=dtype, quant=quant)
        allocated = max(result.hf["prefill_allocated_bytes"], result.hf["decode_peak_bytes"])
        rows.append(_row("octocoder", f"octocoder generate, {label}", "allocated GiB",
                         published, allocated / GiB, time.perf_counter() - start, "held-out"))
    return rows


def vllm() -> list[dict]:
    from batchfit.answers.serve import serve_capacity

    rows = []
    for length, published in ((20000, 1952), (29000, 1478)):
        start = time.perf_counter()
        r = serve_capacity("hf:meta-llama/Llama-3.1-8B", device="RTX 3090",
                           max_model_len=length, max_num_batched_tokens=length,
                           total_memory_bytes=int(23.58 * GiB), non_torch_bytes=int(0.35 * GiB))
        rows.append(_row("vllm", f"Llama-3.1-8B, RTX 3090, max_model_len {length}",
                         "# GPU blocks", published, r.plan.num_blocks,
                         time.perf_counter() - start, "dev"))
    start = time.perf_counter()
    r = serve_capacity("hf:meta-llama/Llama-2-7b-hf", device="A100 80GB", max_model_len=4096,
                       max_num_batched_tokens=4096, total_memory_bytes=int(79.15 * GiB),
                       non_torch_bytes=0)
    rows.append(_row("vllm", "Llama-2-7B, A100-80GB, vLLM 0.2", "# GPU blocks", 7449,
                     r.plan.num_blocks, time.perf_counter() - start, "held-out"))
    start = time.perf_counter()
    r = serve_capacity("hf:meta-llama/Meta-Llama-3-8B", device="H100", max_model_len=8192,
                       max_num_batched_tokens=8192, total_memory_bytes=int(79.22 * GiB),
                       non_torch_bytes=int(1.79 * GiB))
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", choices=("unsloth", "octocoder", "vllm"))
    args = parser.parse_args()
    rows: list[dict] = []
    for name, run in (("octocoder", octocoder), ("vllm", vllm), ("unsloth", unsloth)):
        if args.only in (None, name):
            rows += run()
            print(json.dumps(rows[-1]), flush=True)
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / ("llm_published.json" if args.only is None
                      else f"llm_published_{args.only}.json")
    path.write_text(json.dumps(rows, indent=2) + "\n")
    lines = ["| source | case | metric | published | predicted | error | split |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        error = "n/a" if r["error_pct"] is None else f"{r['error_pct']:+.1f}%"
        lines.append(f"| {r['source']} | {r['case']} | {r['metric']} | "
                     f"{r['published'] if r['published'] is not None else 'OOM'} | "
                     f"{r['predicted'] if r['predicted'] is not None else 'nothing fits'} | "
                     f"{error} | {r['split']} |")
    path.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
