"""Basis computation for GaLore: exact SVD, randomized range finder, similarity, moment transport.

Pure math on plain tensors; no module state. The layer code (`layers/`) decides when to call it.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

Reduce = Callable[[torch.Tensor], torch.Tensor]

__all__ = [
    "BasisError",
    "resolve_sides",
    "compute_basis",
    "basis_from_sketch",
    "subspace_similarity",
    "transport_matrix",
]


class BasisError(RuntimeError):
    """A basis could not be computed (non-finite gradient, SVD that did not converge)."""


def resolve_sides(proj_type: str, out_features: int, in_features: int) -> tuple[bool, bool]:
    """Which bases a layer of shape (out, in) = (m, n) keeps: (left P: m x r, right Q: n x r).

    'std' projects on the right when m >= n (so the basis is the smaller n x r matrix), as the GaLore
    paper and galore-torch do; 'reverse_std' the other way round; 'full' keeps both.
    """
    m, n = out_features, in_features
    if proj_type == "std":
        return (False, True) if m >= n else (True, False)
    if proj_type == "reverse_std":
        return (True, False) if m >= n else (False, True)
    if proj_type == "left":
        return True, False
    if proj_type == "right":
        return False, True
    if proj_type == "full":
        return True, True
    raise ValueError(f"unknown proj_type {proj_type!r}; choose one of std, reverse_std, left, right, full")


def _top_left_singular_vectors_svd(matrix: torch.Tensor, rank: int) -> torch.Tensor:
    u, _, _ = torch.linalg.svd(matrix, full_matrices=False)
    return u[:, :rank]


def _top_left_singular_vectors_randomized(
    matrix: torch.Tensor,
    rank: int,
    *,
    oversampling: int,
    power_iterations: int,
    generator: torch.Generator,
    reduce: Optional[Reduce] = None,
) -> torch.Tensor:
    # Halko, Martinsson & Tropp 2011, Algorithms 4.3/4.4 + 5.1: sketch the range with a Gaussian test
    # matrix, re-orthonormalize between power iterations (plain powers lose the small directions to
    # round-off), then an exact SVD of the small (k x n) projection picks the top `rank` directions.
    #
    # Every use of `matrix` is a product with it, linear in it: when the true matrix is the mean of
    # one local matrix per data-parallel rank, `reduce` (an all-reduce mean) applied to each product
    # gives the product of the mean matrix. Ranks then exchange (m + n) x k sketches per power
    # iteration instead of the m x n gradient, and compute identical bases (same test matrix from the
    # same seeded generator, same reduced sketches, same deterministic QR).
    product = (lambda t: _checked(reduce(t))) if reduce is not None else (lambda t: t)
    m, n = matrix.shape
    k = min(rank + oversampling, m, n)
    omega = torch.randn(n, k, generator=generator, device=generator.device, dtype=torch.float32)
    omega = omega.to(matrix.device)
    basis, _ = torch.linalg.qr(product(matrix @ omega))
    for _ in range(power_iterations):
        basis, _ = torch.linalg.qr(product(matrix.mT @ basis))
        basis, _ = torch.linalg.qr(product(matrix @ basis))
    small = product(basis.mT @ matrix)  # k x n
    u_small, _, _ = torch.linalg.svd(small, full_matrices=False)
    return basis @ u_small[:, :rank]


def _checked(sketch: torch.Tensor) -> torch.Tensor:
    # After a reduction every rank holds the same sketch, so every rank raises (or none does): a check
    # of the local matrix instead could stop one rank and leave the others waiting in a collective.
    if not bool(torch.isfinite(sketch).all()):
        raise BasisError("the reduced gradient sketch has non-finite values")
    return sketch


def compute_basis(
    grad: torch.Tensor,
    *,
    side: str,
    rank: int,
    method: str = "svd",
    oversampling: int = 8,
    power_iterations: int = 1,
    generator: Optional[torch.Generator] = None,
    reduce: Optional[Reduce] = None,
) -> torch.Tensor:
    """Orthonormal basis of the top-`rank` singular subspace of `grad` (m x n), in fp32.

    side='left' returns P (m x rank), the top left singular vectors; side='right' returns
    Q (n x rank), the top right singular vectors. Raises :class:`BasisError` on non-finite input or
    when the decomposition fails; callers keep their old basis then.

    `reduce` (method='randomized' only) makes `grad` one rank's share of a gradient averaged over
    data-parallel ranks: each sketch is passed through it (an all-reduce mean) before use, so only
    sketches travel. The non-finite check then runs on the reduced sketches, identically on all ranks.
    """
    if grad.ndim != 2:
        raise ValueError(f"compute_basis expects a 2-D gradient, got shape {tuple(grad.shape)}")
    if side not in ("left", "right"):
        raise ValueError(f"side must be 'left' or 'right', got {side!r}")
    # SVD of bf16/fp16 is unsupported on some backends and inaccurate everywhere: always fp32.
    matrix = grad.detach().to(torch.float32)
    if side == "right":
        matrix = matrix.mT
    if reduce is not None and method != "randomized":
        raise ValueError("reduce= needs method='randomized' (an exact SVD needs the whole reduced gradient)")
    if reduce is None and not bool(torch.isfinite(matrix).all()):
        bad = int((~torch.isfinite(matrix)).sum())
        raise BasisError(f"gradient has {bad} non-finite values")
    if rank > min(matrix.shape):
        raise ValueError(f"rank {rank} exceeds the smaller side of the gradient {tuple(grad.shape)}")
    try:
        if method == "svd":
            basis = _top_left_singular_vectors_svd(matrix, rank)
        elif method == "randomized":
            if generator is None:
                raise ValueError("method='randomized' needs a torch.Generator for its test matrix")
            basis = _top_left_singular_vectors_randomized(
                matrix,
                rank,
                oversampling=oversampling,
                power_iterations=power_iterations,
                generator=generator,
                reduce=reduce,
            )
        else:
            raise ValueError(f"unknown basis method {method!r}; choose 'svd' or 'randomized'")
    except torch.linalg.LinAlgError as exc:  # e.g. "The algorithm failed to converge"
        raise BasisError(f"decomposition failed: {exc}") from exc
    if not bool(torch.isfinite(basis).all()):
        raise BasisError("decomposition returned non-finite values")
    return basis.contiguous()


def subspace_similarity(old: torch.Tensor, new: torch.Tensor) -> float:
    """Mean squared cosine of the principal angles between two orthonormal bases (d x r): in [0, 1].

    1 means the same subspace; r/d is the expected value for unrelated random subspaces. Unlike the
    cosine of flattened matrices it ignores the arbitrary signs and order of singular vectors.
    """
    overlap = old.to(torch.float32).mT @ new.to(torch.float32)
    return float(overlap.square().sum() / min(old.shape[1], new.shape[1]))


def transport_matrix(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """T = old^T new (r x r): coordinates in `old` times T are the same vector's coordinates in `new`."""
    return old.to(torch.float32).mT @ new.to(torch.float32)


