"""The kit's fork server: fresh CUDA processes without paying the imports each time.

The parent imports torch, timm, torchvision and transformers once and never initialises
CUDA; each job is a child forked from it (:func:`batchfit._fork.fork_child`), so a
trial starts with the libraries loaded and creates its own CUDA context. Forking before
CUDA is initialised is safe; after it is not: torch's docs ("Multiprocessing best
practices": "The CUDA runtime does not support the fork start method") and its source
(``torch/cuda/__init__.py``: ``_lazy_init`` registers the fork handler that marks a child
as a bad fork, ``torch._C._cuda_isInBadFork``; ``is_available()`` calls
``cudaGetDeviceCount``, which "initializes the CUDA Driver API via cuInit", unless
``PYTORCH_NVML_BASED_CUDA_CHECK=1`` makes it ask NVML, "to avoid fork poisoning",
pytorch/pytorch#83973). So the kit sets that variable before importing torch, asks the
card only from children, and checks ``torch.cuda.is_initialized()`` before every fork.

Admission: a job declares the device memory it may take (its cap plus a CUDA context);
jobs start while the running ones' reservations fit the pool's memory and there is a
free slot (16 cores: a few threads per child). A child that outlives its timeout is
killed; one that dies without a result reports its exit status.
"""

from __future__ import annotations

import json
import os
import select
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from batchfit._fork import fork_child


@dataclass
class Job:
    """One child's work: ``run()`` returns a JSON-able dict (the child's result)."""

    name: str
    run: Callable[[], dict[str, Any]]
    reserve_bytes: int
    timeout_s: float
    payload: dict[str, Any] = field(default_factory=dict)  # the parent's own bookkeeping


@dataclass
class _Running:
    job: Job
    pid: int
    fd: int
    started: float
    chunks: list[bytes] = field(default_factory=list)


def _child(job: Job) -> Callable[[int, int], None]:
    def run(control_fd: int, output_fd: int) -> None:
        os.close(control_fd)
        try:
            result = job.run()
        except BaseException as exc:  # noqa: BLE001 - reported, not raised, to the parent
            lines = str(exc).strip().splitlines()
            result = {"fits": False, "kind": "crash",
                      "message": f"{type(exc).__name__}: {lines[0] if lines else ''}"[:400]}
        data = json.dumps(result).encode()
        view = memoryview(data)
        while view:
            view = view[os.write(output_fd, view):]
        os.close(output_fd)
    return run


def _check_cuda_untouched() -> None:
    import sys

    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        raise RuntimeError("CUDA was initialised in the kit's parent: a forked trial would "
                           "inherit a broken context")


class ForkPool:
    """Runs :class:`Job` s in forked children within a memory and a slot budget."""

    def __init__(self, memory_bytes: int, slots: int) -> None:
        self.memory_bytes = memory_bytes
        self.slots = slots
        self.running: dict[int, _Running] = {}

    @property
    def reserved_bytes(self) -> int:
        return sum(r.job.reserve_bytes for r in self.running.values())

    def can_start(self, job: Job) -> bool:
        if len(self.running) >= self.slots:
            return False
        # a job larger than the whole pool runs alone
        return (self.reserved_bytes + job.reserve_bytes <= self.memory_bytes
                or not self.running)

    def start(self, job: Job) -> None:
        _check_cuda_untouched()
        pid, control_fd, output_fd = fork_child([], _child(job))
        os.close(control_fd)
        self.running[output_fd] = _Running(job, pid, output_fd, time.monotonic())

    def poll(self, wait_s: float) -> list[tuple[Job, dict[str, Any]]]:
        """Results of the jobs that ended within ``wait_s`` (timed-out ones killed)."""
        done: list[tuple[Job, dict[str, Any]]] = []
        if self.running:
            ready, _, _ = select.select(list(self.running), [], [], wait_s)
            for fd in ready:
                chunk = os.read(fd, 1 << 16)
                if chunk:
                    self.running[fd].chunks.append(chunk)
                    continue
                done.append(self._finish(fd))
        elif wait_s:
            time.sleep(wait_s)
        now = time.monotonic()
        for fd, running in list(self.running.items()):
            if now - running.started > running.job.timeout_s:
                os.kill(running.pid, signal.SIGKILL)
                job, _ = self._finish(fd)
                done.append((job, {"fits": False, "kind": "timeout",
                                   "message": f"killed after {job.timeout_s:.0f} s"}))
        return done

    def _finish(self, fd: int) -> tuple[Job, dict[str, Any]]:
        running = self.running.pop(fd)
        os.close(fd)
        _, status = os.waitpid(running.pid, 0)
        data = b"".join(running.chunks)
        try:
            return running.job, json.loads(data)
        except ValueError:
            signum = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
            why = f"signal {signum}" if signum else f"exit {os.WEXITSTATUS(status)}"
            return running.job, {"fits": False, "kind": "crash",
                                 "message": f"the child ended without a result ({why})"}

    def stop_all(self) -> list[Job]:
        """Kill every running child (the budget is spent); return their jobs."""
        stopped = []
        for fd, running in list(self.running.items()):
            os.kill(running.pid, signal.SIGKILL)
            os.waitpid(running.pid, 0)
            os.close(fd)
            stopped.append(running.job)
        self.running.clear()
        return stopped
