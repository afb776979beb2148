"""What an adapter stores for one linear layer, and the weight update it stands for.

Every adapter type adds a learned update ΔW to a frozen weight W [out, in]. They differ only in how ΔW
is built from a few small tensors (s = alpha / r is the scale, 1 when a file has no alpha):

    LoRA   ΔW = s · up @ down                          up [out, r], down [r, in]
    LoHa   ΔW = s · (w1_a @ w1_b) ⊙ (w2_a @ w2_b)      each pair [out, r] @ [r, in]
    LoKr   ΔW = s · w1 ⊗ w2                            w1 [a_out, a_in], w2 [b_out, b_in]

*Hadamard product* (⊙, LoHa): the element-wise product of two matrices. Two rank-r factors multiply to
a matrix of rank up to r², so LoHa reaches a higher rank than LoRA for the same number of parameters.

*Kronecker product* (⊗, LoKr): `A ⊗ B` is the block matrix whose block (i, j) is `A[i, j] · B`, so it is
[a_out·b_out, a_in·b_in] and `(A ⊗ B)[i·b_out + k, j·b_in + l] = A[i, j] · B[k, l]`. Two small factors
span a large matrix (rank(A ⊗ B) = rank(A) · rank(B)). Either factor may itself be stored as a low-rank
product (`lokr_w1_a @ lokr_w1_b`, `lokr_w2_a @ lokr_w2_b`); r is then the rank of the decomposed factor
(w2's when both are), and a LoKr whose factors are both full matrices has scale 1 whatever its alpha.

*DoRA* (weight decomposition, Liu et al. 2024) splits a weight into a magnitude and a direction and
learns both: `W' = m · (W + ΔW) / ‖W + ΔW‖`. The norm is taken per column (`m` [1, in], the layout
ComfyUI, LyCORIS and kohya files use) or per row (`m` [out, 1], PEFT's `lora_magnitude_vector`). At
strength t a loader uses `W + t · (W' - W)`. ΔW is any of the three above.

Exact conversions to LoRA form (what the diffusers layout, which knows only LoRA, is written with):
- LoHa: `(A1 B1) ⊙ (A2 B2) = (A1 ⊙ᵣ A2)(B1 ⊙꜀ B2)`, with the face-splitting products
  `up[o, j·r2 + k] = A1[o, j] · A2[o, k]` and `down[j·r2 + k, i] = B1[j, i] · B2[k, i]`: rank r1·r2.
- LoKr: the mixed-product property `(U1 V1) ⊗ (U2 V2) = (U1 ⊗ U2)(V1 ⊗ V2)`; a full factor F is written
  `F · I` or `I · F`, whichever gives the smaller rank.

`ModuleWeights` is this file-level view of one module, independent of key layout; the trainable modules
(`lora.py`, `loha.py`, `lokr.py`, `dora.py`) produce and consume it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tuner.errors import CheckpointError

LORA, LOHA, LOKR = "lora", "loha", "lokr"

ROLES: dict[str, tuple[str, ...]] = {
    LORA: ("down", "up"),
    LOHA: ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b"),
    LOKR: ("lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b"),
}
"""The tensors of each kind, by role. LoHa and LoKr roles are their (layout-independent) file suffixes."""

KIND_NAMES = {LORA: "LoRA", LOHA: "LoHa", LOKR: "LoKr"}


@dataclass
class ModuleWeights:
    """One module's adapter tensors as a file stores them, whatever the key layout."""

    kind: str
    """"lora", "loha" or "lokr"."""
    tensors: dict[str, torch.Tensor]
    """By role (see `ROLES`); for LoKr each factor is either full (`lokr_w1`) or a pair (`lokr_w1_a/_b`)."""
    alpha: float | None = None
    """None when the file has none (scale 1)."""
    dora_scale: torch.Tensor | None = None
    """DoRA magnitude, [1, in] (per column) or [out, 1] (per row); None for a plain adapter."""

    @property
    def rank(self) -> int | None:
        """The r of s = alpha / r; None for a LoKr with two full factors."""
        t = self.tensors
        if self.kind == LORA:
            return t["down"].shape[0]
        if self.kind == LOHA:
            return t["hada_w1_b"].shape[0]
        if "lokr_w2_b" in t:
            return t["lokr_w2_b"].shape[0]
        return t["lokr_w1_b"].shape[0] if "lokr_w1_b" in t else None

    @property
    def scale(self) -> float:
        rank = self.rank
        if rank is None or not self.alpha:
            return 1.0
        return self.alpha / rank

    @property
    def shape(self) -> tuple[int, int]:
        """(out, in) of the weight this module updates."""
        t = self.tensors
        if self.kind == LORA:
            return t["up"].shape[0], t["down"].shape[1]
        if self.kind == LOHA:
            return t["hada_w1_a"].shape[0], t["hada_w1_b"].shape[1]
        (a_out, a_in), (b_out, b_in) = lokr_factor(t, "1").shape, lokr_factor(t, "2").shape
        return a_out * b_out, a_in * b_in

    def delta(self) -> torch.Tensor:
        """ΔW as an fp32 [out, in] matrix, scale included (DoRA not applied: see `effective_delta`)."""
        t = {k: v.float() for k, v in self.tensors.items()}
        if self.kind == LORA:
            raw = t["up"] @ t["down"]
        elif self.kind == LOHA:
            raw = (t["hada_w1_a"] @ t["hada_w1_b"]) * (t["hada_w2_a"] @ t["hada_w2_b"])
        else:
            raw = torch.kron(lokr_factor(t, "1"), lokr_factor(t, "2"))
        return raw * self.scale

    def effective_delta(self, weight: torch.Tensor | None) -> torch.Tensor:
        """What the adapter adds to `weight` at strength 1 (fp32); DoRA needs the base weight."""
        if self.dora_scale is None:
            return self.delta()
        if weight is None:
            raise CheckpointError("a DoRA module needs its base weight to compute its update")
        base = weight.float()
        return dora_weight(base, self.delta().to(base.device), self.dora_scale.to(base.device)) - base


