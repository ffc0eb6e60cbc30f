"""The bytes of llama.cpp's block structs (ggml-common.h) for `formats.gguf.Blocks`, and back.

`pack(blocks)` gives a uint8 array [rows, blocks per row × bytes per block], the layout a
GGUF tensor of that type holds; `unpack(type, data, cols)` reads it into `Blocks` again, so
pack → unpack gives back every stored integer and code.
"""

from __future__ import annotations

import numpy as np
import torch

from quantkit.formats.gguf import Blocks, BlockType

# -- helpers ---------------------------------------------------------------------------


def _half(x: torch.Tensor) -> np.ndarray:
    """fp16 values [..] as their 2 little-endian bytes [.., 2]."""
    return x.numpy().astype("<f2").view(np.uint8).reshape(*x.shape, 2)


def _from_half(b: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(b).view("<f2")[..., 0].astype(np.float32))


def _nibbles(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    return (lo & 15 | (hi & 15) << 4).astype(np.uint8)


def _bits_le(bits: np.ndarray) -> np.ndarray:
    """Bits [..., 8k] (0/1) as k bytes, bit i of byte j = bits[8 j + i]."""
    return np.packbits(bits.astype(np.uint8), axis=-1, bitorder="little")


def _unbits_le(b: np.ndarray) -> np.ndarray:
    return np.unpackbits(b, axis=-1, bitorder="little").astype(np.int32)


# -- 32-weight types -------------------------------------------------------------------


def _pack_small(b: Blocks) -> np.ndarray:
    t = b.type
    rows, cols = b.shape
    q = b.q.numpy().reshape(rows, cols // 32, 32)
    parts = [_half(b.d)]
    if t.offset == "float":
        parts.append(_half(b.m))
    if t.name == "q8_0":
        parts.append(q.astype(np.int8).view(np.uint8))
    else:
        if t.qmax == 31:
            parts.append(_bits_le(q >> 4 & 1))
        parts.append(_nibbles(q[..., :16], q[..., 16:]))
    return np.concatenate(parts, axis=-1).reshape(rows, -1)


def _unpack_small(t: BlockType, data: np.ndarray, cols: int) -> Blocks:
    rows = data.shape[0]
    x = data.reshape(rows, cols // 32, t.nbytes)
    d = _from_half(x[..., 0:2])
    at, m = 2, None
    if t.offset == "float":
        m, at = _from_half(x[..., 2:4]), 4
    if t.name == "q8_0":
        q = x[..., at:].view(np.int8).astype(np.int32)
    else:
        high = 0
        if t.qmax == 31:
            high, at = _unbits_le(x[..., at : at + 4]) << 4, at + 4
        qs = x[..., at:].astype(np.int32)
        q = np.concatenate([qs & 15, qs >> 4], axis=-1) | high
    return Blocks(t, torch.from_numpy(q.reshape(rows, cols)), d, m)


# -- K-quants --------------------------------------------------------------------------


def _pack_scales_k4(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """8 six-bit scales and mins [..., 8] into K_SCALE_SIZE = 12 bytes (get_scale_min_k4's inverse)."""
    out = np.empty((*sc.shape[:-1], 12), dtype=np.uint8)
    out[..., 0:4] = sc[..., :4] | (sc[..., 4:] >> 4) << 6
    out[..., 4:8] = mn[..., :4] | (mn[..., 4:] >> 4) << 6
    out[..., 8:12] = (sc[..., 4:] & 15) | (mn[..., 4:] & 15) << 4
    return out


def _unpack_scales_k4(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    s = s.astype(np.int32)
    sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 15) | (s[..., 0:4] >> 6) << 4], axis=-1)
    mn = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | (s[..., 4:8] >> 6) << 4], axis=-1)
    return sc, mn


