"""Which activation checkpointing a Hugging Face step gets when the user does not say
(``use_reentrant=None``): the recipe's own, else torch's default under peft's
``prepare_model_for_kbit_training``, else transformers' default for its version.

The rule is checked against the real libraries: a real tiny model is prepared exactly as a
user's script prepares it, run forward, and its autograd graph says which variant ran
(the reentrant ``torch.utils.checkpoint`` is one ``CheckpointFunctionBackward`` node;
the non-reentrant one leaves the layer's own ops in the graph)."""

from __future__ import annotations

import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

from tests.engine.test_workloads import SPEC, tiny_llama

from batchfit.engine.spec import TrainConfig
from batchfit.engine.trace import trace_step
from batchfit.engine.workloads.recipes import NON_REENTRANT_DEFAULT, Recipe, default_reentrant


def _ran_reentrant(model) -> bool:
    """Run one real forward with checkpointing on; whether the graph holds the reentrant
    checkpoint's autograd node."""
    model.train()
    ids = torch.randint(0, 100, (1, 8))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = model(input_ids=ids).logits
    seen, stack = set(), [out.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__ == "CheckpointFunctionBackward":
            return True
        stack.extend(next_fn for next_fn, _ in node.next_functions)
    return False


def test_peft_kbit_preparation_runs_torchs_default_as_the_rule_says():
    from peft import prepare_model_for_kbit_training

    model = tiny_llama()
    # what transformers sets on a model it loaded in 4 bits; peft reads only this flag
    model.is_loaded_in_4bit = True
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepare_model_for_kbit_training(model)  # the user's call, peft's defaults
    assert _ran_reentrant(model) is True
    assert TrainConfig(lora="r=8", quant="nf4").reentrant is True


def test_plain_transformers_checkpointing_runs_the_installed_default_as_the_rule_says():
    model = tiny_llama()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.gradient_checkpointing_enable()  # the user's call, transformers' defaults
    assert TrainConfig(lora="r=8", checkpointing=True).reentrant is _ran_reentrant(model)


def test_the_version_rule_follows_transformers_sources():
    # 4.57's gradient_checkpointing_enable: {"use_reentrant": True}; 5.0's: False
    assert default_reentrant(None, False, (4, 57))[0] is True
    assert default_reentrant(None, False, (4, 30))[0] is True  # torch's default then
    assert default_reentrant(None, False, NON_REENTRANT_DEFAULT)[0] is False
    assert default_reentrant(None, False, (5, 24))[0] is False
    # peft hands transformers {} (not None) whatever its version: torch's True
    assert default_reentrant(None, True, (5, 24))[0] is True
    assert default_reentrant(Recipe.PEFT, True, (5, 24))[0] is True
    # the frameworks' own: torchtune NO_REENTRANT, Unsloth and axolotl True
    assert default_reentrant(Recipe.TORCHTUNE, False, (4, 57))[0] is False
    assert default_reentrant(Recipe.UNSLOTH, False, (5, 24))[0] is True
    assert default_reentrant(Recipe.AXOLOTL, True, (5, 24))[0] is True
    assert TrainConfig(lora="r=8", checkpointing=True,
                       transformers_version="4.46").reentrant is True


def test_an_explicit_choice_wins():
    assert TrainConfig(lora="r=8", quant="nf4", use_reentrant=False).reentrant is False
    assert TrainConfig(lora="r=8", checkpointing=True, transformers_version="5.0",
                       use_reentrant=True).reentrant is True


def test_the_default_traces_the_variant_it_names():
    """A QLoRA step with peft's preparation is traced with the reentrant checkpoint unless
    the user says otherwise: the default's events are the explicit ``True``'s, not
    ``False``'s (the two variants hold different tensors during recomputation)."""
    from batchfit.device.profile import resolve_device

    device = resolve_device("A100 80GB")

    def events(**extra):
        config = TrainConfig(lora="r=8", quant="nf4", **extra)
        trace = trace_step(tiny_llama(), SPEC, 2, config, device)
        return [(e.kind, e.nbytes, e.op) for e in trace.steady_events]

    default = events()
    assert default == events(use_reentrant=True)
    assert default != events(use_reentrant=False)
