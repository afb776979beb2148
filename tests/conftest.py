import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

# One thread: tiny models run faster without threading overhead, and pinned golden losses do not
# depend on how many cores the machine has (reductions split differently across threads).
torch.set_num_threads(1)

import pytest  # noqa: E402


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
