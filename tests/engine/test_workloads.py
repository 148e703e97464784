"""LLM workloads: LoRA (peft), bitsandbytes 4-bit/8-bit weights and optimizers, traced on fake
tensors. The CPU predictions are checked against the profiler on the same real step (the
model quantized for real by bitsandbytes' CPU kernels), and the per-component bytes against
values derived by hand from the bitsandbytes and peft sources."""

from __future__ import annotations

import math

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")

import torch  # noqa: E402

from batchfit.answers.estimate import estimate  # noqa: E402
from batchfit.engine.spec import TensorSpec, TrainConfig  # noqa: E402
from batchfit.engine.trace import trace_step
from batchfit.engine.tracer import Category, EventKind, Phase  # noqa: E402
from batchfit.errors import InvalidInputError  # noqa: E402

H, I, V, LAYERS, KV_HEADS, HEADS = 256, 512, 1000, 2, 2, 4
SPEC = {"input_ids": TensorSpec((64,), "int64", 0, V), "labels": TensorSpec((64,), "int64", 0, V)}


def tiny_llama():
    config = transformers.LlamaConfig(
        hidden_size=H, intermediate_size=I, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS, vocab_size=V, max_position_embeddings=512, use_cache=False)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


def tiny_qwen3():
    """Qwen3's layout (per-head q/k RMSNorm, GQA, untied head) at the same small sizes."""
    config = transformers.Qwen3Config(
        hidden_size=H, intermediate_size=I, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS, head_dim=H // HEADS, vocab_size=V,
        max_position_embeddings=512, use_cache=False, tie_word_embeddings=False)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


