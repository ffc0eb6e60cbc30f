"""W8A8 for fp32 activations on x86 CPUs without AMX: the C++ kernels of `kernels/int8/w8a8_avx.cpp`
(AVX2 `vpmaddwd`, AVX-512 VNNI `vpdpbusd`), x quantized to int8 per token inside the call.

    weight, why = repack(w_int8, scales)   # once, at load: int8 [N, K], scales [N, 1], [N] or [1]
    y = gemm(x, weight)                    # x [..., K] float -> y [..., N] in x's dtype

The math is the twin's (`kernels/int8/twin.py`): x per token to int8 (scale max|x| / 127.5,
round half to even, clamp to [-128, 127]: the same int8 values and scales as
`quantkit.primitives`), int8 x int8 products summed exactly in int32, then y = float(acc) s_w s_x.

Layouts (`W8A8AvxWeight.q`, built here, never saved; the .cpp's header has the details):

- avx2: int16 [ceil(N/16), ceil(K/2), 16, 2]: per tile of 16 channels and pair of k, each
  channel's two weights, sign-extended once here (`vpmaddwd` against x's int16 pair: exact, no
  int16 saturation, all 8 bits of the activations kept; twice the int8 bytes, half fp32's);
- avx512: int8 [ceil(N/32), ceil(K/4), 32, 4] for `vpdpbusd` (u8 x s8 in fours), with
  `comp` int32 = 128 sum_k w per channel, since x goes in as u = q + 128.

Channels past N and k past K are zero. `scales` is fp32 per channel (a per-tensor scale
repeated), padded with zeros.

ISA: `QUANTKIT_ISA=avx2|avx512` (read once, at import) forces one; unset, the widest the CPU has
(avx512 needs AVX-512 F/BW/VL/DQ and VNNI). The AVX2 code is compiled with AVX-512 disabled
(VEX encodings, ymm registers only), so forcing it on an AVX-512 CPU runs what an AVX2-only CPU
runs. `repack(..., isa=)` chooses per weight (the tests run both).

The extension is built on first use by `cpu_ext.Extension` (the same flags, cache folder and lock
as the other C++ kernels) into `$QUANTKIT_CACHE/ext/w8a8avx-<key>`, as
`torch.ops.quantkit_w8a8_avx`; `QUANTKIT_NO_EXT=1` or a failed build make `repack` return
(None, why), and the caller keeps another candidate.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass

import torch

from quantkit.errors import QuantkitError
from quantkit.kernels import cpu_ext

ISAS = cpu_ext.ISAS
_TILE = {"avx2": (16, 2), "avx512": (32, 4)}  # channels per tile, k per int32 word


@dataclass(frozen=True, slots=True)
class W8A8AvxWeight:
    """A per-channel int8 weight [N, K] for `gemm`: `q` (the ISA's layout, module docstring),
    `scales` fp32 [N_pad], `comp` int32 [N_pad] (avx512; empty for avx2), `isa`."""

    out_features: int
    in_features: int
    q: torch.Tensor
    scales: torch.Tensor
    comp: torch.Tensor
    isa: str

    @property
    def nbytes(self) -> int:
        return self.q.numel() + self.scales.numel() * 4 + self.comp.numel() * 4


def _needs(flags: str) -> str | None:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return "the AVX W8A8 kernel is for x86-64 CPUs"
    return None if {"avx2", "fma"} <= set(flags.split()) else "this CPU has no AVX2 + FMA"


EXTENSION = cpu_ext.Extension(
    "int8/w8a8_avx.cpp", "quantkit_w8a8_avx", "w8a8_gemm", "the AVX W8A8 CPU kernel", _needs, prefix="w8a8avx"
)


def isa_level() -> int:
    """0: the kernels cannot run here, 1: AVX2 + FMA, 2: AVX-512 with VNNI too."""
    ops = EXTENSION.load()
    return 0 if ops is None else int(ops.isa_level())


def choose_isa(isa: str | None = None) -> tuple[str | None, str]:
    """(isa, "") for the ISA to run (`isa`, else QUANTKIT_ISA, else the widest), or (None, why)."""
    return cpu_ext.choose_isa(EXTENSION, isa, "AVX-512 VNNI")


def has_amx_int8() -> bool:
    """Whether this CPU has AMX-INT8 (then oneDNN's int8 GEMM is faster from 64 rows, measured)."""
    return "amx_int8" in cpu_ext._cpu_flags().split()


def forced() -> bool:
    """Whether QUANTKIT_ISA names an ISA (the chooser then takes this kernel wherever it runs)."""
    return cpu_ext.ISA_ENV in ISAS


def repack(w_int8: torch.Tensor, scales: torch.Tensor, isa: str | None = None) -> tuple[W8A8AvxWeight | None, str]:
    """int8 [N, K] symmetric values and their scales ([N, 1], [N] per channel or [1] per tensor,
    any float dtype) -> (`W8A8AvxWeight`, what runs), or (None, why it cannot). Call once, at load."""
    n, k = w_int8.shape
    chosen, why = choose_isa(isa)
    if not why and (w_int8.dtype != torch.int8 or scales.numel() not in (1, n)):
        why = f"the AVX W8A8 kernel needs int8 [N, K] and N or 1 scales (got {w_int8.dtype}, {scales.numel()})"
    if why:
        return None, why
    tw, pk = _TILE[chosen]
    t, kw = -(-n // tw), -(-k // pk)
    q = torch.nn.functional.pad(w_int8.cpu(), (0, kw * pk - k, 0, tw * t - n))  # [N_pad, K_pad]
    comp = torch.empty(0, dtype=torch.int32)
    if chosen == "avx512":
        comp = (128 * q.sum(1, dtype=torch.int32)).contiguous()
    q = q.reshape(t, tw, kw, pk).transpose(1, 2).contiguous()  # [T, KW, TW, P]
    if chosen == "avx2":
        q = q.to(torch.int16)  # vpmaddwd's operands, sign-extended once here rather than on every call
    s = scales.cpu().float().reshape(-1).expand(n)
    s = torch.nn.functional.pad(s, (0, tw * t - n)).contiguous()
    return W8A8AvxWeight(n, k, q, s, comp, chosen), f"the {chosen} W8A8 kernel"


_OPS = []  # the loaded ops, once a weight exists (repack succeeded)


def _ops():
    if not _OPS:
        _OPS.append(EXTENSION.load())
    return _OPS[0]


def gemm(x: torch.Tensor, weight: W8A8AvxWeight) -> torch.Tensor:
    """y = Q(x) · (W s_w)ᵀ with x quantized per token. x [..., K] any float dtype (converted to
    fp32 on entry); returns [..., N] in x's dtype."""
    k, n = weight.in_features, weight.out_features
    if x.shape[-1] != k:
        raise QuantkitError(f"W8A8 gemm: x has {x.shape[-1]} features, the weight takes {k}.")
    direct = x.dim() == 2 and x.dtype == torch.float32 and x.is_contiguous()
    x2 = x if direct else x.reshape(-1, k).float().contiguous()
    isa = 2 if weight.isa == "avx512" else 1
    y = _ops().w8a8_gemm(x2, weight.q, weight.scales, weight.comp, n, isa)
    return y if direct else y.to(x.dtype).reshape(*x.shape[:-1], n)
