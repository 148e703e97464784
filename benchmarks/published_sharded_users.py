"""Predict published per-GPU memory of multi-GPU training, asked as a user asks it (issue 40).

How it asks batchfit: ``batchfit.estimate("published_sharded_users.py:lightning_demo", 1,
gpu="A100 40GB", world_size=2, strategy="fsdp1", wrap="TransformerEncoderLayer,
TransformerDecoderLayer", offload=..., optimizer="adam", zero_grad="after-forward")``: the
guide's model as a user file (this one), the card by its catalog name and the guide's
settings as options.

The rows of ``published_sharded_points.py`` (see its docstring for the sources and for why
each setting is what it is) that the options express:

* Lightning Trainer's FSDP guide (held out there): DDP, FULL_SHARD and FULL_SHARD with
  ``cpu_offload=True`` (FSDP1 ``CPUOffload``), torch >= 2.1's Adam, the Trainer's loop order
  (``zero_grad`` between the loss and ``backward``: ``zero_grad="after-forward"``).
* Lightning Fabric's FSDP guide, FULL_SHARD with ``cpu_offload=True``: the optimizer steps on
  the host, so the guide's torch 2.0 Adam does not set the peak and the installed torch's
  Adam (``optimizer="adam"``) asks the same step.

Left in ``published_sharded_points.py`` (a harness: settings no option expresses): the other
Fabric rows (torch 2.0's foreach Adam, restated), SHARD_GRAD_OP (FSDP1 with
``reshard_after_forward=False``; ``strategy="fsdp-grad-op"`` is FSDP2's) and torchtitan's
Llama rows (its per-op selective checkpointing policy).

The figure is the peak allocated in ``torch.cuda.memory_summary()`` of one rank (the guides'
"MB" are MiB); the prediction is the binding rank's ``peak_allocated_bytes``.

Usage: nice python benchmarks/published_sharded_users.py
Writes benchmarks/results/published_sharded_users.{json,md}.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
MIB = 1 << 20
SEQ = 35  # WikiText2's default block size in lightning.pytorch.demos
VOCAB = 33278
WRAP = "TransformerEncoderLayer,TransformerDecoderLayer"
SOURCES = {
    "fabric": "Lightning Fabric FSDP guide (Lightning 2.1, PyTorch 2.1, 2x A100 40GB)",
    "trainer": "Lightning Trainer FSDP guide (Lightning 2.1, PyTorch 2.1, 2x A100 40GB)",
}
# (group, label, the options beyond the common ones, published MiB)
ROWS = [
    ("fabric", "FULL_SHARD + cpu_offload (FSDP1 CPUOffload)",
     {"strategy": "fsdp1", "wrap": WRAP, "offload": "params"}, 2_825),
    ("trainer", "DDP", {"strategy": "ddp", "zero_grad": "after-forward"}, 23_125),
    ("trainer", "FULL_SHARD (FSDP1)",
     {"strategy": "fsdp1", "wrap": WRAP, "zero_grad": "after-forward"}, 9_627),
    ("trainer", "FULL_SHARD + cpu_offload (FSDP1 CPUOffload)",
     {"strategy": "fsdp1", "wrap": WRAP, "offload": "params", "zero_grad": "after-forward"},
     2_790),
]


def lightning_transformer():
    """Lightning's demo Transformer, its forward with ``tgt_is_causal=True``: torch detects
    that its mask is causal by comparing values (``torch.equal``), which a fake trace cannot
    do; the mask is causal, so the hint leaves the computation as it was."""
    import torch.nn.functional as F
    from lightning.pytorch.demos import Transformer

    class CausalHinted(Transformer):
        def forward(self, inputs, target, mask=None):
            _, t = inputs.shape
            if mask is None:
                mask = self.generate_square_subsequent_mask(t).to(inputs.device)
            src = self.pos_encoder(self.embedding(inputs) * math.sqrt(self.ninp))
            target = self.pos_encoder(self.embedding(target) * math.sqrt(self.ninp))
            output = self.transformer(src, target, tgt_mask=mask, tgt_is_causal=True)
            output = F.log_softmax(self.decoder(output), dim=-1)
            return output.view(-1, self.vocab_size)

    return CausalHinted(vocab_size=VOCAB, nlayers=32, nhid=4096, ninp=1024, nhead=64)


def nll_loss(output, batch):
    """The guide's ``F.nll_loss`` against the target sequence (the second input)."""
    import torch.nn.functional as F

    args, _ = batch  # (positional inputs, keyword inputs)
    return F.nll_loss(output, args[1].view(-1))


def lightning_demo():
    """The user file's factory: the model, one WikiText2 sample (input and target) and the
    loss, as the guide's example trains it."""
    from batchfit import TensorSpec

    tokens = TensorSpec((SEQ,), "int64", high=VOCAB)
    return lightning_transformer(), (tokens, tokens), nll_loss


def rows() -> list[dict]:
    import batchfit

    spec = f"{Path(__file__).resolve()}:lightning_demo"
    out = []
    for group, label, options, published in ROWS:
        start = time.perf_counter()
        answer = batchfit.estimate(spec, 1, gpu="A100 40GB", world_size=2, optimizer="adam",
                                   **options)
        predicted = answer.binding.peak_allocated_bytes / MIB
        out.append({"group": "held-out" if group == "trainer" else "first",
                    "source": SOURCES[group], "case": label, "options": options,
                    "reports": "allocated", "unit": "MiB", "published": published,
                    "predicted": round(predicted),
                    "error_pct": round(100 * (predicted - published) / published, 2),
                    "seconds": round(time.perf_counter() - start, 1)})
        print(json.dumps(out[-1]), flush=True)
    return out


def main() -> None:
    results = rows()
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "published_sharded_users.json").write_text(json.dumps(results, indent=2) + "\n")
    lines = ["| group | source | case | options | published | predicted | error |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        words = ", ".join(f"{k}={v}" for k, v in r["options"].items())
        lines.append(f"| {r['group']} | {r['source']} | {r['case']} | {words} | "
                     f"{r['published']:,} MiB | {r['predicted']:,} | {r['error_pct']:+.1f}% |")
    for group in ("first", "held-out"):
        errs = [abs(r["error_pct"]) for r in results if r["group"] == group]
        if errs:
            within = sum(e <= 10 for e in errs)
            lines.append(f"\n{group}: {within}/{len(errs)} within 10%, worst |error| "
                         f"{max(errs):.1f}%")
    (RESULTS / "published_sharded_users.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
