"""W4A16 and W8A16 for fp32 activations on x86 CPUs with AVX2+FMA or AVX-512, the C++ kernels
of `kernels/int4/int4_avx.cpp` (for CPUs without native bf16, where the engine runs fp32).

    weight, why = repack(w_packed, scales, zeros, group_size, g_idx)   # once, at load
    y = gemm(x, weight)                                                 # x [..., K] -> y [..., N]
    weight8, why = repack_int8(w_int8, scales)                          # per-channel int8 (W8A16)
    y = gemm_int8(x, weight8)

x is any float dtype, converted to fp32 on entry (fp32 products and sums); y comes back in x's
dtype. The weight is dequantized in registers, never as a whole:

- up to `FEW_ROWS[isa]` rows (decode and small batches), lanes along 16 output channels: each
  nibble is converted in place and every row's x[k] broadcast against it into a per-group
  accumulator, folded into y with the group's scale at the group's end; the weight streams once
  per call (4 rows at a time on AVX2, 8 on AVX-512, a tile staying in L1 between them);
- more rows: x is packed once per 128 rows, and 256 k of a panel of 16 (AVX2) or 32 (AVX-512)
  channels at a time are dequantized into an L1 buffer and multiplied by a register-blocked fp32
  micro-kernel (6 x 16 / 8 x 32). Dequantized blocks through torch's fp32 GEMM (at::mm) measured
  slower at every M and are not used.

Layout of the int4 weight `Int4AvxWeight.words` (built here, never saved): int32
[T, K/G, G/8 + 2, 16] with T = ceil(N / 16). For tile t and group g, rows 0 .. G/8-1 hold word
(kb, i) = the 8 nibbles u = q + 8 of channel 16t + i for k = gG + 8kb .. +7, the first in bits
0..3 (the on-disk words of `quantkit.packing`, transposed); row G/8 holds the 16 channels' scales
s and row G/8+1 zs = -(8 + z) s, both as fp32 bits, so w = (q - z) s = u s + zs. Channels past N
are zero. It takes any K (a multiple of 8, as the on-disk words hold), a group size that is a
multiple of 8 dividing K (or per channel), and act-order where sorting the columns makes the
groups contiguous (`perm`: x's columns are permuted once per call). Both layouts (this and the
int8 one below) are copied into `quantkit.kernels.cpu.WEIGHTS`: on 2 MB pages where the OS allows,
one stream in the order the linears are built (a decode step's int4 GEMVs run 1.13-1.32x faster
than on 4 KB pages).

Layout of the int8 weight `Int8AvxWeight.q`: int8 [T, K, 16] (q of channel 16t + i at k) and
`scales` fp32 [16 T]; w = q s.

ISA: `QUANTKIT_ISA=avx2|avx512` (read once, at import) forces one; unset, the widest the CPU
has. The AVX2 code is compiled with AVX-512 disabled (VEX encodings, ymm registers only), so
forcing it on an AVX-512 CPU runs what an AVX2-only CPU runs. `repack(..., isa=)` chooses per
weight (the tests run both).

The extension is built on first use by `cpu_ext.Extension` (the same flags, cache folder and
lock as the other C++ kernels) into `$QUANTKIT_CACHE/ext/int4avx-<key>`, as
`torch.ops.quantkit_int4_avx`; `QUANTKIT_NO_EXT=1` or a failed build make `repack` return
(None, why), and the caller keeps the torch twin.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass

import torch

from quantkit.errors import QuantkitError
from quantkit.kernels import cpu, cpu_ext
from quantkit.kernels.int4.int4pack import _act_order_perm
from quantkit.packing import pack, unpack

ISAS = cpu_ext.ISAS
FEW_ROWS = {"avx2": 12, "avx512": 24}  # the register schedule up to here (measured crossovers)


@dataclass(frozen=True, slots=True)
class Int4AvxWeight:
    """An int4 linear weight [N, K] for `gemm`: `words` (module docstring), `perm` (act-order
    column order, or None), `isa` ("avx2" or "avx512")."""

    out_features: int
    in_features: int
    group_size: int
    words: torch.Tensor
    perm: torch.Tensor | None
    isa: str

    @property
    def nbytes(self) -> int:
        """Bytes of weight data a small-M matmul reads (nibbles and fp32 scales)."""
        return self.words.numel() * 4


@dataclass(frozen=True, slots=True)
class Int8AvxWeight:
    """A per-channel int8 weight [N, K] for `gemm_int8`: `q` int8 [ceil(N/16), K, 16], `scales`
    fp32 [16 ceil(N/16)] (module docstring), `isa`."""

    out_features: int
    in_features: int
    q: torch.Tensor
    scales: torch.Tensor
    isa: str

    @property
    def nbytes(self) -> int:
        return self.q.numel() + self.scales.numel() * 4


def _needs(flags: str) -> str | None:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return "the AVX int4 kernel is for x86-64 CPUs"
    return None if {"avx2", "fma"} <= set(flags.split()) else "this CPU has no AVX2 + FMA"


EXTENSION = cpu_ext.Extension(
    "int4/int4_avx.cpp", "quantkit_int4_avx", "int4_gemm", "the AVX int4 CPU kernel", _needs, prefix="int4avx"
)


_OPS = []  # the loaded ops, once a weight exists (repack succeeded)


def _ops():
    if not _OPS:
        _OPS.append(EXTENSION.load())
    return _OPS[0]


def isa_level() -> int:
    """0: the kernels cannot run here, 1: AVX2 + FMA, 2: AVX-512 too."""
    ops = EXTENSION.load()
    return 0 if ops is None else int(ops.isa_level())


def choose_isa(isa: str | None = None) -> tuple[str | None, str]:
    """(isa, "") for the ISA to run (`isa`, else QUANTKIT_ISA, else the widest), or (None, why)."""
    return cpu_ext.choose_isa(EXTENSION, isa, "AVX-512")


def shape_reason(out_features: int, in_features: int, group_size: int | None) -> str:
    """ "" when the kernel takes this shape, else one sentence saying why not."""
    g = group_size or in_features
    if in_features % 8 or g % 8 or in_features % g:
        return (
            f"the AVX int4 kernel needs a group size that is a multiple of 8 dividing in_features "
            f"(got {g} for {in_features})"
        )
    return ""


def unsupported(
    out_features: int, in_features: int, group_size: int | None, g_idx: torch.Tensor | None = None, isa=None
) -> str:
    """Why the kernel cannot take this weight here ("" when it can): the CPU (or the ISA asked
    for), the shape, or act-order groups that are not contiguous once sorted."""
    why = choose_isa(isa)[1] or shape_reason(out_features, in_features, group_size)
    if not why and g_idx is not None and group_size and _act_order_perm(g_idx, group_size) is None:
        why = "its act-order groups are not contiguous once sorted"
    return why


def repack(
    w_packed: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int | None,
    g_idx: torch.Tensor | None = None,
    isa: str | None = None,
) -> tuple[Int4AvxWeight | None, str]:
    """Pack-quantized int4 -> (`Int4AvxWeight`, what runs), or (None, why it cannot).

    w_packed int32 [N, K/8] (`quantkit.packing`: u = q + 8, 8 nibbles along K per word);
    scales [N, K/G] (or [N, 1] with group_size None: per channel), any float dtype; zeros int8
    [N, K/G] signed zero points or None (symmetric); g_idx int32 [K] act-order groups or None.
    isa: "avx2", "avx512" or None (QUANTKIT_ISA, else the widest). Call once, at load.
    """
    n, k = scales.shape[0], w_packed.shape[1] * 8
    g = group_size or k
    why = unsupported(n, k, group_size, g_idx, isa)
    if why:
        return None, why
    chosen = choose_isa(isa)[0]
    perm = None if g_idx is None or not group_size else _act_order_perm(g_idx, g)
    t, groups = -(-n // 16), k // g
    pad = (0, 0, 0, 16 * t - n)  # zero channels up to a multiple of 16
    words = w_packed.cpu().to(torch.int32)
    if perm is not None:
        words = pack(unpack(words, k)[:, perm])
    words = torch.nn.functional.pad(words, pad)  # [N_pad, K/8]
    words = words.reshape(t, 16, groups, g // 8).permute(0, 2, 3, 1)  # [T, groups, G/8, 16]
    s = scales.cpu().float().expand(n, groups)
    z = torch.zeros_like(s) if zeros is None else zeros.cpu().float().expand(n, groups)
    zs = -(8 + z) * s  # w = (u - 8 - z) s = u s + zs
    sz = torch.nn.functional.pad(torch.stack([s, zs], dim=-1), (0, 0, *pad))  # [N_pad, groups, 2]
    sz = sz.view(torch.int32).reshape(t, 16, groups, 2).permute(0, 2, 3, 1)  # [T, groups, 2, 16]
    words = cpu.WEIGHTS.copy(torch.cat([words, sz], dim=2))  # on 2 MB pages where the OS allows
    weight = Int4AvxWeight(n, k, g, words, perm, chosen)
    return weight, f"the {chosen} int4 kernel (registers up to {FEW_ROWS[chosen]} rows, L1 blocks above)"


def _x2(x: torch.Tensor, k: int) -> torch.Tensor:
    """x [..., K] -> contiguous fp32 [M, K] (x itself when it is one: a few µs a call count at batch 1)."""
    if x.dim() == 2 and x.dtype == torch.float32 and x.is_contiguous():
        return x
    return x.reshape(-1, k).float().contiguous()


def _y(y: torch.Tensor, x: torch.Tensor, n: int) -> torch.Tensor:
    return y if x.dim() == 2 and x.dtype == torch.float32 else y.to(x.dtype).reshape(*x.shape[:-1], n)


def gemm(x: torch.Tensor, weight: Int4AvxWeight) -> torch.Tensor:
    """y = x · dequant(W)ᵀ. x [..., K] any float dtype (computed in fp32); returns [..., N] in
    x's dtype."""
    k, n = weight.in_features, weight.out_features
    if x.shape[-1] != k:
        raise QuantkitError(f"int4 gemm: x has {x.shape[-1]} features, the weight takes {k}.")
    x2 = _x2(x, k)
    if weight.perm is not None:
        x2 = x2.index_select(1, weight.perm)
    isa = 2 if weight.isa == "avx512" else 1
    y = _ops().int4_gemm(x2, weight.words, n, weight.group_size, isa, FEW_ROWS[weight.isa])
    return _y(y, x, n)


