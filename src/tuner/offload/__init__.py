"""Moving weights and activations between the GPU and host memory, attached to a model from outside.

- `transfer.py`: the copies themselves — CUDA side streams ordered by events, or a fake CPU device that
  makes scheduling mistakes visible in tests.
- `blockswap.py`: keep N transformer blocks in pinned host memory and stream them in ahead of use, in
  forward and in backward (reverse order).
- `activations.py`: checkpoint each block and park its saved inputs in pinned host memory.
- `sizing.py`: how many blocks to swap for a VRAM budget, from measured sizes.

`tuner.memory.apply_memory_settings` puts these together from the `[memory]` config section.
"""

from tuner.offload.activations import CheckpointBlocks
from tuner.offload.blockswap import BlockSwap, block_modules
from tuner.offload.sizing import choose_blocks_to_swap
from tuner.offload.transfer import CudaTransfer, FakeTransfer, Transfer, transfer_for

__all__ = [
    "BlockSwap",
    "CheckpointBlocks",
    "CudaTransfer",
    "FakeTransfer",
    "Transfer",
    "block_modules",
    "choose_blocks_to_swap",
    "transfer_for",
]
