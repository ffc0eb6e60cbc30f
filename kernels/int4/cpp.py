"""W4A16 on x86 CPUs: the AMX / AVX512-BF16 kernel of `kernels/int4/int4_gemm.cpp`, and torch's
paths where the CPU has no AMX.

    weight, why = repack(w_packed, scales, zeros, group_size, g_idx)   # once, at load
    y = gemm(x, weight)                                                 # x [..., K] -> y [..., N]

`repack` builds the weight for one kernel (`Int4Weight.kernel`); the engine chooses which at load
(`quantkit.kernels.int4.CANDIDATES`) and binds `gemm_amx` or `gemm_int4pack`; `gemm` takes either.

- `amx` (AMX-BF16, the extension built): up to `GEMV_ROWS` rows (decode), no tiles: the weight
  streams once, looked up into bf16 and multiplied with x by AVX512-BF16 dot products (lanes
  along k, fp32 sums; ~2x faster than the tiles at one row, where they waste 15 of 16 tile
  rows); up to `AMX_FEW_ROWS` rows (32 at a time), the weight
  is looked up into bf16 8 k steps at a time, in L1, and multiplied at once on the tiles; more rows, the
  weight is looked up once per call into VNNI tiles (~0.5 MB at a time, in L2) and x's tiles
  are read in place, 8 k steps at a time. The schedule is the C++ kernel's, by row count, per
  call; a dense path (whole weight dequantized + oneDNN) measured slower than both at every M and
  is not taken.
- `int4pack` (any other CPU: AVX2, AVX-512 without AMX; or no build): torch's
  `_weight_int4pack_mm_for_cpu` (`quantkit.kernels.int4.int4pack`) below `DENSE_MIN_M` rows, the
  twin's dequantization + an fp32 matmul from there (a bf16 matmul is slow without native bf16).

Layout of the `amx` weight (built here, never saved; the C++ file's header says how it is read):
`nibbles` int16 [N_pad/4, K], word (c, k) holding u = q + 8 of channels 4c .. 4c+3 at bits 0, 4,
8, 12; `scales` and `zs` float [N_pad, K/G] with zs = -(8 + z) · s, so w = (q - z) · s = u · s + zs
(exact in fp32 for bf16 scales: the weights equal the twin's, bit for bit). N_pad is N rounded up
to 16 (zero channels). It takes K % 32 == 0 and a group size that is a multiple of 32 dividing K
(per-channel: one group of K); act-order where sorting the columns makes the groups contiguous.

`QUANTKIT_INT4_KERNEL=int4pack` (or `repack(..., kernel="int4pack")`) forces the fallback;
`QUANTKIT_NO_EXT=1` leaves the extension unbuilt, as for `cpu_ext`; so does a CPU without AMX-BF16.

The extension is built with `torch.utils.cpp_extension` on first use, into
`$QUANTKIT_CACHE/ext/int4-<key>` (the key hashes the source, flags, torch, Python, compiler and
CPU flags), by `cpu_ext.Extension` (the same flags and build lock as the other C++ kernels).
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass

import torch

from quantkit.errors import QuantkitError
from quantkit.kernels import cpu_ext
from quantkit.kernels.int4 import int4pack
from quantkit.kernels.int4 import twin as int4_twin
from quantkit.packing import unpack

KERNELS = ("amx", "int4pack")
GEMV_ROWS = 4  # the C++ kernel's AVX512-BF16 dot products up to here (measured: ~2x the tiles at 4 rows, slower at 8)
AMX_FEW_ROWS = 64  # the C++ kernel's crossover (measured: the two schedules are level at 64-96 rows)
DENSE_MIN_M = 512  # int4pack: from here dequantize + fp32 matmul wins (measured on AVX2)


@dataclass(frozen=True, slots=True)
class Int4Weight:
    """An int4 linear weight [N, K] ready for `gemm`. `kernel` is one of KERNELS; `amx` holds
    `nibbles`, `scales`, `zs` (module docstring) and `perm` (act-order column order, or None);
    `int4pack` holds torch's weight in `fallback`. `source` is the pack-quantized tensors
    (w_packed, scales, zeros, group_size, g_idx) for the dense path, the caller's own tensors."""

    kernel: str
    out_features: int
    in_features: int
    group_size: int
    source: tuple
    nibbles: torch.Tensor | None = None
    scales: torch.Tensor | None = None
    zs: torch.Tensor | None = None
    perm: torch.Tensor | None = None
    fallback: int4pack.Int4CpuWeight | None = None

    @property
    def nbytes(self) -> int:
        """Bytes of weight data one small-M matmul reads."""
        if self.fallback is not None:
            return self.fallback.nbytes
        return sum(t.numel() * t.element_size() for t in (self.nibbles, self.scales, self.zs))


