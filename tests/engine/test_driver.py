"""The step driver (batchfit.engine.driver): one pass prepares and runs a step for every
observer. Its memory events equal the code before it, byte for byte; the op costs come
from the same pass, with the same workload, stack and CUDA emulation as the memory."""

from __future__ import annotations

import contextlib
import json
import sys
from collections import Counter
from pathlib import Path

import pytest
from torch import nn

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # driver_reference: the cases and their digest

import driver_reference

from batchfit.engine.spec import TrainConfig
from batchfit.errors import InvalidInputError, ModelForwardError
from batchfit.speed.op_costs import trace_op_costs, trace_step_and_costs

REFERENCE = json.loads((HERE / "driver_reference.json").read_text())


@pytest.mark.parametrize("name", sorted(REFERENCE))
def test_memory_events_equal_the_code_before_the_driver(name):
    # The reference was recorded by main (ac24284), before the driver: see
    # driver_reference.py's docstring for the command.
    pytest.importorskip("transformers")
    if name.startswith("llama-lora"):
        pytest.importorskip("peft")
    if name.startswith("keras"):
        pytest.importorskip("keras")
    assert driver_reference.digest_case(name) == REFERENCE[name]


@pytest.mark.parametrize("name", ["resnet18-a100-amp-bf16", "gpt2-a100-amp-fp16",
                                  "llama-lora-cpu", "keras-cnn-cpu"])
def test_the_op_cost_observer_leaves_the_memory_events_alone(name):
    from batchfit.device.profile import resolve_device

    pytest.importorskip("transformers")
    if name.startswith("llama-lora"):
        pytest.importorskip("peft")
    if name.startswith("keras"):
        pytest.importorskip("keras")
    factory, inputs, batch, options, device, _ = driver_reference.CASES[name]
    inputs = inputs() if callable(inputs) else inputs
    traced, ops = trace_step_and_costs(factory, inputs, batch, TrainConfig(**options),
                                       resolve_device(device))
    assert ops
    assert driver_reference._digest(traced.steady_events) == REFERENCE[name]["steady"]
    assert driver_reference._digest(traced.first_events) == REFERENCE[name]["first"]


def _mlp():
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))


def _cnn():
    return nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 32, 3, padding=1),
                         nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))


def _optimizer_ops(stack):
    config = TrainConfig(optimizer="adamw", stack=stack)
    ops = trace_op_costs(_mlp, (32,), 4, config, device="V100")
    return [op.op for op in ops if "foreach" in op.op], ops


def test_op_costs_run_the_stacks_optimizer_implementation():
    # torch 1.10 made the for-loop AdamW the default (foreach became CUDA's default in 2.0),
    # and the memory trace runs that; the op costs used foreach on every GPU target.
    # For-loop AdamW over 4 parameters runs no _foreach_ op; the foreach one does.
    foreach_old, ops_old = _optimizer_ops("torch1.10+cu113")
    foreach_new, _ = _optimizer_ops(None)
    assert foreach_old == []
    assert foreach_new
    # the for-loop runs each elementwise update once per parameter (4 parameters)
    assert sum(op.op == "aten.addcmul_.default" for op in ops_old) == 4


def test_op_costs_trace_the_llm_workload():
    # LoRA freezes the base weights: backward computes no weight gradient for them, so a
    # step with LoRA on every linear layer has fewer FLOPs than full fine-tuning (the op
    # costs skipped the workload and counted full fine-tuning).
    pytest.importorskip("peft")
    inputs = driver_reference._tokens(labels=True)
    full = trace_op_costs(driver_reference._llama, inputs, 2, TrainConfig())
    lora = trace_op_costs(driver_reference._llama, inputs, 2,
                          TrainConfig(lora="r=8,targets=all-linear"))
    assert sum(op.flops for op in lora) < sum(op.flops for op in full)


