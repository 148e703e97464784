"""KV-cache bytes of a model, layer by layer, from its transformers config, and how vLLM turns
the memory left after a profile run into KV blocks.

Per layer (the specs vLLM builds in ``vllm/v1/kv_cache_interface.py``):

* full attention: ``2 * num_kv_heads * head_dim * dtype_bytes`` per token (K and V);
  grouped-query and multi-query attention only through ``num_kv_heads``.
* sliding window: the same per token, but a sequence never holds more than
  ``min(window - 1 + max_num_batched_tokens, max_model_len)`` tokens, plus one block
  (``SlidingWindowSpec.max_memory_usage_bytes``).
* MLA (DeepSeek-V2/V3): one latent of ``kv_lora_rank + qk_rope_head_dim`` values per token,
  shared by all heads (``MLAAttentionSpec``: ``num_kv_heads=1``).
* Mamba / state-space layers: a fixed state per sequence, whatever its length: the
  convolution state ``(conv_kernel - 1) x intermediate`` and the SSM state
  ``intermediate x state_size`` (``MambaSpec``).

vLLM (V1, ``kv_cache_utils.get_kv_cache_config_from_groups``) gives every layer of a KV-cache
group a page of ``block_size`` tokens and allocates ``num_blocks = available // page_size //
layers_per_group`` blocks; layers of different kinds (sliding and full in Gemma 2/3) form
groups of equal size that share the tensors. The largest number of requests of
``max_model_len`` tokens that fit at once is ``num_blocks / blocks_per_request``
(``get_max_concurrency_for_kv_cache_config``).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from enum import StrEnum
from typing import Any


class CacheKind(StrEnum):
    FULL = "full_attention"
    SLIDING = "sliding_attention"
    MLA = "mla"
    MAMBA = "mamba"
    NONE = "none"  # no cache (linear layers without state, encoder-only)


@dataclass(frozen=True)
class LayerCache:
    """One layer's cache.

    Attributes:
        kind: :class:`CacheKind`.
        bytes_per_token: cache bytes a token adds (attention kinds; 0 for Mamba).
        state_bytes: fixed bytes per sequence (Mamba).
        window: the sliding window in tokens.
        heads, head_dim: KV heads and head size of the cache entry (MLA: 1 and the latent size).
    """

    kind: CacheKind
    bytes_per_token: int = 0
    state_bytes: int = 0
    window: int | None = None
    heads: int = 0
    head_dim: int = 0

    def page_bytes(self, block_size: int) -> int:
        """Bytes of one block of this layer (vLLM ``page_size_bytes``)."""
        if self.kind is CacheKind.MAMBA:
            return self.state_bytes
        return block_size * self.bytes_per_token

    def max_usage_bytes(self, max_model_len: int, block_size: int,
                        max_num_batched_tokens: int) -> int:
        """The most one request can hold (vLLM ``max_memory_usage_bytes``)."""
        if self.kind is CacheKind.MAMBA:
            return self.state_bytes
        if self.kind is CacheKind.NONE:
            return 0
        if self.kind is CacheKind.SLIDING and self.window:
            tokens = min(self.window - 1 + max_num_batched_tokens, max_model_len)
            return (_cdiv(tokens, block_size) + 1) * self.page_bytes(block_size)
        return _cdiv(max_model_len, block_size) * self.page_bytes(block_size)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


_DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2, "fp8": 1,
                "fp8_e4m3": 1, "fp8_e5m2": 1, "auto": 2}


def dtype_bytes(name: str) -> int:
    return _DTYPE_BYTES[str(name).removeprefix("torch.")]


def _text_config(config: Any) -> Any:
    getter = getattr(config, "get_text_config", None)
    return getter() if callable(getter) else config


def _heads(config: Any) -> tuple[int, int]:
    """(KV heads, head dim) of a standard attention layer."""
    heads = getattr(config, "num_attention_heads", None) or getattr(config, "n_head")
    hidden = getattr(config, "hidden_size", None) or getattr(config, "n_embd")
    kv = getattr(config, "num_key_value_heads", None)
    if kv is None:
        kv = 1 if getattr(config, "multi_query", False) else heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    return int(kv), int(head_dim)


def layer_caches(config: Any, kv_bytes: int, state_bytes: int | None = None) -> list[LayerCache]:
    """The cache of every decoder layer of a transformers ``config``.

    Args:
        config: a ``PretrainedConfig`` (text part used for multimodal configs).
        kv_bytes: bytes per cached K/V value (2 for bf16/fp16, 1 for fp8).
        state_bytes: bytes per Mamba state value (vLLM keeps the model dtype by default).
    """
    config = _text_config(config)
    model_type = getattr(config, "model_type", "")
    state_bytes = kv_bytes if state_bytes is None else state_bytes
    layers = int(getattr(config, "num_hidden_layers", None) or getattr(config, "n_layer"))
    if model_type in ("mamba", "falcon_mamba"):
        inner = int(getattr(config, "intermediate_size", None)
                    or config.expand * config.hidden_size)
        conv = (int(config.conv_kernel) - 1) * inner
        ssm = inner * int(config.state_size)
        return [LayerCache(CacheKind.MAMBA, state_bytes=(conv + ssm) * state_bytes)] * layers
    if getattr(config, "kv_lora_rank", None):  # MLA: DeepSeek-V2/V3 and descendants
        latent = int(config.kv_lora_rank) + int(config.qk_rope_head_dim)
        return [LayerCache(CacheKind.MLA, bytes_per_token=latent * kv_bytes, heads=1,
                           head_dim=latent)] * layers
    kv_heads, head_dim = _heads(config)
    per_token = 2 * kv_heads * head_dim * kv_bytes
    window = getattr(config, "sliding_window", None)
    if getattr(config, "use_sliding_window", True) is False:
        window = None
    types = getattr(config, "layer_types", None)
    if types is None:
        types = ["sliding_attention" if window else "full_attention"] * layers
    caches = []
    for kind in types[:layers]:
        if kind == "sliding_attention" and window:
            caches.append(LayerCache(CacheKind.SLIDING, per_token, window=int(window),
                                     heads=kv_heads, head_dim=head_dim))
        elif kind in ("full_attention", "sliding_attention", "chunked_attention", "attention"):
            caches.append(LayerCache(CacheKind.FULL, per_token, heads=kv_heads,
                                     head_dim=head_dim))
        elif kind in ("mamba", "linear_attention"):
            inner = int(getattr(config, "mamba_expand", 2) * config.hidden_size)
            conv = (int(getattr(config, "mamba_d_conv", 4)) - 1) * inner
            ssm = inner * int(getattr(config, "mamba_d_state", 16))
            caches.append(LayerCache(CacheKind.MAMBA, state_bytes=(conv + ssm) * state_bytes))
        else:
            caches.append(LayerCache(CacheKind.NONE))
    return caches


def kv_bytes_per_token(caches: list[LayerCache]) -> int:
    """Cache bytes one more token of context adds, over all layers (sliding-window layers
    included, as for a context shorter than the window)."""
    return sum(c.bytes_per_token for c in caches)


@dataclass(frozen=True)
class BlockPlan:
    """vLLM's KV blocks for a memory budget.

    Attributes:
        num_blocks: blocks per layer of a group (vLLM's ``num_gpu_blocks``).
        block_size: tokens per block.
        tokens: ``num_blocks * block_size`` (vLLM's "GPU KV cache size: N tokens").
        page_bytes: bytes of one block of one layer.
        layers_per_group: layers sharing one block (the group size).
        groups: KV-cache groups (1 for a model whose layers all cache alike).
        blocks_per_request: blocks one request of ``max_model_len`` tokens needs.
        max_concurrency: ``num_blocks / blocks_per_request`` (vLLM's "Maximum concurrency").
    """

    num_blocks: int
    block_size: int
    tokens: int
    page_bytes: int
    layers_per_group: int
    groups: int
    blocks_per_request: int
    max_concurrency: float


def plan_blocks(caches: list[LayerCache], available_bytes: int, *, block_size: int,
                max_model_len: int, max_num_batched_tokens: int) -> BlockPlan:
    """Blocks and concurrency as vLLM V1 computes them for ``available_bytes`` of KV memory.

    Layers are grouped by cache spec; with one spec all layers form one group. With several
    (Gemma 2/3: sliding and full), the group size is the smallest count of layers of one
    kind, or the largest when it is under 1.5x the smallest, and every kind is split into
    groups of that size (``_get_kv_cache_groups_uniform_page_size``).
    """
    cached = [c for c in caches if c.kind is not CacheKind.NONE]
    if not cached:
        return BlockPlan(1, block_size, 0, 0, 0, 0, 0, float("inf"))
    by_spec = Counter(cached)
    counts = list(by_spec.values())
    group_size = min(counts)
    if max(counts) < 1.5 * min(counts):
        group_size = max(counts)
    groups: list[LayerCache] = []
    for spec, count in by_spec.items():
        groups += [spec] * _cdiv(count, group_size)
    page = max(spec.page_bytes(block_size) for spec in by_spec)
    num_blocks = max(int(available_bytes // page // group_size), 0)
    per_request = group_size * sum(
        spec.max_usage_bytes(max_model_len, block_size, max_num_batched_tokens)
        for spec in groups)
    blocks_per_request = _cdiv(per_request, page * group_size)
    concurrency = num_blocks / blocks_per_request if blocks_per_request else float("inf")
    return BlockPlan(num_blocks=num_blocks, block_size=block_size,
                     tokens=num_blocks * block_size, page_bytes=page,
                     layers_per_group=group_size, groups=len(groups),
                     blocks_per_request=blocks_per_request, max_concurrency=concurrency)
