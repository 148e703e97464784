"""litgpt's model in the ``litgpt`` recipe (issue 36): one LoRA dropout for the fused qkv,
a separate output head, every linear layer quantized from float16, k and v repeated to
every query head. Expected bytes are
worked out by hand from litgpt's and Lightning's sources, cited in
src/batchfit/engine/workloads/litgpt.py."""

from __future__ import annotations

import math

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")

from tests.engine.test_workloads import (
    HEADS,
    KV_HEADS,
    LAYERS,
    LINEARS,
    SPEC,
    H,
    I,
    V,
    _cpu,
    _gpu,
    live_before,
)

from batchfit.engine.spec import TrainConfig
from batchfit.engine.trace import trace_step
from batchfit.engine.tracer import Category, EventKind, Phase

BATCH, SEQ = 2, SPEC["input_ids"].shape[0]


def tiny_tied_llama():
    """The test Llama with its head tied to the embedding, as Llama 3.2's checkpoints are."""
    config = transformers.LlamaConfig(
        hidden_size=H, intermediate_size=I, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS, vocab_size=V, max_position_embeddings=512,
        use_cache=False, tie_word_embeddings=True)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


def _parameter_bytes(trace) -> int:
    return sum(e.nbytes for e in trace.steady_events
               if e.kind is EventKind.ALLOC and e.category is Category.PARAMETERS
               and e.phase is Phase.SETUP)


def _dropout_bytes(recipe: str) -> int:
    """What a 0.1 LoRA dropout on q, k and v adds to the end of forward."""
    live = {}
    for dropout in (0.0, 0.1):
        config = TrainConfig(lora=f"r=8,dropout={dropout},targets=q_proj+k_proj+v_proj,dtype=bf16",
                             precision="bf16", recipe=recipe)
        live[dropout] = live_before(trace_step(tiny_tied_llama, SPEC, BATCH, config, _gpu()),
                                    Phase.BACKWARD)
    return live[0.1] - live[0.0]


def test_litgpt_runs_one_dropout_for_the_fused_qkv():
    # litgpt/lora.py, LoRAQKVLinear.forward: lora_A(self.lora_dropout(x)) once per attention
    # for q, k and v; peft runs one per adapted projection. Each dropout keeps for backward
    # its bf16 output (lora_A's input, 2 bytes per value) and its mask, over B x S x H
    # values; without dropout lora_A keeps x itself (the norm's output, which nothing else
    # keeps), 2 bytes per value, which the dropped copies replace. CUDA's fused dropout
    # (aten::native_dropout) keeps a bool mask: 1 byte per value.
    values, mask_bytes = BATCH * SEQ * H, 1
    assert _dropout_bytes("litgpt") == LAYERS * values * (2 + mask_bytes - 2)
    assert _dropout_bytes("peft") == LAYERS * values * (3 * (2 + mask_bytes) - 2)


def test_litgpt_keeps_a_separate_output_head():
    # litgpt/model.py GPT.__init__ builds lm_head next to wte, and convert_hf_checkpoint.py
    # copies the embedding into it for a tied checkpoint: V x H bf16 values more than the
    # tied transformers model, whose head is the embedding
    base = H * (2 * LAYERS + 1) + sum(o * i for o, i in LINEARS) * LAYERS
    adapters = LAYERS * sum(8 * (o + i) for o, i in LINEARS)
    sizes = {}
    for recipe in ("litgpt", "peft"):
        config = TrainConfig(lora="r=8,targets=all-linear,dtype=bf16", precision="bf16",
                             recipe=recipe)
        sizes[recipe] = _parameter_bytes(trace_step(tiny_tied_llama, SPEC, BATCH, config, _cpu()))
    assert sizes["peft"] == 2 * (V * H + base) + 2 * adapters
    assert sizes["litgpt"] == 2 * (2 * V * H + base) + 2 * adapters


def _nf4_bytes(n: int) -> int:
    """An NF4 weight of n values: packed halves, one fp32 absmax per 64, 16 fp32 codes."""
    return n // 2 + 4 * math.ceil(n / 64) + 64


