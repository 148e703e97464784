"""The diff of a real snapshot against the predicted one (``device/snapshot_diff.py``).

The "real" snapshot is built by hand in the format torch writes (Python frames, innermost
first); no CPU can record one. Each expected group and slack is derived in the comments.
"""

from __future__ import annotations

from torch import nn

import batchfit
from batchfit.device.snapshot_diff import AllocationGroup, diff_snapshots

MiB = 1 << 20
TORCH = "/usr/lib/python3/dist-packages/torch"
NET = "/home/me/net.py"


def torch_frames(torch_file: str, function: str, line: int) -> list[dict]:
    return [{"filename": f"{TORCH}/{torch_file}", "line": 400, "name": function},
            {"filename": NET, "line": line, "name": "forward"},
            {"filename": "/usr/lib/python3.11/runpy.py", "line": 88, "name": "_run_code"}]


def batchfit_frames(module: str, op: str) -> list[dict]:
    return [{"filename": module, "line": 0, "name": op},
            {"filename": "batchfit", "line": 0, "name": "forward: activations"}]


def alloc(addr: int, size: int, frames: list[dict]) -> dict:
    return {"action": "alloc", "addr": addr, "size": size, "frames": frames}


def free(addr: int, size: int) -> list[dict]:
    return [{"action": "free_requested", "addr": addr, "size": size},
            {"action": "free_completed", "addr": addr, "size": size}]


def seg(addr: int, size: int) -> dict:
    return {"action": "segment_alloc", "addr": addr, "size": size}


def segment(addr: int, *blocks: tuple[int, str]) -> dict:
    return {"device": 0, "address": addr, "total_size": sum(n for n, _ in blocks),
            "blocks": [{"size": n, "requested_size": n, "state": state} for n, state in blocks]}


#: Both: 8 MiB of parameters allocated before the window, in their own segment.
PARAMS = segment(64 * MiB, (8 * MiB, "active_allocated"))


def real_snapshot() -> dict:
    # running (allocated, reserved) in the window, from (0, 0):
    # small seg (0, 2), 1 KiB (1 KiB, 2), free (0, 2), seg (0, 22), conv 4 (4, 22),
    # workspace seg (4, 38), workspace 16 (20, 38) <- allocated peak, free (4, 38),
    # relu 2 (6, 38), fc seg (6, 50), fc 12 (18, 50), free (6, 50), free relu (4, 50).
    # Before the window: 8 MiB allocated, 8 MiB reserved (the parameters' segment).
    trace = [seg(96 * MiB, 2 * MiB), alloc(96 * MiB, 1024, torch_frames(
        "nn/functional.py", "relu", 11)), *free(96 * MiB, 1024),
        seg(0, 20 * MiB), alloc(0, 4 * MiB, torch_frames("nn/modules/conv.py", "_conv_forward", 12)),
        seg(48 * MiB, 16 * MiB),
        alloc(48 * MiB, 16 * MiB, torch_frames("nn/modules/conv.py", "_conv_forward", 12)),
        *free(48 * MiB, 16 * MiB),
        alloc(4 * MiB, 2 * MiB, torch_frames("nn/functional.py", "relu", 13)),
        seg(32 * MiB, 12 * MiB),
        alloc(32 * MiB, 12 * MiB, torch_frames("nn/modules/linear.py", "forward", 15)),
        *free(32 * MiB, 12 * MiB), *free(4 * MiB, 2 * MiB)]
    segments = [segment(96 * MiB, (2 * MiB, "inactive")),
                segment(0, (4 * MiB, "active_allocated"), (16 * MiB, "inactive")),
                segment(48 * MiB, (16 * MiB, "inactive")), segment(32 * MiB, (12 * MiB, "inactive")),
                PARAMS]
    return {"segments": segments, "device_traces": [trace]}


