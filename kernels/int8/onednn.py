"""W8A8 on the CPU: int8 weights and per-token int8 activations through oneDNN's int8 GEMM (AMX /
VNNI / AVX-512), on a weight prepacked at load. Not on AVX2 without VNNI, where its sums are not
exact (`saturates`)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from quantkit.errors import QuantkitError

_HAS_QLINEAR = hasattr(torch.ops.onednn, "qlinear_prepack") and torch.backends.mkldnn.is_available()


@dataclass(frozen=True, slots=True)
class W8A8CpuWeight:
    """A symmetric int8 weight [N, K] for `w8a8_gemm_cpu`: `packed` is oneDNN's blocked layout
    (`onednn.qlinear_prepack`, the one inductor's x86 int8 path builds; opaque, built at load,
    never saved), `scales` fp32 [N] (a per-tensor scale repeated), `zero_points` int64 zeros [N].
    `elementwise` is `torch.ops.quantkit_w8a8` (the C++ quantization and row scaling of
    `kernels/int8/w8a8.cpp`) or None, when the same math runs as torch ops."""

    packed: torch.Tensor
    scales: torch.Tensor
    zero_points: torch.Tensor
    out_features: int
    in_features: int
    elementwise: object | None = None


@functools.cache
def saturates() -> bool:
    """Whether oneDNN's int8 GEMM loses the exact int32 sums here. On AVX2 without VNNI (and with
    ONEDNN_MAX_CPU_ISA=AVX2) it adds 128 to the int8 activations and multiplies them with
    `vpmaddubsw`, whose sums of two u8·s8 products saturate at int16 (255·127·2 > 32767); on
    smollm2's real activations that error was up to 4× W8A8's own (docs/benchmarks.md). Probed
    once per process on the worst case, every activation and weight 127, where the exact sum is
    127²·64; on AVX-512, AVX-VNNI and AMX oneDNN's sums are exact."""
    k = 64
    packed = torch.ops.onednn.qlinear_prepack(torch.full((16, k), 127, dtype=torch.int8), None)
    ones, zeros = torch.ones(16), torch.zeros(16, dtype=torch.int64)
    q = torch.full((1, k), 127, dtype=torch.int8)
    y = torch.ops.onednn.qlinear_pointwise(q, 1.0, 0, packed, ones, zeros, None, 1.0, 0, torch.float32, "none", [], "")
    return not bool((y == 127 * 127 * k).all())


def w8a8_unsupported(out_features: int, in_features: int, inexact_ok: bool = False) -> str | None:
    """Why `w8a8_gemm_cpu` cannot run an [out, in] weight, or None when it can. `inexact_ok`
    lets it run where its int32 sums saturate (`saturates`; benchmarks only)."""
    if not _HAS_QLINEAR:
        return "this torch has no oneDNN int8 linear (onednn.qlinear_pointwise)"
    if out_features < 1 or in_features < 1:
        return f"the weight [{out_features}, {in_features}] is empty"
    if not inexact_ok and saturates():
        return "on this CPU (AVX2 without VNNI) oneDNN's int8 products saturate in int16: its sums are not exact"
    return None


def prepack_w8a8(
    w_int8: torch.Tensor, scales: torch.Tensor, elementwise: bool = True, inexact_ok: bool = False
) -> W8A8CpuWeight:
    """int8 [N, K] weight and its scales ([N, 1], [N] or [1]) -> `W8A8CpuWeight`, with the C++
    element-wise passes when `elementwise` and they build here (`quantkit.kernels.int8.cpp`);
    `inexact_ok` as in `w8a8_unsupported`."""
    n, k = w_int8.shape
    why = w8a8_unsupported(n, k, inexact_ok)
    if why:
        raise QuantkitError(f"oneDNN's int8 linear cannot run here: {why}; use another W8A8 kernel.")
    if w_int8.dtype != torch.int8 or scales.numel() not in (1, n):
        raise QuantkitError(
            f"oneDNN's int8 linear takes an int8 [N, K] weight with N or 1 scales (got {w_int8.dtype} "
            f"[{n}, {k}] and {scales.numel()} scales); use the torch twin."
        )
    from quantkit.kernels.int8 import cpp as cpu_w8a8

    packed = torch.ops.onednn.qlinear_prepack(w_int8.cpu().contiguous(), None)
    s = scales.cpu().float().reshape(-1).expand(n).contiguous()
    ext = cpu_w8a8.load() if elementwise else None
    return W8A8CpuWeight(packed, s, torch.zeros(n, dtype=torch.int64), n, k, ext)


def w8a8_gemm_cpu(x: torch.Tensor, weight: W8A8CpuWeight) -> torch.Tensor:
    """y = (Q(x) · W_intᵀ) · s_x · s_w with x [..., K] quantized to int8 per token (scale
    max|x| / 127.5, as `int8_gemm.quantize_per_token`), products summed in int32 by oneDNN, which
    applies s_w and writes bf16 (x bf16) or fp32 (any other x); then each row times its s_x.
    Returns [..., N] in x's dtype."""
    from quantkit.kernels.int8.int_mm import quantize_per_token

    n, k = weight.out_features, weight.in_features
    if x.shape[-1] != k:
        raise QuantkitError(f"w8a8_gemm_cpu: x has {x.shape[-1]} features, the weight takes {k}.")
    x2 = x.reshape(-1, k)
    out = torch.bfloat16 if x.dtype == torch.bfloat16 else torch.float32
    ext = weight.elementwise if x.dtype in (torch.bfloat16, torch.float32) else None
    q, s = ext.quantize_per_token(x2.contiguous()) if ext is not None else quantize_per_token(x2)
    y = torch.ops.onednn.qlinear_pointwise(
        q, 1.0, 0, weight.packed, weight.scales, weight.zero_points, None, 1.0, 0, out, "none", [], ""
    )
    if ext is not None and out == torch.bfloat16:
        ext.scale_rows_(y, s)
    else:
        y.mul_(s.to(out))
    return y.to(x.dtype).reshape(*x.shape[:-1], n)
