"""Low-rank linear algebra shared by the SVD-family methods (SVD, SVD-LLM, Basis Sharing).

Conventions: weights are (out_features, in_features) as in ``nn.Linear``; a Gram matrix is
G = XᵀX of a layer's inputs (in, in). A rank-k factorisation W ≈ C·B has a basis
B (k, in) and coefficients C (out, k). Everything runs in float64 on the device of the
inputs (the sums of 16-bit batches: see ``product_dtype``); callers cast the factors back to
the model's dtype at the end.
"""

from __future__ import annotations

import math

import torch

from .. import kernels
from ..errors import UsageError, need


def rank_for_ratio(d_in: int, d_out: int, ratio: float, n: int = 1) -> int:
    """Rank k that removes ``ratio`` of the parameters of ``n`` (d_out, d_in) matrices sharing
    one basis: k·(d_in + n·d_out) = (1 - ratio)·n·d_in·d_out (Basis Sharing, eq. 6)."""
    if not 0 < ratio < 1:
        raise UsageError(f"ratio {ratio} is outside (0, 1)", "give the fraction of parameters to remove, e.g. ratio: 0.2")
    k = math.floor((1 - ratio) * n * d_in * d_out / (d_in + n * d_out))
    if k < 1:
        raise UsageError(f"ratio {ratio} leaves no rank for a {d_out}x{d_in} matrix", "use a smaller ratio")
    return k


def gram(x: torch.Tensor) -> torch.Tensor:
    """XᵀX (float64) of x (tokens, d)."""
    return symmetrize(add_gram(None, x))


