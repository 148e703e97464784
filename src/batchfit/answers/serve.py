"""Serving capacity: how many tokens of KV cache, and how many concurrent sequences, fit next
to the weights.

vLLM (``engine="vllm"``), as its V1 worker sizes the cache (``gpu_worker.py``,
``determine_available_memory``)::

    requested = total_memory * gpu_memory_utilization
    available = requested - weights - activation peak of the profile run - non-torch memory
    num_blocks = available // page_bytes // layers_per_group      (kv_cache_utils.py)

The profile run is a forward of ``max_num_batched_tokens`` tokens (split over up to
``max_num_seqs`` requests) followed by a dummy sampler run over one row per request. batchfit
traces that forward on the target GPU (flash attention where the card and dtype allow it:
memory linear in the tokens; before sm80, where vLLM V1 runs FlashInfer or Triton attention
since FlashAttention needs sm80 (``_get_backend_priorities`` in vllm/platforms/cuda.py), the
trace's fp16 memory-efficient kernel, also linear; the dtype follows the card as vLLM's does,
:func:`_serving_dtype`, so the trace does not fall back to the math path's seq x seq scores,
which no vLLM backend allocates, for a dtype the card lacks) and adds the sampler: the
logits of ``max_num_seqs`` rows in the model dtype, their float32 copy and float32
probabilities. vLLM's V0 engine (``vllm_engine="v0"``,
vLLM <= 0.6) samples its profile requests with top-p 0.99 and top-k vocab - 1, whose sort of
the logits sets the peak instead (:func:`sampler_bytes`). ``non_torch`` is what the
engine measures outside torch's allocator after its startup snapshot (cuBLAS/NCCL state);
it is an input, 0.35 GiB by default (vLLM 0.6 printed ``non_torch_memory=0.35GiB`` for one
RTX 3090, vllm-project/vllm#10517). The KV cache layout per layer is
:mod:`batchfit.answers.kvcache`.

``engine="hf"``: ``model.generate`` with transformers' dynamic cache, batch ``B``, a prompt of
``P`` tokens and ``N`` new ones: the prefill forward is traced (``use_cache=True``, logits of the
last position only, as ``generate`` asks since transformers 4.45), and decoding adds, per
step, the cache growing by one token per layer (``torch.cat`` makes the new K and V while the
old ones live) and one row of logits; the peak is the larger of the two.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

from batchfit.answers.kvcache import (
    BlockPlan,
    CacheKind,
    LayerCache,
    dtype_bytes,
    kv_bytes_per_token,
    layer_caches,
    plan_blocks,
)
from batchfit.device.profile import DeviceProfile, marketed_memory_note, resolve_device
from batchfit.errors import InvalidInputError, option

GiB = 1 << 30
#: vLLM 0.6's measured non-torch memory on one RTX 3090 (vllm-project/vllm#10517).
DEFAULT_NON_TORCH_BYTES = int(0.35 * GiB)


#: Results kept for the process: weights by (model, overrides, dtype), profile peaks by
#: those and the run's shape (a library caller asking about several cache settings).
_WEIGHTS: dict[tuple, int] = {}
_PROFILE_RUNS: dict[tuple, int] = {}


class Engine(StrEnum):
    VLLM = "vllm"
    HF = "hf"


#: The engine asked about when none is named.
DEFAULT_ENGINE = Engine.VLLM


class VllmEngine(StrEnum):
    """Which vLLM engine sizes the cache: V1 (vLLM >= 0.8's default) or V0 (vLLM <= 0.6)."""

    V1 = "v1"
    V0 = "v0"


@dataclass(frozen=True)
class ServeResult:
    """Serving capacity of a model on a GPU.

    Attributes:
        engine: ``vllm`` or ``hf``.
        model: the model spec.
        device: the GPU profile.
        dtype: weight and activation dtype; ``kv_dtype`` the cache's.
        weights_bytes: the weights as loaded.
        activation_peak_bytes: the profile run's peak beyond the weights (vLLM) or the
            generate step's (hf).
        non_torch_bytes, requested_bytes: vLLM's accounting (0 for hf).
        kv_cache_bytes: memory for the cache.
        kv_bytes_per_token: cache bytes one token of context adds (all layers).
        state_bytes_per_sequence: fixed per-sequence cache (Mamba layers).
        plan: vLLM's blocks (None for hf).
        max_model_len: the context each request may reach.
        max_concurrency: requests of ``max_model_len`` tokens that fit at once.
        layer_kinds: count of layers per cache kind.
        hf: for ``engine=hf``: batch size, prompt and new tokens, peaks and the largest batch.
        vllm_engine: ``v1`` or ``v0``: whose profile run (sampler) was modelled.
        concurrency_by_context: vLLM: ``(max_model_len, max_concurrency)`` at shorter
            contexts with the same KV memory (the profile run does not depend on the
            context): powers of two from 1,024 tokens, then ``max_model_len`` itself.
        notes: what the answer assumed that the user did not ask for (a dtype the card
            forced, a card total the catalog lacks).
    """

    engine: Engine
    model: str
    device: DeviceProfile
    dtype: str
    kv_dtype: str
    weights_bytes: int
    activation_peak_bytes: int
    non_torch_bytes: int
    requested_bytes: int
    kv_cache_bytes: int
    kv_bytes_per_token: int
    state_bytes_per_sequence: int
    plan: BlockPlan | None
    max_model_len: int
    max_concurrency: float
    layer_kinds: dict[str, int]
    hf: dict[str, Any] = field(default_factory=dict)
    vllm_engine: str = "v1"
    notes: tuple[str, ...] = ()
    concurrency_by_context: tuple[tuple[int, float], ...] = ()

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "engine": self.engine.value, "model": self.model, "device": self.device.to_dict(),
            "dtype": self.dtype, "kv_dtype": self.kv_dtype,
            "weights_bytes": self.weights_bytes,
            "activation_peak_bytes": self.activation_peak_bytes,
            "non_torch_bytes": self.non_torch_bytes, "requested_bytes": self.requested_bytes,
            "kv_cache_bytes": self.kv_cache_bytes, "kv_bytes_per_token": self.kv_bytes_per_token,
            "state_bytes_per_sequence": self.state_bytes_per_sequence,
            "max_model_len": self.max_model_len,
            "max_concurrency": round(self.max_concurrency, 4),
            "layer_kinds": self.layer_kinds, "notes": list(self.notes),
            # a result means the weights and the profile run fit (else DoesNotFitError)
            "fits": True,
        }
        if self.plan is not None:
            data.update(vllm_engine=self.vllm_engine,
                        num_blocks=self.plan.num_blocks, block_size=self.plan.block_size,
                        kv_tokens=self.plan.tokens, page_bytes=self.plan.page_bytes,
                        blocks_per_request=self.plan.blocks_per_request,
                        kv_cache_groups=self.plan.groups,
                        concurrency_by_context=[
                            {"max_model_len": tokens, "max_concurrency": round(requests, 4)}
                            for tokens, requests in self.concurrency_by_context])
        if self.hf:
            data["hf"] = self.hf
        return data


