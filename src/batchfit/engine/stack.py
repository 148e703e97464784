"""The software stack the user's step runs on: torch, CUDA and cuDNN versions.

A GPU's answer depends on more than the card. The same model, batch and card use
different memory under torch 1.12 + CUDA 11.3 and under torch 2.9 + CUDA 12.8, for
reasons each written in a source:

* **The CUDA context.** Before CUDA 11.7 the driver loads every kernel of every loaded
  library into device memory when the context is created (eager module loading);
  CUDA 11.7 added lazy loading (``CUDA_MODULE_LOADING=LAZY``, CUDA 11.7 release notes),
  torch 1.13 turns it on when the user has not set it (pytorch/pytorch#86509, which
  measured 287 MB lazy against 667 MB eager for torch's own kernels), and CUDA 12.2
  makes it the driver's default on Linux. Measured: 1,343 MB on a V100 with a CUDA 11
  torch before 1.13 (Hugging Face, "Model training anatomy"), ~300-430 MB lazy (pytorch/pytorch#107667,
  #109888). Eager loading loads the kernels built for the card's architecture, so the
  eager context is per compute capability where measured (1,685 MiB on an RTX 3090,
  pytorch/pytorch#55277). :meth:`Stack.context_bytes`.
* **``optimizer.zero_grad()``** sets gradients to None from torch 2.0 (``set_to_none``
  default True, torch 2.0 release notes); before, it zeroes them in place, so last
  step's gradients stay allocated through the next forward and backward.
  :attr:`Stack.zero_grad_sets_none`.
* **Optimizer implementation.** From torch 2.0 optimizers default to the multi-tensor
  (``foreach``) implementation on CUDA (``_default_to_fused_or_foreach`` in
  torch/optim/optimizer.py), whose whole-group temporaries count; before, the for-loop.
  :attr:`Stack.foreach_default`.
* **Fused attention.** ``F.scaled_dot_product_attention`` exists from torch 2.0; before,
  attention is computed explicitly (what the math backend does). :attr:`Stack.has_sdpa`.
* **The math attention path's precision.** From torch 2.5 the math backend of
  ``scaled_dot_product_attention`` computes fp16/bf16 inputs in float32 (pytorch/pytorch
  #128922), so its attention matrices take twice the bytes they took before.
  :attr:`Stack.math_sdpa_upcasts`.
* **Softmax's saved input.** Before torch 1.11 the backward formulas of softmax and
  log_softmax referenced ``self``, so autograd kept the input alive beside the output
  (pytorch/pytorch#64000, fixed by #65242): an extra attention-matrix-sized tensor per
  attention layer in training. :attr:`Stack.softmax_saves_input`.
* **cuDNN's version** decides which convolution kernels a depthwise convolution reaches
  (:mod:`batchfit.engine.limits`) and whether cuDNN attention is available.

* **Autocast's weight cache under ``torch.inference_mode()``.** Autocast keeps one
  low-precision copy of each fp32 weight for the whole autocast region (``cached_cast``
  in aten/src/ATen/autocast_mode.cpp). pytorch/pytorch#165068 (fixing #158232, merged
  2025-12-10) adds ``!c10::InferenceMode::is_enabled()`` to that cache's condition, so
  under inference mode each op casts its weights afresh and the copies die with the op.
  torch 2.9.1 (released 2025-11-12) predates it; the torch 2.13 and 2.14 wheels have it
  (tests/engine/test_inference_mode.py counts the casts). The first release with it is
  2.11: ultralytics/thop v2.2.4's release notes give the bug #165068 fixes (cached casts
  made under no_grad) as affecting "PyTorch 2.10 and older". Were 2.10 to have it, a 2.10
  answer under inference mode would count copies the real step does not keep, on the
  safe side. :attr:`Stack.autocast_caches_in_inference_mode`.

Otherwise ``torch.inference_mode()`` allocates what ``torch.no_grad()`` does: neither
saves anything for backward; inference mode also skips version counters and view
tracking (host-side bookkeeping, torch docs "Inference Mode").

Versions are parsed from what users type (``2.4``, ``2.4.0+cu124``, ``12.4``, ``cu124``,
``torch2.4+cu124``). The default is the installed torch and the CUDA it was built for,
read from its package metadata without importing torch.

Example:
    >>> from batchfit.engine.stack import Stack
    >>> old = Stack.parse(torch_version="1.12", cuda_version="11.3")
    >>> old.lazy_module_loading, old.zero_grad_sets_none, old.context_bytes() // 2**20
    (False, False, 1343)
    >>> Stack.parse(stack="torch2.9.1+cu128").cudnn_version
    91002
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib import metadata

from batchfit.errors import InvalidInputError, option

MiB = 1 << 20

#: CUDA context with lazy module loading: the default DeviceProfile context (torch's
#: kernels measured at 287 MB lazily loaded, pytorch/pytorch#86509; ~300-430 MB after a
#: few ops, #107667, #109888; the kernels a step uses load on top). #86509 measured
#: cudaMemGetInfo's total - free, and that total already leaves out what the driver keeps
#: (the catalog's ``cuda_total_mib``), so the two are subtracted without counting twice.
LAZY_CONTEXT_BYTES = 512 * MiB
#: CUDA context without lazy loading: 1,343 MB measured by nvidia-smi on a V100 with a
#: CUDA 11 torch before 1.13 (the docs name no version) after the first CUDA tensor (Hugging Face transformers docs, "Model
#: training anatomy"). nvidia-smi's "MB" are MiB. It is NVML's ``used`` on a card that
#: showed "0 MB" before: the increase, without what the driver keeps (not counted twice).
EAGER_CONTEXT_BYTES = 1343 * MiB
#: Eager loading puts every kernel built for the device's architecture into the context,
#: so its size depends on the card, not only on the stack. Measured per compute
#: capability (where no measurement exists, the V100's above):
#: * (8, 6), the RTX 3090: 1,687 MiB after ``torch.Tensor(1).cuda()`` with torch
#:   1.8.2+cu111 (pytorch/pytorch#55277, the table of 2022-04-12: 721 MiB on a GTX 1080
#:   with cu101, 1,687 on a 3090 with cu111), less that tensor's 2 MiB segment
#:   (the caching allocator's smallest). A second 3090 measurement, torch 1.7.1+cu110
#:   (pytorch/pytorch#49877: 1,644 MiB with a 156.25 MiB tensor in a 158 MiB segment),
#:   gives 1,486 MiB; newer torch loads more kernels, so the newer figure is used.
EAGER_CONTEXT_BYTES_BY_CAPABILITY: dict[tuple[int, int], int] = {
    (8, 6): (1687 - 2) * MiB,
}

#: torch releases: the CUDA versions of their official wheels and the cuDNN those wheels
#: ship (``torch.backends.cudnn.version()``; from 2.1 the ``nvidia-cudnn-cu1x`` pin of the
#: wheel). Sources: the PyTorch release compatibility matrix (RELEASE.md) and the wheels'
#: metadata. A (torch, CUDA) pair not in the table keeps the torch's nearest cuDNN.
_RELEASES: dict[tuple[int, int], dict[tuple[int, int], int]] = {
    (1, 8): {(10, 2): 7605, (11, 1): 8005},
    (1, 9): {(10, 2): 7605, (11, 1): 8005},
    (1, 10): {(10, 2): 7605, (11, 1): 8005, (11, 3): 8200},
    (1, 11): {(10, 2): 7605, (11, 3): 8200, (11, 5): 8302},
    (1, 12): {(10, 2): 7605, (11, 3): 8302, (11, 6): 8302},
    (1, 13): {(11, 6): 8500, (11, 7): 8500},
    (2, 0): {(11, 7): 8500, (11, 8): 8700},
    (2, 1): {(11, 8): 8700, (12, 1): 8902},
    (2, 2): {(11, 8): 8700, (12, 1): 8902},
    (2, 3): {(11, 8): 8700, (12, 1): 8902},
    (2, 4): {(11, 8): 90100, (12, 1): 90100, (12, 4): 90100},
    (2, 5): {(11, 8): 90100, (12, 1): 90100, (12, 4): 90100},
    (2, 6): {(11, 8): 90100, (12, 4): 90100, (12, 6): 90501},
    (2, 7): {(11, 8): 90100, (12, 6): 90501, (12, 8): 90701},
    (2, 8): {(12, 6): 91002, (12, 8): 91002, (12, 9): 91002},
    (2, 9): {(12, 6): 91002, (12, 8): 91002, (13, 0): 91300},
    # cuDNN 9.15.1.9 for the CUDA 13 builds from 2.10 (pytorch/pytorch#171189, the 2.10
    # cherry-pick "Upgrade cuDNN to 9.15.1 for CUDA 13 builds", and #173677, "Update release
    # 2.10 CUDNN version to 9.15.1.9"); the CUDA 12 builds were not upgraded there. 2.11 is
    # the nearest older entry's until read off a 2.11 wheel (benchmarks/gpu_truth records
    # ``torch.backends.cudnn.version()`` on the card it runs on).
    (2, 10): {(12, 6): 91002, (12, 8): 91002, (13, 0): 91501},
}
#: CUDA toolkit versions torch has been built with (major, minor).
_CUDA_VERSIONS = frozenset({(10, 2), (11, 0), (11, 1), (11, 3), (11, 5), (11, 6), (11, 7),
                            (11, 8), (12, 0), (12, 1), (12, 2), (12, 4), (12, 6), (12, 8),
                            (12, 9), (13, 0), (13, 1), (13, 2)})


def _version(text: str, what: str, flag: str) -> tuple[int, int]:
    match = re.fullmatch(r"\s*(?:torch|cuda|cu)?\s*v?(\d+)\.(\d+)(?:\.\d+)?(?:[+.\-]\S*)?\s*", text)
    if match is None:
        raise InvalidInputError(f"malformed {flag} {text!r}: write the {what} version like "
                                f"{'2.4' if what == 'torch' else '12.4'}")
    return int(match.group(1)), int(match.group(2))


def _cuda_tag(text: str) -> tuple[int, int] | None:
    """``cu124`` -> (12, 4); ``cu113`` -> (11, 3); ``cu130`` -> (13, 0)."""
    match = re.fullmatch(r"cu(\d{2,3})", text.strip().lower())
    if match is None:
        return None
    digits = match.group(1)
    return int(digits[:2]), int(digits[2:] or 0)


def _installed() -> tuple[str, str | None]:
    """The installed torch's version string and its CUDA version ("2.14.1+cu130", "13.0")."""
    try:
        version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        return "0.0", None
    local = version.partition("+")[2]
    cuda = _cuda_tag(local) if local else None
    if cuda is None and not local:  # a plain "2.x.y" wheel from PyPI is a CUDA build
        try:
            import torch  # noqa: PLC0415 - only when the metadata cannot tell

            return version, torch.version.cuda
        except ImportError:
            return version, None
    return version, None if cuda is None else f"{cuda[0]}.{cuda[1]}"


