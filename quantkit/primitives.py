"""The numerical reference: qparams, quantize, dequantize, fake_quantize.

Everything else (algorithms, packers, kernels' torch twins, evaluation of
fake-quantized models) goes through these functions.

Conventions, as in compressed-tensors so vLLM and transformers agree with us:
- int: signed values in [-2^(b-1), 2^(b-1)-1] (int4: [-8, 7]), stored as int8.
  symmetric: scale = amax / ((qmax - qmin) / 2), zero point 0; the searches may store the
  full-range scale instead (`full_range_scale`: the end of larger magnitude on qmin, a negative
  scale when that end is the max), the same format.
  asymmetric: scale = (max - min) / (qmax - qmin), zero point = round(qmin - min / scale),
  an integer in [qmin, qmax]. min/max are widened to include 0.
- float (fp8 e4m3): scale = amax / 448, values float8_e4m3fn; strategy block: one scale per
  [rows, columns] block of the weight (`block_structure`), partial blocks at the edges.
- fp4 e2m1 (values 0, ±0.5, ±1, ±1.5, ±2, ±3, ±4, ±6; `round_e2m1` rounds to nearest, ties to
  the even mantissa, as compressed-tensors' `cast_to_fp4`), in groups of 16 or 32:
  NVFP4 (strategy tensor_group): a float32 global scale gs = 448 * 6 / amax(tensor); each
  group's scale s = fp8_e4m3(amax(group) / 6 * gs) (0 becomes 0.125) is stored, and the
  effective scale is s / gs (computed in fp32, as compressed-tensors divides).
  MX (scale_dtype uint8, groups of 32, fp4 or fp8 values): scale = 2^e with e the exponent of
  amax(group) rounded up to the next power of two when its mantissa is 1.75 or more
  (`round_to_power_2`), minus 2 (fp4: 2^2 ≤ 6) or 8 (fp8: 2^8 ≤ 448), stored as the
  e8m0 byte e + 127 (`mx_exponent`).
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
FP4_MAX = 6.0
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # the non-negative fp4 e2m1 values, by code 0..7
_MX_OFFSET = {4: 2, 8: 8}  # floor(log2(grid max)): fp4 e2m1 6 -> 2, fp8 e4m3 448 -> 8


def round_e2m1(y: torch.Tensor) -> torch.Tensor:
    """y (fp32) to the nearest fp4 e2m1 value, ties to the even mantissa, clamped to ±6; a
    negative y that rounds to 0 gives -0.0 (as compressed-tensors packs it: sign bit set)."""
    a = y.abs()
    r = torch.zeros_like(a)
    for lo, value, inclusive in ((0.25, 0.5, False), (0.75, 1.0, True), (1.25, 1.5, False), (1.75, 2.0, True)):
        r = torch.where(a >= lo if inclusive else a > lo, value, r)
    for lo, value, inclusive in ((2.5, 3.0, False), (3.5, 4.0, True), (5.0, 6.0, False)):
        r = torch.where(a >= lo if inclusive else a > lo, value, r)
    return torch.where(y < 0, -r, r)


def mx_scale(amax: torch.Tensor, num_bits: int) -> torch.Tensor:
    """The MX power-of-two scale (fp32) of groups whose largest magnitude is `amax`."""
    bits = amax.float().contiguous().view(torch.int32)
    p2 = ((bits + (1 << 21)) & 0x7F800000).view(torch.float32)  # round_to_power_2 with e2m1's 1-bit mantissa
    e = (127 + torch.floor(torch.log2(p2)) - _MX_OFFSET[num_bits]).clamp(0, 255).round()
    return torch.pow(2.0, e - 127)


def mx_exponent(scale: torch.Tensor) -> torch.Tensor:
    """The e8m0 byte (uint8, biased by 127) of power-of-two scales."""
    return (127 + torch.floor(torch.log2(scale.float()))).to(torch.int32).to(torch.uint8)


def mx_decode(e: torch.Tensor) -> torch.Tensor:
    """fp32 scales 2^(e - 127) of e8m0 bytes."""
    return torch.pow(2.0, e.to(torch.int32).float() - 127)


def nvfp4_global_scale(amax: torch.Tensor) -> torch.Tensor:
    """NVFP4's float32 global scale [1] for a tensor (or a fused group) whose largest
    magnitude is `amax`: 448 * 6 / amax, 1 when that is not finite."""
    amax = amax.float().reshape(1).clamp_min(torch.finfo(torch.float32).tiny)
    return torch.nan_to_num(FP8_MAX * FP4_MAX / amax, nan=1.0, posinf=1.0, neginf=1.0)


def nvfp4_group_scales(amax: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """NVFP4's stored float8_e4m3fn group scales: amax / 6 * global scale, 0 -> 0.125."""
    s = (amax.float() / FP4_MAX * global_scale.float()).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return torch.where(s.float() == 0, torch.tensor(0.125), s.float()).to(torch.float8_e4m3fn)


