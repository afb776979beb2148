"""GenericOptim's parts, each against a direct fp64 computation of its formula (the optimizer runs in
fp32, hence the tolerances)."""

from __future__ import annotations

import math

import pytest
import torch

from tuner.optimizers.generic import (
    POLAR_EXPRESS,
    GenericOptim,
    clip_top_rows,
    hadamard,
    polar_express,
    projection,
)

F64 = torch.float64


def _grads(shape, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) for _ in range(n)]


def _run(shape, grads, **kwargs):
    start = torch.randn(shape, generator=torch.Generator().manual_seed(9))
    p = torch.nn.Parameter(start.clone())
    opt = GenericOptim([p], lr=0.01, **kwargs)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    return start.to(F64), p.detach().to(F64), opt


def test_full_second_moment_is_adamw():
    grads = _grads((6, 4), 3)
    w, got, _ = _run((6, 4), grads, weight_decay=0.1)
    m = v = torch.zeros(6, 4, dtype=F64)
    for t, g in enumerate(grads, 1):
        g = g.to(F64)
        m, v = 0.9 * m + 0.1 * g, 0.999 * v + 0.001 * g * g
        w = w - 0.01 * ((m / (1 - 0.9**t)) / ((v / (1 - 0.999**t)).sqrt() + 1e-8) + 0.1 * w)
    torch.testing.assert_close(got, w, rtol=1e-5, atol=1e-6)


def test_factored_second_moment():
    grads = _grads((6, 4), 3)
    w, got, opt = _run((6, 4), grads, second_moment="factored")
    m, row, col = torch.zeros(6, 4, dtype=F64), torch.zeros(6, dtype=F64), torch.zeros(4, dtype=F64)
    for t, g in enumerate(grads, 1):
        g = g.to(F64)
        m = 0.9 * m + 0.1 * g
        row, col = 0.999 * row + 0.001 * (g * g).mean(1), 0.999 * col + 0.001 * (g * g).mean(0)
        v = row[:, None] * col[None, :] / row.mean()
        w = w - 0.01 * (m / (1 - 0.9**t)) / ((v / (1 - 0.999**t)).sqrt() + 1e-8)
    torch.testing.assert_close(got, w, rtol=1e-5, atol=1e-6)
    state = next(iter(opt.state.values()))
    # kept for the transposed 4 × 6 view (the shorter side first): 4 + 6 numbers instead of 24
    assert "v" not in state and state["row"].shape == (4,) and state["col"].shape == (6,)


def test_no_second_moment_steps_along_the_momentum():
    grads = _grads((5,), 2)
    w, got, _ = _run((5,), grads, second_moment="none")
    m = torch.zeros(5, dtype=F64)
    for t, g in enumerate(grads, 1):
        m = 0.9 * m + 0.1 * g.to(F64)
        w = w - 0.01 * m / (1 - 0.9**t)
    torch.testing.assert_close(got, w, rtol=1e-5, atol=1e-6)


def test_polar_express_follows_its_iteration_and_orthogonalizes():
    u = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    x = u.to(F64) / (u.to(F64).norm() * 1.01 + 1e-7)
    for a, b, c in POLAR_EXPRESS:
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    got = polar_express(u)
    torch.testing.assert_close(got.to(F64), x, rtol=1e-4, atol=1e-4)
    singular = torch.linalg.svdvals(got.to(F64))
    assert singular.min() > 0.6 and singular.max() < 1.25, singular  # all near 1, as the SVD's U Vᵀ
    assert polar_express(u.T).shape == (16, 8)


