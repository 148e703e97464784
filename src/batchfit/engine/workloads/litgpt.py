"""litgpt's model where it holds memory differently from transformers' + peft's.

batchfit traces transformers' model with peft's LoRA; ``litgpt finetune_lora`` trains
litgpt's own ``GPT`` (``litgpt/model.py``, ``litgpt/lora.py``) under Lightning Fabric. The
``litgpt`` recipe makes the traced model hold what litgpt's holds. Read in
Lightning-AI/litgpt at v0.5.13 (commit 26857050fe3f) and at the commits of its published
config-hub tables (00af8b0d, 5895df10), which agree on all three points:

* **A separate output head.** ``GPT.__init__`` (litgpt/model.py) always builds
  ``self.lm_head = nn.Linear(config.n_embd, config.padded_vocab_size)`` next to
  ``transformer.wte``, and ``copy_weights_hf_llama`` (litgpt/scripts/convert_hf_checkpoint.py)
  fills ``lm_head.weight`` from the embedding when a tied checkpoint (Llama 3.2, Gemma) has
  none; ``finetune/lora.py::validate_args`` refuses ``tie_embeddings``. So a model that
  transformers ties holds a second ``vocabulary x hidden`` weight in litgpt.
* **Every linear layer is quantized, the head too, from float16.** Lightning's
  ``BitsandbytesPrecision`` (lightning/fabric/plugins/precision/bitsandbytes.py,
  ``_convert_layers``) swaps every ``nn.Linear`` whose name is not in ``ignore_modules``,
  which ``finetune/lora.py`` never passes (transformers keeps ``lm_head`` in 16 bits), and
  ``_Linear4bit.quantize`` quantizes ``weight.contiguous().to(device, dtype=torch.half)``
  (the same in Lightning 2.1.0, 2.4.0 and 2.6.6):
  the quant state's dtype is float16, so bitsandbytes' ``dequantize_4bit`` writes a float16
  weight that ``MatMul4Bit`` then copies to the bf16 compute dtype (``.to(A.dtype)``).
* **Keys and values at every query head.** With grouped-query attention litgpt's
  ``CausalSelfAttention.forward`` repeats k and v to ``n_head`` heads before SDPA
  (``k.expand(...)`` then ``k.reshape(B, -1, T, hs)`` at 00af8b0d and 5895df10,
  ``k.repeat_interleave(q_per_kv, dim=1)`` at v0.5.13; "flash attention requires it in
  training mode"), so SDPA keeps the repeated copies for backward; transformers passes the
  grouped k and v with ``enable_gqa=True`` (``sdpa_attention_forward``, no mask).
* **The head on 128-token chunks.** ``fit`` calls ``model(input_ids, lm_head_chunk_size=128)``
  (finetune/lora.py), and litgpt's LoRA ``GPT.forward`` (litgpt/lora.py) returns
  ``[self.lm_head(x_i) for x_i in x.split(lm_head_chunk_size, dim=1)]``, which
  ``chunked_cross_entropy`` (litgpt/utils.py) takes chunk by chunk: no ``B x T x V`` logits
  or logits gradient is ever made in one piece, and a LoRA head's intermediates are one
  chunk's.
* **Float32 logits, held until the next step's.** Fabric's model wrapper
  (lightning/fabric/wrappers.py, ``_FabricModule.forward``) returns
  ``precision.convert_output(output)``, and both ``HalfPrecision`` (``bf16-true``) and
  ``BitsandbytesPrecision`` convert every floating output to ``torch.get_default_dtype()``,
  float32 in litgpt's process (the same in Lightning 2.1.0, 2.4.0 and 2.6.6): each bf16
  logits chunk becomes a float32 copy, and ``chunked_cross_entropy`` runs on those (its
  log-softmax, kept for backward, is float32 too). ``fit`` assigns ``logits = model(...)``,
  so the previous step's float32 logits live until the new ones are made.
* **One LoRA dropout for q, k and v.** litgpt fuses them in one ``attn`` linear, a
  ``LoRAQKVLinear`` whose ``forward`` runs ``self.lora_dropout(x)`` once on the fused
  projection's input (``lora_A`` covers every enabled part), where peft's ``q_proj``,
  ``k_proj`` and ``v_proj`` each run their own dropout: one mask and one dropped input per
  attention instead of one per adapted projection. The MLP's ``fc_1``/``fc_2``/``proj`` are
  separate ``LoRALinear``\\ s in litgpt too, each with its own dropout, as in peft.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from batchfit.engine.workloads.losses import (LITGPT_CHUNK_TOKENS, _mean, _shifted_labels,
                                              base_model_of)

#: transformers' names of the projections litgpt fuses in ``attn`` (``LoRAQKVLinear``).
QKV_NAMES = ("q_proj", "k_proj", "v_proj")
#: ``_Linear4bit.quantize``: ``weight.contiguous().to(device=device, dtype=torch.half)``
QUANTIZED_FROM = torch.float16
#: Fabric's ``convert_output``: ``torch.get_default_dtype()``, which litgpt leaves at float32
FABRIC_OUTPUT_DTYPE = torch.float32


def untie_output_embedding(model: nn.Module) -> None:
    """Give a tied output head its own weight, as litgpt's converted checkpoint has.

    A no-op for a model whose head is already separate (or that has none).
    """
    get_head = getattr(model, "get_output_embeddings", None)
    get_embedding = getattr(model, "get_input_embeddings", None)
    head = get_head() if get_head is not None else None
    embedding = get_embedding() if get_embedding is not None else None
    if head is None or embedding is None or head.weight is not embedding.weight:
        return
    tied = embedding.weight
    head.weight = nn.Parameter(torch.empty_like(tied), requires_grad=tied.requires_grad)
    config = getattr(model, "config", None)
    if config is not None:
        config.tie_word_embeddings = False  # so a later tie_weights() keeps them apart


def litgpt_quant(quant: Any) -> Any:
    """``quant`` as Lightning's plugin applies it: no module kept in 16 bits (unless the
    user named some with ``skip_modules``)."""
    from dataclasses import replace

    if quant is None or quant.skip_modules is not None:
        return quant
    return replace(quant, skip_modules=())


#: The attention implementation name (transformers' registry) of litgpt's SDPA call.
LITGPT_SDPA = "batchfit-litgpt-sdpa"


def expanded_kv_sdpa(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                     value: torch.Tensor, attention_mask: Any, **kwargs: Any) -> Any:
    """transformers' SDPA attention with k and v repeated to every query head first, as
    litgpt's attention does."""
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    if groups > 1:
        key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    # the repeated heads are the query heads: nothing left to group
    ungrouped = SimpleNamespace(num_key_value_groups=1,
                                is_causal=getattr(module, "is_causal", True))
    return sdpa_attention_forward(ungrouped, query, key, value, attention_mask, **kwargs)


