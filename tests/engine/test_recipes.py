"""Fine-tuning recipes (issue 36, item 1): each framework's defaults fill what the user left
unset, explicit values win, the LoRA ``dtype=`` key is honoured, and the frameworks' losses
hold what their sources say. Expected values come from the frameworks' sources (cited in
src/batchfit/engine/workloads/recipes.py and losses.py) and from sizes worked out by hand."""

from __future__ import annotations

import math

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")

from tests.engine.test_workloads import LAYERS, LINEARS, SPEC, H, V, _cpu, _forward_peak, tiny_llama

from batchfit.engine.spec import Precision, TrainConfig
from batchfit.engine.trace import trace_step
from batchfit.engine.tracer import Category, EventKind, Phase
from batchfit.errors import InvalidInputError


def _parameter_bytes(trace):
    return sum(e.nbytes for e in trace.steady_events
               if e.kind is EventKind.ALLOC and e.category is Category.PARAMETERS
               and e.phase is Phase.SETUP)


def test_peft_qlora_defaults_live_in_the_library():
    # peft's QLoRA: prepare_model_for_kbit_training (use_gradient_checkpointing=True by
    # default), bf16 compute, fp32 adapters; the library now decides this, not the CLI
    config = TrainConfig(lora="r=8", quant="nf4")
    assert config.precision is Precision.AMP_BF16 and config.checkpointing is True
    assert config.quant.prepare is True and config.lora.dtype.value == "fp32"
    plain = TrainConfig(lora="r=8")
    assert plain.precision is Precision.FP32 and plain.checkpointing is False
    assert plain.loss.value == "standard" and plain.optimizer.value == "adamw"


@pytest.mark.parametrize("recipe, expected", [
    # litgpt/finetune/lora.py + litgpt/utils.py: bf16-true, no kbit prep, bf16 adapters,
    # no checkpointing, bf16 loss, bnb PagedAdamW with --quantize
    ("litgpt", dict(precision="bf16", checkpointing=False, prepare=False, dtype="bf16",
                    loss="native", optimizer="paged-adamw32bit")),
    # 7B_qlora_single_device.yaml: dtype bf16, activation checkpointing, fused AdamW,
    # chunked output CE
    ("torchtune", dict(precision="bf16", checkpointing=True, prepare=False, dtype="bf16",
                       loss="chunked-output", optimizer="adamw")),
    ("unsloth", dict(precision="bf16", checkpointing=True, prepare=False, dtype="bf16",
                     loss="native", optimizer="adamw8bit")),
    # axolotl's qlora.yml examples: bf16 auto, gradient checkpointing, paged_adamw_32bit;
    # its loader runs prepare_model_for_kbit_training
    ("axolotl", dict(precision="amp-bf16", checkpointing=True, prepare=True, dtype="fp32",
                     loss="standard", optimizer="paged-adamw32bit")),
])
def test_recipe_fills_what_the_user_left_unset(recipe, expected):
    config = TrainConfig(lora="r=8", quant="nf4", recipe=recipe)
    assert config.precision.value == expected["precision"]
    assert config.checkpointing is expected["checkpointing"]
    assert config.quant.prepare is expected["prepare"]
    assert config.lora.dtype.value == expected["dtype"]
    assert config.loss.value == expected["loss"]
    assert config.optimizer.value == expected["optimizer"]
    assert ("fused" in config.optimizer_kwargs) is (recipe == "torchtune")


def test_explicit_values_win_over_the_recipe():
    config = TrainConfig(lora="r=8,dtype=fp32", quant=_quant(prepare=True), recipe="litgpt",
                         checkpointing=True, loss="standard", optimizer="adamw",
                         precision="fp16")
    assert config.lora.dtype.value == "fp32" and config.quant.prepare is True
    assert config.checkpointing is True and config.loss.value == "standard"
    assert config.optimizer.value == "adamw" and config.precision is Precision.FP16


def _quant(**kwargs):
    from batchfit.engine.workloads.spec import QuantSpec

    return QuantSpec(method="nf4", **kwargs)


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(lora="r=8", recipe="lit-gpt"), "unknown recipe 'lit-gpt': choose one of peft"),
    (dict(recipe="torchtune"), "is a LoRA/QLoRA fine-tuning recipe: add --lora"),
    (dict(lora="r=8", quant="nf4", recipe="litgpt", precision="amp-bf16"),
     "Quantization and mixed precision is not supported"),
    (dict(lora="r=8", quant="int8", recipe="torchtune"), "torchao's NF4 only"),
    (dict(lora="r=8,dtype=fp8"), "LoRA dtype='fp8': use fp32"),
])
def test_bad_recipe_input_says_why(kwargs, fragment):
    with pytest.raises(InvalidInputError, match=fragment.replace("(", r"\(")):
        TrainConfig(**kwargs)


