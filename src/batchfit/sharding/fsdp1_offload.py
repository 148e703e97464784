"""FSDP1's ``CPUOffload(offload_params=True)`` as a GPU sees it, from a trace on the CPU.

What FSDP1 does (torch/distributed/fsdp/_flat_param.py and _runtime_utils.py of the
installed torch; method names below are ``FlatParamHandle``'s):

* ``init_flat_param_attributes`` (lazy init, first forward): the sharded flat parameter
  stays on the host as ``_local_shard`` (``flat_param.data.pin_memory()``), and a host
  gradient ``_cpu_grad`` the size of the shard is made (``zeros_like(...).pin_memory()``).
  The optimizer holds the original parameters, views into ``_local_shard``, so its state
  and its step are on the host too.
* ``pre_unshard``: without parameter mixed precision, ``flat_param_to(self.device)``
  copies the shard to the GPU when the flat parameter is on the host (``flat_param.device
  != self.device``); the copy is what is all-gathered, and it is dropped when ``unshard``
  points the flat parameter at the gathered one (``_use_unsharded_flat_param``). With
  mixed precision, ``_use_low_precision_shard`` allocates the low-precision ``_mp_shard``
  on the GPU and fills it from ``_local_shard.to(self.device)``: a full-precision copy of
  the shard that lives for the ``copy_``.
* ``_reduce_grad`` / ``_offload_grad``: the reduce-scatter output (on the GPU) is kept as
  ``_saved_grad_shard`` and copied into ``_cpu_grad``; the post-backward callback points
  ``flat_param.grad`` at ``_cpu_grad`` and deletes ``_saved_grad_shard``
  (``prepare_gradient_for_optim``), which frees the GPU copy there.

* Wrapping (torch/distributed/fsdp/_init_utils.py): a model offloaded so is built on the
  host (it is why one offloads); with ``device_id`` FSDP1 moves each unit's parameters to
  the GPU when it wraps the unit (``_move_module_to_device``), flattens and shards them
  there, and moves the shard back to the host (``_init_param_handle_from_params``:
  ``flat_param_to(cpu)``). The trace builds the model on its one device, so the model's
  own parameters are taken off as host memory; the flattened unit and its shard are
  traced on the device (the moved copy that precedes the flattening, one unit at a time,
  is not added).

On a CPU trace the compute device is the host: ``flat_param.device != self.device`` is
False and ``_local_shard.to("cpu")`` returns the shard itself, so neither copy happens,
and ``pin_memory()`` needs an accelerator (a fake tensor has no ``_pin_memory`` at all).
:class:`HostOffload` adds the two copies as the events a GPU would see (named
:data:`~batchfit.sharding.offload.COPY_TO_DEVICE`) and takes what lives on the host
(``_local_shard``, ``_cpu_grad``, the optimizer's state and step) off the device's events;
the GPU copy of the reduce-scatter output is traced as it is, since the same code runs.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from batchfit.engine import _torch_internals as ti
from batchfit.engine.trace import StepTrace
from batchfit.engine.tracer import Category, Phase, Tracer


def _handles(module: nn.Module) -> list[Any]:
    from torch.distributed.fsdp import _traversal_utils

    return list(_traversal_utils._get_fsdp_handles(module))


@contextlib.contextmanager
def _pinning_is_a_no_op() -> Iterator[None]:
    """``Tensor.pin_memory`` returns the tensor: page-locking host memory changes what
    the host holds, not what the GPU does, and it needs an accelerator this machine
    lacks."""
    original = torch.Tensor.pin_memory
    torch.Tensor.pin_memory = lambda self, device=None: self  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.pin_memory = original  # type: ignore[method-assign]


def run_on_this_host(module: nn.Module) -> None:
    """Adapt the offload of FSDP1-wrapped ``module`` to a compute device that is the host
    (a trace, or a real run on this CPU, which checks it), the least that lets torch's
    code run: its lazy initialisation pins ``_local_shard`` and ``_cpu_grad``
    (:func:`_pinning_is_a_no_op`), and its post-backward callback waits for the gradients'
    D2H copies with ``current_stream().synchronize()``, which ``torch.cpu.Stream`` lacks
    (on the host a copy is done when it returns: :class:`_HostDevice`)."""
    for handle in _handles(module):
        original = handle.init_flat_param_attributes

        @functools.wraps(original)
        def init(original: Any = original) -> None:
            with _pinning_is_a_no_op():
                original()

        handle.init_flat_param_attributes = init
    module._device_handle = _HostDevice(module._device_handle)


class _HostDevice:
    """FSDP1's device handle for the host, whose streams can ``synchronize()``."""

    def __init__(self, handle: Any) -> None:
        self._handle = handle

    def __getattr__(self, name: str) -> Any:
        return getattr(self._handle, name)

    def current_stream(self, *args: Any) -> Any:
        return _SynchronizableStream(self._handle.current_stream(*args))


class _SynchronizableStream:
    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)

    def synchronize(self) -> None:
        pass


class HostOffload:
    """Follows FSDP1's offload in a traced step (see the module docstring)."""

    def __init__(self, module: nn.Module, tracer: Tracer, built: Iterable[int] = ()) -> None:
        self.tracer = tracer
        self.host: set[int] = set(built)
        self._copies: dict[int, tuple[int, int]] = {}
        for handle in _handles(module):
            self._follow(handle)

    def _follow(self, handle: Any) -> None:
        init, pre_unshard = handle.init_flat_param_attributes, handle.pre_unshard
        unshard, low_precision = handle.unshard, handle._use_low_precision_shard

        def init_attributes() -> None:
            init()
            flat = handle.flat_param
            for tensor in (flat._local_shard, getattr(flat, "_cpu_grad", None)):
                if tensor is not None:
                    self.host.update(self.tracer.uids(tensor))

        def pre() -> bool:
            flat = handle.flat_param
            mixed = handle._uses_param_mixed_precision and not handle._force_full_precision
            on_host = getattr(flat, "_local_shard", None) is not None and _same_storage(
                flat.data, flat._local_shard)
            if not mixed and on_host:  # flat_param_to(self.device): the shard's H2D copy
                nbytes = flat.numel() * flat.element_size()
                self._copies[id(handle)] = (self._transient(nbytes), nbytes)
            return pre_unshard()

        def gather() -> None:
            unshard()
            copy = self._copies.pop(id(handle), None)
            if copy is not None:  # the flat parameter now points at the gathered one
                self.tracer.release(copy[0], copy[1], Category.COMMUNICATION)

        def use_low_precision_shard() -> None:
            low_precision()
            local = handle.flat_param._local_shard  # _local_shard.to(self.device): a copy
            nbytes = local.numel() * local.element_size()
            self.tracer.release(self._transient(nbytes), nbytes, Category.COMMUNICATION)

        handle.init_flat_param_attributes = init_attributes
        handle.pre_unshard = pre
        handle.unshard = gather
        handle._use_low_precision_shard = use_low_precision_shard

    def _transient(self, nbytes: int) -> int:
        from batchfit.sharding.offload import COPY_TO_DEVICE

        return self.tracer.transient(nbytes, Category.COMMUNICATION, COPY_TO_DEVICE)

    def on_device(self, trace: StepTrace) -> StepTrace:
        """``trace`` without the host's storages, the optimizer's state and its step."""
        from batchfit.sharding.offload import on_device

        return on_device(trace, categories=(Category.OPTIMIZER_STATE,),
                         phases=(Phase.OPTIMIZER,), host=self.host)


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    key_a, key_b = ti.storage_key(a), ti.storage_key(b)
    return key_a is not None and key_b is not None and key_a[0] == key_b[0]
