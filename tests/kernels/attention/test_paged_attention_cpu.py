"""The CPU paged attention against the twins: the batched torch path (`attention.cpu`: kv_store,
paged_attention, paged_prefill, their plans), and the C++ kernels' decode and prefill paths (AMX
or AVX-512 scores), bf16 ones also against attention in fp64."""

from __future__ import annotations

import pytest
import torch
from paged_cases import (
    CPU_CACHES,
    CPU_SEQ_LENS,
    GQA,
    PREFILL_QUERY_LENS,
    PREFILL_SEQ_LENS,
    SOFTCAPS,
    TOLERANCES,
    Case,
    cpu_case,
    make_case,
)

from quantkit import ops
from quantkit.kernels.attention import cpu as cpu_attention
from quantkit.kernels.attention import twin as attention_twin


# CHUNK_BYTES 1: every sequence its own SDPA call (no mask); the default: all in one padded, masked call
@pytest.mark.parametrize("chunk_bytes", [1, cpu_attention.CHUNK_BYTES])
@pytest.mark.parametrize("gqa", list(GQA))
@pytest.mark.parametrize("cache", list(CPU_CACHES))
def test_cpu_paged_attention_matches_twin(cache, gqa, chunk_bytes, monkeypatch):
    """Unused cache slots hold NaN (make_case): padding must be neither read nor let through."""
    monkeypatch.setattr(cpu_attention, "CHUNK_BYTES", chunk_bytes)
    case = cpu_case(cache, gqa, seq_lens=CPU_SEQ_LENS)
    out = cpu_attention.paged_attention(case.q, *case.cache_args(), 0.3, case.k_scale, case.v_scale)
    want = attention_twin.paged_attention(case.q, *case.cache_args(), 0.3, case.k_scale, case.v_scale)
    assert out.dtype == case.q.dtype and torch.equal(out[CPU_SEQ_LENS.index(0)], torch.zeros_like(out[0]))
    torch.testing.assert_close(out, want, **TOLERANCES[case.q.dtype])


def test_cpu_paged_attention_chunks_sequences_by_length(monkeypatch):
    row = 2 * 2 * 16 * 2  # K+V bytes per token: 2 KV heads of 16 bf16 values each
    monkeypatch.setattr(cpu_attention, "CHUNK_BYTES", 2 * 300 * row)
    assert cpu_attention._chunks([5, 300, 0, 40, 300, 7], row) == [[1, 4], [3, 5, 0]]  # longest first, no empty


@pytest.mark.parametrize("gqa", list(GQA))
@pytest.mark.parametrize("cache", ["bf16", "fp32", "fp8-head-bf16", "int8-tensor"])
def test_cpu_paged_prefill_matches_twin(cache, gqa):
    case = cpu_case(cache, gqa, seq_lens=PREFILL_SEQ_LENS, q_tokens=sum(PREFILL_QUERY_LENS))
    query_lens = torch.tensor(PREFILL_QUERY_LENS, dtype=torch.int32)
    args = (case.q, *case.cache_args(), query_lens, 0.25, case.k_scale, case.v_scale)
    torch.testing.assert_close(
        cpu_attention.paged_prefill(*args), attention_twin.paged_prefill(*args), **TOLERANCES[case.q.dtype]
    )


@pytest.mark.parametrize("cache", ["bf16", "fp32", "fp8-tensor", "int8-head"])
def test_cpu_kv_store_writes_what_the_twin_writes(cache):
    dtype, q_dtype, strategy = CPU_CACHES[cache]
    g = torch.Generator().manual_seed(1)
    k, v = (torch.randn(6, 2, 16, generator=g).to(q_dtype) for _ in range(2))
    slots = torch.tensor([17, 3, -1, 40, 0, 41])  # one token skipped
    scales = (
        (torch.tensor([0.01]), torch.tensor([0.02]))
        if strategy == "tensor"
        else (torch.tensor([0.01, 0.03]), torch.tensor([0.02, 0.05]))
        if strategy
        else (None, None)
    )
    caches = [[torch.zeros(4, 16, 2, 16, dtype=dtype) for _ in range(2)] for _ in range(2)]
    cpu_attention.kv_store(k, v, *caches[0], slots, *scales)
    attention_twin.kv_store(k, v, *caches[1], slots, *scales)
    for ours, theirs in zip(*caches):
        assert torch.equal(ours.view(torch.uint8), theirs.view(torch.uint8))


