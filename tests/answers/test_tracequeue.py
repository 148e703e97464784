"""The trace queue: searches that each wait on their own traces, driven at once, each trace
taken by the first free worker; every request traced once; the same results when this
process traces them itself (no workers, or a worker that fails)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from batchfit.answers import tracepool

#: Run in a fresh interpreter: the workers must be forked before any backward pass. Each
#: trace runs a backward pass (as a real one does) and logs when it starts and ends.
_QUEUE = """
import json, os, sys, time
import torch
from batchfit.answers import tracepool

log, mode = sys.argv[1], sys.argv[2]
tracepool._can_fork = lambda: True
tracepool._idle_cores = lambda window_s=0.05: 2.0
parent = os.getpid()


def trace(request):
    if mode == "fail" and os.getpid() != parent:
        raise RuntimeError("worker trouble")
    x = torch.ones(2, requires_grad=True)
    (x * request).sum().backward()
    with open(log, "a") as out:
        out.write(f"start {request} {time.time()} {os.getpid()}\\n")
    time.sleep(3.0 if request == 100 else 0.1)
    with open(log, "a") as out:
        out.write(f"end {request} {time.time()} {os.getpid()}\\n")
    return [request * 10, os.getpid()]


def long_one():
    got = yield [100]
    return got[100]


def chain():
    first = yield [1, 2]
    second = yield [3]
    third = yield [2, 4]  # 2 again, and 4, which the next task asks too
    return [first[1], first[2], second[3], third[2], third[4]]


def shared():
    got = yield [4]
    return got[4]


with tracepool.TraceQueue(trace) as queue:
    parallel = queue.start()
    ends = queue.run([long_one(), chain(), shared()], rank=lambda request: -request)
    workers = len(queue._workers)
print(json.dumps({"me": parent, "parallel": parallel, "ends": ends, "workers": workers}))
"""


def _run_queue(tmp_path: Path, mode: str) -> tuple[dict, list[tuple[str, int, float, int]]]:
    log = tmp_path / f"{mode}.log"
    done = subprocess.run([sys.executable, "-c", _QUEUE, str(log), mode], capture_output=True,
                          text=True, check=True, timeout=300)
    out = json.loads(done.stdout.strip().splitlines()[-1])
    lines = [line.split() for line in log.read_text().splitlines()]
    return out, [(kind, int(request), float(when), int(pid)) for kind, request, when, pid in lines]


@pytest.mark.skipif(not hasattr(os, "fork") or (os.cpu_count() or 1) < 2,
                    reason="workers need fork and a second core")
def test_two_workers_take_the_next_trace_as_each_comes_free(tmp_path):
    out, log = _run_queue(tmp_path, "ok")
    me = out["me"]
    assert out["parallel"] and out["workers"] == 2
    long_one, chain, shared = out["ends"]
    assert long_one[0] == 1000 and chain[0][0] == 10 and chain[2][0] == 30
    assert chain[4] == shared  # one trace of 4 answers both tasks
    starts = [(request, pid) for kind, request, _, pid in log if kind == "start"]
    # each request traced once, all in the two workers, none here
    assert sorted(request for request, _ in starts) == [1, 2, 3, 4, 100]
    pids = {pid for _, pid in starts}
    assert len(pids) == 2 and me not in pids
    # the highest-ranked first (rank: -request), then each as a worker comes free: the
    # long trace holds one worker while the other runs 4, 2, 1 and then the chain's 3,
    # which it asks only once 1 and 2 are back, all before the long trace ends
    long_pid = next(pid for request, pid in starts if request == 100)
    assert [request for request, pid in starts if pid != long_pid] == [4, 2, 1, 3]
    end_of_long = next(when for kind, request, when, _ in log if (kind, request) == ("end", 100))
    start_of_3 = next(when for kind, request, when, _ in log if (kind, request) == ("start", 3))
    assert start_of_3 < end_of_long


@pytest.mark.skipif(not hasattr(os, "fork"), reason="workers need fork")
def test_a_worker_that_fails_leaves_its_request_to_this_process(tmp_path):
    out, log = _run_queue(tmp_path, "fail")
    me = out["me"]
    assert out["parallel"] and out["workers"] == 0  # both failed a request: both stopped
    long_one, chain, shared = out["ends"]
    assert long_one == [1000, me] and chain[2] == [30, me] and chain[4] == shared == [40, me]
    starts = [request for kind, request, _, _ in log if kind == "start"]
    assert sorted(starts) == [1, 2, 3, 4, 100]  # each traced once, here


def test_without_workers_this_process_traces_in_rank_then_task_order(monkeypatch):
    monkeypatch.setattr(tracepool, "_can_fork", lambda: False)
    traced: list[int] = []

    def trace(request: int) -> int:
        traced.append(request)
        return request * 10

    def first():
        got = yield [100]
        return got

    def second():
        got = yield [1, 2]
        more = yield [3]
        return got, more

    def third():
        return (yield [4])

    with tracepool.TraceQueue(trace) as queue:
        assert not queue.start()
        ends = queue.run([first(), second(), third()])
    # no rank: the tasks in order; a task's later request comes before a later task's
    assert traced == [100, 1, 2, 3, 4]
    assert ends == [{100: 1000}, ({1: 10, 2: 20}, {3: 30}), {4: 40}]
    traced.clear()
    with tracepool.TraceQueue(trace, allowed=False) as queue:
        assert not queue.start()
        assert queue.run([third(), first()], rank=lambda r: -r) == [{4: 40}, {100: 1000}]
    assert traced == [100, 4]  # the rank before the task


def test_a_request_already_traced_is_answered_at_once():
    traced: list[int] = []

    def twice():
        one = yield [7]
        again = yield [7]
        return one, again

    with tracepool.TraceQueue(lambda r: traced.append(r) or r, allowed=False) as queue:
        assert queue.run([twice()]) == [({7: 7}, {7: 7})]
    assert traced == [7]
