"""A Keras 3 callback that finds the largest batch size that trains, inside ``model.fit``,
on the real device, seeded by batchfit's prediction; then ``fit`` trains at it.

``model.fit(x, y, epochs=10, callbacks=[BatchSizeFinder()])``: at the first training step
(before any weight changes) the finder runs the seeded boundary search of
:mod:`batchfit.integrations._trials` with real steps of the model's own compiled train
function (``model.train_on_batch``: Keras's ``train_step``, ``torch.compile``/XLA as
``fit`` would run it) on batches made by repeating the first real batch ``fit`` gave it,
catches the backend's out-of-memory error, and puts every Keras variable back (weights,
optimizer slots and iteration count, metrics, seed generators) bit for bit, with the RNG
states of Python, numpy and torch. Then:

* **torch backend**: the finder re-batches what ``fit`` feeds the step, so training runs
  at the recommended batch size whatever ``batch_size`` ``fit`` was given: the samples
  arrive in ``fit``'s order and are cut into steps of that size (carried over between
  ``fit``'s batches; an epoch's remainder is one smaller step at its end, as Keras's last
  batch is, run with ``fit``'s last batch of the epoch so the epoch's logs count it). ``fit``'s progress bar and ``steps_per_epoch`` still count ``fit``'s own
  batches; the optimizer's ``iterations`` counts the real steps.
* **JAX and TensorFlow**: ``fit`` compiles its data pipeline and steps into the backend's
  graph before any callback runs, so the finder cannot re-batch them: it searches at
  ``on_train_begin`` on batches built from the model's input and target shapes (or
  ``inputs=``), reports the batch size (``finder.batch_size``) and leaves this ``fit``
  as it was; pass ``batch_size=finder.batch_size`` to the next one. There is no
  prediction on these backends (batchfit traces torch ops), so the search starts from
  ``predicted`` or doubles from ``init_val``.

The prediction (torch backend): :func:`batchfit.max_batch_size` of a copy of the model's
architecture, compiled as it is (:mod:`batchfit.engine.keras_step`), for the GPU the model
runs on (its free memory), or for the CPU with ``memory_bytes``. On the CPU the trials run
under that budget (:func:`batchfit.integrations._trials.cpu_memory_cap`, default: the
memory the machine has available now), so they fail cleanly instead of swapping.
"""

from __future__ import annotations

import math
import random
import sys
import time
from typing import Any

try:
    import keras
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("batchfit.integrations.keras needs Keras 3: "
                      "pip install 'batchfit[keras]'") from exc

from batchfit.device.profile import available_memory_bytes
from batchfit.errors import InvalidInputError
from batchfit.integrations._trials import (
    BatchSizeSearch,
    SearchLimits,
    check_positive_int,
    check_steps,
    cpu_memory_cap,
    cpu_trial_room,
    search_in_process,
    trial_line,
)