_DTYPES = {"auto": None, "bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16",
           "float16": "float16", "half": "float16", "fp32": "float32", "float32": "float32"}
_KV_DTYPES = {"auto": None, "fp16": "float16", "float16": "float16", "bf16": "bfloat16",
              "bfloat16": "bfloat16", "fp8": "fp8", "fp8_e4m3": "fp8", "fp8_e5m2": "fp8"}


#: vLLM's ``CudaPlatformBase.supported_dtypes`` (vllm/platforms/cuda.py): bfloat16 from
#: compute capability 8.0 (Ampere) on; Pascal, Volta and Turing serve float16 or float32.
_BF16_FROM_CC = (8, 0)


def _serving_dtype(model: str, dtype: str, profile: DeviceProfile) -> tuple[str, str | None]:
    """``dtype``: the dtype served and a note where ``auto`` left the checkpoint's.

    ``auto`` is the checkpoint's dtype, float16 for float32 checkpoints; a bfloat16
    checkpoint on a card without bfloat16 is served in float16, as vLLM's
    ``_resolve_auto_dtype`` (vllm/config/model.py) falls back to the first of the platform's
    ``supported_dtypes`` with a warning (``engine=hf`` follows the card too). An explicit
    bfloat16 there is refused, as vLLM's worker refuses it ("Bfloat16 is only supported on
    GPUs with compute capability of at least 8.0"), and as batchfit refuses bf16 for any
    step on such a card (:func:`batchfit.answers.estimate.step_profile`).
    """
    from batchfit.models.resolve import checkpoint_dtype

    chosen = _DTYPES.get(str(dtype).lower(), "invalid")
    if chosen == "invalid":
        raise InvalidInputError(f"unknown {option('dtype')} {dtype!r}: use auto, bf16, fp16 or fp32")
    cc = profile.compute_capability
    has_bf16 = cc is None or tuple(cc) >= _BF16_FROM_CC
    if chosen == "bfloat16" and not has_bf16:
        raise InvalidInputError(
            f"{profile.name} has no bfloat16 (compute capability {cc[0]}.{cc[1]}, bf16 needs "
            f"8.0 or later): use {option('dtype', 'fp16')}")
    if chosen is not None:
        return chosen, None
    stored = checkpoint_dtype(model) if str(model).startswith("hf:") else None
    if stored in (None, "float32"):
        return "float16", None
    if stored == "bfloat16" and not has_bf16:
        return "float16", (f"{model} is stored in bfloat16, which {profile.name} lacks "
                           f"(compute capability {cc[0]}.{cc[1]}): served in float16, as vLLM "
                           "serves it")
    return stored, None


