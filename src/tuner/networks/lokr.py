"""LoKr: adaptation with a Kronecker product (Edalati et al. 2022, "KronA"; LyCORIS's `lokr_*` files).

    ΔW = s · w1 ⊗ w2        w1 [a_out, a_in], w2 [b_out, b_in], out = a_out · b_out, in = a_in · b_in

The *Kronecker product* A ⊗ B is the block matrix whose block (i, j) is A[i, j] · B. Two small factors
span the whole [out, in] update: for Wan 14B's 5120 × 5120 projections, w1 is 64 × 64 and w2 80 × 80,
about 10k parameters for a matrix of 26M, and rank(w1 ⊗ w2) = rank(w1) · rank(w2) can be full.

How a side is split: n = a · b with a the largest divisor of n not above √n (and not above `factor`
when one is given), so w1 is the small factor. w2 is stored as a low-rank product w2_a [b_out, r] @
w2_b [r, b_in]; `decompose_both` does the same to w1; `full_matrix` keeps both factors whole (then r and
alpha are unused and the scale is 1, as every loader reads such files). Otherwise s = alpha / r.

Initialisation: w1 (or its pair) and w2_b start Kaiming-uniform, w2_a (or a full w2) at zero, so ΔW = 0
at step 0 and the zero factor still gets a gradient. LoRA+ treats that factor as LoRA's up.

The forward pass never builds ΔW. Reading x as a matrix X [a_in, b_in] (row-major, so x[j·b_in + l] =
X[j, l]), the product is

    (w1 ⊗ w2) x = vec(w1 · X · w2ᵀ)        ([a_out, a_in] @ [a_in, b_in] @ [b_in, b_out])

two small matmuls per token instead of one large one, and nothing weight-sized is kept for backward.
Dropout, rank dropout (on output channels, see `base.drop_output_channels`) and module dropout follow
LoRA's rules.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from tuner.errors import CheckpointError, TunerError
from tuner.networks.base import (
    AdapterModule,
    AdapterNetwork,
    adapter_device,
    drop_output_channels,
    init_generator,
)
from tuner.networks.delta import LOKR, ModuleWeights, lokr_factor
from tuner.networks.dora import wrap_dora
from tuner.networks.keys import COMFY_PREFIX, NameMap
from tuner.networks.targets import TargetSpec, find_targets


def factorize(n: int, factor: int = -1) -> tuple[int, int]:
    """(a, b) with a · b = n and a ≤ b: a is the largest divisor of n with a ≤ √n and, when
    `factor` > 0, a ≤ factor. 5120 -> (64, 80); with factor 8 -> (8, 640); a prime -> (1, n)."""
    if factor == 0 or factor < -1:
        raise TunerError(f"LoKr factor must be -1 (automatic) or a positive size, got {factor}")
    limit = math.isqrt(n) if factor < 0 else min(math.isqrt(n), factor)
    a = next(d for d in range(limit, 0, -1) if n % d == 0)
    return a, n // a


@dataclass(frozen=True)
class LoKrLayout:
    """The shapes of a LoKr's factors: w1 [a_out, a_in], w2 [out / a_out, in / a_in], and the rank of
    each factor's low-rank pair (None: stored as a full matrix)."""

    a_out: int
    a_in: int
    rank1: int | None
    rank2: int | None

    @classmethod
    def from_options(
        cls,
        out_features: int,
        in_features: int,
        rank: int,
        factor: int,
        decompose_both: bool,
        full_matrix: bool,
    ) -> LoKrLayout:
        if decompose_both and full_matrix:
            raise TunerError("LoKr: decompose_both and full_matrix exclude each other")
        if rank < 1 and not full_matrix:
            raise TunerError(f"LoKr rank must be at least 1, got {rank}")
        a_out, a_in = factorize(out_features, factor)[0], factorize(in_features, factor)[0]
        return cls(a_out, a_in, rank if decompose_both else None, None if full_matrix else rank)

    @classmethod
    def of(cls, weights: ModuleWeights) -> LoKrLayout:
        t = weights.tensors
        a_out, a_in = lokr_factor(t, "1").shape
        ranks = [t[f"lokr_w{w}_b"].shape[0] if f"lokr_w{w}_b" in t else None for w in "12"]
        return cls(a_out, a_in, *ranks)


