"""Tolerances for numbers computed on another machine (a fixture, a pinned value) or by another sequence of
float operations, derived from the operations.

Two x86-64 CPUs run the same fp32 code through different kernels: MKL picks its GEMM and LAPACK code path
by instruction set (AVX-512, AVX2, SSE4.2), ATen vectorizes elementwise ops and reductions by it, and
oneDNN and numpy dispatch likewise. Each path sums in its own order, so results agree up to the rounding
error bounds of the operations, not bit for bit (docs/contributing.md, "The test suite", selects other CPUs'
paths on one machine). Bit for bit is kept where both sides run on the same machine through the same code
(a save/load round trip, a resume against an uninterrupted run).
"""

from __future__ import annotations

import torch

EPS32 = torch.finfo(torch.float32).eps  # 2^-23: one rounding moves a value by at most eps/2 of it


def dot_tolerance(magnitude, length: int, *, eps: float = EPS32):
    """How far two computations (two machines, or two summation orders) of fp32 dot products of `length`
    terms may be apart: each is within gamma_length sum |a_i b_i| <= length * eps * sum |a_i b_i| of the
    exact value (Higham, "Accuracy and Stability of Numerical Algorithms", 2nd ed., section 3.1; gamma_k =
    k u / (1 - k u), u = eps / 2), so within twice that of each other. `magnitude`: sum |a_i b_i| (``|A| @ |B|``
    for a matrix product), a number or a tensor."""
    return 2 * length * eps * magnitude


def singular_vector_tolerance(matrix: torch.Tensor, rank: int, *, rounding: float) -> torch.Tensor:
    """Bound on how far each of the top-`rank` left singular vectors (unit columns) of `matrix` (m x n) may
    move between two machines whose copies of `matrix` differ by at most `rounding` * ||matrix||_2.

    Each machine's SVD is backward stable: what it returns is the exact SVD of A + E, ||E||_2 <=
    p(m, n) eps ||A||_2 (LAPACK Users' Guide, 3rd ed., section 4.9), taken here with p = max(m, n), the
    growth of a Householder bidiagonalization. The i-th singular vector of a matrix perturbed by E moves by
    at most ||E||_2 / gap_i (Wedin's sin-theta theorem), gap_i the distance of sigma_i to the other singular
    values (and to 0 when m > n: the left null space). Returns `rank` bounds in the norm of each column.
    """
    m, n = matrix.shape
    sigma = torch.linalg.svdvals(matrix.double())
    if m > n:
        sigma = torch.cat([sigma, sigma.new_zeros(1)])
    perturbation = 2 * (max(m, n) * EPS32 + rounding) * sigma[0]  # both machines' E
    gaps = (sigma[:rank, None] - sigma[None, :]).abs()
    gaps.fill_diagonal_(float("inf"))
    return (perturbation / gaps.min(dim=1).values).float()


def assert_close_up_to_rounding(got: torch.Tensor, expected: torch.Tensor, *, atol, step=0.0, msg: str = "") -> None:
    """`got` and `expected` come from computations at most `atol` apart (a number, or a tensor that
    broadcasts), then rounded to a grid of spacing `step` (quantization codes: 1; bf16 values: its ulp;
    0 for none).

    A value that lands within `atol` of its rounding threshold (a midpoint for round-to-nearest, its random
    threshold for stochastic rounding) goes to the neighbouring grid point on one machine and not on the
    other, and then differs by up to atol + one step. Worst-case bounds cannot say how many values do (with
    atol >= step / 2 every one could). The actual differences are far smaller (measured under docs/contributing.md's
    CPU settings: bases within 1.2e-5 against int8 and bf16 steps of 2e-3 and more), which puts about 1% of
    the values that close to a threshold. Allowed: 1/32 of the values (at least 2); another rounding mode,
    random stream or scale moves more (measured: another random stream moved 5-9% of the NF4 W0 codes of
    tests/test_layer_storage.py, a third of the INT8 ones).
    """
    assert got.shape == expected.shape and got.dtype == expected.dtype, (msg, got.shape, got.dtype, expected.dtype)
    diff = (got.double() - expected.double()).abs()
    atol = torch.as_tensor(atol, dtype=torch.float64).expand_as(diff)
    step = torch.as_tensor(step, dtype=torch.float64).expand_as(diff)
    worst = int((diff - atol - step).argmax()) if diff.numel() else 0
    assert bool((diff <= atol + step).all()), (
        f"{msg}: {got.reshape(-1)[worst].item()} vs {expected.reshape(-1)[worst].item()} at flat index {worst}, "
        f"beyond atol {atol.reshape(-1)[worst].item():.3g} + one step {step.reshape(-1)[worst].item():.3g}"
    )
    moved = int((diff > atol).sum())
    allowed = max(2, diff.numel() // 32)
    assert moved <= allowed, f"{msg}: {moved} of {diff.numel()} values moved by a rounding step (allowed {allowed})"


def bf16_step(values: torch.Tensor) -> torch.Tensor:
    """The spacing of bf16 values around `values` (at most eps_bf16 * |value|; the smallest normal's below)."""
    tiny = torch.finfo(torch.bfloat16).tiny
    return torch.finfo(torch.bfloat16).eps * values.double().abs().clamp_min(tiny)