def test_adapter_dtype_is_honoured():
    # r=8 on every linear layer but lm_head: r x (in + out) values each, 4 bytes in fp32 and
    # 2 in bf16; the non-quantized step holds the base weights in bf16 as well
    adapters = LAYERS * sum(8 * (o + i) for o, i in LINEARS)
    base = V * H * 2 + H * (2 * LAYERS + 1) + sum(o * i for o, i in LINEARS) * LAYERS
    sizes = {}
    for dtype in ("fp32", "bf16", "base"):
        config = TrainConfig(lora=f"r=8,targets=all-linear,dtype={dtype}", precision="bf16")
        sizes[dtype] = _parameter_bytes(trace_step(tiny_llama, SPEC, 2, config, _cpu()))
    assert sizes["fp32"] == 2 * base + 4 * adapters
    assert sizes["bf16"] == sizes["base"] == 2 * base + 2 * adapters


def test_litgpt_qlora_keeps_bf16_weights_and_adapters():
    # no prepare_model_for_kbit_training: embedding and norms stay bf16 (peft's recipe
    # upcasts them, and the head it keeps out of 4 bits, to fp32), and the adapters are bf16
    # (fp32 in peft's); Lightning's plugin quantizes the head too (tests/engine/test_litgpt.py)
    weights = [o * i for o, i in LINEARS] * LAYERS
    quantized = sum(n // 2 + 4 * math.ceil(n / 64) + 64 for n in weights)
    head = V * H // 2 + 4 * math.ceil(V * H / 64) + 64
    full_precision = V * H * 2 + H * (2 * LAYERS + 1)
    adapters = LAYERS * sum(8 * (o + i) for o, i in LINEARS)
    config = TrainConfig(lora="r=8,targets=all-linear", quant="nf4", recipe="litgpt")
    trace = trace_step(tiny_llama, SPEC, 2, config, _cpu())
    assert _parameter_bytes(trace) == quantized + head + 2 * (full_precision - V * H) \
        + 2 * adapters
    peft = trace_step(tiny_llama, SPEC, 2, TrainConfig(lora="r=8,targets=all-linear",
                                                         quant="nf4"), _cpu())
    assert _parameter_bytes(peft) == quantized + 4 * full_precision + 4 * adapters


def test_framework_losses_by_hand():
    # B x S tokens, bf16 logits, the forward's peak at the loss (the logits dominate):
    #   transformers (>= 4.49): bf16 logits 2BSV + float32 copy 4BSV + log-softmax 4BSV
    #   litgpt: bf16 logits 2BSV + bf16 log-softmax 2BSV (S = 64 < its 128-token chunk)
    #   torchtune: bf16 logits 2BSV + 8 float32 log-softmax chunks 4BSV + the last chunk's
    #              float32 copy 4BSV/8
    # up to the per-token tensors each one adds (shifted int64 labels, masks, per-token
    # losses: a few B x S x 8 bytes, under 2% of the differences below)
    b, s = 2, 64
    peaks = {loss: _forward_peak(trace_step(tiny_llama, SPEC, b, TrainConfig(
        lora="r=8,targets=all-linear", precision="bf16", loss=loss), _cpu()))
        for loss in ("standard", "native", "chunked-output")}
    standard = 10 * b * s * V
    litgpt = 4 * b * s * V
    tune = 2 * b * s * V + 4 * b * s * V + 4 * b * s * V // 8
    for loss, expected in (("native", litgpt), ("chunked-output", tune)):
        saved = peaks["standard"] - peaks[loss]
        assert saved == pytest.approx(standard - expected, rel=0.02), loss


def test_estimate_takes_the_recipe_keyword():
    # the public entry point passes recipe= through to TrainConfig: litgpt's bf16 weights
    # and adapters and 4-bit head, as worked out in
    # test_litgpt_qlora_keeps_bf16_weights_and_adapters
    from batchfit.answers.estimate import estimate

    weights = [o * i for o, i in LINEARS] * LAYERS + [V * H]
    quantized = sum(n // 2 + 4 * math.ceil(n / 64) + 64 for n in weights)
    full_precision = V * H + H * (2 * LAYERS + 1)
    adapters = LAYERS * sum(8 * (o + i) for o, i in LINEARS)
    result = estimate(tiny_llama, SPEC, 2, device=_cpu(), lora="r=8,targets=all-linear",
                      quant="nf4", recipe="litgpt")
    parameters = result.to_dict()["by_category"]["parameters"]
    assert parameters == quantized + 2 * full_precision + 2 * adapters
