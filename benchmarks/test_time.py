"""Where the test suite's time goes: the slowest 25 tests and the total per architecture, so the cost of
adding one is visible.

    python benchmarks/test_time.py [pytest arguments]      # default: -q -n 2 --dist loadgroup tests
    python benchmarks/test_time.py --report DIR            # print an earlier run's records again

It runs pytest with this file loaded as a plugin (`-p test_time`): around each test (setup, call and
teardown together) every process appends the test's wall seconds and CPU seconds (its own and its
finished children's) to `DIR/<worker>.jsonl`. CPU seconds are the number to compare on a shared
machine; wall seconds stretch with everything else that runs. A test belongs to an architecture when
one of its parameters names a registered architecture (the contract suite's `contract`, and the tests
parametrized over architecture names); the first test of an architecture in each process also pays for
its session fixture (its tiny model written and its cache filled), so the per-architecture totals are
what one more record costs.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RECORDS_DIR = "TUNER_TEST_TIME_DIR"
DEFAULT_ARGS = ["-q", "-n", "2", "--dist", "loadgroup", "tests"]


# ---- the plugin: one record per test, in the process that ran it ------------------------------------


def _cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _architecture(item) -> str | None:
    params = getattr(getattr(item, "callspec", None), "params", {})
    if not params:
        return None
    from tuner.registry import ARCHITECTURES

    named = [v for v in params.values() if isinstance(v, str) and v in ARCHITECTURES]
    return named[0] if named else None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    wall, cpu = time.perf_counter(), _cpu_seconds()
    yield
    record = {
        "test": item.nodeid.split("@")[0],  # xdist's loadgroup appends "@group"
        "architecture": _architecture(item),
        "wall": time.perf_counter() - wall,
        "cpu": _cpu_seconds() - cpu,
    }
    folder = os.environ.get(RECORDS_DIR)
    if folder:
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        with open(Path(folder) / f"{worker}.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")


# ---- the report ------------------------------------------------------------------------------------


def read_records(folder: Path) -> list[dict]:
    return [json.loads(line) for path in sorted(folder.glob("*.jsonl")) for line in path.open()]


def report(records: list[dict], slowest: int = 25) -> str:
    """The slowest tests by CPU seconds, then the totals per architecture and per file."""
    lines = [f"{len(records)} tests: {sum(r['cpu'] for r in records):.0f} CPU-s, "
             f"{sum(r['wall'] for r in records):.0f} s wall summed over processes"]  # fmt: skip
    lines += ["", f"slowest {slowest} tests   CPU-s   wall-s"]
    for r in sorted(records, key=lambda r: -r["cpu"])[:slowest]:
        lines.append(f"  {r['cpu']:7.1f} {r['wall']:8.1f}  {r['test']}")
    for title, key in (("architecture", lambda r: r["architecture"]), ("file", _file)):
        totals: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
        for r in records:
            total = totals[key(r) or "(none)"]
            total[0] += 1
            total[1] += r["cpu"]
            total[2] += r["wall"]
        lines += ["", f"per {title}   tests   CPU-s   wall-s"]
        for name, (count, cpu, wall) in sorted(totals.items(), key=lambda kv: -kv[1][1]):
            lines.append(f"  {cpu:7.1f} {wall:8.1f} {count:5d}  {name}")
    return "\n".join(lines)


def _file(record: dict) -> str:
    return re.sub(r"::.*", "", record["test"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--report", type=Path, help="print the records of an earlier run in this folder")
    parser.add_argument("--records", type=Path, help="keep this run's records in this folder")
    args, pytest_args = parser.parse_known_args(argv)
    if args.report:
        print(report(read_records(args.report)))
        return 0
    folder = args.records or Path(tempfile.mkdtemp(prefix="tuner-test-time-"))
    folder.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, RECORDS_DIR: str(folder)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), str(ROOT / "src"), env.get("PYTHONPATH")]))
    before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    code = subprocess.run([sys.executable, "-m", "pytest", "-p", "test_time", *(pytest_args or DEFAULT_ARGS)],
                          cwd=ROOT, env=env).returncode  # fmt: skip
    wall, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    print(f"\nsuite: {wall:.0f} s wall, {cpu:.0f} CPU-s (all processes), pytest exit code {code}")
    print(f"records: {folder} (--report {folder} prints this again)\n")
    print(report(read_records(folder)))
    return code


if __name__ == "__main__":
    sys.exit(main())
