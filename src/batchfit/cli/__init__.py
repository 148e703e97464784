"""The command line: ``batchfit estimate | max | search | bench | gpus | noise | recommend | serve | plan``.

Owns the typer app (:mod:`batchfit.cli.app`), the rich renderings of results
(:mod:`batchfit.cli.report`) and the matplotlib figures (:mod:`batchfit.cli.plot`).
The top layer: it may import every other part of batchfit, and nothing imports it.
Commands import torch and the engine lazily, so ``batchfit --help`` stays fast.
"""

# Ctrl-C from the first moment: the imports below (typer, rich, every command's module)
# take a good part of a second on a busy machine, and the entry point imports this package
# before ``main`` runs, so an interrupt among them would end in a KeyboardInterrupt
# traceback (exit -2) instead of the command's one line and exit 130
from batchfit.cli.interrupt import exit_on_interrupt

exit_on_interrupt()

from batchfit.cli import app as _first  # noqa: F401 - registers estimate ... gpus, listed first
from batchfit.cli import noise as _noise  # noqa: F401 - registers noise and recommend
from batchfit.cli import plan as _plan  # noqa: F401 - registers plan
from batchfit.cli import serve as _serve  # noqa: F401 - registers serve
from batchfit.cli import webapp as _webapp  # noqa: F401 - registers ui
from batchfit.cli.app import app, main

__all__ = ["app", "main"]
