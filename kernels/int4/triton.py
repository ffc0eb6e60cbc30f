"""W4A16 GEMM in Triton: y = x · dequant(Wq)ᵀ, the int4 weights dequantized in registers.

The kernel reads the on-disk compressed-tensors `pack-quantized` layout as is (no repack
at load): `w_packed` int32 [out, in / 8], element j of a row in bits 4*(j % 8) of word
j // 8, stored as value + 8. Each program computes one [BLOCK_M, BLOCK_N] tile of y and
walks K in BLOCK_K steps (interleaved over SPLIT_K programs when split-K is on):

    x tile      [BLOCK_M, BLOCK_K]  loaded in x's dtype (masked rows / columns read 0)
    words       [BLOCK_K, BLOCK_N]  w_packed[n, k // 8] (each word is read by its 8 k rows)
    q           (words >> 4*(k % 8)) & 0xF - 8                       signed int4
    w           ((q - z) * s) in fp32, rounded to scales' dtype, then to x's dtype
    acc        += tl.dot(x, w)   fp32 accumulator

s and z come from the group of column k: g_idx[k] (act-order), k // group_size, or the
single per-channel column; when a group spans whole K tiles one [BLOCK_N] row of scales is
loaded per tile instead of a gather. The twin is `quantkit.kernels.int4.twin.int4_gemm`.

On a GPU the tile sizes are autotuned over `_configs()`; under TRITON_INTERPRET=1 (CPU
tests) autotune needs a driver, so the first config is used as is.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _configs() -> list[triton.Config]:
    if INTERPRET:  # one fixed config; small enough that test shapes still exercise masks
        return [triton.Config({"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64})]
    return [
        triton.Config({"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128}, num_warps=4, num_stages=4),
        triton.Config({"BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 64}, num_warps=4, num_stages=4),
        triton.Config({"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 64}, num_warps=4, num_stages=4),
        triton.Config({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64}, num_warps=4, num_stages=3),
        triton.Config({"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64}, num_warps=8, num_stages=3),
        triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64}, num_warps=8, num_stages=3),
    ]


@triton.jit
def _int4_gemm_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    z_ptr,
    g_ptr,
    y_ptr,
    M,
    N,
    K,
    M_BUCKET,  # M_BUCKET: autotune key only (M rounded up to a power of two)
    stride_xm,
    stride_wn,
    stride_sn,
    stride_zn,
    stride_ys,
    stride_ym,
    GROUP_SIZE: tl.constexpr,  # 0: per channel (one scale column)
    HAS_ZEROS: tl.constexpr,
    HAS_G_IDX: tl.constexpr,
    X_IS_FP32: tl.constexpr,
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
    shifts = ((rk % 8) * 4)[:, None]  # [BK, 1] bit offset of element k in its word
    s_dtype = s_ptr.dtype.element_ty
    x_dtype = x_ptr.dtype.element_ty

    if GROUP_SIZE == 0:  # per channel: one [1, BN] row of scales for the whole K loop
        s_row = tl.load(s_ptr + offs_n * stride_sn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        z_row = tl.zeros([1, BLOCK_N], dtype=tl.int32)
        if HAS_ZEROS:
            z_row = tl.load(z_ptr + offs_n * stride_zn, mask=n_mask, other=0).to(tl.int32)[None, :]

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(pid_k * BLOCK_K, K, SPLIT_K * BLOCK_K):
        offs_k = k0 + rk
        k_mask = offs_k < K
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0
        )  # [BM, BK]
        kn_mask = k_mask[:, None] & n_mask[None, :]
        words = tl.load(w_ptr + offs_n[None, :] * stride_wn + (offs_k // 8)[:, None], mask=kn_mask, other=0)
        q = ((words >> shifts) & 0xF) - 8  # [BK, BN] int32 in [-8, 7]

        if HAS_G_IDX:  # act-order: gather the group of every column
            g = tl.load(g_ptr + offs_k, mask=k_mask, other=0)[:, None]  # [BK, 1]
            s = tl.load(s_ptr + offs_n[None, :] * stride_sn + g, mask=kn_mask, other=0.0).to(tl.float32)
            z = tl.zeros([1, BLOCK_N], dtype=tl.int32)
            if HAS_ZEROS:
                z = tl.load(z_ptr + offs_n[None, :] * stride_zn + g, mask=kn_mask, other=0).to(tl.int32)
        elif GROUP_SIZE == 0:
            s = s_row
            z = z_row
        elif GROUP_SIZE % BLOCK_K == 0:  # the whole K tile lies in one group: one row of scales
            g0 = k0 // GROUP_SIZE
            s = tl.load(s_ptr + offs_n * stride_sn + g0, mask=n_mask, other=0.0).to(tl.float32)[None, :]
            z = tl.zeros([1, BLOCK_N], dtype=tl.int32)
            if HAS_ZEROS:
                z = tl.load(z_ptr + offs_n * stride_zn + g0, mask=n_mask, other=0).to(tl.int32)[None, :]
        else:  # several groups per K tile
            g = (offs_k // GROUP_SIZE)[:, None]
            s = tl.load(s_ptr + offs_n[None, :] * stride_sn + g, mask=kn_mask, other=0.0).to(tl.float32)
            z = tl.zeros([1, BLOCK_N], dtype=tl.int32)
            if HAS_ZEROS:
                z = tl.load(z_ptr + offs_n[None, :] * stride_zn + g, mask=kn_mask, other=0).to(tl.int32)

        # (q - z) * s is exact in fp32; one rounding to scales' dtype, as the twin dequantizes
        w = ((q - z).to(tl.float32) * s).to(s_dtype).to(x_dtype)  # [BK, BN]
        if X_IS_FP32:  # no tf32: the twin multiplies in full fp32
            acc = tl.dot(x, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w, acc)

    y_ptrs = y_ptr + pid_k * stride_ys + offs_m[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


if not INTERPRET:
    _int4_gemm_kernel = triton.autotune(
        configs=_configs(), key=["M_BUCKET", "N", "K", "GROUP_SIZE", "HAS_G_IDX", "SPLIT_K"]
    )(_int4_gemm_kernel)
_FIXED_META = _configs()[0].kwargs if INTERPRET else {}


def _fail(msg: str):
    raise ValueError(f"int4_gemm: {msg}")


def _check(x, w_packed, scales, zeros, group_size, g_idx) -> int:
    """Validate the arguments; return the number of groups."""
    if x.dtype not in FLOAT_DTYPES:
        _fail(f"x must be float16, bfloat16 or float32, got {x.dtype}.")
    if INTERPRET and x.dtype == torch.bfloat16:
        _fail(
            "bfloat16 x is not supported under TRITON_INTERPRET=1 (the interpreter's tl.dot on bf16 "
            "is wrong); use float16/float32 or the torch backend."
        )
    if w_packed.dtype != torch.int32 or w_packed.dim() != 2:
        _fail(f"w_packed must be int32 [out, in / 8], got {w_packed.dtype} {list(w_packed.shape)}.")
    out_f, in_f = w_packed.shape[0], w_packed.shape[1] * 8
    if x.shape[-1] != in_f:
        _fail(
            f"x's last dimension is {x.shape[-1]} but w_packed {list(w_packed.shape)} holds in = {in_f} "
            f"columns (x must be [..., {in_f}])."
        )
    if group_size is not None and (not isinstance(group_size, int) or group_size <= 0 or in_f % group_size):
        _fail(
            f"group_size {group_size} does not divide the input width {in_f}; use a divisor of {in_f} "
            "or None (per channel)."
        )
    n_groups = in_f // group_size if group_size else 1
    if scales.dtype not in FLOAT_DTYPES or tuple(scales.shape) != (out_f, n_groups):
        _fail(
            f"scales must be float [{out_f}, {n_groups}] ([out, in / group_size]), "
            f"got {scales.dtype} {list(scales.shape)}."
        )
    if zeros is not None and (zeros.dtype != torch.int8 or tuple(zeros.shape) != (out_f, n_groups)):
        _fail(
            f"zeros must be int8 [{out_f}, {n_groups}] (unpacked signed zero points) or None, "
            f"got {zeros.dtype} {list(zeros.shape)}."
        )
    if g_idx is not None and (g_idx.dtype not in (torch.int32, torch.int64) or tuple(g_idx.shape) != (in_f,)):
        _fail(
            f"g_idx must be int32 [{in_f}] (the group of each input column) or None, "
            f"got {g_idx.dtype} {list(g_idx.shape)}."
        )
    for name, t in (("w_packed", w_packed), ("scales", scales), ("zeros", zeros), ("g_idx", g_idx)):
        if t is not None and t.device != x.device:
            _fail(f"{name} is on {t.device} but x is on {x.device}; put all operands on one device.")
    if not INTERPRET and x.device.type != "cuda":
        _fail(
            f"the Triton kernel needs CUDA tensors, got {x.device}; use the torch backend on CPU "
            "(or set TRITON_INTERPRET=1 before importing triton, for tests)."
        )
    return n_groups


def _split_k(m: int, n: int, k: int, device: torch.device) -> int:
    """Split K over programs when M is small and the (M, N) tiles alone leave SMs idle."""
    if INTERPRET or m > 64:
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    tiles = triton.cdiv(m, 64) * triton.cdiv(n, 64)
    split = 1
    while split < 8 and 2 * split * tiles <= sms and k // (2 * split) >= 512:
        split *= 2
    return split


def _launch(x, w_packed, scales, zeros, group_size, g_idx, split_k: int) -> torch.Tensor:
    """Run the kernel on checked arguments with an explicit split-K factor."""
    n_out, k = w_packed.shape[0], x.shape[-1]
    x2 = x.reshape(-1, k).contiguous()  # [M, K]
    m = x2.shape[0]
    y = torch.empty((m, n_out), dtype=x.dtype, device=x.device)
    if m == 0 or n_out == 0:
        return y.reshape(*x.shape[:-1], n_out)
    w_packed, scales = w_packed.contiguous(), scales.contiguous()
    zeros = zeros.contiguous() if zeros is not None else None
    g_idx = g_idx.to(torch.int32).contiguous() if g_idx is not None else None
    out = y if split_k == 1 else torch.empty((split_k, m, n_out), dtype=torch.float32, device=x.device)

    def grid(meta):
        return triton.cdiv(m, meta["BLOCK_M"]), triton.cdiv(n_out, meta["BLOCK_N"]), split_k

    _int4_gemm_kernel[grid](
        x2,
        w_packed,
        scales,
        zeros if zeros is not None else scales,
        g_idx if g_idx is not None else w_packed,
        out,
        m,
        n_out,
        k,
        triton.next_power_of_2(m),
        x2.stride(0),
        w_packed.stride(0),
        scales.stride(0),
        zeros.stride(0) if zeros is not None else 0,
        out.stride(0) if split_k > 1 else 0,
        out.stride(-2),
        GROUP_SIZE=group_size or 0,
        HAS_ZEROS=zeros is not None,
        HAS_G_IDX=g_idx is not None,
        X_IS_FP32=x.dtype == torch.float32,
        SPLIT_K=split_k,
        **_FIXED_META,
    )
    if split_k > 1:
        y = out.sum(dim=0).to(x.dtype)
    return y.reshape(*x.shape[:-1], n_out)


def int4_gemm(
    x: torch.Tensor,
    w_packed: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int | None,
    g_idx: torch.Tensor | None = None,
) -> torch.Tensor:
    """y = x · dequant(W)ᵀ for W4A16, in Triton; same contract as `reference.int4_gemm`.

    x [..., in] float16/bfloat16/float32; w_packed int32 [out, in / 8] (pack-quantized);
    scales float [out, in / group_size] ([out, 1] with group_size None: per channel);
    zeros int8 [out, in / group_size] (unpacked signed zero points) or None (symmetric);
    g_idx int32 [in] (act-order: column j uses group g_idx[j]; values are not checked,
    that would cost a device sync) or None. All on one CUDA device (CPU only under
    TRITON_INTERPRET=1). Accumulates in fp32; returns [..., out] in x's dtype. Raises
    ValueError naming the argument when a shape, dtype or device is wrong.
    """
    _check(x, w_packed, scales, zeros, group_size, g_idx)
    m = x.numel() // max(x.shape[-1], 1)
    return _launch(x, w_packed, scales, zeros, group_size, g_idx, _split_k(m, w_packed.shape[0], x.shape[-1], x.device))
