"""The twins of the paged KV cache's operations: `kv_store` (an index copy), `paged_attention` and
`paged_prefill` (gathered blocks, plain softmax attention; layout: `quantkit.kernels.attention.triton`),
and their window and soft-cap helpers."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from quantkit.errors import QuantkitError
from quantkit.kernels.fp8.twin import FP8_MAX


def _quantize_kv(x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None) -> torch.Tensor:
    """x [n, kv_heads, head_dim] -> the cache's dtype; fp8/int8 store quantize(x / scale)."""
    if scale is None:
        return x.to(dtype)
    y = x.float() / scale.float().reshape(-1, 1)  # scale [1] or [kv_heads] -> [1 or kv_heads, 1]
    if dtype == torch.float8_e4m3fn:
        return y.clamp(-FP8_MAX, FP8_MAX).to(dtype)
    return torch.round(y).clamp(-128, 127).to(torch.int8)


def kv_store(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Write k, v [num_tokens, kv_heads, head_dim] into the caches [num_blocks, block_size,
    kv_heads, head_dim] at slot_mapping [num_tokens] (block * block_size + offset; negative =
    skip), quantising for fp8/int8 caches with k_scale / v_scale fp32 [1] or [kv_heads]."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    block, offset = slots // k_cache.shape[1], slots % k_cache.shape[1]
    k_cache[block, offset] = _quantize_kv(k[keep], k_cache.dtype, k_scale)
    v_cache[block, offset] = _quantize_kv(v[keep], v_cache.dtype, v_scale)


def gather_kv(
    cache: torch.Tensor, block_table: torch.Tensor, seq_len: int, scale: torch.Tensor | None = None
) -> torch.Tensor:
    """The first seq_len tokens of one sequence, dequantised: [seq_len, kv_heads, head_dim] fp32."""
    blocks = block_table[: -(-seq_len // cache.shape[1])].long()
    x = cache[blocks].flatten(0, 1)[:seq_len].float()  # [n_blocks, bs, h, d] -> [seq_len, h, d]
    return x if scale is None else x * scale.float().reshape(-1, 1)


def check_window_softcap(name: str, window: int | None, softcap: float | None) -> None:
    """Raise a QuantkitError unless window is a positive int or None and softcap a positive
    finite number or None (the options of `paged_attention` and `paged_prefill`)."""
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise QuantkitError(
            f"{name}: window must be a positive int (the sliding window in tokens) or None; got {window!r}."
        )
    if softcap is not None and (
        isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not 0 < softcap < math.inf
    ):
        raise QuantkitError(
            f"{name}: softcap must be a finite positive number (the attention-logit soft cap) or None; got {softcap!r}."
        )


def visible(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """bool [n, L]: True where the query at absolute position q_pos[i] attends to the key at
    k_pos[j]: k <= q (causal) and, with a window, q - window < k (transformers' sliding window)."""
    mask = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        mask &= k_pos[None, :] > q_pos[:, None] - window
    return mask


def cap(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """softcap · tanh(scores / softcap), Gemma 2's attn_logit_softcapping; scores as they are for None."""
    return scores if softcap is None else torch.tanh(scores / softcap) * softcap


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
    """Decode attention: q [num_seqs, num_heads, head_dim], one new token per sequence (at
    position seq_lens[i] - 1), over the first seq_lens[i] cached tokens of sequence i
    (block_tables [num_seqs, max_blocks]); with a window, over its last `window` tokens only.
    Scores are q·k · scale, then softcap · tanh(· / softcap) when softcap is set. Query head
    h reads KV head h // (num_heads / kv_heads). fp32 softmax; returns q's dtype (zeros for
    a sequence of length 0)."""
    out = torch.zeros_like(q)
    group = q.shape[1] // k_cache.shape[2]
    for i, seq_len in enumerate(seq_lens.tolist()):
        if seq_len == 0:
            continue
        k = gather_kv(k_cache, block_tables[i], seq_len, k_scale).repeat_interleave(group, dim=1)  # [L, H, D]
        v = gather_kv(v_cache, block_tables[i], seq_len, v_scale).repeat_interleave(group, dim=1)
        scores = cap(torch.einsum("hd,lhd->hl", q[i].float(), k) * scale, softcap)  # [H, L]
        if window is not None:
            scores[:, : max(seq_len - window, 0)] = float("-inf")
        out[i] = torch.einsum("hl,lhd->hd", scores.softmax(dim=-1), v).to(q.dtype)
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
    """Causal attention for the new tokens of several sequences: q [total_query_tokens,
    num_heads, head_dim] holds sequence i's last query_lens[i] of its seq_lens[i] cached
    tokens, back to back (query j at position seq_len - query_len + j). Each sequence's
    blocks are gathered, dequantised to fp32 and fed to SDPA with a bottom-right causal mask
    (`visible`, narrowed to the window when one is given); with a softcap, which SDPA cannot
    apply, the same in explicit fp32 matmuls. Returns q's shape and dtype."""

    out = torch.empty_like(q)
    start = 0
    lens, qlens = seq_lens.tolist(), query_lens.tolist()
    group = q.shape[1] // k_cache.shape[2]
    for i, (seq_len, q_len) in enumerate(zip(lens, qlens)):
        if q_len == 0:
            continue
        k = gather_kv(k_cache, block_tables[i], seq_len, k_scale).transpose(0, 1)  # [kv_heads, L, D]
        v = gather_kv(v_cache, block_tables[i], seq_len, v_scale).transpose(0, 1)
        qi = q[start : start + q_len].float().transpose(0, 1)  # [heads, q_len, D]
        pos = torch.arange(seq_len - q_len, seq_len, device=q.device)  # absolute positions of the queries
        mask = visible(pos, torch.arange(seq_len, device=q.device), window)  # [q_len, L]
        if softcap is None:
            o = F.scaled_dot_product_attention(qi, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        else:
            k, v = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)  # [heads, L, D]
            scores = cap(qi @ k.transpose(1, 2) * scale, softcap).masked_fill(~mask, float("-inf"))
            o = scores.softmax(dim=-1) @ v  # [heads, q_len, D]
        out[start : start + q_len] = o.transpose(0, 1).to(q.dtype)
        start += q_len
    return out
