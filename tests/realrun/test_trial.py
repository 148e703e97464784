"""Real trials: out-of-memory classification and recovery, bit-exact state restore, capped
fresh-process trials against batch sizes derived by hand."""

from __future__ import annotations

import functools
import hashlib
import os
import random
import textwrap

import numpy as np
import pytest
import torch
from capped_models import Broadcast
from torch import nn

from batchfit.errors import InvalidInputError, TrialError
from batchfit.realrun.state import preserved_state
from batchfit.realrun.trial import is_out_of_memory, run_trial
from batchfit.realrun.trial_server import TrialServer, run_trial_subprocess

pytestmark = pytest.mark.slow  # real trials, some in capped fresh processes

MIB = 1 << 20
PINNED = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "OMP_NUM_THREADS": "1"}


class Aborts(nn.Module):
    """Kills its process from inside forward whenever the batch has more than one sample:
    a library that aborts when malloc fails, seen from outside."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > 1:
            os.abort()
        return self.linear(x)


class Raises(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise ValueError("bad shape in the user's forward")


class OutOfMemoryOnCall(nn.Module):
    """A 1024x1024 layer (4 MiB) whose forward asks the CPU allocator for 2**50 bytes on
    call number ``explode_at`` (after the first step has created gradients, optimizer
    state and activations): the allocator's real "can't allocate memory" error."""

    def __init__(self, explode_at: int | None = 2) -> None:
        super().__init__()
        self.linear = nn.Linear(1024, 1024)
        self.norm = nn.BatchNorm1d(1024)
        self.explode_at = explode_at
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        h = torch.relu(self.norm(self.linear(x)))
        if self.calls == self.explode_at:
            torch.empty(2**50, dtype=torch.uint8)
        return h


class SleepsAbove(nn.Module):
    """Sleeps for a minute in forward when the batch has more than four samples: a trial
    that hangs, seen from outside."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > 4:
            import time

            time.sleep(60)
        return self.linear(x)


def counted_broadcast(log_path: str) -> nn.Module:
    """A Broadcast whose every build appends this process's id to ``log_path``."""
    with open(log_path, "a") as log:
        log.write(f"{os.getpid()}\n")
    return Broadcast()


def fails_to_build() -> nn.Module:
    raise ValueError("the factory itself is broken")


def tiny_cnn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Flatten(), nn.Linear(8 * 8 * 8, 10))


@pytest.fixture(scope="module")
def server():
    with TrialServer([__name__], env=PINNED) as running:
        yield running


# --------------------------------------------------------------------------- classification


@pytest.mark.parametrize("exc, expected", [
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), True),
    (MemoryError(), True),
    (RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't "
                  "allocate memory: you tried to allocate 8388608 bytes."), True),
    (RuntimeError("could not create a primitive"), True),
    (RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"),
     True),
    # Types other than plain RuntimeError never match on the message alone:
    (ValueError("DefaultCPUAllocator: can't allocate memory"), False),
    (NotImplementedError("could not create a primitive"), False),
    (RecursionError("could not create a primitive"), False),
    (RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 4x4)"), False),
    (KeyError("out of memory"), False),
])
def test_is_out_of_memory(exc, expected):
    assert is_out_of_memory(exc) is expected


def test_real_cpu_allocator_error_is_out_of_memory():
    with pytest.raises(RuntimeError) as info:
        torch.empty(2**50, dtype=torch.uint8)
    assert is_out_of_memory(info.value)


# --------------------------------------------------------------------------- recovery in process


def _allocator_net_bytes(prof) -> int:
    """Net bytes the CPU allocator handed out while profiling: the sum of its own
    allocation (+) and free (-) reports, read from the raw kineto events (prof.events()
    drops most "[memory]" events)."""
    from torch.autograd import DeviceType

    total = 0
    for event in prof.profiler.kineto_results.events():
        if event.device_type() != DeviceType.CPU or event.nbytes() == 0:
            continue
        try:
            name = event.name()
        except UnicodeDecodeError:
            name = "[memory]"
        if name == "[memory]":
            total += event.nbytes()
    return total


