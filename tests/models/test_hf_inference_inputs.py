"""``--mode infer`` on a Hugging Face model runs ``model(input_ids)``: the logits of every
position and no loss (before, the batch carried ``labels``, so the forward also computed
the loss: the logits in float32 and their log-softmax). Checked against the profiler's peak
of the same real forward on the CPU."""

from __future__ import annotations

import pytest

from batchfit.api.step import resolve_step

pytest.importorskip("transformers")

TINY_GPT2 = ["n_layer=1", "n_embd=64", "n_head=2"]


def test_inference_feeds_no_labels_and_training_still_does():
    infer = resolve_step("hf:gpt2", mode="infer", seq_len=32, model_kwargs=TINY_GPT2)
    train = resolve_step("hf:gpt2", mode="train", seq_len=32, model_kwargs=TINY_GPT2)
    assert sorted(infer.inputs) == ["input_ids"]
    assert sorted(train.inputs) == ["input_ids", "labels"]
    t5 = resolve_step("hf:google-t5/t5-small", mode="infer", seq_len=16,
                      model_kwargs=["num_layers=1", "num_decoder_layers=1"])
    assert sorted(t5.inputs) == ["decoder_input_ids", "input_ids"]


def test_the_inference_estimate_is_the_real_forward_without_a_loss():
    import torch

    from batchfit.answers.estimate import estimate
    from batchfit.realrun.measure import measure_step

    torch.set_num_threads(1)
    step = resolve_step("hf:gpt2", mode="infer", seq_len=128, model_kwargs=TINY_GPT2,
                        precision="fp32")
    predicted = estimate(step.spec.factory, step.inputs, 4, step.config, device="cpu")
    measured = measure_step(step.spec.factory, step.inputs, 4, step.config, steps=2)
    assert predicted.peak_allocated_bytes == measured.peak_bytes
    # the loss is gone: the logits, 4 x 128 x 50,257 float32 (102,926,336 bytes), are the
    # largest tensor alive, and nothing of their size is made again after them
    logits = 4 * 128 * 50_257 * 4
    weights = sum(p.numel() * 4 for p in step.spec.factory().parameters())
    assert logits < predicted.peak_allocated_bytes - weights < 2 * logits


def test_a_seq2seq_model_infers_with_its_decoder_inputs():
    from batchfit.answers.estimate import estimate

    step = resolve_step("hf:google-t5/t5-small", mode="infer", seq_len=16,
                        model_kwargs=["num_layers=1", "num_decoder_layers=1"])
    assert estimate(step.spec.factory, step.inputs, 2, step.config,
                    device="cpu").peak_allocated_bytes > 0