class BatchSizeFinder(keras.callbacks.Callback):
    """Find the largest batch size that trains at the start of ``model.fit``.

    Args:
        predicted: skip the prediction and start from this batch size.
        device: the prediction's target (torch backend): a catalog GPU name, a
            :class:`~batchfit.DeviceProfile` or ``"cpu"``. Default: the GPU the model's
            variables are on (its free memory), else the CPU with ``memory_bytes``.
        memory_bytes: the memory budget: the prediction's, and on the CPU the cap the
            trials run under (default there: the memory available now).
        steps_per_trial: training steps per trial (>= 2: the steady state is the second).
        max_trials: trials at most; when they run out, the largest batch that ran is used
            (``search.confirmed`` is then False).
        headroom: the batch size used is the largest that ran, less this fraction.
        approach: the first trial's margin below the prediction, a fraction of it.
        max_batch_size: never try more.
        init_val: the first trial without a prediction (then doubled, then bisected).
        inputs: the per-sample input spec where the model declares none (JAX/TF backends,
            subclassed models); on torch the first real batch gives it.
        rebatch: torch backend: train this ``fit`` at the batch size found (default); if
            False, only report it.
        verbose: print one line per trial and one with the result.

    Attributes:
        search: the search (None before it ran).
        batch_size: the batch size found (the recommended one), or None.

    Example (with ``KERAS_BACKEND=torch``):
        >>> import numpy as np, keras, torch
        >>> class Guard(keras.layers.Layer):  # stands in for a step that runs out of memory
        ...     def call(self, x):
        ...         if x.device.type != "meta" and x.shape[0] > 24:
        ...             raise torch.OutOfMemoryError("CUDA out of memory")
        ...         return x
        >>> model = keras.Sequential([keras.Input((8,)), Guard(), keras.layers.Dense(1)])
        >>> model.compile(optimizer="sgd", loss="mse")
        >>> finder = BatchSizeFinder(predicted=20, headroom=0.0, verbose=False)
        >>> _ = model.fit(np.ones((64, 8)), np.ones((64, 1)), epochs=1, verbose=0,
        ...               callbacks=[finder])
        >>> finder.batch_size, finder.search.confirmed
        (24, True)
    """

    def __init__(self, *, predicted: int | None = None, device: Any = None,
                 memory_bytes: int | None = None, steps_per_trial: int = 2,
                 max_trials: int = 32, headroom: float = 0.05, approach: float = 0.1,
                 max_batch_size: int = 8192, init_val: int = 2, inputs: Any = None,
                 rebatch: bool = True, verbose: bool = True):
        super().__init__()
        if predicted is not None:
            check_positive_int(predicted, "predicted")
        if memory_bytes is not None:
            check_positive_int(memory_bytes, "memory_bytes")
        check_steps(steps_per_trial)
        check_positive_int(init_val, "init_val")
        self.limits = SearchLimits(max_batch_size=max_batch_size, max_trials=max_trials,
                                   approach=approach, headroom=headroom)
        self.predicted, self.device, self.memory_bytes = predicted, device, memory_bytes
        self.steps_per_trial, self.init_val = steps_per_trial, init_val
        self.inputs, self.rebatch, self.verbose = inputs, rebatch, verbose
        self.search: BatchSizeSearch | None = None
        self.batch_size: int | None = None
        self._step: _Rebatching | None = None

    # -- fit's events --------------------------------------------------------------------
    def on_train_begin(self, logs: Any = None) -> None:
        self.search, self.batch_size = None, None
        if keras.backend.backend() == "torch":
            self._step = _Rebatching(self, self.model)  # the search runs at the first batch
            self.model.train_function = self._step
        else:
            self._find(_synthetic_sample(self.model, self.inputs))

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        if self._step is not None:
            self._step.calls = 0

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        if self._step is not None:  # an epoch of unknown length: its remainder now
            self._step.flush()

    def on_train_end(self, logs: Any = None) -> None:
        if self._step is not None:
            self._step.flush()
            self.model.train_function = self._step.original
            self._step = None

    # -- the search ------------------------------------------------------------------------
    def _find(self, sample: tuple) -> int:
        """Search with batches that repeat ``sample`` (one batch of (x, y[, weights]))."""
        started = time.perf_counter()
        model = self.model
        limits = self.limits
        cap = None
        snapshot = _KerasSnapshot(model)
        try:
            predicted = self.predicted
            if predicted is None:
                predicted = self._predict(sample, limits.max_batch_size)
            on_cpu = _on_cpu(model)
            if on_cpu:
                budget = self.memory_bytes or available_memory_bytes()
                if budget is not None:
                    room = cpu_trial_room(budget, _state_bytes(model))
                    cap = lambda: cpu_memory_cap(room)  # noqa: E731
            steps = self.steps_per_trial

            def trial(batch_size: int) -> None:
                data = _repeat(sample, batch_size)
                for _ in range(steps):
                    logs = model.train_on_batch(*data, return_dict=True)
                    # JAX dispatches asynchronously: an out-of-memory error surfaces when
                    # a result is read, so read them here, inside the trial
                    for value in keras.tree.flatten(logs):
                        float(keras.ops.convert_to_numpy(value))

            search, _ = search_in_process(
                trial, limits, predicted=predicted, start=self.init_val,
                after_trial=snapshot.restore, started=started, cap=cap,
                on_trial=self._say_trial if self.verbose else None)
        finally:
            snapshot.restore()
        self.search, self.batch_size = search, search.recommended_batch_size
        if self.verbose:
            _say(f"BatchSizeFinder: largest batch {search.max_batch_size}"
                 f"{'' if search.confirmed else ' (not confirmed)'}, using "
                 f"{search.recommended_batch_size} ({len(search.trials)} trials, "
                 f"{search.seconds:.1f} s)")
        return search.recommended_batch_size

    def _say_trial(self, trial: Any) -> None:
        _say(f"BatchSizeFinder: {trial_line(trial)}")

    def _predict(self, sample: tuple, limit: int) -> int | None:
        """batchfit's largest batch for a copy of the model (torch backend only)."""
        if keras.backend.backend() != "torch":
            return None
        from batchfit.integrations._seed import predict, prediction_target

        target = prediction_target(_model_device(self.model), self.device,
                                   self.memory_bytes or (available_memory_bytes()
                                                         if _on_cpu(self.model) else None))
        if target is None:
            return None
        from batchfit.engine import keras_step
        from batchfit.engine.spec import TrainConfig

        spec = self.inputs if self.inputs is not None else _per_sample_spec(sample[0])
        if spec is None:
            return None
        factory = keras_step.clone_factory(self.model)
        return predict(factory, spec, TrainConfig(), target, limit, "BatchSizeFinder")


