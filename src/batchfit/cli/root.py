"""The typer application every command module registers on (``@app.command``).

On its own, so that the command modules and :mod:`batchfit.cli.app` (which defines
``main``) import it without importing each other.
"""

from __future__ import annotations

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Predict the GPU memory of a PyTorch step and the largest batch that fits.")
