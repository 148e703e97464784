"""What the engine needs from the device it predicts for: a small protocol, so engine code
names the facts it reads instead of taking ``device: Any``
(:class:`batchfit.device.profile.DeviceProfile` is the one implementation)."""

from __future__ import annotations

from typing import Protocol


class Target(Protocol):
    """What a trace needs from the device it predicts for
    (:class:`batchfit.device.profile.DeviceProfile` is one)."""

    @property
    def is_cuda(self) -> bool:
        """A CUDA GPU: CUDA's autocast, attention kernels and optimizer defaults apply."""

    compute_capability: tuple[int, int] | None  #: the GPU's (major, minor); None on a CPU
    sm_count: int | None  #: streaming multiprocessors (kernel grids); None if unknown
    kernel_scratch: bool  #: a CPU's kernels allocate in-op scratch (oneDNN)
