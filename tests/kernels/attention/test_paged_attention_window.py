"""The sliding window and soft-capping options (`window`, `softcap`): the twins against dense
attention with the window mask and tanh cap written out, the Triton kernel and the CPU paths
against the twins, the blocks before a window never read, and bad options refused."""

from __future__ import annotations

import pytest
import torch
from paged_cases import (
    BLOCK_SIZE,
    CPU_SEQ_LENS,
    DEVICE,
    GQA,
    PREFILL_QUERY_LENS,
    PREFILL_SEQ_LENS,
    SEQ_LENS,
    SOFTCAPS,
    TOLERANCES,
    WINDOWS,
    Case,
    cpu_case,
    dense_attention,
    dense_decode,
    dense_kv,
    launcher_args,
    make_case,
)

from quantkit.errors import QuantkitError
from quantkit.kernels.attention import cpu as cpu_attention
from quantkit.kernels.attention import twin as attention_twin
from quantkit.kernels.attention.triton import paged_attention, paged_prefill


@pytest.mark.parametrize("softcap", SOFTCAPS)
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("cache", ["fp16", "fp8-head", "int8-tensor"])
def test_twin_window_softcap_matches_dense(cache, window, softcap):
    case = make_case(cache, *GQA["gqa3"])
    out = attention_twin.paged_attention(case.q, *case.cache_args(), 0.3, case.k_scale, case.v_scale, window, softcap)
    torch.testing.assert_close(out, dense_decode(case, 0.3, window, softcap), **TOLERANCES[case.q.dtype])


@pytest.mark.parametrize("softcap", SOFTCAPS)
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("cache", ["fp16", "fp8-head", "int8-tensor"])
def test_prefill_window_softcap_matches_dense(cache, window, softcap):
    """Through the launcher (its checks, then the twin)."""
    case = make_case(cache, *GQA["gqa3"], seq_lens=PREFILL_SEQ_LENS, q_tokens=sum(PREFILL_QUERY_LENS))
    query_lens = torch.tensor(PREFILL_QUERY_LENS, dtype=torch.int32, device=DEVICE)
    out = paged_prefill(case.q, *case.cache_args(), query_lens, 0.3, case.k_scale, case.v_scale, window, softcap)
    for i, (start, n) in enumerate(zip([0, 21, 29, 30], PREFILL_QUERY_LENS)):
        if n:
            want = dense_attention(case.q[start : start + n].transpose(0, 1), *dense_kv(case, i), 0.3, window, softcap)
            torch.testing.assert_close(
                out[start : start + n], want.transpose(0, 1).to(case.q.dtype), **TOLERANCES[case.q.dtype]
            )


# The interpreter is slow (~0.3 s a call), so not the whole product: every window and the cap
# alone and with each, each cache dtype at least once (no window, no cap: test_kernel_matches_twin)
KERNEL_CASES = [
    ("fp16", None, 5.0),
    ("int8-head", None, 5.0),
    ("fp32", 1, None),
    ("fp8-tensor", 1, 5.0),
    ("fp8-head", 7, None),
    ("fp16", 7, 5.0),
    ("int8-tensor", 7, 5.0),
    ("int8-head", 20, None),
    ("fp32", 20, 5.0),
    ("fp16", 1000, None),
    ("fp8-head", 1000, 5.0),
]


@pytest.mark.parametrize("cache, window, softcap", KERNEL_CASES)
def test_kernel_window_softcap_matches_twin(cache, window, softcap):
    case = make_case(cache, *GQA["gqa3"])
    args = (case.q, *case.cache_args(), 0.3, case.k_scale, case.v_scale, window, softcap)
    out = paged_attention(*args)
    assert torch.equal(out[SEQ_LENS.index(0)], torch.zeros_like(out[0]))
    torch.testing.assert_close(out, attention_twin.paged_attention(*args), **TOLERANCES[case.q.dtype])


