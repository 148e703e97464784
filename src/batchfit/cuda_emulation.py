"""Emulate, on CPU (real or fake) tensors, what a CUDA device does differently.

A trace runs on the CPU, where these differ from the GPU the user asks about,
and all of them change memory:

* **Autocast.** ``torch.autocast("cuda")`` is silently disabled without CUDA,
  and CPU autocast casts a different op list. :class:`CudaEmulation` applies
  CUDA's policy instead (``aten/src/ATen/autocast_mode.h``, the
  ``AT_FORALL_*`` lists, plus ``cudnn/AutocastRNN.cpp``), including its cache of
  low-precision copies of fp32 parameters, which live until the outermost
  autocast region exits.
* **Attention kernels.** On the CPU ``F.scaled_dot_product_attention`` runs the
  CPU flash kernel or, with dropout or inputs it cannot take, the math path,
  which saves the ``seq x seq`` attention matrix. A GPU picks flash,
  memory-efficient, cuDNN or math attention by the rules of
  ``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp``
  (:func:`choose_sdpa_backend`); the fused ones save only the output and a
  float32 log-sum-exp. The emulation runs what the chosen CUDA kernel saves, and
  allocates in backward (:class:`_FusedAttention`), or CUDA's math path.
* **Other kernels.** ``rms_norm`` is one fused kernel on CUDA and a chain of
  saved intermediates on the CPU (:class:`_FusedRmsNorm`); CUDA's
  ``softmax(half, dtype=float32)`` reads fp16 without an fp32 copy.

How it works. A :class:`~torch.overrides.TorchFunctionMode` sits above autograd,
where the real ``Autocast`` dispatch key sits, so its casts are recorded by
autograd and the low-precision copies are what backward saves. The emulated
region *is* CPU autocast state: :meth:`CudaEmulation.autocast_region` enters
``torch.autocast("cpu", dtype)``, and while the emulation is active any enabled
CPU autocast means "CUDA autocast with that dtype". The mode runs each op with
CPU autocast's own kernels switched off, so only CUDA's policy applies. Because
the state is torch's own, everything that saves and restores autocast state
keeps working: ``torch.utils.checkpoint`` (both variants) recomputes under the
state it captured in forward, so recomputation is cast exactly like the forward
pass, and model code that disables autocast locally
(``torch.autocast(x.device.type, enabled=False)``) is honoured.

Python-level composites (``F.multi_head_attention_forward``, ``torch.einsum``,
``F.interpolate``...) reach a function mode as one call; real autocast acts on
the aten ops inside them. The mode therefore runs such a function's body with
itself re-enabled (a copy of the function whose ``has_torch_function`` checks
answer False), so every op inside is seen. C++ composites are opaque: the ones
that reach listed ops inside (``cross_entropy_loss``, ``nll_loss_nd``,
``pairwise_distance``, the RNNs) have rules here; any other one found, while a region is active, to reach a
listed op with inputs the policy would have cast is named in
:attr:`CudaEmulation.unsupported`.

Known limitations:
    * A CPU autocast region that was not entered through
      :meth:`~CudaEmulation.autocast_region` (a checkpoint recomputation, or the
      user's own ``torch.autocast("cpu")``) has no exit the emulation can see:
      its weight copies are cached weakly (a copy lives as long as something,
      usually autograd, holds it) instead of until the region exits.
    * ``torch.autocast("cuda", ...)`` written into model code stays a no-op, as
      on any machine without CUDA. (Inside a region CUDA's autocast *state* is set,
      so code that asks ``torch.is_autocast_enabled()`` sees what it would on a GPU.)
    * Substituted attention computes values without dropout (memory is the
      same: fused kernels keep only an RNG seed); a trainable ``attn_mask`` and
      nested tensors use the math path. cuDNN attention's workspace and the
      memory-efficient kernel's backward workspace are approximated (see
      :class:`_FusedAttention`).
    * ``rms_norm`` runs as CUDA's fused kernel (:class:`_FusedRmsNorm`); the backward's
      partial-sum buffers for the weight gradient are not modelled.
    * ``softmax``/``log_softmax`` of fp16 with ``dtype=float32`` skip the fp32
      input copy, as CUDA's kernel does, only on fake or meta tensors (CPU
      kernels cannot); on real CPU tensors a transient copy remains.
    * cudnn RNNs cast their weights into one new flat buffer per call; here the
      cached per-parameter copies stand in for it.

Torch-private APIs used (kept in this file): ``torch._subclasses.fake_tensor.is_fake``,
``torch.utils._python_dispatch.TorchDispatchMode``, ``torch._C`` dispatcher
queries and the aten ops ``_scaled_dot_product_attention_math`` and
``_softmax``/``_log_softmax``.
"""

