"""Tests for batchfit.models.resolve and batchfit.models.hf_configs.

Every model is built on the meta device. Expected parameter counts come from hand formulas
over the published hyperparameters and, where the model card states one, the published
count; neither is read from the code under test.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

from batchfit.engine.spec import TensorSpec
from batchfit.errors import InvalidInputError, ModelSpecError
from batchfit.models.hf_configs import ENTRIES, find_hf_config, hf_config_names
from batchfit.models.resolve import ModelSpec, parse_model_kwargs, resolve_model

SRC = Path(__file__).resolve().parents[2] / "src"


def build(spec: ModelSpec) -> torch.nn.Module:
    with torch.device("meta"):
        return spec.factory()


def count_params(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())  # tied weights count once


def assert_one_line(exc_info: pytest.ExceptionInfo) -> str:
    message = str(exc_info.value)
    assert "\n" not in message
    return message


# --------------------------------------------------------------------------- hand formulas

def llama_params(vocab, d, layers, heads, kv_heads, inter, tied, head_dim=None, qkv_bias=False):
    """Llama/Mistral/Qwen2/Phi-3: GQA attention, SwiGLU MLP, two RMSNorms per layer."""
    hd = head_dim or d // heads
    attn = d * heads * hd + 2 * d * kv_heads * hd + heads * hd * d
    if qkv_bias:
        attn += heads * hd + 2 * kv_heads * hd
    layer = attn + 3 * d * inter + 2 * d
    return vocab * d * (1 if tied else 2) + layers * layer + d


def gpt2_params(vocab, positions, d, layers):
    attn = (d * 3 * d + 3 * d) + (d * d + d)
    mlp = (d * 4 * d + 4 * d) + (4 * d * d + d)
    layer = 2 * d + attn + 2 * d + mlp
    return vocab * d + positions * d + layers * layer + 2 * d  # lm_head tied to wte


def bert_mlm_params(vocab, positions, token_types, d, layers, inter):
    """BertForMaskedLM / RobertaForMaskedLM: no pooler, decoder weight tied, own bias."""
    embeddings = (vocab + positions + token_types) * d + 2 * d
    layer = 4 * (d * d + d) + 2 * d + (d * inter + inter) + (inter * d + d) + 2 * d
    head = (d * d + d) + 2 * d + vocab
    return embeddings + layers * layer + head


def distilbert_mlm_params(vocab, positions, d, layers, inter):
    embeddings = (vocab + positions) * d + 2 * d
    layer = 4 * (d * d + d) + 2 * d + (d * inter + inter) + (inter * d + d) + 2 * d
    head = (d * d + d) + 2 * d + vocab
    return embeddings + layers * layer + head


def t5_params(vocab, d, d_ff, heads, layers, d_kv=64, buckets=32):
    inner = heads * d_kv
    encoder = layers * (4 * d * inner + 2 * d * d_ff + 2 * d) + heads * buckets + d
    decoder = layers * (8 * d * inner + 2 * d * d_ff + 3 * d) + heads * buckets + d
    return vocab * d + encoder + decoder  # lm_head tied to the shared embedding


def neox_params(vocab, d, layers, inter):
    layer = 4 * d + (d * 3 * d + 3 * d) + (d * d + d) + (d * inter + inter) + (inter * d + d)
    return 2 * vocab * d + layers * layer + 2 * d


# hub name -> (expected by formula, count published on the model card or None)
EXPECTED_PARAMS = {
    "openai-community/gpt2": (gpt2_params(50257, 1024, 768, 12), 124_439_808),
    "openai-community/gpt2-medium": (gpt2_params(50257, 1024, 1024, 24), 354_823_168),
    "openai-community/gpt2-large": (gpt2_params(50257, 1024, 1280, 36), 774_030_080),
    "openai-community/gpt2-xl": (gpt2_params(50257, 1024, 1600, 48), 1_557_611_200),
    "google-bert/bert-base-uncased": (bert_mlm_params(30522, 512, 2, 768, 12, 3072), None),
    "google-bert/bert-large-uncased": (bert_mlm_params(30522, 512, 2, 1024, 24, 4096), None),
    "FacebookAI/roberta-base": (bert_mlm_params(50265, 514, 1, 768, 12, 3072), None),
    "distilbert/distilbert-base-uncased": (distilbert_mlm_params(30522, 512, 768, 6, 3072), None),
    "google-t5/t5-small": (t5_params(32128, 512, 2048, 8, 6), 60_506_624),
    "google-t5/t5-base": (t5_params(32128, 768, 3072, 12, 12), 222_903_552),
    "meta-llama/Llama-2-7b-hf": (llama_params(32000, 4096, 32, 32, 32, 11008, False),
                                 6_738_415_616),
    "meta-llama/Llama-2-13b-hf": (llama_params(32000, 5120, 40, 40, 40, 13824, False),
                                  13_015_864_320),
    "meta-llama/Llama-2-70b-hf": (llama_params(32000, 8192, 80, 64, 8, 28672, False),
                                  68_976_648_192),
    "meta-llama/Meta-Llama-3-8B": (llama_params(128256, 4096, 32, 32, 8, 14336, False),
                                   8_030_261_248),
    "meta-llama/Llama-3.1-8B": (llama_params(128256, 4096, 32, 32, 8, 14336, False),
                                8_030_261_248),
    "meta-llama/Meta-Llama-3-70B": (llama_params(128256, 8192, 80, 64, 8, 28672, False),
                                    70_553_706_496),
    "meta-llama/Llama-3.2-1B": (llama_params(128256, 2048, 16, 32, 8, 8192, True, head_dim=64),
                                1_235_814_400),
    "TinyLlama/TinyLlama-1.1B-Chat-v1.0": (llama_params(32000, 2048, 22, 32, 4, 5632, False),
                                           1_100_048_384),
    "mistralai/Mistral-7B-v0.1": (llama_params(32000, 4096, 32, 32, 8, 14336, False),
                                  7_241_732_096),
    "Qwen/Qwen2.5-0.5B": (llama_params(151936, 896, 24, 14, 2, 4864, True, qkv_bias=True),
                          494_032_768),
    "Qwen/Qwen2.5-7B": (llama_params(152064, 3584, 28, 28, 4, 18944, False, qkv_bias=True),
                        7_615_616_512),
    "microsoft/Phi-3-mini-4k-instruct": (llama_params(32064, 3072, 32, 32, 32, 8192, False),
                                         3_821_079_552),
    "EleutherAI/pythia-1b": (neox_params(50304, 2048, 16, 8192), 1_011_781_632),
}

#: The current LLM families (issue 15), each against the total parameter count its model card
#: or hub page publishes, in billions, to the precision it is published with.
PUBLISHED_BILLIONS = {
    "meta-llama/Llama-3.1-70B": (70.6, 0.05),
    "meta-llama/Llama-3.2-3B": (3.21, 0.005),
    "Qwen/Qwen2.5-3B": (3.09, 0.005),
    "Qwen/Qwen2.5-14B": (14.8, 0.05),
    "Qwen/Qwen2.5-32B": (32.8, 0.05),
    "Qwen/Qwen2.5-72B": (72.7, 0.05),
    "Qwen/Qwen3-0.6B": (0.6, 0.05),
    "Qwen/Qwen3-4B": (4.0, 0.05),
    "Qwen/Qwen3-8B": (8.2, 0.05),
    "Qwen/Qwen3-14B": (14.8, 0.05),
    "Qwen/Qwen3-32B": (32.8, 0.05),
    "Qwen/Qwen3-30B-A3B": (30.5, 0.05),
    "mistralai/Mistral-7B-v0.3": (7.25, 0.005),
    "mistralai/Mixtral-8x7B-v0.1": (46.7, 0.05),
    "google/gemma-2-2b": (2.61, 0.005),
    "google/gemma-2-9b": (9.24, 0.005),
    "google/gemma-2-27b": (27.2, 0.05),
    "google/gemma-3-1b-pt": (1.0, 0.005),
    "microsoft/phi-4": (14.7, 0.05),
    "deepseek-ai/DeepSeek-V2-Lite": (15.7, 0.05),
    "deepseek-ai/DeepSeek-V3": (671.0, 0.5),
    "tiiuae/falcon-mamba-7b": (7.27, 0.005),
}


# --------------------------------------------------------------------------- parse_model_kwargs

def test_parse_model_kwargs_types():
    parsed = parse_model_kwargs([
        "depth=3", "drop_rate=0.1", "pretrained=false", "act=gelu", "flag=True", "x=none",
        "sizes=[1, 2]", "img=(224,224)", "eps=1e-5", "cfg={\"a\": 1}", "name=\"quoted\"",
        "neg=-2", "empty=",
    ])
    assert parsed == {
        "depth": 3, "drop_rate": 0.1, "pretrained": False, "act": "gelu", "flag": True,
        "x": None, "sizes": [1, 2], "img": (224, 224), "eps": 1e-5, "cfg": {"a": 1},
        "name": "quoted", "neg": -2, "empty": "",
    }
    assert type(parsed["depth"]) is int and type(parsed["drop_rate"]) is float


@pytest.mark.parametrize("item", ["depth", "=3", "bad key=1", "1x=2"])
def test_parse_model_kwargs_malformed(item):
    with pytest.raises(InvalidInputError, match="write KEY=VALUE") as exc_info:
        parse_model_kwargs([item])
    assert_one_line(exc_info)


def test_parse_model_kwargs_duplicate():
    with pytest.raises(InvalidInputError, match="given twice"):
        parse_model_kwargs(["depth=1", "depth=2"])


def test_import_is_cheap():
    code = ("import sys, batchfit.models.resolve; "
            "print(sorted(m for m in ('torch', 'timm', 'transformers', 'torchvision') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(SRC)}, check=True)
    assert out.stdout.strip() == "[]"


# --------------------------------------------------------------------------- timm

def test_timm_resnet50():
    spec = resolve_model("timm:resnet50")
    assert spec.name == "timm:resnet50"
    assert spec.input_spec == TensorSpec((3, 224, 224))
    assert not spec.is_token_model and not spec.hf_labels and spec.loss_fn is None
    model = build(spec)
    assert count_params(model) == 25_557_032
    assert next(model.parameters()).device.type == "meta"


def test_timm_default_input_from_pretrained_cfg():
    assert resolve_model("timm:vit_base_patch16_384").input_spec.shape == (3, 384, 384)
    assert resolve_model("timm:resnet50.a1_in1k").input_spec.shape == (3, 224, 224)


def test_timm_kwargs_reach_the_model_and_the_input():
    spec = resolve_model("timm:vit_base_patch16_224",
                         model_kwargs={"img_size": 384, "in_chans": 1, "num_classes": 10,
                                       "pretrained": False})
    assert spec.input_spec.shape == (1, 384, 384)
    model = build(spec)
    assert model.head.out_features == 10
    assert model.patch_embed.proj.in_channels == 1


def test_timm_input_shape_override():
    spec = resolve_model("timm:resnet50", input_shape=(3, 160, 128))
    assert spec.input_spec == TensorSpec((3, 160, 128))


def test_timm_fixed_size_model_rejects_other_input():
    with pytest.raises(InvalidInputError, match="img_size=384") as exc_info:
        resolve_model("timm:vit_base_patch16_224", input_shape=(3, 384, 384))
    assert_one_line(exc_info)
    spec = resolve_model("timm:vit_base_patch16_224", model_kwargs={"img_size": 384},
                         input_shape=(3, 384, 384))
    assert spec.input_spec.shape == (3, 384, 384)


def test_timm_case_insensitive():
    assert count_params(build(resolve_model("timm:ResNet50"))) == 25_557_032


def test_timm_unknown_name_suggests():
    with pytest.raises(ModelSpecError) as exc_info:
        resolve_model("timm:resnet5")
    assert assert_one_line(exc_info) == (
        "unknown timm model 'resnet5': did you mean 'resnet50'? (timm.list_models() lists all)")


def test_timm_rejects_pretrained_and_hub_names():
    with pytest.raises(ModelSpecError, match="never loads weights"):
        resolve_model("timm:resnet50", model_kwargs={"pretrained": True})
    with pytest.raises(ModelSpecError, match="offline"):
        resolve_model("timm:hf-hub:timm/resnet50.a1_in1k")


def test_timm_bad_kwarg_fails_at_build_in_one_line():
    spec = resolve_model("timm:resnet50", model_kwargs={"no_such_arg": 1})
    with pytest.raises(ModelSpecError) as exc_info:
        build(spec)
    message = assert_one_line(exc_info)
    assert message.startswith("building timm model 'resnet50' failed: TypeError:")
    assert "no_such_arg" in message


def test_missing_optional_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "timm", None)  # makes `import timm` raise ImportError
    with pytest.raises(ModelSpecError) as exc_info:
        resolve_model("timm:resnet50")
    assert str(exc_info.value) == "timm is not installed: pip install 'batchfit[timm]'"
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ModelSpecError, match=r"pip install 'batchfit\[transformers\]'"):
        resolve_model("hf:gpt2")


# --------------------------------------------------------------------------- torchvision

def test_torchvision_resnet50():
    spec = resolve_model("torchvision:resnet50")
    assert spec.input_spec == TensorSpec((3, 224, 224))
    assert count_params(build(spec)) == 25_557_032


@pytest.mark.parametrize("name, shape", [
    ("inception_v3", (3, 299, 299)),
    ("efficientnet_b3", (3, 300, 300)),
    ("vit_h_14", (3, 224, 224)),  # built without weights: image_size 224
    ("fcn_resnet50", (3, 520, 520)),
    ("deeplabv3_resnet50", (3, 520, 520)),
    ("r3d_18", (3, 16, 112, 112)),
    ("mvit_v2_s", (3, 16, 224, 224)),
])
def test_torchvision_default_inputs(name, shape):
    spec = resolve_model(f"torchvision:{name}")
    assert spec.input_spec.shape == shape
    build(spec)  # builds on meta without downloading a backbone


def test_torchvision_kwargs():
    spec = resolve_model("torchvision:vit_b_16", model_kwargs={"image_size": 384,
                                                               "num_classes": 10})
    assert spec.input_spec.shape == (3, 384, 384)
    model = build(spec)
    assert model.image_size == 384 and model.heads.head.out_features == 10


def test_torchvision_errors():
    with pytest.raises(ModelSpecError) as exc_info:
        resolve_model("torchvision:resnet5")
    assert assert_one_line(exc_info) == (
        "unknown torchvision model 'resnet5': did you mean 'resnet50'? "
        "(torchvision.models.list_models() lists all)")
    with pytest.raises(ModelSpecError, match="list of images") as exc_info:
        resolve_model("torchvision:fasterrcnn_resnet50_fpn")
    assert_one_line(exc_info)
    with pytest.raises(ModelSpecError, match="never loads weights"):
        resolve_model("torchvision:resnet50", model_kwargs={"weights": "DEFAULT"})


# --------------------------------------------------------------------------- hf table

@pytest.mark.parametrize("hub_name", sorted(EXPECTED_PARAMS))
def test_hf_table_parameter_counts(hub_name):
    by_formula, published = EXPECTED_PARAMS[hub_name]
    if published is not None:
        assert by_formula == published  # the formulas themselves are right
    model = build(resolve_model(f"hf:{hub_name}"))
    assert count_params(model) == by_formula
    assert all(p.device.type == "meta" for p in model.parameters())


@pytest.mark.parametrize("name", sorted(PUBLISHED_BILLIONS))
def test_llm_table_published_parameter_counts(name):
    model = build(resolve_model(f"hf:{name}"))
    billions = sum(p.numel() for p in model.parameters()) / 1e9
    published, precision = PUBLISHED_BILLIONS[name]
    assert abs(billions - published) <= precision, billions


def test_moe_builds_every_expert():
    # Qwen3-30B-A3B: 48 layers x 128 experts x 3 x 2048 x 768 expert weights
    model = build(resolve_model("hf:Qwen/Qwen3-30B-A3B"))
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    assert experts == 48 * 128 * 3 * 2048 * 768


def test_every_table_entry_is_tested_and_names_its_config_class():
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    assert {e.hub_name for e in ENTRIES} == set(EXPECTED_PARAMS) | set(PUBLISHED_BILLIONS)
    for entry in ENTRIES:
        assert CONFIG_MAPPING[entry.config["model_type"]].__name__ == entry.config_class


def test_bert_base_masked_lm_is_bert_plus_head():
    # BertModel with pooler: the well-known 109,482,240; the MLM head drops the pooler
    # (768*768+768) and adds transform (768*768+768), LayerNorm (2*768) and a bias (30522).
    assert bert_mlm_params(30522, 512, 2, 768, 12, 3072) == 109_482_240 + 2 * 768 + 30522


@pytest.mark.parametrize("name, hub_name", [
    ("gpt2", "openai-community/gpt2"),
    ("GPT2", "openai-community/gpt2"),
    ("openai-community/gpt2", "openai-community/gpt2"),
    ("gpt2-medium", "openai-community/gpt2-medium"),
    ("bert-base-uncased", "google-bert/bert-base-uncased"),
    ("roberta-base", "FacebookAI/roberta-base"),
    ("t5-small", "google-t5/t5-small"),
    ("meta-llama/Llama-2-7b-hf", "meta-llama/Llama-2-7b-hf"),
    ("Llama-2-7b-hf", "meta-llama/Llama-2-7b-hf"),
    ("llama-2-7b", "meta-llama/Llama-2-7b-hf"),
    ("LLAMA-2-13B-HF", "meta-llama/Llama-2-13b-hf"),
    ("meta-llama/Meta-Llama-3-8B", "meta-llama/Meta-Llama-3-8B"),
    ("Meta-Llama-3-8B-Instruct", "meta-llama/Meta-Llama-3-8B"),
    ("Llama-3.1-8B", "meta-llama/Llama-3.1-8B"),
    ("meta-llama/Meta-Llama-3.1-8B", "meta-llama/Llama-3.1-8B"),
    ("llama-3-70b", "meta-llama/Meta-Llama-3-70B"),
    ("mistral-7b", "mistralai/Mistral-7B-v0.1"),
    ("qwen/qwen2.5-0.5b", "Qwen/Qwen2.5-0.5B"),
    ("Qwen2.5-7B", "Qwen/Qwen2.5-7B"),
    ("phi-3-mini", "microsoft/Phi-3-mini-4k-instruct"),
    ("distilbert-base-uncased", "distilbert/distilbert-base-uncased"),
    ("pythia-1b", "EleutherAI/pythia-1b"),
    ("TinyLlama-1.1B", "TinyLlama/TinyLlama-1.1B-Chat-v1.0"),
    ("Llama-3.2-1B", "meta-llama/Llama-3.2-1B"),
])
def test_hf_alias_resolution(name, hub_name):
    assert find_hf_config(name).hub_name == hub_name
    assert resolve_model(f"hf:{name}").name == f"hf:{name}"


def test_hf_names_are_unique_across_entries():
    seen: dict[str, str] = {}
    for entry in ENTRIES:
        for name in entry.names:
            assert seen.setdefault(name, entry.hub_name) == entry.hub_name, name
    assert "gpt2" in hf_config_names()


@pytest.mark.parametrize("name, seq_len", [
    ("gpt2", 1024), ("bert-base-uncased", 512), ("roberta-base", 512), ("distilbert", 512),
    ("t5-small", 512), ("llama-2-7b", 4096), ("Meta-Llama-3-8B", 4096), ("pythia-1b", 2048),
    ("tinyllama", 2048), ("phi-3-mini", 4096),
])
def test_hf_default_inputs(name, seq_len):
    spec = resolve_model(f"hf:{name}")
    entry = find_hf_config(name)
    vocab = entry.config["vocab_size"]
    tokens = TensorSpec((seq_len,), "int64", low=0, high=vocab)
    assert spec.input_spec == {"input_ids": tokens, "labels": tokens}
    assert spec.is_token_model and spec.hf_labels and spec.loss_fn is None
    assert spec.vocab_size == vocab and spec.default_seq_len == seq_len


@pytest.mark.parametrize("name, model_class", [
    ("gpt2", "GPT2LMHeadModel"), ("bert-base-uncased", "BertForMaskedLM"),
    ("roberta-base", "RobertaForMaskedLM"), ("t5-small", "T5ForConditionalGeneration"),
    ("llama-2-7b", "LlamaForCausalLM"), ("phi-3-mini", "Phi3ForCausalLM"),
])
def test_hf_model_class_and_attention(name, model_class):
    model = build(resolve_model(f"hf:{name}", model_kwargs={"num_hidden_layers": 1}))
    assert type(model).__name__ == model_class
    assert model.config._attn_implementation == "sdpa"
    if hasattr(model.config, "use_cache"):
        assert model.config.use_cache is False


def test_hf_seq_len_override():
    spec = resolve_model("hf:llama-2-7b", seq_len=512)
    assert spec.input_spec["input_ids"].shape == (512,)
    assert spec.input_spec["labels"].shape == (512,)
    assert spec.default_seq_len == 4096
    spec = resolve_model("hf:llama-2-7b", seq_len=16384)  # rotary: no hard limit
    assert spec.input_spec["input_ids"].shape == (16384,)


def test_hf_seq_len_beyond_learned_positions():
    with pytest.raises(InvalidInputError) as exc_info:
        resolve_model("hf:gpt2", seq_len=2048)
    assert "n_positions=N" in assert_one_line(exc_info)
    with pytest.raises(InvalidInputError, match="512 positions"):
        resolve_model("hf:roberta-base", seq_len=513)
    spec = resolve_model("hf:gpt2", seq_len=2048, model_kwargs={"n_positions": 2048})
    assert count_params(build(spec)) == gpt2_params(50257, 2048, 768, 12)


def test_hf_config_overrides():
    spec = resolve_model("hf:llama-2-7b", model_kwargs={"num_hidden_layers": 2,
                                                        "hidden_size": 1024})
    model = build(spec)
    # head_dim is derived in the config constructor: it must follow the new hidden size.
    assert count_params(model) == llama_params(32000, 1024, 2, 32, 32, 11008, False)
    with pytest.raises(ModelSpecError) as exc_info:
        resolve_model("hf:llama-2-7b", model_kwargs={"num_hiden_layers": 2})
    assert "did you mean 'num_hidden_layers'?" in assert_one_line(exc_info)


def test_hf_sequence_classification_task():
    spec = resolve_model("hf:bert-base-uncased",
                         model_kwargs={"task": "sequence_classification", "num_labels": 5})
    assert spec.input_spec["labels"] == TensorSpec((), "int64", low=0, high=5)
    assert spec.input_spec["input_ids"].shape == (512,)
    model = build(spec)
    assert type(model).__name__ == "BertForSequenceClassification"
    spec = resolve_model("hf:tinyllama", model_kwargs={"task": "sequence-classification"},
                         seq_len=64)
    assert spec.input_spec["labels"].shape == ()  # the seq-len override leaves it alone
    assert type(build(spec)).__name__ == "LlamaForSequenceClassification"
    with pytest.raises(InvalidInputError, match="unknown hf task"):
        resolve_model("hf:gpt2", model_kwargs={"task": "translation"})


def test_hf_builds_in_the_default_dtype_not_the_checkpoint_dtype():
    # The table records torch_dtype bfloat16 / float16; the engine picks the precision.
    assert next(build(resolve_model("hf:qwen2.5-0.5b")).parameters()).dtype == torch.float32
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = build(resolve_model("hf:llama-2-7b", model_kwargs={"num_hidden_layers": 1}))
    finally:
        torch.set_default_dtype(previous)
    assert next(model.parameters()).dtype == torch.bfloat16


@pytest.mark.parametrize(("name", "stored"), [
    ("hf:llama-2-7b", "float16"), ("llama-2-7b", "float16"),  # config.json: torch_dtype
    ("hf:qwen2.5-0.5b", "bfloat16"), ("Qwen/Qwen2.5-0.5B", "bfloat16"),
    ("hf:gpt2", None),  # gpt2's config.json has no torch_dtype
    ("torchvision:resnet18", None),  # not a Hugging Face checkpoint
])
def test_the_spec_records_the_checkpoint_dtype_with_or_without_the_hf_prefix(name, stored):
    # plan trains a 16-bit checkpoint in its dtype; a bare name is the same model as hf:NAME,
    # so it carries the same stored dtype (the CLI looked it up for hf: names only)
    assert resolve_model(name).checkpoint_dtype == stored


def test_hf_unknown_name_suggests_and_explains():
    with pytest.raises(ModelSpecError) as exc_info:
        resolve_model("hf:meta-llama/Llama-2-7b-hg")
    message = assert_one_line(exc_info)
    # the Hub id the user can paste, with its organisation and casing
    assert ("unknown hf model 'meta-llama/Llama-2-7b-hg': did you mean "
            "'hf:meta-llama/Llama-2-7b-hf'?") in message
    assert "put its config.json in a local directory and pass hf:path/to/dir" in message


@pytest.mark.parametrize("name", ["HuggingFaceTB/SmolLM2-1.7B",  # another organisation
                                  "Qwen/Qwen2.5-1.5B",  # the table has 0.5B: another size
                                  "huggyllama/llama-7b"])  # meta-llama's is not this one
def test_hf_unknown_hub_id_suggests_no_other_model(name, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ModelSpecError) as exc_info:
        resolve_model(f"hf:{name}")
    message = assert_one_line(exc_info)
    assert f"unknown hf model '{name}'" in message and "did you mean" not in message
    assert f"hf download {name} config.json" in message  # how to fix it instead


def test_hf_input_shape_is_rejected_for_token_models():
    with pytest.raises(InvalidInputError, match="with seq_len, not input_shape") as exc_info:
        resolve_model("hf:gpt2", input_shape=(512,))
    assert_one_line(exc_info)


def test_image_model_rejects_seq_len():
    with pytest.raises(InvalidInputError, match="seq_len applies to token models.*with input_shape") as exc_info:
        resolve_model("timm:resnet50", seq_len=128)
    assert_one_line(exc_info)


@pytest.mark.parametrize("seq_len", [0, -1, 2.5, True])
def test_bad_seq_len(seq_len):
    with pytest.raises(InvalidInputError, match="sequence length"):
        resolve_model("hf:gpt2", seq_len=seq_len)


# --------------------------------------------------------------------------- hf local configs

TINY_LLAMA_CONFIG = """{
  "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
  "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
  "num_hidden_layers": 3, "vocab_size": 1000, "max_position_embeddings": 8192,
  "tie_word_embeddings": false, "torch_dtype": "bfloat16"
}"""


def test_hf_local_config_dir(tmp_path):
    (tmp_path / "config.json").write_text(TINY_LLAMA_CONFIG)
    expected = llama_params(1000, 256, 3, 4, 2, 512, False)
    for spec_text in (f"hf:{tmp_path}", str(tmp_path)):
        spec = resolve_model(spec_text)
        assert spec.vocab_size == 1000 and spec.default_seq_len == 4096
        model = build(spec)
        assert count_params(model) == expected
        assert next(model.parameters()).dtype == torch.float32
    spec = resolve_model(f"hf:{tmp_path}", model_kwargs={"num_hidden_layers": 1}, seq_len=100)
    assert count_params(build(spec)) == llama_params(1000, 256, 1, 4, 2, 512, False)
    assert spec.input_spec["input_ids"].shape == (100,)


def test_hf_local_dir_errors(tmp_path):
    with pytest.raises(ModelSpecError, match="has no config.json"):
        resolve_model(f"hf:{tmp_path}")
    (tmp_path / "config.json").write_text('{"hidden_size": 8}')
    with pytest.raises(ModelSpecError, match="model_type"):
        resolve_model(f"hf:{tmp_path}")
    (tmp_path / "config.json").write_text('{"model_type": "no-such-architecture"}')
    with pytest.raises(ModelSpecError, match="does not know model_type"):
        resolve_model(f"hf:{tmp_path}")


@pytest.mark.slow
def test_llama_2_7b_builds_on_meta_fast_without_memory():
    code = textwrap.dedent("""
        import resource, time, torch
        from batchfit.models.resolve import resolve_model
        spec = resolve_model("hf:meta-llama/Llama-2-7b-hf")
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        start = time.perf_counter()
        with torch.device("meta"):
            model = spec.factory()
        seconds = time.perf_counter() - start
        grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
        print(sum(p.numel() for p in model.parameters()), seconds, grown_mib)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(SRC)}, check=True, timeout=300)
    params, seconds, grown_mib = out.stdout.split()
    assert int(params) == 6_738_415_616
    assert float(seconds) < 10
    assert float(grown_mib) < 300  # real fp32 weights would be ~25,700 MiB


