"""The public entry points, called with a model object and inputs, or in words: a model spec
string and the CLI's option names as keywords.

``batchfit.max_batch_size("hf:meta-llama/Llama-3.2-1B", gpu="RTX 4090", seq_len=512,
lora="r=8", quant="nf4")`` answers what ``batchfit max hf:meta-llama/Llama-3.2-1B --gpu
"RTX 4090" --seq-len 512 --lora r=8 --quant nf4`` answers: both go through
:mod:`batchfit.api.answers`, which decides every default. The mapping of flags to keywords
is in ``docs/guides/python-api.md``.
"""

from __future__ import annotations

from typing import Any

from batchfit.api.answers import (
    Answer,
    estimate_words,
    max_batch_words,
    max_seq_len_words,
    plan_words,
    predict_throughput_words,
)

__all__ = ["Answer", "bench", "estimate", "max_batch_size", "max_seq_len", "noise_scale",
           "plan", "predict_throughput", "recommend_batch_size", "search_max_batch", "serve"]

#: The engine's own keywords of :func:`batchfit.realrun.search.search_max_batch`: a spec
#: string called with them (or with positional inputs) keeps going to the engine.
_SEARCH_ENGINE_WORDS = frozenset({"inputs", "config", "memory_cap_bytes", "predicted",
                                  "trial_server", "process_group", "parallel", "loader"})


def estimate(model: Any, *args: Any, **kwargs: Any) -> Any:
    """Predict the peak memory of one step.

    ``estimate(model, inputs, batch_size, config=None, *, device=..., ...)`` with a module or
    factory (:func:`batchfit.answers.estimate.estimate`); ``estimate("timm:resnet50",
    batch_size=32, gpu="A100 80GB")`` with a spec string and the CLI's names
    (:func:`batchfit.api.answers.estimate_words`, an :class:`Answer`).

    Example:
        >>> import batchfit
        >>> answer = batchfit.estimate("torchvision:resnet18", batch_size=2, device="cpu")
        >>> answer.peak_allocated_bytes > 0
        True
    """
    if isinstance(model, str):
        return estimate_words(model, *args, **kwargs)
    from batchfit.answers.estimate import estimate as estimate_module

    return estimate_module(model, *args, **kwargs)


def max_batch_size(model: Any, *args: Any, **kwargs: Any) -> Any:
    """The largest batch that fits.

    ``max_batch_size(model, inputs, config=None, *, device=..., ...)`` with a module or
    factory (:func:`batchfit.answers.maxbatch.max_batch_size`); ``max_batch_size(
    "hf:meta-llama/Llama-3.2-1B", gpu="RTX 4090", seq_len=512, lora="r=8", quant="nf4")``
    with a spec string and the CLI's names (:func:`batchfit.api.answers.max_batch_words`,
    an :class:`Answer`).

    Example:
        >>> import batchfit
        >>> answer = batchfit.max_batch_size("torchvision:resnet18", gpu="T4")
        >>> answer.max_batch_size > 0
        True
    """
    if isinstance(model, str):
        return max_batch_words(model, *args, **kwargs)
    from batchfit.answers.maxbatch import max_batch_size as max_batch_module

    return max_batch_module(model, *args, **kwargs)


def max_seq_len(model: Any, *args: Any, **kwargs: Any) -> Any:
    """The longest sequence that fits at a batch size (token models).

    ``max_seq_len(model, inputs, batch_size, config=None, *, device=..., ...)`` with a module
    or factory (:func:`batchfit.answers.maxbatch.max_seq_len`); ``max_seq_len("hf:gpt2",
    batch_size=4, gpu="T4")`` with a spec string and the CLI's names
    (:func:`batchfit.api.answers.max_seq_len_words`, an :class:`Answer`).
    """
    if isinstance(model, str):
        return max_seq_len_words(model, *args, **kwargs)
    from batchfit.answers.maxbatch import max_seq_len as max_seq_len_module

    return max_seq_len_module(model, *args, **kwargs)


def predict_throughput(model: Any, *args: Any, **kwargs: Any) -> Any:
    """Predicted step time and throughput against batch size, without the device.

    ``predict_throughput(model, inputs, config=None, *, gpu=..., ...)`` with a module or
    factory (:func:`batchfit.speed.roofline.predict_throughput`); ``predict_throughput(
    "timm:resnet50", gpu="A100 80GB", batches=[64, 128])`` with a spec string and the names
    of ``batchfit bench --predict`` (:func:`batchfit.api.answers.predict_throughput_words`,
    an :class:`Answer`).
    """
    if isinstance(model, str):
        return predict_throughput_words(model, *args, **kwargs)
    from batchfit.speed.roofline import predict_throughput as predict_module

    return predict_module(model, *args, **kwargs)


def serve(model: str, **kwargs: Any) -> Any:
    """Serving capacity of a language model on a card: KV-cache bytes per token, blocks,
    tokens and concurrent sequences (vLLM), or ``model.generate``'s peak (``engine="hf"``).

    ``serve("hf:Qwen/Qwen2.5-0.5B", gpu="A100 80GB", max_model_len=4096)`` answers what
    ``batchfit serve hf:Qwen/Qwen2.5-0.5B --gpu "A100 80GB" --max-model-len 4096`` answers,
    with the command's names as keywords (:func:`batchfit.api.serving.serve_words`, an
    :class:`Answer`; the engine is :func:`batchfit.answers.serve.serve_capacity`).

    Example:
        >>> import batchfit
        >>> answer = batchfit.serve("hf:Qwen/Qwen2.5-0.5B", gpu="A100 80GB",
        ...                         max_model_len=2048, max_num_batched_tokens=256,
        ...                         model_kwargs={"num_hidden_layers": 2})
        >>> answer.plan.num_blocks > 0
        True
    """
    from batchfit.api.serving import serve_words

    return serve_words(model, **kwargs)


