"""The AVX int4 and int8 kernels for fp32 activations (`quantkit.kernels.int4.avx`) against
their twins, on both ISA variants.

Tolerance. The kernels compute the twin's fp32 weights exactly (w = u s + zs regrouped as
s · Σ u x + zs · Σ x per group, products of small integers and fp32 scales), so against the fp32
twin only the order and grouping of the fp32 sums differ: rtol = 1e-4 with atol = 1e-4 · rms of
the output (measured: max |error| ≤ ~6e-6 · rms). Every M crosses the few-rows schedule, its
crossover to the L1-block schedule (cpu_int4_avx.FEW_ROWS: 4 rows on AVX2, 8 on AVX-512) and
partial micro-kernel row blocks; N is never a multiple of 16 or 32. The AVX-512 variant is skipped
where the CPU lacks it; everything is skipped where the extension cannot be built.
"""

from __future__ import annotations

import pytest
import torch
from int4_cases import quantized

from quantkit.errors import QuantkitError
from quantkit.kernels.int4 import avx as cpu_int4_avx
from quantkit.kernels.int4 import twin as reference

LEVEL = cpu_int4_avx.isa_level()
pytestmark = pytest.mark.skipif(LEVEL == 0, reason=f"no AVX int4 kernel: {cpu_int4_avx.EXTENSION.reason()}")
ISAS = [
    "avx2",
    pytest.param(
        "avx512", marks=pytest.mark.skipif(LEVEL < 2, reason="this CPU has no AVX-512, so only the AVX2 variant runs")
    ),
]
ROWS = [1, 2, 3, 4, 5, 8, 9, 17, 64, 300]


def _close(y, twin):
    rms = twin.pow(2).mean().sqrt().item()
    torch.testing.assert_close(y, twin, rtol=1e-4, atol=1e-4 * rms)


# (k, n, group): groups of 8 .. 128 and per channel; groups that straddle the 256-k blocks of the
# many-rows schedule (96); K below one block (64, 96); N with a partial tile or panel.
SHAPES = [(576, 961, 64), (256, 37, 32), (1536, 77, 128), (320, 19, None), (576, 50, 96), (64, 16, 8), (96, 40, 32)]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("k, n, group_size", SHAPES)
@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
def test_int4_matches_twin(isa, m, k, n, group_size, symmetric):
    w_packed, scale, zero, _ = quantized(n, k, group_size, symmetric, seed=m)
    weight, why = cpu_int4_avx.repack(w_packed, scale, zero, group_size, isa=isa)
    assert weight is not None and weight.isa == isa, why
    x = torch.randn(m, k)
    y = cpu_int4_avx.gemm(x, weight)
    assert y.dtype == torch.float32 and y.shape == (m, n)
    _close(y, reference.int4_gemm(x, w_packed, scale.float(), zero, group_size))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("m", [1, 5, 9, 64])
def test_int4_act_order(isa, m):
    k, g = 512, 128
    order = torch.randperm(k, generator=torch.Generator().manual_seed(2))
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[order] = (torch.arange(k) // g).to(torch.int32)  # GPTQ act-order: groups permuted
    w_packed, scale, zero, _ = quantized(45, k, g, False, g_idx)
    weight, why = cpu_int4_avx.repack(w_packed, scale, zero, g, g_idx, isa=isa)
    assert weight is not None and weight.perm is not None, why
    x = torch.randn(m, k)
    _close(cpu_int4_avx.gemm(x, weight), reference.int4_gemm(x, w_packed, scale.float(), zero, g, g_idx))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_int4_other_activations_and_leading_dims(dtype):
    w_packed, scale, zero, _ = quantized(40, 256, 64, False)
    weight, _ = cpu_int4_avx.repack(w_packed, scale, zero, 64)
    x = torch.randn(2, 3, 256).to(dtype)
    y = cpu_int4_avx.gemm(x, weight)
    assert y.dtype == dtype and y.shape == (2, 3, 40)
    twin = reference.int4_gemm(x.float(), w_packed, scale.float(), zero, 64).to(dtype)
    torch.testing.assert_close(y, twin)  # computed in fp32, rounded once to x's dtype


def test_repack_says_why_it_cannot():
    w_packed, scale, zero, _ = quantized(16, 48, 12, False)  # groups of 12: not a multiple of 8
    weight, why = cpu_int4_avx.repack(w_packed, scale, zero, 12)
    assert weight is None and "multiple of 8" in why and why.count(". ") == 0
    k, g = 256, 64
    w_packed, scale, zero, _ = quantized(16, k, g, True)
    g_idx = torch.zeros(k, dtype=torch.int32)  # one group of 256 where the group size says 64
    weight, why = cpu_int4_avx.repack(w_packed, scale, zero, g, g_idx)
    assert weight is None and why == "its act-order groups are not contiguous once sorted"
    with pytest.raises(QuantkitError, match="avx3"):
        cpu_int4_avx.repack(w_packed, scale, zero, g, isa="avx3")


def test_layout():
    """Tile 0, group 0, word row 0 holds the on-disk words of channels 0..15; then s and zs."""
    w_packed, scale, zero, _ = quantized(20, 128, 64, False)
    weight, _ = cpu_int4_avx.repack(w_packed, scale, zero, 64)
    assert weight.words.shape == (2, 2, 10, 16) and weight.words.dtype == torch.int32
    assert torch.equal(weight.words[0, 1, :8].t(), w_packed[:16, 8:16])
    s = weight.words[1, 0, 8].view(torch.float32)
    assert torch.equal(s[:4], scale[16:, 0].float()) and torch.equal(s[4:], torch.zeros(12))
    zs = weight.words[0, 1, 9].view(torch.float32)
    assert torch.equal(zs, -(8 + zero[:16, 1].float()) * scale[:16, 1].float())


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("k, n", [(576, 961), (64, 40), (1536, 19)])
def test_int8_matches_twin(isa, m, k, n):
    torch.manual_seed(m)
    q = torch.randint(-128, 128, (n, k), dtype=torch.int8)
    s = (torch.rand(n, 1) * 0.01 + 1e-3).to(torch.bfloat16)
    weight, why = cpu_int4_avx.repack_int8(q, s, isa=isa)
    assert weight is not None and weight.isa == isa, why
    x = torch.randn(m, k)
    y = cpu_int4_avx.gemm_int8(x, weight)
    assert y.dtype == torch.float32 and y.shape == (m, n)
    _close(y, x @ (q.float() * s.float()).t())
