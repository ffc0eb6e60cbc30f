"""The numerical reference: qparams, quantize, dequantize, fake_quantize.

Everything else (algorithms, packers, kernels' torch twins, evaluation of
fake-quantized models) goes through these functions.

Conventions, as in compressed-tensors so vLLM and transformers agree with us:
- int: signed values in [-2^(b-1), 2^(b-1)-1] (int4: [-8, 7]), stored as int8.
  symmetric: scale = amax / ((qmax - qmin) / 2), zero point 0.
  asymmetric: scale = (max - min) / (qmax - qmin), zero point = round(qmin - min / scale),
  an integer in [qmin, qmax]. min/max are widened to include 0.
- float (fp8 e4m3): scale = amax / 448, values float8_e4m3fn.
- q = clamp(round(x / scale) + zero_point), x' = (q - zero_point) * scale, with
  round-half-to-even, computed in fp32; dequantized values come out in scale's dtype.

Scale shapes (weights [out, in]): group [out, in / group_size], channel [out, 1],
tensor [1]; activations [..., hidden] with strategy token: [..., 1].
"""

from __future__ import annotations

import math

import torch

from quantkit.errors import QuantkitError
from quantkit.scheme import QuantArgs

FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448.0


def _grouped(x: torch.Tensor, args: QuantArgs) -> torch.Tensor:
    """View x as [rows, n_groups, group] according to the strategy."""
    if args.strategy == "group":
        # w [co, ci] -> [co, n_group, group_size]
        return x.reshape(x.shape[0], -1, args.group_size)
    if args.strategy == "channel":
        return x.reshape(x.shape[0], 1, -1)
    if args.strategy == "token":
        return x.reshape(-1, 1, x.shape[-1])
    if args.strategy == "tensor":
        return x.reshape(1, 1, -1)
    raise QuantkitError(f"strategy {args.strategy!r} has no weight/activation grouping.")


def _scale_shape(x: torch.Tensor, args: QuantArgs, n_groups: int) -> tuple[int, ...]:
    if args.strategy in ("group", "channel"):
        return (x.shape[0], n_groups)
    if args.strategy == "token":
        return (*x.shape[:-1], 1)
    return (1,)


def check_group_size(name: str, in_features: int, group_size: int) -> None:
    """Raise a `QuantkitError` naming the layer and the group sizes that would work."""
    if in_features % group_size == 0 and in_features % 8 == 0:
        return
    fits = [g for g in (16, 32, 64, 128, 256) if in_features % g == 0]
    hint = f"use one of {', '.join(map(str, fits))}" if fits else "this layer cannot be group-quantized"
    raise QuantkitError(
        f"group size {group_size} does not divide the input width {in_features} of {name}; {hint} (--group-size)."
    )


def minmax(x: torch.Tensor, args: QuantArgs) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group min and max of x, each shaped like the scale."""
    g = _grouped(x.float(), args)
    shape = _scale_shape(x, args, g.shape[1])
    return g.amin(dim=-1).reshape(shape), g.amax(dim=-1).reshape(shape)


def qparams_from_minmax(
    lo: torch.Tensor, hi: torch.Tensor, args: QuantArgs, scale_dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scale (in `scale_dtype`) and zero point (int8, None when symmetric) from ranges."""
    lo = torch.minimum(lo.float(), torch.zeros_like(lo, dtype=torch.float32))
    hi = torch.maximum(hi.float(), torch.zeros_like(hi, dtype=torch.float32))
    if args.type == "float":
        scale = torch.maximum(-lo, hi) / FP8_MAX
    elif args.symmetric:
        scale = torch.maximum(-lo, hi) / ((args.qmax - args.qmin) / 2)
    else:
        scale = (hi - lo) / (args.qmax - args.qmin)
    tiny = torch.finfo(scale_dtype).tiny
    scale = torch.where(scale > tiny, scale, torch.ones_like(scale)).to(scale_dtype)
    if args.type == "float" or args.symmetric:
        return scale, None
    zero = torch.round(args.qmin - lo / scale.float()).clamp(args.qmin, args.qmax).to(torch.int8)
    return scale, zero


def compute_qparams(
    x: torch.Tensor, args: QuantArgs, scale_dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Min-max scale and zero point of x for `args` (see the module docstring)."""
    return qparams_from_minmax(*minmax(x, args), args, scale_dtype)


def _expand(p: torch.Tensor, x: torch.Tensor, args: QuantArgs, g_idx: torch.Tensor | None) -> torch.Tensor:
    """Broadcast a per-group parameter to x's element grid."""
    if g_idx is not None:  # act-order: column j belongs to group g_idx[j]
        return p[:, g_idx.long()]
    g = _grouped(x, args)
    return p.reshape(g.shape[0], g.shape[1], 1).expand_as(g).reshape(x.shape)


def quantize(
    x: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    args: QuantArgs,
    g_idx: torch.Tensor | None = None,
) -> torch.Tensor:
    """x -> int8 values in [qmin, qmax] (int) or float8_e4m3fn (float); same shape as x."""
    s = _expand(scale.float(), x, args, g_idx)
    y = x.float() / s
    if args.type == "float":
        return y.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    if zero_point is not None:
        y = y + _expand(zero_point.float(), x, args, g_idx)
    return torch.round(y).clamp(args.qmin, args.qmax).to(torch.int8)


def dequantize(
    q: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    args: QuantArgs,
    g_idx: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """(q - zero_point) * scale, computed and returned in scale's dtype (or `dtype`)."""
    s = _expand(scale, q, args, g_idx)
    y = q.to(s.dtype)
    if zero_point is not None:
        y = y - _expand(zero_point, q, args, g_idx).to(s.dtype)
    y = y * s
    return y if dtype is None else y.to(dtype)


def fake_quantize(
    x: torch.Tensor,
    args: QuantArgs,
    scale: torch.Tensor | None = None,
    zero_point: torch.Tensor | None = None,
    g_idx: torch.Tensor | None = None,
) -> torch.Tensor:
    """dequantize(quantize(x)) in x's dtype; min-max qparams when none are given."""
    if scale is None:
        scale, zero_point = compute_qparams(x, args)
    return dequantize(quantize(x, scale, zero_point, args, g_idx), scale, zero_point, args, g_idx, x.dtype)


def sqnr(ref: torch.Tensor, approx: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB (higher is better)."""
    ref, approx = ref.double(), approx.double()
    noise = (ref - approx).pow(2).sum().item()
    return math.inf if noise == 0 else 10 * math.log10(ref.pow(2).sum().item() / noise)