@pytest.fixture
def one_thread():
    """The real steps on one thread: bitsandbytes' CPU kernels on a shared two-core machine
    took 6 s a step with two threads and 0.4 s with one; the bytes do not change."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# (out, in) of every linear layer of one decoder layer: q, k, v, o, gate, up, down
KV = H // HEADS * KV_HEADS
LINEARS = [(H, H), (KV, H), (KV, H), (H, H), (I, H), (I, H), (H, I)]


CPU_CASES = {  # issue 15's CPU exactness check; benchmarks/llm_cpu_exact.py prints the errors
    "lora": (tiny_llama, dict(lora="r=8,alpha=16,targets=all-linear")),
    "qlora-nf4-dq": (tiny_llama, dict(lora="r=8,targets=all-linear", quant="nf4-dq")),
    "qlora-fp4-amp-paged8bit": (tiny_llama, dict(lora="r=8,targets=all-linear", quant="fp4",
                                                 precision="amp-bf16",
                                                 optimizer="paged-adamw8bit")),
    "adamw8bit": (tiny_llama, dict(optimizer="adamw8bit")),
    # fp32 without checkpointing, the settings this case checked before issue 36 moved peft's
    # QLoRA defaults (amp-bf16, checkpointing) into TrainConfig; with those defaults the
    # prediction is 2.8% off the profiler here, which is left to its own issue
    "int8-lora": (tiny_llama, dict(lora="r=8,targets=all-linear", quant="int8",
                                   precision="fp32", checkpointing=False)),
    "qwen3-qlora-nf4-adamw8bit": (tiny_qwen3, dict(lora="r=8,targets=all-linear",
                                                   quant="nf4", optimizer="adamw8bit")),
}


@pytest.mark.parametrize("case", list(CPU_CASES))
def test_cpu_prediction_matches_the_profiler(case, one_thread):
    from batchfit.realrun.measure import measure_step

    factory, options = CPU_CASES[case]
    config = TrainConfig(**options)
    predicted = estimate(factory, SPEC, 4, config, device="cpu").peak_allocated_bytes
    measured = measure_step(factory, SPEC, 4, config, steps=2).peak_bytes
    assert abs(predicted - measured) / measured < 0.02, (predicted, measured)


def _parameter_bytes(trace):
    return sum(e.nbytes for e in trace.steady_events
               if e.kind is EventKind.ALLOC and e.category is Category.PARAMETERS
               and e.phase is Phase.SETUP)


def test_quantized_layout_by_hand():
    from batchfit.engine.prepare import workload_model as _workload_model
    from batchfit.engine.workloads.quantstate import layout_of

    weights = [o * i for o, i in LINEARS] * LAYERS
    nested = _workload_model(tiny_llama, TrainConfig(lora="r=8", quant="nf4-dq"), None)[0]
    layout = layout_of(nested)
    assert layout.layers == 7 * LAYERS
    assert layout.packed_bytes == sum(n // 2 for n in weights)            # two values a byte
    assert layout.absmax_bytes == sum(math.ceil(n / 64) for n in weights)  # uint8 per 64
    assert layout.nested_absmax_bytes == sum(4 * math.ceil(math.ceil(n / 64) / 256)
                                             for n in weights)
    assert layout.code_bytes == 14 * (16 * 4 + 256 * 4)  # NF4 book + the 8-bit book
    assert layout.offset_bytes == 14 * 4
    plain = layout_of(_workload_model(tiny_llama, TrainConfig(lora="r=8", quant="nf4"), None)[0])
    assert plain.absmax_bytes == sum(4 * math.ceil(n / 64) for n in weights)  # fp32
    assert plain.nested_absmax_bytes == plain.offset_bytes == 0
    int8 = layout_of(_workload_model(tiny_llama, TrainConfig(lora="r=8", quant="int8"), None)[0])
    assert int8.packed_bytes == sum(weights) and int8.scale_bytes == 4 * sum(
        o for o, _ in LINEARS) * LAYERS


def test_lora_parameters_by_hand():
    # r=8 on every linear layer but lm_head: r x (in + out) float32 values each
    config = TrainConfig(lora="r=8,targets=all-linear", quant="nf4")
    trace = trace_step(tiny_llama, SPEC, 2, config, _cpu())
    assert trace.trainable_parameter_count == LAYERS * sum(8 * (o + i) for o, i in LINEARS)
    # the stored weights: packed 4-bit + fp32 absmax + code books, the fp32 embedding, lm_head,
    # norms (prepare_model_for_kbit_training upcasts them) and the fp32 adapters
    weights = [o * i for o, i in LINEARS] * LAYERS
    quantized = sum(n // 2 + 4 * math.ceil(n / 64) + 64 for n in weights)
    full_precision = 4 * (V * H * 2 + H * (2 * LAYERS + 1))
    adapters = 4 * trace.trainable_parameter_count
    assert _parameter_bytes(trace) == quantized + full_precision + adapters


def _cpu():
    from batchfit.device.profile import DeviceProfile

    return DeviceProfile.cpu()


def _gpu():
    from batchfit.device.profile import resolve_device

    return resolve_device("RTX 4090")


def _steady_optimizer_state(trace):
    live, category = {}, {}
    for event in trace.steady_events:
        if event.kind is EventKind.ALLOC:
            live[event.key] = event.nbytes
            category[event.key] = event.category
        elif event.kind is EventKind.FREE:
            live.pop(event.key, None)
        else:
            category[event.key] = event.category
    return sum(n for k, n in live.items() if category[k] is Category.OPTIMIZER_STATE)


def test_8bit_optimizer_state_by_hand():
    # bitsandbytes Optimizer2State.init_state: uint8 state1/state2 and fp32 absmax1/absmax2
    # per 256-element block for tensors of >= 4096 elements, fp32 state below; plus the two
    # 256-entry fp32 code books shared by all
    model = tiny_llama()
    expected = 2 * 256 * 4
    for p in model.parameters():
        n = p.numel()
        expected += 2 * n + 2 * 4 * math.ceil(n / 256) if n >= 4096 else 2 * 4 * n
    trace = trace_step(tiny_llama, SPEC, 2, TrainConfig(optimizer="adamw8bit"), _cpu())
    assert _steady_optimizer_state(trace) == expected


def test_paged_state_is_host_backed_on_a_gpu():
    # bitsandbytes pages a state buffer (cudaMallocManaged) when the parameter has >= 1e5
    # elements: the embedding and lm_head (256,000) and the MLP weights (131,072) here
    model = tiny_llama()
    paged = sum(p.numel() for p in model.parameters() if p.numel() >= 100_000)
    small = sum(p.numel() for p in model.parameters() if p.numel() < 100_000)
    trace = trace_step(tiny_llama, SPEC, 2, TrainConfig(optimizer="paged-adamw32bit"), _gpu())
    assert trace.host_backed_bytes == 2 * 4 * paged
    # what stays on the device: the small tensors' fp32 state, in 512-byte allocator blocks
    assert _steady_optimizer_state(trace) == 2 * 4 * small
    cpu = trace_step(tiny_llama, SPEC, 2, TrainConfig(optimizer="paged-adamw32bit"), _cpu())
    assert cpu.host_backed_bytes == 0  # bitsandbytes does not page on the CPU


def test_4bit_forward_dequantizes_the_weight_on_a_gpu():
    # M = 8 x 256 = 2048 rows > 1536: bitsandbytes' CUDA gemm_4bit takes the fallback, which
    # dequantizes the whole (N, K) weight to the input dtype inside the op
    long = {k: TensorSpec((256,), "int64", 0, V) for k in SPEC}
    config = TrainConfig(lora="r=8,targets=all-linear", quant="nf4", precision="amp-bf16")
    trace = trace_step(tiny_llama, long, 8, config, _gpu())
    down = "base_model.model.model.layers.0.mlp.down_proj.base_layer"
    forward = [e for e in trace.steady_events if e.kind is EventKind.ALLOC
               and e.module == down and e.phase is Phase.FORWARD]
    assert H * I * 2 in [e.nbytes for e in forward]  # the bf16 dequantized weight
    # one row of tokens (M = 2): bitsandbytes' fused cgemm_4bit writes only the output
    one = {k: TensorSpec((2,), "int64", 0, V) for k in SPEC}
    small = trace_step(tiny_llama, one, 1, config, _gpu())
    forward = [e for e in small.steady_events if e.kind is EventKind.ALLOC
               and e.module == down and e.phase is Phase.FORWARD and "gemm" not in e.op]
    assert H * I * 2 not in [e.nbytes for e in forward]


def test_bad_lora_target_lists_candidates():
    with pytest.raises(InvalidInputError) as info:
        trace_step(tiny_llama, SPEC, 1, TrainConfig(lora="r=4,targets=qproj"), _cpu())
    text = str(info.value)
    assert "'qproj' matches no module" in text and "q_proj" in text and "\n" not in text


def test_quant_needs_linear_layers():
    def convnet():
        return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Flatten())

    with pytest.raises(InvalidInputError, match="no nn.Linear layer"):
        trace_step(convnet, (3, 8, 8), 1, TrainConfig(lora="r=4", quant="nf4"), _cpu())


def test_gradient_accumulation_keeps_gradients_through_the_next_micro_batch():
    # with two micro-batches, the first one's LoRA gradients (r x (in + out) fp32 values per
    # adapted layer) are live while the second one runs forward
    config = TrainConfig(lora="r=8,targets=all-linear", grad_accum_steps=2)
    trace = trace_step(tiny_llama, SPEC, 2, config, _cpu())
    grads = 4 * LAYERS * sum(8 * (o + i) for o, i in LINEARS)
    live, category, seen = {}, {}, []
    for event in trace.steady_events:
        if event.kind is EventKind.ALLOC:
            live[event.key], category[event.key] = event.nbytes, event.category
        elif event.kind is EventKind.FREE:
            live.pop(event.key, None)
        else:
            category[event.key] = event.category
        if event.phase is Phase.FORWARD:
            seen.append(sum(n for k, n in live.items() if category[k] is Category.GRADIENTS))
    assert max(seen) == grads and min(seen) == 0  # none in the first, all in the second
    single = trace_step(tiny_llama, SPEC, 2, TrainConfig(lora="r=8,targets=all-linear"), _cpu())
    assert not any(e.category is Category.GRADIENTS and e.phase is Phase.FORWARD
                   for e in single.steady_events)


def _allocations(trace):
    return [e for e in trace.steady_events if e.kind is EventKind.ALLOC]


def test_chunked_loss_never_holds_the_whole_logits():
    pytest.importorskip("liger_kernel")
    # Liger's fused linear cross-entropy over BT = 3 x 64 rows, H = 256, V = 1000:
    # inc_factor = ceil(V / H) = 4, chunk = next_pow2(ceil(192 / 4)) = 64 rows of logits
    config = TrainConfig(lora="r=8,targets=all-linear", precision="bf16")
    standard = trace_step(tiny_llama, SPEC, 3, config, _gpu())
    chunked = trace_step(tiny_llama, SPEC, 3, TrainConfig(
        lora="r=8,targets=all-linear", precision="bf16", loss="chunked"), _gpu())
    full = 3 * 64 * V * 2  # the bf16 logits of every position
    assert full in [e.nbytes for e in _allocations(standard)]
    sizes = [e.nbytes for e in _allocations(chunked)]
    assert full not in sizes and 2 * full not in sizes  # nor their fp32 upcast
    assert 64 * V * 2 in sizes  # one chunk's logits


def test_packing_builds_the_block_diagonal_mask_for_sdpa_only():
    from batchfit.models.resolve import resolve_model

    tokens = 96
    plain = resolve_model("hf:Qwen/Qwen3-0.6B", seq_len=tokens, model_kwargs={
        "num_hidden_layers": 1, "hidden_size": 64, "intermediate_size": 128,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32, "vocab_size": 512})
    packed = resolve_model("hf:Qwen/Qwen3-0.6B", seq_len=tokens, packing=True, model_kwargs={
        "num_hidden_layers": 1, "hidden_size": 64, "intermediate_size": 128,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32, "vocab_size": 512})
    assert "position_ids" in packed.input_spec and "position_ids" not in plain.input_spec
    mask = 2 * 1 * tokens * tokens  # (batch, 1, seq, seq) booleans
    config = TrainConfig(lora="r=4", precision="bf16")
    without = trace_step(plain.factory, plain.input_spec, 2, config, _gpu())
    with_packing = trace_step(packed.factory, packed.input_spec, 2,
                              TrainConfig(lora="r=4", precision="bf16", packing=True), _gpu())
    from collections import Counter

    extra = Counter(e.nbytes for e in _allocations(with_packing)) - Counter(
        e.nbytes for e in _allocations(without))
    assert extra[mask] >= 1  # built once the packed positions are seen


def _forward_peak(trace) -> int:
    """The largest live bytes during forward and loss (the model computes its loss inside
    its forward), from the steady step's events."""
    live: dict[int, int] = {}
    total = peak = 0
    for e in trace.steady_events:
        if e.kind is EventKind.ALLOC:
            live[e.key] = e.nbytes
            total += e.nbytes
        elif e.kind is EventKind.FREE and e.key in live:
            total -= live.pop(e.key)
        if e.phase in (Phase.FORWARD, Phase.LOSS):
            peak = max(peak, total)
    return peak


