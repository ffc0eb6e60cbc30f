"""paged_attention (Triton; under TRITON_INTERPRET=1 without a GPU) against its torch twin, the
twin against dense attention computed from scratch (`paged_cases`), the torch paged_prefill
against dense causal attention, and the launcher's errors. The batched CPU path and the C++
kernels: test_paged_attention_cpu.py; the sliding window and soft-cap: test_paged_attention_window.py.

Queries and caches are fp16/fp32 here: under the interpreter bf16 `tl.dot` is wrong and
fp32 -> bf16 casts truncate, so bf16 is only checked on a GPU (test_bf16_on_gpu).
Dequantisation is exact in both paths (stored * scale), so tolerances depend on the
query/output dtype only.
"""

from __future__ import annotations

import pytest
import torch
from paged_cases import (
    CACHES,
    DEVICE,
    GQA,
    PREFILL_QUERY_LENS,
    PREFILL_SEQ_LENS,
    SEQ_LENS,
    TOLERANCES,
    dense_attention,
    dense_kv,
    launcher_args,
    make_case,
)

from quantkit.kernels.attention import twin as attention_twin
from quantkit.kernels.attention.triton import paged_attention, paged_prefill


@pytest.mark.parametrize("gqa", list(GQA))
@pytest.mark.parametrize("cache", list(CACHES))
def test_twin_matches_dense(cache, gqa):
    case = make_case(cache, *GQA[gqa])
    scale = 16**-0.5
    out = attention_twin.paged_attention(case.q, *case.cache_args(), scale, case.k_scale, case.v_scale)
    want = torch.zeros_like(case.q)
    for i, n in enumerate(SEQ_LENS):
        if n:
            want[i] = dense_attention(case.q[i, :, None], *dense_kv(case, i), scale)[:, 0].to(case.q.dtype)
    torch.testing.assert_close(out, want, **TOLERANCES[case.q.dtype])


@pytest.mark.parametrize("gqa", list(GQA))
@pytest.mark.parametrize("cache", list(CACHES))
def test_kernel_matches_twin(cache, gqa):
    case = make_case(cache, *GQA[gqa])
    out = paged_attention(case.q, *case.cache_args(), 0.3, case.k_scale, case.v_scale)
    want = attention_twin.paged_attention(case.q, *case.cache_args(), 0.3, case.k_scale, case.v_scale)
    assert out.dtype == case.q.dtype and out.shape == case.q.shape
    assert torch.equal(out[SEQ_LENS.index(0)], torch.zeros_like(out[0]))  # an empty sequence gives zeros
    torch.testing.assert_close(out, want, **TOLERANCES[case.q.dtype])


def test_kernel_head_dim_not_a_power_of_two():
    case = make_case("fp8-head", 6, 2, seq_lens=[19, 33], head_dim=24)
    out = paged_attention(case.q, *case.cache_args(), 24**-0.5, case.k_scale, case.v_scale)
    want = attention_twin.paged_attention(case.q, *case.cache_args(), 24**-0.5, case.k_scale, case.v_scale)
    torch.testing.assert_close(out, want, **TOLERANCES[case.q.dtype])


def test_kernel_softmax_is_stable_for_large_scores():
    """Scores around 1e4 would overflow exp() without the running max."""
    case = make_case("fp32", 4, 2, seq_lens=[40, 7])
    out = paged_attention(case.q, *case.cache_args(), 300.0)
    want = attention_twin.paged_attention(case.q, *case.cache_args(), 300.0)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, want, atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 tl.dot is wrong in the Triton interpreter")
@pytest.mark.parametrize(
    "cache", [(torch.bfloat16, torch.bfloat16, None), (torch.float8_e4m3fn, torch.bfloat16, "attn_head")]
)
def test_bf16_on_gpu(cache):
    case = make_case(cache, 32, 8, seq_lens=[1, 16, 200, 513], head_dim=128)
    out = paged_attention(case.q, *case.cache_args(), 128**-0.5, case.k_scale, case.v_scale)
    want = attention_twin.paged_attention(case.q, *case.cache_args(), 128**-0.5, case.k_scale, case.v_scale)
    torch.testing.assert_close(out, want, **TOLERANCES[torch.bfloat16])


