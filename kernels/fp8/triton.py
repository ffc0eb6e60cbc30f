"""W8A8 fp8 (e4m3) GEMM in Triton: y = (x_fp8 · W_fp8ᵀ) · s_x · s_w.

Two kernels:

- `_quantize_fp8_kernel`: one program per row of x [M, K]; dynamic: amax over the row,
  scale = max(amax, 1e-12) / 448 (stored, [M, 1] fp32); static: the given per-tensor scale.
  Then q = clamp(x / scale, ±448) -> e4m3 bytes. The fp32 -> e4m3 rounding is done with
  integer/float arithmetic in `_e4m3_bits` (round to nearest even, subnormals included)
  rather than `.to(tl.float8e4nv)`: the triton 3.9 interpreter's conversion rounds ties
  away from zero and mishandles mantissa carries and subnormals, and one path that is exact
  everywhere is easier to trust than two. Divisions use `div_rn` (IEEE), as torch does.
- `_fp8_gemm_kernel`: one [BLOCK_M, BLOCK_N] tile per program, K loop; the e4m3 tiles go
  straight into `tl.dot` with an fp32 accumulator, promoted to full fp32 every BLOCK_K
  products (`max_num_imprecise_acc`: Hopper's fp8 tensor-core accumulator is narrower than
  fp32). Triton has no e4m3 type before sm_89, so the GEMM needs an Ada/Hopper-class GPU.
  The interpreter's `tl.dot` takes fp8 operands too (it decodes them to fp16 exactly and
  multiplies in fp32), so the CPU tests run this same path. Epilogue: acc * s_x[m] * s_w[n]
  in fp32, cast to x's dtype.

The twin is `quantkit.kernels.fp8.twin.fp8_gemm`. On a GPU the GEMM tiles are autotuned
over `_configs()`; under TRITON_INTERPRET=1 the first config is used as is.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FP8_MAX = 448.0
_FP8_MAX = tl.constexpr(FP8_MAX)  # kernels may only read constexpr globals


def _configs() -> list[triton.Config]:
    if INTERPRET:  # one fixed config; small enough that test shapes still exercise masks
        return [triton.Config({"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64})]
    return [
        triton.Config({"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128}, num_warps=4, num_stages=4),
        triton.Config({"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 128}, num_warps=4, num_stages=4),
        triton.Config({"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 128}, num_warps=4, num_stages=4),
        triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128}, num_warps=8, num_stages=3),
        triton.Config({"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64}, num_warps=8, num_stages=3),
    ]


@triton.jit
def _e4m3_bits(v):
    """fp32 (|v| <= 448 or NaN) -> uint8 e4m3fn code, round to nearest even, like torch."""
    bits = v.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    e = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)  # unbiased exponent; -6 covers subnormals
    inv_quantum = ((130 - e) << 23).to(tl.float32, bitcast=True)  # 2^(3 - e): 3 mantissa bits
    y = tl.abs(v) * inv_quantum  # exact, in [0, 16)
    r = ((y + 8388608.0) - 8388608.0).to(tl.int32)  # rint, ties to even (2^23 trick)
    code = ((e + 6) * 8 + r) | sign  # r == 16 carries into the exponent, as it should
    return tl.where(v != v, 0x7F | sign, code).to(tl.uint8)


@triton.jit
def _quantize_fp8_kernel(x_ptr, q_ptr, s_ptr, K, stride_xm, stride_qm, STATIC: tl.constexpr, BLOCK_K: tl.constexpr):
    row = tl.program_id(0)
    x_row = x_ptr + row * stride_xm
    rk = tl.arange(0, BLOCK_K)
    if STATIC:
        scale = tl.load(s_ptr)
    else:
        amax = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            xk = tl.load(x_row + k0 + rk, mask=k0 + rk < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(xk))
        scale = tl.math.div_rn(tl.maximum(tl.max(amax, axis=0), 1e-12), _FP8_MAX)
        tl.store(s_ptr + row, scale)
    for k0 in range(0, K, BLOCK_K):
        k_mask = k0 + rk < K
        xk = tl.load(x_row + k0 + rk, mask=k_mask, other=0.0).to(tl.float32)
        v = tl.minimum(tl.maximum(tl.math.div_rn(xk, tl.zeros_like(xk) + scale), -_FP8_MAX), _FP8_MAX)
        v = tl.where(xk != xk, xk, v)  # NaN stays NaN, as with torch.clamp
        tl.store(q_ptr + row * stride_qm + k0 + rk, _e4m3_bits(v), mask=k_mask)


@triton.jit
def _fp8_gemm_kernel(
    a_ptr,
    b_ptr,
    as_ptr,
    bs_ptr,
    y_ptr,
    M,
    N,
    K,
    M_BUCKET,  # M_BUCKET: autotune key only (M rounded up to a power of two)
    stride_am,
    stride_bn,
    stride_ym,
    PER_TOKEN: tl.constexpr,
    PER_CHANNEL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + rk
        k_mask = offs_k < K
        a = tl.load(
            a_ptr + offs_m[:, None] * stride_am + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0
        )  # [BM, BK] e4m3
        b = tl.load(
            b_ptr + offs_n[None, :] * stride_bn + offs_k[:, None], mask=k_mask[:, None] & n_mask[None, :], other=0.0
        )  # [BK, BN] e4m3 (W transposed)
        acc = tl.dot(a, b, acc, max_num_imprecise_acc=BLOCK_K)
    if PER_TOKEN:
        acc = acc * tl.load(as_ptr + offs_m, mask=m_mask, other=0.0)[:, None]
    else:
        acc = acc * tl.load(as_ptr)
    if PER_CHANNEL:
        acc = acc * tl.load(bs_ptr + offs_n, mask=n_mask, other=0.0)[None, :]
    else:
        acc = acc * tl.load(bs_ptr)
    tl.store(
        y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :],
        acc.to(y_ptr.dtype.element_ty),
        mask=m_mask[:, None] & n_mask[None, :],
    )


if not INTERPRET:
    _fp8_gemm_kernel = triton.autotune(configs=_configs(), key=["M_BUCKET", "N", "K"])(_fp8_gemm_kernel)
_FIXED_META = _configs()[0].kwargs if INTERPRET else {}


def _fail(fn: str, msg: str):
    raise ValueError(f"{fn}: {msg}")


def _check_x(fn: str, x: torch.Tensor) -> None:
    if x.dtype not in FLOAT_DTYPES:
        _fail(fn, f"x must be float16, bfloat16 or float32, got {x.dtype}.")
    if not INTERPRET and x.device.type != "cuda":
        _fail(
            fn,
            f"the Triton kernel needs CUDA tensors, got {x.device}; use the torch backend on CPU "
            "(or set TRITON_INTERPRET=1 before importing triton, for tests).",
        )


def _quantize(x2: torch.Tensor, x_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """x2 [M, K] -> (e4m3 [M, K], fp32 scale: [M, 1] computed, or the given one as fp32)."""
    m, k = x2.shape
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x2.device)
    static = x_scale is not None
    scale = x_scale.float().reshape(1) if static else torch.empty((m, 1), dtype=torch.float32, device=x2.device)
    if m and k:
        block_k = min(triton.next_power_of_2(k), 4096 if INTERPRET else 1024)
        _quantize_fp8_kernel[(m,)](
            x2, q.view(torch.uint8), scale, k, x2.stride(0), q.stride(0), STATIC=static, BLOCK_K=block_k
        )
    elif not static:
        scale.fill_(1e-12 / FP8_MAX)
    return q, scale


def quantize_fp8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token fp8 quantization in Triton.

    x [M, K] (or [..., K]) float16/bfloat16/float32 -> (x_fp8 float8_e4m3fn [M, K],
    scale fp32 [M, 1]) with scale = max(amax(|row|), 1e-12) / 448 and
    x_fp8 = clamp(x / scale, -448, 448) rounded to nearest even; leading dimensions are
    kept ([..., K] and [..., 1]). Bit-identical to the torch computation in
    `reference.fp8_gemm`.
    """
    _check_x("quantize_fp8_per_token", x)
    if x.dim() == 0:
        _fail("quantize_fp8_per_token", "x must have at least one dimension [..., K].")
    k = x.shape[-1]
    q, scale = _quantize(x.reshape(-1, k).contiguous(), None)
    return q.reshape(x.shape), scale.reshape(*x.shape[:-1], 1)