def test_litgpt_qlora_quantizes_the_head_too():
    # Lightning's BitsandbytesPrecision swaps every nn.Linear (no ignore_modules from
    # litgpt), lm_head included; transformers keeps lm_head in bf16
    weights = [o * i for o, i in LINEARS] * LAYERS
    norms = H * (2 * LAYERS + 1)
    adapters = LAYERS * sum(8 * (o + i) for o, i in LINEARS)
    config = TrainConfig(lora="r=8,targets=all-linear", quant="nf4", recipe="litgpt")
    trace = trace_step(tiny_tied_llama, SPEC, BATCH, config, _cpu())
    quantized = sum(_nf4_bytes(n) for n in weights + [V * H])
    assert _parameter_bytes(trace) == quantized + 2 * (V * H + norms) + 2 * adapters


def _lm_head_forward_peak(version: str) -> int:
    """The largest sum of live allocations made inside lm_head during forward."""
    config = TrainConfig(lora="r=8,targets=q_proj", quant="nf4", recipe="litgpt",
                         bitsandbytes_version=version)
    trace = trace_step(tiny_tied_llama, SPEC, BATCH, config, _gpu())
    live, peak = {}, 0
    for e in trace.steady_events:
        inside = e.phase is Phase.FORWARD and ".lm_head" in e.module
        if e.kind is EventKind.ALLOC and inside:
            live[e.key] = e.nbytes
        elif e.kind is EventKind.FREE:
            live.pop(e.key, None)
        peak = max(peak, sum(live.values()))
    return peak


def test_old_bitsandbytes_dequantizes_litgpts_fp16_state_then_casts():
    # Lightning's _Linear4bit.quantize quantizes weight.to(torch.half): the quant state is
    # float16. bitsandbytes 0.42's MatMul4Bit.forward runs
    # F.linear(A, F.dequantize_4bit(B, state).to(A.dtype).t()): a float16 V x H weight, its
    # bf16 copy while it lives (then the bf16 logits, B x S x V = 256,000 bytes, next to
    # the bf16 copy alone: less)
    assert _lm_head_forward_peak("0.42") == 2 * V * H * 2


def _live_at_backward(monkeypatch, expand: bool) -> int:
    from batchfit.engine.workloads import litgpt

    if not expand:
        monkeypatch.setattr(litgpt, "expand_kv_heads", lambda model: False)
    config = TrainConfig(lora="r=8,targets=q_proj+v_proj", precision="bf16", recipe="litgpt")
    return live_before(trace_step(tiny_tied_llama, SPEC, BATCH, config, _gpu()), Phase.BACKWARD)


def test_litgpt_keeps_keys_and_values_at_every_query_head(monkeypatch):
    # litgpt/model.py, CausalSelfAttention.forward: with grouped queries k and v are
    # repeated to n_head heads before SDPA, which keeps them for backward; transformers
    # hands SDPA the KV_HEADS-head k and v (enable_gqa). Per layer, k and v each gain
    # (HEADS - KV_HEADS) heads of B x S x head_dim bf16 values.
    head_dim = H // HEADS
    extra = LAYERS * 2 * BATCH * (HEADS - KV_HEADS) * SEQ * head_dim * 2
    expanded = _live_at_backward(monkeypatch, True)
    assert expanded - _live_at_backward(monkeypatch, False) == extra


def _litgpt_trace(monkeypatch, fabric: bool):
    from batchfit.engine.workloads import litgpt

    if not fabric:
        monkeypatch.setattr(litgpt, "fabric_logits", lambda model, chunked: None)
    config = TrainConfig(lora="r=8,targets=q_proj+v_proj", recipe="litgpt")
    return trace_step(tiny_tied_llama, SPEC, BATCH, config, _gpu())