def plan(model: Any, *args: Any, **kwargs: Any) -> Any:
    """Multi-GPU layouts of a global batch ranked by predicted step time, with memory per GPU.

    ``plan(model, inputs, config=None, *, gpus=..., global_batch=..., ...)`` with a module
    or factory (:func:`batchfit.speed.plan.plan`); ``plan("hf:meta-llama/Meta-Llama-3-8B",
    gpus="8xH100 SXM", global_batch=64, seq_len=2048)`` with a spec string and the names of
    ``batchfit plan`` (:func:`batchfit.api.answers.plan_words`, an :class:`Answer`; a 16-bit
    Hugging Face checkpoint trains in mixed precision in its dtype unless ``precision=``
    says otherwise).
    """
    if isinstance(model, str):
        return plan_words(model, *args, **kwargs)
    from batchfit.speed.plan import plan as plan_module

    return plan_module(model, *args, **kwargs)


def bench(model: Any, *args: Any, **kwargs: Any) -> Any:
    """Throughput against batch size on a real device, and the fastest batch.

    ``bench(model, inputs, config=None, *, device=..., memory_bytes=..., ...)`` with a
    module or factory (:func:`batchfit.speed.bench.bench`); ``bench("timm:resnet18",
    device="cpu", memory="4GiB", batches="16,32")`` with a spec string and the names of
    ``batchfit bench`` (:func:`batchfit.api.measured.bench_words`, an :class:`Answer`;
    ``predict=True, gpu=NAME`` predicts instead of measuring).

    Example:
        >>> import batchfit
        >>> answer = batchfit.bench("torchvision:resnet18", device="cpu", memory="4GiB",
        ...                         batches="1,2", input_shape="3x64x64", time_budget="30s")
        >>> answer.recommended_batch_size in (1, 2)
        True
    """
    if isinstance(model, str):
        from batchfit.api.measured import bench_words

        return bench_words(model, *args, **kwargs)
    from batchfit.speed.bench import bench as bench_module

    return bench_module(model, *args, **kwargs)


def search_max_batch(model: Any, *args: Any, **kwargs: Any) -> Any:
    """The exact largest batch on the real device, in a few real steps from the prediction.

    ``search_max_batch(model, inputs=None, config=None, *, device=..., memory_cap_bytes=...,
    ...)`` with a module, a factory or a model spec (:func:`batchfit.realrun.search.
    search_max_batch`); ``search_max_batch("timm:resnet18", device="cpu",
    memory_cap="2GiB", input_shape="3x64x64")`` with a spec string and the names of
    ``batchfit search`` (:func:`batchfit.api.measured.search_words`, an :class:`Answer`).
    A spec string with positional inputs or the engine's keywords (``memory_cap_bytes``,
    ``config``...) goes to the engine, as before.

    Example:
        >>> import batchfit
        >>> answer = batchfit.search_max_batch("torchvision:resnet18", device="cpu",
        ...                                    memory_cap="512MiB", input_shape="3x64x64",
        ...                                    boundary_runs=1)
        >>> answer.max_batch_size > 0
        True
    """
    if isinstance(model, str) and not args and not _SEARCH_ENGINE_WORDS & kwargs.keys():
        from batchfit.api.measured import search_words

        return search_words(model, **kwargs)
    from batchfit.realrun.search import search_max_batch as search_module

    return search_module(model, *args, **kwargs)


def noise_scale(model: Any, *args: Any, **kwargs: Any) -> Any:
    """The gradient noise scale ``B_simple`` of a model on its data.

    ``noise_scale(model, loss_fn, data, *, batch_small=..., ...)`` with a module
    (:func:`batchfit.stats.measure.noise_scale`); ``noise_scale("train.py:workload",
    batch_small=8, batch_big=64)`` with a workload file and the names of ``batchfit noise``
    (:func:`batchfit.api.noise.noise_words`, whose ``to_dict()`` is the command's
    ``--json``).
    """
    if isinstance(model, str):
        from batchfit.api.noise import noise_words

        return noise_words(model, *args, **kwargs)
    from batchfit.stats.measure import noise_scale as noise_module

    return noise_module(model, *args, **kwargs)


def recommend_batch_size(noise: Any, *args: Any, **kwargs: Any) -> Any:
    """The batch that reaches a target loss soonest.

    ``recommend_batch_size(b_noise, points, *, max_batch_size=..., ...)`` with a noise scale
    and a step-time curve (:func:`batchfit.stats.recommend.recommend_batch_size`);
    ``recommend_batch_size("train.py:workload", gpu="A100 80GB", predict=True)`` with a
    workload file and the names of ``batchfit recommend``
    (:func:`batchfit.api.noise.recommend_words`, whose ``to_dict()`` is the command's
    ``--json``).
    """
    if isinstance(noise, str):
        from batchfit.api.noise import recommend_words

        return recommend_words(noise, *args, **kwargs)
    from batchfit.stats.recommend import recommend_batch_size as recommend_module

    return recommend_module(noise, *args, **kwargs)
