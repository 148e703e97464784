"""The predicted step written as a CUDA memory snapshot (``device/snapshot_export.py``).

The hand-built step's expected snapshot follows the caching allocator's rules
(c10/cuda/CUDACachingAllocator.cpp): a 1-10 MiB request gets a
20 MiB segment, split when more than 1 MiB would remain; a request >= 10 MiB rounds to
2 MiB; best fit among the cached blocks; a large block is not split when 1 MiB or less
would remain. The real-model checks read the export back with torch's own
``torch.cuda._memory_viz`` and batchfit's snapshot reader.
"""

from __future__ import annotations

import pickle

import pytest
from torch import nn

import batchfit
from batchfit.device.profile import DeviceProfile
from batchfit.device.snapshot import read_allocations
from batchfit.device.snapshot_export import predicted_snapshot, write_snapshot
from batchfit.engine.tracer import Category, Event, EventKind, Phase
from batchfit.errors import InvalidInputError

MiB = 1 << 20
GPU = DeviceProfile.cuda(8 << 30, (8, 0), context_bytes=0, workspace_bytes=0)


def _alloc(key, nbytes, phase=Phase.FORWARD, module="net.fc", op="aten.mm",
           category=Category.ACTIVATIONS):
    return Event(EventKind.ALLOC, key, nbytes, category, module, op, phase)


def _free(key, nbytes, phase=Phase.FORWARD):
    return Event(EventKind.FREE, key, nbytes, Category.ACTIVATIONS, "net.fc", "", phase)


def _step():
    # setup: a 4 MiB parameter; the step: A (3 MiB), B (12 MiB), both freed.
    return [_alloc(1, 4 * MiB, Phase.SETUP, "net", "parameter", Category.PARAMETERS),
            _alloc(2, 3 * MiB), _alloc(3, 12 * MiB, Phase.BACKWARD, "net.head", "aten.addmm"),
            _free(2, 3 * MiB), _free(3, 12 * MiB, Phase.BACKWARD)]


def test_hand_built_step_segments_and_trace():
    # The parameter takes a 20 MiB segment (1-10 MiB request) and splits it: 4 + 16 free.
    # A (3 MiB) is cut from the 16 MiB block: 3 + 13 free. B rounds to 12 MiB and takes
    # the best-fitting cached block, the 13 MiB one at offset 7 MiB: no second segment.
    # After the step A and B are free and merge into one 16 MiB block behind the parameter.
    snapshot = predicted_snapshot(_step(), GPU)
    (segment,) = snapshot["segments"]
    base = segment["address"]
    assert segment["total_size"] == 20 * MiB and segment["segment_type"] == "large"
    assert [(b["address"] - base, b["size"], b["state"], b["requested_size"])
            for b in segment["blocks"]] == [(0, 4 * MiB, "active_allocated", 4 * MiB),
                                            (4 * MiB, 16 * MiB, "inactive", 0)]
    assert segment["allocated_size"] == 4 * MiB
    assert segment["blocks"][0]["frames"][0] == {"filename": "net", "line": 0,
                                                "name": "parameter"}
    trace = snapshot["device_traces"][0]
    assert [(e["action"], e["addr"] - base, e["size"]) for e in trace] == [
        ("alloc", 4 * MiB, 3 * MiB), ("alloc", 7 * MiB, 12 * MiB),
        ("free_requested", 4 * MiB, 3 * MiB), ("free_completed", 4 * MiB, 3 * MiB),
        ("free_requested", 7 * MiB, 12 * MiB), ("free_completed", 7 * MiB, 12 * MiB)]
    assert trace[1]["frames"] == [
        {"filename": "net.head", "line": 0, "name": "aten.addmm"},
        {"filename": "batchfit", "line": 0, "name": "backward: activations"}]


def test_hand_built_step_read_back():
    # The reader rewinds from the segments: 4 MiB allocated, 20 MiB reserved before the
    # step; at most 4 + 3 + 12 = 19 MiB requested live, and the 20 MiB segment.
    real = read_allocations(predicted_snapshot(_step(), GPU))
    assert real.sizes == (3 * MiB, 12 * MiB)
    assert (real.peak_allocated_bytes, real.peak_reserved_bytes) == (19 * MiB, 20 * MiB)


def test_segment_allocated_and_freed_in_the_step():
    # The cuBLAS workspace (8 MiB) gets a 20 MiB segment. The step's 30 MiB request fits no
    # cached block and gets its own segment in the first step, which stays cached: the
    # steady step reuses it, so its trace has no segment_alloc.
    gpu = DeviceProfile.cuda(8 << 30, (8, 0), context_bytes=0, workspace_bytes=8 * MiB)
    events = [_alloc(1, 30 * MiB), _free(1, 30 * MiB)]
    snapshot = predicted_snapshot(events, gpu)
    actions = [e["action"] for e in snapshot["device_traces"][0]]
    assert actions == ["alloc", "free_requested", "free_completed"]
    sizes = sorted(s["total_size"] for s in snapshot["segments"])
    assert sizes == [20 * MiB, 30 * MiB]  # the workspace's 20 MiB segment, the cached one
    workspace = [b for s in snapshot["segments"] for b in s["blocks"]
                 if b["state"] == "active_allocated"]
    assert [(b["size"], b["frames"][0]["name"]) for b in workspace] == [
        (8 * MiB, "cuBLAS workspace")]


