"""The C++ CPU attention kernels (`quantkit.kernels.cpu_ext`, kernels/attention/attention.cpp)
against the torch twins (`reference.paged_attention`, `reference.paged_prefill`): every cache
dtype with its scales, grouped-query heads, head dims with and without a compiled-in loop
(64, 128; 48, 80), lengths at and across block boundaries, shuffled block tables, sliding
windows and soft-capping, many sequences on two threads, prefill with and without cached
prefixes; then the dispatch in `cpu_attention`, the fallback to the torch path, and the build
lock.

Unused cache slots hold NaN (fp8: 0x7f; int8: 127), so a read past a sequence shows. Both
sides dequantise exactly (stored * scale) and accumulate in fp32; they differ in summation
order (tiles of 16 tokens, 8 on AVX2, with an online softmax against one softmax) and in the kernel's
polynomial exp, so the tolerance depends on the output (q's) dtype only: fp32 2e-5 (atol and
rtol), fp16 2e-3, bf16 2e-2 (one or two units in the last place of the rounded output).

The extension must build here: these tests skip only when the machine has no C++ compiler.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import built, shuffled_cache

from quantkit import ops
from quantkit.kernels import cpu_ext
from quantkit.kernels.attention import cpu as cpu_attention
from quantkit.kernels.attention import twin as attention_twin

TOLERANCES = {
    torch.float32: dict(atol=2e-5, rtol=2e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}
CACHES = {  # name: (cache dtype, q dtype, scales: None, "tensor" or "head")
    "bf16": (torch.bfloat16, torch.bfloat16, None),
    "bf16-q32": (torch.bfloat16, torch.float32, None),  # not the bf16 dot-product path
    "fp16": (torch.float16, torch.float16, None),
    "fp32": (torch.float32, torch.float32, None),
    "fp8-tensor": (torch.float8_e4m3fn, torch.bfloat16, "tensor"),
    "fp8-head": (torch.float8_e4m3fn, torch.float32, "head"),
    "int8-tensor": (torch.int8, torch.float16, "tensor"),
    "int8-head": (torch.int8, torch.bfloat16, "head"),
}
GQA = {"group1": (4, 4), "group3": (6, 2), "group4": (8, 2)}  # (heads, kv_heads)
# one token, a block less one, a block, a block and one, two blocks and one, long, empty
SEQ_LENS = [1, 15, 16, 17, 33, 100, 0]


@pytest.fixture(scope="module")
def ext():
    with built(cpu_ext.ATTENTION) as module:
        yield module


def make_case(cache, heads, kv_heads, seq_lens, head_dim=64, block_size=16, q_tokens=None, seed=0):
    """(q, k_cache, v_cache, block_tables, seq_lens, k_scale, v_scale): each sequence's random
    K/V stored by the kv_store twin into shuffled blocks of a cache whose other slots hold NaN."""
    dtype, q_dtype, scales = CACHES[cache]
    g = torch.Generator().manual_seed(seed)
    width = max(-(-n // block_size) for n in seq_lens) + 1
    tables, k_cache, v_cache = shuffled_cache(seq_lens, block_size, (kv_heads, head_dim), dtype, g, 3, width)
    total = sum(seq_lens)
    spread = torch.logspace(-0.5, 0.5, kv_heads).reshape(1, kv_heads, 1)
    k = (torch.randn(total, kv_heads, head_dim, generator=g) * spread * 2).to(q_dtype)
    v = (torch.randn(total, kv_heads, head_dim, generator=g) * spread).to(q_dtype)
    k_scale = v_scale = None
    if scales is not None:
        top = 448.0 if dtype == torch.float8_e4m3fn else 127.0
        dims = (0, 1, 2) if scales == "tensor" else (0, 2)
        k_scale, v_scale = (x.float().abs().amax(dim=dims).reshape(-1) / top for x in (k, v))
    slots = torch.cat(
        [
            tables[i, torch.arange(n) // block_size].long() * block_size + torch.arange(n) % block_size
            for i, n in enumerate(seq_lens)
        ]
    )
    attention_twin.kv_store(k, v, k_cache, v_cache, slots, k_scale, v_scale)
    q = torch.randn(q_tokens or len(seq_lens), heads, head_dim, generator=g).to(q_dtype)
    return q, k_cache, v_cache, tables, torch.tensor(seq_lens, dtype=torch.int32), k_scale, v_scale


def decode(ext, case, scale, window=None, softcap=None):
    q, k, v, tables, lens, ks, vs = case
    out = ext.paged_attention(q, k, v, tables, lens, scale, ks, vs, window or 0, softcap or 0.0)
    return out, attention_twin.paged_attention(q, k, v, tables, lens, scale, ks, vs, window, softcap)


def prefill(ext, case, query_lens, scale, window=None, softcap=None, tile=16):
    q, k, v, tables, lens, ks, vs = case
    qlens = torch.tensor(query_lens, dtype=torch.int32)
    out = ext.paged_prefill(q, k, v, tables, lens, qlens, scale, ks, vs, window or 0, softcap or 0.0, tile, 0)
    return out, attention_twin.paged_prefill(q, k, v, tables, lens, qlens, scale, ks, vs, window, softcap)


# --- decode ----------------------------------------------------------------------------------


@pytest.mark.parametrize("gqa", list(GQA))
@pytest.mark.parametrize("cache", list(CACHES))
def test_decode_matches_twin(ext, cache, gqa):
    case = make_case(cache, *GQA[gqa], SEQ_LENS)
    out, want = decode(ext, case, 64**-0.5)
    assert out.dtype == want.dtype and out.shape == want.shape
    assert torch.equal(out[SEQ_LENS.index(0)], torch.zeros_like(out[0]))  # an empty sequence gives zeros
    torch.testing.assert_close(out, want, **TOLERANCES[want.dtype])


@pytest.mark.parametrize("head_dim", [128, 48, 80])  # 128: compiled-in loops; 48, 80: the generic ones
@pytest.mark.parametrize("cache", ["bf16", "fp16", "fp8-head", "int8-tensor"])
def test_decode_head_dims(ext, cache, head_dim):
    case = make_case(cache, 6, 2, SEQ_LENS, head_dim=head_dim)
    torch.testing.assert_close(*decode(ext, case, head_dim**-0.5), **TOLERANCES[case[0].dtype])


@pytest.mark.parametrize("cache", ["bf16", "fp32", "int8-head"])
def test_decode_blocks_of_32_are_read_in_tiles(ext, cache):
    case = make_case(cache, 6, 2, [1, 16, 31, 32, 33, 70], block_size=32)
    torch.testing.assert_close(*decode(ext, case, 0.125, window=20), **TOLERANCES[case[0].dtype])


@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize("window", [1, 7, 16, 20, 1000])  # the token itself, mid-block, a block, across, all
@pytest.mark.parametrize("cache", ["bf16", "fp32", "fp8-tensor", "int8-head"])
def test_decode_window_softcap(ext, cache, window, softcap):
    case = make_case(cache, 6, 2, SEQ_LENS)
    out, want = decode(ext, case, 0.3, window, softcap)  # scores up to ±20: the cap bends them
    torch.testing.assert_close(out, want, **TOLERANCES[want.dtype])


@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize("block_size", [1, 5, 32])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("cache", ["fp32", "bf16-q32", "fp8-head"])
def test_decode_fp32_queries(ext, cache, head_dim, block_size, softcap):
    """fp32 queries take `decode_f32_item` (every score, one softmax per head, P · V): any cache,
    block sizes that cut its 16-token tiles, a window across blocks, a group of 3 and of 32."""
    for heads, kv_heads in [(6, 2), (32, 1)]:
        case = make_case(cache, heads, kv_heads, SEQ_LENS, head_dim=head_dim, block_size=block_size)
        out, want = decode(ext, case, 0.3, 7, softcap)
        torch.testing.assert_close(out, want, **TOLERANCES[want.dtype])


def test_decode_window_skips_the_blocks_before_it(ext):
    """Blocks wholly before the window may hold anything (freed and reused): they are not read."""
    q, k, v, tables, lens, _, _ = make_case("fp32", 6, 2, [40, 100])
    want = attention_twin.paged_attention(q, k, v, tables, lens, 0.125, window=7)
    nan_block = int(tables.max()) + 1  # never written: NaN
    tables = tables.clone()
    tables[0, :2], tables[1, :5] = nan_block, nan_block  # tokens 0-31 of 40, 0-79 of 100
    out = ext.paged_attention(q, k, v, tables, lens, 0.125, None, None, 7, 0.0)
    torch.testing.assert_close(out, want, **TOLERANCES[torch.float32])


def test_decode_softmax_is_stable_for_large_scores(ext):
    case = make_case("fp32", 4, 2, [40, 7])
    out, want = decode(ext, case, 300.0)  # scores around 1e4: exp() would overflow without the running max
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("cache", ["bf16", "fp8-head", "int8-tensor"])
def test_decode_many_sequences_on_two_threads(ext, cache):
    g = torch.Generator().manual_seed(3)
    lens = torch.randint(0, 300, (48,), generator=g).tolist()
    case = make_case(cache, 9, 3, lens, seed=1)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        out, want = decode(ext, case, 0.125)
        again, _ = decode(ext, case, 0.125)
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(out, want, **TOLERANCES[want.dtype])
    assert torch.equal(out, again)  # each (sequence, KV head) is summed in one order, whichever thread takes it


def test_decode_takes_a_strided_q(ext):
    """The runner passes q as a view of the fused qkv projection."""
    q, k, v, tables, lens, _, _ = make_case("bf16", 6, 2, SEQ_LENS)
    qkv = torch.cat([q, torch.randn(q.shape[0], 4, 64).to(q.dtype)], dim=1)  # [n, 6 + 2 + 2, 64]
    view = qkv[:, :6]
    assert not view.is_contiguous()
    out = ext.paged_attention(view, k, v, tables, lens, 0.125, None, None, 0, 0.0)
    torch.testing.assert_close(
        out, attention_twin.paged_attention(q, k, v, tables, lens, 0.125), **TOLERANCES[torch.bfloat16]
    )


def test_float_cache_with_scales_and_a_strided_block_table(ext):
    """The twin applies scales given with a float cache too; tables may be any view."""
    q, k, v, tables, lens, _, _ = make_case("fp32", 6, 2, SEQ_LENS)
    ks, vs = torch.tensor([0.5, 2.0]), torch.tensor([1.5])
    strided = torch.stack([tables, tables], dim=2).flatten(1)[:, ::2]
    assert strided.stride(1) == 2 and torch.equal(strided, tables)
    out = ext.paged_attention(q, k, v, strided, lens, 0.125, ks, vs, 0, 0.0)
    want = attention_twin.paged_attention(q, k, v, tables, lens, 0.125, ks, vs)
    torch.testing.assert_close(out, want, **TOLERANCES[torch.float32])


def test_errors_are_sentences(ext):
    q, k, v, tables, lens, _, _ = make_case("fp32", 4, 2, [5, 20])
    bad = tables.clone()
    bad[1, 1] = 1000
    with pytest.raises(RuntimeError, match=r"sequence 1 names block 1000 of a cache with \d+ blocks"):
        ext.paged_attention(q, k, v, bad, lens, 1.0, None, None, 0, 0.0)
    with pytest.raises(RuntimeError, match=r"head_dim must match the cache and be a multiple of 16; got 24"):
        ext.paged_attention(q[..., :24], k[..., :24], v[..., :24], tables, lens, 1.0, None, None, 0, 0.0)
    with pytest.raises(RuntimeError, match=r"fp8 / int8 caches need k_scale and v_scale"):
        ext.paged_attention(q, k.to(torch.int8), v.to(torch.int8), tables, lens, 1.0, None, None, 0, 0.0)
    with pytest.raises(RuntimeError, match=r"sequence 0 has length 99 but its block table holds 48 tokens"):
        ext.paged_attention(q, k, v, tables, torch.tensor([99, 5], dtype=torch.int32), 1.0, None, None, 0, 0.0)


# --- prefill ---------------------------------------------------------------------------------

PREFILL_LENS = [21, 40, 17, 5, 70]
QUERY_LENS = [21, 8, 1, 0, 33]  # a whole prompt, 8 after 32 cached, one token, none, 33 after 37


@pytest.mark.parametrize("gqa", list(GQA))
@pytest.mark.parametrize("cache", list(CACHES))
def test_prefill_matches_twin(ext, cache, gqa):
    case = make_case(cache, *GQA[gqa], PREFILL_LENS, q_tokens=sum(QUERY_LENS))
    out, want = prefill(ext, case, QUERY_LENS, 64**-0.5)
    torch.testing.assert_close(out, want, **TOLERANCES[want.dtype])


@pytest.mark.parametrize("tile", [1, 5, 64])
@pytest.mark.parametrize("head_dim", [64, 128, 80])
def test_prefill_query_tiles_and_head_dims(ext, tile, head_dim):
    case = make_case("bf16", 6, 2, PREFILL_LENS, head_dim=head_dim, q_tokens=sum(QUERY_LENS))
    out, want = prefill(ext, case, QUERY_LENS, head_dim**-0.5, tile=tile)
    torch.testing.assert_close(out, want, **TOLERANCES[torch.bfloat16])


@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize("window", [1, 7, 20, 1000])
@pytest.mark.parametrize("cache", ["bf16", "fp32", "fp8-head", "int8-tensor"])
def test_prefill_window_softcap(ext, cache, window, softcap):
    case = make_case(cache, 6, 2, PREFILL_LENS, q_tokens=sum(QUERY_LENS))
    out, want = prefill(ext, case, QUERY_LENS, 0.3, window, softcap, tile=5)
    torch.testing.assert_close(out, want, **TOLERANCES[want.dtype])


def test_prefill_of_one_token_is_a_decode_step(ext):
    case = make_case("fp32", 6, 2, [33, 16, 1])
    out, _ = prefill(ext, case, [1, 1, 1], 0.125)
    want, _ = decode(ext, case, 0.125)
    torch.testing.assert_close(out, want, atol=1e-6, rtol=1e-6)


def test_prefill_leaves_long_sequences_to_the_caller(ext):
    q, k, v, tables, lens, _, _ = make_case("fp32", 6, 2, [10, 40], q_tokens=50)
    qlens = torch.tensor([10, 40], dtype=torch.int32)
    out = ext.paged_prefill(
        q, k, v, tables, lens, qlens, 0.125, None, None, 0, 0.0, 16, 100
    )  # 10 * 10 <= 100 < 40 * 40
    want = attention_twin.paged_prefill(q, k, v, tables, lens, qlens, 0.125)
    torch.testing.assert_close(out[:10], want[:10], **TOLERANCES[torch.float32])


# --- prefill with AMX (bf16 q; bf16, fp8 and int8 caches; head_dim 64 and 128) --------------

# whole prompts at and across 16-key tiles, 32-key steps, 128-key chunks and 256-query work items;
# chunks after cached prefixes; one token; none
AMX_LENS = [16, 32, 40, 100, 300, 1, 64, 129, 0]
AMX_QUERY_LENS = [16, 32, 9, 100, 300, 1, 1, 129, 0]
AMX_GROUPS = {"g1": (4, 4), "g3": (9, 3), "g8": (16, 2)}


def amx_case(cache, gqa, head_dim=64, block_size=16, lens=AMX_LENS, query_lens=AMX_QUERY_LENS):
    return make_case(cache, *AMX_GROUPS[gqa], lens, head_dim=head_dim, block_size=block_size, q_tokens=sum(query_lens))


@pytest.mark.parametrize("amx", ["on", "off"])
@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("gqa", list(AMX_GROUPS))
@pytest.mark.parametrize("cache", ["bf16", "fp8-tensor", "int8-head"])
def test_amx_prefill_matches_twin(ext, cache, gqa, head_dim, block_size, amx, monkeypatch):
    """QUANTKIT_NO_AMX=1 takes `attend` instead (the same results within the tolerance)."""
    if amx == "off":
        monkeypatch.setenv("QUANTKIT_NO_AMX", "1")
    case = amx_case(cache, gqa, head_dim, block_size)
    assert ext.amx_prefill(case[0], case[1]) == (amx == "on" and cpu_ext_has_amx())
    out, want = prefill(ext, case, AMX_QUERY_LENS, head_dim**-0.5)
    torch.testing.assert_close(out, want, **TOLERANCES[torch.bfloat16])


@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize("window", [1, 7, 16, 40, 200, 1000])  # the token itself, mid-tile, a tile, across, all
@pytest.mark.parametrize("cache", ["bf16", "int8-tensor"])
def test_amx_prefill_window_softcap(ext, cache, window, softcap):
    case = amx_case(cache, "g3", block_size=16)
    out, want = prefill(ext, case, AMX_QUERY_LENS, 0.3, window, softcap)  # scores up to ±20: the cap bends them
    torch.testing.assert_close(out, want, **TOLERANCES[torch.bfloat16])


def test_amx_prefill_window_skips_the_blocks_before_it(ext):
    """Blocks wholly before every query's window may hold anything: they are not read."""
    q, k, v, tables, lens, _, _ = amx_case("bf16", "g3", lens=[300, 100], query_lens=[40, 100])
    qlens = torch.tensor([40, 100], dtype=torch.int32)
    want = attention_twin.paged_prefill(q, k, v, tables, lens, qlens, 0.125, window=20)
    nan_block = int(tables.max()) + 1  # never written: NaN
    tables = tables.clone()
    tables[0, :15] = nan_block  # tokens 0-239: the first query (position 260) sees 241 on
    out = ext.paged_prefill(q, k, v, tables, lens, qlens, 0.125, None, None, 20, 0.0, 16, 0)
    torch.testing.assert_close(out[:40], want[:40], **TOLERANCES[torch.bfloat16])


