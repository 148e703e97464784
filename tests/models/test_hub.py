"""``hf:ORG/NAME`` from the Hugging Face cache or the hub (``models/hub.py``).

Tests never download: tests/conftest.py sets ``HF_HUB_OFFLINE`` and an empty
``HF_HUB_CACHE``; each test here builds the cache folder it needs, in the layout
huggingface_hub writes (``models--ORG--NAME/refs/main`` naming a snapshot folder that
holds ``config.json``).
"""

from __future__ import annotations

import json

import huggingface_hub
import huggingface_hub.constants
import huggingface_hub.errors
import pytest
import torch
from typer.testing import CliRunner

from batchfit.cli import app
from batchfit.errors import ModelSpecError
from batchfit.models import hub
from batchfit.models.resolve import resolve_model

#: SmolLM2-1.7B's published config.json (huggingface.co/HuggingFaceTB/SmolLM2-1.7B), the
#: fields that shape the network; not in batchfit's offline table.
SMOLLM2_17B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
    "hidden_size": 2048, "intermediate_size": 8192, "num_attention_heads": 32,
    "num_hidden_layers": 24, "num_key_value_heads": 32, "vocab_size": 49152,
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-05, "rope_theta": 130000,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16",
}
#: By hand from that config: embeddings 49152 x 2048; per layer q, k, v, o 4 x 2048 x 2048,
#: gate, up, down 3 x 2048 x 8192 and two RMSNorm weights 2 x 2048; the final norm 2048;
#: the LM head tied to the embeddings.
SMOLLM2_17B_PARAMETERS = (49152 * 2048 + 24 * (4 * 2048 * 2048 + 3 * 2048 * 8192 + 2 * 2048)
                          + 2048)