def predicted_snapshot() -> dict:
    # (0, 0): seg (0, 20), conv 4 (4, 20), relu 2 (6, 20), pool 3 (9, 20), free (6, 20),
    # fc seg (6, 32), fc 12 (18, 32) <- allocated peak, free (6, 32), free relu (4, 32);
    # 8 MiB allocated and reserved before the window.
    trace = [seg(0, 20 * MiB), alloc(0, 4 * MiB, batchfit_frames("conv1", "aten.convolution")),
             alloc(4 * MiB, 2 * MiB, batchfit_frames("act", "aten.relu")),
             alloc(6 * MiB, 3 * MiB, batchfit_frames("pool", "aten.max_pool2d_with_indices")),
             *free(6 * MiB, 3 * MiB), seg(32 * MiB, 12 * MiB),
             alloc(32 * MiB, 12 * MiB, batchfit_frames("fc", "aten.addmm")),
             *free(32 * MiB, 12 * MiB), *free(4 * MiB, 2 * MiB)]
    segments = [segment(0, (4 * MiB, "active_allocated"), (16 * MiB, "inactive")),
                segment(32 * MiB, (12 * MiB, "inactive")), PARAMS]
    return {"segments": segments, "device_traces": [trace]}


def test_allocations_on_one_side_are_grouped_by_module_and_op():
    diff = diff_snapshots(real_snapshot(), predicted_snapshot())
    # large sizes in order: real 4, 16, 2, 12; predicted 4, 2, 3, 12 (MiB). The 4, 2 and
    # 12 align; the real 16 MiB workspace is lacking, the predicted 3 MiB pool added; the
    # 1 KiB is under the default 1 MiB and left out.
    assert diff.matched_allocations == 3
    assert diff.lacking == (AllocationGroup("net.py:12 forward", "conv._conv_forward", 1,
                                            16 * MiB),)
    assert diff.adding == (AllocationGroup("pool", "aten.max_pool2d_with_indices", 1, 3 * MiB),)
    # real: allocated peaks at 8 + 20 = 28 MiB with 8 + 38 = 46 MiB reserved: slack 18 MiB;
    # predicted: 8 + 18 = 26 MiB with 8 + 32 = 40 MiB reserved: slack 14 MiB.
    assert diff.real_slack_bytes == 18 * MiB
    assert diff.predicted_slack_bytes == 14 * MiB
    assert diff.slack_difference_bytes == 4 * MiB
    assert not diff.is_empty
    data = diff.to_dict()
    assert data["lacking_bytes"] == 16 * MiB and data["adding_bytes"] == 3 * MiB
    assert data["lacking"] == [{"module": "net.py:12 forward", "op": "conv._conv_forward",
                                "count": 1, "total_bytes": 16 * MiB}]


def test_small_allocations_count_when_asked():
    diff = diff_snapshots(real_snapshot(), predicted_snapshot(), min_bytes=0)
    # the 1 KiB relu scalar rounds to 1 KiB (a multiple of 512 B) and has no partner
    assert AllocationGroup("net.py:11 forward", "functional.relu", 1, 1024) in diff.lacking
    assert diff.matched_allocations == 3


def test_a_snapshot_against_itself_differs_in_nothing():
    real = real_snapshot()
    diff = diff_snapshots(real, real)
    assert diff.is_empty and diff.matched_allocations == 4


def test_the_estimate_against_its_own_export_differs_in_nothing():
    def net() -> nn.Module:
        return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Flatten(),
                             nn.Linear(16 * 32 * 32, 10))

    est = batchfit.estimate(net(), (3, 32, 32), 64, optimizer="adamw", device="A100")
    again = batchfit.estimate(net(), (3, 32, 32), 64, optimizer="adamw", device="A100",
                              snapshot=est.predicted_snapshot())
    diff = again.snapshot_diff
    assert diff.is_empty and diff.matched_allocations > 0
    assert diff.predicted_slack_bytes == diff.real_slack_bytes
    assert again.to_dict()["snapshot_diff"]["slack_difference_bytes"] == 0
    assert est.snapshot_diff is None and "snapshot_diff" not in est.to_dict()
