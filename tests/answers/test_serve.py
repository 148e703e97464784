"""Serving capacity: vLLM's arithmetic on a small model, derived by hand, and the CLI."""

from __future__ import annotations

import json
import math

import pytest
from typer.testing import CliRunner

pytest.importorskip("transformers")

from batchfit.answers.serve import serve_capacity  # noqa: E402
from batchfit.cli import app  # noqa: E402
from batchfit.errors import InvalidInputError  # noqa: E402

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
        (["--vllm-engine", "v2"], "unknown --vllm-engine"),
    ]:
        bad = runner.invoke(app, ["serve", "hf:Qwen/Qwen2.5-0.5B", "--gpu", "L4", *args])
        assert bad.exit_code == 2 and fragment in bad.output, bad.output
        assert len(bad.output.strip().splitlines()) == 1


def test_v0_sampler_sort_by_hand():
    # vLLM <= 0.6 (V0): the profile run samples every request with top_p 0.99 and top_k
    # vocab - 1, so Sampler._apply_top_k_top_p sorts the float32 logits. At the sort: the
    # model-dtype logits (2 B), the float32 copy (4), the sorted values (4) and int64
    # indices (8), and torch's stable-sort scratch (SortStable.cu): with >= 128 rows the
    # int64 reverse indices and CUB's alternate key and value buffers (8 + 4 + 8)
    from batchfit.answers.serve import sampler_bytes

    v = 151_936
    assert sampler_bytes(256, v, 2, "v0") == 256 * v * (2 + 4 + 4 + 8 + 20)
    # 2..127 rows: two int2 buffers, radix_sort_pairs' keys-out, CUB's alternates
    assert sampler_bytes(16, v, 2, "v0") == 16 * v * (2 + 4 + 12 + 8 + 8 + 4 + 4 + 8)
    # one row: sorted as one segment, the scratch is one row's
    assert sampler_bytes(1, v, 2, "v0") == v * (2 + 4 + 12 + 20)
    # a float32 model: .to(torch.float) returns the logits themselves, no copy
    assert sampler_bytes(256, v, 4, "v0") == 256 * v * (4 + 12 + 20)
    # V1's dummy sampler: the logits, their float32 copy and float32 probabilities
    assert sampler_bytes(256, v, 2, "v1") == 256 * v * (2 + 4 + 4)
    # end to end: 512 tokens over 256 requests of a 2-layer Qwen2.5-0.5B, where the sampler
    # (plus the final hidden states the runner holds) is above the forward's peak
    kwargs = dict(device="A100 80GB", max_model_len=4096, max_num_batched_tokens=512,
                  model_kwargs={"num_hidden_layers": 2}, non_torch_bytes=GiB // 4,
                  total_memory_bytes=80 * GiB)
    v0 = serve_capacity("hf:Qwen/Qwen2.5-0.5B", vllm_engine="v0", **kwargs)
    v1 = serve_capacity("hf:Qwen/Qwen2.5-0.5B", **kwargs)
    assert v0.activation_peak_bytes == 512 * 896 * 2 + 256 * v * 38
    assert v1.kv_cache_bytes - v0.kv_cache_bytes == (v0.activation_peak_bytes
                                                     - v1.activation_peak_bytes)
    assert v0.to_dict()["vllm_engine"] == "v0" and v1.to_dict()["vllm_engine"] == "v1"
    with pytest.raises(Exception, match="unknown vllm_engine"):
        serve_capacity("hf:Qwen/Qwen2.5-0.5B", vllm_engine="v2", **kwargs)


# Qwen2.5-0.5B cut to 2 layers (bf16 checkpoint, 14 query heads): parameters as counted in
# test_vllm_blocks_by_hand
_LAYER = 2 * 896 * 896 + 2 * 896 * 128 + 896 + 2 * 128 + 3 * 896 * 4864 + 2 * 896
_PARAMS_2_LAYERS = 151_936 * 896 + 2 * _LAYER + 896