def test_oom_trial_releases_everything_and_process_stays_usable():
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    model = OutOfMemoryOnCall(explode_at=2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    # Live before the trial: weight 4 MiB, bias 4 KiB, BatchNorm 4 x 4 KiB, counter 8 B.
    baseline = 1024 * 1024 * 4 + 1024 * 4 + 4 * 1024 * 4 + 8
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        trial = run_trial(model, (1024,), 256, optimizer=optimizer, steps=2)
    assert not trial.fits
    assert "can't allocate memory" in trial.error
    assert model.calls == 2  # step 1 ran (gradients, momentum, activations), step 2 failed
    # The allocator's own accounting: everything the trial allocated was freed again.
    assert abs(_allocator_net_bytes(prof)) <= 0.01 * baseline
    assert all(p.grad is None for p in model.parameters())
    assert len(optimizer.state) == 0  # the momentum buffers the trial created are gone
    model.explode_at = None
    again = run_trial(model, (1024,), 256, optimizer=optimizer, steps=2)
    assert again.fits and again.peak_bytes > baseline


def test_non_oom_errors_propagate_unchanged_in_process():
    with pytest.raises(ValueError, match="bad shape in the user's forward"):
        run_trial(Raises(), (4,), 2, optimizer="sgd")


def test_trial_arguments_are_checked():
    with pytest.raises(InvalidInputError, match="steps per trial"):
        run_trial(Broadcast(), (1,), 2, steps=1)
    with pytest.raises(InvalidInputError, match="batch size"):
        run_trial(Broadcast(), (1,), 0)


# --------------------------------------------------------------------------- state restore


def _digest(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, str]:
    """A hash of every parameter, buffer, gradient, optimizer state tensor, hyper-parameter,
    flag and RNG state."""
    found: dict[str, str] = {}

    def put(key: str, value) -> None:
        if isinstance(value, torch.Tensor):
            value = value.detach().cpu().contiguous()
            data = value.numpy().tobytes() if value.dtype != torch.bfloat16 else \
                value.view(torch.int16).numpy().tobytes()
            value = (str(value.dtype), tuple(value.shape), data)
        found[key] = hashlib.sha256(repr(value).encode()).hexdigest()

    for name, p in model.named_parameters():
        put(f"param:{name}", p)
        put(f"requires_grad:{name}", p.requires_grad)
        put(f"grad:{name}", p.grad if p.grad is not None else "none")
    for name, b in model.named_buffers():
        put(f"buffer:{name}", b)
    for name, module in model.named_modules():
        put(f"training:{name}", module.training)
    names = {id(p): n for n, p in model.named_parameters()}
    for p, state in optimizer.state.items():
        for key, value in state.items():
            put(f"optim:{names[id(p)]}:{key}", value)
    for index, group in enumerate(optimizer.param_groups):
        put(f"group:{index}", {k: v for k, v in group.items() if k != "params"})
    put("rng:torch", torch.get_rng_state())
    put("rng:numpy", repr(np.random.get_state()))
    put("rng:python", repr(random.getstate()))
    return found


def _trained_state():
    torch.manual_seed(1)
    model = tiny_cnn()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss = model(torch.randn(4, 3, 8, 8)).sum()
    loss.backward()
    optimizer.step()  # optimizer state exists; gradients stay
    model[0].weight.requires_grad_(False)  # a frozen layer
    model[1].eval()  # a module in eval mode inside a training model
    np.random.seed(3)
    random.seed(4)
    return model, optimizer


def test_preserved_state_restores_everything_bit_exactly_after_real_trials():
    model, optimizer = _trained_state()
    before = _digest(model, optimizer)
    grad_object = model[4].weight.grad
    with_state = set(optimizer.state)
    with preserved_state(model, optimizer) as snapshot:
        for batch_size in (2, 5):
            trial = run_trial(model, (3, 8, 8), batch_size, optimizer=optimizer, steps=3)
            assert trial.fits
            assert _digest(model, optimizer) != before  # the trial really trained
            snapshot.restore()
            assert _digest(model, optimizer) == before
        torch.rand(10), np.random.rand(), random.random()  # move every RNG
        optimizer.param_groups[0]["lr"] = 0.5
        model.train()
    assert _digest(model, optimizer) == before
    assert model[4].weight.grad is grad_object  # the user's tensors, not copies
    assert set(optimizer.state) == with_state


def test_preserved_state_keeps_the_data_loader_position():
    data = torch.utils.data.TensorDataset(torch.arange(32.0))
    generator = torch.Generator().manual_seed(7)
    loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True, generator=generator)
    expected = [b[0].tolist() for b in loader]  # the order of the first epoch...
    generator.manual_seed(7)
    with preserved_state(None, loader=loader):
        for _ in loader:  # ...a full epoch consumed inside the block
            pass
    assert [b[0].tolist() for b in loader] == expected


# --------------------------------------------------------------------------- capped fresh processes


def test_capped_trial_boundary_matches_hand_derivation(server):
    # 100 MiB cap, 12 MiB per sample (Broadcast's docstring): 8 * 12 = 96 MiB fits with
    # 4 MiB to spare; 9 * 12 = 108 MiB cannot.
    cap = 100 * MIB
    fits = run_trial_subprocess(Broadcast, (1,), 8, cap_bytes=cap, optimizer="sgd", server=server)
    fails = run_trial_subprocess(Broadcast, (1,), 9, cap_bytes=cap, optimizer="sgd", server=server)
    assert fits.fits and not fails.fits
    assert "can't allocate memory" in fails.error
    assert 8 * 12 * MIB <= fits.peak_bytes < 8 * 12 * MIB + 64 * 1024
    assert fits.peak_bytes - fits.baseline_bytes <= fits.used_bytes <= cap
    assert fits.limit_bytes == cap