@functools.cache
def _register_litgpt_sdpa() -> None:
    """Add :data:`LITGPT_SDPA` to transformers' attention and mask registries (a new name
    next to theirs; no existing entry changes), with SDPA's mask."""
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register(LITGPT_SDPA, expanded_kv_sdpa)
    AttentionMaskInterface.register(LITGPT_SDPA, sdpa_mask)


def expand_kv_heads(model: nn.Module) -> bool:
    """Run ``model``'s SDPA attention as litgpt's, with k and v repeated to every query head.
    Returns whether it did: a model on another attention implementation keeps it."""
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    _register_litgpt_sdpa()
    config._attn_implementation = LITGPT_SDPA
    return True


class FusedQKVDropout(nn.Module):
    """One dropout on the input of an attention's q, k and v adapters, as litgpt's
    ``LoRAQKVLinear`` runs it: the first adapter called drops the input, the others reuse
    that output while the attention's forward lasts (:meth:`release`, a forward hook on the
    attention, lets it go, so nothing outlives what autograd saves)."""

    def __init__(self, dropout: nn.Module) -> None:
        super().__init__()
        self.dropout = dropout
        self._input: torch.Tensor | None = None
        self._output: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._input is not x:
            self._input, self._output = x, self.dropout(x)
        return self._output

    def release(self, *args: Any) -> None:
        """Forward hook of the attention module: its q, k and v have all run."""
        self._input = self._output = None


