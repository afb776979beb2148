"""DoRA: weight-decomposed low-rank adaptation (Liu et al. 2024).

*Weight decomposition*: every column of a weight matrix is a length times a unit vector, so
W = m · V / ‖V‖ with V = W and m = ‖W‖ (one norm per column). The paper finds that full fine-tuning and
LoRA change these two parts in different patterns, and that learning them separately brings LoRA close
to full fine-tuning. DoRA keeps the frozen W as the starting direction, lets an adapter (LoRA, LoHa or
LoKr) update the direction, and learns the magnitude as a vector of its own:

    W' = m · (W + ΔW) / ‖W + ΔW‖        m starts at ‖W + ΔW‖ (= ‖W‖ for a fresh adapter), so W' = W

Which norm: tuner normalises each column (the norm runs over the output dimension; m is [1, in]). That
is the `dora_scale` [1, in] of LyCORIS, kohya and ComfyUI files, and every such loader computes it the
same way. PEFT normalises each row (m [out], `lora_magnitude_vector`); those files are read and applied
with their own axis (see `delta.dora_weight`), but a per-column DoRA has no PEFT form.

The forward pass never builds W'. With the gains G = m / ‖W + ΔW‖:

    per column:  W' x - W x = W ((G - 1) ⊙ x) + ΔW (G ⊙ x)
    per row:     W' x - W x = (G - 1) ⊙ (W x) + G ⊙ (ΔW x)

so the adapter runs its own low-rank forward (with its dropouts) and the base weight is used once more.
As the paper suggests, ‖W + ΔW‖ is treated as a constant in backward (computed without gradient): the
magnitude still learns through G, the direction through ΔW, and no [out, in] matrix is kept for backward.
At strength t a loader computes W + t (W' - W), which is what the hook's multiplier does.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from tuner.errors import CheckpointError
from tuner.networks.base import AdapterModule, base_weight
from tuner.networks.delta import ModuleWeights, dora_norm_dim, dora_weight


class DoRAModule(AdapterModule):
    """Weight decomposition around another adapter (`inner`, never attached itself): the inner
    adapter learns the direction, `magnitude` ([1, in] per column, or [out, 1] per row) the lengths."""

    def __init__(self, inner: AdapterModule, magnitude: torch.Tensor | None = None) -> None:
        super().__init__(inner.name, inner.base, inner.module_dropout)
        inner.module_dropout = 0.0  # the hook asks this module whether to skip
        self.kind = inner.kind
        self.inner = inner
        with torch.no_grad():
            if magnitude is None:
                magnitude = self._norm(0)
            if magnitude.is_meta:  # a base another pipeline stage holds: that stage's magnitude is saved
                magnitude = torch.zeros(magnitude.shape)
            device = next(inner.parameters()).device
            self.magnitude = nn.Parameter(magnitude.detach().float().to(device))

    @torch.no_grad()
    def _norm(self, dim: int) -> torch.Tensor:
        combined = base_weight(self.base) + self.inner.delta_weight().to(self.base.weight.device)
        return combined.norm(dim=dim, keepdim=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dim = dora_norm_dim(self.magnitude)
        gain = self.magnitude / self._norm(dim).to(self.magnitude.device)
        gain = gain.reshape(-1)  # [in] per column, [out] per row
        weight = base_weight(self.base, x.dtype)  # no copy when the base is stored in the input's dtype
        if dim == 0:
            rest = F.linear(x * (gain - 1).to(x.dtype), weight).to(gain.dtype)
            return rest + self.inner(x.to(gain.dtype) * gain)
        return (gain - 1) * F.linear(x, weight).to(gain.dtype) + gain * self.inner(x)

    def delta_weight(self) -> torch.Tensor:
        weight = base_weight(self.base)
        delta = self.inner.delta_weight().to(weight.device)
        return dora_weight(weight, delta, self.magnitude.float().to(weight.device)) - weight

    def weights(self) -> ModuleWeights:
        return replace(self.inner.weights(), dora_scale=self.magnitude.detach())

    def up_parameters(self) -> list[nn.Parameter]:
        return self.inner.up_parameters()

    @torch.no_grad()
    def load(self, weights: ModuleWeights, source: str) -> None:
        """Load the inner adapter; take the file's magnitude, or (a plain adapter file) start the
        magnitude at ‖W + ΔW‖, so the network computes exactly what the file does."""
        self.inner.load(replace(weights, dora_scale=None), source)
        magnitude = weights.dora_scale
        if magnitude is None:
            magnitude = self._norm(dora_norm_dim(self.magnitude))
        elif magnitude.shape != self.magnitude.shape and magnitude.numel() not in self.base.weight.shape:
            raise CheckpointError(f"{source}: {self.name}: dora_scale {tuple(magnitude.shape)} does not fit")
        if magnitude.shape == self.magnitude.shape:
            self.magnitude.copy_(magnitude)
        else:  # a file with the other norm axis (PEFT's rows) is taken as it is: the axis follows the shape
            self.magnitude = nn.Parameter(magnitude.float().to(self.magnitude.device))


def wrap_dora(adapter: AdapterModule, enabled: bool) -> AdapterModule:
    """`adapter` with weight decomposition around it when `enabled`."""
    return DoRAModule(adapter) if enabled else adapter
