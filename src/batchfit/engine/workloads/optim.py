"""bitsandbytes optimizers in a trace: 8-bit state, the small-tensor fp32 fallback, paged state.

The optimizers are bitsandbytes' own classes, run on the trace's tensors, so their state is
what ``init_state`` allocates (bitsandbytes/optim/optimizer.py, ``Optimizer2State`` and
``Optimizer1State``):

* 8-bit: ``state1``/``state2`` uint8 tensors shaped like the parameter, ``absmax1``/``absmax2``
  float32 with one value per 256-element block (``blocks = ceil(n / 256)``), and ``qmap1``/
  ``qmap2``, the 256-value dynamic code books shared by every parameter.
* A parameter with fewer than ``min_8bit_size`` (4096) elements keeps float32 state.
* Paged (``paged_adamw_8bit``, ``paged_adamw_32bit``...): on a GPU each state buffer of a
  parameter with at least 100,000 elements comes from ``F.get_paged`` (``cudaMallocManaged``:
  unified memory, outside torch's caching allocator); smaller ones are ordinary tensors. On
  the CPU bitsandbytes falls back to ordinary tensors.

Unified memory is host-backed: the driver migrates its pages to the GPU when a kernel
touches them (during ``optimizer.step``) and evicts them back to host memory when the GPU
runs short, so paged state never raises an out-of-memory error; it costs PCIe traffic
instead. batchfit therefore does not count it against the card: a trace for a GPU target
keeps paged buffers out of its events and reports their bytes as ``host_backed_bytes``.
While the step runs they may occupy the card too (nvidia-smi shows them), but only in the
memory the allocator leaves free.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

#: bitsandbytes optimizer classes by batchfit name, and their defaults (those of
#: transformers' ``optim=`` choices that map to them).
BNB_OPTIMIZERS: dict[str, tuple[str, dict[str, Any]]] = {
    "adamw8bit": ("AdamW8bit", {"lr": 1e-3}),
    "adam8bit": ("Adam8bit", {"lr": 1e-3}),
    "paged-adamw8bit": ("PagedAdamW8bit", {"lr": 1e-3}),
    "paged-adamw32bit": ("PagedAdamW32bit", {"lr": 1e-3}),
    "lion": ("Lion", {"lr": 1e-4}),
    "lion8bit": ("Lion8bit", {"lr": 1e-4}),
    "paged-lion8bit": ("PagedLion8bit", {"lr": 1e-4}),
}

#: ``get_state_buffer`` pages a buffer from this many elements (``p.numel() < 1e5`` is not).
PAGED_MIN_NUMEL = 100_000


def is_bnb_optimizer(name: str) -> bool:
    return name in BNB_OPTIMIZERS


def build_bnb_optimizer(name: str, params: list[torch.nn.Parameter], kwargs: dict[str, Any],
                        on_paged: Callable[[torch.Tensor], None] | None) -> Any:
    """bitsandbytes' optimizer ``name`` over ``params``.

    ``on_paged``: for a GPU target, called with every buffer bitsandbytes would page (the
    trace keeps it off the device and counts it as host-backed); None for a CPU target,
    where bitsandbytes itself falls back to ordinary buffers.

    The optimizer is constructed with every dispatch mode off: its code books are built
    with ``.tolist()``, which a fake tensor cannot answer.
    """
    from batchfit.engine._torch_internals import no_dispatch_modes
    from batchfit.engine.workloads.build import import_bitsandbytes
    from batchfit.engine.workloads.runtime import register_bnb_decompositions

    bnb = import_bitsandbytes()
    register_bnb_decompositions()  # and its ops known to allocate only their outputs

    cls_name, defaults = BNB_OPTIMIZERS[name]
    cls = getattr(bnb.optim, cls_name)
    with no_dispatch_modes(), torch.device("cpu"):
        optimizer = cls(params, **{**defaults, **kwargs})
    if getattr(optimizer, "is_paged", False):
        _reroute_paging(optimizer, on_paged)
    return optimizer


def _reroute_paging(optimizer: Any, on_paged: Callable[[torch.Tensor], None] | None) -> None:
    """Replace the optimizer's paging calls (CUDA driver calls through ctypes, which a fake
    or meta tensor cannot make) with their memory effect."""

    def get_state_buffer(p: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        buffer = torch.zeros_like(p, dtype=dtype)
        if on_paged is not None and p.numel() >= PAGED_MIN_NUMEL:
            on_paged(buffer)
        return buffer

    optimizer.get_state_buffer = get_state_buffer
    optimizer.prefetch_state = lambda p: None  # cudaMemPrefetchAsync: no allocation
