"""Predict the published bert-large V100 memory figures, asked as a user would ask.

How it asks batchfit: the ``batchfit estimate`` command line with the source's words
(``--gpu``, ``--stack``, ``--precision``, ``--checkpointing``).

Hugging Face's "model training anatomy" / "efficient training on one GPU" docs:
bert-large-uncased (sequence classification), seq 512, AdamW, fp32, on a 16 GB
V100, measured by nvidia-smi (which includes the 1,343 MB CUDA context they also
measured):

    batch 4: 14,949 MB   batch 1: 8,681 MB   batch 1 + checkpointing: 6,775 MB
    batch 4 + fp16 AMP: 13,939 MB

Each figure is asked of the ``batchfit estimate`` command line with the user's words
only: the model spec, the card's catalog name and the stack the source ran (eager
attention, since the docs predate SDPA). Nothing is set by hand: the stack decides
the optimizer's implementation, whether ``zero_grad()`` frees gradients, the CUDA
context and which tensors autograd keeps.

Which stack. The docs name no torch version. Their eager 1,343 MB context means CUDA
before 11.7 (no lazy module loading), which torch 1.10, 1.11 and 1.12 all shipped
with (cu113). They differ in one thing this step touches: torch 1.10's autograd keeps
softmax's input for backward (its generated ``SoftmaxBackward0`` holds ``self_``;
1.11's holds only ``result_``: pytorch/pytorch#65242), one fp32 tensor of attention
scores per layer. Asked with ``torch1.10+cu113`` the fp32 batch-4 step needs more than
the V100's memory, yet the published run fitted at 14,949 MB; so the figures are scored
with ``torch1.11+cu113``, and the torch 1.10 answers are written beside them (the
results file shows which figure each stack matches better: the AMP one is closer under
torch 1.10, a disagreement only a run on a card can settle).

Usage: python benchmarks/published_gpu_points.py
Writes benchmarks/results/published_gpu_points.md and .json.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
MODEL = "hf:bert-large-uncased"
GPU = "V100 SXM2 16GB"
STACK = "torch1.11+cu113"  # the stack the figures are scored with (module docstring)
OTHER_STACK = "torch1.10+cu113"
CASES = [
    # (label, batch, precision, checkpointing, published MiB)
    ("batch 4, fp32", 4, "fp32", False, 14_949),
    ("batch 1, fp32", 1, "fp32", False, 8_681),
    ("batch 1, fp32, checkpointing", 1, "fp32", True, 6_775),
    ("batch 4, amp-fp16", 4, "amp-fp16", False, 13_939),
]
MIB = 1 << 20  # nvidia-smi reports MiB; the docs copy those numbers as "MB"


def command(batch: int, precision: str, checkpointing: bool, stack: str) -> list[str]:
    """The ``batchfit estimate`` invocation a user would type for one figure."""
    words = ["estimate", MODEL, "--model-kwargs", "task=sequence-classification",
             "--attn", "eager", "-b", str(batch), "--seq-len", "512",
             "--optimizer", "adamw", "--precision", precision,
             "--gpu", GPU, "--stack", stack, "--json"]
    if checkpointing:
        words.append("--checkpointing")
    return words


def ask(words: list[str]) -> dict:
    """Run the command line in a fresh interpreter, as the user's shell would."""
    code = "import sys; from batchfit.cli import main; sys.argv = ['batchfit', *sys.argv[1:]]; main()"
    done = subprocess.run([sys.executable, "-c", code, *words], capture_output=True, text=True,
                          check=True)
    return json.loads(done.stdout)


def main() -> None:
    rows = []
    for label, batch, precision, ckpt, published in CASES:
        row = {"case": label, "published_mib": published,
               "command": "batchfit " + " ".join(command(batch, precision, ckpt, STACK))}
        for key, stack in (("", STACK), ("torch_1_10_", OTHER_STACK)):
            est = ask(command(batch, precision, ckpt, stack))
            predicted = est["total_bytes"] / MIB
            row[f"{key}predicted_mib"] = round(predicted)
            row[f"{key}error_pct"] = round(100 * (predicted - published) / published, 2)
            row[f"{key}fits"] = est["total_bytes"] <= est["device"]["total_memory_bytes"]
        rows.append(row)
        print(f"{label}: {row['predicted_mib']:,} MiB ({row['error_pct']:+.1f}%)", flush=True)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "published_gpu_points.json").write_text(json.dumps(rows, indent=2) + "\n")
    lines = [f"`batchfit estimate {MODEL} ... --gpu \"{GPU}\" --stack STACK` "
             "(commands in the JSON file)", "",
             f"| case | published (MiB) | {STACK} (MiB) | error | {OTHER_STACK} (MiB) | error |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['case']} | {r['published_mib']:,} | {r['predicted_mib']:,} | "
              f"{r['error_pct']:+.1f}% | {r['torch_1_10_predicted_mib']:,}"
              f"{'' if r['torch_1_10_fits'] else ' (does not fit)'} | "
              f"{r['torch_1_10_error_pct']:+.1f}% |" for r in rows]
    (RESULTS / "published_gpu_points.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
