"""How `make test` spreads the suite over its processes (pytest-xdist, `--dist loadgroup`), used by
conftest.py: which tests go to one process together, and which groups start first.

* **groups**: a test file is one group (its module fixtures are built once, its per-file leak check runs
  once), except the tests that use the session fixture `contract` (conftest.py: an architecture's tiny
  model written and its cache filled; the contract suite, test_checkpoint_layouts.py, ...): each
  architecture is a group of all of them, so one process builds its `contract` once (each file built
  every architecture's in each process that ran it), and groups of seconds each replace files of
  minutes each.
* **order**: with two processes, the run ends when the last group does, so the costliest groups start
  first: a group's cost is its seconds in the last run on this checkout (kept in pytest's cache under
  `tuner/group_seconds`), or, before there is one, a guess from its tests' `slow` marks. Costs are
  compared within a factor of two only, so groups of about the same cost keep pytest-randomly's order:
  the order still changes from run to run.
"""

from __future__ import annotations

import math
from collections import defaultdict

import pytest

CACHE_KEY = "tuner/group_seconds"
GROUP = "xdist_group"


def mark(item: pytest.Item) -> None:
    """Put the test in its group: the mark xdist's loadgroup reads, and a property its reports carry."""
    group = group_of(item)
    item.add_marker(pytest.mark.xdist_group(group))
    item.user_properties.append((GROUP, group))


def group_of(item: pytest.Item) -> str:
    params = getattr(getattr(item, "callspec", None), "params", {})
    if "contract" in params:
        return f"contract-{params['contract']}"
    return item.nodeid.split("::")[0]


def _guess(items: list[pytest.Item]) -> float:
    """Seconds a group without a measurement may take: half a minute for a slow test (most start
    processes: a two-process training run costs about that), a tenth for the others."""
    return sum(30.0 if item.get_closest_marker("slow") else 0.1 for item in items)


def order(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Put the costliest groups first, in place, keeping the order within each group."""
    measured = _cache(config).get(CACHE_KEY, {}) if _cache(config) else {}
    groups: dict[str, list[pytest.Item]] = defaultdict(list)
    for item in items:
        groups[group_of(item)].append(item)

    def cost_class(group: str) -> int:
        seconds = measured.get(group, _guess(groups[group]))
        return -int(math.log2(1.0 + seconds))

    items[:] = [item for group in sorted(groups, key=cost_class) for item in groups[group]]


class GroupSeconds:
    """Sums each group's seconds (setup, call and teardown) from the reports the main process sees, and
    saves them in pytest's cache at the end, for the next run's order."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    def add(self, report: pytest.TestReport) -> None:
        group = dict(report.user_properties).get(GROUP)  # set by `mark`; xdist sends it with the report
        if group:
            self.seconds[group] += report.duration

    def save(self, config: pytest.Config) -> None:
        cache = _cache(config)
        if cache is not None and self.seconds:
            measured = cache.get(CACHE_KEY, {})
            cache.set(CACHE_KEY, {**measured, **{k: round(v, 2) for k, v in self.seconds.items()}})


def _cache(config: pytest.Config):
    return getattr(config, "cache", None)  # None under `-p no:cacheprovider`