from __future__ import annotations

import contextlib
import math
import types
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Self

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = [
    "CUDA_AUTOCAST_POLICY",
    "CastPolicy",
    "CudaEmulation",
    "SdpaBackend",
    "SdpaProblem",
    "choose_sdpa_backend",
]

# ---------------------------------------------------------------------------------------
# Knowledge: CUDA's autocast op lists
# ---------------------------------------------------------------------------------------


class CastPolicy(StrEnum):
    """What CUDA autocast does to an op's floating inputs (``CastPolicy`` in autocast_mode.h)."""

    LOWER_PRECISION = "lower_precision"  # cast every floating input to the autocast dtype
    FP32 = "fp32"  # cast every floating input to float32
    FP32_SET_OPT_DTYPE = "fp32_set_opt_dtype"  # no cast; dtype=float32 unless the caller set one
    PROMOTE = "promote"  # cast to the widest floating input dtype
    BANNED = "banned"  # raises under autocast


_LOWER_PRECISION_OPS = (
    # AT_FORALL_LOWER_PRECISION_FP, plus cudnn_convolution(_transpose) registered beside it
    "_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d",
    "conv_transpose2d", "conv_transpose3d", "convolution", "cudnn_convolution",
    "cudnn_convolution_transpose", "prelu", "addmm", "addmv", "addr", "matmul", "einsum",
    "mm", "mv", "linalg_vecdot", "linear", "addbmm", "baddbmm", "bmm", "chain_matmul",
    "linalg_multi_dot", "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell", "lstm_cell",
    "gru_cell", "rnn_tanh_cell", "rnn_relu_cell", "_scaled_dot_product_flash_attention",
    "scaled_dot_product_attention",
    # cudnn/AutocastRNN.cpp
    "_cudnn_rnn",
)
_FP32_OPS = (
    # AT_FORALL_FP32
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p",
    "reciprocal", "rsqrt", "sinh", "tan", "pow", "softplus", "layer_norm", "native_layer_norm",
    "group_norm", "frobenius_norm", "nuclear_norm", "cosine_similarity", "poisson_nll_loss",
    "cosine_embedding_loss", "nll_loss", "nll_loss2d", "hinge_embedding_loss", "kl_div",
    "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss", "margin_ranking_loss",
    "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss", "multi_margin_loss",
    "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm", "logsumexp",
    "upsample_nearest1d", "_upsample_nearest_exact1d", "upsample_nearest2d",
    "_upsample_nearest_exact2d", "upsample_nearest3d", "_upsample_nearest_exact3d",
    "upsample_linear1d", "upsample_bilinear2d", "_upsample_bilinear2d_aa",
    "upsample_trilinear3d", "upsample_bicubic2d", "_upsample_bicubic2d_aa",
    # registered for AutocastCUDA in torch 2.14 (the float32 group of the dispatcher)
    "rms_norm", "linalg_matrix_sqrth",
)
_FP32_SET_OPT_DTYPE_OPS = (
    # AT_FORALL_FP32_SET_OPT_DTYPE
    "prod", "softmax", "log_softmax", "cumprod", "cumsum", "linalg_vector_norm",
    "linalg_matrix_norm", "sum",
    # AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE (fp32_append_dtype): same effect, norm
    # overloads without a dtype get dtype=float32
    "norm",
)
_PROMOTE_OPS = (
    # AT_FORALL_PROMOTE (cat and stack left the list: they type-promote by themselves)
    "addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler",
    "index_put", "tensordot", "scatter_add",
)
# Builtins whose aten op is a C++ composite that reaches listed ops inside, where a
# function mode cannot see: the policy of what they reach, applied at their level.
_OPAQUE_COMPOSITES = {
    "lstm": CastPolicy.LOWER_PRECISION,  # -> _cudnn_rnn
    "gru": CastPolicy.LOWER_PRECISION,
    "rnn_tanh": CastPolicy.LOWER_PRECISION,
    "rnn_relu": CastPolicy.LOWER_PRECISION,
    "nll_loss_nd": CastPolicy.FP32,  # -> nll_loss / nll_loss2d
    "special_softmax": CastPolicy.FP32_SET_OPT_DTYPE,  # -> softmax(dtype)
    "special_log_softmax": CastPolicy.FP32_SET_OPT_DTYPE,
}

