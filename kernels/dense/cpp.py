"""fp32 GEMV on the CPU for float linears at a few rows (`kernels/dense/gemv.cpp`, 1 to 4 rows),
built on first use by `cpu_ext.Extension` (the same compiler flags, cache folder and build lock as
the other kernels). `load()` returns `torch.ops.quantkit_dense` (`gemv`, `isa_level`) or None, and
`reason()` says why.

`linear(x, weight, bias)` is F.linear for an fp32 weight [N, K] kept as `nn.Linear` keeps it (no
layout of its own, so a tied lm_head reads the embedding's memory): at `ROWS` (1 to 4 rows of x)
the C++ GEMV (exact fp32 products, fp32 sums in another order than MKL's), otherwise MKL through
`F.linear`. The GEMV reads the weight as one sequential stream, one output channel at a time: on
the Zen 4 EPYC 1.3-4× MKL's speed at 1-4 rows on smollm2's shapes (docs/benchmarks.md).

ISA: `QUANTKIT_ISA=avx2|avx512` (read once, at import) forces one, as for the int4 kernels; unset,
the widest the CPU has. The AVX2 code is compiled with AVX-512 disabled, so forcing it on an
AVX-512 CPU runs what an AVX2-only CPU runs.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from quantkit.kernels import cpu_ext

EXTENSION = cpu_ext.Extension("dense/gemv.cpp", "quantkit_dense", "gemv", "the C++ fp32 GEMV")
load, reason = EXTENSION.load, EXTENSION.reason
ROWS = (1, 4)  # the rows given to the GEMV; MKL takes the others (docs/benchmarks.md)
ISA_LEVEL = {"avx2": 1, "avx512": 2}


@functools.cache
def isa() -> tuple[str | None, str]:
    """(isa, "") the GEMV runs (QUANTKIT_ISA, else the widest), or (None, why): once per process."""
    return cpu_ext.choose_isa(EXTENSION, None, "AVX-512")


def available() -> tuple[bool, str]:
    """(True, "") where the GEMV can run, else (False, why)."""
    chosen, why = isa()
    return chosen is not None, why


def gemv(x: torch.Tensor, weight: torch.Tensor, isa_name: str | None = None) -> torch.Tensor:
    """x [M ≤ 4, K] fp32 · weight [N, K]ᵀ through the C++ GEMV on `isa_name` (default: `isa()`)."""
    return load().gemv(x, weight, ISA_LEVEL[isa_name or isa()[0]])


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x · weightᵀ (+ bias) for fp32 x [..., K] and a contiguous fp32 weight [N, K] on the CPU."""
    rows = x.numel() // max(x.shape[-1], 1)
    if not ROWS[0] <= rows <= ROWS[1] or x.dtype != torch.float32 or not weight.is_contiguous():
        return F.linear(x, weight, bias)
    y = gemv(x.reshape(rows, x.shape[-1]).contiguous(), weight)
    if bias is not None:
        y += bias
    return y.view(*x.shape[:-1], weight.shape[0])
