"""Library log records that say nothing to a batchfit user, dropped one by one.

- ``torch.utils.cpp_extension`` looks for a CUDA toolkit when it is imported and, where it
  finds one (``nvcc`` on the PATH, ``/usr/local/cuda``) but torch has no CUDA runtime (a
  CPU build, a machine without a GPU), logs "No CUDA runtime is found, using
  CUDA_HOME=...". That module compiles C++/CUDA extensions, which batchfit never does; it
  is imported along with ``torch.utils.benchmark`` (its ``cpp_jit``) and DeepSpeed.
- ``torch._subclasses.fake_tensor`` logs "failed while attempting to run meta for OP",
  with a traceback, before it re-raises the error of a failing meta kernel (a wrong input
  shape in the user's forward); the trace reports that error as one line.

Only those records are dropped, and only inside the context: the loggers' other records,
and their levels, are left as they are.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator


class _DropPrefix(logging.Filter):
    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


@contextlib.contextmanager
def _without(logger_name: str, prefix: str) -> Iterator[None]:
    logger = logging.getLogger(logger_name)
    drop = _DropPrefix(prefix)
    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)


def without_cuda_home_notice() -> contextlib.AbstractContextManager[None]:
    """Import (or call) something that imports ``torch.utils.cpp_extension`` without its
    import-time "No CUDA runtime is found" notice."""
    return _without("torch.utils.cpp_extension", "No CUDA runtime is found")


def without_meta_failure_log() -> contextlib.AbstractContextManager[None]:
    """Run a fake trace without fake_tensor's log of a failing meta kernel (the error
    itself still propagates, and the trace reports it)."""
    return _without("torch._subclasses.fake_tensor", "failed while attempting to run meta")
