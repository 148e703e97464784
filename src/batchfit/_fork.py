"""One fork-with-two-pipes for every helper process batchfit forks, and the rule every
helper follows, forked or exec'd: it ignores Ctrl-C and ends with its parent
(:func:`follow_parent`; :func:`helper_preexec` for ``subprocess.Popen``).

Used by the trial server's templates and trial children (:mod:`batchfit.realrun.trial_server`) and by
the trace worker (:mod:`batchfit.answers.tracepool`); the trial server's zygote and the fresh
trial interpreters (:mod:`batchfit.realrun.fresh`) start with :func:`helper_preexec`.
"""

from __future__ import annotations

import ctypes
import functools
import os
import signal
import sys
from collections.abc import Callable
from typing import Any


def fork_child(closing: list[Any], run: Callable[[int, int], None]) -> tuple[int, int, int]:
    """Fork a child that closes ``closing``, runs ``run(control_fd, output_fd)`` and exits
    with 0 (1 if it raised), without the parent's atexit handlers or buffers; return
    ``(pid, control write fd, output read fd)``."""
    control_read, control_write = os.pipe()
    output_read, output_write = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            follow_parent()
            for stream in closing:
                stream.close()
            os.close(control_write)
            os.close(output_read)
            run(control_read, output_write)
        except BaseException:  # noqa: BLE001 - the parent reads the exit status
            code = 1
        finally:
            os._exit(code)
    os.close(control_read)
    os.close(output_write)
    return pid, control_write, output_read


_PR_SET_PDEATHSIG = 1  # linux/prctl.h


@functools.cache
def _prctl() -> Callable[..., int] | None:
    """libc's prctl (Linux), looked up once in the parent: a child forked from a process
    with threads should not load libraries before it execs."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def helper_preexec() -> Callable[[], None]:
    """``preexec_fn`` for a helper interpreter started with ``subprocess.Popen``: it starts
    with SIGINT ignored (so Python keeps it ignored and never raises KeyboardInterrupt,
    not even while it imports) and ends with this process (:func:`follow_parent`)."""
    _prctl()
    return follow_parent


def follow_parent() -> None:
    """Make this helper process leave interrupts to its parent and end with it.

    A terminal's Ctrl-C reaches every process of the foreground group, helpers included;
    a helper that raised KeyboardInterrupt would print its own traceback in the middle of
    whatever it runs. So a helper ignores SIGINT: the parent (the ``batchfit`` command, or
    the user's script) decides what an interrupt means. And on Linux the kernel kills the
    helper when its parent ends (``PR_SET_PDEATHSIG``), so that a parent that exits at once
    on an interrupt (the CLI) or is killed leaves no helper running on.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    prctl = _prctl()
    if prctl is None:  # no prctl: the helper ends at EOF on its pipes
        return
    parent = os.getppid()
    prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent or parent == 1:  # the parent ended before prctl took effect
        os._exit(1)
