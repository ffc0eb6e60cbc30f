"""Pure-torch twins of the kernels: same signatures, plain math, the reference the
Triton kernels are tested against and the CPU path."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from quantkit.errors import QuantkitError
from quantkit.packing import unpack
from quantkit.primitives import dequantize, fake_quantize
from quantkit.scheme import QuantArgs


def int4_gemm(
    x: torch.Tensor,
    w_packed: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int | None,
    g_idx: torch.Tensor | None = None,
) -> torch.Tensor:
    """y = x · dequant(W)ᵀ for W4A16.

    x [..., in] (any float dtype); w_packed int32 [out, in / 8] in the pack-quantized
    layout; scales [out, in / group_size] (or [out, 1] per channel); zeros int8
    [out, in / group_size] unpacked signed zero points, None when symmetric; g_idx int32
    [in] (act-order groups) or None. Dequantizes in scales' dtype, multiplies in x's
    dtype; returns [..., out] in x's dtype.
    """
    in_features = w_packed.shape[1] * 8
    args = QuantArgs(
        num_bits=4,
        symmetric=zeros is None,
        strategy="group" if group_size else "channel",
        group_size=group_size,
    )
    w = dequantize(unpack(w_packed, in_features), scales, zeros, args, g_idx)
    return x @ w.to(x.dtype).t()


FP8_MAX = 448.0


def fp8_gemm(
    x: torch.Tensor,
    w_fp8: torch.Tensor,
    w_scale: torch.Tensor,
    x_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """y = (x_fp8 · W_fp8ᵀ) · s_x · s_w for W8A8 fp8 e4m3.

    x [..., in] (float); w_fp8 float8_e4m3fn [out, in]; w_scale [out, 1] (per channel) or
    [1] (per tensor); x_scale [1] (static per tensor) or None (dynamic: amax / 448 per
    token). The fp8 products are summed in fp32; returns [..., out] in x's dtype.
    """
    xf = x.float()
    if x_scale is None:
        x_scale = xf.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12) / FP8_MAX  # [..., 1]
    x_fp8 = (xf / x_scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    y = (x_fp8.float() @ w_fp8.float().t()) * x_scale * w_scale.float().reshape(1, -1)
    return y.to(x.dtype)


INT8_TOKEN = QuantArgs(num_bits=8, type="int", symmetric=True, strategy="token", group_size=None, dynamic=True)


def int8_gemm(x: torch.Tensor, w_int8: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """y = Q(x) · (W_int8 · s_w)ᵀ for W8A8 int8.

    x [..., in] (float), quantized to int8 per token (symmetric, scale amax / 127.5, as
    `quantkit.primitives`) and dequantized; w_int8 int8 [out, in]; w_scale [out, 1] (per
    channel) or [1] (per tensor). Multiplies the dequantized values in fp32; returns
    [..., out] in x's dtype.
    """
    w = w_int8.float() * w_scale.float().reshape(-1, 1)  # [out, in]
    return (fake_quantize(x.float(), INT8_TOKEN) @ w.t()).to(x.dtype)


# --- paged KV cache: kv_store and paged_attention (layout: kernels/paged_attention.py) ---


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


# The element-wise steps of a decoder block: transformers' own torch code, the twins of
# `kernels/csrc/fused.cpp` (its header says where each rounds).


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool = False) -> torch.Tensor:
    """RMSNorm over the last dim as Llama computes it (`weight` times the normalised x in x's
    dtype) or, with gemma, as Gemma does ((1 + weight) times it, in fp32, then x's dtype)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if gemma:
        return (h * (1.0 + weight.float())).to(x.dtype)
    return weight * h.to(x.dtype)


def add_rms_norm_(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool = False):
    """x += delta in place (the residual stream), then `rms_norm(x)`."""
    return rms_norm(x.add_(delta), weight, eps, gemma)


def rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin with rotate_half(x) = [-x2, x1] written as [x2, x1] * [-sin1, sin2]
    (the same products and sum as transformers'); x [T, heads, D], cos/sin [T, 1, R]: with
    R < D (partial rotary) only the first R dims rotate."""
    rotary = cos.shape[-1]
    if rotary < x.shape[-1]:
        return torch.cat([rope(x[..., :rotary], cos, sin_signed), x[..., rotary:]], dim=-1)
    swapped = x.unflatten(-1, (2, -1)).flip(-2).flatten(-2)  # [x2, x1]
    return x * cos + swapped * sin_signed


def rope_(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> None:
    """`rope` in place: x [T, heads, D], cos and sign-folded sin [T, R]."""
    x.copy_(rope(x, cos[:, None], sin_signed[:, None]))


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [T, 2I] = [gate, up]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(-1) for x [rows, vocab]: the first index of each row's maximum (NaN the largest)."""
    return x.argmax(-1)
