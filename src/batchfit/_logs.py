"""Library notices that say nothing about batchfit's work, dropped one by one.

``torch.utils.cpp_extension`` looks for a CUDA toolkit when it is imported and, where it
finds one (``nvcc`` on the PATH, ``/usr/local/cuda``) but torch has no CUDA runtime (a CPU
build, a machine without a GPU), logs "No CUDA runtime is found, using CUDA_HOME=...". That
module compiles C++/CUDA extensions, which batchfit never does; it is imported along with
``torch.utils.benchmark`` (its ``cpp_jit``) and DeepSpeed. Only that one message is dropped:
the logger's other records, and its level, are left as they are.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

_CUDA_HOME_NOTICE = "No CUDA runtime is found"


class _DropCudaHomeNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(_CUDA_HOME_NOTICE)


@contextlib.contextmanager
def without_cuda_home_notice() -> Iterator[None]:
    """Import (or call) something that imports ``torch.utils.cpp_extension`` without its
    import-time "No CUDA runtime is found" notice; the filter is removed after."""
    logger = logging.getLogger("torch.utils.cpp_extension")
    drop = _DropCudaHomeNotice()
    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)