def _needs(flags: str) -> str | None:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return "the int4 CPU kernel is for x86-64 CPUs"
    return None if "amx_bf16" in flags.split() else "this CPU has no AMX-BF16"


EXTENSION = cpu_ext.Extension("int4/int4_gemm.cpp", "quantkit_int4", "gemm", "the AMX int4 CPU kernel", needs=_needs)
_load = EXTENSION.load


def available() -> bool:
    """True when the AMX kernel runs here (AMX-BF16, the OS allows it, the extension built)."""
    ops = _load()
    return ops is not None and int(ops.isa_level()) == 2


def reason() -> str:
    """Why `available()` is False ("" when it is True)."""
    ops = _load()
    if ops is None:
        return EXTENSION.reason()
    return "" if int(ops.isa_level()) == 2 else str(ops.isa_note())


def shape_reason(out_features: int, in_features: int, group_size: int | None) -> str:
    """ "" when the AMX kernel takes this shape, else one sentence saying why not."""
    g = group_size or in_features
    if in_features % 32:
        return f"the AMX int4 kernel needs in_features % 32 == 0 (got {in_features})"
    if g % 32 or in_features % g:
        return f"the AMX int4 kernel needs a group size that is a multiple of 32 dividing {in_features} (got {g})"
    return ""


def amx_unsupported(out_features: int, in_features: int, group_size: int | None, g_idx: torch.Tensor | None) -> str:
    """ "" when the AMX kernel runs here and takes this weight, else one phrase saying why not."""
    why = reason() or shape_reason(out_features, in_features, group_size)
    if not why and g_idx is not None and group_size and int4pack._act_order_perm(g_idx, group_size) is None:
        why = "its act-order groups are not contiguous once sorted"
    return why


def _nibbles(u: torch.Tensor) -> torch.Tensor:
    """u [N, K] (0..15, N % 4 == 0) -> int16 [N/4, K]: word (c, k) holds u[4c + i, k] at bit 4 i."""
    words = u[0::4] | (u[1::4] << 4) | (u[2::4] << 8) | (u[3::4] << 12)  # int32, < 2^16
    return torch.where(words >= 2**15, words - 2**16, words).to(torch.int16).contiguous()


