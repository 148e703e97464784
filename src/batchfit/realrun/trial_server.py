"""Trials in fresh processes under a hard memory cap: batchfit's CPU "device".

:func:`run_trial_subprocess` runs a trial (:mod:`batchfit.realrun.trial`) in a fresh
process. The child builds the model and the optimizer, runs one warm-up step at batch 1,
drops the warm-up gradients and batch, reads its ``VmData`` and sets ``RLIMIT_DATA`` to
that plus the cap; then it runs the K steps at batch B.

Why ``RLIMIT_DATA`` and not ``RLIMIT_AS``: since Linux 4.7 ``RLIMIT_DATA`` limits
exactly the private writable mappings (brk heap, anonymous mmaps: every tensor the CPU
allocator hands out, whether glibc serves it from the heap or from its own mmap), and
``/proc/self/status`` reports the same counter as ``VmData``, so "usage + cap" is
measured on the scale the kernel enforces. ``RLIMIT_AS`` also counts library text,
``PROT_NONE`` reservations (each glibc thread arena reserves 64 MiB of address space)
and the guard pages of new threads, none of which is memory the step uses.
``RLIMIT_RSS`` is ignored by Linux.

Fresh processes come from a :class:`TrialServer`: a zygote interpreter started with
``python -c`` that imports torch and the model's own library once. Per request (model,
input spec, config, cap) it forks a *template*, which builds the model and the
optimizer, warms up and waits (while the caller computes its prediction); each trial is
a child forked from the template, so it starts from exactly the memory a fresh process
that imported the same libraries and did the same work holds: measured at a boundary
with 144 KiB to spare, the trials and an independent ``python -c`` process needed the
same data segment to the byte. What breaks that equivalence is importing more in the
zygote: ``torch._dynamo`` (a fresh process imports it when it builds its first
optimizer, after the model) or libraries the model does not use each cost one batch
there. A fresh interpreter costs seconds (``import torch``, then
``torch._dynamo``); the template pays the model's build, warm-up and ``torch._dynamo``
once per request, and a trial costs a fork (milliseconds) and its steps. The zygote and
the template never run a torch op with more than one thread (GNU OpenMP does not
survive a fork after a parallel region: the child hangs), so templates serve trials on
one thread (``OMP_NUM_THREADS=1`` or ``torch.set_num_threads(1)`` in the caller); on
more threads each trial child builds and warms up itself, one prepared ahead.

That equivalence was measured with glibc's mmap threshold pinned, on one thread. With
glibc's defaults and torch's threads (what a user's script runs) a fork still starts
from the zygote's heap, which a fresh process does not, so the CPU search settles its
answer in exec'd interpreters (:mod:`batchfit.realrun.fresh`) and uses forks for its bisection only.

Known limitations:
    * A child killed by a signal after the cap was set (a library that aborts when
      malloc fails) counts as "does not fit", with the signal in ``Trial.error``.
    * A factory must be picklable: a module-level function, a ``functools.partial``
      (every :func:`batchfit.models.resolve.resolve_model` factory is one), an
      ``"module:function"`` string or a ``"file.py:factory"`` spec. An ``nn.Module``
      is pickled with its weights.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import importlib.util
import os
import pickle
import resource
import select
import signal
import struct
import subprocess
import sys
import time
import traceback
import types
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, BinaryIO, Self

import torch
from torch import nn

from batchfit._fork import fork_child, helper_preexec
from batchfit.engine.spec import Mode, TrainConfig, make_config
from batchfit.engine.step import StepRunner
from batchfit.errors import InvalidInputError, TrialError
from batchfit.realrun.trial import (
    Trial,
    _check_trial_args,
    _checked_module,
    _data_segment_now,
    _one_line,
    _run_steps,
    _state_tensors,
    _StepSetup,
    _UsageTracker,
    is_out_of_memory,
    release_exception,
    vm_data_bytes,
)


@dataclass(frozen=True)
class TrialRequest:
    """What a child process needs to run one capped trial (pickled to it).

    ``parallel`` (a :class:`batchfit.sharding.Parallelism`) and ``group`` (a
    :class:`~batchfit.realrun.sharded_trial.TrialGroup`): a sharded trial, whose child
    joins the other ranks' children in the trial's own gloo group once it has its batch
    size, then builds, shards and warms up (a template cannot: the group is the trial's).
    """

    model: Any  # a picklable factory, an nn.Module, or an importable "module:function"
    inputs: Any
    config: TrainConfig
    batch_size: int
    cap_bytes: int | None
    steps: int
    num_threads: int
    parallel: Any = None
    group: Any = None

    def preparation(self) -> bytes:
        """The request without its batch size, pickled: what a child can do in advance.
        Equal bytes mean the same preparation (one pickling per request object)."""
        return pickle.dumps(replace(self, batch_size=0))


def model_source(model: Any) -> tuple[Any, Any, Any]:
    """``(source, input_spec, loss_fn)`` for a model given as a ModelSpec, a spec string
    (``timm:NAME``, ``file.py:factory``, ``package.module:function``), a factory or a module."""
    from batchfit.models.resolve import ModelSpec, resolve_model

    if isinstance(model, str):
        module_name, sep, attr = model.partition(":")
        if (sep and attr.isidentifier() and not module_name.endswith(".py")
                and module_name not in ("timm", "torchvision", "hf")
                and importlib.util.find_spec(module_name) is not None):
            return model, None, None
        model = resolve_model(model)
    if isinstance(model, ModelSpec):
        return model.factory, model.input_spec, model.loss_fn
    if isinstance(model, nn.Module) or callable(model):
        return model, None, None
    raise InvalidInputError(
        f"cannot run {type(model).__name__} as a model: give an nn.Module, a factory, "
        "a ModelSpec or a spec string")


def _check_picklable(request: TrialRequest) -> bytes:
    try:
        return request.preparation()
    except Exception as exc:
        raise InvalidInputError(
            f"the model cannot be sent to a fresh process ({type(exc).__name__}: "
            f"{_one_line(exc, 120)}): give a module-level function, a functools.partial, "
            "'package.module:function' or 'path/to/file.py:factory'") from exc


def preloads_for(source: Any) -> list[str]:
    """Modules a zygote for ``source`` imports once: torch, batchfit and the model's own
    library (timm, torchvision, transformers, the factory's module), and nothing else; a
    fresh process that trains the model imports those too. Importing more moves the heap
    (measured: a zygote that also imported timm and transformers lost one batch of a
    plain CNN at a 128 MiB cap)."""
    names = ["torch", "batchfit.realrun.trial_server", "batchfit.engine.fake"]
    func = source.func if hasattr(source, "func") else source
    module = (source.partition(":")[0] if isinstance(source, str)
              else getattr(func, "__module__", None) or type(source).__module__)
    if module and module != "__main__":
        names.append(module)
    libraries = {"_build_timm": "timm", "_build_torchvision": "torchvision",
                 "_build_hf": "transformers"}
    for part in (func, *getattr(source, "args", ())):  # resolve_model's partials name their builder
        library = libraries.get(getattr(part, "__name__", ""))
        if library is not None:
            names.append(library)
    return names


def trial_request(model: Any, inputs: Any, batch_size: int, config: TrainConfig,
                  cap_bytes: int | None, steps: int) -> TrialRequest:
    """A checked, picklable :class:`TrialRequest` (see :func:`run_trial_subprocess`)."""
    _check_trial_args(batch_size, steps)
    if cap_bytes is not None and (isinstance(cap_bytes, bool) or not isinstance(cap_bytes, int)
                                  or cap_bytes <= 0):
        raise InvalidInputError(f"memory cap must be a positive number of bytes, not {cap_bytes!r}")
    source, spec_inputs, loss_fn = model_source(model)
    inputs = inputs if inputs is not None else spec_inputs
    if inputs is None:
        raise InvalidInputError("no input spec: give inputs, e.g. (3, 224, 224)")
    if loss_fn is not None and config.loss_fn is None:
        config = replace(config, loss_fn=loss_fn)
    request = TrialRequest(source, inputs, config, batch_size, cap_bytes, steps,
                           torch.get_num_threads())
    _check_picklable(request)
    return request


def run_trial_subprocess(model: Any, inputs: Any, batch_size: int,
                         config: TrainConfig | None = None, cap_bytes: int | None = None,
                         steps: int = 2, *, server: TrialServer | None = None,
                         timeout_s: float | None = None, **options: Any) -> Trial:
    """Run one trial in a fresh process whose memory is capped ``cap_bytes`` above its
    state after a warm-up step.

    The child builds the model and the optimizer on the CPU, runs one step at batch 1
    (batch 2 if the model cannot train on one sample; this creates the optimizer state
    and starts the thread pool), frees that step's gradients and batch, reads
    ``VmData`` and sets ``RLIMIT_DATA`` to ``VmData + cap_bytes`` (soft limit; see the
    module docstring for why DATA and not AS). Then it runs ``steps`` steps at
    ``batch_size``; an out-of-memory error ends the trial with ``fits=False``. Any other
    error is re-raised here, unchanged, with the child's traceback as a note.

    Args:
        model: a ModelSpec, a spec string (``timm:NAME``, ``path/file.py:factory``,
            ``package.module:function``), a picklable factory or an ``nn.Module``.
        inputs: the per-sample input spec (default: the spec's own).
        batch_size: the batch size.
        config: a :class:`TrainConfig`, or its fields as ``options``.
        cap_bytes: bytes available beyond the warmed-up state (None: no cap).
        steps: steps at ``batch_size`` (>= 2).
        server: a running :class:`TrialServer` to fork from; by default a fresh one is
            started for this trial and stopped after it.
        timeout_s: kill the child after this long and raise :class:`TrialError`.

    Example:
        >>> import functools, torch
        >>> factory = functools.partial(torch.nn.Linear, 16, 4)
        >>> trial = run_trial_subprocess(factory, (16,), 8, cap_bytes=64 * 2**20, optimizer="sgd")
        >>> trial.fits
        True
    """
    request = trial_request(model, inputs, batch_size, make_config(config, options), cap_bytes,
                            steps)
    if server is not None:
        return server.run(request, timeout_s=timeout_s)
    with TrialServer(preloads_for(request.model), prepare_next=False) as fresh:
        return fresh.run(request, timeout_s=timeout_s)


def _frame(stream: BinaryIO, data: bytes) -> None:
    stream.write(struct.pack("<Q", len(data)) + data)
    stream.flush()


def _read_exact(stream: BinaryIO, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = stream.read(size - len(data))
        if not chunk:
            raise EOFError
        data += chunk
    return data


def _unframe(stream: BinaryIO) -> bytes:
    (size,) = struct.unpack("<Q", _read_exact(stream, 8))
    return _read_exact(stream, size)


class TrialServer:
    """A zygote process that forks one fresh, warmed-up process per capped trial.

    Start it once per search: it pays for ``import torch`` (and the model's libraries,
    ``preload``) once. For each request (a model, input spec, config and cap; any batch
    size) the zygote forks a *template*: a child that builds the model and the optimizer,
    runs the warm-up step at batch 1 and drops its gradients and batch, exactly what a
    fresh process does before its cap is set, then waits. Each trial is a child forked
    from the template at that point: its memory is the template's, byte for byte, so it
    is what a fresh process that imported those libraries and did that work holds (the
    zygote imports nothing else: a fresh process imports ``torch._dynamo`` when it builds
    its first optimizer, after the model; importing it in the zygote moves the heap's free
    space and, measured, changed the largest batch by one). A trial then costs a fork
    and its steps: the model's build, its warm-up and the ``torch._dynamo`` import (seconds)
    are paid once per request, by the template, which :meth:`prepare`
    starts while the caller computes its prediction. The template is kept while requests
    repeat, so a second search of the same request on the same server starts at once.

    Templates need one thread: GNU OpenMP does not survive a fork after a parallel
    region (the child hangs), and a template warmed up on one thread for a trial on more
    is not a fresh process (measured on a small convnet on two threads: 1 MiB more
    overhead, the largest batch two lower). A request on more threads (a request
    carries the caller's ``torch.get_num_threads()``) gets what a fresh process on that
    many threads does: each trial is a child that builds, warms up (starting its thread
    team and the workers' malloc arenas before the cap) and runs, the next one prepared
    ahead while the current one runs.

    Args:
        preload: module names to import in the zygote (torch and batchfit are always).
        env: the zygote's environment (default: this process's); glibc reads
            ``MALLOC_*`` variables from it at start-up.
        prepare_next: keep the template between trials of the same request; False builds
            a new one for every trial (each trial then pays the build and the warm-up).
    """

    def __init__(self, preload: list[str] | tuple[str, ...] = (), *,
                 env: dict[str, str] | None = None, prepare_next: bool = True):
        self.preload = list(dict.fromkeys(["torch", "batchfit.realrun.trial_server", *preload]))
        env = dict(os.environ) if env is None else env
        self.env = env  # also the environment of the search's exec'd boundary runs
        self._process = subprocess.Popen(
            [sys.executable, "-c", "from batchfit.realrun.trial_server import zygote_main; zygote_main()"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
            preexec_fn=helper_preexec())
        # Read through the unbuffered stream, so that select() sees every pending byte.
        self._output = self._process.stdout.raw
        _frame(self._process.stdin, pickle.dumps({
            "preload": self.preload, "sys_path": sys.path, "main_path": _main_path(),
            "keep_template": prepare_next}))
        self._ready = False
        self._keys: list[tuple[TrialRequest, bytes]] = []

    def wait_ready(self) -> None:
        """Block until the zygote has imported its modules."""
        if not self._ready:
            reply = pickle.loads(self._receive(None))
            if "error" in reply:
                raise TrialError(f"the trial process could not start: {reply['error']}")
            self._ready = True

    def _key(self, request: TrialRequest) -> bytes:
        """The request's preparation, pickled once per request object, so that requests
        that differ only in batch size send equal bytes."""
        template = replace(request, batch_size=0)
        for known, data in self._keys:
            if known is template or known == template:
                return data
        data = template.preparation()
        self._keys.append((template, data))
        return data

    def prepare(self, request: TrialRequest) -> None:
        """Start building the template for ``request`` now (no batch size needed yet)."""
        _frame(self._process.stdin, self._key(request))
        _frame(self._process.stdin, struct.pack("<q", 0))

    def run(self, request: TrialRequest, *, timeout_s: float | None = None) -> Trial:
        """Run one trial in a child forked from the request's template."""
        self.wait_ready()
        _frame(self._process.stdin, self._key(request))
        _frame(self._process.stdin, struct.pack("<q", request.batch_size))
        child = pickle.loads(self._receive(None))["child"]
        try:
            messages = self._receive(timeout_s)
        except TimeoutError:
            if child:  # None: the template died before it could fork
                with contextlib.suppress(ProcessLookupError):
                    os.kill(child, signal.SIGKILL)
            self._receive(None)
            self._receive(None)
            raise TrialError(f"the trial did not finish within {timeout_s} s") from None
        (status,) = struct.unpack("<q", self._receive(None))
        return _trial_from_reply(_decode_messages(messages), status, request)

    def _receive(self, timeout_s: float | None) -> bytes:
        if timeout_s is not None:
            ready, _, _ = select.select([self._output], [], [], timeout_s)
            if not ready:
                raise TimeoutError
        try:
            return _unframe(self._output)
        except EOFError:
            code = self._process.wait()
            raise TrialError(f"the trial process exited unexpectedly (code {code})") from None

    def close(self) -> None:
        if self._process.poll() is None:
            with contextlib.suppress(BrokenPipeError, OSError):
                self._process.stdin.close()
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _main_path() -> str | None:
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    return os.path.abspath(path) if path and path.endswith(".py") else None


def _decode_messages(data: bytes) -> list[tuple[str, Any]]:
    """The trial child's ``(kind, value)`` messages, from its raw framed output."""
    import io

    stream, messages = io.BytesIO(data), []
    with contextlib.suppress(EOFError, pickle.UnpicklingError):
        while True:
            messages.append(pickle.loads(_unframe(stream)))
    return messages


def _trial_from_reply(messages: list[tuple[str, Any]], status: int,
                      request: TrialRequest) -> Trial:
    kinds = dict(messages)
    if "result" in kinds:
        return Trial(**kinds["result"])
    if "error" in kinds:
        exc, text = kinds["error"]
        exc.add_note(f"raised in the trial process (batch {request.batch_size}):\n{text}")
        raise exc
    how = (f"signal {signal.Signals(os.WTERMSIG(status)).name}" if os.WIFSIGNALED(status)
           else f"exit code {os.WEXITSTATUS(status)}")
    if "capped" in kinds:  # it died under the cap: a library that aborts when malloc fails
        return Trial(request.batch_size, False, None, 0.0,
                     f"the trial process died ({how}) under the memory cap",
                     limit_bytes=request.cap_bytes, baseline_bytes=kinds["capped"]["baseline"])
    raise TrialError(f"the trial process died ({how}) before its memory cap was set")


# --------------------------------------------------------------------------- in the zygote / template / trial


def _read_all(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 1 << 16):
        chunks.append(chunk)
    os.close(fd)
    return b"".join(chunks)


@dataclass
class _Template:
    """A forked template (in the zygote): ``control`` carries batch sizes to it, ``output``
    brings back, per trial, three frames: ``{"child": pid}``, the trial child's raw
    messages, and its wait status."""

    key: bytes
    pid: int
    control: int
    output: BinaryIO

    def run(self, batch_size: int, relay: Callable[[bytes], None]) -> bool:
        """Start one trial and relay its three frames as they come (the caller's timeout
        needs the first at once); False if the template is gone."""
        relayed = 0
        try:
            os.write(self.control, struct.pack("<q", batch_size))
            while relayed < 3:
                relay(_unframe(self.output))
                relayed += 1
        except (EOFError, BrokenPipeError, OSError):
            _, status = os.waitpid(self.pid, 0)
            self.pid = 0
            for frame in [pickle.dumps({"child": None}), b"",
                          struct.pack("<q", status)][relayed:]:
                relay(frame)
        return self.pid != 0

    def discard(self) -> None:
        if self.pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
        with contextlib.suppress(OSError):
            os.close(self.control)
        self.output.close()


def _fork_template(key: bytes, main_path: str | None, closing: list[Any]) -> _Template:
    pid, control_write, output_read = fork_child(
        closing, lambda control, output: _template_main(key, control, output, main_path))
    return _Template(key, pid, control_write, os.fdopen(output_read, "rb", buffering=0))


def zygote_main() -> None:
    """Entry point of the zygote: import, then fork templates on request (internal)."""
    proto_in = os.fdopen(os.dup(0), "rb")
    proto_out = os.fdopen(os.dup(1), "wb")
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(2, 1)  # anything a model prints goes to stderr, never into the protocol
    setup = pickle.loads(_unframe(proto_in))
    sys.path[:] = setup["sys_path"]
    try:
        for name in setup["preload"]:
            importlib.import_module(name)
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        _frame(proto_out, pickle.dumps({"error": f"importing {name}: {_one_line(exc)}"}))
        return
    torch.set_num_threads(1)  # never start an OpenMP team here: forked children would hang
    gc.collect()  # free the imports' garbage here, as a fresh process's collection would
    gc.freeze()  # children's gc.collect() skips (and never copies) the zygote's objects
    _frame(proto_out, pickle.dumps({"ready": True}))
    template: _Template | None = None
    closing = [proto_in, proto_out]
    try:
        while True:
            try:
                key = _unframe(proto_in)
                (batch_size,) = struct.unpack("<q", _unframe(proto_in))
            except EOFError:
                return
            if template is not None and template.key != key:
                template.discard()
                template = None
            if template is None:
                template = _fork_template(key, setup["main_path"], closing)
            if batch_size == 0:  # prepare only
                continue
            alive = template.run(batch_size, lambda frame: _frame(proto_out, frame))
            if not alive or not setup["keep_template"]:
                template.discard()
                template = None
    finally:
        if template is not None:
            template.discard()


def _template_main(key: bytes, control: int, output: int, main_path: str | None) -> None:
    """Serve one request: fork one trial child per batch size received, one kept ready.

    On one thread the template builds the model and warms up once, and its children
    start from that state. With more threads it cannot (GNU OpenMP does not survive a
    fork after a parallel region), so each child builds and warms up itself with the
    request's threads, as a fresh process does; the ready one does it ahead.
    """
    failure, prepared, request = None, None, None
    try:
        request = _load_request(key, main_path)
        if request.num_threads == 1 and request.parallel is None:
            prepared = _PreparedTrial.build(request)
    except BaseException as exc:  # noqa: BLE001 - sent back with each trial request
        failure = _frame_bytes(pickle.dumps(("error", _packed_exception(exc))))
    with os.fdopen(control, "rb", buffering=0) as requests, os.fdopen(output, "wb") as out:
        closing = [requests, out]
        ready = None if failure is not None else _fork_ready(prepared, request, closing)
        try:
            while True:
                try:
                    (batch_size,) = struct.unpack("<q", _read_exact(requests, 8))
                except EOFError:
                    return
                if ready is None:
                    for frame in (pickle.dumps({"child": None}), failure, struct.pack("<q", 0)):
                        _frame(out, frame)
                    continue
                child, ready = ready, None
                child.go(batch_size)
                ready = _fork_ready(prepared, request, closing)
                _frame(out, pickle.dumps({"child": child.pid}))
                messages, status = child.collect()
                _frame(out, messages)
                _frame(out, struct.pack("<q", status))
        finally:
            if ready is not None:
                ready.discard()


@dataclass
class _ReadyChild:
    """A trial child waiting for its batch size on ``control``; it writes to ``result``."""

    pid: int
    control: int
    result: int

    def go(self, batch_size: int) -> None:
        with contextlib.suppress(BrokenPipeError, OSError):  # it died preparing: see result
            os.write(self.control, struct.pack("<q", batch_size))
        os.close(self.control)

    def collect(self) -> tuple[bytes, int]:
        messages = _read_all(self.result)
        _, status = os.waitpid(self.pid, 0)
        return messages, status

    def discard(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        os.close(self.control)
        os.close(self.result)
        os.waitpid(self.pid, 0)


def _fork_ready(prepared: _PreparedTrial | None, request: TrialRequest,
                closing: list[Any]) -> _ReadyChild:
    pid, control_write, result_read = fork_child(
        closing, lambda control, result: _trial_main(prepared, request, control, result))
    return _ReadyChild(pid, control_write, result_read)


def _frame_bytes(data: bytes) -> bytes:
    return struct.pack("<Q", len(data)) + data


def _trial_main(prepared: _PreparedTrial | None, request: TrialRequest, control: int,
                output: int) -> None:
    with os.fdopen(output, "wb") as out:
        def emit(kind: str, value: Any) -> None:
            _frame(out, pickle.dumps((kind, value)))

        try:
            if prepared is None and request.group is None:
                prepared = _PreparedTrial.build(request)
            with os.fdopen(control, "rb", buffering=0) as pipe:
                try:
                    (batch_size,) = struct.unpack("<q", _read_exact(pipe, 8))
                except EOFError:  # discarded before use
                    return
            if prepared is None:  # sharded: the group is this trial's, joined only now
                prepared = _PreparedTrial.build(request)
            emit("result", prepared.run(batch_size, lambda info: emit("capped", info)))
        except BaseException as exc:  # noqa: BLE001 - sent back and re-raised in the parent
            emit("error", _packed_exception(exc))


def _load_request(payload: bytes, main_path: str | None) -> TrialRequest:
    try:
        return pickle.loads(payload)
    except AttributeError:
        if main_path is None:
            raise
    # The factory lives in the user's __main__: import that script as multiprocessing's
    # spawn does (its ``if __name__ == "__main__"`` block does not run).
    import runpy

    main = types.ModuleType("__mp_main__")
    main.__dict__.update(runpy.run_path(main_path, run_name="__mp_main__"))
    sys.modules["__main__"] = sys.modules["__mp_main__"] = main
    return pickle.loads(payload)


def _packed_exception(exc: BaseException) -> tuple[BaseException, str]:
    text = "".join(traceback.format_exception(exc))
    release_exception(exc)
    try:
        clone = pickle.loads(pickle.dumps(exc))
    except Exception:  # noqa: BLE001 - unpicklable exception: keep its type name and text
        clone = RuntimeError(f"{type(exc).__name__}: {exc}")
    return clone, text


def factory_of(source: Any) -> Any:
    """A module or a callable for an importable ``"module:function"`` string or a factory."""
    if isinstance(source, str):
        module_name, _, attr = source.partition(":")
        return getattr(importlib.import_module(module_name), attr)
    return source


def _build_from_source(source: Any, setup: _StepSetup) -> nn.Module:
    source = factory_of(source)
    return source if isinstance(source, nn.Module) else _checked_module(setup.build(source))


def _sharded_peer_stopped(exc: BaseException) -> bool:
    """A sharded trial's collective failed because a peer's process has gone (only a
    sharded trial's process has a process group; others import nothing here)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return False
    from batchfit.realrun.sharded_trial import peer_stopped

    return peer_stopped(exc)


def _warm_up(runner: StepRunner, setup: _StepSetup, generator: torch.Generator) -> None:
    """One step at batch 1, or at batch 2 for models that cannot train on one sample
    (BatchNorm over a single value per channel raises)."""
    step = runner.train_step if setup.config.mode is Mode.TRAIN else runner.infer_step
    try:
        runner.batch = setup.batch(1, generator)
        step()
    except Exception as exc:  # retried once; a second failure is the user's error
        if _sharded_peer_stopped(exc):  # a sharded trial's peer has gone: its group is broken
            raise
        runner.drop_gradients()
        runner.batch = setup.batch(2, generator)
        step()


@dataclass
class _PreparedTrial:
    """After the build and the warm-up, waiting for a batch size: what a fresh process
    that built the model and the optimizer and ran one step at batch 1 holds."""

    request: TrialRequest
    setup: _StepSetup
    runner: StepRunner
    generator: torch.Generator

    @classmethod
    def build(cls, request: TrialRequest, *, pin_threads: bool = True) -> _PreparedTrial:
        """``pin_threads``: set the request's thread count even where it is the process's
        already (a template: 1, see _template_main); False leaves a fresh interpreter's
        own setting alone unless the caller had changed it (realrun/fresh.py). In a
        forked child it also replaces the pthreadpool inherited from the parent here, on
        the only thread, before a sharded model's backward starts threads that would race
        to replace it (see :mod:`batchfit.realrun.sharded_trial`)."""
        if pin_threads or request.num_threads != torch.get_num_threads():
            torch.set_num_threads(request.num_threads)
        torch.manual_seed(0)
        if request.group is not None:
            from batchfit.realrun.sharded_trial import join_and_shard, step_config

            setup = _StepSetup.of(request.inputs, step_config(request), torch.device("cpu"))
            model = join_and_shard(request, setup,
                                   lambda: _build_from_source(request.model, setup))
        else:
            setup = _StepSetup.of(request.inputs, request.config, torch.device("cpu"))
            model = setup.prepare(_build_from_source(request.model, setup))
        generator = torch.Generator().manual_seed(0)
        runner = setup.runner(model, None, generator)
        _warm_up(runner, setup, generator)
        runner.drop_gradients()
        runner.batch = ((), {})
        gc.collect()
        return cls(request, setup, runner, generator)

    def run(self, batch_size: int, on_capped: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
        """Cap the data segment, run the steps at ``batch_size``, measure them."""
        cap = self.request.cap_bytes
        tracker = _UsageTracker(sample_data_segment=True)
        for tensor in _state_tensors(self.runner):
            tracker.add(tensor)
        baseline = tracker.live_bytes
        start_data = vm_data_bytes()
        if cap is not None:
            _, hard = resource.getrlimit(resource.RLIMIT_DATA)
            if hard != resource.RLIM_INFINITY and start_data + cap > hard:
                raise InvalidInputError(f"memory cap exceeds the hard RLIMIT_DATA of {hard} B")
            resource.setrlimit(resource.RLIMIT_DATA, (start_data + cap, hard))
        tracker.data_peak = segment_start = _data_segment_now()
        on_capped({"baseline": baseline, "vm_data": start_data})
        result = {"batch_size": batch_size, "fits": True, "peak_bytes": None, "error": None,
                  "used_bytes": None, "limit_bytes": cap, "baseline_bytes": baseline}
        start = time.perf_counter()
        try:
            result["peak_bytes"] = _run_steps(self.runner, self.setup, batch_size,
                                              self.request.steps, self.generator, tracker)
            result["used_bytes"] = tracker.data_peak - segment_start
        except Exception as exc:
            if is_out_of_memory(exc):
                result.update(fits=False, error=_one_line(exc))
            elif _sharded_peer_stopped(exc):
                # another rank's trial ran out of memory and its process ended: not this
                # rank's limit, and never a wait (see batchfit.realrun.sharded_trial)
                from batchfit.realrun.sharded_trial import PEER_STOPPED

                result.update(fits=False, error=f"{PEER_STOPPED}: {_one_line(exc)}")
            else:
                raise
            release_exception(exc)
        result["seconds"] = time.perf_counter() - start
        return result