class LoKrModule(AdapterModule):
    """A LoKr adapter on one `nn.Linear`; parameters `lokr_w1` or `lokr_w1_a`/`_b`, and `lokr_w2` or
    `lokr_w2_a`/`_b` (see `LoKrLayout`)."""

    kind = LOKR

    def __init__(
        self,
        name: str,
        base: nn.Linear,
        rank: int,
        alpha: float | None = None,
        *,
        factor: int = -1,
        decompose_both: bool = False,
        full_matrix: bool = False,
        dropout: float = 0.0,
        rank_dropout: float = 0.0,
        module_dropout: float = 0.0,
        dtype: torch.dtype = torch.float32,
        layout: LoKrLayout | None = None,
        seed: int = 0,
    ) -> None:
        """`layout` fixes the factor shapes directly (used when reading a file); otherwise they follow
        from `rank`, `factor`, `decompose_both` and `full_matrix`."""
        super().__init__(name, base, module_dropout, dropout, rank_dropout)
        out_features, in_features = base.out_features, base.in_features
        layout = layout or LoKrLayout.from_options(
            out_features, in_features, rank, factor, decompose_both, full_matrix
        )
        if out_features % layout.a_out or in_features % layout.a_in:
            raise TunerError(
                f"{name}: a LoKr factor of {layout.a_out}x{layout.a_in} does not divide {out_features}x{in_features}"
            )
        self.layout = layout
        self.rank = layout.rank2 or layout.rank1  # the r of alpha / r (w2's when both are decomposed)
        self.alpha = float(alpha) if alpha else float(self.rank or 1)
        self.b_out, self.b_in = out_features // layout.a_out, in_features // layout.a_in
        gen, kw = init_generator(seed, name), {"device": adapter_device(base), "dtype": dtype}

        def init(rows: int, cols: int, zero: bool) -> nn.Parameter:  # drawn on the CPU in fp32, then moved
            tensor = torch.zeros(rows, cols)
            if not zero:
                nn.init.kaiming_uniform_(tensor, a=math.sqrt(5), generator=gen)
            return nn.Parameter(tensor.to(**kw))

        self.factors = nn.ParameterDict()
        for which, (rows, cols), rank_, zero in (
            ("1", (layout.a_out, layout.a_in), layout.rank1, False),
            ("2", (self.b_out, self.b_in), layout.rank2, True),
        ):
            if rank_ is None:
                self.factors[f"lokr_w{which}"] = init(rows, cols, zero)
            else:
                self.factors[f"lokr_w{which}_a"] = init(rows, rank_, zero)
                self.factors[f"lokr_w{which}_b"] = init(rank_, cols, False)

    @property
    def scale(self) -> float:
        return self.alpha / self.rank if self.rank else 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w1, w2 = lokr_factor(self.factors, "1"), lokr_factor(self.factors, "2")
        x = self.dropout(x.to(w1.dtype))
        lead = x.shape[:-1]
        grid = x.reshape(*lead, self.layout.a_in, self.b_in)  # X with x = vec(X)
        y = (w1 @ (grid @ w2.T)).reshape(*lead, -1) * self.scale
        if self.training and self.rank_dropout > 0:
            y = drop_output_channels(y, self.rank_dropout)
        return y

    def delta_weight(self) -> torch.Tensor:
        w1, w2 = lokr_factor(self.factors, "1"), lokr_factor(self.factors, "2")
        return torch.kron(w1.float(), w2.float()) * self.scale

    def weights(self) -> ModuleWeights:
        return ModuleWeights(LOKR, {k: v.detach() for k, v in self.factors.items()}, self.alpha)

    def up_parameters(self) -> list[nn.Parameter]:
        return [self.factors["lokr_w2" if "lokr_w2" in self.factors else "lokr_w2_a"]]

    @torch.no_grad()
    def load(self, weights: ModuleWeights, source: str) -> None:
        self.check_kind(weights, source)
        mine = {k: tuple(v.shape) for k, v in self.factors.items()}
        theirs = {k: tuple(v.shape) for k, v in weights.tensors.items()}
        if mine != theirs:
            raise CheckpointError(
                f"{source}: {self.name}: the file has LoKr factors {theirs}, the network expects {mine} "
                "(other rank, factor, decompose_both or full_matrix?)"
            )
        for key, tensor in weights.tensors.items():
            self.factors[key].copy_(tensor)
        self.alpha = weights.alpha if weights.alpha else float(self.rank or 1)


class LoKrNetwork(AdapterNetwork):
    """LoKr adapters on the targeted linear layers of one model."""

    @classmethod
    def apply_to(
        cls,
        model: nn.Module,
        spec: TargetSpec,
        rank: int,
        alpha: float | None = None,
        *,
        factor: int = -1,
        decompose_both: bool = False,
        full_matrix: bool = False,
        dropout: float = 0.0,
        rank_dropout: float = 0.0,
        module_dropout: float = 0.0,
        dora: bool = False,
        dtype: torch.dtype = torch.float32,
        name_map: NameMap | None = None,
        prefix: str = COMFY_PREFIX,
        seed: int = 0,
    ) -> LoKrNetwork:
        """Attach a fresh LoKr to every linear layer `spec` selects (see `LoRANetwork.apply_to`)."""
        options = {"factor": factor, "decompose_both": decompose_both, "full_matrix": full_matrix}
        adapters = [
            wrap_dora(
                LoKrModule(
                    name,
                    layer,
                    rank,
                    alpha,
                    **options,
                    dropout=dropout,
                    rank_dropout=rank_dropout,
                    module_dropout=module_dropout,
                    dtype=dtype,
                    seed=seed,
                ),
                dora,
            )  # fmt: skip
            for name, layer in find_targets(model, spec).items()
        ]
        return cls(adapters, name_map=name_map, prefix=prefix)
