"""GenericOptim: one optimizer whose parts are chosen by arguments.

Adam is momentum, a per-element second moment and a step. Each part has alternatives that trade memory or
conditioning, and they combine; this optimizer takes them as arguments, for every parameter:

**Second moment** (`second_moment`): `"full"` keeps v = EMA(g²) per element (Adam); `"factored"` keeps,
for a matrix, an EMA of the row means and of the column means of g² and uses row ⊗ col / mean(row) in
its place (Adafactor: n + m numbers instead of n · m; vectors keep the full form); `"none"` steps along
the momentum itself (what Muon does before orthogonalizing). Bias-corrected: m̂ = m / (1 − β1ᵗ),
v̂ = v / (1 − β2ᵗ); the direction is m̂ / (√v̂ + eps).

**Momentum in a subspace** (`subspace`, `rank`, `update_every`): for a matrix G (n × m, n ≤ m after a
transpose), momentum and second moment are kept for PᵀG (rank × m) instead of G, with P an n × rank
matrix of orthonormal columns refreshed every `update_every` steps (the momentum is carried over as
P_newᵀ P_old M; the second moment carries over as it is, as in GaLore). The update is P · direction. Choices of P:
- `"gaussian"`: the Q of a QR of an n × rank standard Gaussian matrix (a random subspace);
- `"srht"`: a subsampled randomized Hadamard transform, P = D Hᵀ Sᵀ (D random ±1 on the diagonal, H the
  orthonormal Walsh-Hadamard matrix of the next power of two, S `rank` random distinct rows), cut to n
  rows and re-orthonormalized when n is not a power of two: a random subspace applied in O(n log n);
- `"galore"`: the top-`rank` left singular vectors of the current gradient (GaLore, Zhao et al. 2024):
  the subspace the gradient actually lives in.
Matrices with n ≤ rank, and vectors, keep full-size state.

**Orthogonalized updates** (`orthogonalize`): a matrix direction U is replaced by the nearest
semi-orthogonal matrix, UV ᵀ of its SVD (all singular values set to one), as Muon does; approximated by
the Polar Express iteration (Amsel, Persson, Musco, Gower 2025): X₀ = U / (1.01 ‖U‖_F), then
Xₖ₊₁ = aₖ Xₖ + (bₖ A + cₖ A²) Xₖ with A = Xₖ Xₖᵀ, with coefficients chosen per step to be minimax-optimal
(the classic Newton-Schulz iteration uses one fixed triple and converges slower). The result is scaled
by √max(1, rows / cols), Muon's rule that keeps the update's RMS independent of the shape.

**Top-k norm clipping** (`topk_clip`): for a matrix update, the row norms above the norm of the
`topk_clip` fraction of largest rows' smallest member are scaled down to it, so a few outlier rows
cannot dominate a step (0 disables).

The update is p ← p − lr · (update + weight_decay · p). State per matrix element: 4 bytes of momentum
(rank/n of that in a subspace) and 4 of second moment with `"full"` (none with `"factored"`/`"none"`).
"""

from __future__ import annotations

import math

import torch

from tuner.optimizers import PerParameter

# Polar Express coefficients (a, b, c) per iteration, from the paper (degree-5 polynomials, for inputs
# scaled by 1.01 · Frobenius norm); iterations past the list reuse the last triple
POLAR_EXPRESS = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)
SECOND_MOMENTS = ("full", "factored", "none")
SUBSPACES = ("none", "gaussian", "srht", "galore")


