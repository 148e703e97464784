"""Serving capacity asked in words: ``serve_words("hf:NAME", gpu="A100 80GB",
max_model_len=4096)`` answers what ``batchfit serve hf:NAME --gpu "A100 80GB" --max-model-len
4096`` answers (flag ``--gpu-memory-utilization`` -> keyword ``gpu_memory_utilization``,
``--non-torch`` -> ``non_torch``, ``--total-memory`` -> ``total_memory``). Every default is
:func:`batchfit.answers.serve.serve_capacity`'s; the command line passes only what the user
gave. :func:`batchfit.serve` sends a spec string here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from batchfit.api.answers import Answer, StatusFn, _split
from batchfit.api.target import chosen

#: The keywords of ``batchfit serve``'s options, as its flags name them.
SERVE_WORDS = ("engine", "max_model_len", "gpu_memory_utilization", "dtype", "kv_dtype",
               "block_size", "max_num_batched_tokens", "max_num_seqs", "batch_size",
               "prompt_len", "new_tokens", "quant", "all_logits", "vllm_engine")


def serve_words(model: str, *, gpu: str, non_torch: str | None = None,
                total_memory: str | None = None,
                model_kwargs: Sequence[str] | Mapping[str, Any] | None = None,
                on_status: StatusFn | None = None, **words: Any) -> Answer:
    """Serving capacity of the language model named ``model`` (``hf:NAME``) on the catalog
    card ``gpu``. ``non_torch`` and ``total_memory`` are sizes (``"0.35GiB"``); ``words``:
    the other options of ``batchfit serve`` as keywords (:data:`SERVE_WORDS`). The answer
    says which catalog card ``gpu`` was taken for (``gpu_choice``), with a note where the name
    could mean another."""
    from batchfit.answers.serve import serve_capacity
    from batchfit.api.step import _model_kwargs
    from batchfit.device.catalog import find_gpu
    from batchfit.device.profile import gpu_profile
    from batchfit.engine.spec import parse_size

    (options,) = _split(words, SERVE_WORDS)
    profile = gpu_profile(find_gpu(gpu))
    if on_status is not None:
        on_status(f"tracing {model}'s profile forward on {gpu}")
    result = serve_capacity(
        model, device=profile,
        non_torch_bytes=None if non_torch is None else parse_size(non_torch, allow_zero=True),
        total_memory_bytes=None if total_memory is None else parse_size(total_memory),
        model_kwargs=_model_kwargs(model_kwargs), **options)
    choices, notes = chosen(gpu, None)
    return Answer(model, result, choices, tuple(notes))
