"""The C++ element-wise kernels (`quantkit.kernels.elementwise.cpp`, kernels/elementwise/fused.cpp) against
their twins (`kernels/elementwise/twin.py`) (transformers' own torch code): RMSNorm Llama's way
and Gemma's, the residual add + norm, rotary embedding in place (whole and partial), SiLU * up;
every float dtype, sizes with and without a vector tail, strided views as the runner passes.

Tolerance: the kernels round where the twins round, so rotary embedding and SiLU are the
twins' bit for bit, and so is the add of `add_rms_norm_`. The norms sum the squares in another
order, so 1/sqrt(mean) may differ in its last bit: fp32 within 4 units in the last place
(relative), bf16 / fp16 within one, and at least 99% of their values bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from conftest import built

from quantkit import ops
from quantkit.kernels import elementwise
from quantkit.kernels.attention import twin as attention_twin
from quantkit.kernels.choice import Problem, choose
from quantkit.kernels.elementwise import cpp as cpu_fused
from quantkit.kernels.elementwise import twin as elementwise_twin

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(scope="module")
def k():
    with built(cpu_fused.EXTENSION) as module:
        yield module


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    """A norm's output: a few units in the last place, and mostly the same bits."""
    assert got.shape == want.shape and got.dtype == want.dtype
    ulp = torch.finfo(want.dtype).eps * (4 if want.dtype == torch.float32 else 1)
    torch.testing.assert_close(got, want, rtol=ulp, atol=ulp * 1e-3)
    if want.dtype != torch.float32:
        assert (got == want).float().mean() >= 0.99


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [576, 37, 8])
@pytest.mark.parametrize("gemma", [False, True])
def test_rms_norm(k, dtype, hidden, gemma):
    g = torch.Generator().manual_seed(hidden)
    x = (torch.randn(19, hidden, generator=g) * 3).to(dtype)
    w = (torch.rand(hidden, generator=g) + 0.5).to(dtype)
    close(k.rms_norm(x, w, 1e-5, gemma), elementwise_twin.rms_norm(x, w, 1e-5, gemma))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_of_heads_in_a_strided_view(k, dtype):
    """q_norm / k_norm: per-head rows of the q slice of a fused q/k/v output."""
    qkv = torch.randn(5, (4 + 2 * 2) * 64, generator=torch.Generator().manual_seed(1)).to(dtype)
    q = qkv[:, : 4 * 64].view(5, 4, 64)
    w = torch.rand(64, generator=torch.Generator().manual_seed(2)).to(dtype)
    out = k.rms_norm(q, w, 1e-6, False)
    assert out.is_contiguous()
    close(out, elementwise_twin.rms_norm(q, w, 1e-6, False))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [576, 37])
def test_add_rms_norm_adds_in_place(k, dtype, hidden):
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(7, hidden, generator=g) * 3).to(dtype)
    delta = torch.randn(7, hidden, generator=g).to(dtype)
    w = (torch.rand(hidden, generator=g) + 0.5).to(dtype)
    x_ref = x.clone()
    out = k.add_rms_norm_(x, delta, w, 1e-5, False)
    want = elementwise_twin.add_rms_norm_(x_ref, delta, w, 1e-5, False)
    assert torch.equal(x, x_ref)  # the residual stream, the same bits
    close(out, want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rotary", [64, 32, 16, 40])  # whole, partial, a half shorter than a vector, a tail
def test_rope_in_place(k, dtype, rotary):
    g = torch.Generator().manual_seed(rotary)
    qkv = torch.randn(6, 10, 64, generator=g).to(dtype)
    angle = torch.rand(6, rotary // 2, generator=g) * 100
    cos = torch.cat([angle.cos()] * 2, -1).to(dtype)
    sin = torch.cat([-angle.sin(), angle.sin()], -1).to(dtype)  # sign folded, as the runner passes
    x, x_ref = qkv[:, 2:7], qkv.clone()[:, 2:7]  # a strided slice of heads
    k.rope_(x, cos, sin)
    elementwise_twin.rope_(x_ref, cos, sin)
    assert torch.equal(x, x_ref)
    assert torch.equal(qkv[:, :2], qkv[:, :2].clone()) and not torch.equal(x, qkv.clone()[:, 2:7] * 0)


def test_rope_leaves_other_heads_alone(k):
    qkv = torch.randn(3, 6, 64)
    before = qkv.clone()
    cos, sin = torch.rand(3, 64), torch.rand(3, 64)
    k.rope_(qkv[:, 1:3], cos, sin)
    assert torch.equal(qkv[:, [0, 3, 4, 5]], before[:, [0, 3, 4, 5]])
    assert not torch.equal(qkv[:, 1:3], before[:, 1:3])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [1536, 37])
def test_silu_mul(k, dtype, inter):
    gu = (torch.randn(9, 2 * inter, generator=torch.Generator().manual_seed(inter)) * 4).to(dtype)
    got, want = k.silu_mul(gu), elementwise_twin.silu_mul(gu)
    if dtype == torch.float32 and inter % 16:  # the tail: SLEEF's exp where torch's loop takes libm's
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    else:
        assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [49152, 1000, 37, 16, 5, 1])