def test_ops_auto_takes_the_cpu_path_and_torch_the_twin():
    case = cpu_case("fp32", "gqa3", seq_lens=[21, 5])
    args = (case.q, *case.cache_args(), 0.3)
    assert torch.equal(ops.paged_attention(*args), cpu_attention.paged_attention(*args))
    assert torch.equal(ops.paged_attention(*args, backend="torch"), attention_twin.paged_attention(*args))


def test_cpu_paged_attention_replans_when_the_tables_change_in_place():
    """The plan (chunks, block lists, masks) is made once per step for all layers; an
    in-place change of seq_lens or block_tables must not reuse it."""
    case = cpu_case("fp32", "gqa3", seq_lens=[21, 32, 48])
    args = lambda: (case.q, *case.cache_args(), 0.3)  # noqa: E731
    torch.testing.assert_close(
        cpu_attention.paged_attention(*args()), attention_twin.paged_attention(*args()), **TOLERANCES[torch.float32]
    )
    case.seq_lens[1] = 7
    torch.testing.assert_close(
        cpu_attention.paged_attention(*args()), attention_twin.paged_attention(*args()), **TOLERANCES[torch.float32]
    )
    case.block_tables[2] = case.block_tables[2].roll(1)  # the same blocks in another order: other values
    torch.testing.assert_close(
        cpu_attention.paged_attention(*args()), attention_twin.paged_attention(*args()), **TOLERANCES[torch.float32]
    )


# --- the C++ decode kernel's paths (attention.cpp: AMX or AVX-512 scores, two-pass softmax) ----

# group 1 / 3 / 8 / 16 (the widest the decode kernel takes) and 17 (the per-head kernel)
DECODE_GROUPS = {"g1": (4, 4), "g3": (9, 3), "g8": (16, 2), "g16": (16, 1), "g17": (17, 1)}
LONG_SEQ_LENS = [700, 1, 17, 333, 64, 0, 129]  # long, one token, mid-block, block boundary, empty


