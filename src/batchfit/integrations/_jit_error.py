"""Undo the one lasting effect an in-process CPU cap can have on torch: oneDNN's JIT error.

oneDNN (torch's CPU convolutions, bf16 matmuls, reorders) generates each kernel with
Xbyak. oneDNN builds Xbyak without exceptions (``XBYAK_NO_EXCEPTION`` in
``src/cpu/x64/cpu_isa_traits.hpp``), so an error is a code kept in a thread-local int
(``Xbyak::local::GetErrorRef()`` in ``third_party/xbyak/xbyak.h``), which keeps the first
error and is cleared only by ``CodeGenerator::reset()``. When the code buffer's ``mmap``
fails (``MmapAllocator::alloc``) the code is ``ERR_CANT_ALLOC``, and
``jit_generator_t::create_kernel()`` (``src/cpu/x64/jit_generator.hpp``) returns
``out_of_memory`` whenever the code is set, before generating anything. Nothing in oneDNN
or torch clears it, so once a kernel's buffer fails under ``RLIMIT_DATA`` every new
primitive on that thread fails ("could not create a primitive"), after the cap is lifted
too: a trial that ran out of memory in the JIT would leave the user's process unable to run
a convolution of any new shape. (Primitives already cached keep working.)

:func:`clear_jit_allocation_error` resets that int on the calling thread, and only when it
holds ``ERR_CANT_ALLOC``: the code a failed allocation leaves, and the one error a cap
causes. The int has no exported symbol, so its offset in ``libtorch_cpu.so``'s thread-local
block comes from the library's own symbol table and the block from ``dlinfo``
(``RTLD_DI_TLS_DATA``: the calling thread's block, or none if the thread never touched it).
Where any of that is missing (another platform, a stripped library, a torch without
oneDNN) it does nothing.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import platform
import struct
import sys
from typing import Any

_SYMBOL = b"_ZZN5Xbyak5local11GetErrorRefEvE3err"  # Xbyak::local::GetErrorRef()::err
# Xbyak's error enum (xbyak.h): ERR_NONE = 0, ..., ERR_UNDER_LOCAL_LABEL = 21, ERR_CANT_ALLOC
ERR_CANT_ALLOC = 22
_RTLD_DI_TLS_DATA = 10  # <dlfcn.h>
_SHT_SYMTAB, _STT_TLS = 2, 6


def clear_jit_allocation_error() -> bool:
    """Clear Xbyak's ``ERR_CANT_ALLOC`` on this thread; True if it was set (and is now 0)."""
    where = _error_address()
    if where is None:
        return False
    error = ctypes.c_int.from_address(where)
    if error.value != ERR_CANT_ALLOC:
        return False
    error.value = 0
    return True


def jit_error() -> int | None:
    """Xbyak's error code on this thread (0: none), or None where it cannot be read."""
    where = _error_address()
    return None if where is None else ctypes.c_int.from_address(where).value


def reachable() -> bool:
    """Whether Xbyak's error can be found here (Linux x86-64, torch with oneDNN, the
    library's symbol table present)."""
    return _locate() is not None


def _error_address() -> int | None:
    located = _locate()
    if located is None:
        return None
    dlinfo, handle, offset = located
    block = ctypes.c_void_p()
    if dlinfo(ctypes.c_void_p(handle), _RTLD_DI_TLS_DATA, ctypes.byref(block)) != 0:
        return None
    return None if block.value is None else block.value + offset


@functools.cache
def _locate() -> tuple[Any, int, int] | None:
    """(``dlinfo``, the loaded ``libtorch_cpu.so``'s handle, the int's offset in its TLS
    block)."""
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return None
    try:
        import torch

        if not torch.backends.mkldnn.is_available():
            return None
        path = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
        offset = _tls_offset(path, _SYMBOL)
        if offset is None:
            return None
        # RTLD_NOLOAD: the copy torch already loaded, never a second one
        handle = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)._handle
        dlinfo = ctypes.CDLL(None).dlinfo  # glibc >= 2.3.3; AttributeError otherwise
    except (OSError, AttributeError, ValueError, struct.error):
        return None
    return dlinfo, handle, offset


def _tls_offset(path: str, name: bytes) -> int | None:
    """The value of the 4-byte thread-local symbol ``name`` in the ELF64 little-endian
    file ``path`` (for a shared library: its offset in the module's TLS block)."""
    with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as elf:
        if elf[:6] != b"\x7fELF\x02\x01":
            return None
        (section_table,) = struct.unpack_from("<Q", elf, 0x28)
        entry_size, count = struct.unpack_from("<HH", elf, 0x3A)
        sections = [struct.unpack_from("<IIQQQQIIQQ", elf, section_table + i * entry_size)
                    for i in range(count)]
        for kind, link, start, size, symbol_size in ((s[1], s[6], s[4], s[5], s[9])
                                                     for s in sections):
            if kind != _SHT_SYMTAB or symbol_size != 24:
                continue
            names, names_size = sections[link][4], sections[link][5]
            at = elf.find(b"\0" + name + b"\0", names, names + names_size)
            if at < 0:
                return None
            key, position = struct.pack("<I", at + 1 - names), start
            while (position := elf.find(key, position, start + size)) >= 0:
                if (position - start) % symbol_size == 0:
                    _, info, _, _, value, length = struct.unpack_from("<IBBHQQ", elf, position)
                    return value if info & 0xF == _STT_TLS and length == 4 else None
                position += 1
    return None
