"""DDP: every process holds the whole model and trains on its own share of each global batch; the
trained gradients are averaged so every process takes the same optimizer step."""

from __future__ import annotations

import torch

from tuner.distributed import Strategy


class DDPStrategy(Strategy):
    name = "ddp"

    def reduce_gradients(self, run) -> None:
        """Average the trainable gradients over processes with one all-reduce of a flat buffer."""
        n = run.accelerator.num_processes
        grads = [p.grad for p in run.trained.parameters() if p.requires_grad and p.grad is not None]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1).float() for g in grads])
        torch.distributed.all_reduce(flat)
        flat /= n
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