def _pack_k(b: Blocks) -> np.ndarray:
    rows, cols = b.shape
    nb = cols // 256
    q = b.q.numpy().reshape(rows, nb, 4, 2, 32)  # chunk c of 64: halves h of 32, lane l
    parts = [_half(b.d), _half(b.m), _pack_scales_k4(b.sc.numpy(), b.mn.numpy())]
    if b.type.qmax == 31:  # qh[l] bit 2c + h = the 5th bit of element 64 c + 32 h + l
        parts.append(_bits_le((q >> 4 & 1).transpose(0, 1, 4, 2, 3).reshape(rows, nb, 32 * 8)))
    parts.append(_nibbles(q[:, :, :, 0], q[:, :, :, 1]).reshape(rows, nb, 128))
    return np.concatenate(parts, axis=-1).reshape(rows, -1)


def _unpack_k(t: BlockType, data: np.ndarray, cols: int) -> Blocks:
    rows, nb = data.shape[0], cols // 256
    x = data.reshape(rows, nb, t.nbytes)
    d, dmin = _from_half(x[..., 0:2]), _from_half(x[..., 2:4])
    sc, mn = _unpack_scales_k4(x[..., 4:16])
    at, high = 16, 0
    if t.qmax == 31:
        bits = _unbits_le(x[..., 16:48]).reshape(rows, nb, 32, 4, 2)
        high, at = bits.transpose(0, 1, 3, 4, 2) << 4, 48
    qs = x[..., at : at + 128].reshape(rows, nb, 4, 1, 32).astype(np.int32)
    q = np.concatenate([qs & 15, qs >> 4], axis=3) | high
    return Blocks(t, torch.from_numpy(q.reshape(rows, cols)), d, dmin, torch.from_numpy(sc), torch.from_numpy(mn))


def _pack_q6k(b: Blocks) -> np.ndarray:
    rows, cols = b.shape
    nb = cols // 256
    q = b.q.numpy().reshape(rows, nb, 2, 4, 32)  # half n, quarter k (element 128 n + 32 k + l)
    ql = np.stack([_nibbles(q[:, :, :, 0], q[:, :, :, 2]), _nibbles(q[:, :, :, 1], q[:, :, :, 3])], axis=3)
    hi = q >> 4 & 3
    qh = (hi[:, :, :, 0] | hi[:, :, :, 1] << 2 | hi[:, :, :, 2] << 4 | hi[:, :, :, 3] << 6).astype(np.uint8)
    sc = b.sc.numpy().astype(np.int8).view(np.uint8)
    parts = [ql.reshape(rows, nb, 128), qh.reshape(rows, nb, 64), sc, _half(b.d)]
    return np.concatenate(parts, axis=-1).reshape(rows, -1)


def _unpack_q6k(t: BlockType, data: np.ndarray, cols: int) -> Blocks:
    rows, nb = data.shape[0], cols // 256
    x = data.reshape(rows, nb, t.nbytes)
    ql = x[..., :128].reshape(rows, nb, 2, 2, 32).astype(np.int32)
    qh = x[..., 128:192].reshape(rows, nb, 2, 1, 32).astype(np.int32)
    low = np.concatenate([ql & 15, ql >> 4], axis=3)  # quarters 0, 1, 2, 3
    high = qh >> np.array([0, 2, 4, 6]).reshape(1, 1, 1, 4, 1) & 3
    q = low | high << 4
    sc = torch.from_numpy(x[..., 192:208].view(np.int8).astype(np.int32))
    return Blocks(t, torch.from_numpy(q.reshape(rows, cols)), _from_half(x[..., 208:210]), sc=sc)


def pack(b: Blocks) -> np.ndarray:
    """The tensor's bytes [rows, cols / block × nbytes] (uint8)."""
    if b.type.offset == "kquant":
        return _pack_k(b)
    if b.type.name == "q6_k":
        return _pack_q6k(b)
    return _pack_small(b)


def unpack(t: BlockType, data: np.ndarray, cols: int) -> Blocks:
    """`pack`'s inverse: data [rows, bytes per row] of a tensor with `cols` weights per row."""
    data = np.ascontiguousarray(data, dtype=np.uint8).reshape(-1, cols // t.block * t.nbytes)
    if t.offset == "kquant":
        return _unpack_k(t, data, cols)
    if t.name == "q6_k":
        return _unpack_q6k(t, data, cols)
    return _unpack_small(t, data, cols)
