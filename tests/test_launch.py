"""tests/launch.py: each rank gets torchrun's environment, the outputs come back in rank order, and a rank
that fails ends the others instead of leaving them waiting."""

import time

import pytest

from launch import GRACE, launch

SAYS = "import os; print(*(os.environ[k] for k in {keys}), sep=',')"


def test_each_rank_gets_its_place_and_one_rendezvous():
    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    result = launch(["-c", SAYS.format(keys=keys)], processes=3, timeout=60)
    assert result.returncode == 0, result.stderr
    lines = [line.split(",") for line in result.stdout.splitlines()]
    assert [line[:4] for line in lines] == [[str(r), str(r), "3", "3"] for r in range(3)]  # in rank order
    assert len({tuple(line[4:]) for line in lines}) == 1 and lines[0][4] == "127.0.0.1"


def test_a_failing_rank_ends_the_others_and_its_status_is_returned():
    # rank 1 fails at once; rank 0 would wait a minute for it (as on a collective that cannot complete)
    code = "import os, sys, time; r = os.environ['RANK']; print('rank', r, file=sys.stderr); " \
           "sys.exit(3) if r == '1' else time.sleep(60)"  # fmt: skip
    start = time.monotonic()
    result = launch(["-c", code], timeout=120)
    assert result.returncode == 3 and time.monotonic() - start < GRACE + 10
    assert result.stderr.splitlines() == ["rank 0", "rank 1"]


def test_ranks_still_running_at_the_timeout_are_ended_and_named():
    with pytest.raises(TimeoutError, match="ranks still running"):
        launch(["-c", "import time; time.sleep(60)"], timeout=1)
