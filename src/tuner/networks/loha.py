"""LoHa: low-rank adaptation with a Hadamard product (Hyeon-Woo et al. 2022, "FedPara"; LyCORIS).

    ΔW = (alpha / r) · (w1_a @ w1_b) ⊙ (w2_a @ w2_b)        w1_a, w2_a [out, r]    w1_b, w2_b [r, in]

The *Hadamard product* ⊙ multiplies two matrices element by element. Each of the two factors has rank
at most r, but their element-wise product can reach rank r² (the product of two sums of r outer products
is a sum of r² outer products). For the parameters of a rank-2r LoRA, LoHa reaches rank r², which helps
when the update a concept needs is not low-rank.

Initialisation: w1_b and w2_b start N(0, 1), w1_a N(0, 0.1) and w2_a at zero, so ΔW = 0 at step 0 while
w2_a receives a gradient (∂L/∂w2_a = s · (G ⊙ (w1_a w1_b)) w2_bᵀ, with G = ∂L/∂ΔW). These are the scales
LyCORIS files are trained with, so learning rates carry over. LoRA+ treats w2_a, the factor that starts
at zero, as LoRA's up.

Memory: ΔW is a full [out, in] matrix. Letting autograd keep it (and the two factor products) alive
until backward would cost three weight-sized fp32 matrices per adapted layer, more than the model when
many layers are adapted. `_HadamardLinear` keeps only the input and the four small factors, and
recomputes the products in backward (the gradients of a Hadamard product are written out there).

Dropout, rank dropout (on output channels: ΔW has no rank-r bottleneck to drop, see
`base.drop_output_channels`), module dropout and alpha follow LoRA's rules.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tuner.errors import CheckpointError, TunerError
from tuner.networks.base import (
    AdapterModule,
    AdapterNetwork,
    adapter_device,
    drop_output_channels,
    init_generator,
)
from tuner.networks.delta import LOHA, ROLES, ModuleWeights
from tuner.networks.dora import wrap_dora
from tuner.networks.keys import COMFY_PREFIX, NameMap
from tuner.networks.targets import TargetSpec, find_targets


class _HadamardLinear(torch.autograd.Function):
    """y = x ΔWᵀ with ΔW = s · (a1 b1) ⊙ (a2 b2), saving only x and the factors for backward."""

    @staticmethod
    def forward(ctx, x, a1, b1, a2, b2, scale: float):  # noqa: ANN001 (autograd signature)
        ctx.scale = scale
        ctx.save_for_backward(x, a1, b1, a2, b2)
        return F.linear(x, (a1 @ b1) * (a2 @ b2) * scale)

    @staticmethod
    def backward(ctx, grad_y):  # noqa: ANN001
        x, a1, b1, a2, b2 = ctx.saved_tensors
        grad_y = grad_y.to(x.dtype)  # under autocast the forward's output (and so grad_y) is half precision
        p1, p2 = a1 @ b1, a2 @ b2
        grad_x = grad_y @ (p1 * p2 * ctx.scale) if ctx.needs_input_grad[0] else None
        # G = ∂L/∂ΔW summed over every token; then ∂L/∂p1 = s G ⊙ p2 and ∂L/∂p2 = s G ⊙ p1.
        grad_w = grad_y.reshape(-1, grad_y.shape[-1]).T @ x.reshape(-1, x.shape[-1]) * ctx.scale
        g1, g2 = grad_w * p2, grad_w * p1
        return grad_x, g1 @ b1.T, a1.T @ g1, g2 @ b2.T, a2.T @ g2, None


class LoHaModule(AdapterModule):
    """A LoHa adapter on one `nn.Linear`; parameters `hada_w1_a`, `hada_w1_b`, `hada_w2_a`, `hada_w2_b`."""

    kind = LOHA

    def __init__(
        self,
        name: str,
        base: nn.Linear,
        rank: int,
        alpha: float | None = None,
        dropout: float = 0.0,
        rank_dropout: float = 0.0,
        module_dropout: float = 0.0,
        dtype: torch.dtype = torch.float32,
        seed: int = 0,
    ) -> None:
        super().__init__(name, base, module_dropout, dropout, rank_dropout)
        if rank < 1:
            raise TunerError(f"LoHa rank must be at least 1, got {rank}")
        self.rank = rank
        self.alpha = float(alpha) if alpha else float(rank)
        out_features, in_features = base.out_features, base.in_features
        device = adapter_device(base)
        gen = init_generator(seed, name)  # drawn on the CPU in fp32, then moved

        def normal(rows: int, cols: int, std: float = 1.0) -> nn.Parameter:
            return nn.Parameter((torch.randn(rows, cols, generator=gen) * std).to(device=device, dtype=dtype))

        self.hada_w1_a = normal(out_features, rank, 0.1)
        self.hada_w1_b = normal(rank, in_features)
        self.hada_w2_a = nn.Parameter(torch.zeros(out_features, rank, device=device, dtype=dtype))
        self.hada_w2_b = normal(rank, in_features)

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def _factors(self) -> tuple[torch.Tensor, ...]:
        return self.hada_w1_a, self.hada_w1_b, self.hada_w2_a, self.hada_w2_b

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.dropout(x.to(self.hada_w1_a.dtype))
        y = _HadamardLinear.apply(x, *self._factors(), self.scale)
        if self.training and self.rank_dropout > 0:
            y = drop_output_channels(y, self.rank_dropout)
        return y

    def delta_weight(self) -> torch.Tensor:
        a1, b1, a2, b2 = (t.float() for t in self._factors())
        return (a1 @ b1) * (a2 @ b2) * self.scale

    def weights(self) -> ModuleWeights:
        return ModuleWeights(LOHA, {r: getattr(self, r).detach() for r in ROLES[LOHA]}, self.alpha)

    def up_parameters(self) -> list[nn.Parameter]:
        return [self.hada_w2_a]

    @torch.no_grad()
    def load(self, weights: ModuleWeights, source: str) -> None:
        self.check_kind(weights, source)
        for role in ROLES[LOHA]:
            param, tensor = getattr(self, role), weights.tensors[role]
            if param.shape != tensor.shape:
                raise CheckpointError(
                    f"{source}: {self.name}: the file has {role} {tuple(tensor.shape)}, the network expects "
                    f"{tuple(param.shape)}"
                )
            param.copy_(tensor)
        self.alpha = weights.alpha if weights.alpha else float(self.rank)


class LoHaNetwork(AdapterNetwork):
    """LoHa adapters on the targeted linear layers of one model."""

    @classmethod
    def apply_to(
        cls,
        model: nn.Module,
        spec: TargetSpec,
        rank: int,
        alpha: float | None = None,
        *,
        dropout: float = 0.0,
        rank_dropout: float = 0.0,
        module_dropout: float = 0.0,
        dora: bool = False,
        dtype: torch.dtype = torch.float32,
        name_map: NameMap | None = None,
        prefix: str = COMFY_PREFIX,
        seed: int = 0,
    ) -> LoHaNetwork:
        """Attach a fresh LoHa to every linear layer `spec` selects (see `LoRANetwork.apply_to`)."""
        adapters = [
            wrap_dora(
                LoHaModule(name, layer, rank, alpha, dropout, rank_dropout, module_dropout, dtype, seed), dora
            )
            for name, layer in find_targets(model, spec).items()
        ]
        return cls(adapters, name_map=name_map, prefix=prefix)
