"""The element-wise steps of a decoder block: transformers' own torch code, the twins of
`fused.cpp` (its header says where each rounds), and the greedy sampler's argmax."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool = False) -> torch.Tensor:
    """RMSNorm over the last dim as Llama computes it (`weight` times the normalised x in x's
    dtype) or, with gemma, as Gemma does ((1 + weight) times it, in fp32, then x's dtype)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if gemma:
        return (h * (1.0 + weight.float())).to(x.dtype)
    return weight * h.to(x.dtype)


def add_rms_norm_(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool = False):
    """x += delta in place (the residual stream), then `rms_norm(x)`."""
    return rms_norm(x.add_(delta), weight, eps, gemma)


def rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin with rotate_half(x) = [-x2, x1] written as [x2, x1] * [-sin1, sin2]
    (the same products and sum as transformers'); x [T, heads, D], cos/sin [T, 1, R]: with
    R < D (partial rotary) only the first R dims rotate."""
    rotary = cos.shape[-1]
    if rotary < x.shape[-1]:
        return torch.cat([rope(x[..., :rotary], cos, sin_signed), x[..., rotary:]], dim=-1)
    swapped = x.unflatten(-1, (2, -1)).flip(-2).flatten(-2)  # [x2, x1]
    return x * cos + swapped * sin_signed


def rope_(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> None:
    """`rope` in place: x [T, heads, D], cos and sign-folded sin [T, R]."""
    x.copy_(rope(x, cos[:, None], sin_signed[:, None]))


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [T, 2I] = [gate, up]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(-1) for x [rows, vocab]: the first index of each row's maximum (NaN the largest)."""
    return x.argmax(-1)