def basis_from_sketch(sketch: torch.Tensor, *, rank: int) -> torch.Tensor:
    """Orthonormal basis (d x rank, fp32) of the top-`rank` singular subspace of a streaming sketch.

    `sketch` (d x k, k >= rank) is Y = A Omega for a Gaussian test matrix Omega (k columns), A the
    matrix whose column space is wanted (G for a left basis, G^T for a right one). Single-pass range
    finder (Halko, Martinsson & Tropp 2011, Sec. 4.1 and 5.5): the range of Y approximates the range of
    A; keeping its top `rank` left singular vectors picks, among its k directions, the ones of largest
    energy (E[Y Y^T] = k A A^T, so they estimate A's top singular vectors). Raises :class:`BasisError`
    on non-finite input or a failed decomposition.
    """
    if sketch.ndim != 2:
        raise ValueError(f"basis_from_sketch expects a 2-D sketch, got shape {tuple(sketch.shape)}")
    if rank > sketch.shape[1]:
        raise ValueError(f"rank {rank} exceeds the sketch's {sketch.shape[1]} columns (rank + oversampling)")
    matrix = sketch.detach().to(torch.float32)
    if not bool(torch.isfinite(matrix).all()):
        raise BasisError(f"gradient sketch has {int((~torch.isfinite(matrix)).sum())} non-finite values")
    try:
        u, _, _ = torch.linalg.svd(matrix, full_matrices=False)
    except torch.linalg.LinAlgError as exc:
        raise BasisError(f"decomposition failed: {exc}") from exc
    basis = u[:, :rank]
    if not bool(torch.isfinite(basis).all()):
        raise BasisError("decomposition returned non-finite values")
    return basis.contiguous()