def test_a_bf16_checkpoint_on_a_t4_is_served_in_fp16():
    # vLLM's CudaPlatformBase.supported_dtypes has no bfloat16 below compute capability 8.0,
    # and _resolve_auto_dtype falls back to float16 for a bfloat16 checkpoint there. In
    # float16 a T4 runs memory-efficient attention (sm50+), so the 2,048-token profile
    # forward keeps no 2,048 x 2,048 score matrix: in bfloat16 the math path's scores alone
    # are 14 heads x 2,048^2 x 2 B = 112 MiB per layer.
    r = serve_capacity("hf:Qwen/Qwen2.5-0.5B", device="T4", max_model_len=4096,
                       max_num_batched_tokens=2048, max_num_seqs=16,
                       model_kwargs={"num_hidden_layers": 2}, non_torch_bytes=GiB // 4)
    assert r.dtype == "float16" and r.kv_dtype == "float16"
    assert r.weights_bytes == _PARAMS_2_LAYERS * 2
    assert r.activation_peak_bytes < 14 * 2048 * 2048 * 2
    assert any("bfloat16" in note and "float16" in note for note in r.notes)
    assert r.to_dict()["notes"] == list(r.notes)
    # a card with bfloat16 keeps the checkpoint's dtype, with no note about it
    a100 = serve_capacity("hf:Qwen/Qwen2.5-0.5B", device="A100 40GB SXM", max_model_len=4096,
                          max_num_batched_tokens=2048, max_num_seqs=16,
                          model_kwargs={"num_hidden_layers": 2}, non_torch_bytes=GiB // 4)
    assert a100.dtype == "bfloat16" and a100.notes == ()
    # engine=hf with bitsandbytes weights: the compute dtype follows the card as well
    hf = serve_capacity("hf:Qwen/Qwen2.5-0.5B", device="T4", engine="hf", quant="nf4",
                        max_model_len=512, new_tokens=16, model_kwargs={"num_hidden_layers": 2})
    assert hf.dtype == "float16" and any("bfloat16" in note for note in hf.notes)


def test_bf16_asked_of_a_card_without_it_is_refused():
    runner = CliRunner()
    bad = runner.invoke(app, ["serve", "hf:Qwen/Qwen2.5-0.5B", "--gpu", "T4", "--dtype", "bf16",
                              "--model-kwargs", "num_hidden_layers=2"])
    assert bad.exit_code == 2, bad.output
    assert "no bfloat16" in bad.output and "--dtype fp16" in bad.output
    # one error line (a loaded machine may also show the progress line before it)
    assert [line.startswith("error:") for line in bad.output.strip().splitlines()][-1:] == [True]
    assert sum(line.startswith("error:") for line in bad.output.splitlines()) == 1
    # the hf engine too: batchfit refuses bf16 on a card without it for every step it traces
    # (answers.estimate.step_profile), in serve's own words: a Python caller's keyword
    with pytest.raises(InvalidInputError, match="no bfloat16.*use dtype='fp16'"):
        serve_capacity("hf:Qwen/Qwen2.5-0.5B", device="T4", engine="hf", dtype="bf16",
                       max_model_len=512, new_tokens=16, model_kwargs={"num_hidden_layers": 2})


def test_a_card_without_a_cuda_total_is_said_to_use_its_marketed_memory():
    kwargs = {"max_model_len": 2048, "max_num_batched_tokens": 256, "max_num_seqs": 16,
              "model_kwargs": {"num_hidden_layers": 2}, "non_torch_bytes": GiB // 4}
    h800 = serve_capacity("hf:Qwen/Qwen2.5-0.5B", device="H800", **kwargs)  # no public total
    assert h800.device.total_memory_bytes == 80 * GiB
    assert any("marketed 80.00 GiB" in n and "torch.cuda.mem_get_info()[1]" in n
               for n in h800.notes)
    t4 = serve_capacity("hf:Qwen/Qwen2.5-0.5B", device="T4", **kwargs)  # 15,109 MiB reported
    assert t4.device.total_memory_bytes == 15_109 * 2**20
    assert not any("marketed" in n for n in t4.notes)
    given = serve_capacity("hf:Qwen/Qwen2.5-0.5B", device="H800", total_memory_bytes=44 * GiB,
                           **kwargs)
    assert given.notes == ()


def test_exit_3_under_json_still_prints_the_verdict():
    # 256 MiB of card: vLLM may use ceil(0.9 x 268,435,456) = 241,591,911 B, less than the
    # bf16 weights alone (2 B per parameter), so nothing is left for the KV cache
    runner = CliRunner()
    args = ["serve", "hf:Qwen/Qwen2.5-0.5B", "--gpu", "A100 40GB SXM", "--total-memory",
            "256MiB", "--max-model-len", "2048", "--max-num-batched-tokens", "256",
            "--model-kwargs", "num_hidden_layers=2"]
    result = runner.invoke(app, [*args, "--json"])
    assert result.exit_code == 3, result.output
    data = json.loads(result.stdout)
    assert data["fits"] is False and data["model"] == "hf:Qwen/Qwen2.5-0.5B"
    assert data["available_bytes"] == 241_591_911
    assert data["needed_bytes"] > _PARAMS_2_LAYERS * 2 > data["available_bytes"]
    assert "leaves no memory for the KV cache" in data["verdict"]
    plain = runner.invoke(app, args)  # without --json: the one line, no JSON
    assert plain.exit_code == 3 and len(plain.output.strip().splitlines()) == 1
    fits = runner.invoke(app, [*args[:5], "40GiB", *args[6:], "--json"])
    assert fits.exit_code == 0 and json.loads(fits.stdout)["fits"] is True
