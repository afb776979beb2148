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
