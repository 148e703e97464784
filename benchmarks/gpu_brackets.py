"""``batchfit max --gpu`` against real out-of-memory brackets measured on real GPUs.

How it asks batchfit: ``batchfit.max_batch_size(factory, (3, S, S),
batchfit.TrainConfig(...), device="CARD NAME")``, a user's own model (the row's timm
release) on the catalog card.

The data (``/work/shared/data/gpu_brackets/``, see its README) are timm's own
``benchmark.py`` runs: for each model, the largest batch that ran (``batch_fit``) and
the next size of its decay sequence, which failed (``batch_failed``). Every row is
predicted here as a user would ask for it, with that run's settings through
batchfit's public API (``batchfit.max_batch_size``):

* the card from the catalog by the row's name, as ``--gpu NAME`` (the RTX PRO 6000
  Blackwell Max-Q included: the catalog has it, with its CUDA total);
* ``timm.create_model(name)`` with the script's arguments (``drop_rate=0``, no drop
  path), input ``(3, img_size, img_size)``, ``channels_last`` for nhwc rows, from the
  timm release that produced the row's file (:data:`TIMM_OF_SOURCE`: the model code
  decides which tensors are alive, so a later timm is a different step), installed
  beside the project's own (``--install-timm``, or by the first run that needs it);
  ``--timm installed`` uses the installed timm for every row instead;
* train rows: SGD with Nesterov momentum (timm's ``sgd``), fp16 autocast, and timm 0.6's
  explicit attention (``q @ k.T``, softmax: no ``F.scaled_dot_product_attention``);
  inference rows: ``eval()``, fp16 autocast, timm 1.0's fused attention;
* where this batchfit has them, the run's stack (torch and CUDA versions) and
  ``cudnn.benchmark=True``; older code gets what it has, and the row says what was set;
* ``max_batch_limit`` = the size the run started at (a row at the start size has no
  upper bound, so the data leave it out; an answer there is above every bracket).

A prediction is *in* the bracket when ``batch_fit <= B* < batch_failed``, *over* when
``B* >= batch_failed`` (the user crashes), *under* when ``B* < batch_fit``. The error is
``|log2(B* / sqrt(batch_fit * batch_failed))|``, against the bracket's geometric middle.
``nonmemory_dev.csv`` rows (failures that are probably a kernel limit, not memory) are
scored the same, and counted as *explained* when in the bracket with a binding
constraint other than memory.

Each row runs in a forked child with a time limit; results are cached per row in
``benchmarks/results/gpu_brackets/<tag>.jsonl`` (``--tag``, default the git commit), so
an interrupted run resumes where it stopped. ``--sample N`` takes N rows spread evenly
over the source files (the same rows every time). ``--trace-cache DIR`` (a directory
outside the repo) keeps every trace a row takes, keyed by the tracing code's digest
(``engine/``, ``models/``, torch and timm versions) and the row's settings, so a later run
after a change to the replay, the allocator or the solver costs only replays.

Usage:
    python benchmarks/gpu_brackets.py --install-timm   # the rows' timm releases (a run
                                                       # installs missing ones itself)
    nice -n 10 python benchmarks/gpu_brackets.py [--set T|I] [--sample N] [--gpu NAME]
        [--jobs 2] [--files memory,nonmemory] [--models REGEX] [--tag NAME] [--timeout S]
        [--trace-cache DIR] [--timm release|installed]
    python benchmarks/gpu_brackets.py --report TAG [--compare TAG]

Writes ``benchmarks/results/gpu_brackets/<tag>.jsonl`` (rows) and ``<tag>.md`` (tables).
"""

from __future__ import annotations