def repack_int8(w_int8: torch.Tensor, scales: torch.Tensor, isa: str | None = None) -> tuple[Int8AvxWeight | None, str]:
    """int8 [N, K] symmetric values and per-channel scales [N] or [N, 1] (any float dtype) ->
    (`Int8AvxWeight`, what runs), or (None, why it cannot). Call once, at load."""
    n, k = w_int8.shape
    chosen, why = choose_isa(isa)
    if not why and (w_int8.dtype != torch.int8 or scales.numel() != n):
        why = f"the AVX int8 kernel needs int8 [N, K] and N per-channel scales (got {w_int8.dtype}, {scales.numel()})"
    if why:
        return None, why
    t = -(-n // 16)
    q = torch.nn.functional.pad(w_int8.cpu(), (0, 0, 0, 16 * t - n))
    q = cpu.WEIGHTS.copy(q.reshape(t, 16, k).transpose(1, 2).contiguous())  # [T, K, 16], on 2 MB pages
    s = torch.nn.functional.pad(scales.cpu().float().reshape(n), (0, 16 * t - n)).contiguous()
    return Int8AvxWeight(n, k, q, s, chosen), f"the {chosen} int8 kernel"


def gemm_int8(x: torch.Tensor, weight: Int8AvxWeight) -> torch.Tensor:
    """y = x · (W s)ᵀ. x [..., K] any float dtype (computed in fp32); returns [..., N] in x's dtype."""
    k, n = weight.in_features, weight.out_features
    if x.shape[-1] != k:
        raise QuantkitError(f"int8 gemm: x has {x.shape[-1]} features, the weight takes {k}.")
    isa = 2 if weight.isa == "avx512" else 1
    y = _ops().int8_gemm(_x2(x, k), weight.q, weight.scales, n, isa, FEW_ROWS[weight.isa])
    return _y(y, x, n)
