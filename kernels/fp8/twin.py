"""The twins of the fp8 GEMMs: per-channel / per-tensor W8A8 and FP8_BLOCK (fp32 matmuls of the
dequantized operands), and MXFP8 weights (decoded, then `x @ W.T`)."""

from __future__ import annotations

import torch

from quantkit.kernels.fp4 import twin as fp4_twin

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


# FP8 block-scaled (compressed-tensors' FP8_BLOCK preset, DeepSeek-V3's layout)

BLOCK = 128  # weight blocks [128, 128]; activation groups of 128 columns per token


def quantize_fp8_per_group(x: torch.Tensor, group: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic fp8 quantization per token and per `group` columns (the last group may be
    shorter): x [..., K] -> (float8_e4m3fn [..., K], fp32 scales [..., ceil(K / group)]) with
    scale = max(amax(|x_group|), 1e-12) / 448, q = clamp(x / scale, ±448) rounded to nearest even."""
    xf = x.float()
    k = xf.shape[-1]
    n_groups = -(-k // group)
    padded = torch.nn.functional.pad(xf, (0, n_groups * group - k)).reshape(*xf.shape[:-1], n_groups, group)
    scale = padded.abs().amax(dim=-1).clamp_min(1e-12) / FP8_MAX  # [..., G]
    wide = scale.repeat_interleave(group, dim=-1)[..., :k]
    return (xf / wide).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def fake_quantize_per_group(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] -> fp32 x_fp8 · scale, quantized per token and per 128 columns."""
    x_fp8, x_scale = quantize_fp8_per_group(x)
    return x_fp8.float() * x_scale.repeat_interleave(BLOCK, dim=-1)[..., : x.shape[-1]]


def dequantize_fp8_block(w_fp8: torch.Tensor, w_scale: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """w_fp8 float8_e4m3fn [N, K], w_scale [ceil(N / block), ceil(K / block)] -> fp32 W [N, K],
    w[n, k] = w_fp8[n, k] · w_scale[n // block, k // block] (partial edge blocks included)."""
    n, k = w_fp8.shape
    s = w_scale.float().repeat_interleave(block, dim=0)[:n].repeat_interleave(block, dim=1)[:, :k]
    return w_fp8.float() * s


def fp8_block_gemm(x: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """y = dequant(x_fp8) · dequant(W_fp8)ᵀ for FP8_BLOCK (W8A8, block-scaled).

    x [..., K] (float); w_fp8 float8_e4m3fn [N, K]; w_scale float [ceil(N/128), ceil(K/128)].
    x is quantized per token and per 128 columns (`quantize_fp8_per_group`), both operands are
    dequantized and multiplied in fp32; returns [..., N] in x's dtype.
    """
    return (fake_quantize_per_group(x) @ dequantize_fp8_block(w_fp8, w_scale).t()).to(x.dtype)


# MXFP8 weights (compressed-tensors' MXFP8A16 / MXFP8 presets): e4m3 with E8M0 scales per 32


def dequantize_mxfp8(w_fp8: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """w_fp8 float8_e4m3fn [N, K], scales uint8 E8M0 [N, K/32] -> fp32 W, w = e4m3 · 2^(e - 127)."""
    return w_fp8.float() * fp4_twin.e8m0(scales).repeat_interleave(32, dim=1)


def mxfp8_gemm(x: torch.Tensor, w_fp8: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """y = x · dequant(W)ᵀ for MXFP8 weights (W8A16): the weight decoded in fp32, rounded once to
    x's dtype, multiplied in x's dtype; x [..., K] -> [..., N]."""
    return x @ dequantize_mxfp8(w_fp8, scales).to(x.dtype).t()
