"""W8A8 int8 GEMM through `torch._int_mm`: cuBLASLt's int8 GEMM on a GPU (as torchao runs
W8A8 there; no Triton kernel needed). Activations are quantized per token with torch ops,
products accumulate in int32, and both scales are applied in fp32. On the CPU the engine
takes oneDNN's prepacked int8 GEMM instead (`quantkit.kernels.cpu.w8a8_gemm_cpu`);
`torch._int_mm` runs there too, for tests. The twin is `quantkit.kernels.int8.twin.int8_gemm`.
"""

from __future__ import annotations

import functools

import torch

from quantkit.errors import QuantkitError

_CUDA_MIN_M = 17  # cuBLASLt's int8 GEMM in torch._int_mm takes more than 16 rows


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] float -> (q int8 [M, K], scale fp32 [M, 1]) with q = clamp(round(x / scale),
    -128, 127) and scale = max|x_row| / 127.5 (`quantkit.primitives`' symmetric int8; an
    all-zero row gets a tiny scale and zeros). One fp32 copy of x, rewritten in place."""
    xf = x.to(torch.float32, copy=True)
    scale = torch.maximum(xf.amax(-1, keepdim=True), xf.amin(-1, keepdim=True).neg_())
    scale = scale.clamp_min_(torch.finfo(torch.float32).tiny).div_(127.5)
    return xf.div_(scale).round_().clamp_(-128, 127).to(torch.int8), scale


@functools.cache
def cpu_exact() -> bool:
    """Whether `torch._int_mm`'s int32 sums are exact on this CPU. It runs oneDNN's int8 GEMM,
    which on AVX2 without VNNI saturates at int16 (`onednn.saturates`); probed once on the
    worst case, every operand 127, where the exact sum is 127²·64."""
    a = torch.full((2, 64), 127, dtype=torch.int8)
    return bool((torch._int_mm(a, a.t()) == 127 * 127 * 64).all())


def unsupported(out_features: int, in_features: int, device: torch.device | str) -> str | None:
    """Why `int8_gemm` cannot take an [out, in] weight on `device`, or None when it can."""
    kind = torch.device(device).type
    if kind == "cuda" and (in_features % 8 or out_features % 8):
        shape = f"[{out_features}, {in_features}]"
        return f"cuBLASLt's int8 GEMM needs in and out features that are multiples of 8, not {shape}"
    if kind == "cpu" and not cpu_exact():
        return "on this CPU (AVX2 without VNNI) torch._int_mm's int8 products saturate in int16: its sums are not exact"
    return None


def int8_gemm(x: torch.Tensor, w_int8: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """y = (Q(x) · W_intᵀ) · s_x · s_w, the twin's function with int32 products.

    x [..., K] float; w_int8 int8 [N, K]; w_scale [N, 1] (per channel) or [1] (per tensor).
    Returns [..., N] in x's dtype.
    """
    n, k = w_int8.shape
    if x.shape[-1] != k or w_int8.dtype != torch.int8 or x.device != w_int8.device:
        raise QuantkitError(
            f"int8_gemm takes x [..., {k}] on the weight's device and an int8 [N, K] weight; got x "
            f"{list(x.shape)} on {x.device} and a {w_int8.dtype} weight on {w_int8.device}."
        )
    why = unsupported(n, k, x.device)
    if why:
        raise QuantkitError(f"int8_gemm: {why}; use the torch twin (backend torch).")
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    q, s = quantize_per_token(x2)
    if x.is_cuda and m < _CUDA_MIN_M:
        q = torch.cat([q, q.new_zeros(_CUDA_MIN_M - m, k)])
    acc = torch._int_mm(q, w_int8.t())[:m]  # int32 [M, N]
    y = acc.float().mul_(s).mul_(w_scale.float().reshape(1, -1))
    return y.to(x.dtype).reshape(*x.shape[:-1], n)
