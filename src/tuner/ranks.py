"""Starting the processes of a multi-process run without a launcher of their own: the environment torchrun
gives its workers (read by `torch.distributed`'s env:// initialization, accelerate and DeepSpeed).

`tuner ui`'s runner (`tuner.ui.runner`) starts a job's processes with it, and so do the multi-process tests
(`tests/launch.py`): torchrun would be one more Python process importing torch (and its elastic agent) per
launch, and the runner watches, stops and reports each process itself.
"""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (rank 0's rendezvous store takes it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_environment(rank: int, world: int, port: int) -> dict[str, str]:
    """The variables torchrun sets for worker `rank` of `world` on one node with a static rendezvous:
    RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, ROLE_RANK, ROLE_WORLD_SIZE, GROUP_WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT (torch.distributed.elastic.agent.server.api's worker environment); rank 0
    hosts the TCP store, as under env:// without torchrun's agent store. LOCAL_RANK picks the process's GPU
    among CUDA_VISIBLE_DEVICES. OMP_NUM_THREADS is the caller's (torchrun sets 1 unless it is set)."""
    r, n = str(rank), str(world)
    return {"RANK": r, "LOCAL_RANK": r, "GROUP_RANK": "0", "ROLE_RANK": r, "WORLD_SIZE": n,
            "LOCAL_WORLD_SIZE": n, "ROLE_WORLD_SIZE": n, "GROUP_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port)}  # fmt: skip
