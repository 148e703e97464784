"""Ctrl-C: one line and exit 130, at once, whatever the command was doing.

Python turns SIGINT into a KeyboardInterrupt raised at the next bytecode the main thread
runs, which can be inside a finalizer (``__del__``, a weakref callback: Python then prints
"Exception ignored in ..." and carries on, and the command can even exit 0) or inside a
Python callback that torch's C++ code called (a dispatch mode, a hook): there the error
comes back to C++ as ``python_error``, and where that C++ frame may not throw the process
aborts ("terminate called after throwing an instance of 'python_error'", exit 134). A
command holds nothing an interrupt must save (it writes its output at the end, and its
helper processes follow it: :func:`batchfit._fork.follow_parent`), so the handler ends the
process itself, before any of that can happen.
"""

from __future__ import annotations

import os
import signal
import sys
from types import FrameType

EXIT_INTERRUPTED = 130  # 128 + SIGINT, what shells report for a command ended by Ctrl-C


def exit_on_interrupt() -> None:
    """Install the handler (the ``batchfit`` entry point does, before any work)."""
    signal.signal(signal.SIGINT, _interrupted)


def _interrupted(signum: int, frame: FrameType | None) -> None:
    # a rich status or progress bar hides the cursor while it runs: show it again
    show_cursor = "\x1b[?25h" if sys.stderr.isatty() else ""
    os.write(2, f"{show_cursor}\ninterrupted\n".encode())
    os._exit(EXIT_INTERRUPTED)
