"""``@batchfit.find_batch_size``: accelerate's ``find_executable_batch_size``, seeded by
batchfit's prediction and able to search upward.

accelerate starts at a guess (128) and multiplies by 0.9 after every out-of-memory error,
so it only ever goes down and stops at the first size that runs, which can be far below
the largest. This decorator starts just below the prediction (or at a given batch size),
goes up while the function runs, and returns only once the largest batch size B ran and
B + 1 ran out of memory (the search of :mod:`batchfit.integrations._trials`).

Each candidate is one call of the function, in this process. So write the function as a
*trial*: build (or reset) what it trains and run a few steps (two or more: the first step
creates the optimizer state), as accelerate's examples do; then train for real at the batch
size found. A function that trains for an hour costs an hour per trial.
"""

from __future__ import annotations

import functools
import inspect
import time
from collections.abc import Callable
from typing import Any

from batchfit.errors import InvalidInputError
from batchfit.integrations._trials import (
    FoundBatchSize,
    SearchLimits,
    search_in_process,
)
from batchfit.realrun.boundary import DEFAULT_MAX_BATCH_LIMIT


def find_batch_size(function: Callable[..., Any] | None = None, *, predicted: Any = None,
                    model: Any = None, inputs: Any = None, config: Any = None,
                    device: Any = None, memory_bytes: int | None = None,
                    max_batch_size: int = DEFAULT_MAX_BATCH_LIMIT, max_trials: int = 32,
                    approach: float = 0.1, headroom: float = 0.05,
                    **options: Any) -> Any:
    """Decorate ``function(batch_size, ...)`` to run it at the largest batch size that fits.

    The decorated function is called without ``batch_size``; the decorator passes it as the
    first argument. Out-of-memory errors (:func:`batchfit.realrun.trial.is_out_of_memory`) mean
    "does not fit": the error's frames are released, garbage is collected, CUDA's cache is
    emptied, and another size is tried. Any other error propagates unchanged.

    The search starts from one of:

    * ``predicted``: a predicted largest batch (an int or a
      :class:`~batchfit.answers.maxbatch.MaxBatchResult`); the first call is ``approach`` below it
      (``approach=0`` starts exactly there, like accelerate's ``starting_batch_size``).
    * ``model`` and ``inputs`` (with ``config``/``options``, ``device``, ``memory_bytes``):
      the prediction is :func:`batchfit.max_batch_size` of them, computed at each call.

    Args:
        function: the function to decorate (when used as ``@find_batch_size(...)``, None).
        predicted: the predicted largest batch size.
        model: the model of the prediction (:func:`batchfit.max_batch_size`'s).
        inputs: its inputs, as :func:`batchfit.max_batch_size` takes them.
        config: its training config.
        device: the device of the prediction.
        memory_bytes: the memory of the prediction's device.
        options: further keywords of :func:`batchfit.max_batch_size`.
        max_batch_size: never call the function with more.
        max_trials: call the function at most this many times; when they run out, the
            result holds the largest size that ran (``search.confirmed`` is then False).
        approach: the first call's margin below the prediction, a fraction of it.
        headroom: ``search.recommended_batch_size`` is the maximum less this fraction.

    Returns:
        The decorated function. Calling it returns a
        :class:`~batchfit.integrations.FoundBatchSize`: ``batch_size`` (the largest that
        ran), ``value`` (what the function returned at that size; the value of the current
        best call is kept while the search goes on, so return a metric, not the model) and
        ``search`` (the trials).

    Raises:
        InvalidInputError: no seed, or both seeds, or a bad option (at decoration time);
            ``batch_size`` passed by the caller (at call time, before any trial: as a
            keyword, or positionally when that leaves too many positional arguments; like
            accelerate's guard, it cannot see a positional batch size that shifts into a
            parameter with a default).
        DoesNotFitError: even batch size 1 ran out of memory.

    Example:
        >>> import torch
        >>> @find_batch_size(predicted=100)
        ... def trial(batch_size):
        ...     if batch_size > 100:  # stands in for a step that runs out of memory
        ...         raise torch.OutOfMemoryError("CUDA out of memory")
        ...     return batch_size * 2
        >>> found = trial()
        >>> found.batch_size, found.value, [t.batch_size for t in found.search.trials]
        (100, 200, [90, 100, 101])
    """
    limits = SearchLimits(max_batch_size=max_batch_size, max_trials=max_trials,
                          approach=approach, headroom=headroom)
    seed = _Seed.of(predicted, model, inputs, config, device, memory_bytes, options)
    if function is None:
        return functools.partial(_decorate, seed=seed, limits=limits)
    return _decorate(function, seed=seed, limits=limits)


