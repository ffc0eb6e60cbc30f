"""Decode attention over a paged KV cache (Triton), and a prefill path (torch).

Paged KV cache layout (shared with `kv_store` and the engine):

- k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], block_size 16 by
  default (the Triton decode kernel takes powers of two >= 16). dtype float16, bfloat16,
  float32 (stored as is), float8_e4m3fn or int8 (quantized).
- k_scale, v_scale: fp32 [1] (per tensor) or [num_kv_heads] (per KV head), fp8/int8 only:
  stored = quantize(value / scale), fp8 clamps to ±448 then casts (round to nearest even),
  int8 rounds half to even and clamps to [-128, 127]; dequantized = stored * scale. Scales
  follow `calibration/kv.py` (fp8: amax / 448, int8: amax / 127), as vLLM's k_scale/v_scale.
- block_tables: int32 [num_seqs, max_blocks_per_seq]; row i lists sequence i's blocks in
  order; entries past its ceil(seq_len / block_size) blocks (e.g. -1) are never read.
- seq_lens: int32 [num_seqs], cached tokens per sequence including the new one(s).
- slot_mapping: int64 [num_tokens], slot = block * block_size + offset; negative = skip.
- Token t of sequence i lives at k_cache[block_tables[i, t // block_size], t % block_size].

Query head h reads KV head h // (num_heads // num_kv_heads) (grouped-query attention).

Options, as transformers: `window` (sliding window) lets the query at position t attend to
positions t - window < s <= t only; the decode kernel starts at the block holding position
seq_len - window and masks the tokens before it. `softcap` (Gemma 2's attn_logit_softcapping)
turns the scaled scores s into softcap · tanh(s / softcap) before masking and softmax.

Under the Triton interpreter (TRITON_INTERPRET=1, CPU, triton 3.9): float8_e4m3fn loads
decode exactly, so fp8 caches are read as fp8 (no uint8 detour; `kv_store` rounds fp8
itself because the interpreter's downcast does not); bf16 `tl.dot` is wrong and fp32 ->
bf16 casts truncate, so bf16 is only checked on a GPU; autotune needs a driver, so the
interpreter runs one fixed config (decided at import).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quantkit.kernels.attention import twin as attention_twin
from quantkit.kernels.attention.triton_kv_store import (
    FLOAT_CACHE_DTYPES,
    check_cache,
    check_device,
    interpreting,
    scale_stride,
)

LOG2E = 1.4426950408889634


def _configs() -> list[triton.Config]:
    """Launch configs to autotune on a GPU; the interpreter has no driver to time them."""
    return [triton.Config({}, num_warps=w, num_stages=s) for w in (2, 4, 8) for s in (1, 2, 3)]


@triton.jit
def _decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    k_scale_ptr,
    v_scale_ptr,
    out_ptr,
    qk_scale,  # softmax scale * log2(e)
    window,  # sliding window in tokens (WINDOW only)
    softcap,  # attention-logit soft cap (SOFTCAP only)
    s_qs,
    s_qh,
    s_qd,
    s_kb,
    s_kt,
    s_kh,
    s_kd,
    s_vb,
    s_vt,
    s_vh,
    s_vd,
    s_bt,
    s_os,
    s_oh,
    s_od,
    head_dim,
    k_scale_stride,
    v_scale_stride,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    DIM: tl.constexpr,
    QUANT: tl.constexpr,
    PRECISION: tl.constexpr,
    WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    # one program per (sequence, KV head): the group's query heads share each K/V tile
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, DIM)
    t = tl.arange(0, BLOCK_SIZE)
    q_mask = (g[:, None] < GROUP) & (d[None, :] < head_dim)
    q = tl.load(
        q_ptr + seq * s_qs + (kvh * GROUP + g[:, None]) * s_qh + d[None, :] * s_qd, mask=q_mask, other=0.0
    )  # [GROUP_PAD, DIM]
    if QUANT:  # scores = (q . k_stored) * k_scale, out = (p . v_stored) * v_scale: exact dequantisation
        qk_scale = qk_scale * tl.load(k_scale_ptr + kvh * k_scale_stride)
    seq_len = tl.load(seq_lens_ptr + seq)
    first = seq_len * 0  # the first position the query (at seq_len - 1) attends to
    if WINDOW:
        first = tl.maximum(seq_len - window, 0)
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)  # running max (log2 units)
    l_i = tl.zeros([GROUP_PAD], tl.float32)  # running sum of exp2(score - m_i)
    acc = tl.zeros([GROUP_PAD, DIM], tl.float32)
    for j in range(first // BLOCK_SIZE, (seq_len + BLOCK_SIZE - 1) // BLOCK_SIZE):  # blocks before the window: skipped
        block = tl.load(block_tables_ptr + seq * s_bt + j).to(tl.int64)
        valid = j * BLOCK_SIZE + t < seq_len  # the tail of the last block is masked
        if WINDOW:
            valid = valid & (j * BLOCK_SIZE + t >= first)  # and the head of the first, before the window
        kv_mask = valid[:, None] & (d[None, :] < head_dim)
        k = tl.load(
            k_cache_ptr + block * s_kb + t[:, None] * s_kt + kvh * s_kh + d[None, :] * s_kd, mask=kv_mask, other=0.0
        )  # [BLOCK_SIZE, DIM], fp8/int8 -> q's dtype is exact
        s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION) * qk_scale  # [GROUP_PAD, BLOCK_SIZE]
        if SOFTCAP:  # c · tanh(s / c) with c = softcap · log2(e) (s is in log2 units); tanh x = 1 - 2 / (e^2x + 1)
            s = (softcap * 1.4426950408889634) * (1.0 - 2.0 / (tl.exp2(s * (2.0 / softcap)) + 1.0))
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(
            v_cache_ptr + block * s_vb + t[:, None] * s_vt + kvh * s_vh + d[None, :] * s_vd, mask=kv_mask, other=0.0
        )  # masked: stale slots may hold NaN
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=PRECISION)
        m_i = m_new
    if QUANT:
        acc = acc * tl.load(v_scale_ptr + kvh * v_scale_stride)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # seq_len 0 -> zeros
    tl.store(
        out_ptr + seq * s_os + (kvh * GROUP + g[:, None]) * s_oh + d[None, :] * s_od,
        out.to(out_ptr.dtype.element_ty),
        mask=q_mask,
    )


_decode = (
    _decode_kernel
    if interpreting()
    else triton.autotune(_configs(), key=["GROUP_PAD", "BLOCK_SIZE", "DIM", "QUANT", "WINDOW", "SOFTCAP"])(
        _decode_kernel
    )
)


def _check_tables(name: str, num_seqs: int, block_tables: torch.Tensor, seq_lens: torch.Tensor) -> None:
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs or block_tables.dtype != torch.int32:
        raise ValueError(
            f"{name}: block_tables must be int32 [{num_seqs}, max_blocks_per_seq] (one row per sequence); "
            f"got {block_tables.dtype} {tuple(block_tables.shape)}."
        )
    if seq_lens.shape != (num_seqs,) or seq_lens.dtype != torch.int32:
        raise ValueError(
            f"{name}: seq_lens must be int32 [{num_seqs}] (one length per sequence); "
            f"got {seq_lens.dtype} {tuple(seq_lens.shape)}."
        )


def _check_query(name: str, q: torch.Tensor, k_cache: torch.Tensor, kind: str) -> None:
    kv_heads, head_dim = k_cache.shape[2:]
    if q.dim() != 3 or q.shape[2] != head_dim or q.shape[1] % kv_heads:
        raise ValueError(
            f"{name}: q must be [tokens, num_heads, {head_dim}] with num_heads a multiple of the cache's "
            f"{kv_heads} KV heads; got {tuple(q.shape)}."
        )
    if q.dtype not in FLOAT_CACHE_DTYPES or (kind == "float" and q.dtype != k_cache.dtype):
        want = k_cache.dtype if kind == "float" else "float16, bfloat16 or float32"
        raise ValueError(f"{name}: q must be {want} for a {k_cache.dtype} cache; got {q.dtype}.")


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Decode attention for one new token per sequence, over the paged cache (layout above).

    q [num_seqs, num_heads, head_dim] fp16/bf16/fp32 (the cache's dtype for an unquantized
    cache); block_tables int32 [num_seqs, max_blocks]; seq_lens int32 [num_seqs] (must fit in
    the table: not checked, it would need a device sync); scale: the softmax scale, usually
    head_dim ** -0.5; k_scale / v_scale fp32 [1] or [num_kv_heads] for fp8/int8 caches;
    window: attend to the last `window` tokens only (None: all); softcap: cap the scaled
    scores at ±softcap with tanh (None: no cap). Online softmax in fp32; returns [num_seqs,
    num_heads, head_dim] in q's dtype (zeros for a sequence of length 0).
    """
    attention_twin.check_window_softcap("paged_attention", window, softcap)
    kind = check_cache("paged_attention", k_cache, v_cache, k_scale, v_scale)
    _check_query("paged_attention", q, k_cache, kind)
    _check_tables("paged_attention", q.shape[0], block_tables, seq_lens)
    _, block_size, kv_heads, head_dim = k_cache.shape
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(
            f"paged_attention: the Triton kernel needs a block_size that is a power of two >= 16; got {block_size}."
        )
    tensors = {"q": q, "k_cache": k_cache, "v_cache": v_cache, "block_tables": block_tables, "seq_lens": seq_lens}
    if kind != "float":
        tensors |= {"k_scale": k_scale, "v_scale": v_scale}
    check_device("paged_attention", tensors)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if q.shape[0] == 0:
        return out
    group = q.shape[1] // kv_heads
    _decode[(q.shape[0], kv_heads)](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        k_cache if k_scale is None else k_scale,
        v_cache if v_scale is None else v_scale,  # unread when None
        out,
        scale * LOG2E,
        window or 0,
        float(softcap or 1.0),
        *q.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        block_tables.stride(0),
        *out.stride(),
        head_dim,
        scale_stride(k_scale),
        scale_stride(v_scale),
        GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        BLOCK_SIZE=block_size,
        DIM=max(16, triton.next_power_of_2(head_dim)),
        QUANT=kind != "float",
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",  # fp32 q: no tf32 rounding on the GPU
        WINDOW=window is not None,
        SOFTCAP=softcap is not None,
    )
    return out


