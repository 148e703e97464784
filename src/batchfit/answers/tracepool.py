"""Two fake traces at once: this process and one forked worker that lives for a search.

Fake traces are pure CPU work that does not depend on each other, and a forked child
shares the model already built on meta. The worker is forked once, at the first pair,
and then serves every later pair, for a reason torch imposes: once a process has run
a backward pass, autograd's device threads exist, and a child forked after that fails
its own first backward ("Unable to handle autograd's threading in combination with
fork-based multiprocessing"). A trace runs a backward pass on fake CUDA tensors, so a
fresh fork per pair (as before) only ever worked for the first pair; every later child
failed and its batch was traced again in sequence. The worker is forked at the first
pair, before this process's first backward, so it can trace as many batches as it is
sent (it checks at once with one tiny backward pass, and the pool runs in sequence
when that fails: a process that trained before calling batchfit cannot fork a worker), and it keeps its own warm
caches (the first trace of a process pays for ``torch._dynamo``'s import and the fake
tensor caches: about 2x a later trace).

The answer never depends on the worker: when it fails or goes quiet for longer than a
generous timeout, it is stopped and this process traces that batch (and every later
one) itself. Off (sequential) on one core, on systems without ``fork``, once CUDA is
initialised (a forked child cannot use it), when no core is idle right now, with
``BATCHFIT_PARALLEL_TRACES=0``, and for CPU targets (their traces run the profiler to
calibrate kernel scratch, and kineto hangs in a forked child).
"""

from __future__ import annotations

import os
import pickle
import select
import signal
import struct
import time
from collections.abc import Callable, Sequence
from typing import Any, Self

from batchfit._fork import fork_child

_LENGTH = struct.Struct("<Q")
_BATCH = struct.Struct("<q")


class TracePool:
    """``map(batch_sizes) -> {b: trace(b)}``, two at a time where the machine allows.

    Use as a context manager (or call :meth:`close`), so the worker exits with the search.
    """

    def __init__(self, trace: Callable[[int], Any], *, allowed: bool = True) -> None:
        self._trace = trace
        self._allowed = allowed
        self._worker: _Worker | None = None

    def map(self, batch_sizes: Sequence[int]) -> dict[int, Any]:
        todo = list(batch_sizes)
        result: dict[int, Any] = {}
        while len(todo) >= 2 and self.parallel():
            first, second, *todo = todo
            result.update(self._pair(first, second))
        result.update({b: self._trace(b) for b in todo})
        return result

    def parallel(self) -> bool:
        """Whether a pair would run at once now (the first call forks the worker)."""
        if not self._allowed:
            return False
        if self._worker is not None:  # forked already: only the machine's load can say no
            return _idle_cores() >= 1.5
        if not _can_fork():
            return False
        self._worker = _Worker.fork(self._trace)
        if not self._worker.ready():
            self._stop_worker()
            return False
        return True

    def _pair(self, first: int, second: int) -> dict[int, Any]:
        worker = self._worker
        assert worker is not None
        traced = None
        try:
            worker.send(second)
            start = time.perf_counter()
            mine = self._trace(first)
            traced = worker.receive(timeout_s=30 + 3 * (time.perf_counter() - start))
        finally:
            if traced is None:  # the worker failed, timed out, or this trace raised
                self._stop_worker()
        return {first: mine, second: traced if traced is not None else self._trace(second)}

    def _stop_worker(self) -> None:
        """The worker failed: stop it; every later trace runs here."""
        self._release(kill=True)

    def close(self) -> None:
        """Let the worker exit; later traces run here (a fork now would follow a backward)."""
        self._release(kill=False)

    def _release(self, *, kill: bool) -> None:
        self._allowed = False
        if self._worker is not None:
            self._worker.close(kill=kill)
            self._worker = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Worker:
    """A forked child that traces the batch sizes it reads and writes back the results."""

    def __init__(self, pid: int, requests: int, replies: int) -> None:
        self.pid, self.requests, self.replies = pid, requests, replies

    @classmethod
    def fork(cls, trace: Callable[[int], Any]) -> _Worker:
        """The worker serves until this process closes the request pipe (its failures
        show here as silence, and this process re-traces)."""
        pid, requests, replies = fork_child([], lambda request, reply:
                                            _serve(trace, request, reply))
        return cls(pid, requests, replies)

    def ready(self, timeout_s: float = 30.0) -> bool:
        """Whether the worker can run a backward pass (it cannot when this process had
        run one before the fork: a library call after training, a second search)."""
        return _read_exactly(self.replies, 1, timeout_s) == b"1"

    def send(self, batch_size: int) -> None:
        os.write(self.requests, _BATCH.pack(batch_size))

    def receive(self, timeout_s: float) -> Any | None:
        """The worker's trace, or None if it failed or went quiet for ``timeout_s``."""
        header = _read_exactly(self.replies, _LENGTH.size, timeout_s)
        if header is None:
            return None
        (size,) = _LENGTH.unpack(header)
        payload = _read_exactly(self.replies, size, timeout_s) if size else None
        try:
            return pickle.loads(payload) if payload else None
        except Exception:  # noqa: BLE001 - e.g. an error whose arguments do not unpickle
            return None

    def close(self, *, kill: bool) -> None:
        os.close(self.requests)  # EOF: an idle worker exits
        os.close(self.replies)
        if kill:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        os.waitpid(self.pid, 0)