class _Seed:
    """Where the search starts: a fixed prediction, or one computed at each call."""

    def __init__(self, predicted: int | None, prediction: dict[str, Any] | None):
        self.predicted = predicted
        self.prediction = prediction

    @classmethod
    def of(cls, predicted: Any, model: Any, inputs: Any, config: Any, device: Any,
           memory_bytes: Any, options: dict[str, Any]) -> _Seed:
        if predicted is not None and model is not None:
            raise InvalidInputError("give either predicted= or model= (and inputs=), not both")
        if predicted is not None:
            predicted = getattr(predicted, "max_batch_size", predicted)
            if isinstance(predicted, bool) or not isinstance(predicted, int) or predicted < 1:
                raise InvalidInputError(
                    f"predicted must be a positive batch size or a MaxBatchResult, not {predicted!r}")
            return cls(predicted, None)
        if model is None:
            raise InvalidInputError(
                "find_batch_size needs a seed: predicted=N (e.g. predicted=128, with "
                "approach=0 to start exactly there), or model=..., inputs=... and "
                "device=/memory_bytes= for batchfit's prediction")
        if inputs is None:
            raise InvalidInputError("model= needs inputs=, the per-sample input, e.g. (3, 224, 224)")
        return cls(None, {"model": model, "inputs": inputs, "config": config, "device": device,
                          "memory_bytes": memory_bytes, **options})

    def resolve(self, limit: int) -> int:
        if self.prediction is None:
            return self.predicted  # type: ignore[return-value]
        from batchfit.answers.maxbatch import max_batch_size
        from batchfit.answers.solve import NothingFits

        arguments = {"max_batch_limit": limit, **self.prediction}
        try:
            return max_batch_size(arguments.pop("model"), arguments.pop("inputs"),
                                  arguments.pop("config"), **arguments).max_batch_size
        except NothingFits:  # predicted not to fit at all: let the device say
            return 1


def _decorate(function: Callable[..., Any], *, seed: _Seed,
              limits: SearchLimits) -> Callable[..., FoundBatchSize[Any]]:
    if not callable(function):
        raise InvalidInputError(f"find_batch_size decorates a function, not {function!r}")
    signature = inspect.signature(function)
    parameters = list(signature.parameters.values())
    if not parameters or parameters[0].kind not in (inspect.Parameter.POSITIONAL_ONLY,
                                                    inspect.Parameter.POSITIONAL_OR_KEYWORD):
        raise InvalidInputError(
            f"{function.__qualname__} must take the batch size as its first argument, "
            f"e.g. def {function.__name__}(batch_size, ...)")
    name = parameters[0].name

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> FoundBatchSize[Any]:
        _check_call(function, signature, name, args, kwargs)
        started = time.perf_counter()
        search, value = search_in_process(lambda b: function(b, *args, **kwargs), limits,
                                          predicted=seed.resolve(limits.max_batch_size),
                                          started=started)
        return FoundBatchSize(batch_size=search.max_batch_size, value=value, search=search)

    return wrapper


def _check_call(function: Callable[..., Any], signature: inspect.Signature, name: str,
                args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """accelerate's guard, and the rest of the call checked before the first trial."""
    call = f"{function.__name__}({_shown(signature, args, kwargs)})"
    if name in kwargs:
        raise InvalidInputError(
            f"{name} was passed to {function.__name__} as a keyword when it was called; remove "
            f"it, the decorator passes it: {function.__name__}"
            f"({_shown(signature, args, {k: v for k, v in kwargs.items() if k != name})})")
    try:
        signature.bind(None, *args, **kwargs)
    except TypeError as exc:
        positional = [p for p in signature.parameters.values()
                      if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        if "too many positional" in str(exc) and args and len(args) >= len(positional):
            raise InvalidInputError(
                f"{name} was passed to {function.__name__} as the first argument when it was "
                f"called ({call}); remove it, the decorator passes it: "
                f"{function.__name__}({_shown(signature, args[1:], kwargs)})") from None
        raise InvalidInputError(f"{call} does not match {function.__name__}{signature}: {exc} "
                                f"(the decorator passes {name} itself)") from None


def _shown(signature: inspect.Signature, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """The call's arguments as ``name=value``, named after the parameters after the first."""
    names = [p.name for p in signature.parameters.values()][1:]
    shown = [f"{n}={v!r}" for n, v in zip(names, args)]
    shown += [repr(v) for v in args[len(names):]]
    shown += [f"{k}={v!r}" for k, v in kwargs.items()]
    return ", ".join(shown)
