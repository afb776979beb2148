"""Automagic: an optimizer that tunes a learning rate per element from the signs of its updates.

Picking a learning rate for a LoRA is guesswork: too low and nothing is learned, too high and the run
burns. Automagic (made popular by ai-toolkit) lets every weight find its own:

1. The step direction is Adafactor's: the gradient divided by the root of a factored second moment
   (for a matrix, an exponential average of the row means and of the column means of g², whose outer
   product over their mean stands in for the full matrix: n + m numbers of state instead of n · m),
   with the update's RMS clipped to `clip_threshold`.
2. Each element keeps its own learning rate, starting at the optimizer's lr. When the update keeps the
   sign it had at the last step (the weight is still travelling one way) its rate grows by `lr_bump`;
   when it flips (it overshot) the rate shrinks by `lr_bump`; rates stay within [`min_lr`, `max_lr`].
3. The step is w ← w − lr_elem · s · (u + weight_decay · w), where s = group lr / initial lr is what a
   learning-rate schedule (warm-up, decay) says on top; with the constant schedule s = 1.

Two deliberate differences from ai-toolkit's `toolkit/optimizers/automagic.py` (and diffusion-pipe's
copy of it), each about 1-6 % of the weight movement over a run:

- The second moment is bias-corrected as in Adam (v / (1 − β2^t)). ai-toolkit divides by the raw
  average, which at step t is too small by 1 − β2^t (0.001 at step 1), so its early updates are inflated
  up to 32× and all end at the RMS clip. `bias_correction = false` gives ai-toolkit's rule.
- At the first step no rate changes: there is no previous sign to agree with. ai-toolkit compares the
  first update with an all-"not positive" polarity, so each rate moves by ±lr_bump according to the
  sign it happens to start with, a one-step artefact (at most lr_bump per element) kept out here.

State per element: the learning rate (fp32, 4 bytes: in bf16 a bump of 1e-6 would vanish next to rates
above ~2.5e-4) and the last update's sign (int8, 1 byte); a matrix's second moment is factored
(negligible). About 5 bytes per trained parameter, against AdamW's 8.
The rates are ordinary optimizer state, so they are saved and resumed with it; `mean_lr()` reports
their mean, which the trainer logs.
"""

from __future__ import annotations

import torch

from tuner.optimizers import PerParameter


class Automagic(PerParameter):
    def __init__(
        self,
        params,
        lr: float = 1e-4,
        min_lr: float = 1e-7,
        max_lr: float = 1e-3,
        lr_bump: float = 1e-6,
        beta2: float = 0.999,
        eps: float = 1e-30,
        clip_threshold: float = 1.0,
        weight_decay: float = 0.0,
        bias_correction: bool = True,
    ):
        if not 0 < min_lr <= lr <= max_lr:
            raise ValueError(f"Automagic needs 0 < min_lr <= lr <= max_lr, got {min_lr}, {lr}, {max_lr}")
        if lr_bump <= 0 or not 0 < beta2 < 1 or clip_threshold <= 0 or weight_decay < 0:
            raise ValueError(
                "Automagic needs lr_bump > 0, 0 < beta2 < 1, clip_threshold > 0, weight_decay >= 0"
            )
        defaults = dict(lr=lr, min_lr=min_lr, max_lr=max_lr, lr_bump=lr_bump, beta2=beta2, eps=eps,
                        clip_threshold=clip_threshold, weight_decay=weight_decay,
                        bias_correction=bias_correction)  # fmt: skip
        super().__init__(params, defaults)
        for group in self.param_groups:
            group.setdefault("start_lr", group["lr"])  # what the per-element rates start at

    def mean_lr(self) -> float:
        """Mean per-element learning rate over every parameter stepped so far (the start lr before)."""
        total, count = 0.0, 0
        for group in self.param_groups:
            for p in group["params"]:
                rates = self.state.get(p, {}).get("lr")
                if rates is not None:
                    total += rates.float().sum().item()
                    count += rates.numel()
        return total / count if count else self.param_groups[0]["start_lr"]

    def _step_one(self, p: torch.Tensor, group: dict) -> None:
        scale = group["lr"] / group["start_lr"]  # what a schedule says on top of the per-element rates
        g = p.grad.float()
        state = self.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["lr"] = torch.full_like(p, group["start_lr"], dtype=torch.float32)
            state["sign"] = torch.zeros_like(p, dtype=torch.int8)
            if p.dim() >= 2:
                state["row"] = torch.zeros(p.shape[:-1], dtype=torch.float32, device=p.device)
                state["col"] = torch.zeros(p.shape[:-2] + p.shape[-1:], dtype=torch.float32, device=p.device)
            else:
                state["sq"] = torch.zeros_like(p, dtype=torch.float32)
        state["step"] += 1
        beta2 = group["beta2"]
        g2 = g * g + group["eps"]
        if p.dim() >= 2:
            state["row"].lerp_(g2.mean(dim=-1), 1 - beta2)
            state["col"].lerp_(g2.mean(dim=-2), 1 - beta2)
            row, col = state["row"], state["col"]
            v = (row / row.mean(dim=-1, keepdim=True)).unsqueeze(-1) * col.unsqueeze(-2)
        else:
            v = state["sq"].lerp_(g2, 1 - beta2)
        # `.get`: a state saved before the option existed resumes with the rule it was trained with
        debias = 1 - beta2 ** state["step"].item() if group.get("bias_correction", True) else 1.0
        u = g / (v / debias).sqrt()
        u /= (u.pow(2).mean().sqrt() / group["clip_threshold"]).clamp_(min=1.0)

        sign = torch.sign(u).to(torch.int8)
        agreement = (sign * state["sign"]).float()  # 1 kept, -1 flipped, 0 at the first step (no sign yet)
        rates = state["lr"].add_(agreement, alpha=group["lr_bump"]).clamp_(group["min_lr"], group["max_lr"])
        state["sign"].copy_(sign)

        w = p.float()
        if group["weight_decay"]:
            u = u + group["weight_decay"] * w
        p.copy_(w - scale * rates * u)
