import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Pinned golden losses must not depend on the machine's vector width: MKL and oneDNN pick AVX-512 matmul
# kernels where the CPU has them, and their sums round differently from the AVX2 ones (krea2's second-step
# loss moved 1.6e-4 on an AVX-512 machine). Every test process, and every process a test starts, uses the
# AVX2 kernels that all x86-64 CI machines have. ATen's own kernels keep the machine's width: forced to
# AVX2 they made inductor's CPU code for fp8 weights return NaN (tests/test_compile.py).
for _name in ("MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA"):
    os.environ.setdefault(_name, "AVX2")

import torch  # noqa: E402

# One thread: tiny models run faster without threading overhead, and pinned golden losses do not
# depend on how many cores the machine has (reductions split differently across threads).
torch.set_num_threads(1)

import pytest  # noqa: E402

import isolation  # noqa: E402
import scheduling  # noqa: E402

isolation.mark_environment()
_group_seconds = scheduling.GroupSeconds()


def pytest_itemcollected(item):
    # before xdist's own collection hook reads the groups (tests/scheduling.py)
    scheduling.mark(item)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    # after pytest-randomly's shuffle and pytest's grouping by fixture: costliest groups first
    scheduling.order(config, items)


def pytest_runtest_logreport(report):
    _group_seconds.add(report)


def pytest_sessionfinish(session):
    if not hasattr(session.config, "workerinput"):  # the main process, which sees every report
        _group_seconds.save(session.config)


@pytest.fixture(autouse=True)
def _leaves_nothing_behind(request):
    """Fail a test that leaves a child process running or a progress bar open (tests/isolation.py):
    what one test leaves behind changes what the next one sees. Cheap: it runs around every test."""
    children = isolation.children().keys()
    bars = isolation.open_bars()
    yield
    isolation.close_worker_pools()
    left = [p for pid, p in isolation.children().items() if pid not in children]
    open_bars = isolation.open_bars() - bars
    if left:
        described = [isolation.describe(p) for p in left]
        isolation.end(left)
        pytest.fail(f"{request.node.nodeid} left processes running (killed now): {described}")
    if open_bars:
        described = [str(bar) for bar in open_bars]
        for bar in open_bars:
            bar.close()
        pytest.fail(f"{request.node.nodeid} left progress bars open (closed now): {described}")


@pytest.fixture(scope="module", autouse=True)
def _file_leaves_nothing_behind(request):
    """Fail a test file that leaves a diffusers class patched or an orphaned process of this session
    running (tests/isolation.py): the checks that read every class and process, once per file."""
    processes = isolation.running().keys()
    classes = isolation.diffusers_classes()
    yield
    left = [p for pid, p in isolation.running().items() if pid not in processes]
    patched = isolation.patched_classes(classes)
    if left:
        described = [isolation.describe(p) for p in left]
        isolation.end(left)
        pytest.fail(f"{request.node.nodeid} left processes running (killed now): {described}")
    if patched:
        pytest.fail(f"{request.node.nodeid} left diffusers classes patched: {patched}")


@pytest.fixture(scope="session")
def wan_model(tmp_path_factory):
    """The tiny Wan fixture in both layouts, written once per test session."""
    from tuner.fixtures import write_fixture

    root = tmp_path_factory.mktemp("wan_model")
    write_fixture("wan", root)
    return root


def _registered():
    from tuner.registry import ARCHITECTURES

    return list(ARCHITECTURES)


@pytest.fixture(scope="session", params=_registered())
def contract(request, tmp_path_factory):
    """(architecture, config, fixture paths) for every registered architecture: its tiny fixture, the
    demo dataset, and latents and text cached through the CLI. Shared by the contract suite's files."""
    from project import make_project
    from tuner.cli import main
    from tuner.fixtures import write_fixture

    arch = request.param
    root = tmp_path_factory.mktemp(f"contract_{arch}")
    paths = write_fixture(arch, root / "model")
    config = make_project(root / "project", root / "model", architecture=arch)
    assert main(["cache", "latents", "--config", str(config)]) == 0
    assert main(["cache", "text", "--config", str(config)]) == 0
    return arch, config, paths