# --------------------------------------------------------------------------- user files

FACTORY_FILE = '''
import torch
from torch import nn
from batchfit.engine.spec import TensorSpec


class Net(nn.Module):
    def __init__(self, width=8):
        super().__init__()
        self.fc = nn.Linear(4, width)
        self.register_buffer("scale", torch.ones(width))

    def forward(self, x):
        return self.fc(x) * self.scale


def plain(width=8):
    return Net(width)


def with_input(width=8):
    return Net(width), TensorSpec((4,))


def with_loss(width=8):
    return Net(width), TensorSpec((4,)), lambda output, batch: output.sum()


def as_dict(width=8):
    return {"model": Net(width), "input_spec": (4,)}


class TokenNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(100, 8)

    def forward(self, input_ids, mask):
        return self.emb(input_ids) * mask.unsqueeze(-1)


def tokens():
    return TokenNet(), {"input_ids": TensorSpec((32,), "int64", high=100),
                        "mask": TensorSpec((32,))}


def pair():
    return Net(), (TensorSpec((4,)), TensorSpec((4,)))


def broken(width=8):
    raise RuntimeError("no GPU\\nsecond line")


def wrong_type():
    return 42


_helper = 1
'''


@pytest.fixture
def factory_file(tmp_path):
    path = tmp_path / "my_model.py"
    path.write_text(FACTORY_FILE)
    return path