import argparse
import collections
import csv
import dataclasses
import json
import math
import os
import pickle
import re
import select
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "gpu_brackets"
DATA = Path(os.environ.get("GPU_BRACKETS_DATA", "/work/shared/data/gpu_brackets"))
PRO6000_MAXQ = "RTX PRO 6000 Blackwell Max-Q"
#: Where benchmark.py starts each file's decay sequence (the data README).
START_SIZE = {("T", "nchw"): 512, ("T", "nhwc"): 512, ("I", "nhwc"): 512}
#: CUDA version of each torch build the rows ran (the data README).
CUDA_OF_SOURCE = (("cu113", "11.3"), ("cu124", "12.4"), ("cu128", "12.8"), ("cu130", "13.0"))
#: The timm release benchmark.py ran for each file, from the commits that added the files
#: to huggingface/pytorch-image-models ``results/``: the pt240 files in b3f3a005, 5c33776a
#: and ee5b1e82 (2024-08-26 to 09-05, v1.0.9 plus up to 9 commits), the pt291 files in
#: 90cae8c5 (tagged v1.0.24, 2026-01-06). The pt110/pt112 train files ran timm 0.6.x
#: (2022), which does not import on Python 3.11 (a dataclass with a mutable default): those
#: rows use the installed timm with timm 0.6's explicit attention.
TIMM_OF_SOURCE = (("pt240", "1.0.9"), ("pt291", "1.0.24"))
#: Where ``--install-timm`` puts each release (``pip install --target``; not in git).
TIMM_DIR = HERE / ".timm"


@dataclasses.dataclass(frozen=True)
class Row:
    file: str  # memory or nonmemory
    index: int  # line in its file, from 0
    set: str  # noqa: A003 - the data's column name
    model: str
    img_size: int
    gpu: str
    torch: str
    layout: str
    batch_fit: int
    batch_failed: int
    source_file: str
    evidence: str = ""

    @property
    def key(self) -> str:
        return f"{self.file}:{self.index}:{self.model}:{self.gpu}:{self.torch}:{self.layout}"

    def _tagged(self, table: tuple[tuple[str, str], ...]) -> str | None:
        """The version of the first ``(tag, version)`` whose tag is a ``-``-separated part
        of the row's file name."""
        return next((version for tag, version in table if f"-{tag}-" in self.source_file), None)

    @property
    def cuda(self) -> str:
        version = self._tagged(CUDA_OF_SOURCE)
        if version is None:
            raise ValueError(f"no CUDA version in {self.source_file}")
        return version

    @property
    def timm_release(self) -> str | None:
        """The timm release that produced this row's file; None: not installable here."""
        return self._tagged(TIMM_OF_SOURCE)

    @property
    def start_size(self) -> int:
        if (self.set, self.layout) in START_SIZE:
            return START_SIZE[(self.set, self.layout)]
        return 2048 if self.gpu == PRO6000_MAXQ else 1024

    @property
    def family(self) -> str:
        return model_family(self.model)


def model_family(name: str) -> str:
    """``convnext_large`` -> ``convnext``, ``tf_efficientnet_b3`` -> ``efficientnet``,
    ``resnet50d`` -> ``resnet``: the architecture, not its size or variant."""
    words = [w for w in name.split("_") if w not in ("tf", "gluon", "legacy", "ig", "ssl", "swsl")]
    head = words[0] if words else name
    return re.sub(r"[0-9].*$", "", head) or head


def read_rows(files: Iterable[str]) -> list[Row]:
    rows = []
    for file in files:
        path = DATA / f"{file}_dev.csv"
        with path.open(newline="") as handle:
            for index, raw in enumerate(csv.DictReader(handle)):
                rows.append(Row(
                    file=file, index=index, set=raw["set"], model=raw["model"],
                    img_size=int(raw["img_size"]), gpu=raw["gpu"], torch=raw["torch"],
                    layout=raw["layout"], batch_fit=int(raw["batch_fit"]),
                    batch_failed=int(raw["batch_failed"]), source_file=raw["source_file"],
                    evidence=raw.get("evidence", "")))
    return rows


