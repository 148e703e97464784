"""Parsing --lora and --quant: every bad input is one InvalidInputError line."""

from __future__ import annotations

import re

import pytest

from batchfit.errors import InvalidInputError
from batchfit.engine.workloads.spec import (ALL_LINEAR, AdapterDtype, LoraSpec, QuantMethod, parse_lora,
                                     parse_quant)


def test_parse_lora_full():
    spec = parse_lora("r=16,alpha=32,targets=all-linear,dropout=0.05")
    assert (spec.r, spec.alpha, spec.dropout, spec.targets) == (16, 32.0, 0.05, ALL_LINEAR)
    assert spec.dtype is None and spec.bias == "none"  # unset: the recipe's (peft's fp32)
    from batchfit.engine.spec import TrainConfig

    assert TrainConfig(lora=spec).lora.dtype is AdapterDtype.FP32


def test_parse_lora_lists_and_defaults():
    spec = parse_lora("r=8,targets=q_proj+v_proj,save=lm_head,dtype=base,dora=true")
    assert spec.targets == ("q_proj", "v_proj") and spec.modules_to_save == ("lm_head",)
    assert spec.dtype is AdapterDtype.BASE and spec.dora
    assert parse_lora("r=4").targets is None  # peft's default for the model type
    assert parse_lora("r=4,targets=q_proj").targets == ("q_proj",)


@pytest.mark.parametrize("text, words", [
    ("r=16,rnk=4", "unknown lora key 'rnk'"),
    ("r=0", "rank r=0 must be a positive integer"),
    ("r=-3", "must be a positive integer"),
    ("r=x", "is not a number"),
    ("r=8,dropout=1.5", "dropout=1.5 must be in [0, 1)"),
    ("r", "malformed lora item 'r'"),
    ("r=8,r=4", "given twice"),
    ("r=8,bias=some", "bias='some'"),
    ("r=8,dtype=int8", "dtype='int8'"),
])
def test_bad_lora(text, words):
    with pytest.raises(InvalidInputError) as info:
        parse_lora(text)
    assert words in str(info.value) and "\n" not in str(info.value)


def test_parse_quant():
    assert parse_quant("nf4").method is QuantMethod.NF4
    dq = parse_quant("NF4_DQ").method
    assert dq.double_quant and dq.quant_type == "nf4" and dq.is_4bit
    assert not parse_quant("int8").method.is_4bit
    with pytest.raises(InvalidInputError, match="unknown quant 'nf3'"):
        parse_quant("nf3")


def test_parse_quant_compute_dtype():
    """``compute=`` sets bitsandbytes' 4-bit compute dtype (before: no user option did)."""
    assert parse_quant("fp4,compute=fp32").compute_dtype == "float32"
    assert parse_quant("nf4-dq, compute=BF16").compute_dtype == "bfloat16"
    assert parse_quant("fp4").compute_dtype is None
    for text, words in (("fp4,compute=fp8", "compute='fp8'"), ("fp4,dtype=fp32", "unknown"),
                        ("int8,compute=fp16", "int8 has none")):
        with pytest.raises(InvalidInputError, match=re.escape(words)):
            parse_quant(text)


def test_quant_text_reaches_the_config():
    from batchfit.engine.spec import TrainConfig

    config = TrainConfig(mode="infer", quant="fp4,compute=fp32")
    assert config.quant.method is QuantMethod.FP4 and config.quant.compute_dtype == "float32"


def test_lora_spec_direct():
    assert LoraSpec(r=2, targets=["a", "b"]).targets == ("a", "b")
    with pytest.raises(InvalidInputError):
        LoraSpec(r=True)
    with pytest.raises(InvalidInputError):
        LoraSpec(r=2, targets=[])
