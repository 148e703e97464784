"""What a forked child runs: the device probe, one boundary trial, one snapshot.

Every function here runs in a child forked from the kit's parent (:mod:`.pool`), which
imported torch and the models' libraries but never initialised CUDA, so each child is a
fresh CUDA process: its own context, its own caching allocator, capped by
``torch.cuda.set_per_process_memory_fraction(cap / total)``
(:func:`batchfit.realrun.trial.cuda_memory_cap`). Each returns a JSON-able dict.

The step is batchfit's own trial (:func:`batchfit.realrun.trial.run_trial`: build on the
CPU, move to the card, two steps, ``max_memory_reserved``/``max_memory_allocated`` over
the steady step) with ``torch.backends.cudnn.benchmark`` set as the row says. An
out-of-memory error (``torch.OutOfMemoryError``, or what
:func:`batchfit.realrun.trial.is_out_of_memory` recognises) is a ``memory`` failure; any
other error (a kernel limit, a cuDNN error) is an ``other`` failure with its message.

The dry run's "device" is the CPU under the project's own CPU trial
(:mod:`batchfit.realrun.trial_server`: ``RLIMIT_DATA`` = the data segment after a warm-up
step + the cap), so its boundaries mean what ``search --device cpu`` means.
"""

from __future__ import annotations

import contextlib
import os
import platform
import subprocess
import time
from pathlib import Path
from typing import Any

from benchmarks.gpu_truth.configs import Config

#: CPU threads per trial child (16 cores shared by the concurrent trials).
THREADS_PER_TRIAL = 2
#: Entries kept by the snapshot's allocator history (one steady step; bounded).
SNAPSHOT_MAX_ENTRIES = 100_000


def device_info(cuda: bool) -> dict[str, Any]:
    """The stack and the card: torch, CUDA, cuDNN, driver, name, memory, what CUDA offers."""
    import torch

    import batchfit

    info: dict[str, Any] = {"torch_version": torch.__version__, "cuda_version": torch.version.cuda,
                            "python": platform.python_version(), "cuda": cuda,
                            "batchfit_path": str(Path(batchfit.__file__).resolve().parent)}
    if not cuda:
        return {**info, "device_name": f"cpu ({platform.machine()})", "cudnn_version": None,
                "total_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")}
    props = torch.cuda.get_device_properties(0)
    free, total = torch.cuda.mem_get_info(0)
    info.update(device_name=torch.cuda.get_device_name(0), total_bytes=props.total_memory,
                free_bytes_at_start=free, mem_get_info_total_bytes=total,
                capability=list(torch.cuda.get_device_capability(0)),
                sm_count=props.multi_processor_count,
                cudnn_version=torch.backends.cudnn.version())
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                              "--format=csv,noheader"], capture_output=True, text=True,
                             timeout=20, check=False)
        info["nvidia_smi"] = smi.stdout.strip()
    return info


def _failure(exc: BaseException) -> dict[str, Any]:
    from batchfit.realrun.trial import is_out_of_memory

    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    message = f"{type(exc).__name__}: {lines[0] if lines else ''}"[:400]
    kind = "memory" if is_out_of_memory(exc) else "other"
    return {"fits": False, "kind": kind, "message": message}


def _prepare(config: Config, cuda: bool) -> tuple[Any, Any, Any]:
    import torch

    torch.set_num_threads(THREADS_PER_TRIAL)
    if cuda:
        torch.backends.cudnn.benchmark = config.cudnn_benchmark
    return config.trial_setup()


def boundary_trial(config: Config, batch_size: int, cuda: bool) -> dict[str, Any]:
    """Two steady steps of ``config`` at ``batch_size`` under its cap."""
    factory, inputs, train_config = _prepare(config, cuda)
    start = time.perf_counter()
    try:
        if cuda:
            return _cuda_trial(factory, inputs, train_config, config.cap_bytes, batch_size)
        return _cpu_trial(factory, inputs, train_config, config.cap_bytes, batch_size)
    except Exception as exc:  # noqa: BLE001 - any error is this trial's outcome
        return {**_failure(exc), "seconds": round(time.perf_counter() - start, 2)}


