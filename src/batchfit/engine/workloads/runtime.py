"""What the workload's libraries do on the target device that a fake trace must reproduce.

bitsandbytes 4-bit matmul (``bitsandbytes::gemm_4bit``)
    Its fake kernel returns only the output. The real kernels allocate more:

    * CUDA (``bitsandbytes/backends/cuda/ops.py``): for ``M > 1536`` rows (any training
      batch of a few thousand tokens), or when its per-GPU heuristic
      ``_gemm_4bit_use_custom_cuda(sm_count, cc, M, N, K)`` prefers it, or when ``K`` is not
      a multiple of the block size, ``_dequant_linear_fallback`` runs: with double
      quantization an fp32 copy of the absmax plus the offset sum, then the whole weight
      dequantized to the input dtype (``N x K``), then ``F.linear``. Otherwise the fused
      ``cgemm_4bit`` kernel writes only the output.
    * CPU (``backends/default/ops.py``): always the same decomposition
      (``_gemm_4bit_default_impl``).

    The trace runs these sub-ops (bitsandbytes' own default implementation on a CPU
    target; the CUDA fallback's allocations, in its order, on a CUDA target), so the
    transient dequantized weight is in the timeline. Backward dequantizes through
    ``F.dequantize_4bit``, whose ops the trace sees anyway.

bitsandbytes' version (``TrainConfig.bitsandbytes_version``; None: the installed one)
    The trace runs the installed ``MatMul4Bit``; two of its changes move memory, and an
    older target version gets back what it did (``bitsandbytes/autograd/_functions.py``,
    ``MatMul4Bit.forward``):

    * before 0.43.2 forward kept the layer's input for backward, ``ctx.tensors = (A, B)``,
      though backward reads only ``B`` (it computes no weight gradient); #1270 (commit
      9e75374, "fix QLoRA mem bug: delete useless buffered activation") saves
      ``(None, B)``. So every 4-bit layer whose input needs a gradient held that input
      (``B x S x in_features`` in the compute dtype) from its forward to its backward.
    * before 0.50.0 forward was ``F.linear(A, F.dequantize_4bit(B, state).to(A.dtype).t())``
      whatever the shape: the whole weight dequantized on every call. 0.50.0 calls
      ``gemm_4bit``, whose CUDA dispatch may pick the fused kernel (above).

bitsandbytes LLM.int8 (``Linear8bitLt``), CUDA targets
    ``bnb.matmul`` picks ``MatMul8bitFp`` for a CPU tensor, which a fake trace has, and
    ``MatMul8bitLt`` on a GPU: the trace calls ``MatMul8bitLt``. Its outlier detection
    (``|A| >= 6.0`` per column) is data-dependent; the trace assumes no outlier column
    (the LLM.int8 paper finds them in a handful of the 4,096+ feature columns; each costs
    ``M`` fp16 values). The CUDA quantization kernel's temporaries (``|A|`` and the
    outlier mask) and ``int8_mm_dequant``'s fp16 output before its cast are decomposed as
    ``backends/cuda/ops.py`` allocates them.

Liger-Kernel's fused linear cross-entropy (``--loss chunked``)
    Liger's own Python runs on the fake tensors, so its buffers (the input gradient, the
    per-chunk logits, the loss vector) are traced; only its Triton kernel launches are
    skipped: they write into tensors that already exist and allocate nothing. Its
    ``.item()`` (the token count) and ``torch.equal`` read values only as scalars.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Iterator

import torch

from batchfit.engine.spec import TrainConfig
from batchfit.engine.target import Target
from batchfit.errors import InvalidInputError, option

#: bitsandbytes' CUDA dispatch: above this many rows the fallback always runs.
GEMM_4BIT_CUSTOM_MAX_M = 1536
#: The first bitsandbytes whose ``MatMul4Bit`` does not keep its input (#1270).
MATMUL_4BIT_DROPS_INPUT = (0, 43, 2)
#: The first bitsandbytes whose ``MatMul4Bit.forward`` calls the ``gemm_4bit`` op.
MATMUL_4BIT_GEMM_OP = (0, 50, 0)


@contextlib.contextmanager
def workload_runtime(config: TrainConfig, device: Target) -> Iterator[None]:
    """Patch what the trace needs for ``config``'s workload on ``device`` (restored after)."""
    from batchfit.engine.workloads.spec import LossKind, QuantMethod

    with contextlib.ExitStack() as stack:
        quant = config.quant
        if quant is not None:
            register_bnb_decompositions()
            if quant.method is QuantMethod.INT8 and device is not None and device.is_cuda:
                stack.enter_context(_int8_on_cuda())
            version = config.bitsandbytes_version
            if quant.method.is_4bit and version is not None:
                stack.enter_context(_matmul_4bit_of(version, device))
        if config.loss is LossKind.CHUNKED:
            stack.enter_context(_liger_without_launches())
        yield


