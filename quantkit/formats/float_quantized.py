"""compressed-tensors `float-quantized`: fp8 e4m3 weights, stored as they are.

Per quantized linear `<name>`:

| tensor | dtype | shape | content |
|---|---|---|---|
| `<name>.weight` | float8_e4m3fn | [out, in] | weight / scale, clamped to ±448 |
| `<name>.weight_scale` | float32 (block: model dtype) | [out, 1] (channel), [1] (tensor) or [ceil(out / rows), ceil(in / columns)] (block) | amax / 448 (a partial block at an edge: of the elements it has) |
| `<name>.input_scale` | float32 | [1] | static activations only: calibrated amax / 448 |
"""

from __future__ import annotations

import torch

from quantkit.primitives import dequantize, quantize
from quantkit.scheme import QuantArgs


def compress(
    weight: torch.Tensor, scale: torch.Tensor, args: QuantArgs, input_scale: torch.Tensor | None = None
) -> dict[str, torch.Tensor]:
    """The stored tensors of one linear (keys without the module prefix)."""
    scale = scale if args.strategy == "block" else scale.float()
    out = {"weight": quantize(weight, scale, None, args), "weight_scale": scale.contiguous()}
    if input_scale is not None:
        out["input_scale"] = input_scale.float().reshape(1)
    return out


def decompress(tensors: dict[str, torch.Tensor], args: QuantArgs, dtype: torch.dtype) -> torch.Tensor:
    """The dequantized [out, in] weight of one stored linear, in `dtype`."""
    return dequantize(tensors["weight"], tensors["weight_scale"], None, args, dtype=dtype)


def _scale_shape(out_features: int, in_features: int, args: QuantArgs) -> tuple[int, ...]:
    if args.strategy == "block":
        rows, columns = args.block_structure
        return (-(-out_features // rows), -(-in_features // columns))
    return (out_features, 1) if args.strategy == "channel" else (1,)


def param_info(
    out_features: int, in_features: int, args: QuantArgs, static_input: bool, dtype: torch.dtype = torch.float32
) -> dict[str, tuple]:
    """Shapes and dtypes of the stored tensors of one [out, in] linear (block scales: `dtype`, the model's)."""
    scale_dtype = dtype if args.strategy == "block" else torch.float32
    info = {
        "weight": ((out_features, in_features), torch.float8_e4m3fn),
        "weight_scale": (_scale_shape(out_features, in_features, args), scale_dtype),
    }
    if static_input:
        info["input_scale"] = ((1,), torch.float32)
    return info
