"""Write tests/slow_tests.txt: the tests that put `make test-fast` over its budget.

Runs the fast selection (``pytest -m "not slow" --durations=0``), adds each test's setup,
call and teardown time, and appends to the list the slowest tests until the rest fit in
``--budget`` seconds (collection included). Run it when `make test-fast` has grown slow:

    .venv/bin/python tests/list_slow_tests.py --budget 150
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIST = ROOT / "tests" / "slow_tests.txt"
_DURATION = re.compile(r"^(\d+(?:\.\d+)?)s (setup|call|teardown)\s+(\S+)$")


def durations(output: str) -> dict[str, float]:
    """Seconds per test id from pytest's ``--durations=0`` report."""
    total: dict[str, float] = defaultdict(float)
    for line in output.splitlines():
        match = _DURATION.match(line.strip())
        if match:
            total[match.group(3)] += float(match.group(1))
    return dict(total)


def over_budget(seconds: dict[str, float], budget_s: float, fixed_s: float) -> list[str]:
    """The slowest tests, fewest first, whose removal brings the rest within the budget."""
    remaining = fixed_s + sum(seconds.values())
    chosen = []
    for test, took in sorted(seconds.items(), key=lambda item: -item[1]):
        if remaining <= budget_s:
            break
        chosen.append(test)
        remaining -= took
    return chosen


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=150.0, help="seconds for the fast run")
    args = parser.parse_args()
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "not slow",
                          "--durations=0", "--durations-min=0"], cwd=ROOT,
                         capture_output=True, text=True, check=False)
    wall = re.search(r"in (\d+(?:\.\d+)?)s", run.stdout.splitlines()[-1])
    seconds = durations(run.stdout)
    fixed = float(wall.group(1)) - sum(seconds.values()) if wall else 0.0
    listed = set(LIST.read_text().splitlines()) if LIST.exists() else set()
    new = [t for t in over_budget(seconds, args.budget, max(fixed, 0.0)) if t not in listed]
    with LIST.open("a") as out:
        out.writelines(f"{test}\n" for test in new)
    print(f"{len(new)} tests added to {LIST.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
