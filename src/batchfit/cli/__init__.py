"""The command line: ``batchfit estimate | max | search | bench | gpus | noise | recommend``.

Owns the typer app (:mod:`batchfit.cli.app`), the rich renderings of results
(:mod:`batchfit.cli.report`) and the matplotlib figures (:mod:`batchfit.cli.plot`).
The top layer: it may import every other part of batchfit, and nothing imports it.
Commands import torch and the engine lazily, so ``batchfit --help`` stays fast.
"""

from batchfit.cli import noise as _noise  # noqa: F401 - registers noise and recommend
from batchfit.cli.app import app, main

__all__ = ["app", "main"]