def polar_express(u: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """The nearest semi-orthogonal matrix to `u` (approximately: its singular values mapped near 1)."""
    transpose = u.shape[0] > u.shape[1]
    x = u.T if transpose else u
    x = x / (x.norm() * 1.01 + 1e-7)
    for k in range(steps):
        a, b, c = POLAR_EXPRESS[min(k, len(POLAR_EXPRESS) - 1)]
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if transpose else x


def hadamard(n: int, dtype=torch.float32) -> torch.Tensor:
    """The orthonormal n × n Walsh-Hadamard matrix (n a power of two)."""
    h = torch.ones(1, 1, dtype=dtype)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(n)


def projection(kind: str, grad: torch.Tensor, rank: int, generator: torch.Generator) -> torch.Tensor:
    """An n × rank matrix with orthonormal columns for an n × m gradient (see the module docstring)."""
    n = grad.shape[0]
    if kind == "galore":
        u, _, _ = torch.linalg.svd(grad.float(), full_matrices=False)
        return u[:, :rank].contiguous()
    if kind == "gaussian":
        q, _ = torch.linalg.qr(torch.randn(n, rank, generator=generator))
        return q
    if kind == "srht":
        size = 1 << (n - 1).bit_length()
        signs = torch.randint(0, 2, (size,), generator=generator).float() * 2 - 1
        rows = torch.randperm(size, generator=generator)[:rank]
        p = (signs[:, None] * hadamard(size).T)[:, rows][:n]  # D Hᵀ Sᵀ, first n rows
        return p if size == n else torch.linalg.qr(p)[0]
    raise ValueError(f"unknown subspace {kind!r}; choose one of {', '.join(SUBSPACES)}")


def clip_top_rows(update: torch.Tensor, fraction: float) -> torch.Tensor:
    """Scale the rows whose norm is above that of the smallest of the largest `fraction` of rows down
    to it."""
    norms = update.norm(dim=1)
    k = max(1, math.ceil(fraction * norms.numel()))
    limit = norms.topk(k).values[-1]
    return update * (limit / norms.clamp(min=1e-30)).clamp(max=1.0)[:, None]


class GenericOptim(PerParameter):
    def __init__(
        self,
        params,
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        second_moment: str = "full",
        subspace: str = "none",
        rank: int = 32,
        update_every: int = 200,
        orthogonalize: bool = False,
        ortho_steps: int = 5,
        topk_clip: float = 0.0,
        seed: int = 0,
    ):
        if second_moment not in SECOND_MOMENTS:
            raise ValueError(
                f"second_moment must be one of {', '.join(SECOND_MOMENTS)}, got {second_moment!r}"
            )
        if subspace not in SUBSPACES:
            raise ValueError(f"subspace must be one of {', '.join(SUBSPACES)}, got {subspace!r}")
        if rank < 1 or update_every < 1 or ortho_steps < 1 or not 0 <= topk_clip <= 1:
            raise ValueError(
                "GenericOptim needs rank, update_every, ortho_steps >= 1 and 0 <= topk_clip <= 1"
            )
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, second_moment=second_moment,
                        subspace=subspace, rank=rank, update_every=update_every, orthogonalize=orthogonalize,
                        ortho_steps=ortho_steps, topk_clip=topk_clip, seed=seed)  # fmt: skip
        super().__init__(params, defaults)
        self._index = {p: i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}

    def _step_one(self, p: torch.Tensor, group: dict) -> None:
        beta1, beta2 = group["betas"]
        g = p.grad.float()
        matrix = g.ndim == 2
        transpose = matrix and g.shape[0] > g.shape[1]
        if transpose:
            g = g.T  # n ≤ m: project the shorter side
        state = self.state[p]
        use_subspace = matrix and group["subspace"] != "none" and g.shape[0] > group["rank"]
        step = int(state.get("step", 0)) + 1
        if use_subspace and (step - 1) % group["update_every"] == 0:
            refresh = (step - 1) // group["update_every"]
            generator = torch.Generator().manual_seed(
                group["seed"] * 1_000_003 + self._index[p] * 7919 + refresh
            )
            new = projection(group["subspace"], g, group["rank"], generator).to(g.device)
            if "projection" in state:  # carry the momentum over into the new subspace
                state["m"] = new.T @ (state["projection"] @ state["m"])
            state["projection"] = new
        low = state["projection"].T @ g if use_subspace else g
        if "m" not in state:
            state["m"] = torch.zeros_like(low)
        state["step"] = torch.tensor(float(step))
        m = state["m"].lerp_(low, 1 - beta1)
        direction = m / (1 - beta1**step)
        mode = group["second_moment"] if (low.ndim == 2 or group["second_moment"] != "factored") else "full"
        if mode == "full":
            v = state.setdefault("v", torch.zeros_like(low)).lerp_(low * low, 1 - beta2)
            direction = direction / ((v / (1 - beta2**step)).sqrt() + group["eps"])
        elif mode == "factored":
            sq = low * low
            row = state.setdefault("row", torch.zeros(low.shape[0], device=low.device)).lerp_(
                sq.mean(1), 1 - beta2
            )
            col = state.setdefault("col", torch.zeros(low.shape[1], device=low.device)).lerp_(
                sq.mean(0), 1 - beta2
            )
            v = row[:, None] * col[None, :] / row.mean().clamp(min=1e-30)
            direction = direction / ((v / (1 - beta2**step)).sqrt() + group["eps"])
        if group["orthogonalize"] and direction.ndim == 2:
            # Muon's scale: √max(1, rows / cols) of the parameter, whatever space the direction is in
            direction = polar_express(direction, group["ortho_steps"]) * math.sqrt(
                max(1.0, p.shape[0] / p.shape[1])
            )
        update = state["projection"] @ direction if use_subspace else direction
        if transpose:
            update = update.T
        if group["topk_clip"] and update.ndim == 2:
            update = clip_top_rows(update, group["topk_clip"])
        w = p.float()
        p.copy_(w - group["lr"] * (update + group["weight_decay"] * w))
