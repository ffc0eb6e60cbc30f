"""compressed-tensors `nvfp4-pack-quantized` and `mxfp4-pack-quantized`: fp4 e2m1 weights,
two to a byte, with fp8 e4m3 group scales and a global scale (NVFP4, groups of 16) or
e8m0 power-of-two group scales (MXFP4, groups of 32).

Per quantized linear `<name>`:

| tensor | dtype | shape | content |
|---|---|---|---|
| `<name>.weight_packed` | uint8 | [out, in / 2] | e2m1 codes (sign in bit 3, magnitude index 0..7 into 0, 0.5, 1, 1.5, 2, 3, 4, 6), column 2j in the low nibble of byte j, 2j + 1 in the high one |
| `<name>.weight_scale` | float8_e4m3fn (NVFP4) / uint8 (MXFP4) | [out, in / group] | NVFP4: amax / 6 · global scale; MXFP4: the e8m0 byte e + 127 of the scale 2^e |
| `<name>.weight_global_scale` | float32 | [1] | NVFP4 only: 448 · 6 / amax, shared by the linears vLLM fuses |
| `<name>.input_global_scale` | float32 | [1] | NVFP4 with activations (`nvfp4`): 448 · 6 / calibrated amax of the input |

The weight is w ≈ e2m1 · weight_scale / weight_global_scale (NVFP4; fp32, divided as
compressed-tensors does) or e2m1 · 2^(weight_scale - 127) (MXFP4).
"""

from __future__ import annotations

import torch

from quantkit.primitives import E2M1_GRID, mx_decode, mx_exponent, quantize
from quantkit.scheme import QuantArgs

_GRID = torch.tensor(E2M1_GRID)


def pack_e2m1(values: torch.Tensor) -> torch.Tensor:
    """[out, in] e2m1 values (fp32, exactly on the grid) -> uint8 [out, in / 2]."""
    index = torch.bucketize(values.abs(), _GRID).to(torch.uint8)
    codes = index | (torch.signbit(values).to(torch.uint8) << 3)
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [out, in / 2] -> fp32 e2m1 values [out, in]."""
    codes = torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(packed.shape[0], -1)
    values = _GRID[(codes & 0x07).long()]
    return torch.where((codes & 0x08).bool(), -values, values)


def compress(
    weight: torch.Tensor,
    scale: torch.Tensor,
    args: QuantArgs,
    global_scale: torch.Tensor | None = None,
    input_global_scale: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """The stored tensors of one linear (keys without the module prefix), from its float
    weight and effective fp32 scales (NVFP4: fp8 scale / global scale). A value that rounds to 0
    keeps the sign of its weight (as compressed-tensors packs it), also when `weight` is
    already fake-quantized and holds it as -0.0."""
    out = {"weight_packed": pack_e2m1(torch.copysign(quantize(weight, scale, None, args), weight))}
    if args.is_mx:
        out["weight_scale"] = mx_exponent(scale).contiguous()
        return out
    gs = global_scale.float().reshape(1)
    out["weight_scale"] = (scale.float() * gs).to(torch.float8_e4m3fn).contiguous()
    out["weight_global_scale"] = gs
    if input_global_scale is not None:
        out["input_global_scale"] = input_global_scale.float().reshape(1)
    return out


def scales(tensors: dict[str, torch.Tensor], args: QuantArgs) -> torch.Tensor:
    """The effective fp32 scales [out, in / group] of one stored linear."""
    if args.is_mx:
        return mx_decode(tensors["weight_scale"])
    return tensors["weight_scale"].float() / tensors["weight_global_scale"].float()


def decompress(tensors: dict[str, torch.Tensor], args: QuantArgs, dtype: torch.dtype) -> torch.Tensor:
    """The dequantized [out, in] weight of one stored linear, in `dtype`."""
    q = unpack_e2m1(tensors["weight_packed"])
    s = scales(tensors, args).repeat_interleave(args.group_size, dim=1)
    return (q * s).to(dtype)


def param_info(out_features: int, in_features: int, args: QuantArgs, static_input: bool) -> dict[str, tuple]:
    """Shapes and dtypes of the stored tensors of one [out, in] linear."""
    groups = -(-in_features // args.group_size)
    info = {
        "weight_packed": ((out_features, in_features // 2), torch.uint8),
        "weight_scale": ((out_features, groups), torch.uint8 if args.is_mx else torch.float8_e4m3fn),
    }
    if not args.is_mx:
        info["weight_global_scale"] = ((1,), torch.float32)
        if static_input:
            info["input_global_scale"] = ((1,), torch.float32)
    return info
