"""compressed-tensors `pack-quantized`: int4 (or int3/int8, any of 1..8 bits) weights packed into int32.

Per quantized linear `<name>`:

| tensor | dtype | shape | content |
|---|---|---|---|
| `<name>.weight_packed` | int32 | [out, ceil(in * bits / 32)] | values + 2^(bits-1) (int4: +8), one dense bit stream per row: element j in bits [bits*j, bits*(j+1)), little-end first; 3 bits: a value may straddle two words (`quantkit.packing`) |
| `<name>.weight_scale` | float (model dtype) | [out, ceil(in / group)] (group), [out, 1] (channel) | |
| `<name>.weight_zero_point` | int32 | [ceil(out * bits / 32), ceil(in / group)] | asymmetric only; signed zero points packed like the weights but along the output dimension |

The config group's `input_activations` are null (w4a16, w3a16, w8a16) or fp8 e4m3 per token,
dynamic (`w4afp8`, vLLM's `CompressedTensorsW4A8Fp8`: no activation tensor is stored).
| `<name>.weight_shape` | int64 | [2] | [out, in] |
| `<name>.weight_g_idx` | int32 | [in] | only with act-order "group": the group of each input column |
"""

from __future__ import annotations

import torch

from quantkit.packing import pack, packed_words, unpack
from quantkit.primitives import quantize
from quantkit.scheme import QuantArgs


def compress(
    weight: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    args: QuantArgs,
    g_idx: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """The packed tensors of one linear (keys without the module prefix)."""
    return pack_ints(quantize(weight, scale, zero_point, args, g_idx), scale, zero_point, args, g_idx)


def pack_ints(
    q: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    args: QuantArgs,
    g_idx: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """The packed tensors of one linear from its int values q [out, in] (int8) and zero points
    [out, groups] (keys without the module prefix)."""
    out = {
        "weight_packed": pack(q, args.num_bits),
        "weight_scale": scale.contiguous(),
        "weight_shape": torch.tensor(list(q.shape), dtype=torch.int64),
    }
    if zero_point is not None:
        out["weight_zero_point"] = pack(zero_point, args.num_bits, dim=0)
    if g_idx is not None:
        out["weight_g_idx"] = g_idx.to(torch.int32)
    return out


def decompress_ints(tensors: dict[str, torch.Tensor], args: QuantArgs):
    """(int8 values [out, in], scale, int8 zero point or None, g_idx or None) of one linear."""
    out_f, in_f = (int(s) for s in tensors["weight_shape"])
    q = unpack(tensors["weight_packed"], in_f, args.num_bits)
    scale = tensors["weight_scale"]
    zp = tensors.get("weight_zero_point")
    if zp is not None:
        zp = unpack(zp, out_f, args.num_bits, dim=0)
    return q, scale, zp, tensors.get("weight_g_idx")


def param_info(out_features: int, in_features: int, args: QuantArgs, dtype: torch.dtype) -> dict[str, tuple]:
    """Shapes and dtypes of the packed tensors of one [out, in] linear."""
    n_groups = -(-in_features // args.group_size) if args.strategy == "group" else 1  # a last, partial group
    info = {
        "weight_packed": ((out_features, packed_words(in_features, args.num_bits)), torch.int32),
        "weight_scale": ((out_features, n_groups), dtype),
        "weight_shape": ((2,), torch.int64),
    }
    if not args.symmetric:
        info["weight_zero_point"] = ((packed_words(out_features, args.num_bits), n_groups), torch.int32)
    if args.actorder == "group":
        info["weight_g_idx"] = ((in_features,), torch.int32)
    return info