def _check_gemm(x, w_fp8, w_scale, x_scale) -> None:
    _check_x("fp8_gemm", x)
    if w_fp8.dtype != torch.float8_e4m3fn or w_fp8.dim() != 2:
        _fail("fp8_gemm", f"w_fp8 must be float8_e4m3fn [out, in], got {w_fp8.dtype} {list(w_fp8.shape)}.")
    out_f, in_f = w_fp8.shape
    if x.dim() == 0 or x.shape[-1] != in_f:
        _fail("fp8_gemm", f"x must be [..., {in_f}] to match w_fp8 [{out_f}, {in_f}], got {list(x.shape)}.")
    if not w_scale.is_floating_point() or w_scale.numel() not in (1, out_f) or w_scale.dim() > 2:
        _fail(
            "fp8_gemm",
            f"w_scale must be float [{out_f}, 1] (per channel) or [1] (per tensor), "
            f"got {w_scale.dtype} {list(w_scale.shape)}.",
        )
    if x_scale is not None and (not x_scale.is_floating_point() or x_scale.numel() != 1):
        _fail(
            "fp8_gemm",
            f"x_scale must be a float [1] (static per tensor) or None (dynamic per token), "
            f"got {x_scale.dtype} {list(x_scale.shape)}.",
        )
    for name, t in (("w_fp8", w_fp8), ("w_scale", w_scale), ("x_scale", x_scale)):
        if t is not None and t.device != x.device:
            _fail("fp8_gemm", f"{name} is on {t.device} but x is on {x.device}; put all operands on one device.")
    if not INTERPRET and torch.cuda.get_device_capability(x.device) < (8, 9):
        _fail(
            "fp8_gemm",
            f"the fp8 kernel needs a GPU with fp8 tensor cores (compute capability 8.9+), "
            f"{torch.cuda.get_device_name(x.device)} has "
            f"{'.'.join(map(str, torch.cuda.get_device_capability(x.device)))}; use the torch backend.",
        )


