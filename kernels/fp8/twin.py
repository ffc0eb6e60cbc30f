"""The twin of the fp8 GEMM: an fp32 matmul of the dequantized operands."""

from __future__ import annotations

import torch

FP8_MAX = 448.0


def fp8_gemm(
    x: torch.Tensor,
    w_fp8: torch.Tensor,
    w_scale: torch.Tensor,
    x_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """y = (x_fp8 · W_fp8ᵀ) · s_x · s_w for W8A8 fp8 e4m3.

    x [..., in] (float); w_fp8 float8_e4m3fn [out, in]; w_scale [out, 1] (per channel) or
    [1] (per tensor); x_scale [1] (static per tensor) or None (dynamic: amax / 448 per
    token). The fp8 products are summed in fp32; returns [..., out] in x's dtype.
    """
    xf = x.float()
    if x_scale is None:
        x_scale = xf.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12) / FP8_MAX  # [..., 1]
    x_fp8 = (xf / x_scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    y = (x_fp8.float() @ w_fp8.float().t()) * x_scale * w_scale.float().reshape(1, -1)
    return y.to(x.dtype)
