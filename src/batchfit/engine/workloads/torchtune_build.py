"""torchtune's QLoRA model build on the GPU, and what it leaves in the caching allocator.

torchtune builds the model on the training device in the recipe's dtype and quantizes each
base weight there, one linear at a time, then loads the checkpoint into it:

* ``_setup_model`` (recipes/lora_finetune_single_device.py, torchtune commit 0914d5cfb line
  254; bd2a0fc7c line 410): ``with set_default_dtype(self._dtype), self._device: model =
  config.instantiate(cfg_model)``, then ``model.load_state_dict(base_model_state_dict)``;
* ``LoRALinear._create_weight_and_bias`` (torchtune/modules/peft/lora.py, 0914d5cfb line 91;
  bd2a0fc7c line 82): ``linear = nn.Linear(in_dim, out_dim)`` (a bf16 weight on the GPU),
  ``weight = to_nf4(linear.weight)``; the bf16 weight dies when the method returns, before
  the next linear is built;
* the checkpoint is a CPU state dict (``safe_torch_load``: ``torch.load(map_location="cpu")``);
  ``load_state_dict`` calls ``param.copy_(cpu_weight)`` on each NF4 parameter, which moves the
  weight to the GPU and quantizes it again there: torchtune's ``inplace_copy``
  (torchtune/utils/_register_nf4_dispatch_ops.py at 0914d5cfb: ``to_nf4(args[0][1].to(
  dest_tensor.device))``, then the parameter takes the new tensors and drops its old ones)
  for torchtune before 0.2 (torchao 0.1); torchao's own ``copy_`` from torchtune 0.2 on
  (torchao nf4tensor.py ``copy_``: ``NF4Tensor.from_tensor(copy_in.to(original.device),
  ...)``, then ``original.copy_(copy_in_nf4)`` copies into the parameter's tensors).

Every bf16 weight and every quantization temporary is freed, but the caching allocator keeps
the segments it cudaMalloc'd for them, and the NF4 tensors made between the temporaries sit
in those segments, so the cache cannot be returned whole. The step then runs on that cache.

``to_nf4`` (``NF4Tensor.from_tensor``, torchao nf4tensor.py) differs by release in its
temporaries:

* torchao 0.1 (pinned ``torchao==0.1`` by torchtune 0.1.0 and 0.1.1, pyproject.toml;
  torchao tag v0.1, commit ff28895) compares every value with the 16 NF4 levels at once:
  ``quantize_tensor_nearest``: ``diff = (value.unsqueeze(-1) - nf4).abs()``, two
  ``numel x 16`` tensors in the weight's dtype (32 bytes per bf16 weight value, 1.44 GB each
  for a Llama-2-7B MLP weight), then ``diff.min(dim=-1)``;
* from torchao 0.2.0 (commit 6081796 "perform in chunks (#196)"; torchtune 0.2.0 pins 0.3.1)
  ``convert_to_norm_float_weight`` fills a ``uint8`` buffer ``CHUNK_SIZE`` = 1024**2 values
  at a time, so those temporaries are 32 MiB each. The steps follow torchao at commit
  36027d82d (torchao/quantization/quantize_/workflows/nf4/nf4_tensor.py), which also keeps
  ``quantization_factor[:, 0].contiguous()`` instead of the whole factor as 0.1 does.

Before torchtune 0.6.0 the builder makes one layer and ``TransformerDecoder`` deep-copies it
into every layer (``_get_clones`` in torchtune/modules/transformer.py: ``copy.deepcopy(module)
for i in range(n)``; the per-layer loop came with commit 23896c30d, "Update model builders
(#2282)", first in v0.6.0). Copying an NF4 parameter calls ``clone``, which torchtune
registers as ``to_nf4(args[0][0].get_original_weight())`` (_register_nf4_dispatch_ops.py):
each copy dequantizes the template's weight to bf16 and quantizes it again.

What is modelled (:func:`record_build`): the build (each 4-bit layer's bf16 weight,
``to_nf4``'s temporaries in the source's order, the weight freed; before 0.6 the template
layer built so, then the embedding, output and final norm (``lora_llama2`` makes them before
``TransformerDecoder`` copies the layer, models/llama2/_component_builders.py at 0914d5cfb),
each layer then dequantized from the template and quantized again, the template freed),
then the rest of the model, then the load (the checkpoint weight copied to the GPU,
``to_nf4`` again, one set of NF4 tensors freed). The kept NF4 tensors are the trace's own
quantized weights (bitsandbytes' packed data and absmax: close to torchao's ``n/2 + 3n/64``
bytes but not equal), placed where ``to_nf4`` makes its own. Left out: the LoRA adapters and
norms made between the linears (a few KB to MB each, small-pool or shared segments),
and torchao's kept scalars (the mean, the 16-value table).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

#: torchao's NF4 block sizes (``to_nf4(tensor, block_size=64, scaler_block_size=256)``).
BLOCK_SIZE = 64
SCALER_BLOCK_SIZE = 256
#: torchao nf4tensor.py ``CHUNK_SIZE = 1024**2`` (from 0.2.0).
CHUNK_SIZE = 1024**2
#: The first torchtune release on torchao >= 0.2 (chunked ``to_nf4``, torchao's ``copy_``).
CHUNKED_TORCHTUNE = (0, 2, 0)
#: The first torchtune release that builds every layer instead of deep-copying one.
LAYER_LOOP_TORCHTUNE = (0, 6, 0)
_INDEX_BYTES = 8  # max()/min() indices are int64
#: The recipe's dtype, bf16 (torchao 0.1's ``from_tensor`` asserts ``torch.bfloat16``).
_BF16 = 2


class BuildStep(StrEnum):
    """What one entry of :func:`to_nf4_steps` does."""

    ALLOC = "alloc"  # a temporary is allocated
    FREE = "free"  # a temporary dies
    KEEP_SCALERS = "keep_scalers"  # the NF4 tensor's scalers now exist
    KEEP_DATA = "keep_data"  # the NF4 tensor's packed data now exists


@dataclass(frozen=True)
class BuildOp:
    """One step of ``to_nf4``: a temporary ``name`` of ``nbytes`` allocated or freed, or the
    point where the kept tensors appear."""

    step: BuildStep
    name: str = ""
    nbytes: int = 0


def _alloc(name: str, nbytes: int) -> BuildOp:
    return BuildOp(BuildStep.ALLOC, name, nbytes)


def _free(*names: str) -> list[BuildOp]:
    return [BuildOp(BuildStep.FREE, name) for name in names]


def _block_absmax(tag: str, values: int, block: int, element_bytes: int) -> list[BuildOp]:
    """``get_block_absmax``: ``blocks.abs().max(dim=1).values``: the ``abs`` copy and the
    indices die, the maxima (``{tag}``) stay."""
    blocks = values // block
    return [_alloc(f"{tag}.abs", values * element_bytes), _alloc(tag, blocks * element_bytes),
            _alloc(f"{tag}.indices", blocks * _INDEX_BYTES), *_free(f"{tag}.abs", f"{tag}.indices")]


def _double_quantize_scalers(numel: int, w: int, chunked: bool) -> list[BuildOp]:
    """``NF4Tensor.double_quantize_scalers``; ``w`` is the weight's element size."""
    n_blocks = numel // BLOCK_SIZE
    ops = _block_absmax("scalers_1", numel, BLOCK_SIZE, w)
    ops += [_alloc("scalers_1 - mean", n_blocks * w), *_free("scalers_1")]
    ops += _block_absmax("scaler_absmax", n_blocks, SCALER_BLOCK_SIZE, w)
    # ``256 / (2 * scaler_absmax)`` on the expanded (n_scaler_blocks, 256) view: n_blocks
    # values each; ``256 / t`` is ``t.reciprocal() * 256`` (torch/_tensor.py ``__rdiv__``)
    ops += [_alloc("2 * scaler_absmax", n_blocks * w), _alloc("reciprocal", n_blocks * w)]
    if chunked:  # later releases keep ``quantization_factor[:, 0].contiguous()`` only
        ops.append(_alloc("quantization_factor", n_blocks * w))
    ops += _free("reciprocal", "2 * scaler_absmax")  # 0.1 keeps the factor (a view of it)
    ops += [_alloc("scaled", n_blocks * w), _alloc("round", n_blocks * w), *_free("scaled"),
            _alloc("clamp", n_blocks * w), *_free("round")]
    ops.append(BuildOp(BuildStep.KEEP_SCALERS))  # ``.to(torch.int8)``: the kept scalers
    ops += _free("clamp", "scalers_1 - mean", "scaler_absmax")
    if chunked:
        ops += _free("quantization_factor")
    return ops


