"""MXFP8-weight GEMM in Triton (W8A16): y = x · dequant(W)ᵀ with compressed-tensors' MXFP8
weights decoded in registers tile by tile (no repack at load).

    w_fp8    float8_e4m3fn [N, K]   `weight`, as stored
    scales   uint8 [N, K/32]        `weight_scale`: E8M0 exponents, w = e4m3 · 2^(e - 127)

Each program computes one [BLOCK_M, BLOCK_N] tile of y and walks K in BLOCK_K steps (a multiple
of 32): the weight bytes [BLOCK_N, BLOCK_K] and scales [BLOCK_N, BLOCK_K/32] are loaded as
stored, decoded from their bits (`fp4.triton._e4m3`, `_e8m0`: no fp8 support needed from the
GPU, so it runs from sm_80), multiplied per group in fp32 (exact), cast to x's dtype and
transposed into `tl.dot` with an fp32 accumulator; split over K for few rows on a GPU. The
activations stay in x's dtype: this is the MXFP8A16 preset's GEMM (the MXFP8 preset's dynamic
MXFP8 activations are not emulated here). The twin is `quantkit.kernels.fp8.twin.mxfp8_gemm`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quantkit.kernels.fp4.triton import _FIXED_META as _FP4_META
from quantkit.kernels.fp4.triton import _configs as _fp4_configs
from quantkit.kernels.fp4.triton import _e4m3, _e8m0
from quantkit.kernels.fp8.triton import FLOAT_DTYPES, INTERPRET, _fail
from quantkit.kernels.int4.triton import _split_k

GROUP = 32


@triton.jit
def _mxfp8_gemm_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    y_ptr,
    M,
    N,
    K,
    M_BUCKET,  # M_BUCKET: autotune key only (M rounded up to a power of two)
    stride_xm,
    stride_wn,
    stride_sn,
    stride_ys,
    stride_ym,
    X_IS_FP32: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # a multiple of 32
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    rk = tl.arange(0, BLOCK_K)
    rg = tl.arange(0, BLOCK_K // 32)
    x_dtype = x_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(pid_k * BLOCK_K, K, SPLIT_K * BLOCK_K):
        offs_k = k0 + rk
        k_mask = offs_k < K
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0
        )  # [BM, BK]
        b_mask = n_mask[:, None] & k_mask[None, :]
        b = tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :], mask=b_mask, other=0).to(tl.int32)
        offs_g = k0 // 32 + rg
        g_mask = n_mask[:, None] & (offs_g < K // 32)[None, :]
        s = _e8m0(tl.load(s_ptr + offs_n[:, None] * stride_sn + offs_g[None, :], mask=g_mask, other=0).to(tl.int32))
        w = tl.reshape(_e4m3(b), [BLOCK_N, BLOCK_K // 32, 32]) * s[:, :, None]
        w = tl.reshape(tl.where(g_mask[:, :, None], w, 0.0), [BLOCK_N, BLOCK_K])  # masked scales may be NaN
        w = tl.trans(w.to(x_dtype))  # [BK, BN]
        if X_IS_FP32:  # no tf32: the twin multiplies in full fp32
            acc = tl.dot(x, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w, acc)
    y_ptrs = y_ptr + pid_k * stride_ys + offs_m[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


if not INTERPRET:
    _mxfp8_gemm_kernel = triton.autotune(configs=_fp4_configs(), key=["M_BUCKET", "N", "K", "SPLIT_K"])(
        _mxfp8_gemm_kernel
    )


def _check(x, w_fp8, scales) -> None:
    if x.dtype not in FLOAT_DTYPES:
        _fail("mxfp8_gemm", f"x must be float16, bfloat16 or float32, got {x.dtype}.")
    if INTERPRET and x.dtype == torch.bfloat16:
        _fail("mxfp8_gemm", "bfloat16 x is not supported under TRITON_INTERPRET=1; use float16/float32.")
    if w_fp8.dtype != torch.float8_e4m3fn or w_fp8.dim() != 2:
        _fail("mxfp8_gemm", f"w_fp8 must be float8_e4m3fn [out, in], got {w_fp8.dtype} {list(w_fp8.shape)}.")
    out_f, in_f = w_fp8.shape
    if x.dim() == 0 or x.shape[-1] != in_f or in_f % GROUP:
        _fail("mxfp8_gemm", f"x must be [..., {in_f}] with {in_f} a multiple of 32, got {list(x.shape)}.")
    if scales.dtype != torch.uint8 or tuple(scales.shape) != (out_f, in_f // GROUP):
        _fail(
            "mxfp8_gemm",
            f"scales must be uint8 E8M0 [{out_f}, {in_f // GROUP}], got {scales.dtype} {list(scales.shape)}.",
        )
    for name, t in (("w_fp8", w_fp8), ("scales", scales)):
        if t.device != x.device:
            _fail("mxfp8_gemm", f"{name} is on {t.device} but x is on {x.device}; put all operands on one device.")
    if not INTERPRET and x.device.type != "cuda":
        _fail("mxfp8_gemm", f"the Triton kernel needs CUDA tensors, got {x.device}; use the torch backend on CPU.")


def _launch(x, w_fp8, scales, split_k: int) -> torch.Tensor:
    """Run the kernel on checked arguments with an explicit split-K factor."""
    n_out, k = w_fp8.shape
    x2 = x.reshape(-1, k).contiguous()
    m = x2.shape[0]
    y = torch.empty((m, n_out), dtype=x.dtype, device=x.device)
    if m == 0 or n_out == 0:
        return y.reshape(*x.shape[:-1], n_out)
    w = w_fp8.contiguous().view(torch.uint8)
    s = scales.contiguous()
    out = y if split_k == 1 else torch.empty((split_k, m, n_out), dtype=torch.float32, device=x.device)

    def grid(meta):
        return triton.cdiv(m, meta["BLOCK_M"]), triton.cdiv(n_out, meta["BLOCK_N"]), split_k

    _mxfp8_gemm_kernel[grid](
        x2,
        w,
        s,
        out,
        m,
        n_out,
        k,
        triton.next_power_of_2(m),
        x2.stride(0),
        w.stride(0),
        s.stride(0),
        out.stride(0) if split_k > 1 else 0,
        out.stride(-2),
        X_IS_FP32=x.dtype == torch.float32,
        SPLIT_K=split_k,
        **_FP4_META,
    )
    if split_k > 1:
        y = out.sum(dim=0).to(x.dtype)
    return y.reshape(*x.shape[:-1], n_out)


def mxfp8_gemm(x: torch.Tensor, w_fp8: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """y = x · dequant(W)ᵀ for MXFP8 weights, in Triton; same contract as `twin.mxfp8_gemm`.
    x [..., K] float16/bfloat16/float32; w_fp8 float8_e4m3fn [N, K]; scales uint8 E8M0
    [N, K/32]. All on one CUDA device (CPU only under TRITON_INTERPRET=1). Accumulates in fp32;
    returns [..., N] in x's dtype. Raises ValueError naming the argument when a shape, dtype or
    device is wrong."""
    _check(x, w_fp8, scales)
    m = x.numel() // max(x.shape[-1], 1)
    return _launch(x, w_fp8, scales, _split_k(m, w_fp8.shape[0], x.shape[-1], x.device))
