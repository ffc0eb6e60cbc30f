"""The twin of the FP4 GEMMs (NVFP4 and MXFP4 weights, compressed-tensors' layouts): decode the
weight elementwise into fp32, then `x @ W.T` in x's dtype (the reference the Triton kernel is
tested against). Decodes E2M1, E4M3 and E8M0 from their bits itself: kernels import only the
numerical core."""

from __future__ import annotations

import torch

KINDS = {"nvfp4": 16, "mxfp4": 32, "nvfp4_w4a4": 16}  # kind -> group size
E4M3_EPS = 0.125  # compressed-tensors' stand-in for a zero FP8 scale (finfo(float8_e4m3fn).eps)
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


def round_e2m1(v: torch.Tensor) -> torch.Tensor:
    """fp32 values in [-6, 6] -> the nearest E2M1 value, ties to the even code (compressed-tensors'
    `cast_to_fp4` thresholds: 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4)."""
    a = v.abs()
    mag = torch.full_like(a, 6.0)
    for bound, value, closed in ((5.0, 4.0, True), (3.5, 3.0, False), (2.5, 2.0, True), (1.75, 1.5, False)):
        mag = torch.where((a <= bound) if closed else (a < bound), value, mag)
    for bound, value, closed in ((1.25, 1.0, True), (0.75, 0.5, False), (0.25, 0.0, True)):
        mag = torch.where((a <= bound) if closed else (a < bound), value, mag)
    return torch.where(v < 0, -mag, mag)


def nvfp4_activation_parts(x: torch.Tensor, input_global_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4's dynamic activation quantization (the preset's input_activations: groups of 16,
    FP8 scales over a static global scale gs), in fp32 as compressed-tensors computes it for
    fp32 x: s8 = fp8(min(amax / 6 · gs, 448)) (a zero scale becomes 0.125) and
    q = e2m1(clamp(x / (s8 / gs), ±6)). Returns (q fp32 [..., K], s8 fp32 [..., K/16])."""
    groups = x.float().unflatten(-1, (-1, 16))
    gs = input_global_scale.float().reshape(())
    s8 = (groups.abs().amax(dim=-1, keepdim=True) / 6.0 * gs).clamp(max=448.0).to(torch.float8_e4m3fn).float()
    s8 = torch.where(s8 == 0, E4M3_EPS, s8)
    return round_e2m1((groups / (s8 / gs)).clamp(-6.0, 6.0)).flatten(-2), s8.squeeze(-1)


def quantize_nvfp4_activations(x: torch.Tensor, input_global_scale: torch.Tensor) -> torch.Tensor:
    """x fake-quantized to NVFP4 (`nvfp4_activation_parts`): q · (s8 / gs), fp32."""
    q, s8 = nvfp4_activation_parts(x, input_global_scale)
    s = s8 / input_global_scale.float().reshape(())
    return (q.unflatten(-1, (-1, 16)) * s[..., None]).flatten(-2)


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
    input_global_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """y = x · dequant(W)ᵀ for FP4 weights.

    x [..., K] (any float dtype); packed uint8 [N, K/2] (`weight_packed`); scales [N, K/group]
    (float8_e4m3fn for "nvfp4" and "nvfp4_w4a4", group 16; uint8 E8M0 exponents for "mxfp4",
    group 32); global_scale fp32 [1] (NVFP4's `weight_global_scale`, None for MXFP4).
    "nvfp4" and "mxfp4" are W4A16: the weight decoded in fp32, rounded once to x's dtype,
    multiplied in x's dtype. "nvfp4_w4a4" also quantizes x (`quantize_nvfp4_activations`, with
    `input_global_scale` fp32 [1]) and multiplies both fake-quantized operands in fp32. Returns
    [..., N] in x's dtype.
    """
    w = dequantize_fp4(packed, scales, global_scale, group_size, kind)
    if kind == "nvfp4_w4a4":
        return (quantize_nvfp4_activations(x, input_global_scale) @ w.t()).to(x.dtype)
    return x @ w.to(x.dtype).t()