def test_cpu_and_expandable_targets_are_refused():
    with pytest.raises(InvalidInputError, match="GPU"):
        predicted_snapshot(_step(), DeviceProfile.cpu())
    from batchfit.device.allocator import AllocatorConfig

    expandable = GPU.with_allocator(AllocatorConfig.parse("expandable_segments:True"))
    with pytest.raises(InvalidInputError, match="expandable"):
        predicted_snapshot(_step(), expandable)


def _net():
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Flatten(),
                         nn.Linear(16 * 32 * 32, 10))


@pytest.mark.parametrize("options", [{}, {"precision": "amp-fp16"}])
def test_export_matches_the_estimate(options):
    est = batchfit.estimate(_net(), (3, 32, 32), 64, optimizer="adamw", device="A100",
                            **options)
    snapshot = est.predicted_snapshot()
    real = read_allocations(snapshot)
    # The replay of the steady step reaches the estimate's reserved peak; its allocations
    # are the traced step's, one for one.
    assert real.peak_reserved_bytes == est.peak_reserved_bytes
    step = [e.nbytes for e in est.events if e.kind is EventKind.ALLOC
            and e.phase is not Phase.SETUP and e.nbytes]
    assert list(real.sizes) == step
    # The segments at the step's allocated peak: its blocks in use are the estimate's peak
    # allocated bytes, and (this step reserves nothing after it) all its segments the
    # estimate's peak reserved bytes.
    peak = snapshot["batchfit"]["peak_segments"]
    assert sum(b["size"] for s in peak for b in s["blocks"]
               if b["state"] == "active_allocated") == est.peak_allocated_bytes
    assert sum(s["total_size"] for s in peak) == est.peak_reserved_bytes
    # Round trip: the export given back as the real snapshot of the same step.
    again = batchfit.estimate(_net(), (3, 32, 32), 64, optimizer="adamw", device="A100",
                              snapshot=snapshot, **options)
    comparison = again.snapshot_comparison
    assert comparison.differences == () and comparison.first_divergence is None
    assert comparison.real_allocations == comparison.predicted_allocations > 0


def test_torch_memory_viz_reads_the_export(tmp_path):
    import torch.cuda._memory_viz as viz

    est = batchfit.estimate(_net(), (3, 32, 32), 64, optimizer="adamw", device="A100")
    path = write_snapshot(est.predicted_snapshot(), tmp_path / "predicted.pickle")
    with path.open("rb") as f:
        snapshot = pickle.load(f)
    segments = snapshot["segments"]
    folded = viz.memory(snapshot, format_flamegraph=lambda text: text)
    # torch's flame-graph input: every block's bytes (and gaps) under its segment
    assert sum(int(line.rsplit(" ", 1)[1]) for line in folded.splitlines()) == sum(
        s["total_size"] for s in segments)
    summary = viz.segsum(snapshot)  # raises on a segment whose blocks do not add up
    assert f"segments: {len(segments)}" in summary
    assert "entries" in viz.trace(snapshot)
    assert "only_before" not in viz.compare(segments, segments,
                                            format_flamegraph=lambda text: text)
    assert "snapshot.pickle" in viz.trace_plot(snapshot)
    assert "snapshot.pickle" in viz.segment_plot(snapshot)


def test_write_snapshot_to_a_missing_folder(tmp_path):
    with pytest.raises(InvalidInputError, match="cannot write"):
        write_snapshot({}, tmp_path / "no" / "such" / "x.pickle")



def test_hand_built_step_segments_at_the_peak():
    # At the step's allocated peak (after B) the segment holds the parameter (4 MiB), A
    # (3 MiB) and B in the whole 13 MiB block: 12 MiB requested, 1 MiB kept attached.
    snapshot = predicted_snapshot(_step(), GPU)
    peak = snapshot["batchfit"]
    assert peak["peak_trace_index"] == 1  # the second action of the window: B's alloc
    (segment,) = peak["peak_segments"]
    base = segment["address"]
    assert [(b["address"] - base, b["size"], b["state"], b["requested_size"])
            for b in segment["blocks"]] == [(0, 4 * MiB, "active_allocated", 4 * MiB),
                                            (4 * MiB, 3 * MiB, "active_allocated", 3 * MiB),
                                            (7 * MiB, 13 * MiB, "active_allocated", 12 * MiB)]
    assert [b["frames"][0]["name"] for b in segment["blocks"]] == [
        "parameter", "aten.mm", "aten.addmm"]
