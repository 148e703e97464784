"""LLM fine-tuning workloads applied to a built model with the real libraries: LoRA (peft),
quantized base weights (bitsandbytes through transformers' quantizer), bitsandbytes 8-bit and
paged optimizers, the loss over the vocabulary, and the KV cache of serving.

Nothing here imports torch at package import; :mod:`batchfit.engine.workloads.spec` holds the plain
option types the CLI and ``TrainConfig`` use.
"""

from batchfit.engine.workloads.spec import (ALL_LINEAR, AdapterDtype, LoraSpec, LossKind, QuantMethod,
                                     QuantSpec, Workload, parse_lora, parse_quant)

__all__ = ["ALL_LINEAR", "AdapterDtype", "LoraSpec", "LossKind", "QuantMethod", "QuantSpec",
           "Workload", "parse_lora", "parse_quant"]
