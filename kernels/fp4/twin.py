"""The twin of the FP4 GEMMs (NVFP4 and MXFP4 weights, compressed-tensors' layouts): decode the
weight elementwise into fp32, then `x @ W.T` in x's dtype (the reference the Triton kernel is
tested against). Decodes E2M1, E4M3 and E8M0 from their bits itself: kernels import only the
numerical core."""

from __future__ import annotations

import torch

KINDS = {"nvfp4": 16, "mxfp4": 32}  # kind -> group size
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def e2m1(codes: torch.Tensor) -> torch.Tensor:
    """4-bit E2M1 codes (0..15, sign in bit 3) -> fp32 values in ±{0, 0.5, 1, 1.5, 2, 3, 4, 6}."""
    c = codes.to(torch.int32)
    mag = torch.tensor(E2M1, dtype=torch.float32, device=codes.device)[c & 7]
    return torch.where((c & 8) != 0, -mag, mag)


def e8m0(exponents: torch.Tensor) -> torch.Tensor:
    """uint8 E8M0 exponents e -> fp32 2^(e - 127) (e = 0: 2^-127, a subnormal; e = 255: NaN)."""
    e = exponents.to(torch.int32)
    bits = torch.where(e == 0, torch.full_like(e, 1 << 22), e << 23)
    return torch.where(e == 255, torch.nan, bits.view(torch.float32))


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/2] -> codes uint8 [N, K]: element 2j in the low nibble of byte j, 2j + 1 in the
    high one (compressed-tensors' `pack_fp4_to_uint8`)."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(packed.shape[0], -1)


def group_scales(scales: torch.Tensor, global_scale: torch.Tensor | None, kind: str) -> torch.Tensor:
    """The stored scales [N, K/G] -> fp32 multipliers: NVFP4 float8_e4m3fn s / global_scale
    (compressed-tensors divides in fp32), MXFP4 uint8 E8M0 2^(e - 127)."""
    if kind == "mxfp4":
        return e8m0(scales)
    return scales.float() / global_scale.float().reshape(1, 1)


def dequantize_fp4(
    packed: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor | None, group_size: int, kind: str
) -> torch.Tensor:
    """packed uint8 [N, K/2], scales [N, K/group_size] -> fp32 W [N, K], w = e2m1(code) · scale."""
    w = e2m1(unpack_fp4(packed))
    s = group_scales(scales, global_scale, kind)
    return (w.reshape(w.shape[0], -1, group_size) * s[:, :, None]).reshape(w.shape)


def fp4_gemm(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    global_scale: torch.Tensor | None,
    group_size: int,
    kind: str,
) -> torch.Tensor:
    """y = x · dequant(W)ᵀ for FP4 weights (W4A16).

    x [..., K] (any float dtype); packed uint8 [N, K/2] (`weight_packed`); scales [N, K/group]
    (float8_e4m3fn for "nvfp4", group 16; uint8 E8M0 exponents for "mxfp4", group 32);
    global_scale fp32 [1] (NVFP4's `weight_global_scale`, None for MXFP4). The weight is
    decoded in fp32, rounded once to x's dtype, multiplied in x's dtype; returns [..., N].
    """
    w = dequantize_fp4(packed, scales, global_scale, group_size, kind)
    return x @ w.to(x.dtype).t()
