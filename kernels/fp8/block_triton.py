"""FP8 block-scaled GEMM in Triton (compressed-tensors' FP8_BLOCK, DeepSeek-V3's layout):
y[m, n] = Σ_kb s_x[m, kb] · s_w[n // 128, kb] · Σ_{k in block kb} x_fp8[m, k] · w_fp8[n, k].

    w_fp8    float8_e4m3fn [N, K]
    w_scale  float [ceil(N/128), ceil(K/128)]: one scale per 128 x 128 weight block
    x        quantized here per token and per 128 columns, dynamically (the FP8_BLOCK preset's
             input_activations: group 128, dynamic; vLLM's per_token_group_quant_fp8)

Two kernels:

- `_quantize_group_kernel`: one program per (row, group of 128 columns): scale =
  max(amax, 1e-12) / 448 (fp32 [M, ceil(K/128)]), q = clamp(x / scale, ±448) rounded to
  nearest even with `triton._e4m3_bits` (bit-exact against torch; see that module).
- `_fp8_block_gemm_kernel`: one [BLOCK_M, BLOCK_N] tile per program, K in BLOCK_K steps with
  BLOCK_K dividing 128 so that a step lies in one block column; each step's e4m3 `tl.dot` starts
  from zero in fp32 and is scaled by s_x[m, kb] · s_w[n // 128, kb] into the fp32 accumulator
  (the per-block promotion also bounds Hopper's narrower fp8 accumulation to BLOCK_K products).
  N and K need not be multiples of 128: masked loads read 0 past the edges, and the last
  partial block has its own scale. For few rows on a GPU the K steps are split over programs
  (int4's rule), their fp32 partial sums added at the end. fp8 `tl.dot` needs compute
  capability 8.9+.

The twin is `quantkit.kernels.fp8.twin.fp8_block_gemm`. On a GPU the tiles are autotuned over
`_configs()`; under TRITON_INTERPRET=1 the first config is used as is.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quantkit.kernels.fp8.triton import _FP8_MAX, INTERPRET, _check_x, _e4m3_bits, _fail
from quantkit.kernels.int4.triton import _split_k

BLOCK = 128


def _configs() -> list[triton.Config]:
    if INTERPRET:  # one fixed config; BLOCK_K below 128 exercises several steps per block
        return [triton.Config({"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64})]
    return [
        triton.Config({"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128}, num_warps=4, num_stages=4),
        triton.Config({"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 128}, num_warps=4, num_stages=4),
        triton.Config({"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 128}, num_warps=4, num_stages=4),
        triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128}, num_warps=8, num_stages=3),
        triton.Config({"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64}, num_warps=8, num_stages=3),
    ]


@triton.jit
def _quantize_group_kernel(x_ptr, q_ptr, s_ptr, K, stride_xm, stride_qm, stride_sm, GROUP: tl.constexpr):
    row = tl.program_id(0)
    g = tl.program_id(1)
    offs = g * GROUP + tl.arange(0, GROUP)
    mask = offs < K
    x = tl.load(x_ptr + row * stride_xm + offs, mask=mask, other=0.0).to(tl.float32)
    scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), axis=0), 1e-12), _FP8_MAX)
    tl.store(s_ptr + row * stride_sm + g, scale)
    v = tl.minimum(tl.maximum(tl.math.div_rn(x, tl.zeros_like(x) + scale), -_FP8_MAX), _FP8_MAX)
    v = tl.where(x != x, x, v)  # NaN stays NaN, as with torch.clamp
    tl.store(q_ptr + row * stride_qm + offs, _e4m3_bits(v), mask=mask)


@triton.jit
def _fp8_block_gemm_kernel(
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
    stride_asm,
    stride_bsn,
    stride_ys,
    stride_ym,
    SCALE_BLOCK: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    rk = tl.arange(0, BLOCK_K)
    bs_row = bs_ptr + (offs_n // SCALE_BLOCK) * stride_bsn  # [BN] this tile's weight block rows
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(pid_k * BLOCK_K, K, SPLIT_K * BLOCK_K):
        offs_k = k0 + rk
        k_mask = offs_k < K
        kb = k0 // SCALE_BLOCK
        a = tl.load(
            a_ptr + offs_m[:, None] * stride_am + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0
        )  # [BM, BK] e4m3
        b = tl.load(
            b_ptr + offs_n[None, :] * stride_bn + offs_k[:, None], mask=k_mask[:, None] & n_mask[None, :], other=0.0
        )  # [BK, BN] e4m3 (W transposed)
        a_s = tl.load(as_ptr + offs_m * stride_asm + kb, mask=m_mask, other=0.0)
        b_s = tl.load(bs_row + kb, mask=n_mask, other=0.0).to(tl.float32)
        acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
    tl.store(
        y_ptr + pid_k * stride_ys + offs_m[:, None] * stride_ym + offs_n[None, :],
        acc.to(y_ptr.dtype.element_ty),
        mask=m_mask[:, None] & n_mask[None, :],
    )


if not INTERPRET:
    _fp8_block_gemm_kernel = triton.autotune(configs=_configs(), key=["M_BUCKET", "N", "K", "SPLIT_K"])(
        _fp8_block_gemm_kernel
    )
_FIXED_META = _configs()[0].kwargs if INTERPRET else {}


def quantize_fp8_per_group(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic fp8 quantization per token and per 128 columns in Triton: x [..., K]
    float16/bfloat16/float32 -> (float8_e4m3fn [..., K], fp32 scales [..., ceil(K/128)]),
    bit-identical to `twin.quantize_fp8_per_group`."""
    _check_x("quantize_fp8_per_group", x)
    if x.dim() == 0:
        _fail("quantize_fp8_per_group", "x must have at least one dimension [..., K].")
    k = x.shape[-1]
    x2 = x.reshape(-1, k).contiguous()
    m, n_groups = x2.shape[0], triton.cdiv(k, BLOCK)
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((m, n_groups), dtype=torch.float32, device=x.device)
    if m and k:
        _quantize_group_kernel[(m, n_groups)](
            x2, q.view(torch.uint8), scale, k, x2.stride(0), q.stride(0), scale.stride(0), GROUP=BLOCK
        )
    return q.reshape(x.shape), scale.reshape(*x.shape[:-1], n_groups)