def stratified_sample(rows: list[Row], n: int) -> list[Row]:
    """``n`` rows spread evenly over the source files: every k-th row of each file."""
    by_source: dict[tuple[str, str], list[Row]] = collections.defaultdict(list)
    for row in rows:
        by_source[(row.file, row.source_file)].append(row)
    groups = sorted(by_source.values(), key=lambda g: (g[0].file, g[0].source_file))
    per_group = [n * len(g) // len(rows) for g in groups]
    for i in range(n - sum(per_group)):  # remainders, largest groups first
        per_group[sorted(range(len(groups)), key=lambda j: -len(groups[j]))[i % len(groups)]] += 1
    chosen = []
    for group, take in zip(groups, per_group):
        if take:
            step = len(group) / take
            chosen += [group[int(i * step)] for i in range(take)]
    return chosen


# ------------------------------------------------------------------------- one row


def build_timm(name: str, fused_attn: bool) -> Any:
    """``timm.create_model`` as benchmark.py calls it; ``fused_attn=False`` gives timm
    0.6's explicit attention (the train rows), True timm 1.0's default."""
    import timm
    from timm.layers import config as timm_layer_config

    saved = timm_layer_config._USE_FUSED_ATTN
    timm.layers.set_fused_attn(fused_attn)
    try:
        return timm.create_model(name, pretrained=False, drop_rate=0.0,
                                 drop_path_rate=None, drop_block_rate=None)
    finally:
        timm_layer_config._USE_FUSED_ATTN = saved


def build_timm_on_cpu(name: str, fused_attn: bool) -> Any:
    """:func:`build_timm` with real weights on the CPU, whatever device batchfit builds on."""
    import torch

    with torch.device("cpu"):
        return build_timm(name, fused_attn)


def device_for(row: Row) -> Any:
    """The row's card as ``--gpu NAME`` resolves it: the catalog's profile of that name (the
    trace cache's key; the prediction names the card itself)."""
    from batchfit.device.profile import resolve_device

    return resolve_device(row.gpu)


def row_settings(row: Row) -> dict[str, Any]:
    """The run's settings as TrainConfig fields, limited to the ones this batchfit has."""
    import batchfit

    fields = {f.name for f in dataclasses.fields(batchfit.TrainConfig)}
    train = row.set == "T"
    settings: dict[str, Any] = {
        "mode": "train" if train else "infer",
        "optimizer": "nesterov",
        "optimizer_kwargs": {"lr": 1e-4, "momentum": 0.9, "nesterov": True},
        "precision": "amp-fp16",
        "channels_last": row.layout == "nhwc",
    }
    if "stack" in fields:  # torch/CUDA versions decide zero_grad, context, attention...
        settings["stack"] = f"torch{row.torch}+cu{row.cuda}"
    if "cudnn_benchmark" in fields:
        settings["cudnn_benchmark"] = True
    if "inference_mode" in fields and not train:
        settings["inference_mode"] = row.torch.startswith("2.9")
    if "alloc_conf" in fields:  # benchmark.py ran torch's default allocator, whatever ours has
        settings["alloc_conf"] = ""
    return settings


def tracing_source_hash() -> str:
    """A digest of what a trace depends on: batchfit's tracing code (``engine/``,
    ``models/``) and the torch and timm versions. A code change elsewhere (the allocator
    replay, the solver, the limits' evaluation at a batch) keeps cached traces valid."""
    import hashlib

    import batchfit
    import timm
    import torch

    digest = hashlib.sha256(f"{torch.__version__} {timm.__version__}".encode())
    root = Path(batchfit.__file__).resolve().parent
    for sub in ("engine", "models"):
        for path in sorted((root / sub).rglob("*.py")):
            digest.update(str(path.relative_to(root)).encode())
            digest.update(_code_without_docstrings(path.read_text()).encode())
    return digest.hexdigest()[:16]


def _code_without_docstrings(source: str) -> str:
    """The module's syntax tree without docstrings or comments (a documentation edit
    keeps the cached traces)."""
    import ast

    tree = ast.parse(source)
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                and body and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str)):
            node.body = body[1:] or [ast.Pass()]
    return ast.dump(tree)


