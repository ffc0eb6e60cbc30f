"""KV-cache quantization: calibrated scales from running |K| / |V| maxima, and the
fake quantization that attention applies to keys (after rotary) and values.

Scales follow vLLM's `k_scale` / `v_scale`: fp8 e4m3 scale = amax / 448, int8
(symmetric) scale = amax / 127; one per layer (strategy "tensor", shape [1]) or one
per KV head (strategy "attn_head", shape [kv_heads]), fp32.
"""

from __future__ import annotations

import dataclasses

import torch

from quantkit.calibration.registry import KV_DTYPES
from quantkit.errors import QuantkitError
from quantkit.primitives import FP8_MAX, dequantize, quantize
from quantkit.scheme import QuantArgs, preset

KV_STRATEGIES = ("tensor", "attn_head")


def kv_args(dtype: str, per_head: bool = False) -> QuantArgs:
    """The KV-cache args of `--kv-cache fp8|int8` (`per_head`: one scale per KV head)."""
    if dtype not in KV_DTYPES:
        raise QuantkitError(f"KV-cache type {dtype!r} is unknown; use fp8 or int8.")
    args = preset(f"kv-{dtype}").kv_cache
    return dataclasses.replace(args, strategy="attn_head") if per_head else args


def check_kv_args(args: QuantArgs) -> None:
    """Raise a `QuantkitError` unless `args` describe a KV cache quantkit can calibrate."""
    if args.num_bits != 8:
        raise QuantkitError(
            f"the KV cache is quantized to 8 bits (fp8 or int8), not {args.num_bits}; use kv-fp8 or kv-int8."
        )
    if not args.symmetric:
        raise QuantkitError("KV-cache quantization is symmetric only; set symmetric: true.")
    if args.strategy not in KV_STRATEGIES:
        raise QuantkitError(f"KV-cache strategy {args.strategy!r} is not supported; use 'tensor' or 'attn_head'.")


def kv_scales(amax: torch.Tensor, args: QuantArgs) -> torch.Tensor:
    """Scales (fp32, [kv_heads] for attn_head, [1] for tensor) from per-head amax [kv_heads].

    A head (or layer) whose amax is 0 gets scale 1, as in `primitives.qparams_from_minmax`:
    finite, positive, and it maps zeros to zeros."""
    check_kv_args(args)
    amax = amax.detach().float().abs().reshape(-1)  # [kv_heads]
    if args.strategy == "tensor":
        amax = amax.amax().reshape(1)  # [1]
    scale = amax / (FP8_MAX if args.type == "float" else args.qmax)
    return torch.where(scale > torch.finfo(torch.float32).tiny, scale, torch.ones_like(scale))


def fake_quantize_kv(x: torch.Tensor, scale: torch.Tensor, args: QuantArgs) -> torch.Tensor:
    """dequantize(quantize(x)) of keys or values x [batch, kv_heads, seq, head_dim] with a
    scale [1] (per tensor) or [kv_heads] (per head); returned in x's dtype."""
    check_kv_args(args)
    heads = x.shape[1]
    scale = scale.reshape(-1)
    if scale.numel() == 1:
        flat, s = x.reshape(1, -1), scale.float().reshape(1)  # [1, b*h*s*d], [1]
        qargs = dataclasses.replace(args, strategy="tensor")
    elif scale.numel() == heads:
        flat = x.transpose(0, 1).reshape(heads, -1)  # [h, b*s*d]
        s, qargs = scale.float().reshape(heads, 1), dataclasses.replace(args, strategy="channel")
    else:
        raise QuantkitError(f"a KV scale has {scale.numel()} values; expected 1 or one per KV head ({heads}).")
    y = dequantize(quantize(flat, s, None, qargs), s, None, qargs, dtype=x.dtype)
    if scale.numel() == 1:
        return y.reshape(x.shape)
    return y.reshape(heads, x.shape[0], *x.shape[2:]).transpose(0, 1)
