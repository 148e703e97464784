"""Keras 3 models on the torch backend: Keras's own training step, traced and run.

With ``KERAS_BACKEND=torch`` a ``keras.Model`` is a ``torch.nn.Module``, but not one the
generic path (:mod:`batchfit.engine.fake`, :class:`batchfit.engine.step.StepRunner`) can
trace or run faithfully:

* Its weights are Keras variables holding torch parameters, and a layer computes with
  ``variable.value``. Swapping a module's parameters changes nothing the model computes, and
  a deep copy is a Keras serialization round trip that reads every weight. So the model is
  built once under ``keras.device("meta")`` (no memory), and a trace rebinds every Keras
  variable (the model's, the optimizer's, the metrics') to a fake tensor and back after.
* Its sublayers are not registered submodules: ``named_modules()`` shows the model and its
  parameter dicts only. The breakdown follows the Keras layer tree instead, with Keras's
  layer names (:func:`layer_paths`).
* Its training step is Keras's ``train_step``, which differs from torch's canonical loop
  in what lives when: it calls ``zero_grad()`` *after* the forward pass, so the previous
  step's gradients are alive through the forward of the next one; it keeps the model's
  output until the metrics after the optimizer step; its optimizers are Keras's own (the
  torch backend's update their Keras-variable state with ``torch._foreach_*`` ops, on
  the CPU too, each making whole-group temporaries), and the loss is the compiled
  Keras loss. Measured on a Keras CNN with Adam at batch 8, the peak is in Keras Adam's
  update (three parameter-sized temporaries at once), where torch's for-loop Adam makes
  none. So the step run here is the model's own ``train_step`` (``predict_step`` for
  inference), with phase marks added around Keras's calls for the breakdown.
* Mixed precision is Keras's own: a ``mixed_float16``/``mixed_bfloat16`` policy keeps
  float32 variables and casts each layer's inputs and each variable it reads to the
  compute dtype inside the layer call (a fresh cast at every read, kept for backward by
  the op that uses it; no weight-cast cache, no op lists); compiling a
  ``mixed_float16`` model wraps its optimizer in Keras's ``LossScaleOptimizer``. None of
  this is ``torch.autocast``, so batchfit adds no autocast: the trace records Keras's
  casts as it makes them (as ``autocast_copies`` when a variable is cast).
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from batchfit.engine.keras_detect import is_keras_model, keras_module  # noqa: F401 - re-exported
from batchfit.errors import InvalidInputError, ModelSpecError

#: batchfit precision -> the Keras dtype policy that does it; fp32 and tf32 keep the
#: model's own policy (set in its factory, globally or per layer).
KERAS_POLICIES = {"amp-fp16": "mixed_float16", "amp-bf16": "mixed_bfloat16",
                  "bf16": "bfloat16", "fp16": "float16"}

#: batchfit optimizer name -> Keras optimizer class and arguments, for an uncompiled model.
_KERAS_OPTIMIZERS = {
    "sgd": ("SGD", {"learning_rate": 0.01}),
    "momentum": ("SGD", {"learning_rate": 0.01, "momentum": 0.9}),
    "nesterov": ("SGD", {"learning_rate": 0.01, "momentum": 0.9, "nesterov": True}),
    "adam": ("Adam", {"learning_rate": 1e-3}),
    "adamw": ("AdamW", {"learning_rate": 1e-3}),
    "adagrad": ("Adagrad", {"learning_rate": 0.01}),
    "rmsprop": ("RMSprop", {"learning_rate": 0.01}),
    "adafactor": ("Adafactor", {"learning_rate": 0.01}),
}


# -- recognising Keras ------------------------------------------------------------------

def keras_backend() -> str | None:
    keras = keras_module()
    return keras.backend.backend() if keras is not None else None


def check_torch_backend(what: str = "a Keras model") -> None:
    """One clear error unless Keras runs on the torch backend."""
    backend = keras_backend()
    if backend not in (None, "torch"):
        raise InvalidInputError(
            f"{what} on Keras's {backend} backend: batchfit predicts Keras models on the torch "
            "backend only (it traces the model's torch ops on fake tensors); run with "
            "KERAS_BACKEND=torch (Keras 3 code runs unchanged), or use "
            "batchfit.integrations.keras.BatchSizeFinder to search on the real device")


# -- building ---------------------------------------------------------------------------

@contextlib.contextmanager
def build_scope(device: str | torch.device, precision: str | None = None) -> Iterator[None]:
    """How batchfit lets Keras build a model: its variables on ``device`` (``"meta"``: no
    memory), layer names numbered as in a fresh process (``conv2d``, ``conv2d_1``, ...,
    however many models this process built before), and the Keras dtype policy of
    ``precision`` (:data:`KERAS_POLICIES`) unless it is None. A no-op when Keras is not
    imported on the torch backend."""
    keras = keras_module()
    if keras is None or keras.backend.backend() != "torch":
        yield
        return
    from keras.src.backend.common import global_state

    names = global_state.get_global_attribute("object_name_uids")
    global_state.set_global_attribute("object_name_uids", collections.defaultdict(int))
    policy = keras.config.dtype_policy()
    try:
        if precision is not None and precision in KERAS_POLICIES:
            keras.config.set_dtype_policy(KERAS_POLICIES[precision])
        with keras.device(str(device)):
            yield
    finally:
        keras.config.set_dtype_policy(policy)
        global_state.set_global_attribute("object_name_uids", names)


def clone_factory(model: Any) -> Callable[[], Any]:
    """A zero-argument factory that builds a fresh copy of ``model``'s architecture (new
    weights, in the caller's :func:`build_scope`), built and compiled as ``model`` is:
    batchfit never touches the user's model. It holds Keras's serialized config (no
    weights), taken now, outside any meta scope (reading a compiled optimizer's config
    reads its learning rate), and the model's layer classes, so it pickles to a trial
    process as long as those classes are importable there."""
    import functools

    check_torch_backend()
    keras = keras_module()
    try:
        serialized = keras.saving.serialize_keras_object(model)
    except Exception as exc:  # noqa: BLE001 - Keras raises several kinds here
        raise ModelSpecError(
            f"cannot copy the Keras model to trace it ({type(exc).__name__}: {exc}); give a "
            "factory (a function that builds and compiles it) instead") from exc
    custom = {type(layer).__name__: type(layer)
              for layer in model._flatten_layers(include_self=True)}
    return functools.partial(_from_config, serialized, custom)


def _from_config(serialized: Mapping[str, Any], custom: Mapping[str, type]) -> Any:
    keras = keras_module()
    try:
        return keras.saving.deserialize_keras_object(dict(serialized), custom_objects=custom)
    except Exception as exc:  # noqa: BLE001 - Keras raises several kinds here
        raise ModelSpecError(
            f"cannot rebuild the Keras model from its config ({type(exc).__name__}: {exc}); "
            "give a factory (a function that builds and compiles it) instead") from exc


class _CudaOnFakeCpu(str):
    """Keras's device while a CUDA target is traced on fake CPU tensors.

    Keras's torch backend chooses dtype workarounds by comparing its device with
    ``"cuda"`` and ``"cpu"``: on ``"cpu"``, matmul, softmax, log-softmax and a dozen other
    ops compute float16 in float32 (torch's CPU kernels lacked float16), which adds a
    float32 copy of each operand that a GPU never makes. The same device string also
    places every tensor Keras creates. This one is ``"cpu"`` to torch (tensors land on
    the fake CPU device the trace runs on) and equal to ``"cuda"`` (and not to ``"cpu"``)
    in Keras's comparisons."""

    def __eq__(self, other: object) -> bool:
        if isinstance(other, str):
            return str.__eq__(other, "cuda")
        return NotImplemented

    def __ne__(self, other: object) -> bool:
        if isinstance(other, str):
            return not str.__eq__(other, "cuda")
        return NotImplemented

    __hash__ = str.__hash__


@contextlib.contextmanager
def trace_device(cuda: bool) -> Iterator[None]:
    """Keras's device for a trace on fake CPU tensors: the CPU, or for a CUDA target
    :class:`_CudaOnFakeCpu` (set in Keras's global state, restored after)."""
    if not cuda:
        with build_scope("cpu"):
            yield
        return
    from keras.src.backend.common import global_state

    before = global_state.get_global_attribute("torch_device")
    global_state.set_global_attribute("torch_device", _CudaOnFakeCpu("cpu"))
    try:
        yield
    finally:
        global_state.set_global_attribute("torch_device", before)


def compile_if_needed(model: Any, optimizer: Any, *, replace: bool = False) -> None:
    """Compile an uncompiled model with the Keras equivalent of batchfit's ``optimizer``
    name and the default loss (see :func:`default_loss`); a compiled model keeps its own
    optimizer, unless ``replace``: then it is compiled again with that optimizer, keeping
    its loss and metrics."""
    compiled = getattr(model, "compiled", False) and getattr(model, "optimizer", None) is not None
    if compiled and not replace:
        return
    keras = keras_module()
    name = getattr(optimizer, "value", optimizer)
    if not isinstance(name, str) or name not in _KERAS_OPTIMIZERS:
        raise InvalidInputError(
            f"a Keras model trains with a Keras optimizer, not {optimizer!r}: compile it in the "
            "factory (model.compile(optimizer=..., loss=...)) or name one of "
            + ", ".join(_KERAS_OPTIMIZERS))
    class_name, kwargs = _KERAS_OPTIMIZERS[name]
    arguments: dict[str, Any] = {}
    if compiled:
        arguments = dict(getattr(getattr(model, "_compile_config", None), "config", {}) or {})
    arguments["optimizer"] = getattr(keras.optimizers, class_name)(**kwargs)
    if arguments.get("loss") is None:
        arguments["loss"] = default_loss(model)
    model.compile(**arguments)


def with_optimizer(factory: Callable[[], Any], optimizer: Any) -> Callable[[], Any]:
    """``factory``, with the model it builds compiled again with batchfit's ``optimizer``
    name (``--optimizer`` given for a compiled Keras model). Picklable."""
    import functools

    return functools.partial(_built_with_optimizer, factory, getattr(optimizer, "value",
                                                                     optimizer))


def _built_with_optimizer(factory: Callable[[], Any], optimizer: str) -> Any:
    model = factory()
    compile_if_needed(model, optimizer, replace=True)
    return model


def default_loss(model: Any) -> Any:
    """For an uncompiled model: sparse categorical cross-entropy on logits for a 2-D
    output (batchfit's rule for torch models: cross-entropy against integer classes),
    mean squared error against a target of the output's shape otherwise."""
    keras = keras_module()
    outputs = getattr(model, "outputs", None) or []
    if len(outputs) == 1 and len(outputs[0].shape) == 2:
        return keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    return keras.losses.MeanSquaredError()


# -- data ------------------------------------------------------------------------------

def input_spec(model: Any) -> Any | None:
    """The per-sample input of a functional or Sequential model, read from its
    ``keras.Input`` s: a :class:`TensorSpec` for one input, a tuple (in the model's input
    order) for several; None when an input has a free dimension (give ``--input``/
    ``--seq-len``) or the model has no declared inputs (a subclassed model)."""
    from batchfit.engine.spec import TensorSpec

    try:
        inputs = list(model.inputs or [])
    except (AttributeError, ValueError):  # a subclassed model has no symbolic inputs
        return None
    specs = []
    for tensor in inputs:
        shape = tuple(tensor.shape[1:])
        if not inputs or any(d is None for d in shape):
            return None
        dtype = str(tensor.dtype)
        high = _embedding_size(model) if "int" in dtype else None
        specs.append(TensorSpec(shape, dtype, high=high))
    if not specs:
        return None
    return specs[0] if len(specs) == 1 else tuple(specs)


def _embedding_size(model: Any) -> int | None:
    keras = keras_module()
    for layer in model._flatten_layers(include_self=False):
        if isinstance(layer, keras.layers.Embedding):
            return int(layer.input_dim)
    return None


def symbolic_inputs(spec: Any, batch_size: int | None) -> Any:
    """``keras.KerasTensor`` s for ``spec`` (x as Keras takes it: one tensor, a list, a dict)."""
    from batchfit.engine.spec import TensorSpec

    keras = keras_module()

    def one(s: TensorSpec) -> Any:
        return keras.KerasTensor(s.batch_shape(batch_size), s.dtype)

    if isinstance(spec, TensorSpec):
        return one(spec)
    if isinstance(spec, Mapping):
        return {k: one(v) for k, v in spec.items()}
    return [one(s) for s in spec]


def target_specs(model: Any, spec: Any) -> Any:
    """What ``y`` is for the compiled loss, per output, from the model's output shapes:
    integer classes in ``[0, C)`` of shape ``output[:-1]`` for a sparse loss (its name says
    ``sparse``), else a float tensor of the output's shape. None when the model was
    compiled without a loss (it adds its own with ``add_loss``)."""
    from batchfit.engine.spec import TensorSpec

    keras = keras_module()
    loss = getattr(model, "loss", None)
    if loss is None:
        return None
    outputs = model.compute_output_spec(symbolic_inputs(spec, 1))
    names = list(getattr(model, "output_names", None) or [])
    leaves = keras.tree.flatten(outputs)

    def for_output(index: int, output: Any) -> TensorSpec:
        own = loss
        if isinstance(loss, Mapping):
            own = loss.get(names[index]) if index < len(names) else None
        elif isinstance(loss, (list, tuple)):
            own = loss[index] if index < len(loss) else None
        shape = tuple(output.shape[1:])
        if own is not None and _is_sparse(own) and shape:
            return TensorSpec(shape[:-1] or (1,), "int64", low=0, high=int(shape[-1]))
        return TensorSpec(shape or (1,), "float32")

    specs = [for_output(i, out) for i, out in enumerate(leaves)]
    if isinstance(outputs, Mapping):
        return dict(zip(outputs, specs))
    return specs[0] if len(specs) == 1 else specs


def _is_sparse(loss: Any) -> bool:
    name = loss if isinstance(loss, str) else (
        getattr(loss, "name", None) or getattr(loss, "__name__", None) or type(loss).__name__)
    return "sparse" in str(name).lower()


def make_data(spec: Any, targets: Any, batch_size: int, generator: torch.Generator) -> tuple:
    """``(x, y)`` for ``train_step`` on the current default device (fake or real):
    floats from a normal, integers in their range, targets as :func:`target_specs` says."""
    from batchfit.engine.spec import TensorSpec
    from batchfit.engine.step import make_tensor

    def build(value: Any) -> Any:
        if value is None:
            return None
        if isinstance(value, TensorSpec):
            return make_tensor(value, batch_size, None, generator, None)
        if isinstance(value, Mapping):
            return {k: build(v) for k, v in value.items()}
        return [build(v) for v in value]

    return build(spec), build(targets)


def prepare(model: Any, spec: Any, targets: Any) -> None:
    """What ``fit`` does before its first step: build the model, the compiled loss and
    metrics and the optimizer's variables from symbolic data (``_symbolic_build``)."""
    x = symbolic_inputs(spec, None)
    y = None if targets is None else symbolic_inputs(targets, None)
    model._symbolic_build(data_batch=(x, y))


# -- variables and layers ----------------------------------------------------------------

@dataclass(frozen=True)
class KerasState:
    """The model's Keras variables by role (the tensors are their current values)."""

    trainable: tuple[Any, ...]
    non_trainable: tuple[Any, ...]
    optimizer: tuple[Any, ...]
    metrics: tuple[Any, ...]

    @classmethod
    def of(cls, model: Any) -> KerasState:
        seen: set[int] = set()

        def new(variables: Any) -> tuple[Any, ...]:
            kept = []
            for v in variables:
                if id(v) not in seen:
                    seen.add(id(v))
                    kept.append(v)
            return tuple(kept)

        optimizer = getattr(model, "optimizer", None)
        return cls(trainable=new(model.trainable_variables),
                   non_trainable=new(model.non_trainable_variables),
                   optimizer=new(optimizer.variables if optimizer is not None else ()),
                   metrics=new(model.metrics_variables))

    @property
    def variables(self) -> tuple[Any, ...]:
        return self.trainable + self.non_trainable + self.optimizer + self.metrics


def _torch_modules(model: Any) -> list[nn.Module]:
    """Every torch module that can hold a variable's tensor: each Keras layer's parameter
    dict and wrapped torch modules (Keras layers are not registered submodules)."""
    found: dict[int, nn.Module] = {}
    for layer in model._flatten_layers(include_self=True, recursive=True):
        if isinstance(layer, nn.Module):
            for module in layer.modules():
                found.setdefault(id(module), module)
    return list(found.values())


def _rebind(model: Any, state: KerasState, mapping: dict[int, torch.Tensor]) -> None:
    for variable in state.variables:
        replacement = mapping.get(id(variable._value))
        if replacement is not None:
            variable._value = replacement
    for module in _torch_modules(model):
        for name, param in list(module._parameters.items()):
            if param is not None and id(param) in mapping:
                module._parameters[name] = mapping[id(param)]


@contextlib.contextmanager
def fake_variables(model: Any, fake_mode: Any) -> Iterator[KerasState]:
    """Rebind every Keras variable of ``model`` (built on meta, :func:`prepare` d) to a
    fresh fake tensor of ``fake_mode`` for the duration; back to the meta ones after.
    Yields the state, whose variables now hold the fake tensors."""
    state = KerasState.of(model)
    forward: dict[int, torch.Tensor] = {}
    backward: dict[int, torch.Tensor] = {}
    with fake_mode:
        for variable in state.variables:
            old = variable._value
            fake = nn.Parameter(torch.empty(tuple(old.shape), dtype=old.dtype),
                                requires_grad=old.requires_grad)
            forward[id(old)], backward[id(fake)] = fake, old
    _rebind(model, state, forward)
    try:
        yield state
    finally:
        for variable in state.variables:
            variable._value.grad = None
        _rebind(model, state, backward)
    if len(KerasState.of(model).variables) != len(state.variables):
        raise ModelSpecError("the Keras model created variables while it was traced; "
                             "build it fully in its factory")


def layer_paths(model: Any) -> list[tuple[str, nn.Module]]:
    """``(path, layer)`` for the model (``""``) and every layer below it, the path being
    the Keras layer names joined by dots (``"block1.conv"``)."""
    found: list[tuple[str, nn.Module]] = [("", model)]

    def walk(layer: Any, prefix: str) -> None:
        for sub in layer._flatten_layers(include_self=False, recursive=False):
            path = f"{prefix}.{sub.name}" if prefix else sub.name
            if isinstance(sub, nn.Module):
                found.append((path, sub))
            walk(sub, path)

    walk(model, "")
    return found


@contextlib.contextmanager
def garbage_collected_per_layer(model: Any) -> Iterator[None]:
    """Run the cyclic garbage collector after every Keras layer call, and never elsewhere,
    for the duration (a trace).

    Keras's tree utilities (``keras.tree.map_structure`` over a layer's inputs and
    outputs, which merge layers such as ``Add`` use) leave reference cycles that hold
    tensors, so a functional model's intermediate outputs are freed only when Python's
    cyclic collector runs, not when the last op using them is done. In a real step the
    collector runs every few hundred new objects, i.e. every layer or two of Keras code;
    left to itself in a trace it runs at other points (fake tensors allocate other
    objects), which moved ResNet-50's frees between batch 16 and 32 and broke the
    batch-independent op sequence the solver relies on. Collecting at each layer's end
    frees that garbage where a real step's collector would soon after, the same way at
    every batch size."""
    import gc

    def collect(*args: Any) -> None:  # a forward hook: returns None, keeps the output
        gc.collect()

    enabled = gc.isenabled()
    gc.disable()
    hooks = [layer.register_forward_hook(collect, always_call=True)
             for _, layer in layer_paths(model)]
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()
        if enabled:
            gc.enable()


# -- the step ---------------------------------------------------------------------------

class KerasStepRunner:
    """Runs Keras's own step on ``model``: ``train_step((x, y))`` (training) or
    ``predict_step((x,))`` under ``no_grad`` (inference; a real run under
    ``inference_mode`` when ``TrainConfig.inference_mode`` asks for it).

    Real runs go through ``model.train_function``, as ``fit`` does (``torch.compile`` when
    the model was compiled with ``jit_compile=True``); a trace (``mark_phases=True``) calls
    ``train_step`` directly and reports phases through ``on_phase``: forward, then
    zero_grad (Keras calls it after the forward pass), loss, backward (after the loss is
    scaled) and optimizer (``optimizer.apply``; the metrics follow it).

    The interface is :class:`batchfit.engine.step.StepRunner`'s: ``batch`` is ``(x, y)``.
    """

    def __init__(self, model: Any, config: Any, batch: tuple, *,
                 on_phase: Callable[[str], None] = lambda phase: None,
                 mark_phases: bool = False) -> None:
        from batchfit.engine.spec import Mode

        self.model, self.config, self.batch = model, config, batch
        self.on_phase, self.mark_phases = on_phase, mark_phases
        self.training = config.mode is Mode.TRAIN
        self.optimizer = None  # Keras's optimizer keeps its state in Keras variables
        self.scaler = None
        if self.training:
            model.train()
        else:
            model.eval()

    def train_step(self) -> None:
        self.on_phase("forward")
        if not self.mark_phases:
            self.model.make_train_function()
            self.model.train_function([self.batch])
            return
        with self._marks():
            self.model.train_step(self.batch)

    def infer_step(self) -> None:
        self.on_phase("forward")
        x = self.batch[0]
        # As the torch runner: a real run honours TrainConfig.inference_mode (what the user's
        # loop runs under); a trace uses no_grad, whose memory is the same.
        real_inference_mode = self.config.inference_mode and not self.mark_phases
        with torch.inference_mode() if real_inference_mode else torch.no_grad():
            output = self.model.predict_step((x,))
        del output

    def state_tensors(self) -> list[torch.Tensor]:
        """What lives between steps: every variable's tensor and the gradients."""
        values = [v.value for v in KerasState.of(self.model).variables]
        return values + [t.grad for t in values if t.grad is not None]

    def drop_gradients(self) -> None:
        for param in self.model.parameters():
            param.grad = None

    @contextlib.contextmanager
    def _marks(self) -> Iterator[None]:
        """Phase marks around Keras's calls inside ``train_step``, as instance attributes
        of the traced model and optimizer (removed after)."""
        model, optimizer, phase = self.model, self.model.optimizer, self.on_phase

        def before(name: str, function: Callable) -> Callable:
            def marked(*args: Any, **kwargs: Any) -> Any:
                phase(name)
                return function(*args, **kwargs)
            return marked

        def after(name: str, function: Callable) -> Callable:
            def marked(*args: Any, **kwargs: Any) -> Any:
                result = function(*args, **kwargs)
                phase(name)
                return result
            return marked

        patched = [(model, "zero_grad", before("zero_grad", model.zero_grad)),
                   (model, "_compute_loss", before("loss", model._compute_loss))]
        if optimizer is not None:
            patched += [(optimizer, "scale_loss", after("backward", optimizer.scale_loss)),
                        (optimizer, "apply", before("optimizer", optimizer.apply))]
        for owner, name, function in patched:
            owner.__dict__[name] = function
        try:
            yield
        finally:
            for owner, name, _ in patched:
                owner.__dict__.pop(name, None)
