"""paged_attention (Triton; under TRITON_INTERPRET=1 without a GPU) against its torch twin,
the twin against dense attention computed from scratch (contiguous K/V per sequence,
`fake_quantize_kv`, `torch.softmax`), the torch paged_prefill against dense causal
attention, and the batched CPU path (`cpu_attention`: kv_store, paged_attention,
paged_prefill) against the twins; then the same for the sliding window and soft-capping
options (`window`, `softcap`), the twins against dense attention whose window mask and
tanh cap are written out here.

Queries and caches are fp16/fp32 here: under the interpreter bf16 `tl.dot` is wrong and
fp32 -> bf16 casts truncate, so bf16 is only checked on a GPU (test_bf16_on_gpu).
Dequantisation is exact in both paths (stored * scale), so tolerances depend on the
query/output dtype only.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import shuffled_cache

from quantkit import ops
from quantkit.calibration.kv import fake_quantize_kv, kv_scales
from quantkit.errors import QuantkitError
from quantkit.kernels.attention import cpu as cpu_attention
from quantkit.kernels.attention import twin as attention_twin
from quantkit.kernels.attention.triton import paged_attention, paged_prefill
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


PREFILL_SEQ_LENS = [21, 40, 17, 5]
PREFILL_QUERY_LENS = [21, 8, 1, 0]  # a whole prompt, a chunk after 32 cached tokens, one token, none


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


def _good() -> dict:
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
    kwargs = _good() | {name: t.to(DEVICE) if t is not None else None for name, t in changes.items()}
    with pytest.raises(ValueError, match=message):
        paged_attention(**kwargs)


def test_float_cache_needs_a_query_of_its_dtype():
    case = make_case("fp16", 4, 2, seq_lens=[5])
    with pytest.raises(ValueError, match=r"q must be torch.float16 for a torch.float16 cache; got torch.float32"):
        paged_attention(case.q.float(), *case.cache_args(), 0.25)


def test_cpu_tensors_need_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    kwargs = {n: t.cpu() if isinstance(t, torch.Tensor) else t for n, t in _good().items()}
    with pytest.raises(ValueError, match=r"needs a GPU; on CPU call quantkit.kernels.attention.twin.paged_attention"):
        paged_attention(**kwargs)


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


# --- sliding window and soft-capping ---------------------------------------------------------

# off; only the token itself; mid-block; across a block boundary; wider than every context
WINDOWS = [None, 1, 7, 20, 1000]
SOFTCAPS = [None, 5.0]  # the scaled scores here reach ±20, a third of them past ±2.5: the cap bends them


def _dense_decode(case: Case, scale: float, window, softcap) -> torch.Tensor:
    want = torch.zeros_like(case.q)
    for i, n in enumerate(case.seq_lens.tolist()):
        if n:
            o = dense_attention(case.q[i, :, None], *dense_kv(case, i), scale, window, softcap)
            want[i] = o[:, 0].to(case.q.dtype)
    return want


@pytest.mark.parametrize("softcap", SOFTCAPS)
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("cache", ["fp16", "fp8-head", "int8-tensor"])
def test_twin_window_softcap_matches_dense(cache, window, softcap):
    case = make_case(cache, *GQA["gqa3"])
    out = attention_twin.paged_attention(case.q, *case.cache_args(), 0.3, case.k_scale, case.v_scale, window, softcap)
    torch.testing.assert_close(out, _dense_decode(case, 0.3, window, softcap), **TOLERANCES[case.q.dtype])


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
        paged_attention(**_good(), **bad)


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