def install_trace_cache(cache_dir: Path, row: Row, config: Any, device: Any) -> None:
    """Serve ``max_batch_size``'s traces from ``cache_dir`` (one pickle per row setting and
    batch size, keyed by :func:`tracing_source_hash`), tracing and storing on a miss.

    Everything after the trace (the allocator replay of the step, the solver, the kernel
    limits' check on the traced launches) runs as without the cache, so a rerun after a
    change outside the tracing code costs the replays only. Patched in the row's child
    process, before ``max_batch_size`` forks its trace worker.
    """
    import hashlib

    from batchfit.answers import maxbatch

    real = maxbatch.trace_step
    # The trace does not read the device's memory (only the replay does): a change of the
    # card's memory keeps the row's traces.
    traced_device = {f.name: getattr(device, f.name) for f in dataclasses.fields(device)
                     if f.name != "total_memory_bytes"}
    base = (f"{tracing_source_hash()}|{row.set}|{row.model}|{row.img_size}|{config!r}|"
            f"{traced_device!r}")
    cache_dir.mkdir(parents=True, exist_ok=True)

    def cached_trace_step(model: Any, inputs: Any, batch_size: int, *args: Any, **kwargs: Any
                          ) -> Any:
        name = hashlib.sha256(f"{base}|{batch_size}".encode()).hexdigest()[:24]
        path = cache_dir / f"{row.model}-{row.img_size}-{name}.pkl"
        if path.exists():
            with path.open("rb") as handle:
                return pickle.load(handle)
        traced = real(model, inputs, batch_size, *args, **kwargs)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        with tmp.open("wb") as handle:
            pickle.dump(traced, handle)
        tmp.replace(path)
        return traced

    maxbatch.trace_step = cached_trace_step


def use_timm_release(version: str, timm_dir: Path) -> None:
    """Make ``import timm`` load ``version`` from ``timm_dir`` in this process: the timm
    modules already imported are dropped and the release's directory goes first on the
    path. For a forked row (:func:`run_in_child`): the parent keeps its own timm."""
    path = timm_dir / version
    if not (path / "timm").is_dir():
        raise FileNotFoundError(f"timm {version} is not in {timm_dir}: run --install-timm")
    for name in [n for n in sys.modules if n == "timm" or n.startswith("timm.")]:
        del sys.modules[name]
    sys.path.insert(0, str(path))


def missing_timm_releases(rows: Iterable[Row], timm_dir: Path) -> list[str]:
    """The releases ``rows`` ran that ``--install-timm`` has not put in ``timm_dir``."""
    wanted = {row.timm_release for row in rows} - {None}
    return sorted(v for v in wanted if not (timm_dir / v / "timm").is_dir())


def install_timm_releases(timm_dir: Path) -> None:
    """``pip install --no-deps --target timm_dir/<version> timm==<version>`` for each release
    of :data:`TIMM_OF_SOURCE` (their dependencies are the installed timm's)."""
    for _, version in TIMM_OF_SOURCE:
        target = timm_dir / version
        if (target / "timm").is_dir():
            continue
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                        "--target", str(target), f"timm=={version}"], check=True)