def _check(x, w_fp8, w_scale) -> None:
    _check_x("fp8_block_gemm", x)
    if w_fp8.dtype != torch.float8_e4m3fn or w_fp8.dim() != 2:
        _fail("fp8_block_gemm", f"w_fp8 must be float8_e4m3fn [out, in], got {w_fp8.dtype} {list(w_fp8.shape)}.")
    out_f, in_f = w_fp8.shape
    if x.dim() == 0 or x.shape[-1] != in_f:
        _fail("fp8_block_gemm", f"x must be [..., {in_f}] to match w_fp8 [{out_f}, {in_f}], got {list(x.shape)}.")
    blocks = (triton.cdiv(out_f, BLOCK), triton.cdiv(in_f, BLOCK))
    if not w_scale.is_floating_point() or tuple(w_scale.shape) != blocks:
        _fail(
            "fp8_block_gemm",
            f"w_scale must be float [{blocks[0]}, {blocks[1]}] (one per 128 x 128 block), "
            f"got {w_scale.dtype} {list(w_scale.shape)}.",
        )
    for name, t in (("w_fp8", w_fp8), ("w_scale", w_scale)):
        if t.device != x.device:
            _fail("fp8_block_gemm", f"{name} is on {t.device} but x is on {x.device}; put all operands on one device.")
    if not INTERPRET and torch.cuda.get_device_capability(x.device) < (8, 9):
        _fail(
            "fp8_block_gemm",
            f"the fp8 kernel needs a GPU with fp8 tensor cores (compute capability 8.9+), "
            f"{torch.cuda.get_device_name(x.device)} has "
            f"{'.'.join(map(str, torch.cuda.get_device_capability(x.device)))}; use the torch backend.",
        )


def _launch(x, w_fp8, w_scale, split_k: int) -> torch.Tensor:
    """Run the kernels on checked arguments with an explicit split-K factor (fp32 partial sums
    [split_k, M, N] added at the end when split_k > 1)."""
    out_f, k = w_fp8.shape
    lead = x.shape[:-1]
    x_fp8, s_x = quantize_fp8_per_group(x.reshape(-1, k))
    m = x_fp8.shape[0]
    y = torch.empty((m, out_f), dtype=x.dtype, device=x.device)
    if m == 0 or out_f == 0:
        return y.reshape(*lead, out_f)
    w_fp8 = w_fp8.contiguous()
    s_w = w_scale.float().contiguous()
    out = y if split_k == 1 else torch.empty((split_k, m, out_f), dtype=torch.float32, device=x.device)

    def grid(meta):
        return triton.cdiv(m, meta["BLOCK_M"]), triton.cdiv(out_f, meta["BLOCK_N"]), split_k

    _fp8_block_gemm_kernel[grid](
        x_fp8,
        w_fp8,
        s_x,
        s_w,
        out,
        m,
        out_f,
        k,
        triton.next_power_of_2(m),
        x_fp8.stride(0),
        w_fp8.stride(0),
        s_x.stride(0),
        s_w.stride(0),
        out.stride(0) if split_k > 1 else 0,
        out.stride(-2),
        SCALE_BLOCK=BLOCK,
        SPLIT_K=split_k,
        **_FIXED_META,
    )
    if split_k > 1:
        y = out.sum(dim=0).to(x.dtype)
    return y.reshape(*lead, out_f)


def fp8_block_gemm(x: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """y = x · dequant(W)ᵀ for FP8_BLOCK weights with x quantized per token and per 128 columns,
    in Triton; same contract as `twin.fp8_block_gemm`. x [..., K] float16/bfloat16/float32;
    w_fp8 float8_e4m3fn [N, K]; w_scale float [ceil(N/128), ceil(K/128)]. All on one CUDA device
    (CPU only under TRITON_INTERPRET=1). Split over K for few rows on a GPU
    (`int4.triton._split_k`). Returns [..., N] in x's dtype. Raises ValueError naming the
    argument when a shape, dtype or device is wrong."""
    _check(x, w_fp8, w_scale)
    m = x.numel() // max(x.shape[-1], 1)
    return _launch(x, w_fp8, w_scale, _split_k(m, w_fp8.shape[0], x.shape[-1], x.device))