def test_amx_prefill_on_two_threads(ext):
    g = torch.Generator().manual_seed(5)
    lens = torch.randint(1, 600, (12,), generator=g).tolist()
    qlens = [max(1, n // (1 + i % 3)) for i, n in enumerate(lens)]  # whole prompts and chunks after prefixes
    case = make_case("bf16", 9, 3, lens, q_tokens=sum(qlens), seed=2)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        out, want = prefill(ext, case, qlens, 0.125)
        again, _ = prefill(ext, case, qlens, 0.125)
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(out, want, **TOLERANCES[torch.bfloat16])
    assert torch.equal(out, again)


def test_amx_prefill_takes_only_what_it_can(ext, monkeypatch):
    bf16 = torch.bfloat16
    q, cache = torch.zeros(1, 2, 64, dtype=bf16), torch.zeros(1, 16, 1, 64, dtype=bf16)
    for dtype in (torch.float32, torch.float16):  # other q dtypes, other caches
        assert not ext.amx_prefill(q.to(dtype), cache)
        assert not ext.amx_prefill(q, cache.to(dtype))
    assert not ext.amx_prefill(torch.zeros(1, 2, 80, dtype=bf16), torch.zeros(1, 16, 1, 80, dtype=bf16))
    monkeypatch.setenv("QUANTKIT_NO_AMX", "1")
    assert not ext.amx_prefill(q, cache)


def cpu_ext_has_amx() -> bool:
    """Whether this CPU has AMX-BF16 (the kernel also needs the OS to grant the tile state)."""
    return "amx_bf16" in cpu_ext._cpu_flags().split()


# --- the dispatch in cpu_attention / ops, the fallback ---------------------------------------


def test_cpu_attention_and_ops_take_the_extension(ext):
    q, k, v, tables, lens, ks, vs = case = make_case("fp8-head", 6, 2, SEQ_LENS)
    out = ext.paged_attention(q, k, v, tables, lens, 0.125, ks, vs, 0, 0.0)
    assert torch.equal(cpu_attention.paged_attention(q, k, v, tables, lens, 0.125, ks, vs), out)
    assert torch.equal(ops.paged_attention(*case[:5], 0.125, ks, vs), out)


def test_cpu_prefill_splits_between_the_extension_and_sdpa(ext, monkeypatch):
    """Without the AMX prefill, sequences with query_len * seq_len <= PREFILL_EXT_WORK go to the
    C++ kernel, the others to SDPA, in one call."""
    monkeypatch.setenv("QUANTKIT_NO_AMX", "1")
    monkeypatch.setattr(cpu_attention, "PREFILL_EXT_WORK", 21 * 21)  # 21 * 21 and 8 * 40 in C++, 33 * 70 in SDPA
    for cache in ("bf16", "int8-head"):
        case = make_case(cache, 6, 2, PREFILL_LENS, q_tokens=sum(QUERY_LENS))
        q, k, v, tables, lens, ks, vs = case
        qlens = torch.tensor(QUERY_LENS, dtype=torch.int32)
        for window, softcap in ((None, None), (7, 5.0)):
            args = (q, k, v, tables, lens, qlens, 0.25, ks, vs, window, softcap)
            out = cpu_attention.paged_prefill(*args)
            torch.testing.assert_close(out, attention_twin.paged_prefill(*args), **TOLERANCES[q.dtype])
            sdpa = cpu_attention.torch_paged_prefill(*args)
            assert torch.equal(out[-33:], sdpa[-33:])  # the long one went through SDPA


@pytest.mark.parametrize("how", ["env", "unavailable"])
def test_fallback_is_the_torch_path(ext, monkeypatch, how):
    if how == "env":
        monkeypatch.setenv("QUANTKIT_NO_EXT", "1")
        assert cpu_ext.load() is None and cpu_ext.reason() == "disabled by QUANTKIT_NO_EXT=1"
    else:
        monkeypatch.setattr(cpu_ext, "load", lambda: None)
    q, k, v, tables, lens, ks, vs = make_case("int8-tensor", 6, 2, SEQ_LENS)
    args = (q, k, v, tables, lens, 0.125, ks, vs, 7, None)
    assert torch.equal(cpu_attention.paged_attention(*args), cpu_attention.torch_paged_attention(*args))
    case = make_case("bf16", 6, 2, PREFILL_LENS, q_tokens=sum(QUERY_LENS))
    pargs = (*case[:5], torch.tensor(QUERY_LENS, dtype=torch.int32), 0.125, None, None, None, 5.0)
    assert torch.equal(cpu_attention.paged_prefill(*pargs), cpu_attention.torch_paged_prefill(*pargs))


def test_head_dims_the_kernel_cannot_take_go_to_torch(ext):
    q, k, v, tables, lens, _, _ = make_case("fp32", 6, 2, SEQ_LENS, head_dim=24)
    args = (q, k, v, tables, lens, 0.2)
    assert torch.equal(cpu_attention.paged_attention(*args), cpu_attention.torch_paged_attention(*args))


def test_no_compiler_is_a_reason(monkeypatch):
    monkeypatch.setenv("CXX", "/nonexistent/g++")
    ops_, reason = cpu_ext.Extension("attention/attention.cpp", "quantkit_none", "x", "test")._build()
    assert ops_ is None and reason == "no C++ compiler (/nonexistent/g++ not found; set $CXX or install g++)"


def test_the_build_key_names_the_cpu(monkeypatch):
    key = cpu_ext.build_key("c++", cpu_ext.ATTENTION.source)
    monkeypatch.setattr(cpu_ext, "_cpu_flags", lambda: "another cpu")
    assert cpu_ext.build_key("c++", cpu_ext.ATTENTION.source) != key


def test_the_build_key_names_where_the_source_lies(tmp_path):
    # ninja's command names the source's path: checkouts of one source must not share a folder
    copy = tmp_path / "attention.cpp"
    copy.write_bytes(cpu_ext.ATTENTION.source.read_bytes())
    assert cpu_ext.build_key("c++", copy) != cpu_ext.build_key("c++", cpu_ext.ATTENTION.source)


def test_the_build_key_hashes_the_headers_a_source_includes(tmp_path):
    # a change to the shared cpu_isa.h must rebuild every library that includes it
    (tmp_path / "op").mkdir()
    source = tmp_path / "op" / "k.cpp"
    source.write_text('#include "../isa.h"\n#include "k.cpp"  // its own second pass\nint f();\n')
    header = tmp_path / "isa.h"
    header.write_text('#include "more.h"\nint a;\n')
    (tmp_path / "more.h").write_text("int b;\n")
    assert cpu_ext.local_includes(source) == [header.resolve(), (tmp_path / "more.h").resolve()]
    key = cpu_ext.build_key("c++", source)
    header.write_text('#include "more.h"\nint a2;\n')
    changed = cpu_ext.build_key("c++", source)
    (tmp_path / "more.h").write_text("int b2;\n")
    assert len({key, changed, cpu_ext.build_key("c++", source)}) == 3
    gemv = cpu_ext.ROOT / "dense" / "gemv.cpp"
    assert cpu_ext.local_includes(gemv) == [(cpu_ext.ROOT / "cpu_isa.h").resolve()]


# --- the build lock --------------------------------------------------------------------------

LOCKED = """
import sys, time
from pathlib import Path
from quantkit.kernels.cpu_ext import locked_build

def build():
    with open(sys.argv[2], "a") as f:
        f.write(f"start {time.time()}\\n")
    time.sleep(0.5)
    with open(sys.argv[2], "a") as f:
        f.write(f"end {time.time()}\\n")

locked_build(Path(sys.argv[1]), build)
"""


def test_builds_in_two_processes_do_not_overlap(tmp_path):
    script = tmp_path / "locked.py"
    script.write_text(textwrap.dedent(LOCKED))
    (tmp_path / "ext").mkdir()
    (tmp_path / "ext" / "lock").write_text("")  # torch's lock, left by a killed build: removed under ours
    log = tmp_path / "log.txt"
    runs = [subprocess.Popen([sys.executable, str(script), str(tmp_path / "ext"), str(log)]) for _ in range(2)]
    assert [p.wait(timeout=60) for p in runs] == [0, 0]
    events = [line.split() for line in log.read_text().splitlines()]
    assert [e[0] for e in events] == ["start", "end", "start", "end"]
    assert float(events[1][1]) <= float(events[2][1])
    assert not (tmp_path / "ext" / "lock").exists()


def test_a_failed_build_is_remembered(tmp_path):
    calls = []

    def failing():
        calls.append(1)
        raise RuntimeError("Error building extension:\nFAILED: attention.o\nattention.cpp:3:1: error: boom\nmore")

    for _ in range(2):
        with pytest.raises(RuntimeError, match=r"^attention.cpp:3:1: error: boom$"):
            cpu_ext.locked_build(tmp_path / "ext", failing)
    assert calls == [1]