def test_transformers_version_loss_by_hand():
    # The loss of the transformers the user runs (engine/workloads/hfloss.py), B x S tokens,
    # bf16 logits, at the log-softmax (the forward's peak: the logits dominate this model):
    #   installed (>= 4.49): bf16 logits 2BSV + float32 copy 4BSV + log-softmax 4BSV
    #   4.46-4.48: bf16 2BSV + float32 4BSV + contiguous shifted copy and its log-softmax,
    #              4B(S-1)V each
    #   < 4.46 (4.43): the bf16 logits are freed by the forward's upcast: 4BSV + 2 x 4B(S-1)V
    # up to the int64 label tensors each version shifts (a few B x S x 8 bytes)
    b, s = 2, 64
    config = dict(lora="r=8,targets=all-linear", precision="amp-bf16")
    peaks = {v: _forward_peak(trace_step(tiny_llama, SPEC, b, TrainConfig(
        **config, transformers_version=v), _cpu())) for v in (None, "4.46", "4.43.3")}
    installed = 2 * b * s * V + 4 * b * s * V + 4 * b * s * V
    v446 = 2 * b * s * V + 4 * b * s * V + 2 * 4 * b * (s - 1) * V
    v443 = 4 * b * s * V + 2 * 4 * b * (s - 1) * V
    labels = 4 * b * s * 8
    assert abs((peaks["4.46"] - peaks[None]) - (v446 - installed)) <= labels
    assert abs((peaks["4.43.3"] - peaks[None]) - (v443 - installed)) <= labels
    with pytest.raises(InvalidInputError, match="malformed transformers_version"):
        TrainConfig(transformers_version="four")
    with pytest.raises(InvalidInputError, match="loss='chunked' replaces it"):
        TrainConfig(transformers_version="4.46", loss="chunked")