# -- re-batching fit's steps (torch backend) ----------------------------------------------

class _Rebatching:
    """Stands in for ``model.train_function`` during ``fit`` (torch backend): the first call
    runs the search on its batch, then every call's samples are cut into steps of the batch
    size found, carrying the rest over to the next call."""

    def __init__(self, finder: BatchSizeFinder, model: Any):
        self.finder, self.model = finder, model
        self.original = model.train_function
        self.pending: list[tuple] = []
        self.logs: Any = None
        self.calls = 0  # fit's steps in this epoch

    def __call__(self, data: list) -> Any:
        (batch,) = data
        if self.finder.batch_size is None:
            self.model.train_function = self.original  # the trials' train_on_batch uses it
            try:
                self.finder._find(tuple(batch))
            finally:
                self.model.train_function = self
        if not self.finder.rebatch:
            self.logs = self.original(data)
            return self.logs
        self.pending.append(tuple(batch))
        size = self.finder.batch_size
        while _count(self.pending) >= size:
            step, self.pending = _take(self.pending, size)
            self.logs = self.original([step])
        self.calls += 1
        if self.calls == self.finder.params.get("steps"):  # the epoch's last: its remainder
            self.flush()  # now, so that the epoch's logs count it
        return self.logs if self.logs is not None else self.model.get_metrics_result()

    def flush(self) -> None:
        """The samples left at an epoch's end: one smaller step."""
        if self.pending:
            step, self.pending = _take(self.pending, _count(self.pending))
            self.logs = self.original([step])


def _count(parts: list[tuple]) -> int:
    return sum(_length(part) for part in parts)


def _length(batch: tuple) -> int:
    return int(keras.tree.flatten(batch[0])[0].shape[0])


def _take(parts: list[tuple], size: int) -> tuple[tuple, list[tuple]]:
    """The first ``size`` samples of ``parts`` as one batch, and the rest."""
    import torch

    taken, rest, need = [], [], size
    for part in parts:
        n = _length(part)
        if need <= 0:
            rest.append(part)
        elif n <= need:
            taken.append(part)
            need -= n
        else:
            taken.append(keras.tree.map_structure(lambda t: t[:need], part))
            rest.append(keras.tree.map_structure(lambda t: t[need:], part))
            need = 0

    def join(*pieces: Any) -> Any:
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)

    joined = keras.tree.map_structure(join, *taken) if len(taken) > 1 else taken[0]
    return tuple(joined), rest


def _repeat(sample: tuple, batch_size: int) -> tuple:
    """``sample``'s samples repeated (and cut) to ``batch_size``: real data at any size."""
    n = _length(sample)
    times = math.ceil(batch_size / n)

    def tile(t: Any) -> Any:
        if t is None:
            return None
        reps = (times,) + (1,) * (len(t.shape) - 1)
        backend = keras.backend.backend()
        if backend == "torch":
            return t.repeat(*reps)[:batch_size]
        return keras.ops.tile(t, reps)[:batch_size]

    return tuple(keras.tree.map_structure(tile, part) if part is not None else None
                 for part in sample)


# -- state ----------------------------------------------------------------------------------

