"""Accuracy benchmarks ask batchfit the way a user does (issue 40).

A prediction set against a published or measured figure is only a figure for users when it
was asked through the public API in the user's words (a spec string, a catalog card name,
``memory=``, ``stack=``, the CLI's options) or the CLI itself: a hand-built device profile,
a private helper or an internal field makes a different question. Speed and exactness
harnesses time or check the engine itself and may reach inside; each is listed with why.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"

#: What a user cannot write: a hand-built profile, the budget's or the allocator's private
#: helpers, internal config fields, a private name imported from batchfit, or any module of
#: batchfit but the public ones (``batchfit``, ``batchfit.api``, and ``batchfit.cli`` for the
#: command line itself).
FORBIDDEN = {
    "a hand-built device profile": re.compile(r"DeviceProfile\.cuda\("),
    "the private budget helper": re.compile(r"\b_budget\b"),
    "the private allocator helper": re.compile(r"\b_allocator_bytes\b"),
    "an internal config field": re.compile(r"\bgrads_to_none\b|\bforeach\s*="),
    "a private batchfit name": re.compile(r"from batchfit[\w.]* import [^\n]*\b_[a-z]\w*"),
    "a private batchfit module": re.compile(
        r"^[ \t]*(?:from|import)[ \t]+(batchfit\.(?!(?:api|cli)(?![\w.]))[\w.]+)", re.MULTILINE),
}

#: Accuracy benchmarks, asked in the user's words (the public API or the CLI).
ACCURACY = ("llm_published.py", "gpu_brackets.py", "max_vs_true_cpu.py",
            "published_sharded_users.py", "published_gpu_points.py", "recipes_published.py",
            "noise_closed_form.py", "noise_tradeoff.py", "bench_knee.py",
            "search_user_process.py", "accuracy_cpu.py")

#: Modules an accuracy benchmark may import for what is not the prediction, with the reason.
TRUTH_SIDE = {
    "accuracy_cpu.py": {
        "batchfit.realrun.measure": "the truth: the step the case's words name, run for real "
                                    "and measured by the profiler and a live-storage tracker",
    },
    "max_vs_true_cpu.py": {
        "batchfit.models.resolve": "the truth's real step is built from the spec the user "
                                   "names, by the same resolver",
        "batchfit.realrun.trial_server": "the truth: capped real trials in fresh processes",
    },
    "bench_knee.py": {
        "batchfit.speed.knee": "the dense reference's batches (batch_grid: every power of two "
                               "and midpoint) and the auto planner replayed on the dense "
                               "sweep's own numbers (next_auto_batch, find_knee): the "
                               "reference and a diagnostic of the planner, not the answer",
    },
    "gpu_brackets.py": {
        "batchfit.answers": "--trace-cache: a rerun reuses a row's traces, patched in the row's "
                            "child; the answer is the one the public call computes",
        "batchfit.device.profile": "the trace cache's key (the card as --gpu NAME resolves it)",
    },
}

#: Speed and exactness harnesses and diagnostics: allowed inside, with the reason.
HARNESSES = {
    "gpu_brackets_whatif.py": "experiments that swap a rule of the allocator replay and read "
                              "the profile's fields: a what-if of the engine, not an answer",
    "search_vs_peers.py": "times the real-device search against Lightning's and accelerate's "
                          "finders; its foreach=False is the real step every method runs",
    "sharded_speed.py": "wall time and RSS of multi-GPU answers; its foreach=True is the "
                        "peer's (torch's FSDPMemTracker) real optimizer",
    "trace_speed.py": "trace speed against torch's MemTracker; foreach=False is the peer's "
                      "real optimizer on the same step",
    "newcomer_probe.py": "a probe of the CLI's exit codes and first lines (its JSON keys "
                         "contain '_budget'), no figure",
    "published_sharded_points.py": "the published rows no option expresses: torch 2.0's "
                                   "foreach Adam (restated), FSDP1 with "
                                   "reshard_after_forward=False (fsdp-grad-op is FSDP2's), "
                                   "torchtitan's per-op checkpointing policy; the rest is "
                                   "published_sharded_users.py",
    "llm_cpu_exact.py": "exactness of the engine's CPU trace of LLM workloads against the "
                        "profiler on the same step (the tests' CPU cases, as TrainConfigs)",
    "gpu_brackets_dispatch.py": "the engine's inference trace against torch's own CUDA "
                                "dispatch on fake CUDA tensors: the emulation checked, no answer",
    "gpu_snapshot.py": "a diagnostic: one real GPU step's allocator record set against the "
                       "engine's events, allocation by allocation",
    "convnext_stage0_sim.py": "the allocator's rules simulated by hand apart from the engine, "
                              "to check a claim; no answer",
    "cpu_peak_spread.py": "measures how a capped CPU process's peak spreads between runs; "
                          "batchfit predicts nothing",
    "search_trials.py": "where a real-device search spends its steps: the trial's internals "
                        "instrumented",
    "bench_knee_roofline.py": "the roofline with rates measured on this CPU (measure_cpu_profile, "
                              "fastest_profile) against bench_knee.py's dense sweep: in words "
                              "throughput is predicted for catalog GPUs only",
    "accuracy_cpu_explain.py": "a diagnostic of one accuracy_cpu.py case: the engine's trace "
                                "set against the real run's allocations op by op, through "
                                "trace_step, the replay and the tracker's internals",
    "sharded_vs_gloo.py": "exactness of each rank's trace against real gloo runs: a "
                          "tensors-only CPU profile and tiny DDP/DeepSpeed buckets "
                          "(bucket_cap_mb, deepspeed=) that no option sets",
}

#: Wall-time benchmarks: how long an answer takes, not what it is.
SPEED = {
    "llm_speed.py": "wall time and RSS of the LLM commands in fresh processes",
    "plan_speed.py": "wall time of batchfit plan in fresh processes",
    "plan_traces.py": "each trace of plan timed, through the planner's internals",
    "plan_trace_loads.py": "library loads and seconds per plan trace, old src against new",
    "search_speed.py": "where a CPU batchfit search spends its wall time",
    "noise_overhead.py": "the cost of NoiseScaleMonitor in a training loop",
    "replay_speed.py": "the allocator replay against the trace that makes its events",
}

#: Tools the benchmarks share; they produce no figure of their own.
TOOLS = {
    "accuracy_page.py": "writes docs/accuracy.md from benchmarks/results",
    "zoo.py": "the cases accuracy_cpu.py asks about, in the user's words (spec string and "
              "options), and the model files' factories they name",
    "gpu_brackets_cards.py": "compares timm's published files of two cards; reads the "
                             "catalog's CUDA totals, predicts nothing",
}

#: Accuracy benchmarks still to convert, each with what stands in the way.
PENDING = {
}

LISTS = {"ACCURACY": dict.fromkeys(ACCURACY, ""), "HARNESSES": HARNESSES, "SPEED": SPEED,
         "TOOLS": TOOLS, "PENDING": PENDING}


def _code(path: Path) -> str:
    """The file without the code it runs as the measured truth in a fresh process
    (module-level strings named ``*_CHILD``): that is the real step, not a prediction."""
    text = path.read_text()
    lines = text.splitlines()
    for node in ast.parse(text).body:
        if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
                and any(isinstance(t, ast.Name) and t.id.endswith("_CHILD")
                        for t in node.targets)):
            for i in range(node.lineno - 1, node.end_lineno):
                lines[i] = ""
    return "\n".join(lines)


def _violations(name: str, code: str) -> list[str]:
    allowed = TRUTH_SIDE.get(name, {})
    return [f"{what}: {m.group(0).strip()!r}" for what, pattern in FORBIDDEN.items()
            for m in pattern.finditer(code)
            if not (m.groups() and m.group(1) in allowed)]


@pytest.mark.parametrize("name", ACCURACY)
def test_accuracy_benchmarks_use_no_internals(name: str) -> None:
    found = _violations(name, _code(BENCHMARKS / name))
    assert not found, f"{name} asks batchfit as no user can: {found}"


def test_a_private_module_is_forbidden(tmp_path: Path) -> None:
    """An accuracy benchmark importing any batchfit module but the public ones fails; the
    public ones pass, and so does an import the benchmark's TRUTH_SIDE lists."""
    probe = tmp_path / "probe.py"
    probe.write_text("import batchfit\nfrom batchfit.api import estimate\n"
                     "from batchfit.cli import main\n"
                     "def f():\n    from batchfit.answers.ranks import estimate_ranks\n"
                     "import batchfit.cli.report\nfrom batchfit.api.step import resolve_step\n"
                     "from batchfit.device.profile import resolve_device\n")
    found = _violations("probe.py", _code(probe))
    assert [f.split(": ")[1] for f in found] == [
        "'from batchfit.answers.ranks'", "'import batchfit.cli.report'",
        "'from batchfit.api.step'", "'from batchfit.device.profile'"]
    assert len(_violations("gpu_brackets.py", _code(probe))) == 3