def paged_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_lens: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention for the new tokens of several sequences, in torch (no Triton).

    q [total_query_tokens, num_heads, head_dim]: sequence i's query_lens[i] (int32
    [num_seqs]) new tokens, sequences back to back; they are the last query_lens[i] of its
    seq_lens[i] tokens, all already in the cache (kv_store first). A whole prompt has
    query_len == seq_len, a chunk after cached tokens query_len < seq_len. Each sequence's
    blocks are gathered and dequantised to fp32 (`attention_twin.gather_kv`) and fed to
    `F.scaled_dot_product_attention` with a bottom-right causal mask (narrowed to the last
    `window` positions of each query with a window; explicit fp32 matmuls with a softcap);
    returns q's shape and dtype. This validates its arguments and runs `attention_twin.paged_prefill`.
    """
    attention_twin.check_window_softcap("paged_prefill", window, softcap)
    kind = check_cache("paged_prefill", k_cache, v_cache, k_scale, v_scale)
    _check_query("paged_prefill", q, k_cache, kind)
    _check_tables("paged_prefill", seq_lens.numel(), block_tables, seq_lens)
    if query_lens.shape != seq_lens.shape or query_lens.dtype != torch.int32:
        raise ValueError(
            f"paged_prefill: query_lens must be int32 [{seq_lens.numel()}] (one per sequence); "
            f"got {query_lens.dtype} {tuple(query_lens.shape)}."
        )
    lens, qlens = seq_lens.tolist(), query_lens.tolist()
    capacity = block_tables.shape[1] * k_cache.shape[1]
    if sum(qlens) != q.shape[0]:
        raise ValueError(f"paged_prefill: q has {q.shape[0]} tokens but query_lens add up to {sum(qlens)}.")
    for i, (seq_len, q_len) in enumerate(zip(lens, qlens)):
        if not 0 <= q_len <= seq_len <= capacity:
            raise ValueError(
                f"paged_prefill: sequence {i} needs 0 <= query_len <= seq_len <= {capacity} (the block table's "
                f"capacity); got query_len {q_len}, seq_len {seq_len}."
            )
    return attention_twin.paged_prefill(
        q, k_cache, v_cache, block_tables, seq_lens, query_lens, scale, k_scale, v_scale, window, softcap
    )
