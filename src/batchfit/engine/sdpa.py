"""Which attention kernel a CUDA device picks, and what that kernel keeps in memory.

On the CPU ``F.scaled_dot_product_attention`` runs the CPU flash kernel or, with
dropout or inputs it cannot take, the math path, which saves the ``seq x seq``
attention matrix. A GPU picks flash, memory-efficient, cuDNN or math attention by the
rules of ``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp``
(:func:`choose_sdpa_backend`); the fused ones save only the output and a float32
log-sum-exp. :class:`_FusedAttention` allocates what the chosen CUDA kernel saves in
forward and allocates in backward; the emulation
(:mod:`batchfit.engine.cuda_emulation`) substitutes it for the CPU call.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import torch

from batchfit.engine.autocast import _LOW_PRECISION

__all__ = ["SdpaBackend", "SdpaProblem", "choose_sdpa_backend", "emulated_attention_kernel"]

#: The fused kernel whose outputs the emulation is allocating right now (None otherwise).
_ALLOCATING: list[SdpaBackend] = []


def emulated_attention_kernel() -> SdpaBackend | None:
    """The fused attention kernel (flash, memory-efficient, cuDNN) whose outputs (the
    attention output and its log-sum-exp) the emulation is allocating at this moment, else
    None. On the GPU they are the outputs of one aten op
    (``aten._scaled_dot_product_flash_attention`` and its siblings); in a trace they are two
    ``new_empty`` calls inside :class:`_FusedAttention`: a selective activation
    checkpointing policy (``torch.utils.checkpoint.create_selective_checkpoint_contexts``)
    asks this to treat them as that op."""
    return _ALLOCATING[-1] if _ALLOCATING else None

# ---------------------------------------------------------------------------------------
# Knowledge: which attention kernel a CUDA device picks (sdp_utils.cpp)
# ---------------------------------------------------------------------------------------


class SdpaBackend(StrEnum):
    """The kernels behind ``F.scaled_dot_product_attention`` on a CUDA device."""

    FLASH = "flash"
    EFFICIENT = "efficient"
    CUDNN = "cudnn"
    MATH = "math"


@dataclass(frozen=True)
class SdpaProblem:
    """What the kernel choice depends on, for one ``scaled_dot_product_attention`` call.

    Shapes follow the ``(batch, heads, seq, head_dim)`` layout of the fused kernels.

    Attributes:
        dtype: dtype of query, key and value.
        head_dim: last dimension of query and key.
        head_dim_v: last dimension of value (default: ``head_dim``).
        batch_size: batch dimension.
        num_heads: query heads.
        num_kv_heads: key and value heads (default: ``num_heads``).
        seq_len_q: query length.
        seq_len_kv: key and value length (default: ``seq_len_q``).
        has_mask: an ``attn_mask`` was passed.
        mask_requires_grad: the mask is trainable.
        dropout_p: attention dropout.
        is_causal: the ``is_causal`` flag.
        enable_gqa: the ``enable_gqa`` flag.
        requires_grad: grad mode is on and query, key or value requires grad.
        layout_ok: q, k and v are dense 4-D tensors of one dtype whose last dimension
            (and the mask's) has stride 1.
        storage_offsets: storage offsets of q, k and v in elements (mem-efficient
            attention on sm80+ needs them aligned).
    """

    dtype: torch.dtype
    head_dim: int
    head_dim_v: int | None = None
    batch_size: int = 1
    num_heads: int = 1
    num_kv_heads: int | None = None
    seq_len_q: int = 128
    seq_len_kv: int | None = None
    has_mask: bool = False
    mask_requires_grad: bool = False
    dropout_p: float = 0.0
    is_causal: bool = False
    enable_gqa: bool = False
    requires_grad: bool = True
    layout_ok: bool = True
    storage_offsets: tuple[int, int, int] = (0, 0, 0)

    @classmethod
    def from_tensors(cls, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                     is_causal: bool = False, enable_gqa: bool = False) -> SdpaProblem:
        """Describe a call from the arguments of ``F.scaled_dot_product_attention``.

        Example:
            >>> import torch
            >>> q = torch.randn(2, 12, 1024, 64, dtype=torch.float16)
            >>> SdpaProblem.from_tensors(q, q, q, is_causal=True).num_heads
            12
        """
        qkv = (query, key, value)
        dense_4d = all(t.dim() == 4 and not t.is_nested for t in qkv)
        layout_ok = (dense_4d and query.dtype == key.dtype == value.dtype
                     and query.size(0) == key.size(0) == value.size(0)
                     and all(t.stride(-1) == 1 or t.size(-1) == 1 for t in qkv)
                     and (attn_mask is None or attn_mask.stride(-1) == 1))
        return cls(
            dtype=query.dtype, head_dim=query.size(-1), head_dim_v=value.size(-1),
            batch_size=query.size(0) if dense_4d else 1,
            num_heads=query.size(-3) if dense_4d else 1,
            num_kv_heads=key.size(-3) if dense_4d and key.size(-3) == value.size(-3) else None,
            seq_len_q=query.size(-2), seq_len_kv=key.size(-2),
            has_mask=attn_mask is not None,
            mask_requires_grad=attn_mask is not None and attn_mask.requires_grad,
            dropout_p=dropout_p, is_causal=is_causal, enable_gqa=enable_gqa,
            requires_grad=torch.is_grad_enabled() and any(t.requires_grad for t in qkv),
            layout_ok=layout_ok and (not dense_4d or key.size(-3) == value.size(-3)),
            storage_offsets=(query.storage_offset(), key.storage_offset(),
                             value.storage_offset()),
        )


def _heads_ok(p: SdpaProblem, kv_heads: int) -> bool:
    """``check_batch_size_and_num_heads_dense``: equal heads, or a GQA grouping."""
    if p.enable_gqa:
        return kv_heads > 0 and p.num_heads % kv_heads == 0
    return kv_heads == p.num_heads


def _gemm_alignment(cc: tuple[int, int], dtype: torch.dtype) -> int:
    """``minimum_gemm_alignment``: the head-dim multiple mem-efficient attention needs."""
    is_half = dtype in _LOW_PRECISION
    tensor_cores = cc[0] >= 8 or (cc[0] >= 7 and is_half)
    alignment = 4 if cc[0] >= 8 else 1
    return max(alignment, 128 // (16 if is_half else 32)) if tensor_cores else alignment


def _can_use_flash(cc: tuple[int, int], p: SdpaProblem, dv: int, kv_heads: int,
                   skv: int) -> bool:
    if not (p.layout_ok and not p.has_mask and p.head_dim == dv and p.head_dim <= 256
            and (8, 0) <= cc <= (12, 1)):
        return False
    # sm86-89 and sm120-121 cannot train head_dim in (192, 224], or in (224, 256] with dropout
    if (p.requires_grad and ((8, 6) <= cc <= (8, 9) or (12, 0) <= cc <= (12, 1))
            and not (p.head_dim <= 192 or (p.dropout_p == 0.0 and p.head_dim > 224))):
        return False
    if p.is_causal and p.seq_len_q != skv:
        return False
    return (p.dtype in _LOW_PRECISION and _heads_ok(p, kv_heads)
            and p.seq_len_q > 0 and skv > 0)


def _can_use_efficient(cc: tuple[int, int], p: SdpaProblem, dv: int, kv_heads: int,
                       skv: int) -> bool:
    if not (p.layout_ok and (5, 0) <= cc <= (12, 1)):
        return False
    alignment = _gemm_alignment(cc, p.dtype)
    if not (p.head_dim > 0 and dv > 0 and p.head_dim % alignment == 0 and dv % alignment == 0):
        return False
    if cc[0] >= 8 and any(offset % alignment for offset in p.storage_offsets):
        return False
    dtypes = (torch.float16, torch.float32, torch.bfloat16) if cc[0] >= 8 else (
        torch.float16, torch.float32)
    return (p.seq_len_q > 0 and skv > 0 and _heads_ok(p, kv_heads) and p.dtype in dtypes)


def _can_use_cudnn(cc: tuple[int, int], p: SdpaProblem, dv: int, kv_heads: int, skv: int,
                   cudnn_version: int) -> bool:
    if cudnn_version < 90000 or (p.dropout_p > 0 and 91100 < cudnn_version < 91400):
        return False
    dtypes = _LOW_PRECISION if cc[0] >= 8 else (torch.float16,)
    if not (p.layout_ok and p.dtype in dtypes and not p.mask_requires_grad
            and (8, 0) <= cc <= (12, 1) and p.dropout_p * 16 == math.floor(p.dropout_p * 16)):
        return False
    if not (_heads_ok(p, kv_heads) and p.seq_len_q > 0 and skv > 0
            and p.batch_size <= 65535 and p.num_heads <= 65535):
        return False
    sm90_or_sm10x = cc == (9, 0) or cc[0] == 10
    supports_d256 = (sm90_or_sm10x and not (cc == (10, 7) and cudnn_version <= 92500)
                     and cudnn_version > 92200)
    limit = 128
    if supports_d256:
        limit = 256
    elif sm90_or_sm10x and cudnn_version >= 91100 and (p.head_dim, dv) == (192, 128):
        limit = 192
    if not (p.head_dim <= limit and dv <= limit and p.head_dim % 8 == 0 and dv % 8 == 0):
        return False
    if skv == 1 or (p.dropout_p != 0.0 and p.seq_len_q == 1):
        return False
    if p.requires_grad and supports_d256:
        return ((p.head_dim <= 128 and dv <= 128) or (p.head_dim, dv) in ((192, 128), (256, 256)))
    return True


def choose_sdpa_backend(compute_capability: tuple[int, int], problem: SdpaProblem, *,
                        cudnn_version: int = 0) -> SdpaBackend:
    """The kernel CUDA's ``F.scaled_dot_product_attention`` runs for ``problem``.

    Follows ``select_sdp_backend`` in ``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp``
    (torch 2.14, CUDA, not ROCm): the first usable backend in the priority order
    flash, efficient, math, cudnn, with cuDNN moved first when ``priority_order``
    prefers it (sm90 and sm10x with cuDNN newer than 9.15.0). Assumes all backends
    enabled (``torch.backends.cuda.enable_*_sdp``), non-deterministic algorithms, and
    masks of the documented broadcastable shapes.

    Args:
        compute_capability: ``(major, minor)`` of the target GPU, e.g. ``(8, 0)`` for A100.
        problem: the call, see :class:`SdpaProblem`.
        cudnn_version: runtime cuDNN version as ``torch.backends.cudnn.version()``
            reports it (e.g. 92400 for 9.24); 0 rules cuDNN attention out.

    Returns:
        The backend.

    Example:
        >>> import torch
        >>> choose_sdpa_backend((8, 0), SdpaProblem(dtype=torch.float16, head_dim=64))
        <SdpaBackend.FLASH: 'flash'>
        >>> choose_sdpa_backend((7, 5), SdpaProblem(dtype=torch.float16, head_dim=64))
        <SdpaBackend.EFFICIENT: 'efficient'>
    """
    cc = tuple(compute_capability)
    dv = problem.head_dim if problem.head_dim_v is None else problem.head_dim_v
    kv_heads = problem.num_heads if problem.num_kv_heads is None else problem.num_kv_heads
    skv = problem.seq_len_q if problem.seq_len_kv is None else problem.seq_len_kv
    args = (cc, problem, dv, kv_heads, skv)
    if cudnn_version > 91500 and cc[0] in (9, 10) and _can_use_cudnn(*args, cudnn_version):
        return SdpaBackend.CUDNN
    if _can_use_flash(*args):
        return SdpaBackend.FLASH
    if _can_use_efficient(*args):
        return SdpaBackend.EFFICIENT
    return SdpaBackend.MATH


# ---------------------------------------------------------------------------------------
# Emulated kernels
# ---------------------------------------------------------------------------------------


def _has_values(tensor: torch.Tensor) -> bool:
    """False for fake and meta tensors, whose values cannot be computed or read."""
    from torch._subclasses.fake_tensor import is_fake

    return not (tensor.is_meta or is_fake(tensor))


def _values_context() -> contextlib.AbstractContextManager:
    """Where an emulated kernel computes real values: no function mode sees its ops."""
    return torch._C.DisableTorchFunction()


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _bool_mask_to_bias(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``convert_boolean_attn_mask`` (attention.cpp): -inf where the mask is False."""
    zero = torch.zeros((), dtype=dtype, device=mask.device)
    return torch.where(mask.logical_not(), -math.inf, zero)


def _efficient_bias(bias: torch.Tensor, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """``preprocess_mask`` (attention.cpp): expand to 4-D, pad rows to 16 elements."""
    batch, heads, seq_q, _ = query.shape
    seq_kv = key.size(-2)
    expanded = bias.expand(batch, heads, seq_q, seq_kv)
    if expanded.stride(-2) % 16 == 0:
        return expanded
    padded = torch.nn.functional.pad(expanded, (0, 16 - seq_kv % 16))
    return padded[..., :seq_kv]


def math_attention_before_2_5(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                              bias: torch.Tensor | None, dropout_p: float, is_causal: bool,
                              scale: float | None) -> torch.Tensor:
    """torch < 2.5's math attention, in the inputs' dtype.

    ``_scaled_dot_product_attention_math`` in aten/src/ATen/native/transformers/
    attention.cpp as torch 2.0-2.4 ship it: ``q * sqrt(scale)`` and ``k.T * sqrt(scale)``,
    their ``matmul``, the additive mask added in place (``attn.add_(*attn_mask)``; the
    out-of-place ``add`` only for tensor subclasses), ``at::_softmax`` over the last
    dimension, dropout, and the ``matmul`` with ``v``, all in q's dtype. From 2.5 the
    installed kernel differs: it casts fp16/bf16 inputs to float32 first
    (pytorch/pytorch#128922, :attr:`batchfit.engine.stack.Stack.math_sdpa_upcasts`) and
    its softmax is ``_safe_softmax`` (zeros for fully masked rows), whose mask and
    ``where`` are more ``seq x seq`` temporaries. A causal call builds the lower-triangular
    boolean mask and turns it into an additive one (``convert_boolean_attn_mask``).
    """
    factor = math.sqrt(1.0 / math.sqrt(query.size(-1)) if scale is None else scale)
    if is_causal:
        causal = torch.ones(query.size(-2), key.size(-2), dtype=torch.bool,
                            device=query.device).tril()
        bias = _bool_mask_to_bias(causal, query.dtype)
    scaled_query = query * factor
    attn = torch.matmul(scaled_query, key.transpose(-2, -1) * factor)
    if bias is not None:
        attn.add_(bias)
    attn = torch.softmax(attn, -1)
    if dropout_p > 0.0:
        attn = torch.nn.functional.dropout(attn, dropout_p, training=True)
    return torch.matmul(attn, value)


def _math_attention(query, key, value, bias, is_causal, scale, enable_gqa):
    return torch.ops.aten._scaled_dot_product_attention_math(
        query, key, value, bias, 0.0, is_causal, None, scale=scale, enable_gqa=enable_gqa)[0]


#: Callbacks told of every fused attention call (:func:`watching_fused_attention`).
_WATCHERS: list[Any] = []


@contextlib.contextmanager
def watching_fused_attention(callback: Any) -> Any:
    """Call ``callback(backend, backward, inputs, outputs)`` for every fused attention
    kernel the emulation runs while inside: ``inputs`` are (query, key, value) forward and
    (grad_out, query, key, value, out, lse) backward, ``outputs`` (out, lse) and (dq, dk, dv).
    On fake tensors the emulated kernel runs no arithmetic op, so an observer that counts
    work (:mod:`batchfit.speed.op_costs`) learns of the kernel here."""
    _WATCHERS.append(callback)
    try:
        yield
    finally:
        _WATCHERS.remove(callback)


class _FusedAttention(torch.autograd.Function):
    """Flash, memory-efficient or cuDNN attention, as far as memory goes.

    Forward allocates the output in the kernels' ``(batch, seq, heads, dim)`` layout
    (returned transposed, so a following ``transpose(1, 2).reshape`` is a view, as on
    the GPU) and a float32 log-sum-exp (flash: ``(B, H, Sq)``; efficient: padded to a
    multiple of 32; cuDNN: ``(B, H, Sq, 1)``), and saves q, k, v, out, lse and, for
    efficient and cuDNN, the additive mask; efficient attention with 16-bit inputs and a
    head dimension past 128 also allocates a float32 output accumulator for the call
    (:func:`_efficient_forward_accumulator`). Backward allocates dq, dk, dv and the
    kernel's temporaries: flash ``softmax_d`` ``(B, H, Sq128)`` and ``dq_accum``
    ``(B, Sq128, H, D32)`` in float32 plus expanded dk/dv for GQA (flash_api.cpp,
    ``mha_bwd``); efficient a float32 ``delta`` ``(B, H, Sq)`` and, approximating its
    workspace, a float32 dq accumulator. cuDNN's workspace is not modelled.

    On tensors with values the output and gradients are computed through the math
    path (without dropout); on fake tensors nothing is computed.
    """

    @staticmethod
    def forward(ctx, query, key, value, bias, is_causal, scale, enable_gqa, backend):
        batch, heads, seq_q, _ = query.shape
        needs_lse = any(ctx.needs_input_grad[:3])
        if backend is SdpaBackend.EFFICIENT:
            lse_shape = (batch, heads, _round_up(seq_q, 32) if needs_lse else 0)
        elif backend is SdpaBackend.CUDNN:
            lse_shape = (batch, heads, seq_q, 1)
        else:
            lse_shape = (batch, heads, seq_q)
        _ALLOCATING.append(backend)  # the kernel's outputs (emulated_attention_kernel)
        try:
            out = query.new_empty(batch, seq_q, heads, value.size(-1))
            # Only its memory matters: backward recomputes through the math path.
            lse = query.new_empty(lse_shape, dtype=torch.float32)
        finally:
            _ALLOCATING.pop()
        # The memory-efficient kernel for head dims past 128 keeps its float32 partial
        # output in global memory for the call (_efficient_forward_accumulator).
        accumulator = _efficient_forward_accumulator(backend, query, key, value)
        out = out.transpose(1, 2)
        if _has_values(query):
            with _values_context():
                out.copy_(_math_attention(query, key, value, bias, is_causal, scale,
                                          enable_gqa))
        del accumulator
        for watch in _WATCHERS:
            watch(backend, False, (query, key, value), (out, lse))
        kept_bias = bias if backend is not SdpaBackend.FLASH else None
        ctx.save_for_backward(query, key, value, out, lse, kept_bias)
        ctx.options = (is_causal, scale, enable_gqa, backend)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, _out, _lse, bias = ctx.saved_tensors
        is_causal, scale, enable_gqa, backend = ctx.options
        grads = [torch.empty_like(t) for t in (query, key, value)]
        scratch = _backward_scratch(backend, query, key)
        if _has_values(query):
            with torch.enable_grad(), _values_context():
                inputs = [t.detach().requires_grad_() for t in (query, key, value)]
                result = _math_attention(*inputs, bias, is_causal, scale, enable_gqa)
                for grad, computed in zip(grads, torch.autograd.grad(result, inputs, grad_out)):
                    grad.copy_(computed)
        del scratch
        for watch in _WATCHERS:
            watch(backend, True, (grad_out, query, key, value, _out, _lse), tuple(grads))
        needs = ctx.needs_input_grad
        return (*(g if need else None for g, need in zip(grads, needs)),
                None, None, None, None, None)


#: The largest head dimension the memory-efficient forward kernels that keep the output
#: in registers take (``kMaxK`` of ``fmha_cutlassF_*_64x128_rf_*``/``32x128_rf``; the next,
#: ``*_32x128_gmem_*``, has ``kMaxK`` 65536).
EFFICIENT_RF_MAX_HEAD_DIM = 128


def _efficient_forward_accumulator(backend: SdpaBackend, query: torch.Tensor,
                                   key: torch.Tensor, value: torch.Tensor) -> torch.Tensor | None:
    """The float32 output accumulator memory-efficient attention's forward allocates for
    16-bit inputs with a head dimension past 128, freed when the call returns (None when
    it allocates none).

    ``_efficient_attention_forward`` (aten/src/ATen/native/transformers/cuda/attention.cu)
    launches the first kernel of ``dispatch_cutlassF_<dtype>_sm<arch>``
    (mem_eff_attention/kernels/cutlassF.h) whose ``kMaxK`` covers the key's and the value's
    head dimensions: ``64x64_rf`` (64), ``64x128_rf`` (128; ``32x128_rf`` before sm80),
    then ``32x128_gmem`` (65536). For that last one ``kSingleValueIteration`` (``kMaxK <=
    kKeysPerBlock``: 65536 > 128) and so ``kKeepOutputInRF`` are false and, where its
    ``output_accum_t`` (float) is not its ``output_t`` (half or bfloat16),
    ``kNeedsOutputAccumulatorBuffer`` is true
    (mem_eff_attention/kernel_forward.h): the call allocates ``output_accum =
    at::empty({B, M, num_heads, Kv}, float)`` after the output and the log-sum-exp, a local
    that dies when the call returns. float32 inputs accumulate in their output."""
    if (backend is not SdpaBackend.EFFICIENT or query.dtype not in _LOW_PRECISION
            or max(key.size(-1), value.size(-1)) <= EFFICIENT_RF_MAX_HEAD_DIM):
        return None
    batch, heads, seq_q, _ = query.shape
    return torch.empty(batch, seq_q, heads, value.size(-1), dtype=torch.float32,
                       device=query.device)


def _backward_scratch(backend: SdpaBackend, query: torch.Tensor,
                      key: torch.Tensor) -> list[torch.Tensor]:
    batch, heads, seq_q, head_dim = query.shape
    f32 = {"dtype": torch.float32, "device": query.device}
    if backend is SdpaBackend.FLASH:
        seq_q128 = _round_up(seq_q, 128)
        head_dim_rounded = _round_up(head_dim, 32) if head_dim <= 192 else 256
        scratch = [torch.empty(batch, heads, seq_q128, **f32),
                   torch.empty(batch, seq_q128, heads, head_dim_rounded, **f32)]
        if key.size(1) != heads:  # GQA: dk and dv are computed per query head, then summed
            scratch += [query.new_empty(batch, key.size(2), heads, head_dim) for _ in range(2)]
        return scratch
    if backend is SdpaBackend.EFFICIENT:
        return [torch.empty(batch, heads, seq_q, **f32),
                torch.empty(batch, seq_q, heads, head_dim, **f32)]
    return []


_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale",
              "enable_gqa")
_SDPA_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None,
                  "enable_gqa": False}


def _sdpa_arguments(args: tuple, kwargs: dict) -> dict[str, Any]:
    bound = dict(_SDPA_DEFAULTS)
    bound.update(zip(_SDPA_ARGS, args))
    bound.update(kwargs)
    return bound
