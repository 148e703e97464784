"""Emulate, on CPU (real or fake) tensors, what a CUDA device does differently.

A trace runs on the CPU, where these differ from the GPU the user asks about,
and all of them change memory:

* **Autocast.** ``torch.autocast("cuda")`` is silently disabled without CUDA,
  and CPU autocast casts a different op list. :class:`CudaEmulation` applies
  CUDA's policy instead (the knowledge is in :mod:`batchfit.engine.autocast`),
  including its cache of low-precision copies of fp32 parameters, which live
  until the outermost autocast region exits.
* **Attention kernels.** On the CPU ``F.scaled_dot_product_attention`` runs the
  CPU flash kernel or, with dropout or inputs it cannot take, the math path,
  which saves the ``seq x seq`` attention matrix. A GPU picks flash,
  memory-efficient, cuDNN or math attention by the rules of
  ``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp``
  (:func:`~batchfit.engine.sdpa.choose_sdpa_backend`); the fused ones save only
  the output and a float32 log-sum-exp. The emulation runs what the chosen CUDA
  kernel saves, and allocates in backward
  (:class:`~batchfit.engine.sdpa._FusedAttention`), or CUDA's math path.
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
      on any machine without CUDA. (``torch.is_autocast_enabled()`` and
      ``torch.is_autocast_enabled("cuda")`` answer the CPU stand-in's state while the
      emulation is active, a checkpoint recomputation included, so code that asks sees
      what it would on a GPU.)
    * Substituted attention computes values without dropout (memory is the
      same: fused kernels keep only an RNG seed); a trainable ``attn_mask`` and
      nested tensors use the math path. cuDNN attention's workspace and the
      memory-efficient kernel's backward workspace are approximated (see
      :class:`~batchfit.engine.sdpa._FusedAttention`).
    * ``rms_norm`` runs as CUDA's fused kernel (:class:`_FusedRmsNorm`); the backward's
      partial-sum buffers for the weight gradient are not modelled.
    * ``softmax``/``log_softmax`` of fp16 with ``dtype=float32`` skip the fp32
      input copy, as CUDA's kernel does, only on fake or meta tensors (CPU
      kernels cannot); on real CPU tensors a transient copy remains.
    * cudnn RNNs cast their weights into one new flat buffer per call; here the
      cached per-parameter copies stand in for it.

Torch-private APIs used (kept in this file, :mod:`~batchfit.engine.autocast` and
:mod:`~batchfit.engine.sdpa`): ``torch._subclasses.fake_tensor.is_fake``,
``torch.utils._python_dispatch.TorchDispatchMode``, ``torch._C`` dispatcher
queries and the aten ops ``_scaled_dot_product_attention_math`` and
``_softmax``/``_log_softmax``.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Iterator
from typing import Any, Self

import torch
from torch.overrides import TorchFunctionMode

from batchfit.engine.autocast import (
    _BANNED_MESSAGE,
    _COMPOSITE_RULES,
    _LOW_PRECISION,
    _POLICY,
    CastPolicy,
    _CastCache,
    _dtype_given,
    _eligible,
    _is_out_variant,
    _ListedOpWatcher,
    _map_tensors,
    _op_name,
    _promote_type,
)
from batchfit.engine.limits import GRID_YZ_MAX
from batchfit.engine.sdpa import (
    SdpaBackend,
    SdpaProblem,
    _bool_mask_to_bias,
    _efficient_bias,
    _FusedAttention,
    _has_values,
    _sdpa_arguments,
    _values_context,
    choose_sdpa_backend,
    math_attention_before_2_5,
)

__all__ = ["CudaEmulation"]


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



def _cuda_follows_cpu(is_enabled: Callable[..., bool]) -> Callable[..., bool]:
    """``torch.is_autocast_enabled`` answering CUDA's state from the CPU stand-in.

    Enabled CPU autocast means CUDA autocast while the emulation is active, and a checkpoint
    recomputation restores the autocast state of its arguments' device only (the CPU here,
    ``torch.utils.checkpoint``'s ``_get_autocast_kwargs``). Code that asks CUDA's state
    (peft's bitsandbytes LoRA layers: ``requires_conversion = not
    torch.is_autocast_enabled()``) must see in a recomputation what it saw in forward, or it
    casts differently and the non-reentrant checkpoint refuses the recomputed tensors.
    """
    def is_autocast_enabled(device_type: str | None = None) -> bool:
        if device_type is None or device_type == "cuda":
            return is_enabled("cpu")
        return is_enabled(device_type)

    return is_autocast_enabled


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
        fused_attention: the target's torch has fused attention kernels (torch >= 2.0,
            :attr:`batchfit.engine.stack.Stack.has_sdpa`); False runs every
            ``scaled_dot_product_attention`` as CUDA's math path, the explicit attention
            of older code.
        softmax_saves_input: the target's autograd keeps softmax's and log_softmax's
            input for backward besides the output (torch < 1.11, whose backward formula
            referenced ``self``: pytorch/pytorch#64000, fixed by #65242).
        cudnn_version: runtime cuDNN version on the target (e.g. 92400); None means the
            one this torch was built with.
        efficient_chunks_batch: memory-efficient attention runs a batch past the grid
            limit in pieces (torch >= 2.8, :attr:`Stack.efficient_attention_chunks_batch`).
        math_sdpa_upcasts: the math attention path computes fp16/bf16 inputs in float32
            (torch >= 2.5, :attr:`batchfit.engine.stack.Stack.math_sdpa_upcasts`): the
            installed torch's kernel; False runs torch 2.0-2.4's, in the inputs' dtype
            (:func:`batchfit.engine.sdpa.math_attention_before_2_5`).
        weight_cache: autocast keeps one low-precision copy per fp32 weight for the
            region (``cached_cast``). False casts weights afresh per op, as torch does
            under ``torch.inference_mode()`` from 2.11
            (:attr:`batchfit.engine.stack.Stack.autocast_caches_in_inference_mode`).

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
                 fused_attention: bool = True, softmax_saves_input: bool = False,
                 cudnn_version: int | None = None, efficient_chunks_batch: bool = False,
                 weight_cache: bool = True, math_sdpa_upcasts: bool = True):
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
        self.fused_attention = fused_attention
        self.efficient_chunks_batch = efficient_chunks_batch
        self.math_sdpa_upcasts = math_sdpa_upcasts
        self.weight_cache = weight_cache
        self.softmax_saves_input = softmax_saves_input
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
        self._is_autocast_enabled: Callable[..., bool] = torch.is_autocast_enabled

    # -- public ---------------------------------------------------------------------------

    def __enter__(self) -> Self:
        if self._mode is not None:
            raise RuntimeError("this CudaEmulation is already active")
        self._mode = _InterceptMode(self)
        self._mode.__enter__()
        self._is_autocast_enabled = torch.is_autocast_enabled
        torch.is_autocast_enabled = _cuda_follows_cpu(self._is_autocast_enabled)
        return self

    def __exit__(self, *exc_info: object) -> None:
        mode, self._mode = self._mode, None
        try:
            if mode is not None:
                mode.__exit__(*exc_info)
        finally:
            torch.is_autocast_enabled = self._is_autocast_enabled
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
            if self.softmax_saves_input and torch.is_grad_enabled() and args:
                return _SoftmaxKeepingInput.apply(args[0], func, name, args[1:], kwargs)
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
        """``cached_cast`` (autocast_mode.cpp): a low-precision copy of an fp32 leaf that
        requires grad is kept for the region, unless the cache is off (``weight_cache``:
        ``!c10::InferenceMode::is_enabled()`` in ``can_try_cache`` from pytorch#165068)."""
        if not _eligible(tensor) or tensor.dtype is dtype:
            return tensor
        if (dtype is lower and tensor.dtype is torch.float32 and tensor.requires_grad
                and tensor.is_leaf and not tensor._is_view() and torch.is_autocast_cache_enabled()
                and self.weight_cache):
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
        if not self.fused_attention:  # a stack before torch 2.0: attention is explicit
            backend = SdpaBackend.MATH
        if backend is not SdpaBackend.MATH and problem.mask_requires_grad:
            self._note("scaled_dot_product_attention with a trainable attn_mask: "
                       "emulated with the math backend")
            backend = SdpaBackend.MATH
        self.sdpa_backends[backend] = self.sdpa_backends.get(backend, 0) + 1
        # Inference through memory-efficient attention on torch >= 2.8 runs the batch in
        # pieces of at most GRID_YZ_MAX (Stack.efficient_attention_chunks_batch).
        piece = GRID_YZ_MAX if (backend is SdpaBackend.EFFICIENT and self.efficient_chunks_batch
                                and not problem.requires_grad) else query.shape[0]
        if backend is not SdpaBackend.MATH:
            # flash launches (query blocks, batch, heads), efficient (query blocks, heads,
            # batch): batch and heads are grid y/z dimensions, which CUDA caps at 65,535
            # (pytorch/pytorch#146704, #142228).
            extent = max(min(piece, query.shape[0]), query.shape[1])
            if extent > self.largest_grid[0]:
                self.largest_grid = (extent, f"scaled_dot_product_attention ({backend.value})",
                                     self.where())
        if mask is not None and mask.dtype is torch.bool:
            mask = _bool_mask_to_bias(mask, query.dtype)
        if backend is SdpaBackend.MATH:
            if not self.math_sdpa_upcasts and not call["enable_gqa"]:  # (no GQA before 2.5)
                return math_attention_before_2_5(query, key, value, mask, call["dropout_p"],
                                                 call["is_causal"], call["scale"])
            return torch.ops.aten._scaled_dot_product_attention_math(
                query, key, value, mask, call["dropout_p"], call["is_causal"], None,
                scale=call["scale"], enable_gqa=call["enable_gqa"])[0]
        if backend is SdpaBackend.EFFICIENT and mask is not None:
            mask = _efficient_bias(mask, query, key)
        rest = (call["is_causal"], call["scale"], call["enable_gqa"], backend)
        if query.shape[0] <= piece:
            return _FusedAttention.apply(query, key, value, mask, *rest)
        # attention.cu (#154029): each piece's output in the kernel's (B, S, H, D) layout,
        # concatenated along the batch, then transposed: the pieces and the whole output
        # are alive together at the concatenation.
        outputs = [_FusedAttention.apply(query[start:start + piece], key[start:start + piece],
                                         value[start:start + piece],
                                         None if mask is None else mask[start:start + piece],
                                         *rest).transpose(1, 2)
                   for start in range(0, query.shape[0], piece)]
        return torch.cat(outputs).transpose(1, 2)

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


class _SoftmaxKeepingInput(torch.autograd.Function):
    """softmax/log_softmax as torch < 1.11 differentiated them: the backward node kept the
    input (``self``) besides the output (derivatives.yaml referenced it; #64000, #65242)."""

    @staticmethod
    def forward(ctx: Any, source: torch.Tensor, func: Callable, name: str, rest: tuple,
                kwargs: dict) -> torch.Tensor:
        out = _softmax(func, name, (source, *rest), kwargs)
        ctx.save_for_backward(source, out)
        ctx.dim = rest[0] if rest else kwargs["dim"]
        ctx.log = name == "log_softmax"
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        source, out = ctx.saved_tensors
        backward = torch._log_softmax_backward_data if ctx.log else torch._softmax_backward_data
        return backward(grad, out, ctx.dim, source.dtype), None, None, None, None


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