#: CUDA autocast's policy by aten op name (overloads share their op's policy).
CUDA_AUTOCAST_POLICY: Mapping[str, CastPolicy] = types.MappingProxyType({
    **{name: CastPolicy.LOWER_PRECISION for name in _LOWER_PRECISION_OPS},
    **{name: CastPolicy.FP32 for name in _FP32_OPS},
    **{name: CastPolicy.FP32_SET_OPT_DTYPE for name in _FP32_SET_OPT_DTYPE_OPS},
    **{name: CastPolicy.PROMOTE for name in _PROMOTE_OPS},
    "binary_cross_entropy": CastPolicy.BANNED,
})
_POLICY = {**CUDA_AUTOCAST_POLICY, **_OPAQUE_COMPOSITES}

_BANNED_MESSAGE = (  # the message of binary_cross_entropy_banned in autocast_mode.cpp
    "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast.\n"
    "Many models use a sigmoid layer right before the binary cross entropy layer.\n"
    "In this case, combine the two layers using "
    "torch.nn.functional.binary_cross_entropy_with_logits\n"
    "or torch.nn.BCEWithLogitsLoss.  binary_cross_entropy_with_logits and BCEWithLogits are\n"
    "safe to autocast.")

#: Devices whose tensors stand in for CUDA tensors.
_EMULATED_DEVICES = frozenset({"cpu", "meta"})
_LOW_PRECISION = (torch.float16, torch.bfloat16)


def _eligible(value: Any) -> bool:
    """``is_eligible`` in autocast_mode.h: a floating, non-double tensor on the device."""
    return (isinstance(value, torch.Tensor) and value.is_floating_point()
            and value.dtype is not torch.float64 and value.device.type in _EMULATED_DEVICES)


