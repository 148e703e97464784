"""Serving capacity: vLLM's arithmetic on a small model, derived by hand, and the CLI."""

from __future__ import annotations

import json
import math

import pytest
from typer.testing import CliRunner

pytest.importorskip("transformers")

from batchfit.answers.serve import serve_capacity  # noqa: E402
from batchfit.cli import app  # noqa: E402

GiB = 1 << 30


def test_vllm_blocks_by_hand():
    # Qwen2.5-0.5B (bf16 checkpoint, tied embeddings) cut to 2 of its 24 layers: the
    # 151,936 x 896 embedding, per layer q/o 896x896, k/v 896x128 (q, k, v with biases),
    # the 3 MLP matrices 896x4864 and 2 norms, and the final norm; 2 KV heads x 64:
    # 2 x 2 x 64 x 2 B = 512 B per token and layer, a 16-token page 8 KiB
    kwargs = {"num_hidden_layers": 2}
    layer = 2 * 896 * 896 + 2 * 896 * 128 + 896 + 2 * 128 + 3 * 896 * 4864 + 2 * 896
    params = 151_936 * 896 + 2 * layer + 896
    r = serve_capacity("hf:Qwen/Qwen2.5-0.5B", device="A100 80GB", max_model_len=4096,
                       max_num_batched_tokens=512, max_num_seqs=16, model_kwargs=kwargs,
                       non_torch_bytes=GiB // 4, total_memory_bytes=80 * GiB)
    assert r.dtype == "bfloat16" and r.weights_bytes == params * 2
    assert r.kv_bytes_per_token == 2 * 512
    assert r.requested_bytes == math.ceil(80 * GiB * 0.9)
    assert r.kv_cache_bytes == (r.requested_bytes - r.weights_bytes - r.activation_peak_bytes
                                - GiB // 4)
    assert r.plan.num_blocks == r.kv_cache_bytes // 8192 // 2
    assert r.plan.blocks_per_request == 4096 // 16
    assert r.max_concurrency == pytest.approx(r.plan.num_blocks / 256)
    # the profile forward of 512 tokens or the sampler's 16 rows of 151,936 logits
    # (bf16 + fp32 copy + fp32 probabilities) and the final hidden states: the larger
    assert r.activation_peak_bytes >= 16 * 151_936 * 10 + 512 * 896 * 2
    fp8 = serve_capacity("hf:Qwen/Qwen2.5-0.5B", device="A100 80GB", max_model_len=4096,
                         max_num_batched_tokens=512, max_num_seqs=16, kv_dtype="fp8",
                         model_kwargs=kwargs, non_torch_bytes=GiB // 4,
                         total_memory_bytes=80 * GiB)
    assert fp8.plan.num_blocks == fp8.kv_cache_bytes // 4096 // 2


def test_serve_cli_json_and_bad_input():
    runner = CliRunner()
    result = runner.invoke(app, ["serve", "hf:Qwen/Qwen2.5-0.5B", "--gpu", "L4",
                                 "--max-model-len", "2048", "--max-num-batched-tokens", "256",
                                 "--model-kwargs", "num_hidden_layers=2", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    for key in ("num_blocks", "kv_tokens", "kv_bytes_per_token", "max_concurrency",
                "weights_bytes", "activation_peak_bytes", "kv_cache_bytes"):
        assert key in data
    assert data["kv_tokens"] == data["num_blocks"] * 16
    for args, fragment in [
        (["--max-model-len", "40000"], "above hf:Qwen/Qwen2.5-0.5B's context of 32768"),
        (["--gpu-memory-utilization", "1.5"], "must be in (0, 1]"),
        (["--kv-dtype", "int3"], "unknown --kv-dtype"),
        (["--engine", "tgi"], "unknown --engine"),
    ]:
        bad = runner.invoke(app, ["serve", "hf:Qwen/Qwen2.5-0.5B", "--gpu", "L4", *args])
        assert bad.exit_code == 2 and fragment in bad.output, bad.output
        assert len(bad.output.strip().splitlines()) == 1
