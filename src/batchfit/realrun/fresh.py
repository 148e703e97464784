"""Trials in exec'd fresh interpreters: the user's own process, for the CPU search's boundary.

Why the answer needs exec'd interpreters: a plain process's capped boundary is a draw
made by the process itself. Three inputs that differ from process to process decide the
layout of glibc's heap: Python's string-hash seed (random per interpreter unless
``PYTHONHASHSEED`` is set), the address-space layout (ASLR: ``id()``-based hashes order
sets and dicts, mappings align differently), and on more than one thread the
interleaving of the OpenMP threads' allocations and frees. The step's tensors below the
mmap threshold (which glibc raises, up to 32 MiB, as tensors are freed) are served from
the heap's holes or grow it, so the step's peak ``VmData`` differs by tens of MiB between
runs of the same batch. Measured with strace (``benchmarks/cpu_peak_spread.py``:
``VmData`` rebuilt from every mmap/munmap/mprotect/brk; small CNN, AdamW, 2 steps at
batch 40): 100-139 MiB over 3 plain processes (100-149 over 12 with earlier runs);
identical (137.5 MiB) in 5 of 5 with ``PYTHONHASHSEED=0``, ASLR off (``setarch -R``)
and one thread; with the hash seed and ASLR fixed on two threads, 2 of 3 runs agree and
the third is 10-21 MiB higher; with any one input left random it spreads 17-30 MiB.
None of them is the load or the machine: a user's training script draws all three. A
zygote's forks share the seed and the layout, so they repeat (nearly) one draw however
many of them run, and cannot show the flakiness; exec'd interpreters draw afresh, as the
user's training script does. (Forks also start from the zygote's heap and run under a
per-op usage tracker.) The bisection uses the fast zygote (its answer is a starting point); the
answer the user gets is settled here, in processes that are what a user's training
script is: ``sys.executable -c`` started with the caller's environment (or the trial
server's), importing torch, the model's module and the step, building the model and the
optimizer, one warm-up step at batch 1, the warm-up's gradients and batch dropped and
collected, ``RLIMIT_DATA`` = ``VmData`` + cap, then the steps at batch B with no tracker,
as a training loop runs them.

An interpreter costs its ``import torch`` (seconds), so :class:`FreshPool`
starts the first ones ahead, while the search's forked trials run (they import, build
and warm up, then wait for their batch size on stdin), and runs up to ``parallel`` of
them at once when the caps leave room. Later rounds start when they are needed: on two
busy cores, interpreters started for a round that never comes only slow the others.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import resource
import select
import signal
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

from batchfit._fork import helper_preexec
from batchfit.errors import TrialError
from batchfit.realrun.trial import Trial

_CHILD = "from batchfit.realrun.fresh import child_main; child_main()"


class _Child:
    """One started interpreter: it reads the request from the inherited descriptor
    ``request_fd``, prepares, then waits for a batch size on stdin."""

    def __init__(self, request_fd: int, env: dict[str, str]):
        self.stderr = tempfile.TemporaryFile()  # noqa: SIM115 - lives as long as the child
        self.process = subprocess.Popen(
            [sys.executable, "-c", _CHILD, str(request_fd)], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=self.stderr, env=env, pass_fds=(request_fd,),
            preexec_fn=helper_preexec())
        self.started = time.perf_counter()

    def go(self, batch_size: int) -> None:
        with contextlib.suppress(BrokenPipeError, OSError):  # it died preparing: see result
            self.process.stdin.write(struct.pack("<q", batch_size))
            self.process.stdin.close()

    def result(self, batch_size: int, cap: int | None, timeout_s: float | None) -> Trial:
        stdout = self.process.stdout
        if timeout_s is not None:
            ready, _, _ = select.select([stdout], [], [], timeout_s)
            if not ready:
                self.kill()
                raise TrialError(f"the trial did not finish within {timeout_s} s")
        data = stdout.read()
        status = self.process.wait()
        try:
            kind, value = pickle.loads(data)
        except Exception:  # noqa: BLE001 - no reply: it died
            self.stderr.seek(0)
            tail = self.stderr.read().decode(errors="replace").strip().splitlines()[-5:]
            how = f"signal {signal.Signals(-status).name}" if status < 0 else f"exit code {status}"
            raise TrialError(f"the fresh trial process died ({how}) at batch {batch_size}: "
                             + " | ".join(tail)) from None
        finally:
            self.stderr.close()
        if kind == "error":
            exc, text = value
            exc.add_note(f"raised in the fresh trial process (batch {batch_size}):\n{text}")
            raise exc
        return Trial(batch_size, value["fits"], None, value["seconds"], value["error"],
                     limit_bytes=cap, process="exec")

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.process.kill()
        self.process.wait()
        with contextlib.suppress(OSError):
            self.process.stdin.close()
        self.process.stdout.close()
        self.stderr.close()


class FreshPool:
    """Exec'd fresh interpreters for one trial request, ``parallel`` kept ready ahead.

    Args:
        request: a :class:`~batchfit.realrun.trial_server.TrialRequest` (its batch size is
            ignored: each run gets its own).
        env: the interpreters' environment (the user's process's: glibc reads
            ``MALLOC_*`` and OpenMP ``OMP_*`` from it at start-up).
        parallel: interpreters run at once (each under its own cap).
        timeout_s: a run longer than this raises :class:`TrialError`.
    """

    def __init__(self, request: Any, env: dict[str, str], *, parallel: int = 1,
                 timeout_s: float | None = None):
        from batchfit.realrun.trial_server import _main_path

        self.cap, self.parallel, self.timeout_s = request.cap_bytes, max(1, parallel), timeout_s
        self.env = env
        # The request lives in a file without a name (unlinked as it is created), which each
        # interpreter inherits as a descriptor: nothing is left in the temporary folder
        # whichever way this process ends (an exception, Ctrl-C's os._exit in the CLI,
        # SIGKILL), and no child can find it gone because close() ran first.
        self.request_file = tempfile.TemporaryFile(prefix="batchfit-request-")  # noqa: SIM115
        pickle.dump({"request": request.preparation(), "sys_path": list(sys.path),
                     "main_path": _main_path(), "cwd": os.getcwd()}, self.request_file)
        self.request_file.flush()
        self.ready: list[_Child] = []

    def start(self) -> None:
        """Start the interpreters ahead (they prepare while the caller does other work)."""
        while len(self.ready) < self.parallel:
            self.ready.append(_Child(self.request_file.fileno(), self.env))

    def run(self, batch_size: int, count: int, *, until_failure: bool = False) -> list[Trial]:
        """``count`` fresh runs at ``batch_size``, ``parallel`` at a time; with
        ``until_failure``, none after a round in which one did not fit."""
        trials: list[Trial] = []
        while len(trials) < count:
            self.start()
            wave = [self.ready.pop(0) for _ in range(min(self.parallel, count - len(trials)))]
            for child in wave:
                child.go(batch_size)
            for child in wave:
                trials.append(child.result(batch_size, self.cap, self.timeout_s))
            if until_failure and not all(t.fits for t in trials):
                break
        return trials

    def close(self) -> None:
        for child in self.ready:
            child.kill()
        self.ready = []
        self.request_file.close()


def parallel_runs(cap_bytes: int | None, available_bytes: int, at_most: int = 2) -> int:
    """How many capped interpreters may run at once: each may grow by its cap (and holds
    torch and the model besides, counted as another cap's worth, at least 1 GiB)."""
    if cap_bytes is None:
        return 1
    each = cap_bytes + max(cap_bytes, 1 << 30)
    return max(1, min(at_most, available_bytes // max(1, each)))


def settle_boundary(answer: int, confirm: Callable[[int, int, bool], list[Trial]],
                     runs: int, max_batch: int = 1 << 62,
                     ) -> tuple[int, tuple[tuple[int, int, int], ...]]:
    """The largest batch that fits in every one of ``runs`` runs of the user's process,
    searched from the search's answer; returns it and ``(batch, fits, runs)`` for it and
    the batch above it.

    ``confirm(batch, count, until_failure)`` runs ``count`` fresh processes (on the CPU:
    exec'd interpreters, :mod:`batchfit.realrun.fresh`; the search's forked trials do not
    count: they are not the user's process). A batch *holds* when it fits in all
    ``runs`` of its runs (its runs stop at the first failure). From the answer the search
    gallops (1, 2, 4, ... batches) up while batches hold, or down until one holds, then
    bisects between the last batch that held and the first that did not. The batch above
    the result is then run ``runs`` times, so its flakiness shows. The forked trials'
    answer is usually within a few batches, so this costs a few rounds of ``runs``
    interpreters (run at once when memory allows).

    A capped fresh process with glibc's default allocator is not a repeatable device, and
    the draw is made when the interpreter starts (see the module docstring): one run at
    each batch reports one draw; this reports the spread (``fits`` of ``runs`` for the
    batch above), and answers the batch that fitted in every run. That answer is itself a
    draw of a statistic (the largest batch fitting ``runs`` of ``runs``), not a constant:
    for a small CNN under 128 MiB the fit fraction falls from 1 to 0 over ~10 batches."""
    outcomes: dict[int, list[bool]] = {}

    def fill(batch: int, until_failure: bool) -> list[bool]:
        seen = outcomes.setdefault(batch, [])
        if len(seen) < runs and (all(seen) or not until_failure):
            seen.extend(t.fits for t in confirm(batch, runs - len(seen), until_failure))
        return seen

    def holds(batch: int) -> bool:
        return all(fill(batch, True))

    answer = max(1, min(answer, max_batch))
    step, above = 1, None
    if holds(answer):
        while answer < max_batch:
            batch = min(answer + step, max_batch)
            if not holds(batch):
                above = batch
                break
            answer, step = batch, 2 * step
    else:
        above = answer
        while True:
            batch = max(1, above - step)
            if holds(batch) or batch == 1:
                answer = batch
                break
            above, step = batch, 2 * step
    while above is not None and above - answer > 1:
        middle = (answer + above) // 2
        answer, above = (middle, above) if holds(middle) else (answer, middle)
    if above is not None and above > answer:
        fill(above, False)
    settled = tuple((b, sum(outcomes[b]), len(outcomes[b])) for b in sorted(outcomes)
                    if answer <= b <= (above or answer))
    return answer, settled


# --------------------------------------------------------------------------- in the child


def child_main(argv: Sequence[str] | None = None) -> None:
    """Entry point of a fresh trial interpreter (internal): see the module docstring."""
    request_fd = int((argv if argv is not None else sys.argv)[1])
    reply = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # anything the model prints goes to stderr, never into the reply
    try:
        result = _prepare_and_run(request_fd)
        message = ("result", result)
    except BaseException as exc:  # noqa: BLE001 - sent back and re-raised in the parent
        from batchfit.realrun.trial_server import _packed_exception

        message = ("error", _packed_exception(exc))
    if message[1] is not None:
        reply.write(pickle.dumps(message))
    reply.close()


def _prepare_and_run(request_fd: int) -> dict[str, Any] | None:
    # read from offset 0 with pread: the interpreters of a pool share the descriptor's file
    # offset, and may read at the same time
    size = os.fstat(request_fd).st_size
    raw = b""
    while len(raw) < size:
        chunk = os.pread(request_fd, size - len(raw), len(raw))
        if not chunk:
            break
        raw += chunk
    os.close(request_fd)
    setup_data = pickle.loads(raw)
    sys.path[:] = setup_data["sys_path"]
    with contextlib.suppress(OSError):
        os.chdir(setup_data["cwd"])
    from batchfit.realrun.trial import _run_steps, is_out_of_memory, vm_data_bytes
    from batchfit.realrun.trial_server import _load_request, _one_line, _PreparedTrial

    # unpickled after sys.path is the caller's (and, for a factory in the caller's
    # script, after that script is imported as multiprocessing's spawn imports it)
    request = _load_request(setup_data["request"], setup_data["main_path"])
    # the caller's thread count only if it changed it: otherwise torch's own default
    prepared = _PreparedTrial.build(request, pin_threads=False)
    runner, setup, generator = prepared.runner, prepared.setup, prepared.generator
    data = b""
    while len(data) < 8:
        chunk = os.read(0, 8 - len(data))
        if not chunk:
            return None  # discarded before use
        data += chunk
    (batch_size,) = struct.unpack("<q", data)
    if request.cap_bytes is not None:
        _, hard = resource.getrlimit(resource.RLIMIT_DATA)
        resource.setrlimit(resource.RLIMIT_DATA, (vm_data_bytes() + request.cap_bytes, hard))
    start = time.perf_counter()
    fits, error = True, None
    try:
        _run_steps(runner, setup, batch_size, request.steps, generator, None)
    except Exception as exc:
        if not is_out_of_memory(exc):
            raise
        fits, error = False, _one_line(exc)
    return {"fits": fits, "error": error, "seconds": time.perf_counter() - start}
