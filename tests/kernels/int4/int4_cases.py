"""Shared by the int4 kernel tests: a random weight packed as the packer writes it."""

from __future__ import annotations

import torch

from quantkit.packing import pack
from quantkit.primitives import compute_qparams, full_range_scale, minmax, quantize
from quantkit.scheme import QuantArgs


def quantized(n, k, group_size, symmetric, g_idx=None, seed=0, scale_dtype=torch.bfloat16):
    """(w_packed, scale, zero, args) of a random [n, k] int4 weight (group_size None: per channel).
    Symmetric groups: every other row on the full-range grid, as the clip and range searches may
    choose it (negative scales where a group's max is its end of larger magnitude)."""
    torch.manual_seed(seed)
    args = QuantArgs(
        num_bits=4, symmetric=symmetric, strategy="group" if group_size else "channel", group_size=group_size
    )
    w = torch.randn(n, k)
    scale, zero = compute_qparams(w, args, scale_dtype)
    if symmetric and group_size:
        full = full_range_scale(*minmax(w, args), args, scale_dtype).to(scale_dtype)
        scale = torch.where(torch.arange(n)[:, None] % 2 == 1, full, scale)
        assert (scale < 0).any()
    return pack(quantize(w, scale, zero, args, g_idx)), scale, zero, args