def _nearest(tag: str, values: int, w: int) -> list[BuildOp]:
    """``quantize_tensor_nearest``: ``(value.unsqueeze(-1) - nf4).abs().min(dim=-1).indices``
    over ``values`` values: two ``values x 16`` tensors, then the minima and their indices."""
    return [_alloc(f"{tag}value - nf4", values * 16 * w), _alloc(f"{tag}diff", values * 16 * w),
            *_free(f"{tag}value - nf4"), _alloc(f"{tag}min", values * w),
            _alloc(f"{tag}indices", values * _INDEX_BYTES), *_free(f"{tag}min", f"{tag}diff")]


def _chunk_sizes(numel: int) -> list[int]:
    """The chunks whose temporaries the replay needs: every full chunk frees all it makes
    and leaves the allocator as it found it, so one full chunk stands for all of them."""
    full, rest = divmod(numel, CHUNK_SIZE)
    return [CHUNK_SIZE] * min(full, 1) + [rest] * bool(rest)


def _norm_float_weight(numel: int, w: int, chunked: bool) -> list[BuildOp]:
    """``NF4Tensor.convert_to_norm_float_weight``."""
    ops = _block_absmax("scalers", numel, BLOCK_SIZE, w)
    ops.append(_alloc("scaled_blocks", numel * w))  # ``blocks / scales``
    if not chunked:  # torchao 0.1: one pass; ``<< 4`` and ``|`` on the int64 indices
        ops += _nearest("", numel, w)
        ops += [_alloc("<< 4", numel // 2 * _INDEX_BYTES), _alloc("|", numel // 2 * _INDEX_BYTES),
                *_free("<< 4"), BuildOp(BuildStep.KEEP_DATA), *_free("|", "indices")]
    else:  # a uint8 buffer filled chunk by chunk; ``<< 4 |`` on uint8 is the kept data
        ops.append(_alloc("quantized_blocks", numel))
        for size in _chunk_sizes(numel):
            tag = f"chunk {size}: "
            ops += _nearest(tag, size, w)
            ops += [_alloc(f"{tag}uint8", size), *_free(f"{tag}indices", f"{tag}uint8")]
        ops += [_alloc("<< 4", numel // 2), BuildOp(BuildStep.KEEP_DATA), *_free("<< 4"),
                *_free("quantized_blocks")]
    return ops + _free("scaled_blocks", "scalers")


def to_nf4_steps(numel: int, element_bytes: int, chunked: bool) -> tuple[BuildOp, ...]:
    """The allocations of torchao's ``to_nf4`` on a weight of ``numel`` values, in order
    (``NF4Tensor.from_tensor``: ``double_quantize_scalers``, then
    ``convert_to_norm_float_weight``); ``chunked``: torchao 0.2.0 on.

    Example:
        >>> steps = to_nf4_steps(64 * 256, 2, chunked=False)
        >>> max(s.nbytes for s in steps) == 64 * 256 * 16 * 2
        True
    """
    return tuple(_double_quantize_scalers(numel, element_bytes, chunked)
                 + _norm_float_weight(numel, element_bytes, chunked))


def dequantize_steps(numel: int, element_bytes: int) -> tuple[BuildOp, ...]:
    """The allocations of torchao's ``NF4Tensor.get_original_weight`` on a weight of
    ``numel`` values (the same from torchao 0.1 to 0.14); its result, ``original``
    (``numel`` values in the weight's dtype), is left alive.

    Example:
        >>> steps = dequantize_steps(64 * 256, 2)
        >>> [s.nbytes for s in steps if s.name == "first_elements"]
        [65536]
    """
    half, w = numel // 2, element_bytes
    n_blocks = numel // BLOCK_SIZE
    ops = [_alloc(">> 4", half), _alloc("first_elements", half * _INDEX_BYTES), *_free(">> 4"),
           _alloc("& 0b1111", half), _alloc("second_elements", half * _INDEX_BYTES),
           *_free("& 0b1111"), _alloc("dequantized_first", half * w),
           _alloc("dequantized_second", half * w)]
    # ``dequantize_scalers``: ``(quantized_scalers / quantization_factor).flatten() + mean``
    ops += [_alloc("/ factor", n_blocks * w), _alloc("scalers", n_blocks * w), *_free("/ factor")]
    for name in ("scaled_first", "scaled_second"):  # ``dequantized * repeated.flatten()``
        ops += [_alloc(f"repeated for {name}", half * w), _alloc(name, half * w),
                *_free(f"repeated for {name}")]
    ops.append(_alloc("original", numel * w))  # ``torch.stack([...], dim=-1)``
    return tuple(ops + _free("first_elements", "second_elements", "dequantized_first",
                             "dequantized_second", "scalers", "scaled_first", "scaled_second"))


def builds_on_device(config: Any) -> bool:
    """Whether the step's model is built as torchtune's QLoRA recipe builds it."""
    from batchfit.engine.workloads.recipes import Recipe

    return config.recipe is Recipe.TORCHTUNE and config.quant is not None


def _state_tensors(module: Any) -> list[Any]:
    from batchfit.engine.workloads.quantstate import state_tensors

    return state_tensors(module.quant_state)


def _replay(tracer: Any, steps: tuple[BuildOp, ...], keep: Any, op: str) -> None:
    """Record ``steps`` as events; ``keep(step)`` records the kept tensors at their point."""
    from batchfit.engine.tracer import Category

    live: dict[str, tuple[int, int]] = {}
    for step in steps:
        if step.step is BuildStep.ALLOC:
            live[step.name] = (tracer.transient(step.nbytes, Category.TEMPORARIES, op),
                               step.nbytes)
        elif step.step is BuildStep.FREE:
            uid, nbytes = live.pop(step.name)
            tracer.release(uid, nbytes, Category.TEMPORARIES)
        else:
            keep(step.step)


Layer = tuple[str, Any, int]  # a 4-bit layer's path, module and weight values
_DECODER_LAYER = re.compile(r"(^|\.)layers\.\d+\.")


def _layers(twin: Any) -> tuple[list[list[Layer]], list[Layer]]:
    """The 4-bit layers in build order: those of each decoder layer (``...layers.<i>.``),
    and the others."""
    import bitsandbytes as bnb

    decoder: dict[str, list[Layer]] = {}
    others: list[Layer] = []
    for path, module in twin.named_modules():
        if isinstance(module, bnb.nn.Linear4bit):
            layer = (path, module, module.in_features * module.out_features)
            _check_quantizable(path, layer[2])
            found = _DECODER_LAYER.search(path)
            if found:
                decoder.setdefault(path[:found.end()], []).append(layer)
            else:
                others.append(layer)
    return list(decoder.values()), others


def _check_quantizable(path: str, numel: int) -> None:
    """torchao's ``from_tensor`` asserts ``numel % block_size == 0`` and
    ``double_quantize_scalers`` ``n_blocks % scaler_block_size == 0``: torchtune cannot
    quantize a weight whose size is not a multiple of 64 x 256 values."""
    from batchfit.errors import InvalidInputError, option

    if numel % (BLOCK_SIZE * SCALER_BLOCK_SIZE):
        raise InvalidInputError(
            f"{option('recipe', 'torchtune')} quantizes with torchao's to_nf4, which needs each "
            f"weight's size to be a multiple of {BLOCK_SIZE * SCALER_BLOCK_SIZE:,} values "
            f"(blocks of {BLOCK_SIZE}, {SCALER_BLOCK_SIZE} block scales per scaler block): "
            f"{path} has {numel:,}; drop {option('quant')} or use another recipe")


def _keeper(tracer: Any, module: Any, made: list[tuple[int, int]] | None = None,
            category: Any = None) -> Any:
    """Where ``to_nf4`` makes its NF4 tensors: ``module``'s (the trace's) are registered, or,
    with ``made``, tensors of their sizes recorded in ``category`` and listed there."""
    from batchfit.engine.tracer import Category

    def keep(step: BuildStep) -> None:
        tensors = _state_tensors(module) if step is BuildStep.KEEP_SCALERS else [module.weight]
        for tensor in tensors:
            if made is None:
                tracer.register(tensor, Category.PARAMETERS)
            else:
                size = _nbytes(tensor)
                made.append((tracer.transient(size, category, "to_nf4"), size))

    return keep


def _record_linear(tracer: Any, path: str, keep: Any, numel: int, chunked: bool) -> None:
    """``nn.Linear`` in bf16 on the device, ``to_nf4`` of its weight, the weight freed."""
    from batchfit.engine.tracer import Category

    weight = tracer.transient(numel * _BF16, Category.TEMPORARIES, f"nn.Linear {path}")
    _replay(tracer, to_nf4_steps(numel, _BF16, chunked), keep, f"to_nf4 {path}")
    tracer.release(weight, numel * _BF16, Category.TEMPORARIES)


def _record_copies(tracer: Any, twin: Any, decoder: list[list[Layer]], chunked: bool) -> None:
    """Before 0.6: the first decoder layer built as a template, then the embedding, output
    and final norm (``lora_llama2`` makes them before ``TransformerDecoder(layer=layer,
    norm=RMSNorm(...), ...)`` runs), every layer deep-copied from the template (each NF4
    weight dequantized and quantized again), the template freed."""
    from batchfit.engine.tracer import Category

    template: list[tuple[int, int]] = []
    for path, module, numel in decoder[0]:
        _record_linear(tracer, path, _keeper(tracer, module, template, Category.TEMPORARIES),
                       numel, chunked)
    for name, parameter in twin.named_parameters():
        if not _DECODER_LAYER.search(name):
            tracer.register(parameter, Category.PARAMETERS)
    for layer in decoder:
        for (path, module, numel), (_, _, source_numel) in zip(layer, decoder[0]):
            steps = (dequantize_steps(source_numel, _BF16)
                     + to_nf4_steps(numel, _BF16, chunked) + tuple(_free("original")))
            _replay(tracer, steps, _keeper(tracer, module), f"clone {path}")
    for uid, size in template:
        tracer.release(uid, size, Category.TEMPORARIES)


def record_build(twin: Any, tracer: Any, torchtune_version: tuple[int, int, int] | None) -> None:
    """Record torchtune's QLoRA model build, before the step (module docstring).

    ``twin`` is the fake model with its 4-bit layers; its parameters, buffers and quantized
    weights' state are registered here, in build order (the driver's registration then
    finds them recorded). ``torchtune_version`` None: the release the recipe follows.
    """
    from batchfit.engine.tracer import Category

    chunked = torchtune_version is None or torchtune_version >= CHUNKED_TORCHTUNE
    copies = torchtune_version is not None and torchtune_version < LAYER_LOOP_TORCHTUNE
    decoder, others = _layers(twin)
    every = [layer for group in decoder for layer in group] + others
    if copies and decoder:
        _record_copies(tracer, twin, decoder, chunked)
    for path, module, numel in others if copies and decoder else every:
        _record_linear(tracer, path, _keeper(tracer, module), numel, chunked)
    for parameter in twin.parameters():
        tracer.register(parameter, Category.PARAMETERS)
    for buffer in twin.buffers():
        tracer.register(buffer, Category.BUFFERS)
    for path, module, numel in every:
        _record_load(tracer, path, module, numel, chunked)


def _record_load(tracer: Any, path: str, module: Any, numel: int, chunked: bool) -> None:
    """``param.copy_(cpu_weight)`` on one NF4 parameter: the weight moved to the GPU,
    quantized, then one set of NF4 tensors freed (the new ones after torchao's in-place
    ``copy_``; the parameter's old ones when torchtune 0.1 swaps them in)."""
    from batchfit.engine.tracer import Category

    moved = tracer.transient(numel * _BF16, Category.TEMPORARIES, f"Tensor.to {path}")
    old = [(uid, _nbytes(tensor)) for tensor in [*_state_tensors(module), module.weight]
           for uid in tracer.uids(tensor)]
    new: list[tuple[int, int]] = []
    _replay(tracer, to_nf4_steps(numel, _BF16, chunked),
            _keeper(tracer, module, new, Category.PARAMETERS), f"to_nf4 {path}")
    if not chunked:  # torchtune 0.1: ``ref_tensor = to_nf4(w.to(device))``, then the swap
        tracer.release(moved, numel * _BF16, Category.TEMPORARIES)
    for uid, size in new if chunked else old:
        tracer.release(uid, size, Category.PARAMETERS)
    if chunked:
        tracer.release(moved, numel * _BF16, Category.TEMPORARIES)


def _nbytes(tensor: Any) -> int:
    return tensor.untyped_storage().nbytes()