def test_argmax_is_torchs(k, dtype, vocab):
    """The first index of the maximum; NaN counts as the largest, its first index wins."""
    x = torch.randn(10, vocab, generator=torch.Generator().manual_seed(vocab)).to(dtype)
    x[1, min(5, vocab - 1)] = x[1, min(700, vocab - 1)] = 1e4  # ties: the first
    x[2, vocab // 2] = float("nan")
    x[3, -1], x[3, 0] = float("nan"), float("inf")
    x[4] = float("-inf")
    x[5, 0], x[5, -1] = float("nan"), float("nan")
    x[6] = 1.0
    x[7, -1] = 1e4  # in the tail after the last whole vector
    assert torch.equal(k.argmax(x), x.argmax(-1))


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda k: k.rms_norm(torch.randn(4), torch.ones(4), 1e-5, False), "rows"),
        (lambda k: k.rms_norm(torch.randn(2, 4), torch.ones(5), 1e-5, False), "weight"),
        (lambda k: k.rms_norm(torch.randn(2, 4), torch.ones(4, dtype=torch.bfloat16), 1e-5, False), "weight"),
        (lambda k: k.add_rms_norm_(torch.randn(2, 4), torch.randn(3, 4), torch.ones(4), 1e-5, False), "delta"),
        (lambda k: k.rope_(torch.randn(2, 3, 8), torch.ones(2, 16), torch.ones(2, 16)), "rotary_dim"),
        (lambda k: k.rope_(torch.randn(2, 3, 8), torch.ones(3, 8), torch.ones(3, 8)), "cos and sin"),
        (lambda k: k.silu_mul(torch.randn(2, 5)), "even"),
        (lambda k: k.silu_mul(torch.randn(2, 4, dtype=torch.float64)), "float32, bfloat16 or float16"),
        (lambda k: k.argmax(torch.randn(2, 0)), "vocab > 0"),
    ],
)
def test_errors(k, call, message):
    with pytest.raises(RuntimeError, match=message):
        call(k)


def test_ops_take_the_kernel_on_the_cpu_and_the_twin_with_backend_torch(k):
    x, w = torch.randn(3, 8), torch.ones(8)
    for op, candidates in (("rms_norm", elementwise.RMS_NORM), ("silu_mul", elementwise.SILU_MUL)):
        fast = choose(op, candidates, Problem("cpu", torch.float32, dtypes=(torch.float32,)))
        assert (fast.name, fast.why, fast.fn) == ("quantkit C++", None, getattr(k, op))
        twin = choose(op, candidates, Problem("cpu", torch.float32, "torch"))
        assert (twin.name, twin.why, twin.fn) == ("torch ops", "backend torch", getattr(elementwise_twin, op))
    mixed = choose("rms_norm", elementwise.RMS_NORM, Problem("cpu", torch.float32, dtypes=(torch.float64,)))
    assert mixed.fn is elementwise_twin.rms_norm and "operands of one dtype" in mixed.why
    assert torch.equal(
        ops.rms_norm(x, w.double(), 1e-5), elementwise_twin.rms_norm(x, w.double(), 1e-5)
    )  # promotes as torch
    assert torch.equal(ops.rms_norm(x, w, 1e-5, backend="torch"), elementwise_twin.rms_norm(x, w, 1e-5))


def test_without_the_build_the_ops_run_the_twins(monkeypatch):
    monkeypatch.setenv("QUANTKIT_NO_EXT", "1")
    x, w = torch.randn(3, 8), torch.rand(8)
    assert torch.equal(ops.rms_norm(x, w, 1e-5), elementwise_twin.rms_norm(x, w, 1e-5))
    chosen = choose("rms_norm", elementwise.RMS_NORM, Problem("cpu", torch.float32))
    assert (chosen.name, chosen.why) == ("torch ops", "quantkit C++: disabled by QUANTKIT_NO_EXT=1")


@pytest.mark.parametrize(
    "cache_dtype, per_head",
    [
        (torch.bfloat16, False),
        (torch.float32, False),
        (torch.float8_e4m3fn, False),
        (torch.float8_e4m3fn, True),
        (torch.int8, False),
        (torch.int8, True),
    ],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kv_store_writes_what_the_twin_writes(k, cache_dtype, dtype, per_head):
    """Strided k/v views of a fused q/k/v output, a skipped token, slots across blocks; fp8 /
    int8 with scales that push values past the range (clamped), bit for bit."""
    g = torch.Generator().manual_seed(0)
    qkv = (torch.randn(6, (4 + 2 * 2) * 16, generator=g) * 40).to(dtype)
    kv = qkv[:, 4 * 16 :].view(6, 4, 16)
    key, value = kv[:, :2], kv[:, 2:]
    slots = torch.tensor([17, 3, -1, 40, 0, 41])
    scales = (None, None)
    if cache_dtype.itemsize == 1:  # float caches take no scales
        scales = (torch.tensor([0.05, 0.2] if per_head else [0.05]), torch.tensor([0.3, 0.1] if per_head else [0.3]))
    caches = [torch.zeros(6, 8, 2, 16, dtype=cache_dtype) for _ in range(4)]
    k.kv_store_(key, value, caches[0], caches[1], slots, *scales)
    attention_twin.kv_store(key, value, caches[2], caches[3], slots, *scales)
    for got, want in ((caches[0], caches[2]), (caches[1], caches[3])):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert caches[0].view(torch.uint8).any()


def test_kv_store_refuses_what_it_cannot_store(k):
    key = torch.randn(2, 2, 16)
    cache = torch.zeros(4, 8, 2, 16, dtype=torch.float8_e4m3fn)
    with pytest.raises(RuntimeError, match="need float32 scales"):
        k.kv_store_(key, key, cache, cache.clone(), torch.tensor([0, 1]), None, None)
    with pytest.raises(RuntimeError, match="past the cache"):
        k.kv_store_(key, key, torch.zeros(4, 8, 2, 16), torch.zeros(4, 8, 2, 16), torch.tensor([0, 32]), None, None)
