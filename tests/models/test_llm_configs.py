"""The offline table's current LLM families, each checked against the parameter count its
model card or hub page publishes (an independent check of the config fields)."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from batchfit.engine.fake import build_on_meta  # noqa: E402
from batchfit.models.resolve import resolve_model  # noqa: E402

#: name -> (published total parameters in billions, its precision in billions)
PUBLISHED = {
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


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_parameter_count(name):
    model = build_on_meta(resolve_model(f"hf:{name}").factory)
    billions = sum(p.numel() for p in model.parameters()) / 1e9
    published, precision = PUBLISHED[name]
    assert abs(billions - published) <= precision, billions


def test_moe_builds_every_expert():
    # Qwen3-30B-A3B: 48 layers x 128 experts x 3 x 2048 x 768 expert weights
    model = build_on_meta(resolve_model("hf:Qwen/Qwen3-30B-A3B").factory)
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    assert experts == 48 * 128 * 3 * 2048 * 768
