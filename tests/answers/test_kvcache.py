"""KV-cache bytes per token derived by hand from the published configs, and vLLM's block
arithmetic (vllm/v1/core/kv_cache_utils.py) on hand-computed budgets."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from batchfit.answers.kvcache import CacheKind, kv_bytes_per_token, layer_caches, plan_blocks


def _config(name: str):
    from batchfit.models.resolve import load_hf_config

    return load_hf_config(name)


def test_gqa_llama3_8b_by_hand():
    # 32 layers x (K and V) x 8 KV heads x 128 head dim x 2 bytes (bf16)
    caches = layer_caches(_config("meta-llama/Meta-Llama-3-8B"), kv_bytes=2)
    assert len(caches) == 32 and {c.kind for c in caches} == {CacheKind.FULL}
    assert kv_bytes_per_token(caches) == 32 * 2 * 8 * 128 * 2 == 131_072
    # fp8 cache halves it
    assert kv_bytes_per_token(layer_caches(_config("meta-llama/Meta-Llama-3-8B"), 1)) == 65_536


def test_sliding_window_gemma2_by_hand():
    # Gemma-2-9B: 42 layers alternating sliding (4096) and full; 8 KV heads of 256
    caches = layer_caches(_config("google/gemma-2-9b"), kv_bytes=2)
    sliding = [c for c in caches if c.kind is CacheKind.SLIDING]
    full = [c for c in caches if c.kind is CacheKind.FULL]
    assert len(sliding) == len(full) == 21
    assert all(c.window == 4096 for c in sliding)
    assert caches[0].bytes_per_token == 2 * 8 * 256 * 2 == 8192
    # one request of 32,768 tokens with 8,192 batched tokens and 16-token blocks:
    # a sliding layer holds min(4095 + 8192, 32768) = 12,287 tokens -> 768 + 1 blocks
    page = 16 * 8192
    assert sliding[0].max_usage_bytes(32768, 16, 8192) == 769 * page
    assert full[0].max_usage_bytes(32768, 16, 8192) == 2048 * page


def test_mla_deepseek_by_hand():
    # DeepSeek-V3: one latent of kv_lora_rank 512 + rope 64 per token and layer, 61 layers
    caches = layer_caches(_config("deepseek-ai/DeepSeek-V3"), kv_bytes=2)
    assert {c.kind for c in caches} == {CacheKind.MLA} and len(caches) == 61
    assert kv_bytes_per_token(caches) == 61 * (512 + 64) * 2 == 70_272
    lite = layer_caches(_config("deepseek-ai/DeepSeek-V2-Lite"), kv_bytes=2)
    assert kv_bytes_per_token(lite) == 27 * 576 * 2


def test_mamba_state_by_hand():
    # falcon-mamba-7b: intermediate 8192, conv kernel 4, state 16, 64 layers, bf16
    caches = layer_caches(_config("tiiuae/falcon-mamba-7b"), kv_bytes=2)
    assert {c.kind for c in caches} == {CacheKind.MAMBA} and len(caches) == 64
    assert caches[0].state_bytes == (3 * 8192 + 8192 * 16) * 2 == 311_296
    assert kv_bytes_per_token(caches) == 0  # constant in the context length


def test_blocks_uniform_model():
    # 32 identical layers, 16-token pages of 16 x 4096 B: 1 GiB -> 1 GiB // 65536 // 32 = 512
    caches = layer_caches(_config("meta-llama/Meta-Llama-3-8B"), kv_bytes=2)
    plan = plan_blocks(caches, 1 << 30, block_size=16, max_model_len=8192,
                       max_num_batched_tokens=8192)
    assert plan.num_blocks == 512 and plan.tokens == 8192 and plan.layers_per_group == 32
    assert plan.blocks_per_request == 512 and plan.max_concurrency == pytest.approx(1.0)


def test_blocks_hybrid_model_groups():
    # Gemma-2-9B: two groups of 21 layers sharing pages; a request needs the full layers'
    # 8192/16 = 512 blocks plus the sliding layers' ceil(min(4095 + 2048, 8192)/16) + 1 = 385
    caches = layer_caches(_config("google/gemma-2-9b"), kv_bytes=2)
    page = 16 * 8192
    plan = plan_blocks(caches, 21 * page * 1000, block_size=16, max_model_len=8192,
                       max_num_batched_tokens=2048)
    assert plan.layers_per_group == 21 and plan.groups == 2 and plan.num_blocks == 1000
    assert plan.blocks_per_request == 512 + 385
    assert plan.max_concurrency == pytest.approx(1000 / 897)