def fuse_qkv_dropout(model: nn.Module) -> int:
    """Make the LoRA dropout of each attention's adapted q, k and v one dropout (litgpt's
    fused ``attn``). Returns how many attentions now share one; an attention with fewer
    than two of them adapted, or without dropout, keeps its own."""
    from peft.tuners.lora import LoraLayer

    groups: dict[str, list[Any]] = {}
    for name, module in model.named_modules():
        parent, _, leaf = name.rpartition(".")
        if isinstance(module, LoraLayer) and leaf in QKV_NAMES:
            groups.setdefault(parent, []).append(module)
    fused = 0
    for parent, layers in groups.items():
        if len(layers) < 2:
            continue
        for adapter, dropout in list(layers[0].lora_dropout.items()):
            if isinstance(dropout, nn.Identity):
                continue  # dropout=0: peft runs no dropout at all
            shared = FusedQKVDropout(dropout)
            for layer in layers:
                layer.lora_dropout[adapter] = shared
            model.get_submodule(parent).register_forward_hook(shared.release)
            fused += 1
    return fused


class ChunkedHead(nn.Module):
    """litgpt's output head as its LoRA ``GPT.forward`` runs it in training: on each
    128-token chunk of the final norm's output, returning the list of chunk logits."""

    def __init__(self, head: nn.Module) -> None:
        super().__init__()
        self.head = head

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        return [self.head(x_i) for x_i in x.split(LITGPT_CHUNK_TOKENS, dim=1)]


def chunked_cross_entropy(logits: list[torch.Tensor], labels: torch.Tensor, vocab_size: int,
                          ignore_index: int = -100, **kwargs: Any) -> torch.Tensor:
    """litgpt's ``chunked_cross_entropy`` on the chunked head's list (litgpt/utils.py, "lm_head
    was chunked"): cross-entropy per chunk with ``reduction="none"``, then the sum over the
    tokens that count."""
    targets = _shifted_labels(labels, ignore_index)
    losses = [nn.functional.cross_entropy(chunk.reshape(-1, vocab_size), target.reshape(-1),
                                          ignore_index=ignore_index, reduction="none")
              for chunk, target in zip(logits, targets.split(LITGPT_CHUNK_TOKENS, dim=1))]
    return _mean(torch.cat(losses).sum(), targets, ignore_index)


class FabricLogits:
    """A causal LM's loss function on the logits as litgpt's loop has them: converted to
    float32 by Fabric's wrapper, and the last step's kept (``logits = model(...)``) until
    this step's conversion replaces them."""

    def __init__(self, loss_function: Any) -> None:
        self.loss_function = loss_function
        self.logits: torch.Tensor | None = None

    def __call__(self, logits: torch.Tensor | list[torch.Tensor], labels: torch.Tensor,
                 vocab_size: int, **kwargs: Any) -> torch.Tensor:
        # apply_to_collection converts a list's tensors one by one
        converted: Any = ([chunk.to(FABRIC_OUTPUT_DTYPE) for chunk in logits]
                          if isinstance(logits, list) else logits.to(FABRIC_OUTPUT_DTYPE))
        self.logits = converted  # the previous step's are freed only now
        return self.loss_function(converted, labels, vocab_size, **kwargs)


def fabric_logits(model: nn.Module, chunked: bool = True) -> None:
    """Give ``model`` (a causal LM, possibly inside peft) litgpt's float32, held logits and,
    with ``chunked`` (litgpt's own loss), its head on 128-token chunks."""
    base = base_model_of(model)
    if chunked and isinstance(getattr(base, "lm_head", None), nn.Module):
        base.lm_head = ChunkedHead(base.lm_head)
        base.loss_function = chunked_cross_entropy
        _without_final_softcapping(base)
    base.loss_function = FabricLogits(base.loss_function)


def _without_final_softcapping(base: nn.Module) -> None:
    """litgpt's LoRA ``GPT.forward`` returns the list of chunk logits before its final logit
    softcapping (litgpt/lora.py, ``GPT.forward``: ``if lm_head_chunk_size > 0: return
    [self.lm_head(x_i) ...]`` ahead of ``final_logit_softcapping``, v0.5.13 commit 26857050),
    so Gemma 2's chunked training step has none: the model's own forward (transformers'
    ``Gemma2ForCausalLM``) skips it too, on a copy of its config (the resolved config is
    shared with other builds)."""
    import copy

    config = getattr(base, "config", None)
    if getattr(config, "final_logit_softcapping", None) is not None:
        base.config = copy.copy(config)
        base.config.final_logit_softcapping = None
