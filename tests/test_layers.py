"""The packages import one way: a layer imports only from lower layers (and itself).

The layers, lowest first, are the stages of the data flow (docs/architecture.md). The
check reads every module's import statements, including imports inside functions (the
lazy ones), so a higher layer cannot be reached by deferring the import.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

#: Rank of each package: a module may import a package of lower or equal rank; two
#: different packages of equal rank (peers) may not import each other.
LAYERS = {
    "batchfit.errors": 0,
    "batchfit._fork": 0,
    "batchfit._gc": 0,
    "batchfit._logs": 0,
    "batchfit.engine": 10,
    "batchfit.device": 20,
    "batchfit.models": 20,
    "batchfit.sharding": 25,
    "batchfit.answers": 30,
    "batchfit.realrun": 40,
    "batchfit.speed": 50,
    "batchfit.stats": 60,
    "batchfit.integrations": 70,
    "batchfit.api": 75,
    "batchfit.cli": 80,
}
#: The lazy public API (``batchfit/__init__.py``) sits above everything and is imported by
#: nothing inside the package.
FACADE = "batchfit"


def package_of(module: str) -> str | None:
    """The entry of :data:`LAYERS` that ``module`` belongs to, or None."""
    parts = module.split(".")
    for end in range(len(parts), 0, -1):
        name = ".".join(parts[:end])
        if name in LAYERS:
            return name
    return None


def imported_modules(source: str) -> list[tuple[int, str]]:
    """``(line, module)`` of every batchfit import in ``source``; ``from batchfit import x``
    counts as importing ``batchfit.x`` when x is a package or module, else the facade."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names
                      if alias.name.split(".")[0] == "batchfit"]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == FACADE:
                for alias in node.names:
                    sub = f"batchfit.{alias.name}"
                    found.append((node.lineno, sub if package_of(sub) else FACADE))
            elif node.module.split(".")[0] == "batchfit":
                found.append((node.lineno, node.module))
    return found


def violations(module: str, source: str) -> list[str]:
    """What ``module`` (a dotted name) imports against the layering."""
    home = package_of(module)
    if home is None:
        return [f"{module}: not in any layer (add its package to LAYERS)"]
    problems = []
    for line, target in imported_modules(source):
        if target == FACADE:
            problems.append(f"{module}:{line} imports the public facade `batchfit`; import the "
                            f"defining module instead")
            continue
        other = package_of(target)
        if other is None:
            problems.append(f"{module}:{line} imports {target}, which is in no layer")
        elif other != home and LAYERS[other] >= LAYERS[home]:
            problems.append(f"{module}:{line} ({home}, layer {LAYERS[home]}) imports {target} "
                            f"({other}, layer {LAYERS[other]})")
    return problems


def package_modules() -> list[tuple[str, Path]]:
    modules = []
    for path in sorted((SRC / "batchfit").rglob("*.py")):
        parts = path.relative_to(SRC).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if parts == ("batchfit",):
            continue  # the facade
        modules.append((".".join(parts), path))
    return modules


def test_every_module_imports_only_lower_layers():
    problems = [p for module, path in package_modules()
                for p in violations(module, path.read_text(encoding="utf-8"))]
    assert problems == []


def test_every_package_is_in_a_layer():
    packages = {p.parent.name for p in (SRC / "batchfit").glob("*/__init__.py")}
    assert {f"batchfit.{name}" for name in packages} <= set(LAYERS)


@pytest.mark.parametrize(("module", "source", "expected"), [
    # a lower layer reaching up, at module level and lazily inside a function
    ("batchfit.engine.trace", "from batchfit.cli.report import format_bytes\n", "imports"),
    ("batchfit.device.timeline", "def f():\n    from batchfit.answers import estimate\n",
     "imports"),
    ("batchfit.engine.spec", "import batchfit.realrun.search\n", "imports"),
    # peers of one layer
    ("batchfit.models.resolve", "from batchfit.device.catalog import find_gpu\n", "imports"),
    # the facade, which would import everything lazily
    ("batchfit.answers.maxbatch", "from batchfit import estimate\n", "facade"),
])
def test_a_deliberate_violation_is_caught(module, source, expected):
    found = violations(module, source)
    assert len(found) == 1 and expected in found[0]


@pytest.mark.parametrize(("module", "source"), [
    ("batchfit.cli.app", "from batchfit.engine.trace import Category\n"),
    ("batchfit.answers.maxbatch", "from batchfit.answers import tracepool\n"),
    ("batchfit.realrun.trial", "from batchfit.engine import _torch_internals as ti\n"),
    ("batchfit.device.profile", "from batchfit.errors import InvalidInputError\n"),
])
def test_imports_down_the_layers_are_allowed(module, source):
    assert violations(module, source) == []


# -- no import cycle inside a package -------------------------------------------------------


def module_imports(module: str, source: str, modules: set[str]) -> set[str]:
    """The modules of ``modules`` that ``module`` imports (lazy imports included)."""
    found = set()
    for _, target in imported_modules(source):
        while target and target not in modules:
            target = target.rpartition(".")[0]
        if target and target != module:
            found.add(target)
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:  # ``from batchfit.engine import keras_step``
                if f"{node.module}.{alias.name}" in modules:
                    found.add(f"{node.module}.{alias.name}")
    return found


def cycles_within_packages(sources: dict[str, str]) -> list[list[str]]:
    """Import cycles among modules of one package (the strongly connected components of
    the import graph restricted to same-package edges), each sorted."""
    modules = set(sources)
    graph = {m: {t for t in module_imports(m, s, modules) if package_of(t) == package_of(m)}
             for m, s in sources.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(node: str) -> None:  # Tarjan's algorithm
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in graph[node]:
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_cycle_inside_a_package():
    sources = {module: path.read_text(encoding="utf-8") for module, path in package_modules()}
    cycles = cycles_within_packages(sources)
    assert cycles == []


def test_a_deliberate_cycle_is_caught():
    # a lazy import closes the loop, as keras_trace <-> trace did
    sources = {
        "batchfit.engine.trace": "def f():\n    from batchfit.engine.keras_trace import g\n",
        "batchfit.engine.keras_trace": "from batchfit.engine.trace import StepTrace\n",
        "batchfit.engine.spec": "",
        "batchfit.device.profile": "from batchfit.engine.trace import StepTrace\n",
    }
    assert cycles_within_packages(sources) == [["batchfit.engine.keras_trace",
                                                "batchfit.engine.trace"]]
