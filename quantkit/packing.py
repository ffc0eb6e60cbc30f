"""Sub-byte integers packed into int32 words: the one pack/unpack that the checkpoint
formats and the kernels share (bottom layer; imports nothing of quantkit).

`pack` writes signed values offset by 2^(bits-1) (int4 holds q + 8 in 0..15) as one dense
little-end-first bit stream per row along `dim`, as compressed-tensors' `pack_to_int32`
does: value j occupies bits [bits*j, bits*(j+1)) of the row, the first value in the lowest
bits of the first word, and a value may straddle two words (3 bits: 32 values in 3 words).
A row of n values takes ceil(n * bits / 32) words. For bits that divide 32 (2, 4, 8) no
value straddles: word j // (32 / bits) holds value j at bit bits * (j % (32 / bits))."""

from __future__ import annotations

import torch


def packed_words(n: int, num_bits: int) -> int:
    """Words of a packed row of `n` values."""
    return -(-n * num_bits // 32)


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 words in [0, 2^32) as the int32 of the same bits."""
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def pack(values: torch.Tensor, num_bits: int = 4, dim: int = 1) -> torch.Tensor:
    """Pack signed ints (int8, in [-2^(b-1), 2^(b-1)-1]) of a 2-D tensor into int32 along `dim`."""
    v = values if dim == 1 else values.t()
    rows, cols = v.shape
    u = (v.to(torch.int64) + (1 << (num_bits - 1))) & ((1 << num_bits) - 1)
    if 32 % num_bits == 0:
        per_word = 32 // num_bits
        u = torch.nn.functional.pad(u, (0, -cols % per_word)).reshape(rows, -1, per_word)
        shifts = torch.arange(per_word, dtype=torch.int64, device=u.device) * num_bits
        words = _to_int32((u << shifts).sum(dim=-1))  # < 2^32, fits int64
    else:  # 32 values fill num_bits words exactly; each value's low bits, then its spill
        u = torch.nn.functional.pad(u, (0, -cols % 32)).reshape(rows, -1, 32)
        start = torch.arange(32, dtype=torch.int64, device=u.device) * num_bits
        word, offset = start // 32, start % 32
        low = (u << offset) & 0xFFFFFFFF
        spill = torch.where(offset + num_bits > 32, u >> (32 - offset), torch.zeros_like(u))
        out = torch.zeros(rows, u.shape[1], num_bits + 1, dtype=torch.int64, device=u.device)
        out.index_add_(2, word, low).index_add_(2, word + 1, spill)  # disjoint bits: + is |
        words = _to_int32(out[..., :num_bits].reshape(rows, -1)[:, : packed_words(cols, num_bits)])
    return words if dim == 1 else words.t().contiguous()


def unpack(packed: torch.Tensor, n: int, num_bits: int = 4, dim: int = 1) -> torch.Tensor:
    """Inverse of `pack`: int8 values, `n` of them along `dim`."""
    p = packed if dim == 1 else packed.t()
    w = p.to(torch.int64) & 0xFFFFFFFF
    if 32 % num_bits == 0:
        per_word = 32 // num_bits
        shifts = torch.arange(per_word, dtype=torch.int64, device=p.device) * num_bits
        u = ((w.unsqueeze(-1) >> shifts) & ((1 << num_bits) - 1)).reshape(p.shape[0], -1)
    else:
        w = torch.nn.functional.pad(w, (0, -w.shape[1] % num_bits + 1)).reshape(p.shape[0], -1)
        start = torch.arange(-(-n // 32) * 32, dtype=torch.int64, device=p.device) * num_bits
        word, offset = start // 32, start % 32
        both = w[:, word] | (w[:, word + 1] << 32)  # the value's word and the next, as one 64-bit field
        u = (both >> offset) & ((1 << num_bits) - 1)
    v = (u[:, :n] - (1 << (num_bits - 1))).to(torch.int8)
    return v if dim == 1 else v.t().contiguous()