def predict_row(row: Row, trace_cache: Path | None = None) -> dict[str, Any]:
    """``batchfit.max_batch_size`` for one row, in this process."""
    import functools

    import timm

    import batchfit

    settings = row_settings(row)
    config = batchfit.TrainConfig(**settings)
    if trace_cache is not None:
        install_trace_cache(trace_cache, row, config, device_for(row))

    def solve(build: Any) -> Any:
        return batchfit.max_batch_size(functools.partial(build, row.model, row.set != "T"),
                                       (3, row.img_size, row.img_size), config,
                                       device=row.gpu, max_batch_limit=row.start_size)

    start = time.perf_counter()
    built = "meta"
    try:
        result = solve(build_timm)
    except batchfit.ModelSpecError:
        # Some releases' constructors need real tensors everywhere (timm 1.0.9's hybrid
        # embedding runs its backbone on a zero image to size itself): build on the CPU
        # for real, as benchmark.py does before moving the model to the GPU.
        built = "cpu"
        result = solve(build_timm_on_cpu)
    est = result.estimate_at_max
    return {
        "predicted": result.max_batch_size,
        "binding_constraint": result.binding_constraint.value,
        "note": result.note,
        "traces": result.traces,
        "seconds": round(time.perf_counter() - start, 1),
        "budget_bytes": result.budget_bytes,
        "memory_bytes": result.memory_bytes,
        "context_bytes": result.device.context_bytes,
        "workspace_bytes": result.device.workspace_bytes,
        "total_bytes_at_max": result.total_bytes_at_max,
        "by_category": {c.value: b for c, b in est.by_category.items()},
        "peak_phase": est.peak_phase.value,
        "peak_op": est.peak_op,
        "evaluated": [list(p) for p in result.evaluated],
        "settings": {k: v for k, v in settings.items() if k != "optimizer_kwargs"},
        "timm": timm.__version__,
        "built": built,
    }


def run_in_child(row: Row, timeout_s: float, trace_cache: Path | None = None,
                 timm_dir: Path | None = None,
                 predict: Callable[[Row], dict[str, Any]] | None = None) -> dict[str, Any]:
    """``predict_row`` (or ``predict(row)``) in a forked child (own memory, killed after
    ``timeout_s``), with the row's timm release from ``timm_dir`` (None: the installed
    timm)."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        os.close(read_fd)
        os.setpgid(0, 0)  # its own group, so a timeout also stops its trace worker
        try:
            try:
                if timm_dir is not None and row.timm_release is not None:
                    use_timm_release(row.timm_release, timm_dir)
                payload: dict[str, Any] = (predict(row) if predict is not None
                                           else predict_row(row, trace_cache))
            except Exception as exc:  # noqa: BLE001 - recorded with the row
                payload = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"}
            data = pickle.dumps(payload)
            with os.fdopen(write_fd, "wb") as out:
                out.write(data)
        finally:
            os._exit(0)
    os.close(write_fd)
    chunks = []
    deadline = time.monotonic() + timeout_s
    with os.fdopen(read_fd, "rb") as inp:
        while True:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([inp], [], [], max(0.0, left))
            if not ready:
                _kill_group(pid)
                os.waitpid(pid, 0)
                return {"error": f"timeout after {timeout_s:.0f} s"}
            chunk = os.read(inp.fileno(), 1 << 16)
            if not chunk:
                break
            chunks.append(chunk)
    _, status = os.waitpid(pid, 0)
    if not chunks:
        return {"error": f"child died (status {status})"}
    return pickle.loads(b"".join(chunks))


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)  # the group this child created: it and its worker
    except ProcessLookupError:
        pass


# ------------------------------------------------------------------------- scoring


def outcome(row: dict[str, Any]) -> str:
    predicted = row.get("predicted")
    if predicted is None:
        return "error"
    if predicted >= row["batch_failed"]:
        return "over"
    if predicted < row["batch_fit"]:
        return "under"
    return "in"


def log2_error(row: dict[str, Any]) -> float | None:
    predicted = row.get("predicted")
    if not predicted:
        return None
    return abs(math.log2(predicted / math.sqrt(row["batch_fit"] * row["batch_failed"])))


def score(rows: list[dict[str, Any]]) -> dict[str, Any]:
    counts = collections.Counter(outcome(r) for r in rows)
    scored = sum(counts[k] for k in ("in", "over", "under"))
    errors = [e for e in (log2_error(r) for r in rows) if e is not None]
    pct = (lambda k: round(100.0 * counts[k] / scored, 1)) if scored else (lambda k: None)
    return {"rows": len(rows), "in_pct": pct("in"), "over_pct": pct("over"),
            "under_pct": pct("under"), "errors": counts["error"],
            "median_abs_log2": round(statistics.median(errors), 3) if errors else None,
            "nonmemory_explained": sum(1 for r in rows if outcome(r) == "in"
                                       and r.get("binding_constraint") not in (None, "memory"))}


def _table(title: str, groups: dict[str, list[dict[str, Any]]]) -> list[str]:
    lines = [f"### {title}", "",
             "| group | rows | in | over | under | errors | median abs log2 | in w/ non-memory limit |",
             "|---|---|---|---|---|---|---|---|"]
    for name, rows in sorted(groups.items()):
        s = score(rows)
        lines.append(f"| {name} | {s['rows']} | {s['in_pct']}% | {s['over_pct']}% | "
                     f"{s['under_pct']}% | {s['errors']} | {s['median_abs_log2']} | "
                     f"{s['nonmemory_explained']} |")
    return lines + [""]


def without_common_scale(rows: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Models (per set) whose memory-bound rows no single scale of the prediction fits.

    If the emulation were off by a factor that depends on the model only, some ``k`` would
    put ``k * predicted`` inside every bracket of that model: ``batch_fit / predicted <= k <
    batch_failed / predicted`` for all its rows. When no ``k`` exists, the cards, stacks or
    layouts disagree with each other relative to the prediction, and a fix that is right for
    one row is wrong for another: only a mechanism that depends on the card, the stack or
    the layout can bring all of them in.

    >>> row = lambda gpu, fit, failed, p: {"set": "I", "model": "m", "gpu": gpu,
    ...     "batch_fit": fit, "batch_failed": failed, "predicted": p,
    ...     "binding_constraint": "memory"}
    >>> sorted(without_common_scale([row("a", 768, 1024, 735), row("b", 512, 768, 735)]))
    ['I m']
    >>> without_common_scale([row("a", 768, 1024, 735), row("b", 768, 1024, 700)])
    {}
    """
    return {name: rs for name, rs in _memory_bound_by_model(rows).items() if len(rs) > 1
            and max(r["batch_fit"] / r["predicted"] for r in rs)
            >= min(r["batch_failed"] / r["predicted"] for r in rs)}