def _tables_before_window_on_nan(case: Case, window: int) -> torch.Tensor:
    """case's block tables with every block wholly before the window replaced by an unused block (all NaN)."""
    tables = case.block_tables.clone()
    spare = sorted(set(range(case.k_cache.shape[0])) - set(tables.flatten().tolist()))[0]
    for i, n in enumerate(case.seq_lens.tolist()):
        tables[i, : max(n - window, 0) // BLOCK_SIZE] = spare
    return tables


@pytest.mark.parametrize("softcap", SOFTCAPS)
@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_window_skips_the_blocks_before_it(backend, softcap):
    """Blocks wholly before the window may hold anything (e.g. freed and reused): they are not read."""
    case = cpu_case("fp16", "gqa3") if backend == "cpu" else make_case("fp16", *GQA["gqa3"])  # unused slots: NaN
    tables = _tables_before_window_on_nan(case, 7)
    assert tables.ne(case.block_tables).any()
    want = attention_twin.paged_attention(case.q, *case.cache_args(), 0.3, window=7, softcap=softcap)
    attend = cpu_attention.paged_attention if backend == "cpu" else paged_attention
    out = attend(case.q, case.k_cache, case.v_cache, tables, case.seq_lens, 0.3, window=7, softcap=softcap)
    torch.testing.assert_close(out, want, **TOLERANCES[torch.float16])


@pytest.mark.parametrize("softcap", SOFTCAPS)
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("cache", ["bf16", "fp32", "fp8-head-bf16", "int8-tensor"])
def test_cpu_paged_attention_window_softcap_matches_twin(cache, window, softcap, monkeypatch):
    """Each sequence its own call (CHUNK_BYTES 1), then all in one padded, masked call."""
    case = cpu_case(cache, "gqa3", seq_lens=CPU_SEQ_LENS)
    args = (case.q, *case.cache_args(), 0.3, case.k_scale, case.v_scale, window, softcap)
    want = attention_twin.paged_attention(*args)
    for chunk_bytes in (1, cpu_attention.CHUNK_BYTES):
        monkeypatch.setattr(cpu_attention, "CHUNK_BYTES", chunk_bytes)
        out = cpu_attention.paged_attention(*args)
        assert out.dtype == case.q.dtype and torch.equal(out[CPU_SEQ_LENS.index(0)], torch.zeros_like(out[0]))
        torch.testing.assert_close(out, want, **TOLERANCES[case.q.dtype])


@pytest.mark.parametrize("gqa", ["mha", "mqa"])
def test_cpu_paged_attention_window_softcap_other_head_groups(gqa):
    case = cpu_case("fp8-head", gqa, seq_lens=CPU_SEQ_LENS)
    args = (case.q, *case.cache_args(), 0.3, case.k_scale, case.v_scale, 7, 5.0)
    torch.testing.assert_close(
        cpu_attention.paged_attention(*args), attention_twin.paged_attention(*args), **TOLERANCES[case.q.dtype]
    )


@pytest.mark.parametrize("softcap", SOFTCAPS)
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("cache", ["bf16", "fp32", "fp8-head-bf16", "int8-tensor"])
def test_cpu_paged_prefill_window_softcap_matches_twin(cache, window, softcap):
    """With window 1 or 7 the chunk of 8 queries after 32 cached tokens reads from block 1 or 2 on."""
    case = cpu_case(cache, "gqa3", seq_lens=PREFILL_SEQ_LENS, q_tokens=sum(PREFILL_QUERY_LENS))
    query_lens = torch.tensor(PREFILL_QUERY_LENS, dtype=torch.int32)
    args = (case.q, *case.cache_args(), query_lens, 0.3, case.k_scale, case.v_scale, window, softcap)
    torch.testing.assert_close(
        cpu_attention.paged_prefill(*args), attention_twin.paged_prefill(*args), **TOLERANCES[case.q.dtype]
    )


def test_cpu_plans_are_kept_per_window():
    """Gemma 2 alternates window and full layers: each keeps its plan for the step."""
    case = cpu_case("fp32", "gqa3", seq_lens=[40, 32, 48])
    plan = lambda window: cpu_attention._plan_for(case.block_tables, case.seq_lens, BLOCK_SIZE, 128, window)  # noqa: E731
    full, windowed = plan(None), plan(7)
    assert plan(None) is full and plan(7) is windowed and full is not windowed
    assert [c.length for c in full] == [48]
    assert [c.length for c in windowed] == [BLOCK_SIZE]  # positions 33-39, 25-31, 41-47: one block each


@pytest.mark.parametrize("bad", [dict(window=0), dict(window=2.5), dict(softcap=0.0), dict(softcap=float("nan"))])
def test_launcher_rejects_bad_window_or_softcap(bad):
    with pytest.raises(
        QuantkitError,
        match=r"^paged_attention: (window must be a positive int|softcap must be a finite positive number)",
    ):
        paged_attention(**launcher_args(), **bad)