def lokr_factor(tensors: dict[str, torch.Tensor], which: str) -> torch.Tensor:
    """LoKr factor w1 or w2: the full matrix, or the product of its low-rank pair."""
    full = tensors.get(f"lokr_w{which}")
    if full is not None:
        return full
    return tensors[f"lokr_w{which}_a"] @ tensors[f"lokr_w{which}_b"]


def dora_norm_dim(magnitude: torch.Tensor) -> int:
    """The dimension a DoRA norm runs over: 0 (down each column) for [1, in], 1 (along rows) for [out, 1]."""
    return 0 if magnitude.shape[0] == 1 else 1


def dora_weight(weight: torch.Tensor, delta: torch.Tensor, magnitude: torch.Tensor) -> torch.Tensor:
    """W' = m · (W + ΔW) / ‖W + ΔW‖, the norm per column or per row as `magnitude`'s shape says."""
    combined = weight + delta
    norm = combined.norm(dim=dora_norm_dim(magnitude), keepdim=True)
    return combined * (magnitude / norm)


def validate(weights: ModuleWeights, where: str, stem: str) -> None:
    """Raise `CheckpointError` unless the tensors fit together as one linear layer's adapter."""
    t = weights.tensors
    what = f"{where}: module {stem!r} ({KIND_NAMES[weights.kind]})"
    if any(v.ndim != 2 for v in t.values()):
        shapes = {k: tuple(v.shape) for k, v in t.items()}
        raise CheckpointError(f"{what} has tensors that are not matrices {shapes} (a conv adapter?)")
    if weights.kind == LORA:
        ok = t["up"].shape[1] == t["down"].shape[0]
    elif weights.kind == LOHA:
        ok = (
            t["hada_w1_a"].shape[1] == t["hada_w1_b"].shape[0]
            and t["hada_w2_a"].shape[1] == t["hada_w2_b"].shape[0]
            and t["hada_w1_a"].shape[0] == t["hada_w2_a"].shape[0]
            and t["hada_w1_b"].shape[1] == t["hada_w2_b"].shape[1]
        )
    else:
        ok = all(
            (f"lokr_w{w}" in t) != (f"lokr_w{w}_a" in t and f"lokr_w{w}_b" in t)
            and (f"lokr_w{w}" in t or t[f"lokr_w{w}_a"].shape[1] == t[f"lokr_w{w}_b"].shape[0])
            for w in "12"
        )
    if not ok:
        raise CheckpointError(f"{what} has tensors whose shapes do not fit: {_shapes(t)}")
    if weights.dora_scale is not None:
        out, inp = weights.shape
        if tuple(weights.dora_scale.shape) not in ((1, inp), (out, 1)):
            raise CheckpointError(
                f"{what}: dora_scale has shape {tuple(weights.dora_scale.shape)}, expected (1, {inp}) or ({out}, 1)"
            )


def _shapes(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in tensors.items()}


# ---------------------------------------------------------------------------------------------------
# Exact LoRA forms
# ---------------------------------------------------------------------------------------------------


def to_lora(weights: ModuleWeights) -> ModuleWeights:
    """The same ΔW written as a LoRA (exact up to fp32 rounding; the rank may grow, see above). The scale
    is kept as alpha (alpha = s · new rank), so no tensor is rescaled."""
    if weights.kind == LORA:
        return weights
    t = {k: v.float() for k, v in weights.tensors.items()}
    if weights.kind == LOHA:
        a1, b1, a2, b2 = (t[r] for r in ROLES[LOHA])
        up = (a1.unsqueeze(2) * a2.unsqueeze(1)).reshape(a1.shape[0], -1)
        down = (b1.unsqueeze(1) * b2.unsqueeze(0)).reshape(-1, b1.shape[1])
    else:
        u1, v1 = _low_rank_pair(t, "1")
        u2, v2 = _low_rank_pair(t, "2")
        up, down = torch.kron(u1, u2), torch.kron(v1, v2)
    alpha = weights.scale * down.shape[0]
    return ModuleWeights(LORA, {"down": down, "up": up}, alpha, weights.dora_scale)


def _low_rank_pair(tensors: dict[str, torch.Tensor], which: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(U, V) with U @ V = the LoKr factor; a full factor F is F @ I or I @ F, the smaller rank."""
    full = tensors.get(f"lokr_w{which}")
    if full is None:
        return tensors[f"lokr_w{which}_a"], tensors[f"lokr_w{which}_b"]
    rows, cols = full.shape
    if cols <= rows:
        return full, torch.eye(cols, dtype=full.dtype)
    return torch.eye(rows, dtype=full.dtype), full
