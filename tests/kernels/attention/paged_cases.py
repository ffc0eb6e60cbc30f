"""Shared cases of the paged-attention tests: random paged caches of each dtype and head layout,
and dense attention computed from scratch (contiguous K/V per sequence, `fake_quantize_kv`,
`torch.softmax`, the window mask and tanh cap written out), the reference the twins are held to."""

from __future__ import annotations

import dataclasses

import torch
from conftest import shuffled_cache

from quantkit.calibration.kv import fake_quantize_kv, kv_scales
from quantkit.kernels.attention import twin as attention_twin
from quantkit.scheme import preset

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# by query dtype; fp16: the kernel feeds p to the P.V dot in fp16, and outputs are fp16
TOLERANCES = {
    torch.float32: dict(atol=2e-5, rtol=2e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}
CACHES = {  # name: (cache dtype, query dtype, scale strategy; None = not quantized)
    "fp16": (torch.float16, torch.float16, None),
    "fp32": (torch.float32, torch.float32, None),
    "fp8-tensor": (torch.float8_e4m3fn, torch.float16, "tensor"),
    "fp8-head": (torch.float8_e4m3fn, torch.float32, "attn_head"),
    "int8-tensor": (torch.int8, torch.float32, "tensor"),
    "int8-head": (torch.int8, torch.float16, "attn_head"),
}
GQA = {"mha": (8, 8), "gqa3": (6, 2), "mqa": (8, 1)}  # (num_heads, num_kv_heads)
BLOCK_SIZE, MAX_BLOCKS = 16, 3
# ends mid-block (-1 entries after it), at a block boundary, one token, fills the table, empty
SEQ_LENS = [21, 32, 1, 48, 0]


@dataclasses.dataclass
class Case:
    q: torch.Tensor  # [num_seqs, heads, head_dim]
    keys: list[torch.Tensor]  # per sequence [seq_len, kv_heads, head_dim], q's dtype
    values: list[torch.Tensor]
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None
    args: object  # QuantArgs of the KV cache, None when not quantized

    def cache_args(self):
        return (self.k_cache, self.v_cache, self.block_tables, self.seq_lens)


def kv_args(dtype: torch.dtype, strategy: str):
    args = preset("kv-fp8" if dtype == torch.float8_e4m3fn else "kv-int8").kv_cache
    return dataclasses.replace(args, strategy=strategy)


def make_case(cache: str, heads: int, kv_heads: int, seq_lens=SEQ_LENS, head_dim=16, q_tokens=None, seed=0) -> Case:
    """Random K/V per sequence stored (by the kv_store twin) into randomly chosen blocks of a
    cache whose other slots hold NaN (or 127 for int8), so an unmasked read would show."""
    dtype, q_dtype, strategy = CACHES[cache] if isinstance(cache, str) else cache
    g = torch.Generator().manual_seed(seed)
    spread = torch.logspace(-0.5, 0.5, kv_heads).reshape(1, kv_heads, 1)
    keys = [(torch.randn(n, kv_heads, head_dim, generator=g) * spread * 2).to(q_dtype) for n in seq_lens]
    values = [(torch.randn(n, kv_heads, head_dim, generator=g) * spread).to(q_dtype) for n in seq_lens]
    width = max(MAX_BLOCKS, *(-(-n // BLOCK_SIZE) for n in seq_lens))
    tables, k_cache, v_cache = shuffled_cache(seq_lens, BLOCK_SIZE, (kv_heads, head_dim), dtype, g, 2, width)
    args = k_scale = v_scale = None
    k_all, v_all = torch.cat(keys), torch.cat(values)
    if strategy is not None:
        args = kv_args(dtype, strategy)
        k_scale, v_scale = (kv_scales(x.float().abs().amax(dim=(0, 2)), args) for x in (k_all, v_all))
    slots = torch.cat(
        [
            tables[i, torch.arange(n) // BLOCK_SIZE].long() * BLOCK_SIZE + torch.arange(n) % BLOCK_SIZE
            for i, n in enumerate(seq_lens)
        ]
    )
    attention_twin.kv_store(k_all, v_all, k_cache, v_cache, slots, k_scale, v_scale)
    q = torch.randn(q_tokens or len(seq_lens), heads, head_dim, generator=g).to(q_dtype)
    to = lambda t: None if t is None else t.to(DEVICE)  # noqa: E731
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return Case(to(q), keys, values, to(k_cache), to(v_cache), to(tables), to(lens), to(k_scale), to(v_scale), args)


def dense_kv(case: Case, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence i's K and V [kv_heads, seq_len, head_dim] in fp32, fake-quantized like the cache."""
    k, v = (x[i].float().transpose(0, 1).to(DEVICE) for x in (case.keys, case.values))
    if case.args is None:
        return k, v
    return (
        fake_quantize_kv(k[None], case.k_scale, case.args)[0],
        fake_quantize_kv(v[None], case.v_scale, case.args)[0],
    )


def dense_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int | None = None, softcap=None
) -> torch.Tensor:
    """q [heads, n, d] (the last n of k's positions), k/v [kv_heads, L, d] -> [heads, n, d] fp32,
    causal; with a window, query t sees keys s with t - window < s <= t (transformers'
    `kv_idx > q_idx - sliding_window`); with a softcap, scores -> softcap * tanh(scores / softcap)."""
    group = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)
    n, seq_len = q.shape[1], k.shape[1]
    scores = q.float() @ k.transpose(1, 2) * scale  # [heads, n, L]
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    positions = torch.arange(seq_len - n, seq_len, device=q.device)[:, None]  # of the queries, [n, 1]
    keys = torch.arange(seq_len, device=q.device)[None, :]  # [1, L]
    hidden = keys > positions  # the future, [n, L]
    if window is not None:
        hidden |= keys <= positions - window  # out of the window
    return torch.softmax(scores.masked_fill(hidden, float("-inf")), dim=-1) @ v


# --- the batched CPU path against the twins -------------------------------------------------

CPU_CACHES = {
    **CACHES,
    "bf16": (torch.bfloat16, torch.bfloat16, None),
    "fp8-head-bf16": (torch.float8_e4m3fn, torch.bfloat16, "attn_head"),
}
# mid-block, full blocks, one token, the whole table, empty, a repeated length, short
CPU_SEQ_LENS = [21, 32, 1, 48, 0, 32, 5]


def cpu_case(cache, gqa, **kwargs) -> Case:
    case = make_case(CPU_CACHES[cache], *GQA[gqa], **kwargs)
    to_cpu = lambda t: None if t is None else t.cpu()  # noqa: E731
    return dataclasses.replace(
        case,
        **{
            f.name: to_cpu(getattr(case, f.name))
            for f in dataclasses.fields(case)
            if isinstance(getattr(case, f.name), torch.Tensor)
        },
    )


# off; only the token itself; mid-block; across a block boundary; wider than every context
WINDOWS = [None, 1, 7, 20, 1000]
SOFTCAPS = [None, 5.0]  # the scaled scores here reach ±20, a third of them past ±2.5: the cap bends them


def dense_decode(case: Case, scale: float, window, softcap) -> torch.Tensor:
    want = torch.zeros_like(case.q)
    for i, n in enumerate(case.seq_lens.tolist()):
        if n:
            o = dense_attention(case.q[i, :, None], *dense_kv(case, i), scale, window, softcap)
            want[i] = o[:, 0].to(case.q.dtype)
    return want


PREFILL_SEQ_LENS = [21, 40, 17, 5]
PREFILL_QUERY_LENS = [21, 8, 1, 0]  # a whole prompt, a chunk after 32 cached tokens, one token, none


def launcher_args() -> dict:
    case = make_case("int8-head", 4, 2, seq_lens=[5, 17])
    return dict(
        q=case.q,
        k_cache=case.k_cache,
        v_cache=case.v_cache,
        block_tables=case.block_tables,
        seq_lens=case.seq_lens,
        scale=0.25,
        k_scale=case.k_scale,
        v_scale=case.v_scale,
    )