def repack(
    w_packed: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int | None,
    g_idx: torch.Tensor | None = None,
    kernel: str = "auto",
) -> tuple[Int4Weight | None, str]:
    """Pack-quantized int4 -> (`Int4Weight`, which kernel and why), or (None, why none can).

    w_packed int32 [N, K/8] (`quantkit.packing`); scales [N, K/G] or [N, 1] (group_size None:
    per channel), any float dtype; zeros int8 [N, K/G] signed zero points or None (symmetric);
    g_idx int32 [K] act-order groups or None. kernel: "auto", "amx" or "int4pack" (default
    from QUANTKIT_INT4_KERNEL). Call once, at load; the tensors are kept by reference.
    """
    kernel = os.environ.get("QUANTKIT_INT4_KERNEL", "auto") if kernel == "auto" else kernel
    if kernel not in ("auto", *KERNELS):
        raise QuantkitError(f"int4 CPU kernel {kernel!r} is unknown; use auto, {', '.join(KERNELS)}.")
    n, k = scales.shape[0], w_packed.shape[1] * 8
    g = group_size or k
    source = (w_packed, scales, zeros, group_size, g_idx)
    perm = None if g_idx is None or not group_size else int4pack._act_order_perm(g_idx, g)
    why = (
        "forced by QUANTKIT_INT4_KERNEL / kernel=" if kernel == "int4pack" else amx_unsupported(n, k, group_size, g_idx)
    )
    if why:
        if kernel == "amx":
            raise QuantkitError(f"the AMX int4 kernel cannot run this [{n}, {k}] weight: {why}.")
        if not int4pack.supports(n, k, group_size, g_idx):
            return None, f"{why}, and torch's int4pack kernel cannot take it either; use the torch twin"
        fallback = int4pack.repack_int4_cpu(w_packed, scales, zeros, group_size, g_idx)
        weight = Int4Weight("int4pack", n, k, fallback.group_size, source, fallback=fallback)
        return weight, f"torch's int4pack below {DENSE_MIN_M} rows, dequantize + fp32 matmul from there ({why})"
    n_pad = -(-n // 16) * 16
    u = unpack(w_packed.cpu(), k).to(torch.int32) + 8  # [N, K] in 0..15
    if perm is not None:
        u = u[:, perm]
    pad = (0, 0, 0, n_pad - n)  # zero channels up to a multiple of 16
    s = scales.cpu().float().expand(n, k // g)
    z = torch.zeros_like(s) if zeros is None else zeros.cpu().float().expand(n, k // g)
    zs = -(8 + z) * s  # w = (u - 8 - z) * s = u * s + zs
    s, zs = (torch.nn.functional.pad(t, pad).contiguous() for t in (s, zs))
    nibbles = _nibbles(torch.nn.functional.pad(u, pad))
    weight = Int4Weight("amx", n, k, g, source, nibbles, s, zs, perm)
    return weight, (
        f"AVX512-BF16 dot products up to {GEMV_ROWS} rows, AMX tiles above "
        f"(weight looked up per 32 rows up to {AMX_FEW_ROWS} rows, once per call above)"
    )


def amx_path(weight: Int4Weight, m: int) -> str:
    """Which schedule the C++ kernel takes for m rows of an `amx` weight (for benchmarks)."""
    if m <= GEMV_ROWS:
        return "AVX512-BF16 dot products"
    return "AMX few rows" if m <= AMX_FEW_ROWS else "AMX many rows"


def gemm(x: torch.Tensor, weight: Int4Weight) -> torch.Tensor:
    """y = x · dequant(W)ᵀ. x [..., K] any float dtype (multiplied in bf16, accumulated in
    fp32); returns [..., N] in x's dtype. `gemm_amx` or `gemm_int4pack` by the weight's kernel
    (the engine binds one of them at load)."""
    return (gemm_int4pack if weight.kernel == "int4pack" else gemm_amx)(x, weight)


def _rows(x: torch.Tensor, weight: Int4Weight) -> torch.Tensor:
    if x.shape[-1] != weight.in_features:
        raise QuantkitError(f"int4 gemm: x has {x.shape[-1]} features, the weight takes {weight.in_features}.")
    return x.reshape(-1, weight.in_features).to(torch.bfloat16)


def gemm_amx(x: torch.Tensor, weight: Int4Weight) -> torch.Tensor:
    """`gemm` for an `amx` weight; the C++ kernel picks its schedule by the row count."""
    x2, w = _rows(x, weight), weight
    if w.perm is not None:
        x2 = x2.index_select(1, w.perm)
    y = _load().gemm(x2.contiguous(), w.nibbles, w.scales, w.zs, w.out_features, w.group_size)
    return y.to(x.dtype).reshape(*x.shape[:-1], w.out_features)


def gemm_int4pack(x: torch.Tensor, weight: Int4Weight) -> torch.Tensor:
    """`gemm` for an `int4pack` weight: torch's int4pack below DENSE_MIN_M rows, the twin's
    dequantization and an fp32 matmul from there."""
    x2, w = _rows(x, weight), weight
    if x2.shape[0] < DENSE_MIN_M:
        y = int4pack.int4_gemm_cpu(x2, w.fallback)
    else:
        w_packed, scales, zeros, group_size, g_idx = w.source
        y = int4_twin.int4_gemm(x2.float(), w_packed, scales.float(), zeros, group_size, g_idx)
    return y.to(x.dtype).reshape(*x.shape[:-1], w.out_features)
