"""Reference memory events for the step driver's equality test (tests/engine/test_driver.py).

Each case is one traced step of a small model: CNNs, Hugging Face models, an LLM with LoRA,
a Keras model and sharded ranks, on CPU and CUDA targets. The reference is a digest of the
steady and first steps' events (kind, bytes, category, module, op, phase, with storage keys
renumbered by first appearance) and their totals and peaks, recorded by the code *before*
the driver existed (``main`` at ac24284), so the test compares against the old code path
without keeping it in ``src``. Regenerate only from that code::

    cd /work/main && KERAS_BACKEND=torch HF_HUB_OFFLINE=1 PYTHONPATH=src \\
        .venv/bin/python /work/wt/step-driver/tests/engine/driver_reference.py \\
        > /work/wt/step-driver/tests/engine/driver_reference.json
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("KERAS_BACKEND", "torch")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the shared models

SEQ = 32
VOCAB = 1000


def _resnet18():
    import torchvision

    return torchvision.models.resnet18(num_classes=10)


def _mlp():
    import torch

    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 10))


def _bert():
    import transformers

    config = transformers.BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=128, vocab_size=VOCAB,
                                     max_position_embeddings=128, num_labels=3)
    return transformers.BertForSequenceClassification(config)


def _gpt2():
    import transformers

    config = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=VOCAB,
                                     n_positions=128, use_cache=False)
    return transformers.GPT2LMHeadModel(config)


def _llama():
    import transformers

    config = transformers.LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      vocab_size=VOCAB, max_position_embeddings=128,
                                      use_cache=False)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


def _tokens(labels: bool = False):
    from batchfit.engine.spec import TensorSpec

    spec = {"input_ids": TensorSpec((SEQ,), "int64", 0, VOCAB)}
    if labels:
        spec["labels"] = TensorSpec((SEQ,), "int64", 0, VOCAB)
    return spec


def _keras_cnn():
    from keras_models import sequential_cnn

    return sequential_cnn()


def _tiny_transformer():
    from sharded_models import TinyTransformer

    return TinyTransformer()


def _tiny_cnn():
    from sharded_models import TinyCNN

    return TinyCNN()


#: name -> (factory, inputs, batch, config options, device, sharding (world, strategy, rank))
CASES = {
    "resnet18-cpu-adamw": (_resnet18, (3, 64, 64), 2, {"optimizer": "adamw"}, "cpu", None),
    "resnet18-a100-amp-bf16": (_resnet18, (3, 64, 64), 4,
                               {"optimizer": "adamw", "precision": "amp-bf16"}, "A100", None),
    "resnet18-v100-grads-kept": (_resnet18, (3, 64, 64), 2,
                                 {"optimizer": "sgd", "grads_to_none": False}, "V100", None),
    "mlp-cpu-infer": (_mlp, (64,), 8, {"mode": "infer"}, "cpu", None),
    "bert-cpu-adamw": (_bert, lambda: _tokens(), 2, {"optimizer": "adamw"}, "cpu", None),
    "gpt2-a100-amp-fp16": (_gpt2, lambda: _tokens(labels=True), 2,
                           {"optimizer": "adamw", "precision": "amp-fp16"}, "A100", None),
    "llama-lora-cpu": (_llama, lambda: _tokens(labels=True), 2,
                       {"lora": "r=8,targets=all-linear"}, "cpu", None),
    "llama-lora-h100-bf16": (_llama, lambda: _tokens(labels=True), 2,
                             {"lora": "r=8,targets=all-linear", "precision": "amp-bf16"},
                             "H100", None),
    "keras-cnn-cpu": (_keras_cnn, None, 8, {}, "cpu", None),
    "fsdp-transformer-a100-rank0": (_tiny_transformer, None, 4, {"optimizer": "adamw"}, "A100",
                                    (2, "fsdp", 0)),
    "ddp-cnn-cpu-rank1": (_tiny_cnn, (3, 16, 16), 2, {"optimizer": "sgd"}, "cpu",
                          (2, "ddp", 1)),
}


def _digest(events) -> dict:
    """Totals, peaks and a hash of the events with keys renumbered by first appearance."""
    keys: dict[int, int] = {}
    hasher = hashlib.sha256()
    live = peak = allocated = 0
    sizes: dict[int, int] = {}
    for e in events:
        key = keys.setdefault(e.key, len(keys))
        hasher.update(repr((int(e.kind), key, e.nbytes, e.category.value, e.module, e.op,
                            e.phase.value)).encode())
        if e.kind == 0:
            allocated += e.nbytes
            sizes[e.key] = e.nbytes
            live += e.nbytes
            peak = max(peak, live)
        elif e.kind == 1:
            live -= sizes.pop(e.key, 0)
    return {"events": len(events), "allocated_bytes": allocated, "peak_live_bytes": peak,
            "sha256": hasher.hexdigest()}


def trace_case(name: str):
    """The :class:`~batchfit.engine.trace.StepTrace` of case ``name`` (with the code on
    ``sys.path``: the old code for the reference, the new one in the test)."""
    from batchfit.device.profile import resolve_device
    from batchfit.engine.spec import TrainConfig
    from batchfit.engine.trace import trace_step

    factory, inputs, batch, options, device, sharded = CASES[name]
    inputs = inputs() if callable(inputs) else inputs
    if inputs is None and sharded is not None:
        from sharded_models import transformer_inputs

        inputs = transformer_inputs()
    config = TrainConfig(**options)
    profile = resolve_device(device)
    if sharded is None:
        return trace_step(factory, inputs, batch, config, profile)
    from batchfit.sharding.layout import Parallelism
    from batchfit.sharding.rank import trace_rank

    world, strategy, rank = sharded
    return trace_rank(factory, inputs, batch, config, profile,
                      Parallelism(world_size=world, strategy=strategy), rank)


def digest_case(name: str) -> dict:
    traced = trace_case(name)
    return {"steady": _digest(traced.steady_events), "first": _digest(traced.first_events),
            "parameter_count": traced.parameter_count,
            "trainable_parameter_count": traced.trainable_parameter_count}


if __name__ == "__main__":
    only = sys.argv[1:] or list(CASES)
    print(json.dumps({name: digest_case(name) for name in only}, indent=1, sort_keys=True))
