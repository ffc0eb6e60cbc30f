"""The paged KV cache on the CPU: what `quantkit.ops` runs for `kv_store`, `paged_attention`
and `paged_prefill` when the tensors are not on a GPU. Same signatures, layout and results as
the twins (`twin.py` beside them) (the layout is spelled out in
`quantkit.kernels.attention.triton`); tests hold them to the twins with a per-dtype tolerance.

Attention takes the C++ kernels of `kernels/attention/attention.cpp` (`cpu_ext`), which read the
blocks in place, when they are built and head_dim is a multiple of 16; prefill only for the
sequences where they beat SDPA (`paged_prefill`). Decode with bf16 queries on a bf16, fp8 or
int8 cache (head_dim 64 or 128) runs there in two passes per sequence, scores in AMX tiles where
the CPU has them (`QUANTKIT_NO_AMX=1`: AVX512-BF16 instead); prefill with the same queries and
caches runs wholly in AMX tiles where the CPU has them (`ext.amx_prefill`), every sequence; the
kernel's header comment says more. Otherwise, and with `QUANTKIT_NO_EXT=1`, the batched torch
code below (`torch_paged_attention`, `torch_paged_prefill`).

Decode attention in torch does not loop over sequences one by one. Sequences are sorted by length
and taken in chunks of about `CHUNK_BYTES` of K+V; each chunk's blocks are gathered with
one `index_select` per cache into a padded [n, max_len, kv_heads, head_dim] tensor (small
enough to stay in the CPU's cache while it is used), its padding is zeroed, and one SDPA
call attends for all of them with a length mask. Grouped-query heads fold into the query
length: the g query heads that share a KV head become g queries of that head, so nothing
is repeated. SDPA's CPU kernel accumulates in fp32 whatever the input dtype; float caches
attend in q's dtype, fp8/int8 caches are dequantised to fp32. The chunking (sort, block
lists, masks) depends only on block_tables and seq_lens, which the runner passes unchanged
to every layer of a step, so it is made once and reused (`_plan_for`): 10% of a 64-sequence
decode step.

Prefill runs one SDPA per sequence (causal, grouped-query heads natively) on its gathered
blocks; kv_store is one `index_copy_` per cache.

A sliding window narrows what is gathered: decode reads each sequence's blocks from the one
holding its first visible token (`_window_plan`, chunked by those spans, the mask hiding
the tokens before the window), prefill from the block of its first query's first visible
token, with a window mask. Soft-capping cannot go through SDPA: with a softcap the same
attention runs as explicit fp32 matmuls and softmax (`_capped`). Without either, the code
path is the one above.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from quantkit.kernels import cpu_ext
from quantkit.kernels.attention.twin import _quantize_kv, cap, visible

CHUNK_BYTES = 2 << 20  # K+V gathered per SDPA call: about the size of one core's L2
PREFILL_TILE = 16  # queries per work item of the C++ prefill without AMX (the AMX one takes 256)
PREFILL_EXT_WORK = 8192  # without AMX, the C++ prefill takes a sequence when query_len * seq_len <= this


def kv_store(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """`reference.kv_store` as one `index_copy_` per cache (k, v [num_tokens, kv_heads,
    head_dim]; slot_mapping int64 [num_tokens], negative = skip)."""
    slots = slot_mapping.long()
    if slots.numel() and int(slots.min()) < 0:
        keep = slots >= 0
        k, v, slots = k[keep], v[keep], slots[keep]
    for x, cache, scale in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        x = _quantize_kv(x, cache.dtype, scale)
        flat = cache.view(-1, *cache.shape[2:])  # [num_blocks * block_size, kv_heads, head_dim]
        if cache.element_size() == 1:  # index_copy_ has no fp8 kernel; the bytes are the same
            flat, x = flat.view(torch.uint8), x.view(torch.uint8)
        flat.index_copy_(0, slots, x)


def _gather(
    cache: torch.Tensor, blocks: torch.Tensor, n: int, scale: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """cache [num_blocks, bs, h, d], blocks int64 [n * nb] (n sequences' tables, row after
    row) -> [n, nb * bs, h, d] in `dtype`, dequantised with `scale` fp32 [1] or [h]."""
    x = cache.index_select(0, blocks).view(n, -1, *cache.shape[2:])
    if scale is None:
        return x.to(dtype)
    return x.to(torch.float32) * scale.float().reshape(-1, 1)


def _compute_dtype(q: torch.Tensor, cache: torch.Tensor) -> torch.dtype:
    return q.dtype if cache.dtype == q.dtype else torch.float32


def _chunks(lens: list[int], row_bytes: int) -> list[list[int]]:
    """Indices of the non-empty sequences, longest first, in chunks of about CHUNK_BYTES."""
    order = sorted((i for i, n in enumerate(lens) if n > 0), key=lambda i: -lens[i])
    chunks: list[list[int]] = []
    for i in order:
        if chunks and (len(chunks[-1]) + 1) * lens[chunks[-1][0]] * row_bytes <= CHUNK_BYTES:
            chunks[-1].append(i)
        else:
            chunks.append([i])
    return chunks


@dataclass(frozen=True, slots=True)
class _Chunk:
    """Sequences that attend in one SDPA call."""

    rows: torch.Tensor | None  # int64 [n]: their rows of q, None: all rows, in order
    blocks: torch.Tensor  # int64 [n * nb]: their first nb blocks, row after row (-1 entries read block 0)
    n: int
    length: int  # tokens to attend: all n are this long; or the padded length when `mask` is set
    mask: torch.Tensor | None  # bool [n, 1, 1, length]: True where a token is real
    padding: torch.Tensor | None  # int64: the padding tokens' indices in the flat [n * length]


def _plan(block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int, row_bytes: int) -> list[_Chunk]:
    lens, plan = seq_lens.tolist(), []
    for chunk in _chunks(lens, row_bytes):
        n, longest = len(chunk), lens[chunk[0]]
        rows = None if n == len(lens) else torch.tensor(chunk, device=block_tables.device)
        tables, chunk_lens = (
            (block_tables, seq_lens)
            if rows is None
            else (block_tables.index_select(0, rows), seq_lens.index_select(0, rows))
        )
        nb = -(-longest // block_size)
        blocks = tables[:, :nb].reshape(-1).long().clamp_min(0)
        if lens[chunk[-1]] == longest:
            plan.append(_Chunk(rows, blocks, n, longest, None, None))
            continue
        valid = torch.arange(nb * block_size, device=blocks.device) < chunk_lens[:, None]  # [n, padded_len]
        padding = (~valid).view(-1).nonzero().squeeze(1)
        plan.append(_Chunk(rows, blocks, n, nb * block_size, valid[:, None, None, :], padding))
    return plan


def _window_plan(
    block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int, row_bytes: int, window: int
) -> list[_Chunk]:
    """`_plan` for a sliding window: sequence i reads its blocks from the one holding position
    seq_len - window (its decode query's first visible token) on; `mask` hides the tokens before
    that position and past seq_len."""
    lens = seq_lens.tolist()
    firsts = [max(n - window, 0) // block_size for n in lens]  # the first block each sequence reads
    spans = [n - f * block_size if n else 0 for n, f in zip(lens, firsts)]  # tokens from there to the end
    width, device, plan = block_tables.shape[1], block_tables.device, []
    for chunk in _chunks(spans, row_bytes):
        n, nb = len(chunk), -(-spans[chunk[0]] // block_size)
        rows = None if n == len(lens) else torch.tensor(chunk, device=device)
        order = range(n) if rows is None else chunk
        first = torch.tensor([firsts[i] for i in order], device=device)[:, None]  # [n, 1]
        tables, chunk_lens = (
            (block_tables, seq_lens)
            if rows is None
            else (block_tables.index_select(0, rows), seq_lens.index_select(0, rows))
        )
        cols = (first + torch.arange(nb, device=device)).clamp_max(width - 1)  # [n, nb]; past the table: masked
        blocks = tables.gather(1, cols).reshape(-1).long().clamp_min(0)
        pos = first * block_size + torch.arange(nb * block_size, device=device)  # [n, nb * bs] absolute positions
        valid = (pos < chunk_lens[:, None]) & (pos >= chunk_lens[:, None] - window)
        padding = (~valid).view(-1).nonzero().squeeze(1)
        if padding.numel() == 0:
            plan.append(_Chunk(rows, blocks, n, nb * block_size, None, None))
        else:
            plan.append(_Chunk(rows, blocks, n, nb * block_size, valid[:, None, None, :], padding))
    return plan


_last_plan: tuple = ()  # (block_tables, seq_lens, their versions, {(block_size, row_bytes, window): plan})


def _plan_for(
    block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int, row_bytes: int, window: int | None = None
) -> list[_Chunk]:
    """`_plan` (or `_window_plan`), made once for the layers of a step: the runner passes the
    same two tensors to every layer. The plans of the last tensors are kept with them (so their
    ids cannot be reused), one per window (layers may alternate), with their version counters
    (so an in-place change makes new plans)."""
    global _last_plan

    def make() -> list[_Chunk]:
        if window is None:
            return _plan(block_tables, seq_lens, block_size, row_bytes)
        return _window_plan(block_tables, seq_lens, block_size, row_bytes, window)

    try:
        versions = (block_tables._version, seq_lens._version)
    except RuntimeError:  # inference-mode tensors keep no version counter: plan every call
        return make()
    if not (_last_plan and _last_plan[0] is block_tables and _last_plan[1] is seq_lens and _last_plan[2] == versions):
        _last_plan = (block_tables, seq_lens, versions, {})
    plans, key = _last_plan[3], (block_size, row_bytes, window)
    if key not in plans:
        plans[key] = make()
    return plans[key]


def _capped(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float,
) -> torch.Tensor:
    """SDPA with soft-capped scores, in fp32: q [..., m, D], k, v [..., L, D], mask bool
    broadcastable to [..., m, L] (True: attend) or None -> [..., m, D] fp32."""
    scores = cap(q.float() @ k.float().transpose(-1, -2) * scale, softcap)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(dim=-1) @ v.float()


def _ext(q: torch.Tensor):
    """The C++ kernels (`cpu_ext`) when they are built and can take q, else None (for the per-call
    `paged_attention` and `paged_prefill`; the engine chooses once, `quantkit.kernels.attention`)."""
    if q.device.type != "cpu" or q.shape[-1] % 16 or q.stride(-1) != 1:
        return None
    return cpu_ext.load()


def cpp_decode(ext):
    """`paged_attention` on the C++ kernel `ext` (`cpu_ext.load()`), for q with head_dim % 16 == 0."""

    def paged_attention(
        q, k_cache, v_cache, block_tables, seq_lens, scale, k_scale=None, v_scale=None, window=None, softcap=None
    ):
        return ext.paged_attention(
            q, k_cache, v_cache, block_tables, seq_lens, scale, k_scale, v_scale, window or 0, softcap or 0.0
        )

    return paged_attention


def amx_prefill(ext):
    """`paged_prefill` wholly on the C++ AMX prefill of `ext`, for the problems `ext.amx_prefill`
    accepts (faster than SDPA at every length measured: `paged_prefill`)."""

    def paged_prefill(
        q, k_cache, v_cache, tables, seq_lens, query_lens, scale, k_scale=None, v_scale=None, window=None, softcap=None
    ):
        args = (q, k_cache, v_cache, tables, seq_lens, query_lens, scale, k_scale, v_scale)
        return ext.paged_prefill(*args, window or 0, softcap or 0.0, PREFILL_TILE, 0)

    return paged_prefill


def split_prefill(ext):
    """`paged_prefill` with the C++ kernel `ext` for the sequences with query_len * seq_len <=
    PREFILL_EXT_WORK and SDPA for the rest, in one call (`paged_prefill` says why)."""

    def paged_prefill(
        q, k_cache, v_cache, tables, seq_lens, query_lens, scale, k_scale=None, v_scale=None, window=None, softcap=None
    ):
        args = (q, k_cache, v_cache, tables, seq_lens, query_lens, scale, k_scale, v_scale, window, softcap)
        work = [m * n for m, n in zip(query_lens.tolist(), seq_lens.tolist())]
        if not any(0 < w <= PREFILL_EXT_WORK for w in work):
            return torch_paged_prefill(*args)
        out = ext.paged_prefill(
            *args[:9], window or 0, softcap or 0.0, PREFILL_TILE, PREFILL_EXT_WORK
        )  # leaves the longer sequences' rows
        if max(work) <= PREFILL_EXT_WORK:
            return out
        return _sdpa_prefill(out, *args, min_work=PREFILL_EXT_WORK)

    return paged_prefill


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
    """Decode attention, as `reference.paged_attention`: q [num_seqs, num_heads, head_dim],
    one new token per sequence, over the first seq_lens[i] cached tokens of sequence i
    (block_tables int32 [num_seqs, max_blocks]), the last `window` of them with a window,
    scores soft-capped with a softcap; returns q's shape and dtype, zeros for a sequence of
    length 0. The C++ kernel when it is available, else `torch_paged_attention`."""
    ext = _ext(q)
    if ext is not None:
        return cpp_decode(ext)(q, k_cache, v_cache, block_tables, seq_lens, scale, k_scale, v_scale, window, softcap)
    return torch_paged_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, k_scale, v_scale, window, softcap)


def torch_paged_attention(
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
    """`paged_attention` in plain torch: gathered chunks and SDPA (the module docstring)."""
    num_seqs, heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    group = heads // kv_heads
    dtype = _compute_dtype(q, k_cache)
    out = None
    row_bytes = 2 * kv_heads * head_dim * dtype.itemsize
    for c in _plan_for(block_tables, seq_lens, k_cache.shape[1], row_bytes, window):
        k = _gather(k_cache, c.blocks, c.n, k_scale, dtype)[:, : c.length]  # [n, length, kv_heads, D]
        v = _gather(v_cache, c.blocks, c.n, v_scale, dtype)[:, : c.length]
        if c.padding is not None:  # stale slots may hold anything, even NaN: zero what the mask hides
            for x in (k, v):
                x.view(-1, kv_heads, head_dim).index_fill_(0, c.padding, 0)
        qc = q if c.rows is None else q.index_select(0, c.rows)
        qc = qc.to(dtype).view(c.n, kv_heads, group, head_dim)  # a KV head's query heads become its queries
        if softcap is None:
            o = F.scaled_dot_product_attention(
                qc, k.transpose(1, 2), v.transpose(1, 2), attn_mask=c.mask, scale=scale
            )  # [n, kv_heads, group, D]
        else:
            o = _capped(qc, k.transpose(1, 2), v.transpose(1, 2), c.mask, scale, softcap)
        o = o.reshape(c.n, heads, head_dim).to(q.dtype)
        if c.rows is None:
            return o
        out = torch.zeros_like(q) if out is None else out
        out.index_copy_(0, c.rows, o)
    return torch.zeros_like(q) if out is None else out


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
    """Causal attention of the new tokens of several sequences, as `reference.paged_prefill`
    (q [total_query_tokens, num_heads, head_dim], sequence i's last query_lens[i] of its
    seq_lens[i] tokens back to back); returns q's shape and dtype.

    Where the C++ AMX prefill applies (`ext.amx_prefill`: bf16 q, a bf16, fp8 or int8 cache,
    head_dim 64 or 128, a CPU with AMX-BF16, QUANTKIT_NO_AMX not 1), it takes every sequence:
    ~0.45 ns per (query head, key) pair on one thread, faster than SDPA at every length measured.
    Against SDPA on 2048-token chunks of smollm2 prompts (benchmarks/attention.py, one thread,
    30 layers, bf16, blocks of 16; 2026-12): whole prompts of 32 tokens 5.5x, of 64 3.9x, of 128
    3.3-3.5x, of 256 3.3-3.4x, of 512 3.1x, of 1024 2.5x, of 2048 2.2x; the last n/4 after 3n/4
    cached 2.7-7.9x.

    Otherwise, with the C++ kernels, a sequence with query_len * seq_len <= PREFILL_EXT_WORK is
    attended by them, in place; a longer one by `torch_paged_prefill` (gathered blocks + SDPA's
    flash kernel), in the same call. That C++ kernel costs ~5.5 ns per (query head, key) pair
    on one thread, SDPA ~2 ns plus ~135 us per sequence and layer for the gather and the call,
    so it wins only on short work (2026-12-02: prompts of 32 tokens 2.0x, of 64 0.98x, of 128
    0.58x, of 512 0.32x; the last 8 tokens after 24 cached 4.6x, 16 after 48 2.0x, 32 after 96
    0.96x, 128 after 384 0.34x). Level between about 4096 and 8192 for query_len * seq_len."""
    args = (q, k_cache, v_cache, block_tables, seq_lens, query_lens, scale, k_scale, v_scale, window, softcap)
    ext = _ext(q)
    if ext is None:
        return torch_paged_prefill(*args)
    return (amx_prefill if ext.amx_prefill(q, k_cache) else split_prefill)(ext)(*args)


def torch_paged_prefill(
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
    """`paged_prefill` in plain torch: one SDPA per sequence with grouped-query heads, in q's
    dtype for float caches; with a window only the blocks from the first query's first
    visible token on are read, with a softcap the scores go through `_capped`."""
    args = (q, k_cache, v_cache, block_tables, seq_lens, query_lens, scale, k_scale, v_scale, window, softcap)
    return _sdpa_prefill(torch.empty_like(q), *args)


def _sdpa_prefill(
    out: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_lens: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    window: int | None,
    softcap: float | None,
    min_work: int = -1,
) -> torch.Tensor:
    """`torch_paged_prefill` into out, for the sequences with query_len * seq_len > min_work."""
    dtype = _compute_dtype(q, k_cache)
    bs, start = k_cache.shape[1], 0
    for i, (seq_len, q_len) in enumerate(zip(seq_lens.tolist(), query_lens.tolist())):
        start += q_len
        if q_len == 0 or q_len * seq_len <= min_work:
            continue
        first = 0 if window is None else max(seq_len - q_len - window + 1, 0) // bs  # the first block read
        blocks = block_tables[i, first : -(-seq_len // bs)].long()
        k = _gather(k_cache, blocks, 1, k_scale, dtype)[:, : seq_len - first * bs].transpose(
            1, 2
        )  # [1, kv_heads, L, D]
        v = _gather(v_cache, blocks, 1, v_scale, dtype)[:, : seq_len - first * bs].transpose(1, 2)
        qi = q[None, start - q_len : start].to(dtype).transpose(1, 2)  # [1, heads, q_len, D] (4-D: SDPA's fast path)
        if window is not None or softcap is not None:
            pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
            mask = visible(pos, torch.arange(first * bs, seq_len, device=q.device), window)  # [q_len, L]
            o = _prefill_options(qi, k, v, mask, scale, softcap)
        elif q_len == seq_len:
            o = F.scaled_dot_product_attention(qi, k, v, is_causal=True, scale=scale, enable_gqa=True)
        else:  # the queries are the last q_len positions: bottom-right causal mask
            pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
            mask = torch.arange(seq_len, device=q.device)[None, :] <= pos[:, None]  # [q_len, L]
            o = F.scaled_dot_product_attention(qi, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        out[start - q_len : start] = o[0].transpose(0, 1).to(q.dtype)
    return out


def _prefill_options(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float, softcap: float | None
) -> torch.Tensor:
    """One sequence's prefill with a window mask and/or a softcap: q [1, heads, q_len, D], k, v
    [1, kv_heads, L, D], mask bool [q_len, L] -> [1, heads, q_len, D]."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    _, heads, q_len, head_dim = q.shape
    kv_heads = k.shape[1]
    qg = q.view(1, kv_heads, heads // kv_heads, q_len, head_dim)  # a KV head's query heads side by side
    o = _capped(qg, k[:, :, None], v[:, :, None], mask, scale, softcap)  # [1, kv_heads, group, q_len, D]
    return o.view(1, heads, q_len, head_dim)