def _serve(trace: Callable[[int], Any], requests: int, replies: int) -> None:
    import torch

    torch.set_num_threads(1)  # the parent's OpenMP pool does not survive a fork
    try:
        torch.ones(1, requires_grad=True).sum().backward()
    except RuntimeError:
        os.write(replies, b"0")
        return
    os.write(replies, b"1")
    while True:
        request = _read_exactly(requests, _BATCH.size, timeout_s=None)
        if request is None:
            return
        (batch_size,) = _BATCH.unpack(request)
        try:
            payload = pickle.dumps(trace(batch_size), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:  # noqa: BLE001 - the parent traces this batch itself and reports
            payload = b""
        os.write(replies, _LENGTH.pack(len(payload)))
        view = memoryview(payload)
        while view:
            view = view[os.write(replies, view):]


def _read_exactly(fd: int, size: int, timeout_s: float | None) -> bytes | None:
    """``size`` bytes from ``fd``; None at EOF or when nothing arrives for ``timeout_s``."""
    chunks, remaining = [], size
    while remaining:
        ready, _, _ = select.select([fd], [], [], timeout_s)
        if not ready:
            return None
        chunk = os.read(fd, min(remaining, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)


def _can_fork() -> bool:
    if not hasattr(os, "fork") or os.environ.get("BATCHFIT_PARALLEL_TRACES") == "0":
        return False
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    # A second core that other work keeps busy makes the pair slower than in sequence
    # (measured for ResNet-50's `max`: 24.5 s vs 20.0 s with one core taken; 9.3-10.1 s
    # vs 10.9-11.5 s on a quiet machine), so fork only when a core is idle right now.
    if (cores or 1) < 2 or _idle_cores() < 1.5:  # this process and the child: two cores
        return False
    import torch

    return not torch.cuda.is_initialized()


def _idle_cores(window_s: float = 0.05) -> float:
    """Cores' worth of idle CPU over the next ``window_s`` (/proc/stat); on systems
    without it, assume two. The load average lags by a minute, so it is not used."""

    def sample() -> tuple[int, int] | None:
        try:
            with open("/proc/stat") as stat:
                fields = [int(v) for v in stat.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        return sum(fields), fields[3] + (fields[4] if len(fields) > 4 else 0)

    first = sample()
    time.sleep(window_s)
    second = sample()
    if first is None or second is None or second[0] <= first[0]:
        return 2.0
    return (second[1] - first[1]) / (second[0] - first[0]) * (os.cpu_count() or 1)
