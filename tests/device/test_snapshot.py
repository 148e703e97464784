"""Reading a CUDA memory snapshot and setting a traced step against it.

The snapshots here are built by hand in the documented format (the ``Snapshot``
TypedDict of ``torch.cuda.memory._snapshot``); every expected number is counted from
the entries written in the test.
"""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from batchfit.device.snapshot import compare, load_snapshot, read_allocations
from batchfit.errors import InvalidInputError

MIB = 1 << 20
TIMM = "/venv/lib/python3.12/site-packages/timm/models/convnext.py"
TORCH = "/venv/lib/python3.12/site-packages/torch/nn/modules/linear.py"
STDLIB = "/usr/lib/python3.12/contextlib.py"


def segment(total: int, *blocks: tuple[int, str], device: int = 0) -> dict:
    return {"device": device, "total_size": total, "blocks": [
        {"size": size, "requested_size": 0 if state == "inactive" else size,
         "state": state} for size, state in blocks]}


def alloc(addr: int, size: int, frames: list | None = None) -> dict:
    return {"action": "alloc", "addr": addr, "size": size, "frames": frames or []}


def free(addr: int, size: int) -> dict:
    return {"action": "free_completed", "addr": addr, "size": size, "frames": []}


def test_peaks_count_what_was_alive_before_the_window_and_frees_of_older_tensors():
    # Before the window: weights (30 MiB) and last step's output (10 MiB) live, in
    # segments of 30 and 10 MiB. In it: the old output is freed, 50 MiB and 20 MiB are
    # allocated, each in a new segment, and the 50 MiB is freed.
    snapshot = {"segments": [
        segment(30 * MIB, (30 * MIB, "active_allocated")),
        segment(10 * MIB, (10 * MIB, "inactive")),
        segment(50 * MIB, (50 * MIB, "inactive")),
        segment(20 * MIB, (20 * MIB, "active_allocated"))],
        "device_traces": [[
            free(0xA, 10 * MIB),
            {"action": "segment_alloc", "addr": 0xB, "size": 50 * MIB},
            alloc(0xB, 50 * MIB),
            {"action": "segment_alloc", "addr": 0xC, "size": 20 * MIB},
            alloc(0xC, 20 * MIB),
            free(0xB, 50 * MIB)]]}
    real = read_allocations(snapshot)
    assert real.sizes == (50 * MIB, 20 * MIB)
    # allocated: 40 at the start, 30 after the free, 80, 100 (peak), 50 at the end
    assert real.peak_allocated_bytes == 100 * MIB
    # reserved: 40 at the start, 90, 110 (peak; nothing is released)
    assert real.peak_reserved_bytes == 110 * MIB
    assert real.oom_count == 0


def test_a_block_still_awaiting_its_free_counts_as_allocated_at_the_end():
    # freed on another stream: free_requested, but free_completed comes after the window
    snapshot = {"segments": [segment(8 * MIB, (8 * MIB, "active_awaiting_free"))],
                "device_traces": [[{"action": "segment_alloc", "addr": 1, "size": 8 * MIB},
                                   alloc(1, 8 * MIB),
                                   {"action": "free_requested", "addr": 1, "size": 8 * MIB}]]}
    real = read_allocations(snapshot)
    assert (real.peak_allocated_bytes, real.peak_reserved_bytes) == (8 * MIB, 8 * MIB)


def test_the_label_is_the_first_frame_outside_torch_and_the_standard_library():
    frames = [{"filename": TORCH, "line": 125, "name": "forward"},
              {"filename": STDLIB, "line": 80, "name": "inner"},
              {"filename": TIMM, "line": 212, "name": "forward"}]
    snapshot = {"segments": [segment(2 * MIB, (2 * MIB, "active_allocated"))],
                "device_traces": [[{"action": "segment_alloc", "addr": 1, "size": 2 * MIB},
                                   alloc(1, 2 * MIB, frames), {"action": "oom", "size": 1}]]}
    real = read_allocations(snapshot)
    assert real.labels == ("convnext.py:212 forward",)
    assert real.oom_count == 1


def make_real(sizes: list[int], labels: list[str] | None = None):
    from batchfit.device.snapshot import RealAllocations

    return RealAllocations(tuple(sizes), tuple(labels or [""] * len(sizes)), 0, 0, 0)


def test_sizes_whose_counts_differ_come_largest_difference_first():
    real = make_real([64 * MIB, 64 * MIB, 48 * MIB, 8 * MIB, 3 * MIB, 1000],
                     ["a", "b", "c", "d", "e", "f"])
    # batchfit: the two 64 MiB, 8 MiB twice, no 48 MiB, 3 MiB as 3 MiB - 100 B (rounds to
    # the same 512 B block), and a 2 MiB the GPU never made; 1000 B is below min_bytes
    predicted = [64 * MIB, 8 * MIB, 64 * MIB, 8 * MIB, 3 * MIB - 100, 2 * MIB]
    labels = ["fc1", "x", "fc2", "y", "z", "ghost"]
    cmp = compare(real, predicted, labels, 1, 1)
    rows = [(d.size_bytes, d.real_count, d.predicted_count, d.difference_bytes)
            for d in cmp.differences]
    assert rows == [(48 * MIB, 1, 0, 48 * MIB), (8 * MIB, 1, 2, -8 * MIB),
                    (2 * MIB, 0, 1, -2 * MIB)]
    assert cmp.differences[0].real_label == "c" and cmp.differences[0].predicted_label == ""
    assert cmp.differences[2].predicted_label == "ghost"
    assert (cmp.real_allocations, cmp.predicted_allocations) == (5, 6)
    # order: 64 = 64, then 64 (real) vs 8 (batchfit)
    assert cmp.first_divergence == 1
    assert cmp.real_at_divergence == (64 * MIB, "b")
    assert cmp.predicted_at_divergence == (8 * MIB, "x")