@pytest.mark.parametrize("name", sorted({n for names in LISTS.values() for n in names}))
def test_benchmarks_say_how_they_ask(name: str) -> None:
    doc = ast.get_docstring(ast.parse((BENCHMARKS / name).read_text())) or ""
    assert re.search(r"^How it asks batchfit: \S", doc, re.MULTILINE), name


def test_every_benchmark_is_in_exactly_one_list() -> None:
    """Every script in benchmarks/ is classified once; every listed one exists, and each
    entry but an accuracy benchmark says why it is where it is."""
    scripts = {p.name for p in BENCHMARKS.glob("*.py")}
    for name in scripts:
        holders = [list_name for list_name, names in LISTS.items() if name in names]
        assert len(holders) == 1, f"{name} is in {holders or 'no list'}"
    for list_name, names in LISTS.items():
        for name, reason in names.items():
            assert name in scripts, f"{list_name} names {name}, which is not in benchmarks/"
            assert list_name == "ACCURACY" or len(reason) > 20, (list_name, name)
    assert set(TRUTH_SIDE) <= set(ACCURACY)


def test_the_truth_child_is_all_that_is_left_out(tmp_path: Path) -> None:
    """Only ``*_CHILD`` strings are blanked: a forbidden call beside one is still found."""
    probe = tmp_path / "probe.py"
    probe.write_text('TRUTH_CHILD = """\nfoo(foreach=False)\n"""\nbar(foreach=False)\n')
    assert _code(probe).count("foreach=False") == 1
