"""Pure-torch twins of the kernels: same signatures, plain math, the reference the
Triton kernels are tested against and the CPU path."""

from __future__ import annotations

import torch

from quantkit.formats.pack_quantized import unpack
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
