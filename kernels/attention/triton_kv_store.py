"""Triton `kv_store`: write the new tokens' keys and values into their paged-cache slots,
quantising to fp8 e4m3 or int8 on the way. The cache layout is spelled out at the top of
`attention/triton.py`; the torch twin is `attention/twin.py::kv_store`.

Rounding is done in fp32 arithmetic, then an exactly representable value is cast, so the
stored bytes equal torch's (`(x / scale).clamp(±448).to(float8_e4m3fn)`, `round` half to
even for int8) both on a GPU and under TRITON_INTERPRET=1, whose float downcast rounds
ties away from zero and drops fp8 subnormals (triton 3.9 `_convert_float`).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

QUANT_KINDS = {torch.float8_e4m3fn: "fp8", torch.int8: "int8"}
FLOAT_CACHE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _round_e4m3(x):
    """x fp32 in [-448, 448] -> the nearest float8_e4m3fn value (ties to even), still fp32."""
    bits = x.to(tl.int32, bitcast=True)
    exp = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)  # e4m3 subnormals are spaced like 2^-6's binade
    # 1.5 * 2^(exp + 20): adding and subtracting it rounds |x| to a multiple of 2^(exp - 3)
    magic = (((exp + 147) << 23) | 0x400000).to(tl.float32, bitcast=True)
    r = (tl.abs(x) + magic) - magic
    return tl.where(bits < 0, -r, r)  # keeps the sign of -0.0 and of values that round to 0


@triton.jit
def _store_tile(
    src_ptr,
    s_t,
    s_h,
    s_d,
    cache_ptr,
    c_b,
    c_t,
    c_h,
    c_d,
    scale_ptr,
    scale_stride,
    token,
    block,
    offset,
    num_heads,
    head_dim,
    HEADS: tl.constexpr,
    DIM: tl.constexpr,
    KIND: tl.constexpr,
):
    h = tl.arange(0, HEADS)[:, None]
    d = tl.arange(0, DIM)[None, :]
    mask = (h < num_heads) & (d < head_dim)
    x = tl.load(src_ptr + token * s_t + h * s_h + d * s_d, mask=mask, other=0.0)  # [HEADS, DIM]
    if KIND == "float":
        y = x
    else:
        scale = tl.load(scale_ptr + h * scale_stride, mask=h < num_heads, other=1.0)  # [HEADS, 1]
        y = tl.math.div_rn(x.to(tl.float32), scale)  # correctly rounded, like torch's division
        if KIND == "fp8":
            y = _round_e4m3(tl.minimum(tl.maximum(y, -448.0), 448.0))
        else:
            y = tl.minimum(tl.maximum(y, -128.0), 127.0)
            y = (y + 12582912.0) - 12582912.0  # 1.5 * 2^23: round half to even in fp32
    dst = cache_ptr + block * c_b + offset * c_t + h * c_h + d * c_d
    tl.store(dst, y.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _kv_store_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    k_scale_ptr,
    v_scale_ptr,
    s_kt,
    s_kh,
    s_kd,
    s_vt,
    s_vh,
    s_vd,
    s_kb,
    s_kc,
    s_kch,
    s_kcd,
    s_vb,
    s_vc,
    s_vch,
    s_vcd,
    num_heads,
    head_dim,
    k_scale_stride,
    v_scale_stride,
    BLOCK_SIZE: tl.constexpr,
    HEADS: tl.constexpr,
    DIM: tl.constexpr,
    KIND: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot >= 0:  # a negative slot is padding
        block = slot // BLOCK_SIZE
        offset = slot % BLOCK_SIZE
        _store_tile(
            k_ptr,
            s_kt,
            s_kh,
            s_kd,
            k_cache_ptr,
            s_kb,
            s_kc,
            s_kch,
            s_kcd,
            k_scale_ptr,
            k_scale_stride,
            token,
            block,
            offset,
            num_heads,
            head_dim,
            HEADS,
            DIM,
            KIND,
        )
        _store_tile(
            v_ptr,
            s_vt,
            s_vh,
            s_vd,
            v_cache_ptr,
            s_vb,
            s_vc,
            s_vch,
            s_vcd,
            v_scale_ptr,
            v_scale_stride,
            token,
            block,
            offset,
            num_heads,
            head_dim,
            HEADS,
            DIM,
            KIND,
        )


def interpreting() -> bool:
    """True when Triton kernels run in the CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def check_device(name: str, tensors: dict[str, torch.Tensor]) -> None:
    """Raise a ValueError unless all tensors share one device a Triton kernel can run on."""
    devices = {str(t.device) for t in tensors.values()}
    if len(devices) > 1:
        where = ", ".join(f"{n} on {t.device}" for n, t in tensors.items())
        raise ValueError(f"{name}: all tensors must be on one device; got {where}.")
    if next(iter(tensors.values())).device.type == "cpu" and not interpreting():
        raise ValueError(
            f"{name}: the Triton kernel needs a GPU; on CPU call quantkit.kernels.attention.twin.{name} "
            "(or set TRITON_INTERPRET=1 before importing triton)."
        )


