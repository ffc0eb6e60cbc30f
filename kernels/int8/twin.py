"""The twin of the W8A8 int8 GEMM: x fake-quantized per token, an fp32 matmul with the
dequantized weight."""

from __future__ import annotations

import torch

from quantkit.primitives import fake_quantize
from quantkit.scheme import QuantArgs

INT8_TOKEN = QuantArgs(num_bits=8, type="int", symmetric=True, strategy="token", group_size=None, dynamic=True)


def int8_gemm(x: torch.Tensor, w_int8: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """y = Q(x) · (W_int8 · s_w)ᵀ for W8A8 int8.

    x [..., in] (float), quantized to int8 per token (symmetric, scale amax / 127.5, as
    `quantkit.primitives`) and dequantized; w_int8 int8 [out, in]; w_scale [out, 1] (per
    channel) or [1] (per tensor). Multiplies the dequantized values in fp32; returns
    [..., out] in x's dtype.
    """
    w = w_int8.float() * w_scale.float().reshape(-1, 1)  # [out, in]
    return (fake_quantize(x.float(), INT8_TOKEN) @ w.t()).to(x.dtype)