def test_file_factory_module_form(factory_file):
    spec = resolve_model(f"{factory_file}:plain", model_kwargs={"width": 16})
    assert spec.input_spec is None and spec.loss_fn is None and not spec.is_token_model
    model = build(spec)
    assert count_params(model) == 4 * 16 + 16
    assert model.scale.device.type == "meta"  # the factory's torch.ones landed on meta
    spec = resolve_model(f"{factory_file}:plain", input_shape=(4,))
    assert spec.input_spec == TensorSpec((4,))


def test_file_factory_tuple_and_dict_forms(factory_file):
    assert resolve_model(f"{factory_file}:with_input").input_spec == TensorSpec((4,))
    spec = resolve_model(f"{factory_file}:with_loss")
    assert spec.loss_fn(torch.ones(2), None).item() == 2.0
    spec = resolve_model(f"{factory_file}:as_dict")
    assert spec.input_spec == TensorSpec((4,))
    assert count_params(build(spec)) == 4 * 8 + 8


def test_file_factory_token_model(factory_file):
    spec = resolve_model(f"{factory_file}:tokens")
    assert spec.is_token_model and spec.vocab_size == 100 and spec.default_seq_len == 32
    spec = resolve_model(f"{factory_file}:tokens", seq_len=64)
    assert spec.input_spec["input_ids"].shape == (64,)
    assert spec.input_spec["mask"].shape == (64,)  # shares the sequence axis


