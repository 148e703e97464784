"""oneDNN's JIT keeps a failed code allocation as a thread-local Xbyak error that fails
every later kernel on that thread (xbyak.h ``GetErrorRef``, oneDNN's
``jit_generator_t::create_kernel``); an in-process CPU cap must not leave it behind.

Each check runs in a fresh interpreter: a poisoned thread would fail the tests after it."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from batchfit.integrations._jit_error import ERR_CANT_ALLOC, reachable

pytestmark = pytest.mark.skipif(
    not reachable(), reason="Xbyak's error is not reachable (not Linux x86-64 with oneDNN)")

# A warmed-up convolution, then a convolution of a new shape (a new oneDNN primitive, so a
# new JIT kernel) under RLIMIT_DATA = VmData + ROOM: less than the code buffer every kernel
# maps when it is built (Xbyak's CodeArray allocates its max size, jit_generator_t's
# max_code_size of 256 KiB), so that mmap fails; and room enough for oneDNN's own small
# allocations before it, which it does not all check (with too little it crashes instead).
ROOM = 160 * 1024
PRELUDE = """
import resource, torch
from torch.nn.functional import conv2d
from batchfit.integrations._jit_error import clear_jit_allocation_error, jit_error
from batchfit.integrations._trials import cpu_memory_cap
from batchfit.realrun.trial import vm_data_bytes

def conv(channels):  # each channel count is a shape no earlier call built a kernel for
    return conv2d(torch.ones(2, channels, 9, 9), torch.ones(4, channels, 3, 3))

def fails(channels):
    try:
        conv(channels)
    except RuntimeError as error:
        assert "could not create a primitive" in str(error), error
        return True
    return False

conv(3)
"""


def run(body: str) -> None:
    done = subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(body)],
                          check=False, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]


def test_a_failed_jit_allocation_fails_every_new_kernel_until_cleared():
    run(f"""
        soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
        resource.setrlimit(resource.RLIMIT_DATA, (vm_data_bytes() + {ROOM}, hard))
        assert fails(5)
        resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))
        assert jit_error() == {ERR_CANT_ALLOC}
        assert fails(6) and fails(7)  # no cap now, and still every new kernel fails
        assert clear_jit_allocation_error() and jit_error() == 0
        assert not fails(6) and not fails(7)
        assert not clear_jit_allocation_error()  # nothing to clear now
        """)


def test_the_cpu_cap_leaves_no_jit_error_behind():
    run(f"""
        with cpu_memory_cap({ROOM}):
            assert fails(5)
        assert jit_error() == 0
        assert not fails(5) and not fails(6)
        """)


def test_no_symbol_means_nothing_to_clear(tmp_path):
    from batchfit.integrations._jit_error import _SYMBOL, _tls_offset

    junk = tmp_path / "libjunk.so"
    junk.write_bytes(b"not an ELF file" * 100)
    assert _tls_offset(str(junk), _SYMBOL) is None
    # an ELF file without Xbyak in it (this interpreter's executable)
    assert _tls_offset(sys.executable, _SYMBOL) is None
