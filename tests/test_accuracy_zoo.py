"""``benchmarks/zoo.py``: the cases of ``benchmarks/accuracy_cpu.py`` are asked in the user's
words, and the real run measures the step those words name."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import batchfit
from batchfit.api.answers import STEP_WORDS
from batchfit.engine.spec import Mode, OptimizerName, Precision, TensorSpec

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import zoo


@pytest.mark.parametrize("case", zoo.CASES, ids=lambda c: c.name)
def test_a_case_is_a_spec_string_and_option_names(case: zoo.Case) -> None:
    assert case.spec.startswith(("timm:", "hf:", "benchmarks/zoo.py:")), case.spec
    assert set(case.words) <= set(STEP_WORDS), set(case.words) - set(STEP_WORDS)
    assert case.step.config.mode is Mode(case.words.get("mode", "train"))


def test_the_real_step_is_the_one_the_words_name() -> None:
    """unet-rgb-pure-bf16's words, read by hand: momentum SGD, pure bf16, the file's 3x128x128
    image and its reconstruction loss."""
    case = zoo.BY_NAME["unet-rgb-pure-bf16"]
    assert case.config.optimizer is OptimizerName.MOMENTUM
    assert case.config.precision is Precision.BF16
    assert case.config.loss_fn.__name__ == "reconstruction_loss"
    assert case.inputs == TensorSpec((3, 128, 128))
    assert type(case.factory()).__name__ == "UNet"


def test_the_inference_language_models_are_fed_no_labels() -> None:
    """An hf: spec's batch carries labels (its forward computes the loss, in both modes); the
    inference cases' model files feed token ids alone, as the zoo always did."""
    for name, vocab in (("gpt2-4l-infer", 50257), ("llama-tiny-infer", 32000)):
        assert zoo.BY_NAME[name].inputs == {
            "input_ids": TensorSpec((128,), "int64", high=vocab)}, name
    assert "labels" in zoo.BY_NAME["gpt2-4l"].inputs


def test_the_words_ask_what_the_real_step_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The public call with the case's words predicts what the engine predicts for the step
    the real run builds (the model-file path named from the repository root)."""
    monkeypatch.chdir(ROOT)
    case = zoo.BY_NAME["unet-rgb-pure-bf16"]
    asked = batchfit.estimate(case.spec, 2, device="cpu", **case.words)
    stepped = batchfit.estimate(case.factory, case.inputs, 2, case.config, device="cpu")
    assert asked.peak_allocated_bytes == stepped.peak_allocated_bytes
    assert asked.first_step_peak_bytes == stepped.first_step_peak_bytes