def _grouped(x: torch.Tensor, args: QuantArgs) -> torch.Tensor:
    """View x as [rows, n_groups, group] according to the strategy."""
    if args.strategy in ("group", "tensor_group"):
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
    if args.strategy in ("group", "channel", "tensor_group"):
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


def _blocks(x: torch.Tensor, args: QuantArgs) -> torch.Tensor:
    """A [out, in] weight, zero-padded to whole blocks, as [row blocks, columns blocks, rows * columns]."""
    br, bc = args.block_structure
    pr, pc = -x.shape[0] % br, -x.shape[1] % bc
    x = torch.nn.functional.pad(x, (0, pc, 0, pr))
    nr, nc = x.shape[0] // br, x.shape[1] // bc
    return x.reshape(nr, br, nc, bc).transpose(1, 2).reshape(nr, nc, br * bc)


def minmax(x: torch.Tensor, args: QuantArgs) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group min and max of x, each shaped like the scale."""
    if args.strategy == "block":  # [ceil(out / rows), ceil(in / columns)]
        b = _blocks(x.float(), args)
        return b.amin(dim=-1), b.amax(dim=-1)
    g = _grouped(x.float(), args)
    shape = _scale_shape(x, args, g.shape[1])
    return g.amin(dim=-1).reshape(shape), g.amax(dim=-1).reshape(shape)


def qparams_from_minmax(
    lo: torch.Tensor,
    hi: torch.Tensor,
    args: QuantArgs,
    scale_dtype: torch.dtype = torch.float32,
    global_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scale (in `scale_dtype`) and zero point (int8, None when symmetric) from ranges; the
    fp4 / MX grids as `float_scales` (NVFP4: under `global_scale`, else the ranges' own)."""
    lo = torch.minimum(lo.float(), torch.zeros_like(lo, dtype=torch.float32))
    hi = torch.maximum(hi.float(), torch.zeros_like(hi, dtype=torch.float32))
    if args.is_fp4 or args.is_mx or args.strategy == "tensor_group":
        amax = torch.maximum(-lo, hi)
        if args.strategy == "tensor_group" and global_scale is None:
            global_scale = nvfp4_global_scale(amax.max())
        return float_scales(amax, args, global_scale), None
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


def full_range_scale(lo: torch.Tensor, hi: torch.Tensor, args: QuantArgs, scale_dtype=torch.float32) -> torch.Tensor:
    """The "full range" symmetric int scale per group (AutoRound's `quant_tensor_sym`, llama.cpp's
    Q4_0 `d = max / -8`): the end of [min(lo, 0), max(hi, 0)] of larger magnitude (hi on a tie)
    over qmin, so that end quantizes to qmin exactly (negative when it is hi); a scale below
    `scale_dtype`'s tiny becomes 1. Codes stay in [qmin, qmax] and x' = q · scale, the symmetric
    format as stored; against min-max's amax / ((qmax - qmin) / 2) the step is finer (int4:
    amax / 8 against amax / 7.5) and the larger end is not clipped. Differentiable in lo and hi."""
    lo, hi = lo.clamp(max=0), hi.clamp(min=0)
    scale = torch.where(hi < -lo, lo, hi) / args.qmin
    return torch.where(scale.abs() > torch.finfo(scale_dtype).tiny, scale, torch.ones_like(scale))


