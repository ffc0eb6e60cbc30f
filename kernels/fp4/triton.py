"""FP4-weight GEMM in Triton (W4A16): y = x · dequant(W)ᵀ, NVFP4 or MXFP4 weights decoded in
registers tile by tile from compressed-tensors' on-disk layout (no repack at load).

    packed   uint8 [N, K/2]      `weight_packed`: code of column 2j in the low nibble of byte j,
                                 2j + 1 in the high one; a code is E2M1 (sign in bit 3)
    scales   [N, K/G]            NVFP4 (G = 16): float8_e4m3fn; MXFP4 (G = 32): uint8 E8M0
    gscale   fp32 [1]            NVFP4's `weight_global_scale` (w = e2m1 · s / gscale); MXFP4: none

Each program computes one [BLOCK_M, BLOCK_N] tile of y and walks K in BLOCK_K steps (BLOCK_K a
multiple of the group, so a step holds whole groups):

    x tile   [BLOCK_M, BLOCK_K]      in x's dtype (masked rows / columns read 0)
    bytes    [BLOCK_N, BLOCK_K/2]    packed[n, k0/2 ..], contiguous along K as stored
    codes    low and high nibbles -> fp32 by building their bits (`_e2m1`), interleaved
             into [BLOCK_N, BLOCK_K] (column 2j the low nibble, 2j + 1 the high one)
    scales   [BLOCK_N, BLOCK_K/G]    decoded from their bits (`_e4m3` / `_e8m0`), NVFP4's
             divided by the global scale once per group (div_rn, as compressed-tensors divides)
    w        codes · scale per group in fp32 (exact for MXFP4; for NVFP4 the one rounding the
             twin makes), then x's dtype, transposed to [BLOCK_K, BLOCK_N]
    acc     += tl.dot(x, w)           fp32 accumulator

E4M3 is decoded from its byte rather than with `.to(tl.float32)`, so the kernel needs no fp8
support from the GPU (it runs from sm_80). The twin is `quantkit.kernels.fp4.twin.fp4_gemm`.
On a GPU the tile sizes are autotuned over `_configs()`; under TRITON_INTERPRET=1 (CPU tests)
autotune needs a driver, so the first config is used as is.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from quantkit.kernels.fp8.triton import _e4m3_bits
from quantkit.kernels.int4.triton import _split_k

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
KINDS = {"nvfp4": (16, torch.float8_e4m3fn), "mxfp4": (32, torch.uint8), "nvfp4_w4a4": (16, torch.float8_e4m3fn)}


def _configs() -> list[triton.Config]:
    if INTERPRET:  # one fixed config; small enough that test shapes still exercise masks
        return [triton.Config({"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64})]
    return [
        triton.Config({"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128}, num_warps=4, num_stages=4),
        triton.Config({"BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 128}, num_warps=4, num_stages=4),
        triton.Config({"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 128}, num_warps=4, num_stages=4),
        triton.Config({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64}, num_warps=4, num_stages=3),
        triton.Config({"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64}, num_warps=8, num_stages=3),
        triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64}, num_warps=8, num_stages=3),
    ]


@triton.jit
def _e2m1(code):
    """int32 E2M1 codes (0..15) -> fp32: magnitude i = code & 7 is 0, 0.5 (i = 1) or
    2^((i >> 1) - 1) · (1 + (i & 1) / 2), built as fp32 bits; the sign is bit 3."""
    i = code & 7
    bits = tl.where(i >= 2, (((i >> 1) + 126) << 23) | ((i & 1) << 22), tl.where(i == 1, 126 << 23, 0))
    return (bits | ((code & 8) << 28)).to(tl.float32, bitcast=True)


@triton.jit
def _e4m3(b):
    """int32 float8_e4m3fn bytes -> fp32: exponent 4 bits (bias 7), mantissa 3, subnormals
    m · 2^-9, 0x7F / 0xFF NaN."""
    e = (b >> 3) & 0xF
    m = b & 7
    mag = tl.where(e == 0, m.to(tl.float32) * 0.001953125, ((e + 120) << 23 | (m << 20)).to(tl.float32, bitcast=True))
    mag = tl.where((b & 0x7F) == 0x7F, float("nan"), mag)
    return tl.where((b & 0x80) != 0, -mag, mag)


@triton.jit
def _e8m0(e):
    """int32 E8M0 exponents -> fp32 2^(e - 127) (e = 0: the subnormal 2^-127; 255: NaN)."""
    bits = tl.where(e == 0, 1 << 22, e << 23)
    return tl.where(e == 255, float("nan"), bits.to(tl.float32, bitcast=True))


@triton.jit
def _fp4_gemm_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    gs_ptr,
    gx_ptr,
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
    GROUP_SIZE: tl.constexpr,
    MX: tl.constexpr,  # True: E8M0 scales (MXFP4); False: E4M3 scales / global scale (NVFP4)
    W4A4: tl.constexpr,  # x holds e2m1 · s8 (fp16): weights e2m1 · s8 too, both global scales at the end
    X_IS_FP32: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # a multiple of GROUP_SIZE
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    rk = tl.arange(0, BLOCK_K)
    rb = tl.arange(0, BLOCK_K // 2)  # bytes of a K tile
    rg = tl.arange(0, BLOCK_K // GROUP_SIZE)  # groups of a K tile
    x_dtype = x_ptr.dtype.element_ty
    if not MX:
        gscale = tl.load(gs_ptr)

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(pid_k * BLOCK_K, K, SPLIT_K * BLOCK_K):
        offs_k = k0 + rk
        x_mask = m_mask[:, None] & (offs_k < K)[None, :]
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=x_mask, other=0.0)  # [BM, BK]
        offs_b = k0 // 2 + rb
        b_mask = n_mask[:, None] & (offs_b < K // 2)[None, :]
        b = tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_b[None, :], mask=b_mask, other=0).to(tl.int32)
        q = tl.interleave(_e2m1(b & 0xF), _e2m1(b >> 4))  # [BN, BK] fp32: column 2j low nibble, 2j + 1 high
        offs_g = k0 // GROUP_SIZE + rg
        g_mask = n_mask[:, None] & (offs_g < K // GROUP_SIZE)[None, :]
        sb = tl.load(s_ptr + offs_n[:, None] * stride_sn + offs_g[None, :], mask=g_mask, other=0).to(tl.int32)
        if MX:
            s = _e8m0(sb)
        elif W4A4:
            s = _e4m3(sb)  # e2m1 · s8 is exact in fp16
        else:
            s8 = _e4m3(sb)
            s = tl.math.div_rn(s8, tl.zeros_like(s8) + gscale)  # per group, as compressed-tensors divides
        w = tl.reshape(q, [BLOCK_N, BLOCK_K // GROUP_SIZE, GROUP_SIZE]) * s[:, :, None]
        w = tl.reshape(tl.where(g_mask[:, :, None], w, 0.0), [BLOCK_N, BLOCK_K])  # masked scales may be NaN
        w = tl.trans(w.to(x_dtype))  # [BK, BN]
        if X_IS_FP32:  # no tf32: the twin multiplies in full fp32
            acc = tl.dot(x, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w, acc)

    if W4A4:
        acc = acc / (gscale * tl.load(gx_ptr))
    y_ptrs = y_ptr + pid_k * stride_ys + offs_m[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _round_e2m1(v):
    """fp32 in [-6, 6] -> the nearest E2M1 value, ties to the even code (the twin's `round_e2m1`)."""
    a = tl.abs(v)
    mag = tl.where(a <= 5.0, 4.0, 6.0)
    mag = tl.where(a < 3.5, 3.0, mag)
    mag = tl.where(a <= 2.5, 2.0, mag)
    mag = tl.where(a < 1.75, 1.5, mag)
    mag = tl.where(a <= 1.25, 1.0, mag)
    mag = tl.where(a < 0.75, 0.5, mag)
    mag = tl.where(a <= 0.25, 0.0, mag)
    return tl.where(v < 0, -mag, mag)


@triton.jit
def _quantize_nvfp4_kernel(x_ptr, q_ptr, gx_ptr, K, stride_xm, stride_qm, BLOCK: tl.constexpr):
    """One program per (row, BLOCK columns): NVFP4 activation groups of 16, written as
    e2m1 · s8 in fp16 (exact), the global scale left to the GEMM's epilogue."""
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < K
    x = tl.load(x_ptr + row * stride_xm + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.reshape(x, [BLOCK // 16, 16])
    gx = tl.load(gx_ptr)
    amax = tl.max(tl.abs(g), axis=1)
    s = tl.minimum(tl.math.div_rn(amax, tl.zeros_like(amax) + 6.0) * gx, 448.0)
    s8 = _e4m3(_e4m3_bits(s).to(tl.int32))
    s8 = tl.where(s8 == 0.0, 0.125, s8)  # compressed-tensors' stand-in for a zero scale
    s_eff = tl.math.div_rn(s8, tl.zeros_like(s8) + gx)[:, None]
    v = tl.minimum(tl.maximum(tl.math.div_rn(g, tl.zeros_like(g) + s_eff), -6.0), 6.0)
    q = tl.reshape(_round_e2m1(v) * s8[:, None], [BLOCK])
    tl.store(q_ptr + row * stride_qm + offs, q.to(tl.float16), mask=mask)


if not INTERPRET:
    _fp4_gemm_kernel = triton.autotune(
        configs=_configs(), key=["M_BUCKET", "N", "K", "GROUP_SIZE", "MX", "W4A4", "SPLIT_K"]
    )(_fp4_gemm_kernel)
_FIXED_META = _configs()[0].kwargs if INTERPRET else {}


def _fail(msg: str):
    raise ValueError(f"fp4_gemm: {msg}")


def _check(x, packed, scales, global_scale, group_size, kind, input_global_scale=None) -> None:
    if kind not in KINDS:
        _fail(f"kind must be one of {', '.join(KINDS)}, got {kind!r}.")
    want_group, scale_dtype = KINDS[kind]
    if x.dtype not in FLOAT_DTYPES:
        _fail(f"x must be float16, bfloat16 or float32, got {x.dtype}.")
    if INTERPRET and x.dtype == torch.bfloat16:
        _fail(
            "bfloat16 x is not supported under TRITON_INTERPRET=1 (the interpreter's tl.dot on bf16 "
            "is wrong); use float16/float32 or the torch backend."
        )
    if packed.dtype != torch.uint8 or packed.dim() != 2:
        _fail(f"packed must be uint8 [out, in / 2], got {packed.dtype} {list(packed.shape)}.")
    out_f, in_f = packed.shape[0], packed.shape[1] * 2
    if x.dim() == 0 or x.shape[-1] != in_f:
        _fail(f"x must be [..., {in_f}] to match packed {list(packed.shape)} (in = 2 x its columns).")
    if group_size != want_group or in_f % group_size:
        _fail(f"{kind} takes group_size {want_group} dividing the input width {in_f}, got {group_size}.")
    if scales.dtype != scale_dtype or tuple(scales.shape) != (out_f, in_f // group_size):
        _fail(
            f"scales must be {str(scale_dtype)[6:]} [{out_f}, {in_f // group_size}] for {kind}, "
            f"got {scales.dtype} {list(scales.shape)}."
        )
    if (kind != "mxfp4") != (global_scale is not None) or (
        global_scale is not None and (not global_scale.is_floating_point() or global_scale.numel() != 1)
    ):
        _fail("global_scale must be a float [1] for nvfp4 and None for mxfp4.")
    gx = input_global_scale
    if (kind == "nvfp4_w4a4") != (gx is not None) or (
        gx is not None and (not gx.is_floating_point() or gx.numel() != 1)
    ):
        _fail("input_global_scale must be a float [1] for nvfp4_w4a4 and None for the W4A16 kinds.")
    for name, t in (("packed", packed), ("scales", scales), ("global_scale", global_scale), ("input_global_scale", gx)):
        if t is not None and t.device != x.device:
            _fail(f"{name} is on {t.device} but x is on {x.device}; put all operands on one device.")
    if not INTERPRET and x.device.type != "cuda":
        _fail(
            f"the Triton kernel needs CUDA tensors, got {x.device}; use the torch backend on CPU "
            "(or set TRITON_INTERPRET=1 before importing triton, for tests)."
        )


def _quantize_activations(x2: torch.Tensor, gx: torch.Tensor) -> torch.Tensor:
    """x2 [M, K] -> fp16 [M, K] holding e2m1 · s8 per group of 16 (NVFP4 W4A4's activations)."""
    m, k = x2.shape
    q = torch.empty((m, k), dtype=torch.float16, device=x2.device)
    block = min(128, triton.next_power_of_2(k))
    _quantize_nvfp4_kernel[(m, triton.cdiv(k, block))](x2, q, gx, k, x2.stride(0), q.stride(0), BLOCK=block)
    return q


def _launch(x, packed, scales, global_scale, group_size, kind, split_k: int, input_global_scale=None) -> torch.Tensor:
    """Run the kernel on checked arguments with an explicit split-K factor (fp32 partial sums
    [split_k, M, N] added at the end when split_k > 1)."""
    n_out, k = packed.shape[0], x.shape[-1]
    x2 = x.reshape(-1, k).contiguous()
    m = x2.shape[0]
    y = torch.empty((m, n_out), dtype=x.dtype, device=x.device)
    if m == 0 or n_out == 0:
        return y.reshape(*x.shape[:-1], n_out)
    packed = packed.contiguous()
    s = scales.contiguous().view(torch.uint8)
    gs = global_scale.float().reshape(1).contiguous() if global_scale is not None else s
    w4a4 = kind == "nvfp4_w4a4"
    gx = input_global_scale.float().reshape(1).contiguous() if w4a4 else gs
    a = _quantize_activations(x2, gx) if w4a4 else x2
    out = y if split_k == 1 else torch.empty((split_k, m, n_out), dtype=torch.float32, device=x.device)

    def grid(meta):
        return triton.cdiv(m, meta["BLOCK_M"]), triton.cdiv(n_out, meta["BLOCK_N"]), split_k

    _fp4_gemm_kernel[grid](
        a,
        packed,
        s,
        gs,
        gx,
        out,
        m,
        n_out,
        k,
        triton.next_power_of_2(m),
        a.stride(0),
        packed.stride(0),
        s.stride(0),
        out.stride(0) if split_k > 1 else 0,
        out.stride(-2),
        GROUP_SIZE=group_size,
        MX=kind == "mxfp4",
        W4A4=w4a4,
        X_IS_FP32=a.dtype == torch.float32,
        SPLIT_K=split_k,
        **_FIXED_META,
    )
    if split_k > 1:
        y = out.sum(dim=0).to(x.dtype)
    return y.reshape(*x.shape[:-1], n_out)


def fp4_gemm(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    global_scale: torch.Tensor | None,
    group_size: int,
    kind: str,
    input_global_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """y = x · dequant(W)ᵀ for NVFP4 / MXFP4 weights, in Triton; same contract as
    `twin.fp4_gemm`. x [..., K] float16/bfloat16/float32; packed uint8 [N, K/2]; scales
    float8_e4m3fn [N, K/16] ("nvfp4", "nvfp4_w4a4") or uint8 E8M0 [N, K/32] ("mxfp4");
    global_scale fp32 [1] for the NVFP4 kinds, None for mxfp4; input_global_scale fp32 [1] for
    "nvfp4_w4a4" (x quantized to NVFP4 first, `_quantize_nvfp4_kernel`), None otherwise. All on
    one CUDA device (CPU only under TRITON_INTERPRET=1). Accumulates in fp32 (split over K for
    few rows on a GPU, `int4.triton._split_k`); returns [..., N] in x's dtype. Raises ValueError
    naming the argument when a shape, dtype or device is wrong."""
    _check(x, packed, scales, global_scale, group_size, kind, input_global_scale)
    m = x.numel() // max(x.shape[-1], 1)
    split = _split_k(m, packed.shape[0], x.shape[-1], x.device)
    return _launch(x, packed, scales, global_scale, group_size, kind, split, input_global_scale)
