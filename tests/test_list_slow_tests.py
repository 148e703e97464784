"""tests/list_slow_tests.py: reading pytest's durations and choosing what leaves the fast run."""

from __future__ import annotations

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "list_slow_tests", Path(__file__).with_name("list_slow_tests.py"))
lst = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lst)


def test_durations_add_setup_call_and_teardown():
    report = """
============================= slowest durations ==============================
2.50s call     tests/a.py::test_x
0.50s setup    tests/a.py::test_x
0.25s teardown tests/a.py::test_x
1.00s call     tests/b.py::test_y[1-True]
"""
    assert lst.durations(report) == {"tests/a.py::test_x": 3.25,
                                     "tests/b.py::test_y[1-True]": 1.0}


def test_the_slowest_leave_until_the_rest_fits():
    seconds = {"a": 10.0, "b": 5.0, "c": 1.0, "d": 1.0}
    # 20 s fixed + 17 s of tests; a budget of 30 s needs a (10 s) out: 27 s remain
    assert lst.over_budget(seconds, 30.0, 20.0) == ["a"]
    # 25 s needs a and b out: 22 s
    assert lst.over_budget(seconds, 25.0, 20.0) == ["a", "b"]
    assert lst.over_budget(seconds, 100.0, 20.0) == []