def float_scales(
    amax: torch.Tensor,
    args: QuantArgs,
    global_scale: torch.Tensor | None = None,
    scale_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The effective fp32 scales of the fp4 / MX / NVFP4 formats from each group's amax (see
    the module docstring; NVFP4 needs the tensor's, or fused group's, `global_scale`), and the
    fp8 block scales, amax / 448 in `scale_dtype`."""
    if args.is_mx:
        return mx_scale(amax, args.num_bits)
    if args.strategy == "tensor_group":
        return nvfp4_group_scales(amax, global_scale).float() / global_scale.float()
    scale = (amax.float() / args.grid_max).to(scale_dtype)
    return torch.where(scale > torch.finfo(scale_dtype).tiny, scale, torch.ones_like(scale))


def compute_qparams(
    x: torch.Tensor,
    args: QuantArgs,
    scale_dtype: torch.dtype = torch.float32,
    global_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Min-max scale and zero point of x for `args` (see the module docstring). The fp4,
    MX formats take fp32 scales whatever `scale_dtype`; NVFP4 takes x's own
    global scale unless one (shared by a fused group) is given; fp8 blocks take `scale_dtype`."""
    lo, hi = minmax(x, args)
    if args.strategy == "block":
        return float_scales(torch.maximum(-lo, hi).clamp_min(0), args, None, scale_dtype), None
    return qparams_from_minmax(lo, hi, args, scale_dtype, global_scale)


def _expand(p: torch.Tensor, x: torch.Tensor, args: QuantArgs, g_idx: torch.Tensor | None) -> torch.Tensor:
    """Broadcast a per-group parameter to x's element grid."""
    if g_idx is not None:  # act-order: column j belongs to group g_idx[j]
        return p[:, g_idx.long()]
    if args.strategy == "block":
        br, bc = args.block_structure
        return p.repeat_interleave(br, 0).repeat_interleave(bc, 1)[: x.shape[0], : x.shape[1]]
    g = _grouped(x, args)
    return p.reshape(g.shape[0], g.shape[1], 1).expand_as(g).reshape(x.shape)


def quantize(
    x: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    args: QuantArgs,
    g_idx: torch.Tensor | None = None,
) -> torch.Tensor:
    """x -> int8 values in [qmin, qmax] (int), float8_e4m3fn (fp8) or fp32 e2m1 values (fp4);
    same shape as x."""
    s = _expand(scale.float(), x, args, g_idx)
    y = x.float() / s
    if args.is_fp4:
        return round_e2m1(y)
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
    if g_idx is None and x.dim() == 2 and args.type == "int" and args.strategy in ("group", "channel"):
        return _fake_quantize_int(x, scale, zero_point, args)
    return dequantize(quantize(x, scale, zero_point, args, g_idx), scale, zero_point, args, g_idx, x.dtype)


def _fake_quantize_int(x, scale, zero_point, args):
    # `fake_quantize` of int groups or channels, bit for bit, in fp32 on x viewed as
    # [rows, n_group, group] against [rows, n_group, 1] parameters (broadcast, not expanded to
    # x's grid; AWQ's searches call this ~10^5 times). dequantize's (q - zero) * scale in a
    # 16-bit scale dtype is one rounding of the exact product: (q - zero) has at most 9
    # significant bits and the scale 8 (bf16) or 11 (fp16), so their fp32 product is exact and
    # rounding it to the scale's dtype gives the same value
    g = _grouped(x.float(), args)
    shape = (g.shape[0], g.shape[1], 1)
    s = scale.float().reshape(shape)
    z = None if zero_point is None else zero_point.float().reshape(shape)
    y = g / s
    if z is not None:
        y += z
    y = y.round_().clamp_(args.qmin, args.qmax)
    if z is not None:
        y -= z
    y *= s
    return y.reshape(x.shape).to(scale.dtype).to(x.dtype)


def sqnr(ref: torch.Tensor, approx: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB (higher is better)."""
    ref, approx = ref.double(), approx.double()
    noise = (ref - approx).pow(2).sum().item()
    return math.inf if noise == 0 else 10 * math.log10(ref.pow(2).sum().item() / noise)