def _meta_model(config: Any, dtype: str) -> Any:
    """The causal LM on meta, in ``dtype``."""
    import torch

    from batchfit.engine.fake import build_on_meta
    from batchfit.engine.step import torch_dtype
    from batchfit.models.resolve import HFTask, _build_hf

    previous = torch.get_default_dtype()
    try:
        torch.set_default_dtype(torch_dtype(dtype))
        return build_on_meta(functools.partial(_build_hf, config, HFTask.CAUSAL_LM, "sdpa"))
    finally:
        torch.set_default_dtype(previous)


def _weights_bytes(model: Any) -> int:
    """Bytes of every parameter of ``model`` (tied weights once)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def serve_capacity(model: str, *, device: DeviceProfile | str,
                   engine: Engine | str = DEFAULT_ENGINE, max_model_len: int | None = None,
                   gpu_memory_utilization: float = 0.9,
                   dtype: str = "auto", kv_dtype: str = "auto", block_size: int = 16,
                   max_num_batched_tokens: int = 8192, max_num_seqs: int = 256,
                   non_torch_bytes: int | None = None, total_memory_bytes: int | None = None,
                   batch_size: int = 1, prompt_len: int | None = None, new_tokens: int = 256,
                   model_kwargs: dict[str, Any] | None = None, quant: Any = None,
                   all_logits: bool = False, vllm_engine: VllmEngine | str = "v1") -> ServeResult:
    """How many tokens of KV cache and concurrent sequences fit (see the module docstring).

    Args:
        model: ``hf:NAME`` (offline table or a directory with ``config.json``).
        device: a catalog GPU name or a CUDA :class:`DeviceProfile`.
        engine: ``vllm`` or ``hf``.
        max_model_len: the context per request (default: the model's).
        gpu_memory_utilization: vLLM's fraction of the card it may use.
        dtype, kv_dtype: ``auto`` follows the checkpoint (vLLM); ``fp8`` halves the cache.
        block_size: tokens per KV block.
        max_num_batched_tokens, max_num_seqs: the profile run's tokens and requests.
        non_torch_bytes: vLLM's non-torch memory (default 0.35 GiB).
        total_memory_bytes: the card's memory as CUDA reports it (default: the catalog's).
        batch_size, prompt_len, new_tokens: ``engine=hf``'s generate call.
        model_kwargs: config overrides.
        quant: ``engine=hf``: bitsandbytes weights (nf4, nf4-dq, fp4, fp4-dq, int8).
        all_logits: ``engine=hf``: the prefill computes every prompt position's logits, as
            ``generate`` did before transformers 4.45 (``logits_to_keep``).
        vllm_engine: ``v1`` (default) or ``v0``: the engine whose profile run is modelled;
            only its sampler differs (:func:`sampler_bytes`).

    Example:
        >>> r = serve_capacity("hf:Qwen/Qwen2.5-0.5B", device="A100 80GB", max_model_len=4096,
        ...                    max_num_batched_tokens=512)   # doctest: +SKIP
        >>> r.plan.num_blocks > 0  # doctest: +SKIP
        True
    """
    from batchfit.models.resolve import _max_positions, load_hf_config

    if str(engine).lower() not in ("vllm", "hf"):
        raise InvalidInputError(f"unknown {option('engine')} {engine!r}: use vllm or hf")
    engine = Engine(str(engine).lower())
    if str(vllm_engine).lower() not in ("v0", "v1"):
        raise InvalidInputError(f"unknown {option('vllm_engine')} {vllm_engine!r}: use v1 or v0")
    vllm_engine = VllmEngine(str(vllm_engine).lower())
    profile = resolve_device(device)
    if not profile.is_cuda:
        raise InvalidInputError(f"serving capacity is for a GPU: give {option('gpu', 'NAME')}")
    if total_memory_bytes is not None:
        profile = replace(profile, total_memory_bytes=int(total_memory_bytes))
    if not 0 < gpu_memory_utilization <= 1:
        raise InvalidInputError(
            f"{option('gpu_memory_utilization', gpu_memory_utilization)} must be in (0, 1], e.g. 0.9")
    for name, value in (("block_size", block_size), ("max_num_seqs", max_num_seqs),
                        ("max_num_batched_tokens", max_num_batched_tokens),
                        ("batch_size", batch_size), ("new_tokens", new_tokens)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidInputError(f"{option(name)} must be a positive integer, not {value!r}")
    if not str(model).startswith("hf:"):
        raise InvalidInputError(f"serve takes an hf:NAME model; {model!r} is not one")
    config = load_hf_config(model, model_kwargs)
    context = _max_positions(config) or 2048
    if max_model_len is None:
        max_model_len = context
    elif max_model_len < 1:
        raise InvalidInputError(f"{option('max_model_len')} must be positive, not {max_model_len}")
    elif max_model_len > context:
        raise InvalidInputError(
            f"{option('max_model_len', max_model_len)} is above {model}'s context of "
            f"{context} tokens (max_position_embeddings): use "
            f"{option('max_model_len', context)} or less")
    chosen, dtype_note = _serving_dtype(model, dtype, profile)
    notes = tuple(n for n in (dtype_note, None if total_memory_bytes is not None
                              else marketed_memory_note(profile)) if n)
    kv_name = _KV_DTYPES.get(str(kv_dtype).lower(), "invalid")
    if kv_name == "invalid":
        raise InvalidInputError(f"unknown {option('kv_dtype')} {kv_dtype!r}: use auto, fp16, bf16 or fp8")
    kv_name = kv_name or chosen
    caches = layer_caches(config, dtype_bytes(kv_name), state_bytes=dtype_bytes(chosen))
    if engine is Engine.HF:
        return replace(_serve_hf(model, config, profile, chosen, kv_name, caches,
                                 max_model_len, batch_size, prompt_len, new_tokens, quant,
                                 all_logits), notes=notes)
    if quant is not None:
        raise InvalidInputError(f"{option('quant')} applies to {option('engine', 'hf')} "
                                 "(bitsandbytes in transformers)")
    key = (model, repr(sorted((model_kwargs or {}).items())), chosen)
    run = (*key, profile.compute_capability, max_num_batched_tokens, max_num_seqs, vllm_engine)
    built = None
    if key not in _WEIGHTS or run not in _PROFILE_RUNS:
        built = _meta_model(config, chosen)  # once for both (a 70B build: ~2.5 s)
        _WEIGHTS[key] = _weights_bytes(built)
    weights = _WEIGHTS[key]
    if run not in _PROFILE_RUNS:  # the same forward whatever the cache's dtype or size
        _PROFILE_RUNS[run] = _profile_activation(built.base_model, config, chosen, profile,
                                                 max_num_batched_tokens, max_num_seqs,
                                                 vllm_engine)
    activation = _PROFILE_RUNS[run]
    non_torch = DEFAULT_NON_TORCH_BYTES if non_torch_bytes is None else int(non_torch_bytes)
    requested = math.ceil(profile.total_memory_bytes * gpu_memory_utilization)
    available = requested - weights - activation - non_torch
    if available <= 0:
        from batchfit.errors import DoesNotFitError

        raise DoesNotFitError(
            f"{model} leaves no memory for the KV cache on {profile.name}: weights "
            f"{weights / GiB:.2f} GiB + profile peak {activation / GiB:.2f} GiB + non-torch "
            f"{non_torch / GiB:.2f} GiB exceed {gpu_memory_utilization:.0%} of the card",
            needed_bytes=weights + activation + non_torch, available_bytes=requested)
    def blocks(context: int) -> BlockPlan:
        return plan_blocks(caches, available, block_size=block_size, max_model_len=context,
                           max_num_batched_tokens=max_num_batched_tokens)

    plan = blocks(max_model_len)
    contexts = [*(1 << n for n in range(10, max_model_len.bit_length())
                  if 1 << n < max_model_len), max_model_len]
    return ServeResult(
        engine=engine, model=model, device=profile, dtype=chosen, kv_dtype=kv_name,
        weights_bytes=weights, activation_peak_bytes=activation, non_torch_bytes=non_torch,
        requested_bytes=requested, kv_cache_bytes=available,
        kv_bytes_per_token=kv_bytes_per_token(caches),
        state_bytes_per_sequence=sum(c.state_bytes for c in caches), plan=plan,
        max_model_len=max_model_len, max_concurrency=plan.max_concurrency,
        layer_kinds=_kinds(caches), vllm_engine=vllm_engine.value, notes=notes,
        concurrency_by_context=tuple((c, blocks(c).max_concurrency) for c in contexts))


def _kinds(caches: list[LayerCache]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for cache in caches:
        counts[cache.kind.value] = counts.get(cache.kind.value, 0) + 1
    return counts


def _profile_activation(base: Any, config: Any, dtype: str, profile: DeviceProfile,
                        tokens: int, max_num_seqs: int,
                        vllm_engine: VllmEngine = VllmEngine.V1) -> int:
    """The profile run's torch peak beyond the weights: the traced decoder forward over
    ``tokens`` tokens, or the sampler run (hidden states + logits rows), the larger."""
    from batchfit.answers.estimate import estimate
    from batchfit.engine.spec import TensorSpec, TrainConfig
    from batchfit.engine.tracer import Category

    precision = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}[dtype]
    config_infer = TrainConfig(mode="infer", precision=precision)
    vocab = int(getattr(config, "vocab_size", 32000))
    spec = {"input_ids": TensorSpec((tokens,), "int64", low=0, high=vocab)}
    est = estimate(base, spec, 1, config_infer, device=profile, first_step=False)
    held = est.by_category
    weights_in_trace = held.get(Category.PARAMETERS, 0) + held.get(Category.BUFFERS, 0)
    forward = est.peak_allocated_bytes - weights_in_trace
    # transformers' decoders keep the embedding output (``inputs_embeds``) referenced for
    # the whole forward; vLLM's model code reassigns ``hidden_states`` and lets it go after
    # the first layer (vllm/model_executor/models/llama.py), holding three hidden-sized
    # tensors in a later layer's MLP (the layer input, the MLP input, the residual) where
    # the transformers forward holds four. Measured against vLLM's printed profile peak
    # for Llama-3.1-8B at 20,000 and 29,000 tokens (vllm-project/vllm#10517): 2.07 and
    # 2.99 GiB; the transformers forward 2.22 and 3.24; less the embedding, 2.07 and 3.02.
    embedding = _embedding_path(est)
    if embedding and not est.peak_module.startswith(_first_layer(est.peak_module)):
        forward -= sum(m.bytes for m in est.top_modules if m.module == embedding)
    size = dtype_bytes(dtype)
    hidden = int(getattr(config, "hidden_size", 0)) * tokens * size
    rows = min(max_num_seqs, tokens)
    return max(forward, hidden + sampler_bytes(rows, vocab, size, vllm_engine))


def sampler_bytes(rows: int, vocab: int, size: int, engine: VllmEngine | str = "v1") -> int:
    """The peak of the profile run's sampler over ``rows`` rows of ``vocab`` logits in a
    ``size``-byte model dtype (the final hidden states the runner holds come on top).

    V1: the dummy sampler run holds the logits, their float32 copy and the float32
    probabilities: ``size + 4 + 4`` bytes per logit.

    V0 (vLLM <= 0.6; read in vLLM 0.6.5): ``ModelRunner.profile_run``
    (vllm/worker/model_runner.py) gives every dummy request ``SamplingParams(top_p=0.99,
    top_k=vocab_size - 1)``, so ``Sampler.forward`` (vllm/model_executor/layers/sampler.py;
    the torch path, ``VLLM_USE_FLASHINFER_SAMPLER`` being off by default) makes the float32
    copy (``logits.to(torch.float)``, none for float32 models) while ``execute_model`` still
    holds the model-dtype logits, and ``_apply_top_k_top_p`` sorts it: ``logits.sort(dim=-1)``,
    float32 values and int64 indices. Inside the sort, torch's stable sort
    (aten/src/ATen/native/cuda/SortStable.cu, ``launch_stable_sort_kernel``) allocates scratch
    through the caching allocator: for 128 rows or more, ``segmented_sort_pairs``'s int64
    reverse indices and CUB's segmented radix sort's alternate key (4 B) and value (8 B)
    buffers, 20 B per logit; for 2 to 127 rows, ``segmented_sort_pairs_by_full_sort``'s two
    int2 buffers, ``radix_sort_pairs``' keys-out buffer and CUB's alternate buffers, 32 B;
    for one row (or rows of a million or more, sorted one at a time), int64 indices and CUB's
    buffers of one row. The steps after the sort stay below it: the masks, softmax, cumsum
    and the scatter back hold ``size + 30`` B per logit, the probabilities, log-probabilities
    and the multinomial's two copies ``size + 20``.
    """
    elements = rows * vocab
    if VllmEngine(str(engine).lower()) is VllmEngine.V1:
        return elements * (size + 4 + 4)
    upcast = 0 if size == 4 else 4
    held = elements * (size + upcast + 4 + 8)  # logits, float32 copy, sorted values, indices
    if rows == 1 or vocab >= 1_000_000:
        scratch = vocab * (8 + 4 + 8)
    elif rows < 128:
        scratch = elements * (8 + 8 + 4 + 4 + 8)
    else:
        scratch = elements * (8 + 4 + 8)
    after = elements * (size + upcast + 26)  # the scatter back: sort, masks, probs, cumsum, out
    return max(held + scratch, after)


def _embedding_path(est: Any) -> str | None:
    """The input embedding's module path among the peak's modules (``embed_tokens``,
    ``wte``, ``embeddings``)."""
    for name in ("embed_tokens", "wte", "embeddings", "word_embeddings"):
        if any(m.module == name for m in est.top_modules):
            return name
    return None


def _first_layer(module: str) -> str:
    """``layers.0`` for ``layers.1.mlp``: the stack's first block (or the module itself)."""
    parts = module.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[:i] + ["0"])
    return module