# -- bitsandbytes 4-bit ------------------------------------------------------------------

def _uses_fused_kernel(device: Target, A: torch.Tensor, shape_b: Any, blocksize: int) -> bool:
    """bitsandbytes' choice on the target GPU between ``cgemm_4bit`` and the fallback."""
    K = A.shape[-1]
    M = A.numel() // K
    N = shape_b[0]
    if M > GEMM_4BIT_CUSTOM_MAX_M or K % blocksize != 0:
        return False
    try:
        import bitsandbytes.backends.cuda.ops as cuda_ops

        cc = device.compute_capability or (8, 0)
        sms = device.sm_count or 108
        saved = cuda_ops._gpu_dispatch_props
        cuda_ops._gpu_dispatch_props = lambda index: (sms, cc[0], cc[1])
        try:
            return bool(cuda_ops._gemm_4bit_use_custom_cuda.__wrapped__(0, A.dtype, M, N, K))
        finally:
            cuda_ops._gpu_dispatch_props = saved
    except Exception:  # noqa: BLE001 - an older bitsandbytes: assume the fallback (more memory)
        return False


def _gemm_4bit(args: tuple, kwargs: dict, device: Any) -> torch.Tensor:
    from bitsandbytes.backends.default.ops import _gemm_4bit_default_impl

    bound = _bind_gemm_4bit(args, kwargs)
    if device is None or not device.is_cuda:
        return _gemm_4bit_default_impl(**bound)
    A, shape_b = bound["A"], bound["shapeB"]
    if _uses_fused_kernel(device, A, shape_b, bound["blocksize"]):
        return torch.empty((*A.shape[:-1], shape_b[0]), dtype=A.dtype)
    return _cuda_dequant_linear_fallback(**bound)


def _bind_gemm_4bit(args: tuple, kwargs: dict) -> dict[str, Any]:
    names = ("A", "B", "shapeB", "absmax", "blocksize", "quant_type", "bias", "absmax_8bit",
             "absmax_code", "absmax_offset")
    bound = dict(zip(names, args))
    bound.update(kwargs)
    for name in names:
        bound.setdefault(name, None)
    return bound


def _cuda_dequant_linear_fallback(A, B, shapeB, absmax, blocksize, quant_type, bias=None,
                                  absmax_8bit=None, absmax_code=None, absmax_offset=None):
    """``backends/cuda/ops.py::_dequant_linear_fallback``'s allocations, in its order (the
    CUDA kernels it calls write into these buffers)."""
    weight, absmax = _dequantized_weight(shapeB, A.dtype, absmax_8bit, absmax_offset)
    out = torch.nn.functional.linear(A, weight, bias)
    del absmax, weight
    return out


def _dequantized_weight(shapeB: Any, dtype: torch.dtype, absmax_8bit: Any,
                        absmax_offset: Any) -> tuple[torch.Tensor, Any]:
    """The whole weight dequantized to ``dtype``, and (double quantization) the fp32 absmax
    plus offset it was computed with, which the caller frees when its frame ends."""
    absmax = None
    if absmax_8bit is not None:
        absmax_dq = torch.empty_like(absmax_8bit, dtype=torch.float32)
        absmax = (absmax_dq, absmax_dq + absmax_offset)
    return torch.empty(tuple(shapeB), dtype=dtype), absmax