@pytest.mark.parametrize("amx", ["on", "off"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", list(DECODE_GROUPS))
@pytest.mark.parametrize("cache", ["bf16", "fp8-head-bf16", "int8-tensor", "fp16", "fp32"])
def test_cpu_decode_paths_match_twin(cache, group, head_dim, amx, monkeypatch):
    """QUANTKIT_NO_AMX=1 takes the AVX-512 scores instead of AMX tiles (bf16 q only)."""
    if amx == "off":
        monkeypatch.setenv("QUANTKIT_NO_AMX", "1")
    case = make_case(CPU_CACHES[cache], *DECODE_GROUPS[group], seq_lens=LONG_SEQ_LENS, head_dim=head_dim)
    args = (case.q, *case.cache_args(), head_dim**-0.5, case.k_scale, case.v_scale)
    out = cpu_attention.paged_attention(*args)
    assert torch.equal(out[LONG_SEQ_LENS.index(0)], torch.zeros_like(out[0]))
    torch.testing.assert_close(out, attention_twin.paged_attention(*args), **TOLERANCES[case.q.dtype])


@pytest.mark.parametrize("amx", ["on", "off"])
@pytest.mark.parametrize("softcap", SOFTCAPS)
@pytest.mark.parametrize("window", [1, 7, 16, 100, 1000])
@pytest.mark.parametrize("cache", ["bf16", "int8-tensor", "fp32"])
def test_cpu_decode_long_window_softcap_matches_twin(cache, window, softcap, amx, monkeypatch):
    """Windows that start mid-tile, at a block, and past the start; the tiles before them hold NaN."""
    if amx == "off":
        monkeypatch.setenv("QUANTKIT_NO_AMX", "1")
    case = make_case(CPU_CACHES[cache], *GQA["gqa3"], seq_lens=LONG_SEQ_LENS, head_dim=64)
    args = (case.q, *case.cache_args(), 0.3, case.k_scale, case.v_scale, window, softcap)
    torch.testing.assert_close(
        cpu_attention.paged_attention(*args), attention_twin.paged_attention(*args), **TOLERANCES[case.q.dtype]
    )


def test_cpu_decode_bf16_error_against_fp64():
    """The bf16 decode kernel against attention in fp64 on the same (bf16) values: well inside
    the bf16 tolerance (the output's own rounding is 2^-9 relative)."""
    case = make_case(CPU_CACHES["bf16"], 9, 3, seq_lens=[700, 300, 45], head_dim=64)
    out = cpu_attention.paged_attention(case.q, *case.cache_args(), 0.125).double()
    for i in range(3):
        k, v = (x[i].double().transpose(0, 1) for x in (case.keys, case.values))  # [kv_heads, n, D]
        k, v = k.repeat_interleave(3, dim=0), v.repeat_interleave(3, dim=0)
        want = torch.softmax(case.q[i].double()[:, None] @ k.transpose(1, 2) * 0.125, dim=-1) @ v  # [heads, 1, D]
        err = (out[i] - want[:, 0]).abs().max().item()
        assert err < 0.25 * TOLERANCES[torch.bfloat16]["atol"] + 2**-8 * want.abs().max().item()


# --- the C++ prefill with AMX (attention.cpp: Sᵀ = K·Qᵀ and Oᵀ = Vᵀ·Pᵀ in tiles, P in bf16) ----

AMX_PREFILL_LENS, AMX_PREFILL_QUERY_LENS = [700, 300, 45], [700, 100, 45]  # whole, after 200 cached, whole


def _prefill_fp64(case: Case, query_lens: list[int], scale: float) -> list[torch.Tensor]:
    """Causal attention in fp64 on the cache's (bf16) values: per sequence [q_len, heads, D]."""
    out, start = [], 0
    for i, n in enumerate(query_lens):
        q = case.q[start : start + n].double().transpose(0, 1)  # [heads, n, D]
        start += n
        k, v = (x[i].double().transpose(0, 1) for x in (case.keys, case.values))  # [kv_heads, L, D]
        group = q.shape[0] // k.shape[0]
        k, v = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)
        length = k.shape[1]
        mask = torch.arange(length)[None, :] <= torch.arange(length - n, length)[:, None]  # [n, L]
        scores = (q @ k.transpose(1, 2) * scale).masked_fill(~mask, float("-inf"))
        out.append((torch.softmax(scores, dim=-1) @ v).transpose(0, 1))
    return out


@pytest.mark.parametrize("amx", ["on", "off"])
def test_cpu_prefill_bf16_error_against_fp64(amx, monkeypatch):
    """The bf16 prefill against attention in fp64 on the same (bf16) values: well inside the bf16
    tolerance. The AMX path rounds P to bf16 for P·V (2^-9 relative per weight, errors that
    average out over the keys); the output's own rounding is 2^-9 relative."""
    if amx == "off":
        monkeypatch.setenv("QUANTKIT_NO_AMX", "1")
    case = make_case(
        CPU_CACHES["bf16"], 9, 3, seq_lens=AMX_PREFILL_LENS, head_dim=64, q_tokens=sum(AMX_PREFILL_QUERY_LENS)
    )
    query_lens = torch.tensor(AMX_PREFILL_QUERY_LENS, dtype=torch.int32)
    out = cpu_attention.paged_prefill(case.q, *case.cache_args(), query_lens, 0.125).double()
    for got, want in zip(out.split(AMX_PREFILL_QUERY_LENS), _prefill_fp64(case, AMX_PREFILL_QUERY_LENS, 0.125)):
        err = (got - want).abs().max().item()
        assert err < 0.25 * TOLERANCES[torch.bfloat16]["atol"] + 2**-8 * want.abs().max().item()


def test_cpu_prefill_with_amx_takes_the_kernel_for_every_sequence():
    """Where the AMX prefill applies, every sequence goes to it, however long (no SDPA)."""
    from quantkit.kernels import cpu_ext

    ext = cpu_ext.load()
    case = make_case(CPU_CACHES["bf16"], 9, 3, seq_lens=[200, 40], head_dim=64, q_tokens=240)
    if ext is None or not ext.amx_prefill(case.q, case.k_cache):
        pytest.skip("no AMX prefill here")
    query_lens = torch.tensor([200, 40], dtype=torch.int32)
    args = (case.q, *case.cache_args(), query_lens, 0.125)
    out = cpu_attention.paged_prefill(*args)
    assert torch.equal(out, ext.paged_prefill(*args, None, None, 0, 0.0, cpu_attention.PREFILL_TILE, 0))
    torch.testing.assert_close(out, attention_twin.paged_prefill(*args), **TOLERANCES[torch.bfloat16])
