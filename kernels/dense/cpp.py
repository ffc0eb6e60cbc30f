"""fp32 GEMV on the CPU for float linears at a few rows (`kernels/dense/gemv.cpp`, 1 to 4 rows),
built on first use by `cpu_ext.Extension` (the same compiler flags, cache folder and build lock as
the other kernels). `load()` returns `torch.ops.quantkit_dense` (`gemv`) or None, and `reason()` says why.

`linear(x, weight, bias)` is F.linear for an fp32 weight [N, K] kept as `nn.Linear` keeps it (no
layout of its own, so a tied lm_head reads the embedding's memory): at `ROWS` (3 or 4 rows of x)
the C++ GEMV (exact fp32 products, fp32 sums in another order than MKL's), otherwise MKL through
`F.linear`. At one or two rows MKL streams the weight at the memory's speed (the GEMV is
0.92-1.0x of it there); at three and four it falls to about half of that, where this loop
keeps it (1.2-1.7x MKL on smollm2's shapes; docs/benchmarks.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from quantkit.kernels import cpu_ext

EXTENSION = cpu_ext.Extension("dense/gemv.cpp", "quantkit_dense", "gemv", "the C++ fp32 GEMV")
load, reason = EXTENSION.load, EXTENSION.reason
ROWS = (3, 4)  # the rows given to the GEMV; MKL takes the others (docs/benchmarks.md)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x · weightᵀ (+ bias) for fp32 x [..., K] and a contiguous fp32 weight [N, K] on the CPU."""
    rows = x.numel() // max(x.shape[-1], 1)
    if not ROWS[0] <= rows <= ROWS[1] or x.dtype != torch.float32 or not weight.is_contiguous():
        return F.linear(x, weight, bias)
    y = load().gemv(x.reshape(rows, x.shape[-1]).contiguous(), weight)
    if bias is not None:
        y += bias
    return y.view(*x.shape[:-1], weight.shape[0])