@contextlib.contextmanager
def _matmul_4bit_of(version: tuple[int, int, int], device: Target) -> Iterator[None]:
    """``MatMul4Bit`` as bitsandbytes ``version`` runs it (see the module docstring)."""
    from bitsandbytes.autograd._functions import MatMul4Bit

    saved_forward = MatMul4Bit.__dict__["forward"]
    forward = saved_forward.__func__
    keeps_input = version < MATMUL_4BIT_DROPS_INPUT

    state_dtype: list[Any] = [None]  # the quant state's dtype of the layer being run

    def old_forward(ctx: Any, A: torch.Tensor, B: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        state = kwargs.get("quant_state", args[2] if len(args) > 2 else None)
        state_dtype[0] = getattr(state, "dtype", None)
        output = forward(ctx, A, B, *args, **kwargs)
        if keeps_input and not ctx.is_empty and ctx.tensors[1] is not None:
            ctx.tensors = (A, ctx.tensors[1])  # < 0.43.2: ``ctx.tensors = (A, B)``
        return output

    def dequantized(args: tuple, kwargs: dict, device: Any) -> torch.Tensor:
        return _gemm_4bit_dequantized(args, kwargs, device, state_dtype[0])

    ops = {}
    if version < MATMUL_4BIT_GEMM_OP and device is not None and device.is_cuda:
        ops[torch.ops.bitsandbytes.gemm_4bit.default] = dequantized
    try:
        MatMul4Bit.forward = staticmethod(old_forward)
        with _decomposed_as(ops):
            yield
    finally:
        MatMul4Bit.forward = saved_forward


def _gemm_4bit_dequantized(args: tuple, kwargs: dict, device: Any,
                           state_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Before 0.50.0: the whole weight dequantized, then ``F.linear``, at any shape.

    0.42's ``F.linear(A, F.dequantize_4bit(B, quant_state).to(A.dtype).t(), bias)``:
    ``dequantize_4bit`` writes the quant state's dtype (the weight's when it was quantized);
    when that is not the input's, ``.to`` makes a second, cast copy while the first lives.
    """
    bound = _bind_gemm_4bit(args, kwargs)
    A = bound["A"]
    if state_dtype is None or state_dtype == A.dtype:
        return _cuda_dequant_linear_fallback(**bound)
    weight, absmax = _dequantized_weight(bound["shapeB"], state_dtype, bound["absmax_8bit"],
                                         bound["absmax_offset"])
    del absmax  # dequantize_4bit's own temporaries end with it
    cast = weight.to(A.dtype)
    del weight
    return torch.nn.functional.linear(A, cast, bound["bias"])


@functools.cache
def register_bnb_decompositions() -> None:
    """Register the bitsandbytes ops traced as their kernels' sub-ops (once)."""
    from batchfit.engine.workloads.build import import_bitsandbytes

    import_bitsandbytes()  # defines torch.ops.bitsandbytes

    from batchfit.engine.kernels import register_decomposition, register_outputs_only

    register_decomposition(torch.ops.bitsandbytes.gemm_4bit.default, _gemm_4bit)
    # backends/cuda/ops.py: these allocate their outputs with torch.empty and run one kernel
    # into them (dequantize_4bit, dequantize_blockwise, quantize_4bit, quantize_blockwise);
    # the optimizer updates write in place and return nothing; the int8 matmul's output is
    # its int32 product (cuBLASLt's own workspace is not counted).
    register_outputs_only(*(f"bitsandbytes.{name}.default" for name in (
        "dequantize_4bit", "dequantize_blockwise", "quantize_4bit", "quantize_blockwise",
        "optimizer_update_8bit_blockwise", "optimizer_update_32bit", "int8_linear_matmul",
        "int8_vectorwise_dequant", "int8_double_quant")))


# -- bitsandbytes LLM.int8 on a CUDA target ----------------------------------------------------

def _int8_vectorwise_quant_cuda(args: tuple, kwargs: dict, device: Any) -> Any:
    """``backends/cuda/ops.py``'s int8_vectorwise_quant, with no outlier column."""
    A = args[0]
    threshold = args[1] if len(args) > 1 else kwargs.get("threshold", 0.0)
    rows = A.numel() // A.shape[-1]
    row_stats = torch.empty(rows, dtype=torch.float32)
    out_row = torch.empty(A.shape, dtype=torch.int8)
    outlier_cols = None
    if threshold > 0.0:
        outliers = A.abs() >= threshold
        outliers.any(dim=0)  # the column test's temporary; its argwhere is empty here
        del outliers
        outlier_cols = torch.empty(0, dtype=torch.int64)
    return out_row, row_stats, outlier_cols


def _int8_mm_dequant_cuda(args: tuple, kwargs: dict, device: Any) -> torch.Tensor:
    """The CUDA kernel writes fp16, then casts to the requested dtype."""
    names = ("A", "row_stats", "col_stats", "dtype", "bias")
    bound = {**dict(zip(names, args)), **kwargs}
    A, dtype, bias = bound["A"], bound.get("dtype"), bound.get("bias")
    out = torch.empty(tuple(A.shape), dtype=torch.float16)
    if bias is not None and bias.dtype != torch.float16:
        out.add_(bias)
    return out.to(dtype or torch.float16)


def _int8_mixed_scaled_mm(args: tuple, kwargs: dict, device: Any) -> Any:
    """``backends/default/ops.py``'s int8_mixed_scaled_mm (CUDA has no kernel of its own),
    with no outlier column: an empty ``subA`` and ``int8_scaled_mm`` (an int32 product,
    then its dequantization)."""
    names = ("A", "CA", "CB", "SCA", "SCB", "outlier_cols", "bias")
    bound = {**dict(zip(names, args)), **kwargs}
    A = bound["A"]
    sub_a = torch.empty(0, dtype=A.dtype)
    out_i32 = torch.ops.bitsandbytes.int8_linear_matmul.default(bound["CA"], bound["CB"])
    output = torch.ops.bitsandbytes.int8_mm_dequant.default(
        out_i32, bound["SCA"], bound["SCB"], dtype=A.dtype, bias=bound.get("bias"))
    del out_i32
    return output, sub_a


@contextlib.contextmanager
def _int8_on_cuda() -> Iterator[None]:
    import bitsandbytes
    from bitsandbytes.autograd._functions import MatMul8bitLt, MatmulLtState

    def matmul(A, B, out=None, state=None, threshold=0.0, bias=None):
        state = state or MatmulLtState()
        if threshold > 0.0:
            state.threshold = threshold
        return MatMul8bitLt.apply(A, B, out, bias, state)

    ops = {torch.ops.bitsandbytes.int8_vectorwise_quant.default: _int8_vectorwise_quant_cuda,
           torch.ops.bitsandbytes.int8_mm_dequant.default: _int8_mm_dequant_cuda,
           torch.ops.bitsandbytes.int8_mixed_scaled_mm.default: _int8_mixed_scaled_mm}
    saved_matmul = bitsandbytes.matmul
    try:
        bitsandbytes.matmul = matmul
        with _decomposed_as(ops):
            yield
    finally:
        bitsandbytes.matmul = saved_matmul


@contextlib.contextmanager
def _decomposed_as(ops: dict[Any, Any]) -> Iterator[None]:
    """Trace each op of ``ops`` as its decomposition there, restoring the previous ones."""
    from batchfit.engine.kernels import _DECOMPOSE

    saved = {op: _DECOMPOSE.get(op) for op in ops}
    try:
        _DECOMPOSE.update(ops)
        yield
    finally:
        for op, previous in saved.items():
            if previous is None:
                _DECOMPOSE.pop(op, None)
            else:
                _DECOMPOSE[op] = previous


# -- Liger-Kernel's chunked loss ---------------------------------------------------------------

class _NoLaunch:
    """Stands in for a Triton kernel: ``kernel[grid](...)`` does nothing."""

    def __getitem__(self, grid: Any) -> Any:
        return lambda *args, **kwargs: None


@contextlib.contextmanager
def _liger_without_launches() -> Iterator[None]:
    import liger_kernel.ops.fused_linear_cross_entropy as flce

    from batchfit.engine.kernels import scalar_reads

    def reading_scalars(fn: Any) -> Any:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with scalar_reads():
                return fn(*args, **kwargs)
        return wrapper

    names = ("liger_cross_entropy_kernel", "element_mul_kernel",
             "fused_linear_cross_entropy_forward", "fused_linear_cross_entropy_backward")
    saved = {name: getattr(flce, name) for name in names}
    try:
        flce.liger_cross_entropy_kernel = _NoLaunch()
        flce.element_mul_kernel = _NoLaunch()
        flce.fused_linear_cross_entropy_forward = reading_scalars(
            saved["fused_linear_cross_entropy_forward"])
        flce.fused_linear_cross_entropy_backward = reading_scalars(
            saved["fused_linear_cross_entropy_backward"])
        yield
    finally:
        for name, value in saved.items():
            setattr(flce, name, value)


def apply_chunked_loss(model: torch.nn.Module) -> None:
    """Liger's fused linear cross-entropy on ``model`` (an instance patch of its forward,
    as ``AutoLigerKernelForCausalLM`` / ``apply_liger_kernel_to_*(model=...)`` do), and
    nothing else of Liger's (RoPE, RMSNorm, SwiGLU keep transformers' kernels)."""
    try:
        from liger_kernel.transformers.monkey_patch import (
            MODEL_TYPE_TO_APPLY_LIGER_FN,
            _apply_liger_kernel_to_instance,
        )
    except ImportError as exc:
        raise InvalidInputError(
            f"{option('loss', 'chunked')} uses Liger-Kernel's fused linear cross-entropy: "
            "pip install liger-kernel") from exc
    from batchfit.engine.workloads.losses import base_model_of

    base = base_model_of(model)  # a peft model: patch the transformers model inside
    model_type = getattr(getattr(base, "config", None), "model_type", None)
    if model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:
        raise InvalidInputError(
            f"{option('loss', 'chunked')}: Liger-Kernel has no fused cross-entropy for model "
            f"type {model_type!r}; use {option('loss', 'standard')}")
    _apply_liger_kernel_to_instance(base, fused_linear_cross_entropy=True, rope=False,
                                    rms_norm=False, swiglu=False, cross_entropy=False,
                                    layer_norm=False, geglu=False)