def test_orthogonalized_updates_use_muons_scale():
    grads = _grads((16, 8), 1)
    w, got, _ = _run((16, 8), grads, second_moment="none", orthogonalize=True)
    direction = polar_express(grads[0] * 0.1 / 0.1)  # m̂ = g after one step
    expected = w - 0.01 * direction.to(F64) * math.sqrt(16 / 8)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def test_srht_projection_is_d_h_transposed_s_transposed():
    g = torch.Generator().manual_seed(3)
    p = projection("srht", torch.zeros(16, 40), 4, torch.Generator().manual_seed(3))
    signs = torch.randint(0, 2, (16,), generator=g).to(F64) * 2 - 1
    rows = torch.randperm(16, generator=g)[:4]
    expected = (torch.diag(signs) @ hadamard(16, F64).T)[:, rows]
    torch.testing.assert_close(p.to(F64), expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(p.T @ p, torch.eye(4), rtol=0, atol=1e-5)
    assert hadamard(4).T @ hadamard(4) == pytest.approx(torch.eye(4))  # orthonormal
    odd = projection(
        "srht", torch.zeros(12, 40), 4, torch.Generator().manual_seed(3)
    )  # 12: cut and re-orthonormalized
    torch.testing.assert_close(odd.T @ odd, torch.eye(4), rtol=0, atol=1e-5)


def test_galore_projection_spans_the_top_singular_vectors():
    grad = torch.randn(10, 30, generator=torch.Generator().manual_seed(4))
    p = projection("galore", grad, 3, torch.Generator())
    u = torch.linalg.svd(grad.to(F64), full_matrices=False)[0][:, :3]
    torch.testing.assert_close((p.to(F64).T @ u).abs(), torch.eye(3, dtype=F64), rtol=0, atol=1e-5)
    gauss = projection("gaussian", grad, 3, torch.Generator().manual_seed(0))
    torch.testing.assert_close(gauss.T @ gauss, torch.eye(3), rtol=0, atol=1e-5)


@pytest.mark.parametrize("kind", ["gaussian", "srht", "galore"])
def test_subspace_momentum_follows_its_formula(kind):
    """Momentum and second moment of PᵀG; the update is P · direction; P refreshed every 2 steps with the
    momentum carried over as P_newᵀ P_old M. The parameter is 12 × 20 (projected on its 12 rows)."""
    grads = _grads((12, 20), 4)
    w, got, opt = _run((12, 20), grads, subspace=kind, rank=3, update_every=2)
    m = v = None
    proj = None
    for t, g in enumerate(grads, 1):
        g = g.to(F64)
        if (t - 1) % 2 == 0:
            gen = torch.Generator().manual_seed((t - 1) // 2)
            new = projection(kind, g.float(), 3, gen).to(F64)
            m = torch.zeros(3, 20, dtype=F64) if m is None else new.T @ (proj @ m)
            v = torch.zeros(3, 20, dtype=F64) if v is None else v
            proj = new
        low = proj.T @ g
        m, v = 0.9 * m + 0.1 * low, 0.999 * v + 0.001 * low * low
        w = w - 0.01 * proj @ ((m / (1 - 0.9**t)) / ((v / (1 - 0.999**t)).sqrt() + 1e-8))
    torch.testing.assert_close(got, w, rtol=1e-4, atol=1e-5)
    assert next(iter(opt.state.values()))["m"].shape == (3, 20)


def test_topk_clipping_caps_the_largest_rows():
    update = torch.tensor([[3.0, 4.0], [0.0, 1.0], [6.0, 8.0], [0.0, 2.0]])  # row norms 5, 1, 10, 2
    clipped = clip_top_rows(update, 0.5)  # the top half are rows 2 and 0; the smaller of them is 5
    torch.testing.assert_close(clipped.norm(dim=1), torch.tensor([5.0, 1.0, 5.0, 2.0]))
    torch.testing.assert_close(clipped[2], update[2] / 2)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="second_moment must be one of full, factored, none"):
        GenericOptim([torch.nn.Parameter(torch.ones(2))], second_moment="diagonal")
    with pytest.raises(ValueError, match="subspace must be one of none, gaussian, srht, galore"):
        GenericOptim([torch.nn.Parameter(torch.ones(2))], subspace="svd")