def _map_tensors(fn: Callable[[torch.Tensor], Any], value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(_map_tensors(fn, item) for item in value)
    return value


def _iter_tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _iter_tensors(item)


def _promote_type(args: tuple, kwargs: dict, lower: torch.dtype) -> torch.dtype:
    """``promote_type`` in autocast_mode.h: float32 wins over the autocast dtype."""
    current = lower
    for tensor in _iter_tensors((args, tuple(kwargs.values()))):
        if not _eligible(tensor):
            continue
        if current is torch.float32 or tensor.dtype is torch.float32:
            current = torch.float32
        elif tensor.dtype is not lower:
            raise RuntimeError("Unexpected floating ScalarType in at::autocast::prioritize")
    return current


def _dtype_given(args: tuple, kwargs: dict) -> bool:
    if kwargs.get("dtype") is not None:
        return True
    # Positionally, a torch.dtype can only be the op's dtype argument.
    return any(isinstance(arg, torch.dtype) for arg in args)


def _is_out_variant(kwargs: dict) -> bool:
    return kwargs.get("out") is not None


def _op_name(func: Any) -> str | None:
    """The aten op name a torch callable dispatches to, or None."""
    if isinstance(func, torch._ops.OpOverload):
        if func.namespace != "aten" or any(a.is_out for a in func._schema.arguments):
            return None
        return func._schema.name.split("::", 1)[1]
    if isinstance(func, torch._ops.OpOverloadPacket):
        namespace, _, name = func._qualified_op_name.partition("::")
        return name if namespace == "aten" else None
    name = getattr(func, "__name__", None)
    return name if isinstance(name, str) else None


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


def _math_attention(query, key, value, bias, is_causal, scale, enable_gqa):
    return torch.ops.aten._scaled_dot_product_attention_math(
        query, key, value, bias, 0.0, is_causal, None, scale=scale, enable_gqa=enable_gqa)[0]


class _FusedAttention(torch.autograd.Function):
    """Flash, memory-efficient or cuDNN attention, as far as memory goes.

    Forward allocates the output in the kernels' ``(batch, seq, heads, dim)`` layout
    (returned transposed, so a following ``transpose(1, 2).reshape`` is a view, as on
    the GPU) and a float32 log-sum-exp (flash: ``(B, H, Sq)``; efficient: padded to a
    multiple of 32; cuDNN: ``(B, H, Sq, 1)``), and saves q, k, v, out, lse and, for
    efficient and cuDNN, the additive mask. Backward allocates dq, dk, dv and the
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
        out = query.new_empty(batch, seq_q, heads, value.size(-1)).transpose(1, 2)
        needs_lse = any(ctx.needs_input_grad[:3])
        if backend is SdpaBackend.EFFICIENT:
            lse_shape = (batch, heads, _round_up(seq_q, 32) if needs_lse else 0)
        elif backend is SdpaBackend.CUDNN:
            lse_shape = (batch, heads, seq_q, 1)
        else:
            lse_shape = (batch, heads, seq_q)
        # Only its memory matters: backward recomputes through the math path.
        lse = query.new_empty(lse_shape, dtype=torch.float32)
        if _has_values(query):
            with _values_context():
                out.copy_(_math_attention(query, key, value, bias, is_causal, scale,
                                          enable_gqa))
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
        needs = ctx.needs_input_grad
        return (*(g if need else None for g, need in zip(grads, needs)),
                None, None, None, None, None)


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


class _FusedRmsNorm(torch.autograd.Function):
    """CUDA's ``_fused_rms_norm`` (layer_norm.cpp routes ``rms_norm`` there when the weight
    has the input's dtype): saves input, weight and a float32 ``rstd`` with the
    normalized dimensions kept as 1, where the CPU decomposition saves intermediates."""

    @staticmethod
    def forward(ctx, input, normalized_shape, weight, eps):
        dims = tuple(range(-len(normalized_shape), 0))
        rstd_shape = input.shape[:input.dim() - len(dims)] + (1,) * len(dims)
        if _has_values(input):
            with _values_context():
                out = torch.rms_norm(input, normalized_shape, weight, eps)
                eps_value = torch.finfo(input.dtype).eps if eps is None else eps
                rstd = torch.rsqrt(input.float().pow(2).mean(dims, keepdim=True) + eps_value)
        else:
            out = torch.empty_like(input)
            rstd = input.new_empty(rstd_shape, dtype=torch.float32)
        ctx.save_for_backward(input, weight, rstd)
        ctx.options = (normalized_shape, eps)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        input, weight, _rstd = ctx.saved_tensors
        normalized_shape, eps = ctx.options
        grad_input = torch.empty_like(input)
        grad_weight = torch.empty_like(weight) if weight is not None else None
        if _has_values(input):
            with torch.enable_grad(), _values_context():
                inputs = [t.detach().requires_grad_() for t in (input, weight) if t is not None]
                result = torch.rms_norm(inputs[0], normalized_shape,
                                        inputs[1] if weight is not None else None, eps)
                computed = torch.autograd.grad(result, inputs, grad_out)
            grad_input.copy_(computed[0])
            if grad_weight is not None:
                grad_weight.copy_(computed[1])
        needs = ctx.needs_input_grad
        return (grad_input if needs[0] else None, None,
                grad_weight if needs[2] else None, None)


def _rms_norm(func: Callable, args: tuple, kwargs: dict) -> torch.Tensor:
    call = dict(zip(("input", "normalized_shape", "weight", "eps"), args))
    call.update(kwargs)
    input, weight = call["input"], call.get("weight")
    if weight is not None and weight.dtype != input.dtype:
        return func(*args, **kwargs)  # CUDA too decomposes when the dtypes differ
    return _FusedRmsNorm.apply(input, list(call["normalized_shape"]), weight, call.get("eps"))


_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale",
              "enable_gqa")
_SDPA_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None,
                  "enable_gqa": False}


def _sdpa_arguments(args: tuple, kwargs: dict) -> dict[str, Any]:
    bound = dict(_SDPA_DEFAULTS)
    bound.update(zip(_SDPA_ARGS, args))
    bound.update(kwargs)
    return bound


def _cross_entropy_loss(input, target, weight=None, reduction=1, ignore_index=-100,
                        label_smoothing=0.0):
    """``cross_entropy_loss_symint`` (LossNLL.cpp) in Python, so autocast sees its parts.

    On CUDA the log-softmax keeps the input dtype (it is given ``dtype=input.dtype``)
    and ``nll_loss`` then casts it to float32: both copies are saved for backward.
    """
    class_dim = 0 if input.dim() == 1 else 1
    n_classes = input.size(class_dim)
    log_probs = torch.log_softmax(input, class_dim, dtype=input.dtype)
    shape = [1] * input.dim()
    shape[class_dim] = n_classes
    if input.shape == target.shape:  # class probabilities
        if label_smoothing > 0.0:
            target = target * (1 - label_smoothing) + label_smoothing / n_classes
        product = log_probs * target
        if weight is not None:
            product = product * weight.view(shape)
        if reduction == 0:
            return -product.sum(class_dim)
        return -product.sum() if reduction == 2 else -product.sum() / (input.numel() / n_classes)
    nll = torch._C._nn.nll_loss_nd(log_probs, target, weight, reduction, ignore_index)
    if label_smoothing <= 0.0:
        return nll
    weighted = log_probs if weight is None else log_probs * weight.view(shape)
    smooth = -weighted.sum(class_dim)
    ignored = target == ignore_index
    smooth.masked_fill_(ignored, 0.0)
    if reduction == 1:
        if weight is not None:
            denominator = weight.gather(0, target.masked_select(~ignored).flatten()).sum()
        else:
            denominator = (~ignored).sum()
        smooth = smooth.sum() / denominator
    elif reduction == 2:
        smooth = smooth.sum()
    return (1 - label_smoothing) * nll + smooth * (label_smoothing / n_classes)


def _pairwise_distance(x1, x2, p=2.0, eps=1e-6, keepdim=False):
    """``pairwise_distance`` (Distance.cpp): a norm (float32 under autocast) of x1 - x2 + eps."""
    return torch.norm(x1 - x2 + eps, p, max(x1.dim(), x2.dim()) - 1, keepdim)


_COMPOSITE_RULES: dict[str, Callable[..., Any]] = {
    "cross_entropy_loss": _cross_entropy_loss,
    "pairwise_distance": _pairwise_distance,
}


# ---------------------------------------------------------------------------------------
# Interception
# ---------------------------------------------------------------------------------------

_CHECK_NAMES = ("has_torch_function", "has_torch_function_unary", "has_torch_function_variadic")


def _never(*_args: Any) -> bool:
    return False


def _looks_inside(func: types.FunctionType) -> bool:
    """Whether running ``func`` opaquely could hide listed ops worth reporting.

    ``boolean_dispatch`` wrappers (``F.max_pool2d`` and friends) only choose between
    pooling functions, which reach no listed op.
    """
    return not func.__qualname__.startswith("boolean_dispatch.")


class _InterceptMode(TorchFunctionMode):
    """Hands every torch call to :meth:`CudaEmulation._handle`; nothing else."""

    def __init__(self, emulation: CudaEmulation):
        super().__init__()
        self.emulation = emulation

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return self.emulation._handle(func, args, kwargs or {})


class _ListedOpWatcher(TorchDispatchMode):
    """Finds listed aten ops that an opaque C++ composite reaches with castable inputs."""

    def __init__(self, lower: torch.dtype):
        super().__init__()
        self.lower = lower
        self.hits: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _op_name(func)
        if name is not None and _would_cast(_POLICY.get(name), args, kwargs, self.lower):
            self.hits.add(f"aten::{name}")
        return func(*args, **kwargs)


def _would_cast(policy: CastPolicy | None, args: tuple, kwargs: dict,
                lower: torch.dtype) -> bool:
    tensors = [t for t in _iter_tensors((args, tuple(kwargs.values()))) if _eligible(t)]
    if policy is CastPolicy.LOWER_PRECISION:
        return any(t.dtype is not lower for t in tensors)
    if policy is CastPolicy.FP32:
        return any(t.dtype is not torch.float32 for t in tensors)
    if policy is CastPolicy.FP32_SET_OPT_DTYPE:
        return (bool(args) and _eligible(args[0]) and args[0].dtype is not torch.float32
                and not _dtype_given(args, kwargs))
    if policy is CastPolicy.PROMOTE:
        return len({t.dtype for t in tensors}) > 1
    return False


class _CastCache:
    """CUDA's ``cached_cast`` cache: one low-precision copy per fp32 leaf per region.

    Copies made in a region the emulation entered are held until it exits, as torch
    holds them; copies made in other CPU autocast regions (checkpoint recomputation),
    whose exit cannot be seen, are held weakly.
    """

    def __init__(self) -> None:
        self._held: dict[tuple[int, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}
        self._weak: dict[tuple[int, torch.dtype], tuple[weakref.ref, weakref.ref]] = {}

    def __len__(self) -> int:
        return len(self._held) + sum(1 for _, copy in self._weak.values() if copy() is not None)

    def get(self, source: torch.Tensor, dtype: torch.dtype, hold: bool) -> torch.Tensor:
        key = (id(source), dtype)
        held = self._held.get(key)
        if held is not None and held[0] is source:
            return held[1]
        refs = self._weak.get(key)
        copy = refs[1]() if refs is not None and refs[0]() is source else None
        if copy is None:
            copy = source.to(dtype)
        if hold:
            self._held[key] = (source, copy)
        else:
            self._weak[key] = (weakref.ref(source), weakref.ref(copy))
        return copy

    def clear(self) -> None:
        self._held.clear()
        self._weak.clear()


class CudaEmulation:
    """Run a step on CPU (real or fake) tensors the way a CUDA device would run it.

    Enter it around the whole step (forward, backward, optimizer); open
    :meth:`autocast_region` where the real step would use ``torch.autocast("cuda")``.
    Inside, CUDA's autocast policy replaces CPU autocast, and
    ``F.scaled_dot_product_attention`` runs the kernel the target GPU would pick
    (see the module docstring for how, and for the known limitations).

    Args:
        compute_capability: ``(major, minor)`` of the target GPU, e.g. ``(8, 0)``.
        autocast_dtype: ``torch.float16`` or ``torch.bfloat16`` for mixed precision;
            None for none (then :meth:`autocast_region` does nothing).
        sdpa: substitute the target's attention kernel.
        cudnn_version: runtime cuDNN version on the target (e.g. 92400); None means the
            one this torch was built with.

    Attributes:
        unsupported: calls whose CUDA behaviour the emulation could not reproduce,
            one line each, in the order first seen.
        sdpa_backends: how many attention calls went to each backend.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))
        >>> x = torch.randn(4, 8)
        >>> with CudaEmulation((8, 0), autocast_dtype=torch.float16) as emu:
        ...     with emu.autocast_region():
        ...         hidden = model[0](x)
        ...         out = model[1](hidden)
        ...         loss = out.sum()
        ...     loss.backward()
        >>> hidden.dtype, out.dtype, model[0].weight.grad.dtype
        (torch.float16, torch.float32, torch.float32)
    """

    def __init__(self, compute_capability: tuple[int, int],
                 autocast_dtype: torch.dtype | None = None, sdpa: bool = True,
                 cudnn_version: int | None = None):
        if (not isinstance(compute_capability, tuple) or len(compute_capability) != 2
                or not all(isinstance(v, int) and v >= 0 for v in compute_capability)):
            raise ValueError(f"compute_capability must be (major, minor), "
                             f"not {compute_capability!r}")
        if autocast_dtype is not None and autocast_dtype not in _LOW_PRECISION:
            raise ValueError(f"autocast_dtype must be torch.float16, torch.bfloat16 or None, "
                             f"not {autocast_dtype!r}")
        self.compute_capability = compute_capability
        self.autocast_dtype = autocast_dtype
        self.sdpa = sdpa
        if cudnn_version is None:
            cudnn_version = torch.backends.cudnn.version() or 0
        self.cudnn_version = cudnn_version
        self.unsupported: list[str] = []
        self.sdpa_backends: dict[SdpaBackend, int] = {}
        #: (extent, kernel, module) of the largest grid y/z dimension a fused kernel launches
        self.largest_grid: tuple[int, str, str] = (0, "", "")
        self.where: Callable[[], str] = lambda: ""  # the module running now (set by the tracer)
        self._mode: _InterceptMode | None = None
        self._region_depth = 0
        self._cache = _CastCache()
        self._unchecked: dict[Callable, Callable | None] = {}
        self._patched_globals: dict[int, dict] = {}
        self._composite_ops: dict[str, bool] = {}
        self._entering: Callable | None = None

    # -- public ---------------------------------------------------------------------------

    def __enter__(self) -> Self:
        if self._mode is not None:
            raise RuntimeError("this CudaEmulation is already active")
        self._mode = _InterceptMode(self)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc_info: object) -> None:
        mode, self._mode = self._mode, None
        try:
            if mode is not None:
                mode.__exit__(*exc_info)
        finally:
            self._cache.clear()

    @contextlib.contextmanager
    def autocast_region(self) -> Iterator[None]:
        """The region where the real step runs ``torch.autocast("cuda", autocast_dtype)``.

        Use it like ``torch.autocast``: forward and loss inside, ``backward()`` outside.
        Low-precision copies of fp32 parameters are cached here, one per parameter, and
        released when the outermost region exits (:attr:`cached_copies` counts them).

        Raises:
            RuntimeError: the emulation is not active (enter it first, for the whole step,
                so that backward and checkpoint recomputation run under it too).
        """
        if self.autocast_dtype is None:
            yield
            return
        if self._mode is None:
            raise RuntimeError("enter the CudaEmulation before its autocast region, for the "
                               "whole step: `with emu: with emu.autocast_region(): ...`")
        # Mirror CUDA's autocast state for code that asks (torch.is_autocast_enabled()).
        cuda_state = (torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"))
        self._region_depth += 1
        try:
            torch.set_autocast_enabled("cuda", True)
            torch.set_autocast_dtype("cuda", self.autocast_dtype)
            with torch.autocast("cpu", dtype=self.autocast_dtype):
                yield
        finally:
            torch.set_autocast_enabled("cuda", cuda_state[0])
            torch.set_autocast_dtype("cuda", cuda_state[1])
            self._region_depth -= 1
            if self._region_depth == 0:
                self._cache.clear()

    @property
    def cached_copies(self) -> int:
        """Low-precision parameter copies the autocast cache holds now."""
        return len(self._cache)

    # -- interception -----------------------------------------------------------------------

    def _handle(self, func: Callable, args: tuple, kwargs: dict) -> Any:
        entering, self._entering = self._entering, None
        if isinstance(func, types.FunctionType) and func is not entering:
            body = self._unchecked_copy(func)
            if body is not None:  # a Python composite: run it with the mode active inside
                self._entering = func
                try:
                    with self._mode:
                        return body(*args, **kwargs)
                finally:
                    self._entering = None
            if _looks_inside(func):
                self._note_in_region(f"{func.__module__}.{func.__qualname__}: a Python "
                                     f"function the emulation cannot look inside")
        # A builtin, or a Python function run as one: a Tensor method that overrides a
        # builtin of the same name and calls it (super().unflatten) comes back here from
        # its own body; a function whose torch-function check cannot be switched off.
        if not torch.is_autocast_enabled("cpu"):
            return self._run_op(func, args, kwargs, None)
        # CPU autocast stands for CUDA autocast: switch its own kernels off meanwhile.
        lower = torch.get_autocast_dtype("cpu")
        torch.set_autocast_enabled("cpu", False)
        try:
            return self._run_op(func, args, kwargs, lower)
        finally:
            torch.set_autocast_enabled("cpu", True)

    def _run_op(self, func: Callable, args: tuple, kwargs: dict,
                lower: torch.dtype | None) -> Any:
        """Run a builtin (or aten op); ``lower`` is the autocast dtype inside a region."""
        name = _op_name(func)
        if name is None or _is_out_variant(kwargs):
            return func(*args, **kwargs)
        policy = _POLICY.get(name) if lower is not None else None
        if policy is CastPolicy.BANNED:
            raise RuntimeError(_BANNED_MESSAGE)
        if lower is not None and name in _COMPOSITE_RULES:
            with self._mode, _cpu_autocast_on():
                return _COMPOSITE_RULES[name](*args, **kwargs)
        if policy is not None:
            args, kwargs = self._apply_policy(policy, args, kwargs, lower)
        if name == "scaled_dot_product_attention" and self.sdpa:
            return self._attention(func, args, kwargs)
        if name in ("softmax", "log_softmax"):
            return _softmax(func, name, args, kwargs)
        if name == "rms_norm":
            return _rms_norm(func, args, kwargs)
        if policy is None and lower is not None and self._is_opaque_composite(name):
            return self._run_watched(func, name, args, kwargs, lower)
        return func(*args, **kwargs)

    def _apply_policy(self, policy: CastPolicy, args: tuple, kwargs: dict,
                      lower: torch.dtype) -> tuple[tuple, dict]:
        if policy is CastPolicy.FP32_SET_OPT_DTYPE:
            if args and _eligible(args[0]) and not _dtype_given(args, kwargs):
                kwargs = {**kwargs, "dtype": torch.float32}
            return args, kwargs
        if policy is CastPolicy.LOWER_PRECISION:
            target = lower
        elif policy is CastPolicy.FP32:
            target = torch.float32
        else:
            target = _promote_type(args, kwargs, lower)

        def cast(tensor: torch.Tensor) -> torch.Tensor:
            return self._cast(tensor, target, lower)

        return (_map_tensors(cast, args),
                {key: _map_tensors(cast, value) for key, value in kwargs.items()})

    def _cast(self, tensor: torch.Tensor, dtype: torch.dtype,
              lower: torch.dtype) -> torch.Tensor:
        """``cached_cast`` (autocast_mode.cpp)."""
        if not _eligible(tensor) or tensor.dtype is dtype:
            return tensor
        if (dtype is lower and tensor.dtype is torch.float32 and tensor.requires_grad
                and tensor.is_leaf and not tensor._is_view() and torch.is_autocast_cache_enabled()):
            return self._cache.get(tensor, dtype, hold=self._region_depth > 0)
        return tensor.to(dtype)

    def _attention(self, func: Callable, args: tuple, kwargs: dict) -> torch.Tensor:
        call = _sdpa_arguments(args, kwargs)
        query, key, value, mask = call["query"], call["key"], call["value"], call["attn_mask"]
        if any(t.is_nested for t in (query, key, value)):
            self._note("scaled_dot_product_attention on nested tensors: not substituted")
            return func(*args, **kwargs)
        problem = SdpaProblem.from_tensors(query, key, value, mask, call["dropout_p"],
                                           call["is_causal"], call["enable_gqa"])
        backend = choose_sdpa_backend(self.compute_capability, problem,
                                      cudnn_version=self.cudnn_version)
        if backend is not SdpaBackend.MATH and problem.mask_requires_grad:
            self._note("scaled_dot_product_attention with a trainable attn_mask: "
                       "emulated with the math backend")
            backend = SdpaBackend.MATH
        self.sdpa_backends[backend] = self.sdpa_backends.get(backend, 0) + 1
        if backend is not SdpaBackend.MATH:
            # flash launches (query blocks, batch, heads), efficient (query blocks, heads,
            # batch): batch and heads are grid y/z dimensions, which CUDA caps at 65,535
            # (pytorch/pytorch#146704, #142228).
            extent = max(query.shape[0], query.shape[1])
            if extent > self.largest_grid[0]:
                self.largest_grid = (extent, f"scaled_dot_product_attention ({backend.value})",
                                     self.where())
        if mask is not None and mask.dtype is torch.bool:
            mask = _bool_mask_to_bias(mask, query.dtype)
        if backend is SdpaBackend.MATH:
            return torch.ops.aten._scaled_dot_product_attention_math(
                query, key, value, mask, call["dropout_p"], call["is_causal"], None,
                scale=call["scale"], enable_gqa=call["enable_gqa"])[0]
        if backend is SdpaBackend.EFFICIENT and mask is not None:
            mask = _efficient_bias(mask, query, key)
        return _FusedAttention.apply(query, key, value, mask, call["is_causal"], call["scale"],
                                     call["enable_gqa"], backend)

    def _run_watched(self, func: Callable, name: str, args: tuple, kwargs: dict,
                     lower: torch.dtype) -> Any:
        watcher = _ListedOpWatcher(lower)
        with watcher:
            result = func(*args, **kwargs)
        if watcher.hits:
            reached = ", ".join(sorted(watcher.hits))
            self._note(f"aten::{name}: a C++ composite that reaches {reached} inside, "
                       f"which CUDA autocast would cast")
        return result

    # -- helpers ----------------------------------------------------------------------------

    def _note(self, line: str) -> None:
        if line not in self.unsupported:
            self.unsupported.append(line)

    def _note_in_region(self, line: str) -> None:
        if torch.is_autocast_enabled("cpu"):
            self._note(line)

    def _is_opaque_composite(self, name: str) -> bool:
        """An aten op implemented in C++ by other ops (not a view): its inside is hidden."""
        found = self._composite_ops.get(name)
        if found is None:
            found = any(_is_composite(name, schema)
                        for schema in torch._C._jit_get_schemas_for_operator(f"aten::{name}"))
            self._composite_ops[name] = found
        return found

    def _unchecked_copy(self, func: types.FunctionType) -> Callable | None:
        """``func`` with its ``has_torch_function*`` checks answering False, or None."""
        if func in self._unchecked:
            return self._unchecked[func]
        copy = None
        if any(name in func.__code__.co_names for name in _CHECK_NAMES):
            key = id(func.__globals__)
            patched = self._patched_globals.get(key)
            if patched is None:
                patched = dict(func.__globals__)
                patched.update({name: _never for name in _CHECK_NAMES})
                self._patched_globals[key] = patched
            copy = types.FunctionType(func.__code__, patched, func.__name__, func.__defaults__,
                                      func.__closure__)
            copy.__kwdefaults__ = func.__kwdefaults__
        self._unchecked[func] = copy
        return copy


def _is_composite(name: str, schema: Any) -> bool:
    if any(r.alias_info for r in schema.returns):
        return False  # a view
    overload = f"aten::{name}" + (f".{schema.overload_name}" if schema.overload_name else "")
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key(overload, "CompositeImplicitAutograd")
    except RuntimeError:  # a TorchScript-only schema, not a dispatcher op
        return False


@contextlib.contextmanager
def _cpu_autocast_on() -> Iterator[None]:
    """Re-enable CPU autocast (the emulated region) for a rule that re-enters the mode."""
    torch.set_autocast_enabled("cpu", True)
    try:
        yield
    finally:
        torch.set_autocast_enabled("cpu", False)


def _softmax(func: Callable, name: str, args: tuple, kwargs: dict) -> torch.Tensor:
    """CUDA's ``softmax(half, dtype=float32)`` reads fp16 and writes fp32 without an fp32
    copy of the input (SoftMax.cpp, ``half_to_float``); CPU kernels cannot, fake ones can."""
    call = dict(zip(("input", "dim", "dtype"), args))
    call.update(kwargs)
    source, dim = call.get("input"), call.get("dim")
    if (call.get("dtype") is torch.float32 and isinstance(source, torch.Tensor)
            and source.dtype is torch.float16 and isinstance(dim, int)
            and not _has_values(source)):
        kernel = torch._softmax if name == "softmax" else torch._log_softmax
        return kernel(source, dim, True)
    return func(*args, **kwargs)