def test_model_spec_forms_run_in_the_child(server, tmp_path):
    path = tmp_path / "factory_file.py"
    path.write_text(textwrap.dedent("""
        import torch
        from batchfit import TensorSpec

        def build(width=16):
            return torch.nn.Linear(width, 2), TensorSpec((width,))
    """))
    by_file = run_trial_subprocess(f"{path}:build", None, 4, optimizer="sgd", server=server)
    by_name = run_trial_subprocess(f"{__name__}:tiny_cnn", (3, 8, 8), 4, server=server)
    by_partial = run_trial_subprocess(functools.partial(nn.Linear, 8, 2), (8,), 4, server=server)
    by_module = run_trial_subprocess(tiny_cnn(), (3, 8, 8), 4, server=server)
    assert all(t.fits for t in (by_file, by_name, by_partial, by_module))
    # Linear(16, 2): weight 128 B + bias 8 B; plain SGD keeps no state.
    assert by_file.baseline_bytes == 136


def _trials_on(threads: int, *args, **kwargs) -> list:
    """Trials of one request with the caller on ``threads`` threads (a request carries
    the caller's thread count)."""
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return [run_trial_subprocess(*args[:2], batch_size, *args[3:], **kwargs)
                for batch_size in args[2]]
    finally:
        torch.set_num_threads(saved)


@pytest.mark.parametrize("threads", [1, 2])
def test_one_thread_trials_fork_from_one_warmed_up_template(server, tmp_path, threads):
    # One request (model, inputs, config, cap), three trials; a trial that ran out of
    # memory (9 x 12 MiB > 100 MiB) leaves nothing behind: batch 8 after it starts from
    # the same memory and measures the same bytes as before it. On one thread the model
    # is built once (the template); on two each trial builds its own (a template cannot
    # warm up on two threads and fork).
    builds = tmp_path / "builds.txt"
    factory = functools.partial(counted_broadcast, str(builds))
    trials = _trials_on(threads, factory, (1,), (8, 9, 8), cap_bytes=100 * MIB,
                        optimizer="sgd", server=server)
    assert [t.fits for t in trials] == [True, False, True]
    first, _, again = trials
    assert (again.used_bytes, again.peak_bytes, again.baseline_bytes) == \
        (first.used_bytes, first.peak_bytes, first.baseline_bytes)
    if threads == 1:
        assert len(builds.read_text().split()) == 1
    else:
        assert len(builds.read_text().split()) >= 3


def test_a_trial_that_times_out_is_killed_and_the_server_goes_on(server):
    with pytest.raises(TrialError, match="did not finish within 3"):
        run_trial_subprocess(SleepsAbove, (4,), 8, server=server, timeout_s=3)
    assert run_trial_subprocess(SleepsAbove, (4,), 2, server=server, timeout_s=60).fits


def test_a_model_that_fails_to_build_raises_for_every_trial(server):
    for batch_size in (2, 3):
        with pytest.raises(ValueError, match="the factory itself is broken"):
            run_trial_subprocess(fails_to_build, (4,), batch_size, server=server)


def test_trials_with_more_threads_start_their_team_before_the_cap(server):
    # A trial on two threads must not hang (GNU OpenMP hangs in a child forked after a
    # parallel region) and must start its thread team before the cap, as a fresh process
    # does in its warm-up: the worker thread's stack (RLIMIT_STACK, 8 MiB here) would
    # otherwise count against the cap. Measured: two threads use 4.8 MiB more than one
    # (the worker's malloc arena grows in the step); 12.9 MiB more when the team was
    # started after the cap.
    import resource

    stack, _ = resource.getrlimit(resource.RLIMIT_STACK)
    stack = 8 * MIB if stack == resource.RLIM_INFINITY else stack
    (one,), (two,) = (_trials_on(threads, tiny_cnn, (3, 8, 8), (256,), cap_bytes=256 * MIB,
                                 server=server, timeout_s=60) for threads in (1, 2))
    assert one.fits and two.fits
    assert two.used_bytes - one.used_bytes < stack


def test_non_oom_errors_propagate_unchanged_from_the_child(server):
    with pytest.raises(ValueError, match="bad shape in the user's forward") as info:
        run_trial_subprocess(Raises, (4,), 2, server=server)
    assert any("trial process" in note for note in getattr(info.value, "__notes__", []))


def test_child_killed_under_the_cap_does_not_fit(server):
    trial = run_trial_subprocess(Aborts, (4,), 2, cap_bytes=64 * MIB, server=server)
    assert not trial.fits
    assert "SIGABRT" in trial.error


def test_unpicklable_factory_is_rejected_with_the_fix():
    with pytest.raises(InvalidInputError, match="functools.partial"):
        run_trial_subprocess(lambda: nn.Linear(2, 2), (2,), 2, cap_bytes=MIB)


# --------------------------------------------------------------------------- CUDA


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_oom_recovery_and_cap():  # pragma: no cover - no GPU here
    from batchfit.realrun.trial import cuda_memory_cap

    model = Broadcast().cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    start = torch.cuda.memory_allocated()
    with cuda_memory_cap("cuda:0", 256 * MIB):
        fits = run_trial(model, (1,), 8, optimizer=optimizer)
        fails = run_trial(model, (1,), 64, optimizer=optimizer)
    assert fits.fits and not fails.fits
    assert fits.peak_bytes >= 8 * 12 * MIB
    assert torch.cuda.memory_allocated() == start
    assert fits.used_bytes >= fits.peak_bytes  # reserved >= allocated