def _cuda_trial(factory: Any, inputs: Any, train_config: Any, cap_bytes: int,
                batch_size: int) -> dict[str, Any]:
    from batchfit.realrun.trial import cuda_memory_cap, run_trial

    with cuda_memory_cap("cuda:0", cap_bytes):
        trial = run_trial(factory, inputs, batch_size, train_config, device="cuda:0")
    if not trial.fits:
        return {"fits": False, "kind": "memory", "message": trial.error or "",
                "seconds": round(trial.seconds, 2)}
    return {"fits": True, "peak_reserved_bytes": trial.used_bytes,
            "peak_allocated_bytes": trial.peak_bytes, "seconds": round(trial.seconds, 2)}


def _cpu_trial(factory: Any, inputs: Any, train_config: Any, cap_bytes: int,
               batch_size: int) -> dict[str, Any]:
    """The project's CPU trial (``batchfit.realrun.trial_server``): build, warm up at
    batch 1, then ``RLIMIT_DATA`` = data segment + cap, then the steps; in this child."""
    from batchfit.realrun.trial_server import _PreparedTrial, trial_request

    request = trial_request(factory, inputs, batch_size, train_config, cap_bytes, 2)
    result = _PreparedTrial.build(request, pin_threads=False).run(batch_size, lambda _: None)
    if not result["fits"]:
        return {"fits": False, "kind": "memory", "message": result["error"] or "",
                "seconds": round(result["seconds"], 2)}
    return {"fits": True, "peak_reserved_bytes": result["used_bytes"],
            "peak_allocated_bytes": result["peak_bytes"], "seconds": round(result["seconds"], 2)}


def record_snapshot(config: Config, batch_size: int, cuda: bool, path: Path) -> dict[str, Any]:
    """One steady step of ``config`` at ``batch_size`` recorded with the allocator's history
    (python stacks of allocations only, :data:`SNAPSHOT_MAX_ENTRIES`), pickled to ``path``; on the CPU
    (dry run) the step runs unrecorded and uncapped, and only the config is written. The warm-up and the
    recording are ``benchmarks/gpu_snapshot.py``'s :func:`record_step`."""
    import torch

    from batchfit.engine.spec import Mode
    from batchfit.realrun.trial import _StepSetup

    factory, inputs, train_config = _prepare(config, cuda)
    device = torch.device("cuda:0" if cuda else "cpu")
    setup = _StepSetup.of(inputs, train_config, device)
    result: dict[str, Any] = {"batch_size": batch_size}
    from batchfit.realrun.trial import cuda_memory_cap

    with cuda_memory_cap(device, config.cap_bytes) if cuda else contextlib.nullcontext():
        model = setup.prepare(setup.build(factory))
        generator = torch.Generator(device=device).manual_seed(0)
        runner = setup.runner(model, None, generator)
        runner.batch = setup.batch(batch_size, generator)
        step = runner.train_step if train_config.mode is Mode.TRAIN else runner.infer_step
        if cuda:
            record_step = _gpu_snapshot().record_step
            snapshot = record_step(step, path, max_entries=SNAPSHOT_MAX_ENTRIES,
                                   stacks="python", context="alloc")
            result.update(segments=len(snapshot.get("segments", ())),
                          events=sum(len(t) for t in snapshot.get("device_traces", ())),
                          peak_reserved_bytes=torch.cuda.max_memory_reserved(device))
        else:
            for _ in range(3):
                step()
    return result


def _gpu_snapshot() -> Any:
    """``benchmarks/gpu_snapshot.py`` (a script that imports its neighbours by bare name)."""
    import importlib
    import sys

    scripts = str(Path(__file__).resolve().parents[1])
    if scripts not in sys.path:
        sys.path.insert(0, scripts)
    return importlib.import_module("gpu_snapshot")
