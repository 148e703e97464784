"""An offline table of popular Hugging Face model configs, so ``hf:NAME`` works without the hub.

Each entry copies the architecture hyperparameters of the model's published
``config.json`` (hub page ``https://huggingface.co/<hub_name>/blob/main/config.json``).
Fields that do not change the module or its memory (tokenizer ids aside from padding,
``transformers_version``, generation settings, ``task_specific_params``) are left out;
every field that shapes the network is written as published, including the checkpoint's
``torch_dtype`` (kept as documentation: batchfit builds the weights in the dtype of the
chosen precision, not the checkpoint's).

Names match case-insensitively, with or without the organisation prefix
(``meta-llama/Llama-2-7b-hf``, ``Llama-2-7b-hf``) and through each entry's aliases
(``llama-2-7b``). Instruct/chat variants listed as aliases share the base model's
architecture; only token ids or the context length they advertise differ.

Nothing here imports transformers: :mod:`batchfit.models.resolve` turns an entry into a config.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class HFConfigEntry:
    """One published config.

    Args:
        hub_name: the model's id on the Hugging Face hub.
        config_class: name of the ``transformers`` config class (``LlamaConfig``).
        config: the published ``config.json`` fields that define the architecture.
        aliases: further names accepted for this model (lower case).
    """

    hub_name: str
    config_class: str
    config: Mapping[str, Any]
    aliases: tuple[str, ...] = field(default=())

    @property
    def names(self) -> tuple[str, ...]:
        """Every lower-case name this entry answers to."""
        short = self.hub_name.rsplit("/", 1)[-1]
        return tuple(dict.fromkeys(n.lower() for n in (self.hub_name, short, *self.aliases)))


def _gpt2(n_embd: int, n_layer: int, n_head: int) -> dict[str, Any]:
    # Fields shared by the four published GPT-2 sizes (openai-community/gpt2*/config.json).
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "activation_function": "gelu_new", "attn_pdrop": 0.1, "embd_pdrop": 0.1, "resid_pdrop": 0.1,
        "bos_token_id": 50256, "eos_token_id": 50256, "initializer_range": 0.02,
        "layer_norm_epsilon": 1e-05, "n_ctx": 1024, "n_positions": 1024, "vocab_size": 50257,
        "n_embd": n_embd, "n_layer": n_layer, "n_head": n_head,
    }


def _bert(hidden_size: int, layers: int, heads: int, intermediate_size: int) -> dict[str, Any]:
    # Fields shared by google-bert/bert-{base,large}-uncased/config.json.
    return {
        "architectures": ["BertForMaskedLM"], "model_type": "bert",
        "attention_probs_dropout_prob": 0.1, "hidden_act": "gelu", "hidden_dropout_prob": 0.1,
        "initializer_range": 0.02, "layer_norm_eps": 1e-12, "max_position_embeddings": 512,
        "pad_token_id": 0, "position_embedding_type": "absolute", "type_vocab_size": 2,
        "vocab_size": 30522, "hidden_size": hidden_size, "num_hidden_layers": layers,
        "num_attention_heads": heads, "intermediate_size": intermediate_size,
    }


def _t5(d_model: int, d_ff: int, num_heads: int, num_layers: int) -> dict[str, Any]:
    # Fields shared by google-t5/t5-{small,base}/config.json (the original T5, ReLU FFN).
    return {
        "architectures": ["T5ForConditionalGeneration"], "model_type": "t5",
        "d_kv": 64, "decoder_start_token_id": 0, "dropout_rate": 0.1, "eos_token_id": 1,
        "feed_forward_proj": "relu", "initializer_factor": 1.0, "is_encoder_decoder": True,
        "layer_norm_epsilon": 1e-06, "n_positions": 512, "pad_token_id": 0,
        "relative_attention_num_buckets": 32, "vocab_size": 32128,
        "d_model": d_model, "d_ff": d_ff, "num_heads": num_heads, "num_layers": num_layers,
    }


def _llama(**fields: Any) -> dict[str, Any]:
    # Fields every published Llama-architecture config.json here shares.
    base = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "initializer_range": 0.02, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
        "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False,
    }
    return {**base, **fields}


def _qwen2(**fields: Any) -> dict[str, Any]:
    # Fields every published Qwen2.5 config.json here shares (Qwen/Qwen2.5-*/config.json).
    base = {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "attention_dropout": 0.0,
        "bos_token_id": 151643, "eos_token_id": 151643, "hidden_act": "silu",
        "initializer_range": 0.02, "rope_theta": 1000000.0, "torch_dtype": "bfloat16",
        "use_sliding_window": False,
    }
    return {**base, **fields}


def _qwen3(**fields: Any) -> dict[str, Any]:
    # Fields the published Qwen3 dense config.json files share (Qwen/Qwen3-*/config.json):
    # q/k norms, head_dim 128, 40,960 positions, no attention bias.
    base = {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False,
        "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645,
        "head_dim": 128, "hidden_act": "silu", "initializer_range": 0.02,
        "max_position_embeddings": 40960, "rms_norm_eps": 1e-06, "rope_scaling": None,
        "rope_theta": 1000000, "sliding_window": None, "torch_dtype": "bfloat16",
        "use_sliding_window": False, "vocab_size": 151936,
    }
    return {**base, **fields}


def _gemma2(**fields: Any) -> dict[str, Any]:
    # Fields google/gemma-2-{2b,9b,27b}/config.json share: alternating 4,096-token sliding
    # and global attention, logit soft-capping, tied 256k-token embeddings.
    base = {
        "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "attention_bias": False,
        "attention_dropout": 0.0, "attn_logit_softcapping": 50.0, "bos_token_id": 2,
        "cache_implementation": "hybrid", "eos_token_id": 1, "final_logit_softcapping": 30.0,
        "head_dim": 256, "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh", "initializer_range": 0.02,
        "max_position_embeddings": 8192, "pad_token_id": 0, "rms_norm_eps": 1e-06,
        "rope_theta": 10000.0, "sliding_window": 4096, "torch_dtype": "float32",
        "vocab_size": 256000,
    }
    return {**base, **fields}


_LLAMA3_ROPE_SCALING = {  # meta-llama/Llama-3.1-8B/config.json "rope_scaling"
    "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192, "rope_type": "llama3",
}

ENTRIES: tuple[HFConfigEntry, ...] = (
    # --- GPT-2: openai-community/gpt2, gpt2-medium, gpt2-large, gpt2-xl config.json
    HFConfigEntry("openai-community/gpt2", "GPT2Config", _gpt2(768, 12, 12),
                  aliases=("gpt2-small",)),
    HFConfigEntry("openai-community/gpt2-medium", "GPT2Config", _gpt2(1024, 24, 16)),
    HFConfigEntry("openai-community/gpt2-large", "GPT2Config", _gpt2(1280, 36, 20)),
    HFConfigEntry("openai-community/gpt2-xl", "GPT2Config", _gpt2(1600, 48, 25)),
    # --- BERT: google-bert/bert-base-uncased, bert-large-uncased config.json
    HFConfigEntry("google-bert/bert-base-uncased", "BertConfig", _bert(768, 12, 12, 3072),
                  aliases=("bert-base",)),
    HFConfigEntry("google-bert/bert-large-uncased", "BertConfig", _bert(1024, 24, 16, 4096),
                  aliases=("bert-large",)),
    # --- FacebookAI/roberta-base/config.json (514 positions: 512 tokens + padding offset 2)
    HFConfigEntry("FacebookAI/roberta-base", "RobertaConfig", {
        "architectures": ["RobertaForMaskedLM"], "model_type": "roberta",
        "attention_probs_dropout_prob": 0.1, "bos_token_id": 0, "eos_token_id": 2,
        "hidden_act": "gelu", "hidden_dropout_prob": 0.1, "hidden_size": 768,
        "initializer_range": 0.02, "intermediate_size": 3072, "layer_norm_eps": 1e-05,
        "max_position_embeddings": 514, "num_attention_heads": 12, "num_hidden_layers": 12,
        "pad_token_id": 1, "type_vocab_size": 1, "vocab_size": 50265,
    }),
    # --- distilbert/distilbert-base-uncased/config.json
    HFConfigEntry("distilbert/distilbert-base-uncased", "DistilBertConfig", {
        "architectures": ["DistilBertForMaskedLM"], "model_type": "distilbert",
        "activation": "gelu", "attention_dropout": 0.1, "dim": 768, "dropout": 0.1,
        "hidden_dim": 3072, "initializer_range": 0.02, "max_position_embeddings": 512,
        "n_heads": 12, "n_layers": 6, "pad_token_id": 0, "qa_dropout": 0.1,
        "seq_classif_dropout": 0.2, "sinusoidal_pos_embds": False, "tie_weights_": True,
        "vocab_size": 30522,
    }, aliases=("distilbert",)),
    # --- T5: google-t5/t5-small, t5-base config.json (lm_head tied to the embedding)
    HFConfigEntry("google-t5/t5-small", "T5Config", _t5(512, 2048, 8, 6)),
    HFConfigEntry("google-t5/t5-base", "T5Config", _t5(768, 3072, 12, 12)),
    # --- meta-llama/Llama-2-{7b,13b,70b}-hf/config.json (no rope_theta: the default 10000)
    HFConfigEntry("meta-llama/Llama-2-7b-hf", "LlamaConfig", _llama(
        bos_token_id=1, eos_token_id=2, hidden_size=4096, intermediate_size=11008,
        max_position_embeddings=4096, num_attention_heads=32, num_hidden_layers=32,
        num_key_value_heads=32, rope_scaling=None, tie_word_embeddings=False,
        torch_dtype="float16", vocab_size=32000,
    ), aliases=("llama-2-7b", "llama2-7b", "llama-2-7b-chat-hf", "llama-2-7b-chat")),
    HFConfigEntry("meta-llama/Llama-2-13b-hf", "LlamaConfig", _llama(
        bos_token_id=1, eos_token_id=2, hidden_size=5120, intermediate_size=13824,
        max_position_embeddings=4096, num_attention_heads=40, num_hidden_layers=40,
        num_key_value_heads=40, rope_scaling=None, tie_word_embeddings=False,
        torch_dtype="float16", vocab_size=32000,
    ), aliases=("llama-2-13b", "llama2-13b", "llama-2-13b-chat-hf", "llama-2-13b-chat")),
    HFConfigEntry("meta-llama/Llama-2-70b-hf", "LlamaConfig", _llama(
        bos_token_id=1, eos_token_id=2, hidden_size=8192, intermediate_size=28672,
        max_position_embeddings=4096, num_attention_heads=64, num_hidden_layers=80,
        num_key_value_heads=8, rope_scaling=None, tie_word_embeddings=False,
        torch_dtype="float16", vocab_size=32000,
    ), aliases=("llama-2-70b", "llama2-70b", "llama-2-70b-chat-hf", "llama-2-70b-chat")),
    # --- meta-llama/Meta-Llama-3-8B/config.json
    HFConfigEntry("meta-llama/Meta-Llama-3-8B", "LlamaConfig", _llama(
        bos_token_id=128000, eos_token_id=128001, hidden_size=4096, intermediate_size=14336,
        max_position_embeddings=8192, num_attention_heads=32, num_hidden_layers=32,
        num_key_value_heads=8, rope_scaling=None, rope_theta=500000.0,
        tie_word_embeddings=False, torch_dtype="bfloat16", vocab_size=128256,
    ), aliases=("llama-3-8b", "llama3-8b", "meta-llama-3-8b-instruct", "llama-3-8b-instruct")),
    # --- meta-llama/Llama-3.1-8B/config.json (formerly Meta-Llama-3.1-8B)
    HFConfigEntry("meta-llama/Llama-3.1-8B", "LlamaConfig", _llama(
        bos_token_id=128000, eos_token_id=128001, hidden_size=4096, intermediate_size=14336,
        max_position_embeddings=131072, num_attention_heads=32, num_hidden_layers=32,
        num_key_value_heads=8, rope_scaling=_LLAMA3_ROPE_SCALING, rope_theta=500000.0,
        tie_word_embeddings=False, torch_dtype="bfloat16", vocab_size=128256,
    ), aliases=("meta-llama-3.1-8b", "llama3.1-8b", "llama-3.1-8b-instruct",
                "meta-llama-3.1-8b-instruct")),
    # --- meta-llama/Meta-Llama-3-70B/config.json
    HFConfigEntry("meta-llama/Meta-Llama-3-70B", "LlamaConfig", _llama(
        bos_token_id=128000, eos_token_id=128001, hidden_size=8192, intermediate_size=28672,
        max_position_embeddings=8192, num_attention_heads=64, num_hidden_layers=80,
        num_key_value_heads=8, rope_scaling=None, rope_theta=500000.0,
        tie_word_embeddings=False, torch_dtype="bfloat16", vocab_size=128256,
    ), aliases=("llama-3-70b", "llama3-70b", "meta-llama-3-70b-instruct", "llama-3-70b-instruct")),
    # --- meta-llama/Llama-3.2-1B/config.json (tied embeddings, head_dim 64)
    HFConfigEntry("meta-llama/Llama-3.2-1B", "LlamaConfig", _llama(
        bos_token_id=128000, eos_token_id=128001, head_dim=64, hidden_size=2048,
        intermediate_size=8192, max_position_embeddings=131072, num_attention_heads=32,
        num_hidden_layers=16, num_key_value_heads=8,
        rope_scaling={**_LLAMA3_ROPE_SCALING, "factor": 32.0}, rope_theta=500000.0,
        tie_word_embeddings=True, torch_dtype="bfloat16", vocab_size=128256,
    ), aliases=("llama-3.2-1b", "llama3.2-1b", "llama-3.2-1b-instruct")),
    # --- TinyLlama/TinyLlama-1.1B-Chat-v1.0/config.json (same architecture as the 3T base)
    HFConfigEntry("TinyLlama/TinyLlama-1.1B-Chat-v1.0", "LlamaConfig", _llama(
        bos_token_id=1, eos_token_id=2, hidden_size=2048, intermediate_size=5632,
        max_position_embeddings=2048, num_attention_heads=32, num_hidden_layers=22,
        num_key_value_heads=4, rope_scaling=None, rope_theta=10000.0,
        tie_word_embeddings=False, torch_dtype="bfloat16", vocab_size=32000,
    ), aliases=("tinyllama", "tinyllama-1.1b", "tinyllama-1.1b-intermediate-step-1431k-3t")),
    # --- mistralai/Mistral-7B-v0.1/config.json
    HFConfigEntry("mistralai/Mistral-7B-v0.1", "MistralConfig", {
        "architectures": ["MistralForCausalLM"], "model_type": "mistral",
        "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 4096,
        "initializer_range": 0.02, "intermediate_size": 14336,
        "max_position_embeddings": 32768, "num_attention_heads": 32, "num_hidden_layers": 32,
        "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
        "sliding_window": 4096, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "vocab_size": 32000,
    }, aliases=("mistral-7b", "mistral-7b-instruct-v0.1")),
    # --- Qwen/Qwen2.5-0.5B/config.json (q/k/v projections carry a bias; tied embeddings)
    HFConfigEntry("Qwen/Qwen2.5-0.5B", "Qwen2Config", {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
        "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151643,
        "hidden_act": "silu", "hidden_size": 896, "initializer_range": 0.02,
        "intermediate_size": 4864, "max_position_embeddings": 32768, "max_window_layers": 24,
        "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768,
        "tie_word_embeddings": True, "torch_dtype": "bfloat16", "use_sliding_window": False,
        "vocab_size": 151936,
    }, aliases=("qwen2.5-0.5b-instruct",)),
    # --- Qwen/Qwen2.5-7B/config.json
    HFConfigEntry("Qwen/Qwen2.5-7B", "Qwen2Config", {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
        "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151643,
        "hidden_act": "silu", "hidden_size": 3584, "initializer_range": 0.02,
        "intermediate_size": 18944, "max_position_embeddings": 131072, "max_window_layers": 28,
        "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4,
        "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 131072,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_sliding_window": False,
        "vocab_size": 152064,
    }, aliases=("qwen2.5-7b-instruct",)),
    # --- microsoft/Phi-3-mini-4k-instruct/config.json (fused qkv and gate_up projections)
    HFConfigEntry("microsoft/Phi-3-mini-4k-instruct", "Phi3Config", {
        "architectures": ["Phi3ForCausalLM"], "model_type": "phi3",
        "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 1,
        "embd_pdrop": 0.0, "eos_token_id": 32000, "hidden_act": "silu", "hidden_size": 3072,
        "initializer_range": 0.02, "intermediate_size": 8192, "max_position_embeddings": 4096,
        "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32,
        "original_max_position_embeddings": 4096, "pad_token_id": 32000, "resid_pdrop": 0.0,
        "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 10000.0,
        "sliding_window": 2047, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "vocab_size": 32064,
    }, aliases=("phi-3-mini", "phi-3-mini-4k", "phi3-mini")),
    # --- EleutherAI/pythia-1b/config.json (GPT-NeoX, rotary on 25% of each head)
    HFConfigEntry("EleutherAI/pythia-1b", "GPTNeoXConfig", {
        "architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox",
        "bos_token_id": 0, "eos_token_id": 0, "hidden_act": "gelu", "hidden_size": 2048,
        "initializer_range": 0.02, "intermediate_size": 8192, "layer_norm_eps": 1e-05,
        "max_position_embeddings": 2048, "num_attention_heads": 8, "num_hidden_layers": 16,
        "rotary_emb_base": 10000, "rotary_pct": 0.25, "tie_word_embeddings": False,
        "torch_dtype": "float16", "use_parallel_residual": True, "vocab_size": 50304,
    }, aliases=("pythia-1b-deduped",)),
    # --- meta-llama/Llama-3.1-70B/config.json (Llama-3.3-70B-Instruct: the same architecture)
    HFConfigEntry("meta-llama/Llama-3.1-70B", "LlamaConfig", _llama(
        bos_token_id=128000, eos_token_id=128001, hidden_size=8192, intermediate_size=28672,
        max_position_embeddings=131072, num_attention_heads=64, num_hidden_layers=80,
        num_key_value_heads=8, rope_scaling=_LLAMA3_ROPE_SCALING, rope_theta=500000.0,
        tie_word_embeddings=False, torch_dtype="bfloat16", vocab_size=128256,
    ), aliases=("llama-3.1-70b", "llama3.1-70b", "llama-3.1-70b-instruct",
                "meta-llama-3.1-70b-instruct", "meta-llama/Llama-3.3-70B-Instruct",
                "llama-3.3-70b", "llama-3.3-70b-instruct", "llama3.3-70b")),
    # --- meta-llama/Llama-3.2-3B/config.json (tied embeddings)
    HFConfigEntry("meta-llama/Llama-3.2-3B", "LlamaConfig", _llama(
        bos_token_id=128000, eos_token_id=128001, head_dim=128, hidden_size=3072,
        intermediate_size=8192, max_position_embeddings=131072, num_attention_heads=24,
        num_hidden_layers=28, num_key_value_heads=8,
        rope_scaling={**_LLAMA3_ROPE_SCALING, "factor": 32.0}, rope_theta=500000.0,
        tie_word_embeddings=True, torch_dtype="bfloat16", vocab_size=128256,
    ), aliases=("llama-3.2-3b", "llama3.2-3b", "llama-3.2-3b-instruct")),
    # --- Qwen/Qwen2.5-{3B,14B,32B,72B}/config.json
    HFConfigEntry("Qwen/Qwen2.5-3B", "Qwen2Config", _qwen2(
        hidden_size=2048, intermediate_size=11008, max_position_embeddings=32768,
        max_window_layers=36, num_attention_heads=16, num_hidden_layers=36,
        num_key_value_heads=2, rms_norm_eps=1e-06, sliding_window=32768,
        tie_word_embeddings=True, vocab_size=151936,
    ), aliases=("qwen2.5-3b-instruct",)),
    HFConfigEntry("Qwen/Qwen2.5-14B", "Qwen2Config", _qwen2(
        hidden_size=5120, intermediate_size=13824, max_position_embeddings=131072,
        max_window_layers=48, num_attention_heads=40, num_hidden_layers=48,
        num_key_value_heads=8, rms_norm_eps=1e-05, sliding_window=131072,
        tie_word_embeddings=False, vocab_size=152064,
    ), aliases=("qwen2.5-14b-instruct",)),
    HFConfigEntry("Qwen/Qwen2.5-32B", "Qwen2Config", _qwen2(
        hidden_size=5120, intermediate_size=27648, max_position_embeddings=131072,
        max_window_layers=64, num_attention_heads=40, num_hidden_layers=64,
        num_key_value_heads=8, rms_norm_eps=1e-05, sliding_window=131072,
        tie_word_embeddings=False, vocab_size=152064,
    ), aliases=("qwen2.5-32b-instruct",)),
    HFConfigEntry("Qwen/Qwen2.5-72B", "Qwen2Config", _qwen2(
        hidden_size=8192, intermediate_size=29568, max_position_embeddings=131072,
        max_window_layers=80, num_attention_heads=64, num_hidden_layers=80,
        num_key_value_heads=8, rms_norm_eps=1e-05, sliding_window=131072,
        tie_word_embeddings=False, vocab_size=152064,
    ), aliases=("qwen2.5-72b-instruct",)),
    # --- Qwen/Qwen3-{0.6B,4B,8B,14B,32B}/config.json (dense)
    HFConfigEntry("Qwen/Qwen3-0.6B", "Qwen3Config", _qwen3(
        hidden_size=1024, intermediate_size=3072, max_window_layers=28, num_attention_heads=16,
        num_hidden_layers=28, num_key_value_heads=8, tie_word_embeddings=True,
    ), aliases=("qwen3-0.6b-base",)),
    HFConfigEntry("Qwen/Qwen3-4B", "Qwen3Config", _qwen3(
        hidden_size=2560, intermediate_size=9728, max_window_layers=36, num_attention_heads=32,
        num_hidden_layers=36, num_key_value_heads=8, tie_word_embeddings=True,
    ), aliases=("qwen3-4b-base",)),
    HFConfigEntry("Qwen/Qwen3-8B", "Qwen3Config", _qwen3(
        hidden_size=4096, intermediate_size=12288, max_window_layers=36, num_attention_heads=32,
        num_hidden_layers=36, num_key_value_heads=8, tie_word_embeddings=False,
    ), aliases=("qwen3-8b-base",)),
    HFConfigEntry("Qwen/Qwen3-14B", "Qwen3Config", _qwen3(
        hidden_size=5120, intermediate_size=17408, max_window_layers=40, num_attention_heads=40,
        num_hidden_layers=40, num_key_value_heads=8, tie_word_embeddings=False,
    ), aliases=("qwen3-14b-base",)),
    HFConfigEntry("Qwen/Qwen3-32B", "Qwen3Config", _qwen3(
        hidden_size=5120, intermediate_size=25600, max_window_layers=64, num_attention_heads=64,
        num_hidden_layers=64, num_key_value_heads=8, tie_word_embeddings=False,
    )),
    # --- Qwen/Qwen3-30B-A3B/config.json (MoE: 128 experts, 8 routed per token)
    HFConfigEntry("Qwen/Qwen3-30B-A3B", "Qwen3MoeConfig", {
        **_qwen3(hidden_size=2048, intermediate_size=6144, max_window_layers=48,
                 num_attention_heads=32, num_hidden_layers=48, num_key_value_heads=4,
                 rope_theta=1000000.0, tie_word_embeddings=False),
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "decoder_sparse_step": 1, "mlp_only_layers": [], "moe_intermediate_size": 768,
        "norm_topk_prob": True, "num_experts": 128, "num_experts_per_tok": 8,
        "output_router_logits": False, "router_aux_loss_coef": 0.001,
    }, aliases=("qwen3-30b-a3b-base",)),
    # --- mistralai/Mistral-7B-v0.3/config.json (no sliding window; 32,768-token vocabulary)
    HFConfigEntry("mistralai/Mistral-7B-v0.3", "MistralConfig", {
        "architectures": ["MistralForCausalLM"], "model_type": "mistral",
        "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2, "head_dim": 128,
        "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
        "intermediate_size": 14336, "max_position_embeddings": 32768,
        "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
        "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "sliding_window": None,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 32768,
    }, aliases=("mistral-7b-v0.3", "mistral-7b-instruct-v0.3")),
    # --- mistralai/Mixtral-8x7B-v0.1/config.json (MoE: 8 experts, 2 per token)
    HFConfigEntry("mistralai/Mixtral-8x7B-v0.1", "MixtralConfig", {
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
        "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
        "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
        "max_position_embeddings": 32768, "num_attention_heads": 32, "num_experts_per_tok": 2,
        "num_hidden_layers": 32, "num_key_value_heads": 8, "num_local_experts": 8,
        "output_router_logits": False, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.02, "sliding_window": None, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "vocab_size": 32000,
    }, aliases=("mixtral-8x7b", "mixtral-8x7b-instruct-v0.1")),
    # --- google/gemma-2-{2b,9b,27b}/config.json
    HFConfigEntry("google/gemma-2-2b", "Gemma2Config", _gemma2(
        hidden_size=2304, intermediate_size=9216, num_attention_heads=8, num_hidden_layers=26,
        num_key_value_heads=4, query_pre_attn_scalar=256,
    ), aliases=("gemma-2-2b-it",)),
    HFConfigEntry("google/gemma-2-9b", "Gemma2Config", _gemma2(
        hidden_size=3584, intermediate_size=14336, num_attention_heads=16, num_hidden_layers=42,
        num_key_value_heads=8, query_pre_attn_scalar=256,
    ), aliases=("gemma-2-9b-it",)),
    HFConfigEntry("google/gemma-2-27b", "Gemma2Config", _gemma2(
        hidden_size=4608, intermediate_size=36864, num_attention_heads=32, num_hidden_layers=46,
        num_key_value_heads=16, head_dim=128, query_pre_attn_scalar=144,
    ), aliases=("gemma-2-27b-it",)),
    # --- google/gemma-3-1b-pt/config.json (text-only; 5 local layers of 512 tokens per global)
    HFConfigEntry("google/gemma-3-1b-pt", "Gemma3TextConfig", {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
        "attention_bias": False, "attention_dropout": 0.0, "attn_logit_softcapping": None,
        "bos_token_id": 2, "eos_token_id": 1, "final_logit_softcapping": None, "head_dim": 256,
        "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 1152,
        "initializer_range": 0.02, "intermediate_size": 6912, "max_position_embeddings": 32768,
        "num_attention_heads": 4, "num_hidden_layers": 26, "num_key_value_heads": 1,
        "pad_token_id": 0, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06,
        "rope_local_base_freq": 10000.0, "rope_scaling": None, "rope_theta": 1000000.0,
        "sliding_window": 512, "sliding_window_pattern": 6, "torch_dtype": "bfloat16",
        "vocab_size": 262144,
    }, aliases=("gemma-3-1b", "gemma-3-1b-it")),
    # --- microsoft/phi-4/config.json (Phi-3 architecture, 14.7B, GQA with 10 KV heads)
    HFConfigEntry("microsoft/phi-4", "Phi3Config", {
        "architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "attention_bias": False,
        "attention_dropout": 0.0, "bos_token_id": 100257, "embd_pdrop": 0.0,
        "eos_token_id": 100265, "hidden_act": "silu", "hidden_size": 5120,
        "initializer_range": 0.02, "intermediate_size": 17920, "max_position_embeddings": 16384,
        "num_attention_heads": 40, "num_hidden_layers": 40, "num_key_value_heads": 10,
        "original_max_position_embeddings": 16384, "pad_token_id": 100349, "resid_pdrop": 0.0,
        "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 250000,
        "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "vocab_size": 100352,
    }, aliases=("phi-4", "phi4")),
    # --- deepseek-ai/DeepSeek-V2-Lite/config.json (MLA with kv_lora_rank 512; MoE 64+2)
    HFConfigEntry("deepseek-ai/DeepSeek-V2-Lite", "DeepseekV2Config", {
        "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
        "attention_bias": False, "attention_dropout": 0.0, "aux_loss_alpha": 0.001,
        "bos_token_id": 100000, "eos_token_id": 100001, "first_k_dense_replace": 1,
        "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
        "intermediate_size": 10944, "kv_lora_rank": 512, "max_position_embeddings": 163840,
        "moe_intermediate_size": 1408, "moe_layer_freq": 1, "n_group": 1,
        "n_routed_experts": 64, "n_shared_experts": 2, "norm_topk_prob": False,
        "num_attention_heads": 16, "num_experts_per_tok": 6, "num_hidden_layers": 27,
        "num_key_value_heads": 16, "q_lora_rank": None, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
        "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707,
                         "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096,
                         "type": "yarn"},
        "rope_theta": 10000, "routed_scaling_factor": 1.0, "scoring_func": "softmax",
        "seq_aux": True, "tie_word_embeddings": False, "topk_group": 1, "topk_method": "greedy",
        "torch_dtype": "bfloat16", "v_head_dim": 128, "vocab_size": 102400,
    }, aliases=("deepseek-v2-lite", "deepseek-v2-lite-chat")),
    # --- deepseek-ai/DeepSeek-V3/config.json (MLA; MoE 256 routed + 1 shared, 8 per token;
    # the multi-token-prediction layer is not part of transformers' model)
    HFConfigEntry("deepseek-ai/DeepSeek-V3", "DeepseekV3Config", {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 0,
        "eos_token_id": 1, "first_k_dense_replace": 3, "hidden_act": "silu",
        "hidden_size": 7168, "initializer_range": 0.02, "intermediate_size": 18432,
        "kv_lora_rank": 512, "max_position_embeddings": 163840, "moe_intermediate_size": 2048,
        "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1,
        "norm_topk_prob": True, "num_attention_heads": 128, "num_experts_per_tok": 8,
        "num_hidden_layers": 61, "num_key_value_heads": 128, "num_nextn_predict_layers": 1,
        "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
        "rms_norm_eps": 1e-06,
        "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                         "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                         "type": "yarn"},
        "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid",
        "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc",
        "torch_dtype": "bfloat16", "v_head_dim": 128, "vocab_size": 129280,
    }, aliases=("deepseek-v3", "deepseek-r1", "deepseek-ai/DeepSeek-R1")),
    # --- tiiuae/falcon-mamba-7b/config.json (attention-free state-space model)
    HFConfigEntry("tiiuae/falcon-mamba-7b", "FalconMambaConfig", {
        "architectures": ["FalconMambaForCausalLM"], "model_type": "falcon_mamba",
        "bos_token_id": 0, "conv_kernel": 4, "eos_token_id": 11, "expand": 16,
        "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.1,
        "intermediate_size": 8192, "layer_norm_epsilon": 1e-05, "mixer_rms_eps": 1e-06,
        "num_hidden_layers": 64, "pad_token_id": 11, "rescale_prenorm_residual": False,
        "residual_in_fp32": True, "state_size": 16, "tie_word_embeddings": False,
        "time_step_floor": 0.0001, "time_step_init_scheme": "random", "time_step_max": 0.1,
        "time_step_min": 0.001, "time_step_rank": 256, "time_step_scale": 1.0,
        "torch_dtype": "bfloat16", "use_bias": False, "use_conv_bias": True,
        "vocab_size": 65024,
    }, aliases=("falcon-mamba-7b", "falcon-mamba-7b-instruct")),
)


def _index() -> dict[str, HFConfigEntry]:
    index: dict[str, HFConfigEntry] = {}
    for entry in ENTRIES:
        for name in entry.names:
            index.setdefault(name, entry)
    return index


_INDEX = _index()


def find_hf_config(name: str) -> HFConfigEntry | None:
    """The table entry for ``name`` (case-insensitive, org prefix optional), or None.

    Example:
        >>> find_hf_config("Llama-2-7b").hub_name
        'meta-llama/Llama-2-7b-hf'
    """
    key = name.strip().lower()
    return _INDEX.get(key) or _INDEX.get(key.rsplit("/", 1)[-1])


def hf_config_names() -> list[str]:
    """Every name the table answers to, lower case (for suggestions)."""
    return sorted(_INDEX)
