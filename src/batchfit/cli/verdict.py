"""Under ``--json``, a run whose answer is "does not fit" (exit 3) still prints JSON with its
verdict on stdout, so a script reads the same document whatever the outcome; the one-line
error still goes to stderr and the exit code stays 3."""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator
from typing import Any

from batchfit.errors import DoesNotFitError


@contextlib.contextmanager
def json_verdict(as_json: bool, context: dict[str, Any]) -> Iterator[None]:
    """On :class:`DoesNotFitError` with ``as_json``, write ``{**context, "fits": false,
    "error", "needed_bytes", "available_bytes"}`` to stdout, then let the error go on to the
    command's error handler (one line on stderr, exit 3)."""
    try:
        yield
    except DoesNotFitError as exc:
        if as_json:
            sys.stdout.write(json.dumps({**context, "fits": False, "error": str(exc),
                                         "needed_bytes": exc.needed_bytes,
                                         "available_bytes": exc.available_bytes},
                                        indent=2) + "\n")
        raise
