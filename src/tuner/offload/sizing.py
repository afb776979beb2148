"""How many blocks to swap for a VRAM budget, from measured sizes.

With the last `s` blocks swapped, one training step was measured to peak at P bytes. That peak holds the
resident weights, the ring's min(R, s) swapped blocks, the adapter and optimizer state, and the
activations. Keeping the first j swapped blocks on the device instead adds their bytes and leaves the
rest unchanged, except that the ring shrinks when fewer than R blocks remain swapped:

    P(j) = P - ring(s) + ring(s - j) + bytes(swapped blocks 0 .. j-1)      ring(m) = largest m' ≤ R blocks

The answer is the smallest s - j with P(j) <= budget · (1 - headroom); the headroom covers allocator
fragmentation and steps that peak a little higher than the measured one (longer captions, other buckets).
"""

from __future__ import annotations

from collections.abc import Sequence

HEADROOM = 0.05


def choose_blocks_to_swap(
    block_bytes: Sequence[int],
    swapped_now: int,
    measured_peak: int,
    budget: int,
    ring: int = 2,
    headroom: float = HEADROOM,
) -> int:
    """Blocks to swap (the last ones of `block_bytes`, in execution order) so the peak fits `budget`.
    Returns `swapped_now` when even that does not fit (the caller reports it)."""
    n = len(block_bytes)
    swapped = list(block_bytes[n - swapped_now :])
    limit = budget * (1.0 - headroom)

    def ring_bytes(blocks: Sequence[int]) -> int:
        return sum(sorted(blocks, reverse=True)[:ring])

    base = measured_peak - ring_bytes(swapped)
    best = swapped_now
    for j in range(swapped_now + 1):
        peak = base + ring_bytes(swapped[j:]) + sum(swapped[:j])
        if peak <= limit:
            best = swapped_now - j
        else:
            break
    return best
