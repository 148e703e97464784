"""Per-op knowledge: outputs whose real size differs from what the fake kernel reports.

Some meta kernels return an empty placeholder for a buffer the real kernel
fills, typically a workspace saved for backward. Each entry is a small function,
registered for one op, that returns ``{output index: real nbytes}``.

``aten.mkldnn_rnn_layer`` (CPU LSTM/GRU through oneDNN): the meta kernel returns
an empty workspace, while oneDNN's training workspace holds the gates and states
of every time step (12.5 MB for one 128-unit LSTM layer at seq 50, batch 32).
oneDNN gives no formula we can call, so the real kernel is run on small real
tensors at a quarter and a half of the batch and the size is extrapolated
linearly in the batch (exact to the page for batch >= 8 in our checks). For
CUDA targets the same size stands in for cuDNN's RNN reserve space, whose size
cuDNN computes internally.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from batchfit._torch_internals import no_dispatch_modes

SizeFix = Callable[[tuple, dict], dict[int, int]]
_REGISTRY: dict[Any, SizeFix] = {}
_CACHE: dict[tuple, int] = {}


def register_size_fix(op: Any) -> Callable[[SizeFix], SizeFix]:
    def wrap(fn: SizeFix) -> SizeFix:
        _REGISTRY[op] = fn
        return fn
    return wrap


def size_fix_for(op: Any) -> SizeFix | None:
    return _REGISTRY.get(op)


def _rnn_workspace_bytes(args: tuple, batch: int) -> int:
    """The real oneDNN workspace of ``mkldnn_rnn_layer`` at ``batch`` (cached)."""
    (inp, w0, w1, w2, w3, hx, cx, reverse, batch_sizes, mode, hidden, layers, has_biases,
     bidirectional, batch_first, train) = args
    shape = list(inp.shape)
    batch_dim = 1  # the layer always gets (seq, batch, features); batch_first is for the output
    key = (tuple(shape), tuple(w0.shape), tuple(w1.shape), inp.dtype, mode, hidden,
           bidirectional, bool(train), batch)
    if key not in _CACHE:
        shape[batch_dim] = batch
        # grad mode stays on: without it the kernel keeps no workspace
        with no_dispatch_modes():
            def real(t: torch.Tensor, dims: list[int] | None = None) -> torch.Tensor:
                return torch.zeros(dims if dims is not None else list(t.shape), dtype=t.dtype)

            state = [batch, hidden]
            out = torch.ops.aten.mkldnn_rnn_layer(
                real(inp, shape), real(w0), real(w1), real(w2), real(w3), real(hx, state),
                real(cx, state), reverse, batch_sizes, mode, hidden, layers, has_biases,
                bidirectional, batch_first, train)
        _CACHE[key] = out[3].untyped_storage().nbytes()
    return _CACHE[key]


@register_size_fix(torch.ops.aten.mkldnn_rnn_layer.default)
def _mkldnn_rnn_layer(args: tuple, kwargs: dict) -> dict[int, int]:
    if not args[-1]:  # not training: no workspace is kept
        return {}
    batch = args[5].shape[0]  # hx: (batch, hidden)
    small, large = max(1, batch // 4), max(2, batch // 2)
    if batch <= 2:
        return {3: _rnn_workspace_bytes(args, batch)}
    at_small, at_large = _rnn_workspace_bytes(args, small), _rnn_workspace_bytes(args, large)
    slope = (at_large - at_small) / (large - small)
    return {3: int(round(at_large + slope * (batch - large)))}