@dataclass(frozen=True)
class Stack:
    """torch, CUDA and cuDNN versions of the process that will run the step.

    Attributes:
        torch_version: ``(major, minor)``.
        cuda_version: ``(major, minor)`` of the CUDA runtime torch was built with.
        cudnn_version: as ``torch.backends.cudnn.version()`` reports it (8302 for 8.3.2,
            90100 for 9.1.0).
    """

    torch_version: tuple[int, int]
    cuda_version: tuple[int, int]
    cudnn_version: int

    @classmethod
    def parse(cls, *, torch_version: str | None = None, cuda_version: str | None = None,
              stack: str | None = None, cudnn_version: int | None = None) -> Stack:
        """A stack from what the user typed; anything not given is the installed one's.

        Args:
            torch_version: ``2.4``, ``2.4.0``, ``2.4.0+cu124`` (a local ``+cuXYZ`` also
                sets the CUDA version).
            cuda_version: ``12.4`` or ``cu124``.
            stack: both at once, ``torch2.4+cu124`` or ``2.4/12.4``.
            cudnn_version: overrides the cuDNN of the official wheel of that pair.

        Raises:
            InvalidInputError: an unknown or malformed version (one line, with the range
                batchfit knows).
        """
        if stack is not None:
            if torch_version is not None or cuda_version is not None:
                raise InvalidInputError(f"give {option('stack')} or {option('torch_version')}/"
                                        f"{option('cuda_version')}, not both")
            parts = re.split(r"[+/ ]", stack.strip(), maxsplit=1)
            if len(parts) != 2 or not parts[1]:
                raise InvalidInputError(
                    f"malformed {option('stack')} {stack!r}: write torch and CUDA versions like "
                    "torch2.4+cu124 or 2.4/12.4")
            torch_version, cuda_version = parts
        installed_torch, installed_cuda = _installed()
        flag = option("torch_version" if stack is None else "stack")
        text = torch_version if torch_version is not None else installed_torch
        torch_v = _version(text, "torch", flag)
        local = text.partition("+")[2]
        if cuda_version is None and local:
            cuda_version = local
        if cuda_version is None:
            if torch_version is not None and torch_v != _version(installed_torch, "torch", flag):
                cuda_version = _default_cuda(torch_v)
            else:
                cuda_version = installed_cuda or _default_cuda(torch_v)
        cuda_flag = option("cuda_version" if stack is None else "stack")
        cuda_v = _cuda_tag(cuda_version) or _version(cuda_version, "CUDA", cuda_flag)
        _check_known(torch_v, cuda_v, installed_torch, flag, cuda_flag)
        if cudnn_version is None:
            cudnn_version = _cudnn_of(torch_v, cuda_v, installed_torch)
        return cls(torch_v, cuda_v, int(cudnn_version))

    @classmethod
    def installed(cls) -> Stack:
        """The torch installed here, with the CUDA it was built for."""
        return cls.parse()

    # -- what the versions decide -------------------------------------------------------

    @property
    def lazy_module_loading(self) -> bool:
        """Kernels load into the context only when first used (see the module docstring)."""
        return self.cuda_version >= (12, 2) or (
            self.cuda_version >= (11, 7) and self.torch_version >= (1, 13))

    def context_bytes(self, compute_capability: tuple[int, int] | None = None) -> int:
        """The CUDA context and loaded kernels, outside the caching allocator: lazy, the
        same on every card; eager, the measurement for ``compute_capability`` if there is
        one (:data:`EAGER_CONTEXT_BYTES_BY_CAPABILITY`), else the V100's."""
        if self.lazy_module_loading:
            return LAZY_CONTEXT_BYTES
        if compute_capability is None:
            return EAGER_CONTEXT_BYTES
        return EAGER_CONTEXT_BYTES_BY_CAPABILITY.get(tuple(compute_capability),
                                                     EAGER_CONTEXT_BYTES)

    @property
    def zero_grad_sets_none(self) -> bool:
        """``optimizer.zero_grad()`` frees gradients (torch >= 2.0) or zeroes them in place."""
        return self.torch_version >= (2, 0)

    @property
    def foreach_default(self) -> bool:
        """CUDA optimizers default to the multi-tensor implementation (torch >= 2.0)."""
        return self.torch_version >= (2, 0)

    @property
    def softmax_saves_input(self) -> bool:
        """Autograd keeps softmax's input besides its output (torch < 1.11: the backward
        formula referenced ``self``, pytorch/pytorch#64000; #65242 removed it). The
        generated ``torch/csrc/autograd/generated/Functions.h`` of the 1.10.0 wheels
        declares ``SoftmaxBackward0`` with ``SavedVariable self_`` and ``result_``; 1.11.0's
        with ``result_`` alone."""
        return self.torch_version < (1, 11)

    @property
    def cudnn_splits_batch(self) -> bool:
        """cuDNN convolutions on tensors past 2**31 - 1 elements run in 32-bit batch pieces
        (torch < 2.0). From torch 2.0 the cuDNN v8 API is on by default (pytorch/pytorch
        #91117; ``cudnnv8_enabled_check_debug`` in ATen/native/ConvUtils.h reads
        ``TORCH_CUDNN_V8_API_DISABLED``), and Conv_v8.cpp's
        ``raw_cudnn_convolution_forward_out``/``backward_*_out`` call ``run_single_conv``
        on the whole tensors: only the v7 path calls ``split_batch_dim_to_32bit_out``."""
        return self.torch_version < (2, 0)

    @property
    def cudnn_search_empties_cache(self) -> bool:
        """In benchmark mode, the caching allocator's cache is emptied after each cuDNN
        algorithm search, and the effect is modelled (torch >= 2.0, the v8 API path).

        ``run_single_conv`` in aten/src/ATen/native/cudnn/Conv_v8.cpp: after
        ``get_plans_from_find`` (whose timing workspace is freed when it returns), "Replicate
        v7 behavior: clear cached blocks as benchmark incurs significant memory
        consumption" calls ``CUDACachingAllocator::emptyCache()`` when
        ``_cudnn_get_conv_benchmark_empty_cache()`` (true unless
        ``torch._C._cudnn_set_conv_benchmark_empty_cache(False)``, the switch
        pytorch/pytorch#101038 added in 2023 for CUDA-graph warm-up), then ``try_plans``
        allocates the kept plan's workspace. The v7 path (torch < 2.0, ``findAlgorithms``
        in Conv_v7.cpp) empties the cache too, but while the search's own workspace, the
        largest algorithm's that fits, is still held (pytorch/pytorch#50190), so that
        block stays cached afterwards; its size is cuDNN's and is not modelled, so neither
        is the emptying on those stacks."""
        return self.torch_version >= (2, 0)

    @property
    def efficient_attention_chunks_batch(self) -> bool:
        """Memory-efficient attention's forward runs a batch past the grid limit in pieces
        (torch >= 2.8): pytorch/pytorch#154029 ("SDPA fix memory efficient attention for
        large batch dim", opened 2025-05-21 before the 2.8 branch cut, closing #146704)
        makes ``_efficient_attention_forward`` in transformers/cuda/attention.cu slice
        q, k, v and the bias into batches of at most 65,535 and concatenate the outputs.
        The RTX PRO 6000 brackets with torch 2.9.1 confirm it: maxxvit's window attention
        ran a 98,304 batch there, and failed at 65,536 with torch 2.4."""
        return self.torch_version >= (2, 8)

    @property
    def autocast_caches_in_inference_mode(self) -> bool:
        """Autocast keeps its weight copies for the region under ``torch.inference_mode()``
        too (torch < 2.11; see the module docstring: pytorch/pytorch#165068)."""
        return self.torch_version < (2, 11)

    @property
    def has_sdpa(self) -> bool:
        """``F.scaled_dot_product_attention`` and its fused kernels exist (torch >= 2.0)."""
        return self.torch_version >= (2, 0)

    @property
    def math_sdpa_upcasts(self) -> bool:
        """The math backend of ``scaled_dot_product_attention`` computes fp16/bf16 inputs
        in float32 (torch >= 2.5): pytorch/pytorch#128922 ("Always use high precision for
        SDPA math backend", exported 2024-07-14, after the 2.4 release branch) makes
        ``_scaled_dot_product_attention_math`` in transformers/attention.cpp cast q, k and
        v to float32 (``query_acc = ... query_.to(at::kFloat)``), so its ``seq x seq``
        scores and softmax are float32; #135964 (September 2024, torch 2.5) added
        ``torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp`` to turn that off,
        default off. Before 2.5 the math path ran in the inputs' dtype: half the bytes."""
        return self.torch_version >= (2, 5)

    @property
    def label(self) -> str:
        """``torch 2.4 + CUDA 12.4 (cuDNN 9.1.0)``."""
        return (f"torch {self.torch_version[0]}.{self.torch_version[1]} + CUDA "
                f"{self.cuda_version[0]}.{self.cuda_version[1]} (cuDNN {cudnn_label(self.cudnn_version)})")

    def to_dict(self, compute_capability: tuple[int, int] | None = None) -> dict[str, object]:
        """The versions and what they decide; the context on ``compute_capability``'s
        architecture (:meth:`context_bytes`)."""
        return {"torch_version": ".".join(map(str, self.torch_version)),
                "cuda_version": ".".join(map(str, self.cuda_version)),
                "cudnn_version": self.cudnn_version,
                "lazy_module_loading": self.lazy_module_loading,
                "context_bytes": self.context_bytes(compute_capability)}


