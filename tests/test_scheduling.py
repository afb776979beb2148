"""tests/scheduling.py: the tests using `contract` are one group per architecture, the costliest groups start
first, and the seconds each group took are kept for the next run."""

from pathlib import Path
from types import SimpleNamespace

import scheduling


def _item(nodeid: str, contract: str | None = None, slow: bool = False):
    params = {"contract": contract} if contract else {}
    return SimpleNamespace(
        nodeid=nodeid,
        path=Path(nodeid.split("::")[0]),
        callspec=SimpleNamespace(params=params),
        get_closest_marker=lambda name: slow if name == "slow" else None,
    )


class _Cache(dict):
    def get(self, key, default):
        return super().get(key, default)

    def set(self, key, value):
        self[key] = value


def test_the_tests_using_contract_are_grouped_by_architecture_across_files():
    a = _item("tests/test_contract.py::test_forward_shape[wan]", contract="wan")
    b = _item("tests/test_contract_paths.py::test_lora_merge_and_extract[wan]", contract="wan")
    c = _item("tests/test_contract.py::test_forward_shape[flux]", contract="flux")
    d = _item("tests/test_contract.py::test_golden_losses_are_pinned_for_every_architecture")
    e = _item("tests/test_sdxl.py::test_x")
    f = _item("tests/test_checkpoint_layouts.py::test_full_fine_tune[flux]", contract="flux")
    assert [scheduling.group_of(i) for i in (a, b, c, d, e, f)] == [
        "contract-wan", "contract-wan", "contract-flux", "tests/test_contract.py", "tests/test_sdxl.py",
        "contract-flux",
    ]  # fmt: skip


def test_costliest_groups_first_and_about_equal_ones_keep_their_order():
    items = [_item(f"tests/test_{name}.py::t{i}") for name in "abcde" for i in range(2)]
    cache = _Cache({scheduling.CACHE_KEY: {"tests/test_b.py": 3.0, "tests/test_d.py": 300.0,
                                           "tests/test_e.py": 2.5}})  # fmt: skip
    scheduling.order(SimpleNamespace(cache=cache), items)
    files = list(dict.fromkeys(i.nodeid.split("::")[0][len("tests/test_") :] for i in items))
    # d (300 s), then b and e (2 to 4 s: one class, kept in collection order), then a and c (unmeasured)
    assert files == ["d.py", "b.py", "e.py", "a.py", "c.py"]
    assert [i.nodeid for i in items[:2]] == ["tests/test_d.py::t0", "tests/test_d.py::t1"]


def test_without_a_measurement_slow_tests_go_first():
    items = [_item("tests/test_a.py::t"), _item("tests/test_b.py::t", slow=True)]
    scheduling.order(SimpleNamespace(), items)  # no cache provider: -p no:cacheprovider
    assert [i.nodeid for i in items] == ["tests/test_b.py::t", "tests/test_a.py::t"]


def test_group_seconds_are_summed_and_merged_into_the_last_runs():
    seconds = scheduling.GroupSeconds()
    for group, duration in [("tests/test_a.py", 1.0), ("tests/test_a.py", 0.5), ("contract-wan", 2.0)]:
        seconds.add(SimpleNamespace(user_properties=[("xdist_group", group)], duration=duration))
    cache = _Cache({scheduling.CACHE_KEY: {"tests/test_z.py": 9.0, "tests/test_a.py": 7.0}})
    seconds.save(SimpleNamespace(cache=cache))
    assert cache[scheduling.CACHE_KEY] == {
        "tests/test_z.py": 9.0,
        "tests/test_a.py": 1.5,
        "contract-wan": 2.0,
    }


def test_every_test_of_this_run_has_its_group(request):
    marks = [m.args[0] for m in request.node.iter_markers("xdist_group")]
    assert marks == ["tests/test_scheduling.py"]
    assert ("xdist_group", "tests/test_scheduling.py") in request.node.user_properties