def check_cache(
    name: str, k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None
) -> str:
    """Validate a paged K/V cache pair and its scales; return the kind "float", "fp8" or "int8"."""
    if k_cache.dim() != 4:
        raise ValueError(
            f"{name}: k_cache must be [num_blocks, block_size, num_kv_heads, head_dim]; "
            f"got shape {tuple(k_cache.shape)}."
        )
    if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        raise ValueError(
            f"{name}: v_cache must match k_cache; got {tuple(v_cache.shape)} {v_cache.dtype} "
            f"and {tuple(k_cache.shape)} {k_cache.dtype}."
        )
    kind = QUANT_KINDS.get(k_cache.dtype, "float" if k_cache.dtype in FLOAT_CACHE_DTYPES else None)
    if kind is None:
        raise ValueError(
            f"{name}: cache dtype {k_cache.dtype} is not supported; use float16, bfloat16, float32, "
            "float8_e4m3fn or int8."
        )
    kv_heads = k_cache.shape[2]
    for label, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if kind == "float":
            if scale is not None:
                raise ValueError(
                    f"{name}: {label} is only for fp8/int8 caches; pass None with a {k_cache.dtype} cache."
                )
            continue
        if scale is None:
            raise ValueError(f"{name}: a {k_cache.dtype} cache needs {label} (fp32, [1] or [num_kv_heads]).")
        if scale.dtype != torch.float32 or scale.dim() != 1 or scale.numel() not in (1, kv_heads):
            raise ValueError(
                f"{name}: {label} must be float32 of shape [1] or [{kv_heads}] (one per KV head); "
                f"got {scale.dtype} {tuple(scale.shape)}."
            )
    return kind


def scale_stride(scale: torch.Tensor | None) -> int:
    """0 for a per-tensor scale [1] (or none), 1 for one scale per KV head."""
    return 0 if scale is None or scale.numel() == 1 else 1


def kv_store(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Write k and v into the paged caches in place.

    k, v [num_tokens, num_kv_heads, head_dim] fp16/bf16/fp32 (the cache's dtype when the cache
    is not quantized); k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim];
    slot_mapping int64 (or int32) [num_tokens], slot = block * block_size + offset, negative =
    skip. fp8/int8 caches need k_scale, v_scale fp32 [1] or [num_kv_heads]; values are stored
    as quantize(x / scale).
    """
    kind = check_cache("kv_store", k_cache, v_cache, k_scale, v_scale)
    _, block_size, kv_heads, head_dim = k_cache.shape
    if k.dim() != 3 or k.shape[1:] != (kv_heads, head_dim) or v.shape != k.shape:
        raise ValueError(
            f"kv_store: k and v must both be [num_tokens, {kv_heads}, {head_dim}] to match the cache; "
            f"got {tuple(k.shape)} and {tuple(v.shape)}."
        )
    if k.dtype != v.dtype or k.dtype not in FLOAT_CACHE_DTYPES or (kind == "float" and k.dtype != k_cache.dtype):
        want = k_cache.dtype if kind == "float" else "float16, bfloat16 or float32"
        raise ValueError(f"kv_store: k and v must be {want}; got {k.dtype} and {v.dtype}.")
    if slot_mapping.shape != (k.shape[0],) or slot_mapping.dtype not in (torch.int64, torch.int32):
        raise ValueError(
            f"kv_store: slot_mapping must be int64 of shape [{k.shape[0]}] (one slot per token); "
            f"got {slot_mapping.dtype} {tuple(slot_mapping.shape)}."
        )
    tensors = {"k": k, "v": v, "k_cache": k_cache, "v_cache": v_cache, "slot_mapping": slot_mapping}
    if kind != "float":
        tensors |= {"k_scale": k_scale, "v_scale": v_scale}
    check_device("kv_store", tensors)
    if k.shape[0] == 0:
        return
    _kv_store_kernel[(k.shape[0],)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k_cache if k_scale is None else k_scale,
        v_cache if v_scale is None else v_scale,  # unread when None
        *k.stride(),
        *v.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        kv_heads,
        head_dim,
        scale_stride(k_scale),
        scale_stride(v_scale),
        BLOCK_SIZE=block_size,
        HEADS=triton.next_power_of_2(kv_heads),
        DIM=triton.next_power_of_2(head_dim),
        KIND=kind,
        num_warps=4,
    )
