"""Host memory of block swap's host copies with N processes on one machine: a copy each vs one shared.

Each process builds the same stack of `--blocks` frozen Linear blocks (`--block-mib` MiB each, bf16),
swaps all of them with `BlockSwap` and reads every byte of its host copies (as the copies to the GPU
do). What is measured is the growth of the process's proportional set size (PSS, /proc/self/smaps_rollup:
private memory plus each shared page divided by the number of processes mapping it) from just before
`BlockSwap` to after that read, with all processes past it: the host copies' cost to this process.
The original weights stay referenced throughout, so their memory is in both readings and cancels.

The transfer is the CPU fake device with one change: weights at rest point to their host copy, as on
CUDA (the fake's NaN stand-ins would add private memory the CUDA path does not have). Page-locking is
the CUDA path's and is not measured here. Prints one row per mode and the ratio shared / a copy each
(expected ≈ 1/N).

    python benchmarks/shared_swap.py                                       # 2 processes, 8 × 16 MiB
    python benchmarks/shared_swap.py --processes 4 --blocks 8 --block-mib 64
    python benchmarks/shared_swap.py --blocks 2 --block-mib 1              # smoke run

It starts itself under torchrun (gloo) when not already under it.
"""

from __future__ import annotations

import argparse
import gc
import os
import socket
import subprocess
import sys
from pathlib import Path

import torch
from torch import nn

from tuner.offload import BlockSwap, FakeTransfer
from tuner.offload.shared import machine_peers, proportional_set_size

sys.path.insert(0, str(Path(__file__).resolve().parent))  # siblings, also when loaded by path (tests)
from report import table  # noqa: E402


class HostResting(FakeTransfer):
    """The fake device, with weights at rest pointing to their host copy (as `CudaTransfer` does)."""

    def at_rest(self, master: torch.Tensor) -> torch.Tensor:
        return master


class Stack(nn.Module):
    def __init__(self, blocks: int, block_mib: float, seed: int = 0):
        super().__init__()
        width = int((block_mib * 2**20 / 2) ** 0.5)  # one square bf16 Linear per block
        g = torch.Generator().manual_seed(seed)
        self.blocks = nn.ModuleList(nn.Linear(width, width, bias=False) for _ in range(blocks))
        with torch.no_grad():
            for block in self.blocks:
                block.weight.copy_(torch.randn(block.weight.shape, generator=g))
        self.to(torch.bfloat16).requires_grad_(False)


def host_copy_pss(args, share: bool) -> tuple[int, int]:
    """(growth of this process's PSS from swapping the stack, the host copies' bytes)."""
    import torch.distributed as dist

    model = Stack(args.blocks, args.block_mib)
    originals = [p.data for p in model.parameters()]  # kept alive: their memory is not what is measured
    peers = machine_peers() if share else None
    gc.collect()
    dist.barrier()
    before = proportional_set_size()
    swap = BlockSwap(model, ["blocks"], args.blocks, HostResting(), peers=peers)
    masters = [m for block in swap.swapped for m in block.masters]
    read = sum(int(m.view(torch.uint8).sum()) for m in masters)  # every page, as the copies to the GPU
    dist.barrier()
    grown = proportional_set_size() - before
    dist.barrier()  # nobody lets go of a shared copy before everyone has measured
    assert read and originals
    swap.remove()
    return grown, sum(m.numel() * m.element_size() for m in masters)


def worker(args) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    for share in (False, True):  # warm-up on a small stack: first-call allocations are not the copies'
        host_copy_pss(argparse.Namespace(blocks=1, block_mib=0.25), share)
    rows = []
    for share in (False, True):
        grown, nbytes = host_copy_pss(args, share)
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, grown)
        rows.append((share, nbytes, everyone))
    if dist.get_rank() == 0:
        mib = 2**20
        print(table(
            ["host copies", "processes", "swapped weights", "PSS growth per process", "mean"],
            [["shared" if share else "a copy each", len(pss), f"{nbytes / mib:.1f} MiB",
              ", ".join(f"{p / mib:.1f}" for p in pss) + " MiB", f"{sum(pss) / len(pss) / mib:.1f} MiB"]
             for share, nbytes, pss in rows],
        ))  # fmt: skip
        private, shared = (sum(pss) / len(pss) for _, _, pss in rows)
        print(
            f"shared / a copy each: ratio {shared / private:.3f} (1/{len(rows[0][2])} = {1 / len(rows[0][2]):.3f})"
        )
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--block-mib", type=float, default=16.0)
    args = parser.parse_args(argv)
    if "LOCAL_RANK" in os.environ:
        worker(args)
        return 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torchrun = Path(sys.executable).parent / "torchrun"
    cmd = [str(torchrun), "--nproc_per_node", str(args.processes), "--master_port", str(port), __file__,
           "--blocks", str(args.blocks), "--block-mib", str(args.block_mib)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(cmd, env=env, capture_output=True, text=True)
    print(result.stdout, end="")
    if result.returncode:
        print(result.stderr[-3000:], file=sys.stderr)
    return result.returncode


if __name__ == "__main__":
    sys.exit(main())
