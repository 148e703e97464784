"""Reference answers for ``plan``'s equality test (tests/speed/test_plan_reuse.py).

Each case is one plan of a small model over several layouts, as JSON (``PlanResult.to_dict``),
recorded by the code *before* the plan shared one model built on meta between its memory
traces, its roofline traces and its model facts (``plan-speed`` at 03e9f3f), so the test
compares against the old code path without keeping it in ``src``. Regenerate only from that
code, one trace at a time::

    git archive 03e9f3f src | tar -x -C /tmp/old
    BATCHFIT_PARALLEL_TRACES=0 PYTHONPATH=/tmp/old/src .venv/bin/python \\
        tests/speed/plan_reference.py > tests/speed/plan_reference.json
"""

from __future__ import annotations

import json

import torch

from batchfit.engine.spec import TensorSpec, TrainConfig
from batchfit.speed.plan import plan

VOCAB, SEQ = 1000, 128


def llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256,
                                        num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2))


def mlp() -> torch.nn.Module:
    # ~0.27 B parameters over 2,048 tokens on 16 GB cards: DDP and FSDP fit different
    # micro-batches; the DeepSpeed layouts fit none and fall through checkpointing and
    # offload to a reason (a Sequential has no built-in activation checkpointing)
    return torch.nn.Sequential(*[torch.nn.Linear(4096, 4096) for _ in range(16)])


TOKENS = TensorSpec((SEQ,), "int64", low=0, high=VOCAB)
CASES = {
    "llama_8xh100": lambda: plan(llama, {"input_ids": TOKENS, "labels": TOKENS},
                                 TrainConfig(optimizer="adamw"), gpus="8xH100 SXM",
                                 global_batch=64, precision="amp-bf16",
                                 strategies=["ddp", "fsdp", "zero2", "zero3"]),
    "mlp_2xt4_auto": lambda: plan(mlp, (2048, 4096),
                                  TrainConfig(optimizer="adamw", precision="amp-fp16"),
                                  gpus="2xT4", global_batch=128),
}


def answer(name: str) -> dict:
    return CASES[name]().to_dict()


if __name__ == "__main__":
    print(json.dumps({name: answer(name) for name in CASES}, indent=1))