def product_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a batch's XᵀX or XᵀY is formed in before it joins a float64 sum: float32 for
    16-bit inputs (a product of two bfloat16/float16 numbers is exact in float32, so only the
    sum over one batch rounds, ~1e-7 relative, four orders below the inputs' own rounding, at
    twice float64's speed), float64 for the others."""
    return torch.float32 if x.dtype in (torch.bfloat16, torch.float16) else torch.float64


def add_gram(acc: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    """``acc`` (d, d) float64, or a new zero one, plus the lower triangle of XᵀX, in place,
    the batch's product formed in ``product_dtype(x)``: on the CPU by the compiled bfloat16
    kernel (``kernels/products.cpp``) or the BLAS's symmetric rank-k update (half the work of
    the full product), elsewhere by the full product. ``symmetrize`` completes the sum."""
    if acc is None:
        acc = torch.zeros(x.shape[1], x.shape[1], dtype=torch.float64, device=x.device)
    if (module := _products(x)) is not None and acc.is_contiguous():
        module.add_gram(acc, x.detach().contiguous())
        return acc
    x = x.to(product_dtype(x))
    if x.device.type != "cpu":
        return acc.add_(x.T @ x)
    blas = need("scipy.linalg.blas", "compress", "calibration (the Gram matrices)")
    x = x.detach().numpy().T
    if x.dtype == "float64":  # acc's transpose, as numpy sees it, is Fortran-ordered: its upper (= acc's lower) triangle is updated in place
        blas.dsyrk(1.0, x, beta=1.0, c=acc.numpy().T, overwrite_c=1)
        return acc
    part = torch.zeros_like(acc, dtype=torch.float32)
    blas.ssyrk(1.0, x, beta=0.0, c=part.numpy().T, overwrite_c=1)
    return acc.add_(part)


def add_product(acc: torch.Tensor | None, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``acc`` (float64), or a new one, plus XᵀY, in place, formed in ``product_dtype``."""
    if (module := _products(x)) is not None and y.dtype == x.dtype and y.device == x.device \
            and (acc is None or acc.is_contiguous()):
        acc = torch.zeros(x.shape[1], y.shape[1], dtype=torch.float64) if acc is None else acc
        module.add_product(acc, x.detach().contiguous(), y.detach().contiguous())
        return acc
    dtype = product_dtype(x) if product_dtype(y) == product_dtype(x) else torch.float64
    part = x.to(dtype).T @ y.to(dtype)
    return part.double() if acc is None else acc.add_(part)


def _products(x: torch.Tensor):
    """The compiled bfloat16 products where they apply (bfloat16 on the CPU, the kernel built
    with AVX-512 BF16), else None."""
    return kernels.products() if x.dtype == torch.bfloat16 and x.device.type == "cpu" else None


def symmetrize(acc: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """Copy the lower triangle of ``acc`` onto its upper one, in place, a block at a time."""
    for a in range(0, acc.shape[0], block):
        b = min(a + block, acc.shape[0])
        acc[a:b, b:] = acc[b:, a:b].T
        acc[a:b, a:b] = acc[a:b, a:b].tril() + acc[a:b, a:b].tril(-1).T
    return acc


def whitening(gram: torch.Tensor) -> tuple[torch.Tensor, str]:
    """Lower-triangular S with S·Sᵀ = G (Cholesky, float64), and how it was obtained.

    A Gram matrix that is not positive definite (dead input features, fewer calibration
    tokens than features) gets its diagonal shifted by |λ_min| plus a small fraction of its
    mean diagonal, which keeps S invertible; the second value says "cholesky" or "shifted".
    """
    g = gram.double()
    s, info = torch.linalg.cholesky_ex(g)
    if int(info) == 0:
        return s, "cholesky"
    lam_min = torch.linalg.eigvalsh(g)[0].item()
    scale = max(g.diagonal().mean().item(), 1e-12)
    shift = max(-lam_min, 0.0) + 1e-6 * scale
    while True:  # the shift is enough in exact arithmetic; round-off may need a little more
        s, info = torch.linalg.cholesky_ex(g + shift * torch.eye(g.shape[0], dtype=g.dtype, device=g.device))
        if int(info) == 0:
            return s, "shifted"
        shift *= 10


def principal_factors(a: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(L (m, k), R (k, n)) with L·R the best rank-k approximation of ``a`` (truncated SVD), float64.

    Computed from the eigendecomposition of the smaller of AᵀA / AAᵀ, which is several times
    faster than an SVD on CPU; in float64 it resolves singular values down to ~1e-8·σ₁, far
    below any a truncation keeps. No singular value is ever divided by: L = A·V_k, R = V_kᵀ
    (tall a) or L = U_k, R = U_kᵀ·A (wide a), so L·R is an exact projection of a.
    """
    a = a.double()
    if a.shape[0] >= a.shape[1]:
        v = torch.linalg.eigh(a.T @ a).eigenvectors[:, -k:].flip(1)  # eigenvalues ascend
        return a @ v, v.T
    u = torch.linalg.eigh(a @ a.T).eigenvectors[:, -k:].flip(1)
    return u, u.T @ a


def low_rank(w: torch.Tensor, k: int, gram: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, str]:
    """Rank-k factors (C (out, k), B (k, in)) of ``w`` ≈ C·B, float64.

    Without a Gram matrix this is the plain truncated SVD (optimal in ‖W - CB‖_F). With one it
    is SVD-LLM's whitened truncation, optimal for the output error ‖(W - CB)Xᵀ‖_F: the best
    rank-k approximation of W·Xᵀ is P·W·Xᵀ, P the projection on the top k eigenvectors U of
    W·G·Wᵀ (G = XᵀX), so C = U and B = Uᵀ·W. For a wide W (out ≤ in) that small matrix is
    used directly, with no Cholesky factor of the larger G (a 5632² one is 250 MB); for a tall
    W it is the truncated SVD of W·S, S·Sᵀ = G (the Cholesky factor, now the smaller side),
    and B = B_S·S⁻¹: the same projection. The last value names the route ("none", "projection",
    "cholesky" or "shifted"). ``w`` may be several layers' weights stacked along the output
    dimension: their shared basis B comes out the same way.
    """
    k = min(k, *w.shape)
    w = w.double()
    if gram is None:
        return (*balanced(*principal_factors(w, k)), "none")
    if w.shape[0] <= w.shape[1]:
        wg = w @ gram.to(w.device).double()
        del gram  # the caller's copy may be its only other reference
        u = torch.linalg.eigh(wg @ w.T).eigenvectors[:, -k:].flip(1)  # eigenvalues ascend
        del wg
        return (*balanced(u, u.T @ w), "projection")
    s, how = whitening(gram.to(w.device))
    del gram
    coeff, right = principal_factors(w @ s, k)
    basis = torch.linalg.solve_triangular(s, right, upper=False, left=False)  # right·S⁻¹ without forming S⁻¹
    return (*balanced(coeff, basis), how)


def truncation_by_iteration(w: torch.Tensor, k: int, gram: torch.Tensor, start: torch.Tensor,
                            steps: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``low_rank(w, k, gram)``'s factors by block subspace iteration, for a solver that
    truncates a slowly changing matrix many times: the top eigenvectors of W·G·Wᵀ are refined
    from ``start`` (out, p ≥ k independent columns: the previous call's last value, or random)
    by ``steps`` products W·(G·(Wᵀ·Q)), then taken by Rayleigh-Ritz in that p-dimensional
    subspace. A step costs (2·out·in + in²)·p multiply-adds against low_rank's out·in², and
    forms no new out × out or in × in matrix. Exact when p = out. Returns the balanced factors
    and the Ritz vectors (descending) to start the next call from. Float64."""
    w, gram = w.double(), gram.double()
    q = torch.linalg.qr(start.double()).Q
    for _ in range(steps):
        q = torch.linalg.qr(w @ (gram @ (q.T @ w).T)).Q
    right = q.T @ w
    z = torch.linalg.eigh(right @ gram @ right.T).eigenvectors.flip(1)  # descending
    u = q @ z[:, :k]
    return (*balanced(u, z[:, :k].T @ right), q @ z)


def balanced(coeff: torch.Tensor, basis: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The same product C·B with each rank component's column of C and row of B of equal norm
    (U·Σ^½, Σ^½·Vᵀ rather than U·Σ, Vᵀ): whitened bases can be orders of magnitude smaller than
    their coefficients, and a fine-tuning step (Adam's above all) must not move both alike.
    Each component's sign is fixed too (the largest entry of its basis row positive), so the
    factors do not depend on which eigensolver route produced them (a later k-means sees them)."""
    scale = (coeff.norm(dim=0) / basis.norm(dim=1).clamp_min(1e-30)).clamp_min(1e-30).sqrt()
    sign = basis.gather(1, basis.abs().argmax(1, keepdim=True))[:, 0].sign()
    scale = scale * torch.where(sign == 0, 1.0, sign)
    return coeff / scale, basis * scale[:, None]


def refit_coefficients(w: torch.Tensor, basis: torch.Tensor, gram: torch.Tensor, cross: torch.Tensor | None = None,
                       ridge: float = 0.0, prior: torch.Tensor | None = None) -> torch.Tensor:
    """Coefficients C of a fixed basis B such that the compressed layer fed X' best reproduces
    the original weight W fed X: argmin ‖X'·Bᵀ·Cᵀ - X·Wᵀ‖² + λ‖C - C₀‖², i.e.
    (W·XᵀX'·Bᵀ + λ·C₀)·(B·X'ᵀX'·Bᵀ + λ·I)⁻¹, given ``gram`` = X'ᵀX' and ``cross`` = XᵀX'
    (default X = X'); see ``solve_coefficients`` for λ. Float64."""
    w, basis, gram = w.double(), basis.double(), gram.to(w.device).double()
    gb = gram @ basis.T  # (in, k): shared by both products, and cheaper first than W·G (out ≥ k)
    r = w @ (gb if cross is None else cross.to(w.device).double() @ basis.T)
    return solve_coefficients(basis @ gb, r, ridge, prior)


def ridged(a: torch.Tensor, ridge: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(A + λ·I, λ) with λ = ``ridge`` · tr(A)/k: a ridge least-squares loss's quadratic form.
    A tiny floor keeps a rank-deficient solve defined."""
    lam = max(ridge, 1e-10) * a.diagonal().mean().clamp_min(1e-12)
    return a + lam * torch.eye(a.shape[0], dtype=a.dtype, device=a.device), lam


def solve_coefficients(a: torch.Tensor, r: torch.Tensor, ridge: float = 0.0, prior: torch.Tensor | None = None) -> torch.Tensor:
    """C = (R + λ·C₀)·(A + λ·I)⁻¹ from the normal equations of a coefficient refit,
    A = B·X'ᵀX'·Bᵀ (k, k) and R = W·XᵀX'·Bᵀ (out, k). λ (``ridged``) pulls toward ``prior`` C₀
    (default 0)."""
    a, lam = ridged(a.double(), ridge)
    r = r.double()
    if prior is not None:
        r = r + lam * prior.double()
    return torch.linalg.solve(a, r.T).T
