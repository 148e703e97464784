"""Target device profiles: the CPU itself, or a CUDA GPU given by memory and compute capability.

CUDA overheads outside the caching allocator are documented defaults that the
user can override:

* ``context_bytes`` — the CUDA context and loaded kernels. It depends on the stack
  (:mod:`batchfit.engine.stack`): with lazy module loading (CUDA >= 11.7 with
  torch >= 1.13, or CUDA >= 12.2) **512 MiB**; without it 1,343 MiB (measured on a
  V100 with torch 1.10). A profile built without an explicit ``context_bytes`` takes
  its stack's value when a step is predicted (:meth:`DeviceProfile.for_stack`); an
  explicit one (``context_bytes=``, ``--overhead``) is kept.
* ``workspace_bytes`` — cuBLAS/cuBLASLt workspaces, which torch allocates through
  the caching allocator once per handle and stream and keeps. torch's default
  ``CUBLAS_WORKSPACE_CONFIG`` is ``:4096:2:16:8`` (8.125 MiB) before Hopper and
  32 MiB from sm90 on, plus a cuBLASLt workspace of the same size in recent torch.
  cuDNN convolution workspaces vary by algorithm; with
  ``torch.backends.cudnn.benchmark=True`` they can grow with the batch: add them
  through ``workspace_bytes`` if you use benchmark mode.

On the CPU, ``context_bytes`` is the runtime's memory beyond live tensors (oneDNN's
primitive cache, MKL's buffers): 0 by default, measured for a model by
:func:`batchfit.realrun.cpu_overhead.measure_cpu_overhead` (``batchfit max --device cpu``
does it), or set with ``DeviceProfile.cpu(context_bytes=...)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

from batchfit.device.allocator import AllocatorConfig
from batchfit.errors import InvalidInputError, MemoryBelowOverheadError, option

MiB = 1 << 20
GiB = 1 << 30
DEFAULT_CONTEXT_BYTES = 512 * MiB


class DeviceKind(StrEnum):
    CPU = "cpu"
    CUDA = "cuda"


def default_workspace_bytes(compute_capability: tuple[int, int]) -> int:
    """cuBLAS + cuBLASLt workspaces torch keeps for one stream (see module docstring)."""
    per_handle = 32 * MiB if compute_capability >= (9, 0) else (4096 * 2 + 16 * 8) * 1024
    return 2 * per_handle


@dataclass(frozen=True)
class DeviceProfile:
    """Where the step runs.

    Args:
        kind: ``cpu`` (no CUDA emulation; peak allocated is the answer) or ``cuda``.
        name: a display name.
        total_memory_bytes: the card's memory as CUDA reports it (None for the CPU).
        compute_capability: e.g. ``(8, 0)`` for an A100.
        context_bytes: CUDA context and kernels, outside the allocator; on the CPU the
            runtime's memory beyond live tensors (see the module docstring).
        workspace_bytes: cuBLAS/cuDNN workspaces held through the allocator.
        nccl_bytes: NCCL's own buffers on this GPU, outside the allocator (a rank of a
            multi-GPU step; :mod:`batchfit.sharding.nccl`).
        kernel_scratch: on the CPU, count the scratch memory kernels allocate and free
            inside one op (:mod:`batchfit.engine.kernels`); False counts tensors only,
            as a live-storage tracker sees them.
        unified_memory: the GPU shares ``total_memory_bytes`` with the CPU and the OS
            (Jetson); batchfit's answer then assumes all of it is free for CUDA.
        allocator: the caching allocator's ``PYTORCH_CUDA_ALLOC_CONF`` options
            (:class:`~batchfit.device.allocator.AllocatorConfig`; torch's defaults unless
            set with :meth:`with_allocator`).
    """

    kind: DeviceKind = DeviceKind.CPU
    name: str = "cpu"
    total_memory_bytes: int | None = None
    compute_capability: tuple[int, int] | None = None
    context_bytes: int = 0
    workspace_bytes: int = 0
    sm_count: int | None = None
    unified_memory: bool = False
    extra: dict[str, Any] = field(default_factory=dict, compare=False)
    #: False once the user set the context; True while it is the stack's default.
    context_from_stack: bool = field(default=False, compare=False)
    nccl_bytes: int = 0
    kernel_scratch: bool = True
    allocator: AllocatorConfig = field(default_factory=AllocatorConfig)

    @property
    def is_cuda(self) -> bool:
        return self.kind is DeviceKind.CUDA

    @property
    def outside_allocator_bytes(self) -> int:
        """Memory on the device beyond what the allocator holds: the context and NCCL."""
        return self.context_bytes + self.nccl_bytes

    @classmethod
    def cpu(cls, context_bytes: int = 0, *, kernel_scratch: bool = True) -> "DeviceProfile":
        """This CPU; ``context_bytes``: the runtime's memory beyond live tensors;
        ``kernel_scratch``: count kernels' in-op scratch (False: tensors only)."""
        if context_bytes < 0:
            raise InvalidInputError("context_bytes must not be negative")
        return cls(context_bytes=int(context_bytes), kernel_scratch=bool(kernel_scratch))

    @classmethod
    def cuda(cls, total_memory_bytes: int, compute_capability: tuple[int, int] = (8, 0), *,
             name: str = "cuda", context_bytes: int | None = None,
             workspace_bytes: int | None = None, sm_count: int | None = None) -> "DeviceProfile":
        """A CUDA target. Overheads default to the documented values above."""
        if total_memory_bytes <= 0:
            raise InvalidInputError("total_memory_bytes must be positive")
        cc = tuple(compute_capability)
        if len(cc) != 2:
            raise InvalidInputError(f"bad compute capability {compute_capability!r}: use e.g. (8, 0)")
        return cls(
            kind=DeviceKind.CUDA, name=name, total_memory_bytes=int(total_memory_bytes),
            compute_capability=cc,  # type: ignore[arg-type]
            context_bytes=DEFAULT_CONTEXT_BYTES if context_bytes is None else int(context_bytes),
            context_from_stack=context_bytes is None,
            workspace_bytes=(default_workspace_bytes(cc) if workspace_bytes is None  # type: ignore[arg-type]
                             else int(workspace_bytes)),
            sm_count=sm_count)

    def with_overheads(self, context_bytes: int | None = None,
                       workspace_bytes: int | None = None) -> "DeviceProfile":
        changes: dict[str, Any] = {}
        if context_bytes is not None:
            changes["context_bytes"] = int(context_bytes)
            changes["context_from_stack"] = False
        if workspace_bytes is not None:
            changes["workspace_bytes"] = int(workspace_bytes)
        return replace(self, **changes)

    def for_stack(self, stack: Any) -> "DeviceProfile":
        """This profile with the CUDA context of ``stack`` (a
        :class:`~batchfit.engine.stack.Stack`) on this card's architecture, unless the
        context was set explicitly.

        Raises:
            MemoryBelowOverheadError: the stack's context and the workspaces fill the memory.
        """
        if not (self.is_cuda and self.context_from_stack):
            return self
        context = stack.context_bytes(self.compute_capability)
        if context == self.context_bytes:
            return self
        profile = replace(self, context_bytes=context)
        _check_room_for_overheads(profile)  # e.g. --memory 1GiB with an eager-loading CUDA 11
        return profile

    def with_allocator(self, allocator: AllocatorConfig) -> "DeviceProfile":
        """This profile with the caching allocator configured as ``allocator`` (CUDA only:
        the CPU has no caching allocator)."""
        if not self.is_cuda or allocator == self.allocator:
            return self
        return replace(self, allocator=allocator)

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind.value, "name": self.name,
            "total_memory_bytes": self.total_memory_bytes,
            "compute_capability": list(self.compute_capability) if self.compute_capability else None,
            "context_bytes": self.context_bytes, "workspace_bytes": self.workspace_bytes,
            "sm_count": self.sm_count, "nccl_bytes": self.nccl_bytes,
            "unified_memory": self.unified_memory, "allocator": str(self.allocator),
        }