def test_fused_attention_is_one_op_with_torchs_formula():
    # GPT-2 on an A100 in fp16 runs flash attention: one op per layer forward, one
    # backward. Forward FLOPs, by hand: QK^T and PV, 2 * B * H * S * S * D each.
    pytest.importorskip("transformers")
    batch, heads, seq, head_dim = 2, 4, driver_reference.SEQ, 64 // 4
    ops = trace_op_costs(driver_reference._gpt2, driver_reference._tokens(labels=True), batch,
                         TrainConfig(precision="amp-fp16"), device="A100")
    forward = [op for op in ops if op.op == "aten._scaled_dot_product_flash_attention.default"]
    backward = [op for op in ops
                if op.op == "aten._scaled_dot_product_flash_attention_backward.default"]
    assert len(forward) == len(backward) == 2  # two layers
    assert {op.flops for op in forward} == {2 * 2 * batch * heads * seq * seq * head_dim}
    assert {op.kind.value for op in forward} == {"attention"}


def test_predict_throughput_traces_each_step_once(monkeypatch):
    # Every step is run once (counted by its forward pass, per batch size), and the points
    # at the batches whose op costs were traced carry that same pass's memory: the
    # estimate of that batch on the same device, not an interpolation.
    import batchfit
    from batchfit.answers import tracepool
    from batchfit.engine.step import StepRunner
    from batchfit.speed.roofline import predict_throughput

    monkeypatch.setattr(tracepool, "_can_fork", lambda: False)  # count in this process
    runs: Counter[int] = Counter()
    forward = StepRunner.forward_loss

    def counting(self):
        args, kwargs = self.batch
        first = next(iter(args or kwargs.values()))
        runs[int(first.shape[0])] += 1
        return forward(self)

    monkeypatch.setattr(StepRunner, "forward_loss", counting)
    config = TrainConfig(optimizer="adamw", precision="amp-bf16")
    prediction = predict_throughput(_cnn, (3, 64, 64), config, gpu="A100", max_batch_limit=64)
    assert runs and set(runs.values()) == {1}, runs
    assert {4, 5, 8} <= set(runs)
    at = {p.batch_size: p.peak_bytes for p in prediction.points}
    # Before, batch 4 read the max-batch solve's smallest traced batch (np.interp clamps):
    # 578,813,952 B where the step at 4 needs 562,036,736 B.
    for batch_size in (4, 8):
        expected = batchfit.estimate(_cnn, (3, 64, 64), batch_size, config,
                                     device=prediction.device).total_bytes
        assert at[batch_size] == expected


def test_keras_op_costs_come_from_the_driver():
    pytest.importorskip("keras")
    ops = trace_op_costs(driver_reference._keras_cnn, None, 8, TrainConfig())
    assert any(op.kind.value.startswith("conv") for op in ops)
    assert all(isinstance(op.flops, int) for op in ops)


class _Hook:
    removed = False

    def remove(self):
        self.removed = True


@pytest.mark.parametrize("raised", [None, RuntimeError("boom"), InvalidInputError("bad")])
def test_guarded_run_translates_errors_and_always_removes_the_hooks(raised):
    # the one wrapper the torch driver and the Keras runner share (review debt D5)
    from batchfit.engine.step_trace import guarded_run
    from batchfit.engine.tracer import Phase, Tracer

    tracer = Tracer()
    tracer.phase = Phase.BACKWARD
    hooks = [_Hook(), _Hook()]
    expected = pytest.raises(Exception) if raised else contextlib.nullcontext()
    with expected as caught, guarded_run(tracer, nn.Linear(2, 2), hooks):
        if raised is not None:
            raise raised
    assert all(hook.removed for hook in hooks)
    if isinstance(raised, InvalidInputError):  # batchfit's own errors pass as they are
        assert caught.value is raised
    elif raised is not None:  # the model's error becomes one line naming the phase
        assert isinstance(caught.value, ModelForwardError)
        assert str(caught.value).startswith("the backward phase raised RuntimeError")
        assert caught.value.__cause__ is raised
