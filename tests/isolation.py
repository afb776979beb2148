"""What a test may not leave behind, checked by conftest.py: a child process still running or a progress
bar open (around every test: the cheap checks), an orphaned process or a diffusers class patched (around
every test file: these read every process and every class, a few hundredths of a second each).

Every test must pass alone and in any order (`make test` shuffles them with pytest-randomly). Leaks of
both kinds made tests pass or fail by what ran before them:

* **processes**: a subprocess or a DataLoader worker that outlives its test keeps using the CPU and,
  once the session ends, keeps printing into the terminal. The test process's descendants count, and
  so do orphans (the children of a SIGKILLed worker are re-parented away from us): every process
  started under pytest inherits `ENV_MARK` in its environment. The cache readers' worker pool is per
  process by design (`tuner.cache.reads`); it is closed after each test, so no test inherits another's
  workers.
* **progress bars**: tqdm keeps every open bar in a class-level set (a new bar takes the first free
  line) and draws one that is still open when the interpreter exits: a training ended by an error
  printed `steps: 50%| 2/4` after pytest's summary, long after its test, as if a process lived on.
* **diffusers classes**: a patch on a class (a processor's or a model's method, a class attribute)
  reaches every model of that class in the process, a pipeline a user builds beside a tuner model
  included; tuner patches instances. A class whose namespace the test changed, or that holds a
  function defined in tuner or the tests, fails the test.
"""

from __future__ import annotations

import os
import sys
import time

import psutil

ENV_MARK = "TUNER_TEST_SESSION"
SESSION_START = time.time()
# top-level modules whose functions no diffusers class may hold: tuner and the tests' own
_FOREIGN = ("tuner", "test_", "conftest", "project", "isolation")
_MISSING = object()
_CACHES = {"__slotnames__"}  # what Python itself stores on a class (copyreg, on the first deepcopy)


def mark_environment() -> None:
    """Tag this process's environment, so that everything it starts can be found again. Each pytest-xdist
    worker marks its own (it inherits the controller's mark): a test must never take the processes of a
    test running in another worker for its own."""
    os.environ[ENV_MARK] = str(os.getpid())


def children() -> dict[int, psutil.Process]:
    """Live descendants of this process (the cheap check, around every test)."""
    return _alive({p.pid: p for p in psutil.Process().children(recursive=True)})


def running() -> dict[int, psutil.Process]:
    """Live processes this process started: its descendants, and any process since the session's start
    carrying this session's `ENV_MARK` (also one whose parent died)."""
    me = psutil.Process()
    mark = os.environ.get(ENV_MARK)
    found = {p.pid: p for p in me.children(recursive=True)}
    for p in psutil.process_iter(["create_time"]):
        if p.pid == me.pid or p.pid in found or (p.info["create_time"] or 0) < SESSION_START - 1:
            continue
        try:
            if p.environ().get(ENV_MARK) == mark:
                found[p.pid] = p
        except (psutil.Error, OSError):
            continue
    return _alive(found)


def _alive(found: dict[int, psutil.Process]) -> dict[int, psutil.Process]:
    alive = {}
    for pid, p in found.items():
        try:
            if p.status() != psutil.STATUS_ZOMBIE and not _python_helper(p.cmdline()):
                alive[pid] = p
        except psutil.Error:
            continue
    return alive


# Python's own helper processes, started on first use and kept for the interpreter's life by design: the
# multiprocessing resource tracker (one per process, after a first spawned worker or semaphore) and the
# forkserver. Not a test's leftover.
_PYTHON_HELPERS = (
    "from multiprocessing.resource_tracker import main",
    "from multiprocessing.forkserver import main",
)


def _python_helper(cmdline: list[str]) -> bool:
    return any(helper in arg for arg in cmdline for helper in _PYTHON_HELPERS)


def describe(p: psutil.Process) -> str:
    try:
        return f"pid {p.pid}: {' '.join(p.cmdline())[:300]}"
    except psutil.Error:
        return f"pid {p.pid}"


def end(processes: list[psutil.Process]) -> None:
    """Kill what a test left running (our own children are reaped by the wait)."""
    for p in processes:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(processes, timeout=10)


def close_worker_pools() -> None:
    reads = sys.modules.get("tuner.cache.reads")
    if reads is not None:
        reads.close_workers()


def open_bars() -> set:
    """tqdm's progress bars that are open and drawn (a disabled bar draws nothing)."""
    std = sys.modules.get("tqdm.std")
    return {bar for bar in getattr(std.tqdm, "_instances", ()) if not bar.disable} if std else set()


def diffusers_classes() -> dict[type, dict]:
    """Every class defined in an imported diffusers module, with a copy of its namespace."""
    classes = {}
    for name, module in list(sys.modules.items()):
        if not name.startswith("diffusers") or module is None:
            continue
        for obj in list(vars(module).values()):
            if isinstance(obj, type) and obj.__module__ == name:
                classes[obj] = dict(vars(obj))
    return classes


def _foreign(value) -> str | None:
    """The module of a tuner or test function that `value` is or wraps, else None."""
    for fn in (value, getattr(value, "__func__", None), getattr(value, "fget", None)):
        module = getattr(fn, "__module__", None) or ""
        if callable(fn) and module.split(".")[0].startswith(_FOREIGN):
            return module
    return None


def patched_classes(before: dict[type, dict]) -> list[str]:
    """Diffusers classes whose namespace differs from `before`, or that hold a tuner or test function."""
    problems = []
    for cls, names in diffusers_classes().items():
        where = f"{cls.__module__}.{cls.__qualname__}"
        old = before.get(cls)
        if old is not None:
            keys = (old.keys() | names.keys()) - _CACHES
            changed = sorted(k for k in keys if old.get(k, _MISSING) is not names.get(k, _MISSING))
            if changed:
                problems.append(f"{where}: {', '.join(changed)} changed")
                continue
        foreign = sorted(f"{k} (from {m})" for k, v in names.items() if (m := _foreign(v)))
        if foreign:
            problems.append(f"{where}: holds {', '.join(foreign)}")
    return problems