def available_memory_bytes() -> int | None:
    """The memory this machine can give a new allocation now: ``MemAvailable`` of
    ``/proc/meminfo`` (free memory plus the page cache and buffers the kernel can drop;
    the kernel's own estimate). None where there is no ``/proc/meminfo``. What a CPU
    "device" holds when no budget is given, as a GPU's is its free memory."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def resolve_device(device: "DeviceProfile | str | None") -> DeviceProfile:
    """Accept a profile, ``"cpu"``, or a catalog GPU name (``"A100-80GB"``)."""
    if device is None:
        return DeviceProfile.cpu()
    if isinstance(device, DeviceProfile):
        return device
    text = str(device).strip()
    if text.lower() == "cpu":
        return DeviceProfile.cpu()
    from batchfit.device.catalog import find_gpu

    return gpu_profile(find_gpu(text))


def gpu_profile(gpu: Any, memory_bytes: int | None = None, *,
                context_bytes: int | None = None) -> DeviceProfile:
    """A profile for a :class:`batchfit.device.catalog.GPU` row: its compute capability, SM
    count and cuBLAS workspaces (which depend on the architecture), and its memory.

    Args:
        gpu: a catalog card (``find_gpu``) or a live one (``live_gpu``). The profile's
            memory is what CUDA reports as the card's total
            (:attr:`~batchfit.device.catalog.GPU.usable_memory_bytes`).
        memory_bytes: that card's architecture with this much memory instead of its own
            (a memory variant the catalog lacks, or the share of a card you may use).
        context_bytes: the CUDA context (default :data:`DEFAULT_CONTEXT_BYTES`).

    Raises:
        MemoryBelowOverheadError: ``memory_bytes`` does not exceed the CUDA context plus
            the workspaces, so no step could fit (the bytes needed vs given).

    Example:
        >>> from batchfit.device.catalog import find_gpu
        >>> p = gpu_profile(find_gpu("RTX 5090"), memory_bytes=48 * 2**30)
        >>> p.total_memory_bytes // 2**30, p.compute_capability, p.sm_count
        (48, (12, 0), 170)
    """
    if memory_bytes is not None:
        gpu = gpu.with_memory(memory_bytes)
    cc = gpu.compute_capability or (9, 0)
    # What CUDA reports as the total where the catalog has it (the driver keeps the rest of
    # the marketed memory); ``memory_bytes`` given here is that total.
    total = getattr(gpu, "usable_memory_bytes", gpu.memory_bytes)
    profile = DeviceProfile.cuda(total, cc, name=gpu.name, sm_count=gpu.sm_count,
                                 context_bytes=context_bytes)
    if memory_bytes is not None:
        _check_room_for_overheads(profile)
    return replace(profile, unified_memory=bool(getattr(gpu, "unified_memory", False)),
                   extra={"gpu": gpu})


def marketed_memory_note(profile: DeviceProfile) -> str | None:
    """One line where ``profile`` is a catalog card whose CUDA total is unknown, so that its
    marketed memory stands in (:attr:`~batchfit.device.catalog.GPU.memory_is_marketed`);
    else None."""
    gpu = profile.extra.get("gpu") if profile.extra else None
    if gpu is None or not getattr(gpu, "memory_is_marketed", False):
        return None
    return (f"{profile.name}: the catalog has no public report of what CUDA reports as its "
            f"total, so its marketed {profile.total_memory_bytes / GiB:.2f} GiB stands in (CUDA "
            "reports a little less): give the total memory as torch.cuda.mem_get_info()[1] "
            "reports it for the exact figure")


def _check_room_for_overheads(profile: DeviceProfile) -> None:
    """A memory the context and workspaces fill is a mistyped size, not a batch too large."""
    memory = profile.total_memory_bytes or 0
    needed = profile.context_bytes + profile.workspace_bytes
    if memory <= needed:
        raise MemoryBelowOverheadError(
            f"memory {memory:,} B is below the {needed:,} B that {profile.name} needs before "
            f"any tensor (CUDA context {profile.context_bytes:,} B + cuBLAS workspaces "
            f"{profile.workspace_bytes:,} B): give more memory ({option('memory')}) or a smaller "
            f"context ({option('overhead')})", needed_bytes=needed, given_bytes=memory)
