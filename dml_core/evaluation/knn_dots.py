"""Dot products of pairs of rows for the bf16 mode of ``dml_core.evaluation.knn.self_knn``, and their rounding bounds.

Two ways to compute x_i·x_j of chosen pairs in float32: ``_PairDots``, the search's cheap working keys (an elementwise
product summed by torch, the same value wherever the rows sit), and ``_fma_dots``, the final keys rounded exactly as
the BLAS's SGEMM rounds them (one fused multiply-add chain per K block).  ``_widen`` bounds how far two float32
computations of a key may differ; ``_bf16_err`` how far a bf16 panel product may fall below the fp32 one.  Why each
is needed: the module docstring of ``dml_core.evaluation.knn``.
"""

from __future__ import annotations

from typing import cast

import torch

_FUSED_ADDCMUL: bool | None = None


class _PairDots:
    """float32 dot products x_i·x_j of pairs of rows, the bf16 mode's working keys: an elementwise product summed
    by torch's row reduction, whose order depends only on D -- a pair gets the same value wherever its rows
    sit and x_i·x_j = x_j·x_i bit for bit -- within 2·γ_D·‖x_i‖·‖x_j‖ of a GEMM's value (γ_D = D·2⁻²⁴/(1 − D·2⁻²⁴)),
    but not always equal to it (13 % of random pairs are bit-equal).  The rows are gathered into two reused
    buffers (fresh ones cost page faults)."""

    def __init__(self, x: torch.Tensor):
        self.x = x
        self.a = self.b = torch.empty(0, x.shape[1], device=x.device)

    def __call__(self, i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
        m = i.numel()
        if m > self.a.shape[0]:
            size = (max(m, 2 * self.a.shape[0]), self.x.shape[1])
            self.a, self.b = torch.empty(size, device=self.x.device), torch.empty(size, device=self.x.device)
        ga = torch.index_select(self.x, 0, i, out=self.a[:m])
        return ga.mul_(torch.index_select(self.x, 0, j, out=self.b[:m])).sum(dim=1)


def _fused_addcmul() -> bool:
    """Whether ``torch.addcmul`` on CPU float32 is a fused multiply-add (the product exact, one rounding of the sum):
    torch's vectorised kernel is compiled with FMA contraction on the builds checked (bench/README_metrics.md),
    which no API promises, so it is checked once per process against the float64 emulation on 2¹⁶ random triples
    whose unfused result differs in ~23 % of them."""
    global _FUSED_ADDCMUL
    if _FUSED_ADDCMUL is None:
        gen = torch.Generator().manual_seed(3)
        acc, a, b = (torch.randn(1 << 16, generator=gen) for _ in range(3))
        _FUSED_ADDCMUL = torch.equal(torch.addcmul(acc, a, b), (acc.double() + a.double() * b.double()).float())
    return _FUSED_ADDCMUL


def _fma_dots(x: torch.Tensor, i: torch.Tensor, j: torch.Tensor, block: int | None = None) -> torch.Tensor:
    """float32 dot products x_i·x_j of rows of ``x``, rounded as an SGEMM rounds them: within each K block of
    ``block`` dimensions (``None``: all D at once) one chain of fused multiply-adds, each product exact and each
    sum rounded once to float32, started at 0; the blocks' sums added to the result in order, each addition
    rounded once.  That is the order of MKL's and OpenBLAS's micro-kernels; the block size depends on the BLAS,
    the CPU and D (examples in bench/README_metrics.md), so ``_gemm_k_block`` finds the block of the BLAS at hand
    (an elementwise product summed by ``torch.sum`` agrees on ~13 % of pairs).  The chain is ``torch.addcmul_`` in
    float32 where that is a fused multiply-add (``_fused_addcmul``), else emulated in float64 (a product of two
    floats is exact there; an f64 sum rounded to f32 differs from one rounding only at double-rounding ties, ~2⁻²⁸
    of sums) at three times the passes over memory, several times slower (bench/README_metrics.md).  D steps are
    vectorised over a cache-sized slice of pairs at a time.  On exact data (quantised) it is the exact dot
    product, like every order."""
    d = x.shape[1]
    block = d if block is None else block
    out = torch.empty(i.numel(), device=x.device)
    fused = x.device.type == "cpu" and _fused_addcmul()
    # pairs per slice: 16384 fit the cache best for addcmul_ (chosen by measurement, bench/README_metrics.md); the
    # float64 emulation's slice grows with the threads
    step = max(1, min(i.numel(), 16384 * (1 if fused else torch.get_num_threads())))
    dt = torch.float32 if fused else torch.float64
    pa = torch.empty(d, step, dtype=dt, device=x.device)
    pb = torch.empty_like(pa)
    tot = torch.empty(step, device=x.device)  # the sum of the K blocks so far
    acc = None if fused else torch.empty(step, dtype=torch.float64, device=x.device)  # the f64 engine's chain
    for s in range(0, i.numel(), step):
        m = min(step, i.numel() - s)
        # rows gathered (contiguous reads), then transposed so that each step reads one row
        ga = pa[:, :m].copy_(x.index_select(0, i[s : s + m]).T)
        gb = pb[:, :m].copy_(x.index_select(0, j[s : s + m]).T)
        a32, t32 = out[s : s + m], tot[:m]
        if fused:
            for lo in range(0, d, block):
                a32.zero_()
                for r in range(lo, min(d, lo + block)):
                    a32.addcmul_(ga[r], gb[r])  # one FMA per step
                if lo:  # C += the block's sum, one rounding
                    a32.add_(t32)
                t32.copy_(a32)
            continue
        ga.mul_(gb)  # exact: 24-bit mantissas, 53 in f64
        a = cast(torch.Tensor, acc)[:m]  # set wherever the chain is not fused
        for lo in range(0, d, block):
            a.zero_()
            for row in ga[lo : lo + block]:
                a32.copy_(a.add_(row))  # one rounding to float32 per step, as an FMA
                a.copy_(a32)
            if lo:  # C += the block's sum, one rounding
                a32.copy_(a.add_(t32))
            t32.copy_(a32)
    return out


def _widen(norms: torch.Tensor, d: int, mx: float) -> torch.Tensor:
    """Most by which two float32 computations of a key n_i + n_j − 2·x_i·x_j can differ when their dot
    products are summed in different orders: 2·(2·γ_D·‖x_i‖·max‖x‖) plus the keys' own rounding."""
    return 4.04 * d * 2.0**-24 * norms.sqrt() * mx + 2.0**-20 * (norms + mx * mx)


def _bf16_err(norms: torch.Tensor, d: int, mx: float) -> torch.Tensor:
    """Most by which a bf16 panel product (bf16 inputs and output, fp32 accumulation) of row i with any row
    can fall below its fp32 dot product: inputs rounded to bf16 (2·2⁻⁹ + 2⁻¹⁸ relative per term, Σ|x_i x_j| <=
    ‖x_i‖·‖x_j‖), the output rounded to bf16 (2⁻⁹·|s|), fp32 accumulation on both sides (2·γ_D), denormal
    products flushed to zero (D·2⁻¹²⁶)."""
    return (2.0**-8 + 2.0**-9 + 2.0**-14 + 4.04 * d * 2.0**-24) * norms.sqrt() * mx + d * 2.0**-126
