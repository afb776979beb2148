"""AdamW8bitKahan: AdamW with 8-bit moments and Kahan-compensated updates of bf16 weights.

A full fine-tune in bf16 keeps weights with 8 significant bits: a weight near 1.0 can only move in
steps of 2^-8 ≈ 0.004, so an update of 1e-5 rounds away to nothing, every step, and the model stops
learning long before the loss says it should. Kahan summation keeps what the rounding dropped: each
parameter has a bf16 *compensation* buffer c holding the part of past updates that did not fit into the
stored weight; the next update adds it back before rounding:

    y = Δ + c          (the update, plus what earlier rounding lost)
    w' = bf16(w + y)   (computed in fp32, rounded once)
    c = (w + y) − w'   (what this rounding lost, for the next step)

so the stored weight is within half a bf16 step of the exact fp32 sum of every update so far.

The moments are kept in 8 bits as bitsandbytes' AdamW8bit keeps them: block-wise (256 elements share
one fp32 absmax) on its *dynamic* code, a non-linear map with small relative error from the block's
largest value down to ~1e-7 of it (a linear code would round the small moments of a block to zero, and
a zero second moment next to a non-zero first one is a huge step). State per parameter: 1 + 1 bytes of
moments, 2 bytes of compensation for bf16 weights (none for fp32 ones, which do not need it) and 8
bytes per 256 elements of scales: ~4 bytes against AdamW's 8 (plus the fp32 master copy's 4 that mixed
precision would need instead).
"""

from __future__ import annotations

import functools

import torch

from tuner.optimizers import PerParameter

BLOCK = 256


@functools.cache
def _code(signed: bool) -> torch.Tensor:
    import bitsandbytes.functional as bnbf  # imported here: slow to import, and noisy on CPU

    return bnbf.create_dynamic_map(signed=signed)


def quantize(x: torch.Tensor, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """8-bit codes of `x` and the fp32 absmax of each block of 256 elements."""
    import bitsandbytes.functional as bnbf

    codes, state = bnbf.quantize_blockwise(
        x.float().contiguous(), code=_code(signed).to(x.device), blocksize=BLOCK
    )
    return codes, state.absmax


def dequantize(codes: torch.Tensor, absmax: torch.Tensor, signed: bool) -> torch.Tensor:
    import bitsandbytes.functional as bnbf

    return bnbf.dequantize_blockwise(
        codes, absmax=absmax, code=_code(signed).to(codes.device), blocksize=BLOCK
    )


class AdamW8bitKahan(PerParameter):
    def __init__(
        self,
        params,
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        kahan: bool = True,
    ):
        if lr < 0 or eps <= 0 or weight_decay < 0 or not all(0 <= b < 1 for b in betas):
            raise ValueError(
                f"AdamW8bitKahan: invalid lr={lr}, betas={betas}, eps={eps}, weight_decay={weight_decay}"
            )
        super().__init__(
            params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, kahan=kahan)
        )

    def _step_one(self, p: torch.Tensor, group: dict) -> None:
        beta1, beta2 = group["betas"]
        state = self.state[p]
        g = p.grad.float()
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["m"], state["m_absmax"] = quantize(torch.zeros_like(g), signed=True)
            state["v"], state["v_absmax"] = quantize(torch.zeros_like(g), signed=False)
            if group["kahan"] and p.dtype in (torch.bfloat16, torch.float16):
                state["compensation"] = torch.zeros_like(p)
        state["step"] += 1
        step = state["step"].item()
        m = dequantize(state["m"], state["m_absmax"], signed=True).lerp_(g, 1 - beta1)
        v = dequantize(state["v"], state["v_absmax"], signed=False).lerp_(g * g, 1 - beta2)
        state["m"], state["m_absmax"] = quantize(m, signed=True)
        state["v"], state["v_absmax"] = quantize(v, signed=False)

        lr = group["lr"]
        w = p.float()
        update = -lr * (m / (1 - beta1**step)) / ((v / (1 - beta2**step)).sqrt() + group["eps"])
        update -= lr * group["weight_decay"] * w
        compensation = state.get("compensation")
        if compensation is None:
            p.copy_(w + update)
            return
        exact = w + (update + compensation.float())
        p.copy_(exact)  # rounds to the stored dtype
        compensation.copy_(exact - p.float())