class _KerasSnapshot:
    """Every Keras variable of the model (weights, optimizer slots and iteration count,
    metrics, its seed generators') and the global RNGs, copied to host memory once and
    put back by :meth:`restore` with ``variable.assign`` (any backend; exact: a copy of
    the values, bfloat16 as ml_dtypes' bfloat16). On torch, gradients are put back too
    (Keras's step leaves them on the parameters until the next forward)."""

    def __init__(self, model: Any):
        import numpy as np

        self.variables = _all_variables(model)
        self.values = [np.array(keras.ops.convert_to_numpy(v.value), copy=True)
                       for v in self.variables]
        self.python = random.getstate()
        self.numpy = np.random.get_state()
        self.torch = None
        self.grads: list[tuple[Any, Any]] = []
        if keras.backend.backend() == "torch":
            import torch

            self.torch = torch.get_rng_state()
            self.grads = [(p, None if p.grad is None else p.grad.detach().clone())
                          for p in model.parameters()]

    def restore(self) -> None:
        import numpy as np

        for variable, value in zip(self.variables, self.values):
            variable.assign(value)
        random.setstate(self.python)
        np.random.set_state(self.numpy)
        if self.torch is not None:
            import torch

            torch.set_rng_state(self.torch)
            for param, grad in self.grads:
                param.grad = grad.clone() if grad is not None else None


def _all_variables(model: Any) -> list[Any]:
    found: dict[int, Any] = {}
    optimizer = getattr(model, "optimizer", None)
    groups = [model.variables, optimizer.variables if optimizer is not None else [],
              model.metrics_variables]
    try:
        from keras.src.random.seed_generator import global_seed_generator

        groups.append(global_seed_generator().variables)
    except Exception:  # noqa: BLE001 - a Keras without it: nothing to save
        pass
    for group in groups:
        for variable in group:
            found.setdefault(id(variable), variable)
    return list(found.values())


def _state_bytes(model: Any) -> int:
    """Bytes of every Keras variable: what the trials' CPU budget already holds."""
    return sum(_variable_bytes(v) for v in _all_variables(model))


def _variable_bytes(variable: Any) -> int:
    import numpy as np

    dtype = keras.backend.standardize_dtype(variable.dtype)
    itemsize = {"bfloat16": 2, "float16": 2}.get(dtype) or np.dtype(dtype).itemsize
    return int(math.prod(variable.shape)) * itemsize


def _model_device(model: Any) -> Any:
    import torch

    for param in model.parameters():
        return param.device
    return torch.device("cpu")


def _on_cpu(model: Any) -> bool:
    if keras.backend.backend() == "torch":
        return _model_device(model).type == "cpu"
    if keras.backend.backend() == "jax":
        import jax

        return all(d.platform == "cpu" for d in jax.devices())
    import tensorflow as tf  # pragma: no cover - not installed in CI

    return not tf.config.list_physical_devices("GPU")


def _per_sample_spec(x: Any) -> Any:
    """batchfit's per-sample spec of a torch batch (one tensor, a list or a dict)."""
    from batchfit.integrations._seed import tensor_spec

    if isinstance(x, dict):
        specs = {k: tensor_spec(v) for k, v in x.items()}
        return None if None in specs.values() else specs
    if isinstance(x, (list, tuple)):
        specs = tuple(tensor_spec(v) for v in x)
        return None if None in specs else specs
    return tensor_spec(x)


def _synthetic_sample(model: Any, inputs: Any) -> tuple:
    """One sample ``(x, y)`` as numpy arrays, from the model's declared inputs (or
    ``inputs``) and the targets its compiled loss takes (JAX/TensorFlow backends)."""
    import numpy as np

    from batchfit.engine import keras_step
    from batchfit.engine.spec import TensorSpec
    from batchfit.engine.step import normalize_input_spec

    spec = inputs if inputs is not None else keras_step.input_spec(model)
    if spec is None:
        raise InvalidInputError(
            "BatchSizeFinder: the model declares no fixed input shape: pass inputs= (the "
            "per-sample shape, e.g. (224, 224, 3))")
    spec = normalize_input_spec(spec)
    targets = keras_step.target_specs(model, spec)
    rng = np.random.default_rng(0)

    def make(s: Any) -> Any:
        if s is None:
            return None
        if isinstance(s, TensorSpec):
            shape = s.batch_shape(1)
            if s.is_integer:
                return rng.integers(s.low, s.high if s.high is not None else 2, shape,
                                    dtype=s.dtype if s.dtype != "bool" else "int64")
            return rng.standard_normal(shape).astype(s.dtype)
        if isinstance(s, dict):
            return {k: make(v) for k, v in s.items()}
        return [make(v) for v in s]

    return make(spec), make(targets)


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


__all__ = ["BatchSizeFinder"]