def test_the_same_allocations_have_no_difference_and_a_longer_sequence_diverges_at_its_end():
    real = make_real([4 * MIB, 2 * MIB])
    same = compare(real, [4 * MIB, 2 * MIB], ["p", "q"], 1, 1)
    assert same.differences == () and same.first_divergence is None
    longer = compare(real, [4 * MIB, 2 * MIB, 6 * MIB], ["p", "q", "r"], 1, 1)
    assert longer.first_divergence == 2
    assert longer.real_at_divergence is None and longer.predicted_at_divergence == (6 * MIB, "r")


def test_bad_snapshots_get_one_line_saying_how_to_record_one(tmp_path):
    with pytest.raises(InvalidInputError, match="cannot read the snapshot"):
        load_snapshot(tmp_path / "missing.pickle")
    text = tmp_path / "text.pickle"
    text.write_text("not a pickle")
    with pytest.raises(InvalidInputError, match="_record_memory_history"):
        load_snapshot(text)
    other = tmp_path / "other.pickle"
    other.write_bytes(pickle.dumps({"a": 1}))
    with pytest.raises(InvalidInputError, match="not a CUDA memory snapshot"):
        load_snapshot(other)
    with pytest.raises(InvalidInputError, match="no recorded allocator actions"):
        read_allocations({"segments": [], "device_traces": [[], []]})
    two = {"segments": [], "device_traces": [[alloc(1, MIB)], [alloc(2, MIB)]]}
    with pytest.raises(InvalidInputError, match=r"devices \[0, 1\]"):
        read_allocations(two)
    assert read_allocations(two, device=1).sizes == (MIB,)


SCRIPT = Path(__file__).parents[2] / "benchmarks" / "gpu_snapshot.py"
ROW = "memory:120:caformer_b36:RTX 4090:2.4.0:nchw"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU path")
def test_the_gpu_script_says_it_needs_a_gpu_in_one_line():
    result = subprocess.run([sys.executable, str(SCRIPT), "--row", ROW], capture_output=True, check=False,
                            text=True, cwd=SCRIPT.parent, timeout=300)
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "no CUDA GPU" in result.stderr


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_gpu_script_records_a_step_and_compares_it(tmp_path):
    # a small model at a small batch: the recorded step's allocations exist and the
    # comparison names as many large allocations on both sides as the step makes
    result = subprocess.run([sys.executable, str(SCRIPT), "--row", ROW, "--batch", "2",
                             "--out", str(tmp_path)], capture_output=True, text=True, check=False,
                            cwd=SCRIPT.parent, timeout=1200)
    assert result.returncode == 0, result.stderr
    data = json.loads(next(tmp_path.glob("*.json")).read_text())
    cmp = data["snapshot_comparison"]
    assert cmp["real_allocations"] > 0 and cmp["predicted_allocations"] > 0
    assert cmp["oom_count"] == 0


# --- the allocator options the recorded process ran with ------------------------------
# torch/csrc/cuda/Module.cpp writes them as "allocator_settings": expandable_segments (a
# bool), max_split_size (size_t through int64_t: unset SIZE_MAX reads -1),
# roundup_power2_divisions (one entry per power-of-two size interval).

def _settings(**settings) -> dict:
    return {"segments": [], "device_traces": [[]], "allocator_settings": settings}


def test_the_snapshots_allocator_options_are_read():
    from batchfit.device.allocator import AllocatorConfig
    from batchfit.device.snapshot import allocator_config_of

    intervals = {str(1 << i): 4 for i in range(8)}
    assert allocator_config_of({"segments": [], "device_traces": []}) is None  # older torch
    assert allocator_config_of(_settings(expandable_segments=False, max_split_size=-1,
                                         roundup_power2_divisions={"1": 0})) == AllocatorConfig()
    assert allocator_config_of(_settings(
        expandable_segments=True, max_split_size=128 * MIB, roundup_power2_divisions=intervals)
    ) == AllocatorConfig(max_split_size_bytes=128 * MIB, roundup_power2_divisions=4,
                         expandable_segments=True)
    with pytest.raises(InvalidInputError, match="per-size"):
        allocator_config_of(_settings(roundup_power2_divisions={"1": 1, "2": 8}))


def test_an_estimate_against_a_snapshot_replays_with_its_allocator_options():
    # The snapshot ran with expandable segments; left to itself the estimate takes them,
    # an explicit option wins. Linear 1024 -> 3072 at batch 1024: weight 12 MiB, input
    # 4 MiB, output 12 MiB, after the T4's 16.25 MiB cuBLAS workspaces. Default: segments
    # of 18 (16.25 rounded to 2 MiB), 12 and 20 (the input, below 10 MiB; the output is
    # split from its free 16 MiB) = 50 MiB. Expandable, 20 MiB pages filled in address
    # order: 16.25 + 12 + 4 + 12 = 44.25 MiB in 3 pages = 60 MiB.
    import batchfit

    snapshot = _settings(expandable_segments=True, max_split_size=-1)
    snapshot["device_traces"] = [[alloc(0, 12 * MIB), free(0, 12 * MIB)]]

    def model():
        return torch.nn.Linear(1024, 3 * 1024, bias=False)

    taken = batchfit.estimate(model, (1024,), 1024, mode="infer", device="T4",
                              snapshot=snapshot)
    given = batchfit.estimate(model, (1024,), 1024, mode="infer", device="T4",
                              snapshot=snapshot, alloc_conf="")
    assert taken.device.allocator.expandable_segments
    assert not given.device.allocator.expandable_segments
    assert (given.peak_reserved_bytes, taken.peak_reserved_bytes) == (50 * MIB, 60 * MIB)
