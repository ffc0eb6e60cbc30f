"""The twin of the W4A16 GEMM: dequantize, then `x @ W.T` (the reference the kernels are tested
against)."""

from __future__ import annotations

import torch

from quantkit.packing import unpack
from quantkit.primitives import dequantize
from quantkit.scheme import QuantArgs


def int4_gemm(
    x: torch.Tensor,
    w_packed: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int | None,
    g_idx: torch.Tensor | None = None,
) -> torch.Tensor:
    """y = x · dequant(W)ᵀ for W4A16.

    x [..., in] (any float dtype); w_packed int32 [out, in / 8] in the pack-quantized
    layout; scales [out, in / group_size] (or [out, 1] per channel); zeros int8
    [out, in / group_size] unpacked signed zero points, None when symmetric; g_idx int32
    [in] (act-order groups) or None. Dequantizes in scales' dtype, multiplies in x's
    dtype; returns [..., out] in x's dtype.
    """
    in_features = w_packed.shape[1] * 8
    args = QuantArgs(
        num_bits=4,
        symmetric=zeros is None,
        strategy="group" if group_size else "channel",
        group_size=group_size,
    )
    w = dequantize(unpack(w_packed, in_features), scales, zeros, args, g_idx)
    return x @ w.to(x.dtype).t()