def live_before(trace, phase: Phase) -> int:
    """Live bytes when the steady step first enters ``phase`` (``Phase.FORWARD``: what the
    previous step left; ``Phase.BACKWARD``: the end of forward and loss)."""
    live: dict[int, int] = {}
    for e in trace.steady_events:
        if e.phase is phase:
            break
        if e.kind is EventKind.ALLOC:
            live[e.key] = e.nbytes
        elif e.kind is EventKind.FREE:
            live.pop(e.key, None)
    return sum(live.values())


def test_old_bitsandbytes_keeps_each_4bit_input_by_hand():
    # bitsandbytes < 0.43.2, MatMul4Bit.forward: ctx.tensors = (A, B) when A or B needs a
    # gradient (bitsandbytes/autograd/_functions.py; #1270 saves (None, B)). litgpt's QLoRA
    # (bf16, LoRA with dropout on q and v, no checkpointing): what each layer then keeps
    # that nothing else holds at the end of forward, B x S tokens, 2 bytes each:
    #   the q/k/v input (input_layernorm's output, H): LoRA saves its dropout's output, not
    #     it; in layer 0 it needs no gradient (the frozen embedding's), so it is not kept
    #   the gate/up input (post_attention_layernorm's output, H)
    #   the down input (act(gate) * up, I): the mul saves its operands, not its product
    # o_proj's input is a view of the attention output, which attention saves anyway. And
    # the 4-bit lm_head's input (the final norm's output, H), which litgpt quantizes too
    # (Lightning's BitsandbytesPrecision swaps every nn.Linear; tests/engine/test_litgpt.py).
    b, s = 2, 64
    config = dict(recipe="litgpt", lora="r=8,alpha=16,dropout=0.05,targets=q_proj+v_proj",
                  quant="nf4")
    kept = (LAYERS * (H + H + I) - H + H) * b * s * 2
    for device in (_cpu(), _gpu()):
        live = {v: live_before(trace_step(tiny_llama, SPEC, b, TrainConfig(
            **config, bitsandbytes_version=v), device), Phase.BACKWARD)
                for v in (None, "0.41.1", "0.43.2")}
        assert live["0.41.1"] - live[None] == kept
        assert live["0.43.2"] == live[None]


