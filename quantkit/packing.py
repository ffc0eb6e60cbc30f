"""Sub-byte integers packed into int32 words: the one pack/unpack that the checkpoint
formats and the kernels share (bottom layer; imports nothing of quantkit).

`pack` puts 32 / bits signed values (offset by 2^(bits-1), so int4 holds q + 8 in 0..15)
into each int32 word along `dim`, the first value in the lowest bits."""

from __future__ import annotations

import torch


def pack(values: torch.Tensor, num_bits: int = 4, dim: int = 1) -> torch.Tensor:
    """Pack signed ints (int8, in [-2^(b-1), 2^(b-1)-1]) of a 2-D tensor into int32 along `dim`."""
    per_word = 32 // num_bits
    v = values if dim == 1 else values.t()
    rows, cols = v.shape
    pad = -cols % per_word
    u = (v.to(torch.int64) + (1 << (num_bits - 1))) & ((1 << num_bits) - 1)
    u = torch.nn.functional.pad(u, (0, pad)).reshape(rows, -1, per_word)
    shifts = torch.arange(per_word, dtype=torch.int64) * num_bits
    words = (u << shifts).sum(dim=-1)  # < 2^32, fits int64
    words = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
    return words if dim == 1 else words.t().contiguous()


def unpack(packed: torch.Tensor, n: int, num_bits: int = 4, dim: int = 1) -> torch.Tensor:
    """Inverse of `pack`: int8 values, `n` of them along `dim`."""
    per_word = 32 // num_bits
    p = packed if dim == 1 else packed.t()
    shifts = torch.arange(per_word, dtype=torch.int64, device=p.device) * num_bits
    u = (p.to(torch.int64).unsqueeze(-1) >> shifts) & ((1 << num_bits) - 1)
    v = (u.reshape(p.shape[0], -1)[:, :n] - (1 << (num_bits - 1))).to(torch.int8)
    return v if dim == 1 else v.t().contiguous()
