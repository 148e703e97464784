"""The exec'd fresh interpreters leave nothing behind, however the search ends."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # a real search in a process of its own

#: A capped CPU search whose first trial ends the process the way the CLI's Ctrl-C handler
#: does (os._exit: no ``finally`` runs, so FreshPool.close() never does).
_INTERRUPTED_SEARCH = textwrap.dedent("""
    import functools, os, torch
    from batchfit.realrun.search import search_max_batch

    def interrupted(trial):
        print("trial", trial.batch_size, flush=True)
        os._exit(130)

    search_max_batch(functools.partial(torch.nn.Linear, 64, 64), (64,), device="cpu",
                     memory_cap_bytes=16 * 2**20, optimizer="sgd", predicted=1,
                     on_trial=interrupted)
""")


def test_an_interrupted_search_leaves_no_request_file(tmp_path: Path) -> None:
    # Before: FreshPool wrote /tmp/batchfit-request-*.pkl and unlinked it only in close(),
    # so an interrupted (or killed) search left it behind: 73 had piled up on one machine.
    env = {**os.environ, "TMPDIR": str(tmp_path),
           "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    done = subprocess.run([sys.executable, "-c", _INTERRUPTED_SEARCH], env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 130, done.stderr[-2000:]
    assert "trial 1" in done.stdout  # it ran a trial: the pool existed when it ended
    assert sorted(p.name for p in tmp_path.glob("batchfit-request-*")) == []