def _memory_bound_by_model(rows: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    models: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
    for r in rows:
        if r.get("predicted") and r.get("binding_constraint") == "memory":
            models[f"{r['set']} {r['model']}"].append(r)
    return models


def _no_common_scale_lines(rows: list[dict[str, Any]]) -> list[str]:
    models = without_common_scale(rows)
    several = sum(len(rs) > 1 for rs in _memory_bound_by_model(rows).values())
    theirs = [r for rs in models.values() for r in rs]
    misses = sum(outcome(r) in ("over", "under") for r in theirs)
    lines = ["### memory_dev.csv: models no single scale of the prediction fits", "",
             (f"{len(models)} of {several} models with two or "
              f"more memory-bound rows; {misses} of their {len(theirs)} rows miss their "
              "bracket (see `without_common_scale`)."), ""]
    for name, rs in sorted(models.items()):
        brackets = ", ".join(f"{r['gpu']} {r['torch']} {r['layout']} [{r['batch_fit']}, "
                             f"{r['batch_failed']}) vs {r['predicted']}" for r in rs)
        lines.append(f"- {name}: {brackets}")
    return lines + [""]


def report(rows: list[dict[str, Any]], tag: str) -> str:
    def by(key: Any, subset: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
        groups: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
        for r in subset:
            groups[key(r)].append(r)
        return groups

    memory = [r for r in rows if r["file"] == "memory"]
    nonmemory = [r for r in rows if r["file"] == "nonmemory"]
    lines = [f"## gpu_brackets: {tag}", ""]
    lines += _table("memory_dev.csv by set (T train, I inference)",
                    by(lambda r: r["set"], memory))
    lines += _table("memory_dev.csv by source (set, GPU, torch, layout)",
                    by(lambda r: f"{r['set']} {r['gpu']} {r['torch']} {r['layout']}", memory))
    lines += _table("memory_dev.csv by model family (both sets)",
                    by(lambda r: f"{r['set']} {model_family(r['model'])}", memory))
    lines += _table("memory_dev.csv by binding constraint",
                    by(lambda r: f"{r['set']} {r.get('binding_constraint')}", memory))
    lines += _no_common_scale_lines(memory)
    if nonmemory:
        lines += _table("nonmemory_dev.csv by source",
                        by(lambda r: f"{r['gpu']} {r['torch']} {r['layout']}", nonmemory))
    errors = [r for r in rows if outcome(r) == "error"]
    if errors:
        lines += ["### errors", ""] + [f"- {r['model']} ({r['set']}, {r['gpu']}): {r['error']}"
                                       for r in errors] + [""]
    return "\n".join(lines)


def compare(before: list[dict[str, Any]], after: list[dict[str, Any]]) -> str:
    """Per set, the rows both runs have: before vs after."""
    keys = {r["key"] for r in before} & {r["key"] for r in after}
    lines = ["| set | rows | in (before -> after) | over | under | median abs log2 |",
             "|---|---|---|---|---|---|"]
    for file, name in (("memory", "T"), ("memory", "I"), ("nonmemory", "I")):
        b = [r for r in before if r["key"] in keys and r["file"] == file and r["set"] == name]
        a = [r for r in after if r["key"] in keys and r["file"] == file and r["set"] == name]
        if not a:
            continue
        sb, sa = score(b), score(a)
        lines.append(f"| {file} {name} | {len(a)} | {sb['in_pct']}% -> {sa['in_pct']}% | "
                     f"{sb['over_pct']}% -> {sa['over_pct']}% | "
                     f"{sb['under_pct']}% -> {sa['under_pct']}% | "
                     f"{sb['median_abs_log2']} -> {sa['median_abs_log2']} |")
    return "\n".join(lines)


# ------------------------------------------------------------------------- driver


def load_cache(path: Path) -> dict[str, dict[str, Any]]:
    cached: dict[str, dict[str, Any]] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                record = json.loads(line)
                cached[record["key"]] = record
    return cached


def default_tag() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, text=True,
                              capture_output=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "../src"], cwd=HERE,
                               text=True, capture_output=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unversioned"
    return f"{head}-dirty" if dirty else head


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--set", choices=("T", "I"), help="train (T) or inference (I) rows only")
    parser.add_argument("--sample", type=int, help="N rows spread over the source files")
    parser.add_argument("--gpu", help="rows of this GPU only (as in the data, e.g. 'RTX 4090')")
    parser.add_argument("--models", help="rows whose model matches this regex")
    parser.add_argument("--files", default="memory,nonmemory", help="memory,nonmemory")
    parser.add_argument("--jobs", type=int, default=1, help="rows predicted at once")
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds per row")
    parser.add_argument("--tag", help="name of this run's cache and report (default: git HEAD)")
    parser.add_argument("--report", metavar="TAG", help="only print the report of a cached run")
    parser.add_argument("--compare", metavar="TAG", help="before/after table against this run")
    parser.add_argument("--retry-errors", action="store_true", help="predict errored rows again")
    parser.add_argument("--rows-from", metavar="JSONL", type=Path,
                        help="only the rows (their 'key') of this results file, e.g. another tag's")
    parser.add_argument("--trace-cache", metavar="DIR", type=Path,
                        help="keep each row's traces here (outside the repo) and reuse them")
    parser.add_argument("--timm", choices=("release", "installed"), default="release",
                        help="the timm release each file ran (default) or the installed timm")
    parser.add_argument("--timm-dir", type=Path, default=TIMM_DIR, metavar="DIR",
                        help=f"where --install-timm puts the releases (default {TIMM_DIR})")
    parser.add_argument("--install-timm", action="store_true",
                        help="pip-install the rows' timm releases into --timm-dir, then stop")
    args = parser.parse_args(argv)
    if args.install_timm:
        install_timm_releases(args.timm_dir)
        return

    tag = args.report or args.tag or default_tag()
    RESULTS.mkdir(parents=True, exist_ok=True)
    cache_path = RESULTS / f"{tag}.jsonl"
    cached = load_cache(cache_path)
    rows = read_rows(f.strip() for f in args.files.split(",") if f.strip())
    if args.set:
        rows = [r for r in rows if r.set == args.set]
    if args.gpu:
        rows = [r for r in rows if r.gpu.lower() == args.gpu.lower()]
    if args.models:
        rows = [r for r in rows if re.search(args.models, r.model)]
    if args.sample:
        rows = stratified_sample(rows, min(args.sample, len(rows)))
    if args.rows_from:
        keys = set(load_cache(args.rows_from))
        rows = [r for r in rows if r.key in keys]
    if not args.report:
        todo = [r for r in rows if r.key not in cached
                or (args.retry_errors and "error" in cached[r.key])]
        timm_dir = args.timm_dir if args.timm == "release" else None
        if timm_dir is not None and (missing := missing_timm_releases(todo, timm_dir)):
            print(f"installing timm {', '.join(missing)} (the release the rows ran) into "
                  f"{timm_dir}", flush=True)
            try:
                install_timm_releases(timm_dir)
            except (OSError, subprocess.CalledProcessError) as exc:
                print(f"timm {', '.join(missing)} (the release the rows ran) could not be "
                      f"installed into {timm_dir} ({exc}): install it with --install-timm, "
                      "or pass --timm installed", file=sys.stderr)
                raise SystemExit(2) from None
        _predict_all(todo, cached, cache_path, args.jobs, args.timeout, args.trace_cache,
                     timm_dir)
    results = [cached[r.key] for r in rows if r.key in cached]
    text = report(results, tag)
    if args.compare:
        before = list(load_cache(RESULTS / f"{args.compare}.jsonl").values())
        text += f"\n### before ({args.compare}) -> after ({tag}), rows in both\n\n"
        text += compare(before, results) + "\n"
    (RESULTS / f"{tag}.md").write_text(text + "\n")
    print(text)


def _predict_all(todo: list[Row], cached: dict[str, dict[str, Any]], cache_path: Path,
                 jobs: int, timeout_s: float, trace_cache: Path | None = None,
                 timm_dir: Path | None = None) -> None:
    if not todo:
        return
    try:
        os.nice(10)
    except OSError:
        pass
    if jobs > 1:  # each row already uses the second core for paired traces when idle
        os.environ["BATCHFIT_PARALLEL_TRACES"] = "0"
    import batchfit  # noqa: F401 - imported once here, inherited by every forked row
    import timm  # noqa: F401 - a row of another release drops it (use_timm_release)
    import torch  # noqa: F401

    queue = list(todo)
    done = 0
    start = time.perf_counter()
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool, cache_path.open("a") as out:
        futures = {pool.submit(run_in_child, row, timeout_s, trace_cache, timm_dir): row
                   for row in queue}
        from concurrent.futures import as_completed

        for future in as_completed(futures):
            row = futures[future]
            payload = future.result()
            record = {"key": row.key, **dataclasses.asdict(row), **payload}
            cached[row.key] = record
            out.write(json.dumps(record) + "\n")
            out.flush()
            done += 1
            mark = outcome(record)
            print(f"[{done}/{len(todo)} {time.perf_counter() - start:.0f}s] {row.set} "
                  f"{row.model} {row.gpu} {row.torch} {row.layout}: predicted "
                  f"{record.get('predicted')} bracket [{row.batch_fit}, {row.batch_failed}) "
                  f"{mark} {record.get('binding_constraint', record.get('error', ''))} "
                  f"({record.get('seconds', '-')} s)", flush=True)


if __name__ == "__main__":
    main()
