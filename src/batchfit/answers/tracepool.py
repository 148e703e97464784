"""Two fake traces at once: a pair (:class:`TracePool`, ``max``: this process and one forked
worker that lives for a search) or a queue (:class:`TraceQueue`, ``plan``: two forked
workers, each taking the next waiting trace as it comes free).

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
from collections.abc import Callable, Generator, Sequence
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


class TraceQueue:
    """Requests traced by two forked workers, each taking the next one as it comes free:
    ``run(tasks)`` drives searches that each wait on their own traces, so that one
    search's long trace never holds up another's (a pair, by contrast, waits for its
    longer half).

    The workers are forked by :meth:`start`, before this process runs a backward pass
    (see the module docstring); this process then only hands out requests and collects
    answers. Where no worker can run (one core, no ``fork``, no idle core right now,
    ``BATCHFIT_PARALLEL_TRACES=0``, CUDA initialised, ``allowed`` False) or a worker
    fails or goes quiet, this process traces the request itself: the answers never
    depend on the workers. Use as a context manager (or call :meth:`close`).
    """

    #: How long a worker may take over a trace before it is stopped and this process
    #: traces the request itself: generous, from the longest trace seen so far; before
    #: any has finished, a fixed ceiling (a failed worker shows at once, as end of file:
    #: this only catches a worker that hangs).
    FIRST_TIMEOUT_S = 1800.0

    def __init__(self, trace: Callable[[int], Any], *, allowed: bool = True) -> None:
        self._trace = trace
        self._allowed = allowed
        self._workers: list[_Worker] = []
        self._busy: dict[_Worker, tuple[int, float]] = {}  # worker -> (request, started)
        self._longest_s = 0.0

    @property
    def parallel(self) -> bool:
        """Whether two workers are running."""
        return len(self._workers) == 2

    def start(self) -> bool:
        """Fork the two workers now, unless they cannot run; whether they run. Call it
        before this process's first backward pass; later calls do nothing."""
        if self._allowed and _can_fork():
            for _ in range(2):
                # the second must not hold the first's pipes open (its end of file)
                self._workers.append(_Worker.fork(self._trace, self._workers))
                if not self._workers[-1].ready():
                    self.close(kill=True)  # one worker alone gains nothing over this process
                    break
        self._allowed = False
        return self.parallel

    def run(self, tasks: Sequence[Generator[list[int], dict[int, Any], Any]],
            rank: Callable[[int], Any] | None = None,
            on_start: Callable[[int], None] | None = None) -> list[Any]:
        """Drive every task to its end; return what each returns, in order.

        A task is a generator that yields the requests it needs next (a list) and is sent
        their results (``{request: result}``) once all of them are traced; a request asked
        by several tasks, or again, is traced once. Waiting requests are taken smallest
        ``rank(request)`` first, then by the task that asked first; ``on_start(request)``
        is called as each trace begins."""
        order = rank or (lambda request: 0)
        done: dict[int, Any] = {}
        asker: dict[int, int] = {}  # request -> the first task that asked for it
        queued: list[int] = []
        waits: dict[int, list[int]] = {}
        ends: dict[int, Any] = {}

        def advance(index: int, sent: dict[int, Any] | None) -> None:
            while True:
                try:
                    asked = list(dict.fromkeys(tasks[index].send(sent)))
                except StopIteration as stop:
                    ends[index] = stop.value
                    return
                if not all(request in done for request in asked):
                    break
                sent = {request: done[request] for request in asked}
            waits[index] = asked
            running = {request for request, _ in self._busy.values()}
            for request in asked:
                if request not in done and request not in queued and request not in running:
                    asker.setdefault(request, index)
                    queued.append(request)

        for index in range(len(tasks)):
            advance(index, None)
        while waits:
            queued.sort(key=lambda request: (order(request), asker[request]))
            request, result = self._next(queued, on_start)
            done[request] = result
            for index, asked in list(waits.items()):
                if all(r in done for r in asked):
                    del waits[index]
                    advance(index, {r: done[r] for r in asked})
        return [ends[index] for index in range(len(tasks))]

    def _next(self, queued: list[int], on_start: Callable[[int], None] | None
              ) -> tuple[int, Any]:
        """Hand the first of ``queued`` to each free worker (taking them off it), a
        second one only while a core is idle, then return the next answer: a worker's,
        or, with none running, this process's own trace of the first request."""
        while queued:
            free = [worker for worker in self._workers if worker not in self._busy]
            # this process's workers are part of the load: a second trace needs one
            # more idle core (a core other work keeps busy makes two slower than one)
            if not free or (self._busy and _idle_cores() + len(self._busy) < 1.5):
                break
            request = queued.pop(0)
            if on_start is not None:
                on_start(request)
            free[0].send(request)
            self._busy[free[0]] = (request, time.perf_counter())
        if not self._busy:
            request = queued.pop(0)
            if on_start is not None:
                on_start(request)
            return request, self._timed(request)
        return self._answer()

    def _timed(self, request: int) -> Any:
        start = time.perf_counter()
        result = self._trace(request)
        self._longest_s = max(self._longest_s, time.perf_counter() - start)
        return result

    def _answer(self) -> tuple[int, Any]:
        """The first answer a running worker sends back; a worker that fails (end of
        file, a reply that does not unpickle) or outlives its timeout is stopped, and
        this process traces its request."""
        limit = 120 + 4 * self._longest_s if self._longest_s else self.FIRST_TIMEOUT_S
        while True:
            now = time.perf_counter()
            late = [w for w, (_, started) in self._busy.items() if now - started > limit]
            if late:
                return self._take_over(late[0])
            wait = min(limit - (now - started) for _, started in self._busy.values())
            by_fd = {worker.replies: worker for worker in self._busy}
            ready, _, _ = select.select(list(by_fd), [], [], max(wait, 0.0))
            if not ready:
                continue
            worker = by_fd[ready[0]]
            request, started = self._busy[worker]
            traced = worker.receive(timeout_s=limit)
            if traced is None:
                return self._take_over(worker)
            del self._busy[worker]
            self._longest_s = max(self._longest_s, time.perf_counter() - started)
            return request, traced

    def _take_over(self, worker: _Worker) -> tuple[int, Any]:
        request, _ = self._busy.pop(worker)
        self._workers.remove(worker)
        worker.close(kill=True)
        return request, self._timed(request)

    def close(self, *, kill: bool = False) -> None:
        """Let the workers exit (or stop them; a worker still tracing, after an error
        here, is stopped); any later trace runs here."""
        for worker in self._workers:
            worker.close(kill=kill or worker in self._busy)
        self._workers, self._busy = [], {}

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Worker:
    """A forked child that traces the batch sizes it reads and writes back the results."""

    def __init__(self, pid: int, requests: int, replies: int) -> None:
        self.pid, self.requests, self.replies = pid, requests, replies

    @classmethod
    def fork(cls, trace: Callable[[int], Any], others: Sequence[_Worker] = ()) -> _Worker:
        """The worker serves until this process closes the request pipe (its failures
        show here as silence, and this process re-traces). ``others``: workers forked
        before, whose pipes the child closes (else it would keep their request pipes
        open, and they would never see end of file)."""
        pid, requests, replies = fork_child(
            [_Pipes(other) for other in others],
            lambda request, reply: _serve(trace, request, reply))
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


class _Pipes:
    """A worker's two pipe ends in a child forked after it, closed there by
    :func:`~batchfit._fork.fork_child`."""

    def __init__(self, worker: _Worker) -> None:
        self.fds = (worker.requests, worker.replies)

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)


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
