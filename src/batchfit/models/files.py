"""Model files: ``path/to/file.py:factory`` (see :mod:`batchfit.models.resolve` for the forms).

The file is imported as a uniquely named module; the factory is called once on meta to read
its input spec (or a Keras model's ``keras.Input``s); the spec's factory is a picklable
``functools.partial`` that calls it again, so trial processes rebuild the model the same way.
Builds on :mod:`batchfit.models.resolve` (``ModelSpec``); ``resolve_model`` dispatches here.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import re
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from batchfit.engine.spec import InputSpec, TensorSpec
from batchfit.errors import ModelSpecError
from batchfit.models.modelspec import ModelSpec, _one_line, _token_tensor

if TYPE_CHECKING:
    from torch import nn

FILE_SPEC = re.compile(r"^(?P<path>.+\.py)(?::(?P<factory>[^:/\\]*))?$")


def is_file_spec(text: str) -> bool:
    return FILE_SPEC.match(text) is not None


def _module_name(path: Path) -> str:
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:12]
    stem = re.sub(r"\W", "_", path.stem)
    return f"batchfit_user_model_{stem}_{digest}"


def load_file(path: Path, *, reload: bool) -> Any:
    """Import ``path`` as a uniquely named module (kept in sys.modules so classes defined in
    it pickle and dataclasses resolve their module)."""
    name = _module_name(path)
    if not reload and name in sys.modules:
        return sys.modules[name]
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise ModelSpecError(f"cannot import model file '{path}'")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    sys.path.insert(0, str(path.parent))  # let the file import its neighbours
    try:
        module_spec.loader.exec_module(module)
    except Exception as exc:
        sys.modules.pop(name, None)
        raise ModelSpecError(f"importing model file '{path}' failed: {_one_line(exc)}"
                             f"{_keras_backend_hint()}") from exc
    finally:
        sys.path.remove(str(path.parent))
    return module


def _keras_backend_hint() -> str:
    """A note for a file that failed to import while Keras is set to another backend than
    torch (Keras then imports that backend's package, e.g. tensorflow)."""
    backend = os.environ.get("KERAS_BACKEND", "").strip().lower()
    if backend in ("", "torch"):
        return ""
    return (f" (KERAS_BACKEND={backend}: batchfit predicts Keras models on the torch backend "
            "only, as it traces torch ops; run with KERAS_BACKEND=torch)")


def _file_callables(module: Any) -> list[str]:
    return sorted(n for n, obj in vars(module).items()
                  if callable(obj) and not n.startswith("_")
                  and getattr(obj, "__module__", None) == module.__name__)


def file_factory(path: Path, factory_name: str, module: Any) -> Callable[..., Any]:
    factory = getattr(module, factory_name, None) if factory_name else None
    if callable(factory):
        return factory
    names = _file_callables(module)
    listing = f"its callables: {', '.join(names)}" if names else "it defines no functions"
    if not factory_name:
        raise ModelSpecError(f"name the factory in model file '{path}' as "
                             f"{path}:FUNCTION ({listing})")
    raise ModelSpecError(f"model file '{path}' has no factory {factory_name!r} ({listing})")


def _call_factory(path: str, factory_name: str, kwargs: Mapping[str, Any]) -> Any:
    file_path = Path(path)
    factory = file_factory(file_path, factory_name, load_file(file_path, reload=False))
    try:
        return factory(**kwargs)
    except Exception as exc:
        raise ModelSpecError(
            f"model factory {factory_name}() in '{path}' raised {_one_line(exc)}") from exc


def _build_from_file(path: str, factory_name: str, kwargs: Mapping[str, Any]) -> nn.Module:
    return _unpack_factory_result(_call_factory(path, factory_name, kwargs), path,
                                  factory_name)[0]


def check_not_directory(path: str, factory_name: str) -> None:
    """A directory where the model file belongs: say so, and what to give instead."""
    if Path(path).expanduser().is_dir():
        raise ModelSpecError(
            f"'{path}' is a directory, not a model file: give the Python file that defines "
            f"the factory, e.g. {Path(path) / 'model.py'}:{factory_name or 'build'}")


def resolve_file(user_spec: str, kwargs: dict[str, Any]) -> ModelSpec:
    import torch
    match = FILE_SPEC.match(user_spec)
    if match is None:
        raise ModelSpecError(
            f"malformed model file spec {user_spec!r}: write path/to/file.py:factory")
    path = Path(match["path"]).expanduser().resolve()
    factory_name = (match["factory"] or "").strip()
    check_not_directory(match["path"], factory_name)
    if not path.is_file():
        raise ModelSpecError(f"model file '{match['path']}' not found")
    from batchfit.engine import keras_step

    module = load_file(path, reload=True)
    file_factory(path, factory_name, module)  # a clear error before any call
    with torch.device("meta"), keras_step.build_scope("meta"):
        result = _call_factory(str(path), factory_name, kwargs)
    built, input_spec, loss_fn = _unpack_factory_result(result, str(path), factory_name)
    keras_compiled = None
    if keras_step.is_keras_model(built):  # Keras 3 (torch backend): its own input and step
        keras_compiled = bool(getattr(built, "compiled", False))
        if input_spec is None:
            input_spec = keras_step.input_spec(built)
    factory = functools.partial(_build_from_file, str(path), factory_name, kwargs)
    token = _token_tensor(input_spec)
    return ModelSpec(name=user_spec, factory=factory, input_spec=input_spec, loss_fn=loss_fn,
                     is_token_model=token is not None,
                     vocab_size=token.high if token is not None else None,
                     default_seq_len=token.shape[0] if token is not None else None,
                     keras_compiled=keras_compiled)


def _unpack_factory_result(result: Any, path: str,
                           factory_name: str) -> tuple[Any, InputSpec | None, Callable | None]:
    from torch import nn

    from batchfit.engine import keras_step
    where = f"factory {factory_name}() in '{path}'"
    if isinstance(result, nn.Module) or keras_step.is_keras_model(result):
        module, input_spec, loss_fn = result, None, None
    elif isinstance(result, (tuple, list)) and len(result) in (2, 3):
        module, input_spec, loss_fn = (*result, None)[:3]
    elif isinstance(result, Mapping):
        extra = set(result) - {"model", "input_spec", "loss_fn"}
        if extra or "model" not in result:
            raise ModelSpecError(
                f"{where} returned a dict with keys {sorted(result)}: use 'model' (required), "
                "'input_spec' and 'loss_fn'")
        module, input_spec, loss_fn = (result["model"], result.get("input_spec"),
                                       result.get("loss_fn"))
    else:
        module = None
    if keras_step.is_keras_model(module):
        keras_step.check_torch_backend(f"{where} returned a Keras model")
    if not isinstance(module, nn.Module):
        raise ModelSpecError(
            f"{where} returned {type(result).__name__}: return an nn.Module, (module, "
            "input_spec[, loss_fn]) or a dict with 'model', 'input_spec', 'loss_fn'")
    if loss_fn is not None and not callable(loss_fn):
        raise ModelSpecError(f"{where} returned a loss_fn that is not callable")
    return module, _as_input_spec(input_spec, where), loss_fn


def _as_input_spec(value: Any, where: str) -> InputSpec | None:
    if value is None or isinstance(value, TensorSpec):
        return value
    if isinstance(value, (tuple, list)) and value and all(isinstance(d, int) for d in value):
        return TensorSpec(tuple(value))  # a bare shape: one float32 tensor
    if isinstance(value, (tuple, list)) and value and all(isinstance(v, TensorSpec) for v in value):
        return tuple(value)
    if (isinstance(value, Mapping) and value and all(isinstance(k, str) for k in value)
            and all(isinstance(v, TensorSpec) for v in value.values())):
        return dict(value)
    raise ModelSpecError(
        f"{where} returned an input_spec of type {type(value).__name__}: use a TensorSpec, a "
        "shape tuple, a tuple of TensorSpecs or a dict of TensorSpecs")