def fp8_gemm(
    x: torch.Tensor,
    w_fp8: torch.Tensor,
    w_scale: torch.Tensor,
    x_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """y = (x_fp8 · W_fp8ᵀ) · s_x · s_w in Triton; same contract as `reference.fp8_gemm`.

    x [..., in] float16/bfloat16/float32; w_fp8 float8_e4m3fn [out, in]; w_scale float
    [out, 1] (per channel) or [1] (per tensor); x_scale float [1] (static per tensor) or None
    (dynamic per token: `quantize_fp8_per_token`). All on one CUDA device (CPU only under
    TRITON_INTERPRET=1). Products summed in fp32; returns [..., out] in x's dtype. Raises
    ValueError naming the argument when a shape, dtype or device is wrong.
    """
    _check_gemm(x, w_fp8, w_scale, x_scale)
    out_f, k = w_fp8.shape
    x2 = x.reshape(-1, k).contiguous()  # [M, K]
    m = x2.shape[0]
    y = torch.empty((m, out_f), dtype=x.dtype, device=x.device)
    if m == 0 or out_f == 0:
        return y.reshape(*x.shape[:-1], out_f)
    x_fp8, s_x = _quantize(x2, x_scale)
    w_fp8 = w_fp8.contiguous()
    s_w = w_scale.float().reshape(-1).contiguous()

    def grid(meta):
        return triton.cdiv(m, meta["BLOCK_M"]), triton.cdiv(out_f, meta["BLOCK_N"])

    _fp8_gemm_kernel[grid](
        x_fp8,
        w_fp8,
        s_x,
        s_w,
        y,
        m,
        out_f,
        k,
        triton.next_power_of_2(m),
        x_fp8.stride(0),
        w_fp8.stride(0),
        y.stride(0),
        PER_TOKEN=x_scale is None,
        PER_CHANNEL=s_w.numel() == out_f and out_f > 1,
        **_FIXED_META,
    )
    return y.reshape(*x.shape[:-1], out_f)
