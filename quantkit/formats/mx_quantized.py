"""compressed-tensors `mxfp8-quantized`: fp8 e4m3 weights in groups of 32, each with an e8m0
power-of-two scale (OCP MXFP8).

Per quantized linear `<name>`:

| tensor | dtype | shape | content |
|---|---|---|---|
| `<name>.weight` | float8_e4m3fn | [out, in] | weight / 2^e, clamped to ±448 |
| `<name>.weight_scale` | uint8 | [out, in / 32] | the e8m0 byte e + 127 of each group's scale 2^e |

Activations (`mxfp8`) are quantized the same way, per token and group of 32, at run time:
nothing is stored for them.
"""

from __future__ import annotations

import torch

from quantkit.primitives import mx_decode, mx_exponent, quantize
from quantkit.scheme import QuantArgs


def compress(weight: torch.Tensor, scale: torch.Tensor, args: QuantArgs) -> dict[str, torch.Tensor]:
    """The stored tensors of one linear (keys without the module prefix), from its float
    weight and fp32 power-of-two scales."""
    return {"weight": quantize(weight, scale, None, args), "weight_scale": mx_exponent(scale).contiguous()}


def decompress(tensors: dict[str, torch.Tensor], args: QuantArgs, dtype: torch.dtype) -> torch.Tensor:
    """The dequantized [out, in] weight of one stored linear, in `dtype`."""
    s = mx_decode(tensors["weight_scale"]).repeat_interleave(args.group_size, dim=1)
    return (tensors["weight"].float() * s).to(dtype)


def param_info(out_features: int, in_features: int, args: QuantArgs) -> dict[str, tuple]:
    """Shapes and dtypes of the stored tensors of one [out, in] linear."""
    return {
        "weight": ((out_features, in_features), torch.float8_e4m3fn),
        "weight_scale": ((out_features, -(-in_features // args.group_size)), torch.uint8),
    }