def _serve_hf(model: str, config: Any, profile: DeviceProfile, dtype: str, kv_name: str,
              caches: list[LayerCache], max_model_len: int, batch_size: int,
              prompt_len: int | None, new_tokens: int, quant: Any,
              all_logits: bool = False) -> ServeResult:
    """``model.generate``: the traced prefill, then the decode steps' growth."""
    from batchfit.answers.estimate import estimate
    from batchfit.engine.spec import TensorSpec, TrainConfig

    if prompt_len is None:
        prompt_len = max(1, max_model_len - new_tokens)
    if prompt_len < 1 or prompt_len + new_tokens > max_model_len:
        raise InvalidInputError(
            f"{option('prompt_len', prompt_len)} + {option('new_tokens', new_tokens)} exceeds "
            f"{option('max_model_len', max_model_len)}")
    precision = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}[dtype]
    train = TrainConfig(mode="infer", precision=precision, quant=quant)
    vocab = int(getattr(config, "vocab_size", 32000))
    spec = {"input_ids": TensorSpec((prompt_len,), "int64", low=0, high=vocab)}
    factory = functools.partial(_generate_model, config, all_logits)
    prefill = estimate(factory, spec, batch_size, train, device=profile, first_step=False)
    prefill_one = estimate(factory, spec, 1, train, device=profile, first_step=False) \
        if batch_size != 1 else prefill
    weights = _trace_weights(prefill)
    per_token = kv_bytes_per_token(caches)
    state = sum(c.state_bytes for c in caches)
    final = prompt_len + new_tokens
    # transformers' DynamicCache keeps a sliding-window layer's last `window` tokens only
    held = [c.bytes_per_token * (min(final, c.window) if c.kind is CacheKind.SLIDING
                                 and c.window else final) for c in caches]
    cache_at_end = sum(held) + state
    size = dtype_bytes(dtype)

    def decode_peak(batch: int) -> int:
        # weights + the whole cache at the last step + the new K/V of one layer made by
        # torch.cat while the old ones live + a row of logits (model dtype and float32)
        return (weights + batch * (cache_at_end + max(held, default=0))
                + batch * vocab * (size + 4))

    def prefill_peak(batch: int) -> int:
        slope = prefill.peak_reserved_bytes - prefill_one.peak_reserved_bytes
        per = slope / (batch_size - 1) if batch_size > 1 else prefill_one.peak_reserved_bytes - weights
        return int(prefill_one.peak_reserved_bytes + per * (batch - 1))

    peak = max(prefill.peak_reserved_bytes, decode_peak(batch_size))
    budget = profile.total_memory_bytes - profile.context_bytes
    largest = 0
    low, high = 0, 1
    while max(prefill_peak(high), decode_peak(high)) <= budget and high < 1 << 20:
        low, high = high, high * 2
    while high - low > 1:
        mid = (low + high) // 2
        if max(prefill_peak(mid), decode_peak(mid)) <= budget:
            low = mid
        else:
            high = mid
    largest = low
    hf = {"batch_size": batch_size, "prompt_len": prompt_len, "new_tokens": new_tokens,
          "all_logits": all_logits,
          "prefill_peak_bytes": prefill.peak_reserved_bytes,
          "prefill_allocated_bytes": prefill.peak_allocated_bytes,
          "decode_peak_bytes": decode_peak(batch_size), "peak_bytes": peak,
          "total_bytes": peak + profile.context_bytes, "max_batch_size": largest,
          "quant": quant}
    concurrency = (budget - weights) / max(1, cache_at_end)
    return ServeResult(
        engine=Engine.HF, model=model, device=profile, dtype=dtype, kv_dtype=kv_name,
        weights_bytes=weights, activation_peak_bytes=peak - weights, non_torch_bytes=0,
        requested_bytes=budget, kv_cache_bytes=batch_size * cache_at_end,
        kv_bytes_per_token=per_token, state_bytes_per_sequence=state, plan=None,
        max_model_len=max_model_len, max_concurrency=concurrency, layer_kinds=_kinds(caches),
        hf=hf)


def _trace_weights(est: Any) -> int:
    from batchfit.engine.tracer import Category

    held = est.by_category
    return held.get(Category.PARAMETERS, 0) + held.get(Category.BUFFERS, 0)


def _prefill_kwargs(module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """What ``generate`` passes to the prefill forward: keep the cache, and compute the
    logits of the last position only (``logits_to_keep=1``)."""
    return args, {**kwargs, "use_cache": True, "logits_to_keep": 1}


def _prefill_all_logits(module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``generate`` before transformers 4.45: every prompt position's logits."""
    return args, {**kwargs, "use_cache": True}


def _generate_model(config: Any, all_logits: bool = False) -> Any:
    """The causal LM, its forward called as ``generate``'s prefill calls it."""
    from batchfit.models.resolve import HFTask, _build_hf

    model = _build_hf(config, HFTask.CAUSAL_LM, "sdpa")
    model.register_forward_pre_hook(_prefill_all_logits if all_logits else _prefill_kwargs,
                                    with_kwargs=True)
    return model