def cudnn_label(version: int) -> str:
    """8302 -> "8.3.2"; 90100 -> "9.1.0" (cuDNN 9 encodes major*10000 + minor*100 + patch)."""
    if version >= 90000:
        return f"{version // 10000}.{version // 100 % 100}.{version % 100}"
    return f"{version // 1000}.{version // 100 % 10}.{version % 100}"


def resolve_stack(stack: Stack | str | None) -> Stack:
    """A :class:`Stack`, a ``--stack`` string, or None for the installed stack."""
    if isinstance(stack, Stack):
        return stack
    if stack is None:
        return _installed_stack()
    if isinstance(stack, str):
        return Stack.parse(stack=stack)
    raise InvalidInputError(f"stack must be a Stack or a string like 'torch2.4+cu124', "
                            f"not {type(stack).__name__}")


_INSTALLED: Stack | None = None


def _installed_stack() -> Stack:
    global _INSTALLED
    if _INSTALLED is None:
        _INSTALLED = Stack.installed()
    return _INSTALLED


def _default_cuda(torch_v: tuple[int, int]) -> str:
    builds = _RELEASES.get(torch_v)
    if builds is None:
        return "12.8"
    cuda = max(builds)
    return f"{cuda[0]}.{cuda[1]}"


def _check_known(torch_v: tuple[int, int], cuda_v: tuple[int, int], installed: str,
                 flag: str, cuda_flag: str) -> None:
    installed_v = _version(installed, "torch", flag) if installed != "0.0" else None
    first, last = min(_RELEASES), max(max(_RELEASES), installed_v or (0, 0))
    if not (first <= torch_v <= last and torch_v[0] in (first[0], last[0])):
        raise InvalidInputError(
            f"unknown {flag} {torch_v[0]}.{torch_v[1]}: batchfit knows torch "
            f"{first[0]}.{first[1]} to {last[0]}.{last[1]}")
    if cuda_v not in _CUDA_VERSIONS:
        known = ", ".join(f"{a}.{b}" for a, b in sorted(_CUDA_VERSIONS))
        raise InvalidInputError(f"unknown {cuda_flag} {cuda_v[0]}.{cuda_v[1]}: use one of {known}")


def _cudnn_of(torch_v: tuple[int, int], cuda_v: tuple[int, int], installed: str) -> int:
    installed_v = (_version(installed, "torch", option("torch_version"))
                   if installed != "0.0" else None)
    builds = _RELEASES.get(torch_v)
    if torch_v == installed_v and (builds is None or cuda_v not in builds):
        version = _installed_cudnn()
        if version:
            return version
    if builds is None:  # a release between the table and the installed one: the nearest older
        builds = _RELEASES[max(v for v in _RELEASES if v <= torch_v)]
    if cuda_v in builds:
        return builds[cuda_v]
    nearest = min(builds, key=lambda c: (abs(c[0] - cuda_v[0]) * 100 + abs(c[1] - cuda_v[1])))
    return builds[nearest]


def _installed_cudnn() -> int:
    try:
        import torch  # noqa: PLC0415 - the installed build is the one to ask

        return int(torch.backends.cudnn.version() or 0)
    except ImportError:
        return 0
