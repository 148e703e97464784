"""Which modules become sharded units (FSDP's "wrap policy").

The default is the per-layer wrap every FSDP recipe uses (torchtitan, Hugging Face
accelerate's ``TRANSFORMER_BASED_WRAP``, Lightning's ``auto_wrap_policy``): every block
of a list of repeated blocks (a ``ModuleList`` or ``Sequential`` holding two or more
modules of one class that have parameters: transformer layers, ResNet bottlenecks),
plus the root, which holds what is left (embeddings, head). A tuple of classes or a
predicate picks the units instead.

Example:
    >>> import torch
    >>> net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    >>> [path for path, _ in sharded_units(net)]
    ['0', '2']
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

from torch import nn

from batchfit.errors import InvalidInputError, option


def sharded_units(model: nn.Module, wrap: Any = None) -> list[tuple[str, nn.Module]]:
    """The ``(path, module)`` of each unit below the root, outermost first, none inside
    another.

    Args:
        model: the model (on any device).
        wrap: None (repeated blocks), a class or tuple of classes, class names (strings),
            or a predicate ``(module, path) -> bool``.

    Raises:
        InvalidInputError: nothing in the model matches (the model's layers cannot be
            wrapped).
    """
    predicate = _predicate(model, wrap)
    units: list[tuple[str, nn.Module]] = []
    inside: list[str] = []
    for path, module in model.named_modules():
        if not path or any(path.startswith(p + ".") for p in inside):
            continue
        if predicate(module, path) and any(True for _ in module.parameters()):
            units.append((path, module))
            inside.append(path)
    if not units:
        raise InvalidInputError(_nothing_to_wrap(model, wrap))
    return units


def _predicate(model: nn.Module, wrap: Any) -> Callable[[nn.Module, str], bool]:
    if wrap is None:
        blocks = _repeated_blocks(model)
        return lambda module, path: id(module) in blocks
    if isinstance(wrap, (str, type)):
        wrap = (wrap,)
    if isinstance(wrap, (tuple, list, set, frozenset)):
        classes = tuple(w for w in wrap if isinstance(w, type))
        names = {w for w in wrap if isinstance(w, str)}
        if len(classes) + len(names) != len(wrap):
            raise InvalidInputError(
                f"wrap must be module classes or class names, not {wrap!r}")
        return lambda module, path: (isinstance(module, classes)
                                     or type(module).__name__ in names)
    if callable(wrap):
        return lambda module, path: bool(wrap(module, path))
    raise InvalidInputError(
        f"wrap must be None, module classes, class names or a predicate, not {wrap!r}")


def _repeated_blocks(model: nn.Module) -> set[int]:
    """ids of the children of containers that hold >= 2 parameterised modules of one class."""
    found: set[int] = set()
    for module in model.modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)):
            continue
        children = [c for c in module.children() if any(True for _ in c.parameters())]
        counts = Counter(type(c) for c in children)
        found.update(id(c) for c in children if counts[type(c)] >= 2)
    return found


def _nothing_to_wrap(model: nn.Module, wrap: Any) -> str:
    name = type(model).__name__
    if wrap is None:
        return (f"cannot find {name}'s layers to shard: it has no list of repeated blocks "
                "(a ModuleList or Sequential of two or more blocks of one class); name the "
                f"block class with {option('wrap', 'ClassName')}")
    return (f"no module of {name} matches the wrap policy {wrap!r}: name a class that the "
            "model contains and that has parameters")