@pytest.mark.parametrize("gqa", list(GQA))
@pytest.mark.parametrize("cache", ["fp16", "fp8-head", "int8-tensor"])
def test_prefill_matches_dense(cache, gqa):
    case = make_case(cache, *GQA[gqa], seq_lens=PREFILL_SEQ_LENS, q_tokens=sum(PREFILL_QUERY_LENS))
    query_lens = torch.tensor(PREFILL_QUERY_LENS, dtype=torch.int32, device=DEVICE)
    out = paged_prefill(case.q, *case.cache_args(), query_lens, 0.25, case.k_scale, case.v_scale)
    starts = [0, 21, 29, 30]
    for i, (start, n) in enumerate(zip(starts, PREFILL_QUERY_LENS)):
        if n:
            want = dense_attention(case.q[start : start + n].transpose(0, 1), *dense_kv(case, i), 0.25)
            torch.testing.assert_close(
                out[start : start + n], want.transpose(0, 1).to(case.q.dtype), **TOLERANCES[case.q.dtype]
            )
    # a one-token prefill is a decode step
    decode = attention_twin.paged_attention(
        case.q[29:30],
        case.k_cache,
        case.v_cache,
        case.block_tables[2:3],
        case.seq_lens[2:3],
        0.25,
        case.k_scale,
        case.v_scale,
    )
    torch.testing.assert_close(out[29:30], decode, **TOLERANCES[case.q.dtype])


def test_prefill_errors():
    case = make_case("fp16", 4, 2, seq_lens=[10, 3], q_tokens=5)
    with pytest.raises(ValueError, match=r"q has 5 tokens but query_lens add up to 4"):
        paged_prefill(case.q, *case.cache_args(), torch.tensor([2, 2], dtype=torch.int32, device=DEVICE), 1.0)
    with pytest.raises(ValueError, match=r"sequence 1 needs 0 <= query_len <= seq_len <= 48 .* query_len 4, seq_len 3"):
        paged_prefill(case.q, *case.cache_args(), torch.tensor([1, 4], dtype=torch.int32, device=DEVICE), 1.0)
    with pytest.raises(ValueError, match=r"query_lens must be int32 \[2\]"):
        paged_prefill(case.q, *case.cache_args(), torch.tensor([1, 4], device=DEVICE), 1.0)


BAD = {
    "heads not a multiple of kv heads": (
        dict(q=torch.randn(2, 3, 16, dtype=torch.float16)),
        r"num_heads a multiple of the cache's 2 KV heads",
    ),
    "q head_dim": (dict(q=torch.randn(2, 4, 8, dtype=torch.float16)), r"q must be \[tokens, num_heads, 16\]"),
    "int q": (dict(q=torch.ones(2, 4, 16, dtype=torch.int32)), r"q must be float16, bfloat16 or float32"),
    "int64 block table": (
        dict(block_tables=torch.zeros(2, 3, dtype=torch.int64)),
        r"block_tables must be int32 \[2, max_blocks_per_seq\]",
    ),
    "block table rows": (dict(block_tables=torch.zeros(3, 3, dtype=torch.int32)), r"block_tables must be int32 \[2,"),
    "seq_lens length": (dict(seq_lens=torch.ones(3, dtype=torch.int32)), r"seq_lens must be int32 \[2\]"),
    "missing v_scale": (dict(v_scale=None), r"needs v_scale"),
    "block size 8": (
        dict(k_cache=torch.zeros(4, 8, 2, 16, dtype=torch.int8), v_cache=torch.zeros(4, 8, 2, 16, dtype=torch.int8)),
        r"block_size that is a power of two >= 16; got 8",
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_launcher_errors(case):
    changes, message = BAD[case]
    kwargs = launcher_args() | {name: t.to(DEVICE) if t is not None else None for name, t in changes.items()}
    with pytest.raises(ValueError, match=message):
        paged_attention(**kwargs)


def test_float_cache_needs_a_query_of_its_dtype():
    case = make_case("fp16", 4, 2, seq_lens=[5])
    with pytest.raises(ValueError, match=r"q must be torch.float16 for a torch.float16 cache; got torch.float32"):
        paged_attention(case.q.float(), *case.cache_args(), 0.25)


def test_cpu_tensors_need_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    kwargs = {n: t.cpu() if isinstance(t, torch.Tensor) else t for n, t in launcher_args().items()}
    with pytest.raises(ValueError, match=r"needs a GPU; on CPU call quantkit.kernels.attention.twin.paged_attention"):
        paged_attention(**kwargs)
