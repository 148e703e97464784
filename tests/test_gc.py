"""The collector is kept off old objects while batchfit traces, and left as it was found."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import textwrap
from typing import ClassVar

import pytest
from torch import nn

import batchfit
from batchfit._gc import old_objects_frozen


class GcSpy(nn.Module):
    """Records the collector's state each time its forward runs (inside the trace)."""

    seen: ClassVar[list[tuple[bool, int]]] = []

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        GcSpy.seen.append((gc.isenabled(), gc.get_freeze_count()))
        return self.lin(x)


@pytest.fixture()
def spy():
    GcSpy.seen = []
    yield GcSpy
    GcSpy.seen = []


def test_a_trace_freezes_the_objects_that_exist_and_unfreezes_them_after(spy):
    if gc.get_freeze_count():
        gc.unfreeze()  # another test left objects frozen: start from a plain process
    assert gc.isenabled()
    batchfit.estimate(spy, (8,), 4)
    assert spy.seen and all(enabled and frozen > 1000 for enabled, frozen in spy.seen)
    assert gc.isenabled() and gc.get_freeze_count() == 0
    batchfit.max_batch_size(spy, (8,), device="cpu", memory_bytes=1 << 20, max_batch_limit=64)
    assert gc.get_freeze_count() == 0


def test_a_caller_who_froze_objects_or_disabled_the_collector_keeps_that():
    gc.freeze()
    try:
        before = gc.get_freeze_count()
        with old_objects_frozen():
            garbage = [object() for _ in range(10)]
        assert gc.get_freeze_count() == before   # not unfrozen behind the caller's back
    finally:
        gc.unfreeze()
    gc.disable()
    try:
        with old_objects_frozen():
            assert not gc.isenabled() and gc.get_freeze_count() == 0
        assert not gc.isenabled()
    finally:
        gc.enable()
    del garbage


def test_the_cli_freezes_its_imports_once_and_collects_after(tmp_path):
    # A fresh `batchfit` process: the collector is off during the imports, then on,
    # with torch's and the model's objects frozen by the time the model runs.
    record = tmp_path / "gc.json"
    factory = tmp_path / "model.py"
    factory.write_text(textwrap.dedent(f"""
        import gc, json
        from torch import nn

        class Spy(nn.Linear):
            def forward(self, x):
                with open({str(record)!r}, "w") as f:
                    json.dump([gc.isenabled(), gc.get_freeze_count()], f)
                return super().forward(x)

        def build():
            return Spy(8, 8)
    """))
    done = subprocess.run(
        [sys.executable, "-c", "from batchfit.cli import main; main()", "estimate",
         f"{factory}:build", "--batch-size", "2", "--input", "8", "--json"],
        capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    enabled, frozen = json.loads(record.read_text())
    assert enabled
    assert frozen > 100_000   # `import torch` alone creates more objects than that


def test_the_library_in_words_leaves_a_disabled_collector_off(tmp_path):
    """batchfit.estimate("file.py:factory", ...) resolves the model as the CLI does, but only
    the CLI's own process turns the collector back on after the imports."""
    import batchfit

    path = tmp_path / "net.py"
    path.write_text("from torch import nn\nfrom batchfit import TensorSpec\n\n"
                    "def net():\n    return nn.Linear(8, 2), TensorSpec((8,))\n")
    gc.disable()
    try:
        batchfit.estimate(f"{path}:net", batch_size=2, device="cpu")
        assert not gc.isenabled() and gc.get_freeze_count() == 0
    finally:
        gc.enable()
