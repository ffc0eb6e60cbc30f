"""llama.cpp's GGUF block types: choosing their parameters, and packing them byte for byte.

Every type stores each row of a weight [rows, cols] in blocks along the input dimension.
Inside a block, each sub-block of `sub` weights has a float scale s and offset m and an
integer code q per weight, and a weight's value is s · (q − zero) + m (in float32, in the
order llama.cpp's dequantization computes it). How s and m are stored is the type's:

| type | block | sub | codes | s | m |
|---|---|---|---|---|---|
| Q8_0 | 32 | 32 | −127..127 | fp16 d | 0 |
| Q4_0 / Q5_0 | 32 | 32 | 0..15 / 0..31, zero 8 / 16 | fp16 d | 0 |
| Q4_1 / Q5_1 | 32 | 32 | 0..15 / 0..31 | fp16 d | fp16 m |
| Q4_K / Q5_K | 256 | 32 | 0..15 / 0..31 | fp16 d × 6-bit sc | −(fp16 dmin × 6-bit mn) |
| Q6_K | 256 | 16 | 0..63, zero 32 | fp16 d × int8 sc | 0 |

`Blocks` holds one tensor's stored integers (d, sc, ...) and codes; `choose` picks the
stored parameters of each block from the weights (an importance-weighted search over
scales like llama.cpp's make_qx/make_qkx, with a least-squares refit), `grid` gives the
float s and m of every sub-block, `codes` rounds weights onto that grid, `pack` writes the
bytes of ggml-common.h's block structs and `unpack` reads them back.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from quantkit.errors import QuantkitError


@dataclass(frozen=True)
class BlockType:
    name: str
    ggml: int  # ggml_type id (GGMLQuantizationType)
    block: int  # weights per block
    sub: int  # weights per sub-block (one s and m)
    qmin: int
    qmax: int
    zero: int
    offset: str  # "none", "float" (fp16 m), "kquant" (dmin × 6-bit mn)
    nbytes: int  # bytes per block
    scale_bits: int = 0  # K-quants: bits of a sub-block's scale


TYPES = {
    t.name: t
    for t in (
        BlockType("q8_0", 8, 32, 32, -127, 127, 0, "none", 34),
        BlockType("q4_0", 2, 32, 32, 0, 15, 8, "none", 18),
        BlockType("q4_1", 3, 32, 32, 0, 15, 0, "float", 20),
        BlockType("q5_0", 6, 32, 32, 0, 31, 16, "none", 22),
        BlockType("q5_1", 7, 32, 32, 0, 31, 0, "float", 24),
        BlockType("q4_k", 12, 256, 32, 0, 15, 0, "kquant", 144, 6),
        BlockType("q5_k", 13, 256, 32, 0, 31, 0, "kquant", 176, 6),
        BlockType("q6_k", 14, 256, 16, 0, 63, 32, "none", 210, 8),
    )
}


@dataclass
class Blocks:
    """One tensor [rows, cols] in a block type: its codes [rows, cols] (int32) and stored
    parameters, each [rows, blocks] (d, dmin, m: fp16 values as float32) or
    [rows, blocks, sub-blocks per block] (sc, mn: integers as int32)."""

    type: BlockType
    q: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None = None  # Q4_1/Q5_1 min, K-quant dmin
    sc: torch.Tensor | None = None  # K-quant sub-block scales
    mn: torch.Tensor | None = None  # Q4_K/Q5_K sub-block mins

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)


def block_type(name: str) -> BlockType:
    if name not in TYPES:
        raise QuantkitError(f"unknown GGUF block type {name!r}; choose one of {', '.join(TYPES)}.")
    return TYPES[name]


def fp16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float16).to(torch.float32)


def grid(b: Blocks) -> tuple[torch.Tensor, torch.Tensor]:
    """s and m of every sub-block, [rows, cols // sub] float32, as llama.cpp computes them."""
    t = b.type
    if t.offset == "kquant":
        s = (b.d.unsqueeze(-1) * b.sc.float()).flatten(1)
        m = -(b.m.unsqueeze(-1) * b.mn.float()).flatten(1)
        return s, m
    if t.name == "q6_k":
        return (b.d.unsqueeze(-1) * b.sc.float()).flatten(1), torch.zeros(1)
    return b.d, (b.m if t.offset == "float" else torch.zeros(1))


def _expand(x: torch.Tensor, sub: int) -> torch.Tensor:
    return x.repeat_interleave(sub, dim=-1) if x.dim() == 2 else x


def dequantize(b: Blocks) -> torch.Tensor:
    """The float32 weights [rows, cols] the blocks stand for (llama.cpp's values exactly)."""
    s, m = grid(b)
    t = b.type
    out = _expand(s, t.sub) * (b.q - t.zero).float()
    return out + _expand(m, t.sub) if t.offset != "none" else out


def round_codes(w: torch.Tensor, s: torch.Tensor, m: torch.Tensor, t: BlockType) -> torch.Tensor:
    """Nearest codes of weights w on grids s, m broadcast to w's shape (s = 0: code `zero`)."""
    safe = torch.where(s == 0, torch.ones_like(s), s)
    q = torch.round((w - m) / safe) + t.zero
    q = torch.where(s == 0, torch.full_like(q, t.zero if t.offset == "none" else 0), q)
    return q.clamp(t.qmin, t.qmax).to(torch.int32)


def codes(w: torch.Tensor, b: Blocks) -> torch.Tensor:
    s, m = grid(b)
    return round_codes(w.float(), _expand(s, b.type.sub), _expand(m, b.type.sub), b.type)


# -- choosing parameters -------------------------------------------------------------


def _wsum(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x * w).sum(-1)


def search_symmetric(x: torch.Tensor, w: torch.Tensor, lo: int, hi: int, steps: int = 4) -> torch.Tensor:
    """Scale d [N] of each row of x [N, g] on the levels lo..hi (lo < 0 < hi): candidates map
    the largest-magnitude weight to near either end, each refit by weighted least squares
    (d = Σ w x L / Σ w L², whose error is Σ w x² − (Σ w x L)² / Σ w L²); the one with the
    least error wins."""
    idx = x.abs().argmax(-1, keepdim=True)
    peak = x.gather(-1, idx).squeeze(-1)
    safe = torch.where(peak == 0, torch.ones_like(peak), peak)
    xw = x * w
    best_d = torch.zeros_like(peak)
    best_gain = torch.full_like(peak, -1.0)
    for end in (lo, hi):
        for k in range(-steps, steps + 1):
            level = end + 0.1 * k * (1 if end < 0 else -1)
            L = torch.round(x * (level / safe).unsqueeze(-1)).clamp_(lo, hi)
            num = (xw * L).sum(-1)
            den = (L.mul_(L).mul_(w)).sum(-1).clamp_min(1e-30)
            gain = num * num / den  # the error is Σ w x² − gain
            better = gain > best_gain
            best_d = torch.where(better, num / den, best_d)
            best_gain = torch.where(better, gain, best_gain)
    return torch.where(peak == 0, torch.zeros_like(best_d), best_d)


def search_asymmetric(
    x: torch.Tensor, w: torch.Tensor, nmax: int, min_le_zero: bool, steps: int = 10
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale s ≥ 0 and offset m [N] of each row of x [N, g] on levels 0..nmax (x ≈ s L + m),
    as llama.cpp's make_qkx2: candidate steps (max − min)/(nmax + 0.1 k), k = −steps..steps
    (its rmin −1, rdelta 0.1, nstep 20), each refit by weighted least squares for (s, m); m ≤ 0
    when `min_le_zero` (the K-quants store −m). The error Σ w (x − s L − m)² comes from the
    weighted sums, not from the residuals. The range down to nmax − 1 matters for weights that
    were dequantized from this grid: a block whose codes span 0..14 is found again exactly."""
    lo = x.min(-1).values
    if min_le_zero:
        lo = lo.clamp(max=0)
    hi = x.max(-1).values
    span = (hi - lo).clamp_min(1e-30)
    sw, xw = w.sum(-1), x * w
    swx, swx2 = xw.sum(-1), (xw * x).sum(-1)
    best_s, best_m, best_err = span / nmax, lo, torch.full_like(lo, float("inf"))
    shifted = x - lo[:, None]
    for k in range(-steps, steps + 1):
        iscale = (nmax + 0.1 * k) / span  # k = 0: plain min-max
        L = torch.round(shifted * iscale[:, None]).clamp_(0, nmax)
        swl, swlx = (w * L).sum(-1), (xw * L).sum(-1)
        swl2 = (L.mul_(L).mul_(w)).sum(-1)
        det = sw * swl2 - swl * swl
        ok = det > 0
        det = det.where(ok, torch.ones_like(det))
        s = torch.where(ok, (sw * swlx - swl * swx) / det, best_s)
        m = torch.where(ok, (swl2 * swx - swl * swlx) / det, best_m)
        if min_le_zero:
            pos = m > 0
            s = torch.where(pos, swlx / swl2.clamp_min(1e-30), s)
            m = torch.where(pos, torch.zeros_like(m), m)
        err = swx2 - 2 * s * swlx - 2 * m * swx + s * s * swl2 + 2 * s * m * swl + m * m * sw
        better = (err < best_err) & (s > 0)
        best_s, best_m, best_err = best_s.where(~better, s), best_m.where(~better, m), best_err.where(~better, err)
    flat = hi == lo
    return best_s.where(~flat, torch.zeros_like(best_s)), best_m.where(~flat, lo)


def choose(w: torch.Tensor, t: BlockType, importance: torch.Tensor | None = None) -> Blocks:
    """Stored parameters and nearest codes of weights w [rows, cols] (cols a multiple of
    t.block) in type t. `importance` [cols] (e.g. the mean squared input of each column,
    the diagonal of GPTQ's Hessian) weights the error the search minimises; None: x²
    plus its mean, as llama.cpp weighs without an importance matrix."""
    w = w.float()
    rows, cols = w.shape
    if cols % t.block:
        raise QuantkitError(f"a {t.name} row must hold a multiple of {t.block} weights, not {cols}.")
    x = w.reshape(-1, t.sub)
    if importance is None:
        weight = x * x + (x * x).mean(-1, keepdim=True)
    else:
        weight = importance.float().clamp_min(0).expand(rows, cols).reshape(-1, t.sub) + 1e-12
    if t.offset == "float":
        s, m = search_asymmetric(x, weight, t.qmax, False)
        b = Blocks(t, torch.zeros(0), fp16(s).reshape(rows, -1), fp16(m).reshape(rows, -1))
    elif t.offset == "kquant":
        b = _kquant_params(x, weight, t, rows)
    elif t.name == "q6_k":
        b = _q6k_params(x, weight, t, rows)
    else:
        d = search_symmetric(x, weight, t.qmin - t.zero, t.qmax - t.zero, steps=1 if t.qmax > 100 else 4)
        b = Blocks(t, torch.zeros(0), fp16(d).reshape(rows, -1))
    return replace(b, q=codes(w, b))


def _kquant_params(x, weight, t: BlockType, rows: int) -> Blocks:
    s, m = search_asymmetric(x, weight, t.qmax, True)
    per = t.block // t.sub
    s, neg_m = s.reshape(rows, -1, per), (-m).reshape(rows, -1, per)
    top = (1 << t.scale_bits) - 1
    d = fp16(s.amax(-1) / top)
    dmin = fp16(neg_m.amax(-1) / top)
    sc = torch.round(s / d.where(d > 0, torch.ones_like(d)).unsqueeze(-1)).clamp(0, top).to(torch.int32)
    mn = torch.round(neg_m / dmin.where(dmin > 0, torch.ones_like(dmin)).unsqueeze(-1)).clamp(0, top).to(torch.int32)
    return Blocks(t, torch.zeros(0), d, dmin, sc, mn)


def _q6k_params(x, weight, t: BlockType, rows: int) -> Blocks:
    s = search_symmetric(x, weight, t.qmin - t.zero, t.qmax - t.zero).reshape(rows, -1, t.block // t.sub)
    idx = s.abs().argmax(-1, keepdim=True)
    peak = s.gather(-1, idx).squeeze(-1)
    iscale = torch.where(peak == 0, torch.zeros_like(peak), -128.0 / peak.where(peak != 0, torch.ones_like(peak)))
    sc = torch.round(iscale.unsqueeze(-1) * s).clamp(-128, 127).to(torch.int32)
    d = fp16(
        torch.where(iscale == 0, torch.zeros_like(iscale), 1.0 / iscale.where(iscale != 0, torch.ones_like(iscale)))
    )
    return Blocks(t, torch.zeros(0), d, sc=sc)
