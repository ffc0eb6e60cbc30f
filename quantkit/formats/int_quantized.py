"""compressed-tensors `int-quantized`: int8 weights stored as they are, for W8A8 (int8
activations, quantized per token when the model runs; vLLM's `CompressedTensorsW8A8Int8`).

Per quantized linear `<name>`:

| tensor | dtype | shape | content |
|---|---|---|---|
| `<name>.weight` | int8 | [out, in] | round(w / scale), clamped to [-128, 127] |
| `<name>.weight_scale` | float (model dtype) | [out, 1] (channel) or [1] (tensor) | amax / 127.5 |

The config group's `input_activations` are {num_bits: 8, type: int, symmetric: true,
strategy: token, dynamic: true}: no activation tensor is stored.

compressed-tensors (and so llm-compressor) also writes int weights of fewer bits on fp8
activations (W4AFP8) in this format, one int8 per int4 value (`weight` [out, in], group scales
[out, in / group], `weight_zero_point` [out, in / group] int8 when asymmetric); vLLM's W4A8Fp8
scheme reads only pack-quantized, and `quantkit.load` repacks them so (`as_pack_quantized`).
"""

from __future__ import annotations

import torch

from quantkit.formats import pack_quantized
from quantkit.primitives import quantize
from quantkit.scheme import QuantArgs, QuantScheme


def unsupported(scheme: QuantScheme) -> str | None:
    """Why quantkit cannot make or run this int-quantized scheme (one clause), or None.
    It takes int8 symmetric weights per channel or per tensor, and int8 symmetric
    activations per token, quantized at run time."""
    w, a = scheme.weights, scheme.input_activations
    if w is None or a is None or w.type != "int" or a.type != "int":
        return "int-quantized holds int weights with int activations"
    if w.num_bits != 8 or a.num_bits != 8:
        return f"W8A8 takes 8-bit weights and activations, not int{w.num_bits} weights with int{a.num_bits} activations"
    if not w.symmetric or not a.symmetric:
        return "W8A8 weights and activations are symmetric (no zero point)"
    if w.strategy not in ("channel", "tensor") or w.group_size:
        per = f"groups of {w.group_size}" if w.group_size else f"one per {w.strategy}"
        return f"W8A8 weights take one scale per output channel or per tensor, not {per}"
    if w.actorder == "group":
        return "W8A8 weights have no groups, so act-order 'group' does not apply"
    if a.strategy != "token" or not a.dynamic:
        return "W8A8 activations are quantized per token at run time (strategy token, dynamic true)"
    return None


def compress(weight: torch.Tensor, scale: torch.Tensor, args: QuantArgs) -> dict[str, torch.Tensor]:
    """The stored tensors of one linear (keys without the module prefix)."""
    return {"weight": quantize(weight, scale, None, args), "weight_scale": scale.contiguous()}


def param_info(out_features: int, in_features: int, args: QuantArgs, dtype: torch.dtype) -> dict[str, tuple]:
    """Shapes and dtypes of the stored tensors of one [out, in] linear."""
    return {
        "weight": ((out_features, in_features), torch.int8),
        "weight_scale": ((out_features, 1) if args.strategy == "channel" else (1,), dtype),
    }


def as_pack_quantized(tensors: dict[str, torch.Tensor], name: str, args: QuantArgs) -> None:
    """Repack one linear `name` stored int-quantized with fewer than 8 bits (one int8 per value)
    as pack-quantized, in `tensors`, in place. ValueError if its values do not fit `args`."""
    for key in (f"{name}.weight", f"{name}.weight_scale"):
        if key not in tensors:
            raise ValueError(f"{key} is missing")
    q = tensors.pop(f"{name}.weight")
    if q.dtype != torch.int8 or q.dim() != 2 or q.min() < args.qmin or q.max() > args.qmax:
        raise ValueError(f"{name}.weight is not int{args.num_bits} values stored as int8 [out, in]")
    zero_point = tensors.pop(f"{name}.weight_zero_point", None)
    if zero_point is not None:
        zero_point = zero_point.reshape(q.shape[0], -1)
    packed = pack_quantized.pack_ints(q, tensors.pop(f"{name}.weight_scale"), zero_point, args)
    tensors.update({f"{name}.{k}": v for k, v in packed.items()})
