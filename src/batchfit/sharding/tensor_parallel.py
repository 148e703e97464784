"""Tensor parallel through DTensor's ``parallelize_module``, with the model's own plan.

Hugging Face models of the Llama family (Llama, Mistral, Qwen2, Phi-3...) ship their
tensor-parallel plan: ``config.base_model_tp_plan`` for the decoder layers (q, k, v and
the MLP's gate and up projections column-wise, o and down row-wise) and the model's
``_tp_plan`` for the head (``colwise_gather_output``: column-wise with the logits
gathered) and the embedding (``embedding_rowwise``: vocabulary rows sharded). Each style maps to torch's ``ParallelStyle`` (:data:`_STYLES`), and
``parallelize_module`` applies them on the ``tp`` dimension of the mesh; with a larger
world, FSDP2 then shards over the ``dp`` dimension (2-D).

Sequence parallelism is not applied: Hugging Face's decoder builds its causal mask and
position ids from the embedding output's sequence length, which sequence parallelism
would shard (the masks would not match the gathered attention inputs), so the model's
own plan, without it, is what runs. Activations between the sharded matmuls (the norms,
the residual stream) stay whole on every rank, as they do under that plan.

Example:
    >>> sorted(_STYLES)[:3]
    ['colwise', 'colwise_gather_output', 'colwise_rep']
"""

from __future__ import annotations

from typing import Any

from torch import nn

from batchfit.errors import InvalidInputError, option


def _styles() -> dict[str, Any]:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {
        "colwise": lambda: ColwiseParallel(),
        "rowwise": lambda: RowwiseParallel(),
        "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
        "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
        "rowwise_rep": lambda: RowwiseParallel(input_layouts=Replicate()),
        # the vocabulary rows of an embedding sharded, the lookup summed over the ranks
        # (torch's documented plan for an nn.Embedding)
        "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
    }


_STYLES = ("colwise", "rowwise", "colwise_rep", "colwise_gather_output", "rowwise_rep",
           "embedding_rowwise")


def tp_plan(model: nn.Module) -> dict[str, str]:
    """The model's tensor-parallel plan: module path pattern -> style name."""
    config = getattr(model, "config", None)
    base = getattr(config, "base_model_tp_plan", None)
    if not base:
        raise InvalidInputError(
            f"{type(model).__name__} has no tensor-parallel plan: {option('strategy', 'tp')} "
            "uses the "
            "plan Hugging Face models of the Llama family ship (config.base_model_tp_plan)")
    prefix = getattr(model, "base_model_prefix", "")
    if prefix and not hasattr(model, prefix):
        prefix = ""
    plan = {f"{prefix}.{key}" if prefix else key: style for key, style in base.items()}
    plan.update(getattr(model, "_tp_plan", None) or {})
    return plan


def parallelize(model: nn.Module, tp_mesh: Any) -> None:
    """Apply the model's plan (:func:`tp_plan`) on ``tp_mesh``, in place."""
    from torch.distributed.tensor.parallel import parallelize_module

    plan = tp_plan(model)
    degree = tp_mesh.size()
    _check_heads(model, degree)
    styles = _styles()
    unknown = sorted({style for style in plan.values() if style not in styles})
    if unknown:
        raise InvalidInputError(
            f"{type(model).__name__}'s tensor-parallel plan uses {', '.join(unknown)}, "
            f"which batchfit does not map: it maps {', '.join(_STYLES)}")
    parallelize_module(model, tp_mesh, {path: styles[style]() for path, style in plan.items()})


def _check_heads(model: nn.Module, degree: int) -> None:
    config = getattr(model, "config", None)
    for name in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(config, name, None)
        if isinstance(heads, int) and heads % degree:
            raise InvalidInputError(
                f"{option('tp', degree)} does not divide the model's {name} ({heads}): each rank "
                "must hold whole attention heads")