def test_bitsandbytes_before_050_always_dequantizes_in_forward():
    # bitsandbytes < 0.50.0, MatMul4Bit.forward: F.linear(A, F.dequantize_4bit(B, state)...)
    # at any shape; one row of tokens (M = 2) takes the fused cgemm_4bit from 0.50.0 on
    one = {k: TensorSpec((2,), "int64", 0, V) for k in SPEC}
    down = "base_model.model.model.layers.0.mlp.down_proj.base_layer"
    weights = {}
    for version in (None, "0.49.2"):
        config = TrainConfig(lora="r=8,targets=all-linear", quant="nf4", precision="amp-bf16",
                             bitsandbytes_version=version)
        trace = trace_step(tiny_llama, one, 1, config, _gpu())
        weights[version] = [e.nbytes for e in trace.steady_events if e.kind is EventKind.ALLOC
                            and e.module == down and e.phase is Phase.FORWARD]
    assert H * I * 2 not in weights[None]
    assert H * I * 2 in weights["0.49.2"]  # the bf16 dequantized weight
    with pytest.raises(InvalidInputError, match="add quant='nf4'"):
        TrainConfig(lora="r=8", bitsandbytes_version="0.41.1")


def test_a_held_loss_keeps_old_bitsandbytes_inputs_into_the_next_step_by_hand():
    # litgpt's loop (finetune/lora.py) keeps `logits` and `loss` until the next step's
    # replace them;
    # the graph behind it keeps what its nodes hold outside save_for_backward, which
    # backward does not release: bitsandbytes < 0.43.2's ctx.tensors = (A, B). So the
    # previous step's 4-bit inputs are alive when the next forward begins: the per-layer
    # inputs of the test above, plus o_proj's (a view of the attention output, which
    # attention released in backward), H per token in every layer, and the 4-bit lm_head's
    # (the final norm's output, H per token)
    b, s = 2, 64
    config = dict(recipe="litgpt", lora="r=8,alpha=16,dropout=0.05,targets=q_proj+v_proj",
                  quant="nf4")
    left = (LAYERS * (H + H + H + I) - H + H) * b * s * 2
    live = {(v, held): live_before(trace_step(tiny_llama, SPEC, b, TrainConfig(
        **config, bitsandbytes_version=v, holds_loss=held), _cpu()), Phase.FORWARD)
        for v in (None, "0.41.1") for held in (None, False)}
    assert TrainConfig(**config).holds_loss is True  # the litgpt recipe's loop
    assert live[("0.41.1", None)] - live[(None, None)] == left
    assert live[("0.41.1", False)] == live[(None, False)]  # a loop that drops its loss
