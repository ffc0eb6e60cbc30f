"""compressed-tensors `float-quantized`: fp8 e4m3 weights, stored as they are.

Per quantized linear `<name>`:

| tensor | dtype | shape | content |
|---|---|---|---|
| `<name>.weight` | float8_e4m3fn | [out, in] | weight / scale, clamped to ±448 |
| `<name>.weight_scale` | float32 | [out, 1] (channel) or [1] (tensor) | |
| `<name>.input_scale` | float32 | [1] | static activations only: calibrated amax / 448 |
"""

from __future__ import annotations

import torch

from quantkit.primitives import quantize
from quantkit.scheme import QuantArgs


def compress(
    weight: torch.Tensor, scale: torch.Tensor, args: QuantArgs, input_scale: torch.Tensor | None = None
) -> dict[str, torch.Tensor]:
    """The stored tensors of one linear (keys without the module prefix)."""
    out = {"weight": quantize(weight, scale, None, args), "weight_scale": scale.float().contiguous()}
    if input_scale is not None:
        out["input_scale"] = input_scale.float().reshape(1)
    return out


def param_info(out_features: int, in_features: int, args: QuantArgs, static_input: bool) -> dict[str, tuple]:
    """Shapes and dtypes of the stored tensors of one [out, in] linear."""
    info = {
        "weight": ((out_features, in_features), torch.float8_e4m3fn),
        "weight_scale": ((out_features, 1) if args.strategy == "channel" else (1,), torch.float32),
    }
    if static_input:
        info["input_scale"] = ((1,), torch.float32)
    return info
