"""Shared by the int4 kernel tests: a random weight packed as the packer writes it."""

from __future__ import annotations

import torch

from quantkit.packing import pack
from quantkit.primitives import compute_qparams, quantize
from quantkit.scheme import QuantArgs


def quantized(n, k, group_size, symmetric, g_idx=None, seed=0, scale_dtype=torch.bfloat16):
    """(w_packed, scale, zero, args) of a random [n, k] int4 weight (group_size None: per channel)."""
    torch.manual_seed(seed)
    args = QuantArgs(
        num_bits=4, symmetric=symmetric, strategy="group" if group_size else "channel", group_size=group_size
    )
    w = torch.randn(n, k)
    scale, zero = compute_qparams(w, args, scale_dtype)
    return pack(quantize(w, scale, zero, args, g_idx)), scale, zero, args