def test_file_factory_relative_path(factory_file, monkeypatch):
    monkeypatch.chdir(factory_file.parent)
    spec = resolve_model("my_model.py:with_input")
    assert spec.input_spec == TensorSpec((4,))


def test_file_factory_errors(factory_file, tmp_path):
    with pytest.raises(ModelSpecError) as exc_info:
        resolve_model("missing/x.py:make")
    assert assert_one_line(exc_info) == "model file 'missing/x.py' not found"

    with pytest.raises(ModelSpecError) as exc_info:
        resolve_model(f"{factory_file}:nope")
    message = assert_one_line(exc_info)
    assert "has no factory 'nope'" in message
    assert "as_dict, broken, pair, plain, tokens, with_input, with_loss, wrong_type" in message
    assert "_helper" not in message and "TensorSpec" not in message

    with pytest.raises(ModelSpecError, match="name the factory"):
        resolve_model(str(factory_file))

    with pytest.raises(ModelSpecError) as exc_info:
        resolve_model(f"{factory_file}:broken")
    message = assert_one_line(exc_info)
    assert str(factory_file) in message and "broken()" in message
    assert "RuntimeError: no GPU second line" in message

    with pytest.raises(ModelSpecError, match="returned int"):
        resolve_model(f"{factory_file}:wrong_type")

    with pytest.raises(ModelSpecError, match="unexpected keyword argument"):
        resolve_model(f"{factory_file}:plain", model_kwargs={"depth": 2})

    bad = tmp_path / "bad.py"
    bad.write_text("import no_such_module_xyz\n")
    with pytest.raises(ModelSpecError, match="importing model file .* failed: "
                                             "ModuleNotFoundError"):
        resolve_model(f"{bad}:f")

    with pytest.raises(InvalidInputError, match="several input tensors"):
        resolve_model(f"{factory_file}:pair", input_shape=(8,))
    assert resolve_model(f"{factory_file}:pair").input_spec == (TensorSpec((4,)),) * 2


