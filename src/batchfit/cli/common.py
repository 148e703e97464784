"""What every command shares: the consoles, the one-line error handling (library messages
name options by flag here), ``--json`` output and the checks made before any work."""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator
from typing import Any

import typer
from rich.console import Console

from batchfit.cli.options import FLAGS
from batchfit.errors import BatchfitError, DoesNotFitError, InvalidInputError, option_vocabulary

out = Console()
err = Console(stderr=True)


@contextlib.contextmanager
def errors(debug: bool, json_head: dict[str, Any] | None = None) -> Iterator[None]:
    """One clear line and an exit code for every error; a traceback only with --debug.
    With ``json_head`` (``--json``), a "nothing fits" answer (exit 3) is still one JSON
    object on stdout: the head's fields and the verdict. Inside, the library names options
    by their flags."""
    try:
        with option_vocabulary(FLAGS):
            yield
    except typer.Exit:
        raise
    except BatchfitError as exc:
        if json_head is not None and isinstance(exc, DoesNotFitError):
            emit_json({**json_head, **exc.to_dict()})
        if debug:
            raise
        err.print(f"[red]error:[/red] {exc}", highlight=False, soft_wrap=True)
        raise typer.Exit(exc.exit_code) from None
    except KeyboardInterrupt:  # the library called from a test or a script: same line
        err.print("interrupted", highlight=False)
        raise typer.Exit(130) from None
    except Exception as exc:  # noqa: BLE001 - last resort: still one line
        if debug:
            raise
        line = (str(exc).strip().splitlines() or [""])[0]
        err.print(f"[red]error:[/red] {type(exc).__name__}: {line} (rerun with --debug for details)",
                  highlight=False, soft_wrap=True)
        raise typer.Exit(1) from None


def emit_json(data: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(data, indent=2) + "\n")


def print_notes(notes: Any) -> None:
    """The library's notes on what it chose for the user, on stderr."""
    for note in notes:
        err.print(note, highlight=False, soft_wrap=True)


def check_plot(path: str | None) -> None:
    """The --plot file is checked before any work: a result is never lost to a bad path."""
    if path is not None:
        from batchfit.cli.plot import check_plot_path

        check_plot_path(path)
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
            raise InvalidInputError(f"cannot write --plot {path}: {folder} is not a folder "
                                    "this user can write to; create it or give another path")