def test_litgpt_holds_float32_logits_into_the_next_step(monkeypatch):
    # Fabric's _FabricModule.forward returns precision.convert_output(output): the bf16
    # logits as float32 (torch.get_default_dtype()); litgpt's fit() keeps them in `logits`
    # until the next step's forward replaces them: B x S x V float32 values live when the
    # next step begins; and the loss it also keeps is a float32 scalar, not a bf16 one
    fabric = live_before(_litgpt_trace(monkeypatch, True), Phase.FORWARD)
    assert fabric - live_before(_litgpt_trace(monkeypatch, False), Phase.FORWARD) \
        == BATCH * SEQ * V * 4 + (4 - 2)


def test_litgpt_loss_runs_on_float32_logits(monkeypatch):
    # At the loss, per token and vocabulary entry: without Fabric, the bf16 logits (2) and
    # their bf16 log-softmax (2); with it, the bf16 logits (2), their float32 copy (4) and a
    # float32 log-softmax (4), and when the copy is made the previous step's float32 logits
    # (4) are freed: 6 bytes more at the forward's peak, up to the few per-token tensors of
    # the loss (labels, per-token losses)
    from tests.engine.test_workloads import _forward_peak

    more = _forward_peak(_litgpt_trace(monkeypatch, True)) \
        - _forward_peak(_litgpt_trace(monkeypatch, False))
    assert more == pytest.approx(6 * BATCH * SEQ * V, rel=0.02)


def test_litgpt_runs_its_head_on_128_token_chunks(monkeypatch):
    # litgpt/lora.py GPT.forward(lm_head_chunk_size=128): the head runs on each 128-token
    # chunk and chunked_cross_entropy takes the list, so backward never makes the whole
    # B x S x V float32 logits gradient; each chunk's, B x 128 x V x 4 bytes, is made instead
    from batchfit.engine.spec import TensorSpec
    from batchfit.engine.workloads import litgpt

    seq = 256
    spec = {k: TensorSpec((seq,), "int64", 0, V) for k in SPEC}
    whole_head = litgpt.fabric_logits
    sizes = {}
    for chunked in (True, False):
        if not chunked:
            monkeypatch.setattr(litgpt, "fabric_logits",
                                lambda model, chunked: whole_head(model, chunked=False))
        config = TrainConfig(lora="r=8,targets=q_proj+v_proj", recipe="litgpt")
        trace = trace_step(tiny_tied_llama, spec, BATCH, config, _gpu())
        sizes[chunked] = {e.nbytes for e in trace.steady_events
                          if e.kind is EventKind.ALLOC and e.phase is Phase.BACKWARD}
    whole, chunk = BATCH * seq * V * 4, BATCH * 128 * V * 4
    assert whole in sizes[False]  # the whole sequence's head: its gradient in one piece
    assert whole not in sizes[True] and chunk in sizes[True]


def test_litgpt_chunked_head_runs_gemma2_without_softcapping():
    # litgpt/lora.py GPT.forward returns the chunk list before final_logit_softcapping, so
    # Gemma 2 trains without it: the step traces (before: transformers' Gemma2ForCausalLM
    # divided the list by the softcap, a TypeError), with no tanh of the B x S x V logits,
    # and the model's own config (shared with other builds) keeps its softcap
    config = transformers.Gemma2Config(
        hidden_size=H, intermediate_size=I, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS, head_dim=H // HEADS, vocab_size=V,
        max_position_embeddings=512, use_cache=False, final_logit_softcapping=30.0)

    def gemma2():
        return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")

    trace = trace_step(gemma2, SPEC, BATCH, TrainConfig(lora="r=8,targets=q_proj+v_proj",
                                                        recipe="litgpt"), _gpu())
    assert config.final_logit_softcapping == 30.0

    def tanh_ops(trace):  # the logits' tanh (the attention's softcapping has one too)
        return {e.nbytes for e in trace.steady_events if e.kind is EventKind.ALLOC
                and e.phase is Phase.FORWARD and "tanh" in e.op} \
            & {BATCH * SEQ * V * 2, BATCH * SEQ * V * 4}

    assert not tanh_ops(trace)
    # the peft recipe runs transformers' model as it is, softcapping included
    peft = trace_step(gemma2, SPEC, BATCH, TrainConfig(lora="r=8,targets=q_proj+v_proj"),
                      _gpu())
    assert tanh_ops(peft)