def test_file_factory_sees_edits(tmp_path):
    path = tmp_path / "edited.py"
    path.write_text("from torch import nn\ndef f():\n    return nn.Linear(2, 2)\n")
    assert count_params(build(resolve_model(f"{path}:f"))) == 6
    path.write_text("from torch import nn\ndef f():\n    return nn.Linear(3, 3)\n")
    assert count_params(build(resolve_model(f"{path}:f"))) == 12


# --------------------------------------------------------------------------- bare names, pickling

@pytest.mark.parametrize("text, expected_params", [
    ("resnet50", 25_557_032),         # timm first
    ("vit_h_14", 632_045_800),        # not in timm: torchvision
    ("gpt2", 124_439_808),            # neither: the HF table
])
def test_bare_names(text, expected_params):
    assert count_params(build(resolve_model(text))) == expected_params


def test_bare_unknown():
    with pytest.raises(ModelSpecError) as exc_info:
        resolve_model("xyzzy")
    assert assert_one_line(exc_info) == (
        "unknown model spec 'xyzzy': use timm:NAME, torchvision:NAME, hf:NAME or "
        "path/to/file.py:factory")
    with pytest.raises(ModelSpecError, match="did you mean 'timm:resnet50'"):
        resolve_model("resnet5")
    with pytest.raises(ModelSpecError, match="empty model spec"):
        resolve_model("  ")


def test_factories_pickle(factory_file):
    # A spec can be shipped to a fresh process (one real trial per process).
    for text in ("timm:resnet18", "torchvision:resnet18", "hf:gpt2", f"{factory_file}:plain"):
        spec = resolve_model(text)
        factory = pickle.loads(pickle.dumps(spec.factory))
        with torch.device("meta"):
            assert isinstance(factory(), torch.nn.Module)