@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
    """An empty Hugging Face cache folder; returns a function that puts a config in it."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))

    def put(repo_id: str, config: dict) -> None:
        repo = tmp_path / ("models--" + repo_id.replace("/", "--"))
        snapshot = repo / "snapshots" / "0123abcd"
        snapshot.mkdir(parents=True)
        (snapshot / "config.json").write_text(json.dumps(config))
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text("0123abcd")

    return put


def _parameters(spec) -> int:
    with torch.device("meta"):
        model = spec.factory()
    return sum(p.numel() for p in model.parameters())


def test_a_model_outside_the_table_is_read_from_the_cache(hf_cache):
    hf_cache("HuggingFaceTB/SmolLM2-1.7B", SMOLLM2_17B)
    spec = resolve_model("hf:HuggingFaceTB/SmolLM2-1.7B")
    assert _parameters(spec) == SMOLLM2_17B_PARAMETERS
    assert spec.max_positions == 8192


def test_the_cache_comes_before_the_offline_table(hf_cache):
    # the table's Llama-2-7b has 32 layers; the cached config (a user's copy) has 2
    table = resolve_model("hf:meta-llama/Llama-2-7b-hf", model_kwargs={"num_hidden_layers": 2})
    cached = {**json.loads(json.dumps(_table_config("meta-llama/Llama-2-7b-hf"))),
              "model_type": "llama", "num_hidden_layers": 2}
    hf_cache("meta-llama/Llama-2-7b-hf", cached)
    assert _parameters(resolve_model("hf:meta-llama/Llama-2-7b-hf")) == _parameters(table)


def _table_config(name: str) -> dict:
    from batchfit.models.hf_configs import find_hf_config

    return dict(find_hf_config(name).config)


def test_offline_without_cache_says_how_to_fix_it(hf_cache):
    with pytest.raises(ModelSpecError) as exc_info:
        resolve_model("hf:HuggingFaceTB/SmolLM2-1.7B")
    message = str(exc_info.value)
    assert "\n" not in message
    assert "HF_HUB_OFFLINE is set" in message
    assert "hf download HuggingFaceTB/SmolLM2-1.7B config.json" in message


def test_cli_reads_the_cache_and_refuses_offline(hf_cache):
    runner = CliRunner()
    words = ["estimate", "hf:HuggingFaceTB/SmolLM2-1.7B", "-b", "1", "--seq-len", "64",
             "--json"]
    missing = runner.invoke(app, words)
    assert missing.exit_code == 2
    assert "HF_HUB_OFFLINE" in missing.output
    # one line, saying how to fix it (no traceback without --debug), even under --json
    assert len(missing.output.strip().splitlines()) == 1
    assert "hf download HuggingFaceTB/SmolLM2-1.7B config.json" in missing.output
    hf_cache("HuggingFaceTB/SmolLM2-1.7B", {**SMOLLM2_17B, "num_hidden_layers": 1})
    found = runner.invoke(app, words)
    assert found.exit_code == 0, found.output
    # one layer: embeddings, one layer's weights, the final norm
    one_layer = 49152 * 2048 + 4 * 2048 * 2048 + 3 * 2048 * 8192 + 2 * 2048 + 2048
    assert json.loads(found.stdout)["parameter_count"] == one_layer


def _online(monkeypatch, fails_with: BaseException) -> None:
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)

    def download(repo_id, filename, **_):
        raise fails_with

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)


def _response(status: int):
    import httpx2

    return httpx2.Response(status, request=httpx2.Request(
        "GET", "https://huggingface.co/org/name/resolve/main/config.json"))


@pytest.mark.parametrize(("error", "words"), [
    (lambda: huggingface_hub.errors.GatedRepoError("gated", response=_response(401)),
     "is gated on the Hugging Face hub"),
    (lambda: huggingface_hub.errors.RepositoryNotFoundError("404", response=_response(404)),
     "no model 'org/name' on the Hugging Face hub"),
    (lambda: OSError("[Errno -2] Name or service not known"),
     "could not read the config of hf model 'org/name'"),
])
def test_hub_failures_are_one_line(hf_cache, monkeypatch, error, words):
    _online(monkeypatch, error())
    with pytest.raises(ModelSpecError) as exc_info:
        resolve_model("hf:org/name")
    message = str(exc_info.value)
    assert words in message and "\n" not in message
    assert "hf:path/to/dir" in message


def test_a_table_model_asks_no_network(hf_cache, monkeypatch):
    _online(monkeypatch, AssertionError("the hub was asked"))
    assert resolve_model("hf:meta-llama/Llama-2-7b-hf").is_token_model


def test_paths_and_ids():
    assert hub.is_hub_id("HuggingFaceTB/SmolLM2-1.7B") and hub.is_hub_id("gpt2")
    assert not hub.is_hub_id("a/b/c") and not hub.is_hub_id("has space/x")


def test_plan_for_a_bfloat16_llm_trains_in_its_dtype_and_says_so(hf_cache):
    # A one-layer SmolLM2 (its config says torch_dtype bfloat16): with no --precision, plan
    # computes in bfloat16 with float32 master weights (amp-bf16), as Hugging Face's Trainer
    # with bf16=True does, and states it; --precision still wins.
    tiny = {**SMOLLM2_17B, "num_hidden_layers": 1, "hidden_size": 64,
            "intermediate_size": 128, "num_attention_heads": 2, "num_key_value_heads": 2,
            "vocab_size": 256}
    hf_cache("HuggingFaceTB/SmolLM2-1.7B", tiny)
    words = ["plan", "hf:HuggingFaceTB/SmolLM2-1.7B", "--gpus", "2xA100", "--global-batch",
             "4", "--seq-len", "16", "--strategies", "ddp", "--checkpointing", "off",
             "--offload", "none"]
    runner = CliRunner()
    native = runner.invoke(app, [*words, "--json"])
    assert native.exit_code == 0, native.output
    data = json.loads(native.stdout)
    assert (data["precision"], data["precision_source"]) == ("amp-bf16", "checkpoint bfloat16")
    given = json.loads(runner.invoke(app, [*words, "--precision", "fp32", "--json"]).stdout)
    assert (given["precision"], given["precision_source"]) == ("fp32", "given")
    table = runner.invoke(app, words)
    assert table.exit_code == 0, table.output
    assert "precision: amp-bf16 (the model's bfloat16 checkpoint" in " ".join(table.output.split())
