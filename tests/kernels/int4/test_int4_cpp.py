"""The C++ AMX int4 kernel (`quantkit.kernels.int4.cpp`) and its int4pack fallback against the
torch twin.

Tolerances. The kernel's bf16 weights are the twin's dequantized weights rounded to bf16, bit for
bit (bf16 scales make the fma exact), so against x_bf16 · W_bf16ᵀ computed in fp32 the only
differences are the order of the fp32 sums and the bf16 output: rtol = 2^-7 (one bf16 ulp) with
atol = 2^-10 · rms. Torch's int4pack (the fallback) rounds its zero term -z·s to bf16 as well, so
there atol = 2^-7 · rms, as in test_int4pack.py. Against the fp32 twin (weights not rounded) we
ask for a relative RMS error ≤ 1e-2 (measured ~2e-3, which is bf16's rounding of the weights).
The AMX tests skip where the kernel cannot run (no AMX-BF16, no compiler, QUANTKIT_NO_EXT=1); the
fallback tests run anywhere.
"""

from __future__ import annotations

import pytest
import torch
from int4_cases import quantized

from quantkit.errors import QuantkitError
from quantkit.kernels.int4 import cpp as cpu_int4
from quantkit.kernels.int4 import twin as int4_twin
from quantkit.packing import unpack
from quantkit.primitives import dequantize

amx = pytest.mark.skipif(not cpu_int4.available(), reason=f"no AMX int4 kernel: {cpu_int4.reason()}")


def _check(y, x, w_packed, scale, zero, args, group_size, g_idx=None, atol_rms=2**-10):
    k = x.shape[-1]
    assert y.dtype == x.dtype and y.shape == (*x.shape[:-1], w_packed.shape[0])
    twin = int4_twin.int4_gemm(x.float(), w_packed, scale.float(), zero, group_size, g_idx)
    rel = ((y.float() - twin).pow(2).mean() / twin.pow(2).mean()).sqrt().item()
    assert rel <= 1e-2, rel
    w_bf16 = dequantize(unpack(w_packed, k), scale, zero, args, g_idx).to(torch.bfloat16)
    exact = x.to(torch.bfloat16).float() @ w_bf16.float().t()
    rms = exact.pow(2).mean().sqrt().item()
    torch.testing.assert_close(y.float(), exact, rtol=2**-7, atol=atol_rms * rms)


# (m, k, n, group): M through each schedule (up to 16 and 32 rows, then up to 64: weight tiles
# in L1; more: the weight in VNNI tiles, several weight blocks (1000 channels at K = 576), k
# blocks (K = 576, 960, 1536), a last pair of rows that is one full tile (80), or a partial one
# copied (100, 300, 2047)), N not a multiple of 16 or 32, K not a multiple of 128.
CASES = [
    (1, 576, 960, 64),
    (3, 1536, 576, 128),
    (16, 960, 576, 32),
    (17, 576, 1536, 64),
    (33, 576, 40, 32),
    (64, 1536, 48, 128),
    (80, 2048, 64, 128),
    (100, 960, 200, None),
    (300, 576, 1000, 64),
    (2047, 1536, 48, 64),
    (2048, 576, 24, 32),
]


@amx
@pytest.mark.parametrize("m, k, n, group_size", CASES)
@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
def test_amx_matches_twin(m, k, n, group_size, symmetric):
    w_packed, scale, zero, args = quantized(n, k, group_size, symmetric)
    weight, why = cpu_int4.repack(w_packed, scale, zero, group_size)
    assert weight.kernel == "amx", why
    x = torch.randn(m, k, dtype=torch.bfloat16)
    _check(cpu_int4.gemm(x, weight), x, w_packed, scale, zero, args, group_size)


# Few rows (M <= cpu_int4.GEMV_ROWS: the AVX512-BF16 dot-product schedule, then AMX): every M up
# to 8 through each group size, per channel, odd N (a partial last tile of 16 channels).
@amx
@pytest.mark.parametrize("m", range(1, 9))
@pytest.mark.parametrize("k, n, group_size", [(576, 961, 64), (1536, 77, 128), (256, 33, 32), (320, 19, None)])
@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
def test_few_rows_match_twin(m, k, n, group_size, symmetric):
    w_packed, scale, zero, args = quantized(n, k, group_size, symmetric, seed=m)
    weight, why = cpu_int4.repack(w_packed, scale, zero, group_size)
    assert weight.kernel == "amx", why
    x = torch.randn(m, k, dtype=torch.bfloat16)
    _check(cpu_int4.gemm(x, weight), x, w_packed, scale, zero, args, group_size)


@amx
@pytest.mark.parametrize("m", [1, 3, 8])
def test_few_rows_act_order(m):
    k, g = 512, 128
    order = torch.randperm(k, generator=torch.Generator().manual_seed(2))
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[order] = (torch.arange(k) // g).to(torch.int32)
    w_packed, scale, zero, args = quantized(45, k, g, False, g_idx)
    weight, _ = cpu_int4.repack(w_packed, scale, zero, g, g_idx)
    assert weight.kernel == "amx" and weight.perm is not None
    x = torch.randn(m, k, dtype=torch.bfloat16)
    _check(cpu_int4.gemm(x, weight), x, w_packed, scale, zero, args, g, g_idx)


@amx
def test_amx_fp32_activations_leading_dims_and_act_order():
    k, g = 256, 64
    order = torch.randperm(k, generator=torch.Generator().manual_seed(1))
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[order] = (torch.arange(k) // g).to(torch.int32)  # GPTQ "group" act-order
    w_packed, scale, zero, args = quantized(64, k, g, False, g_idx)
    weight, _ = cpu_int4.repack(w_packed, scale, zero, g, g_idx)
    assert weight.kernel == "amx" and weight.perm is not None
    x = torch.randn(2, 3, k)  # fp32, computed in bf16
    _check(cpu_int4.gemm(x, weight), x, w_packed, scale, zero, args, g, g_idx)


@amx
@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
def test_amx_dequantize_equals_the_twin_bit_for_bit(symmetric):
    w_packed, scale, zero, args = quantized(40, 576, 64, symmetric)
    w = cpu_int4.repack(w_packed, scale, zero, 64)[0]
    dense = cpu_int4._load().dequantize(w.nibbles, w.scales, w.zs, w.out_features, w.group_size)
    assert torch.equal(dense, dequantize(unpack(w_packed, 576), scale, zero, args).to(torch.bfloat16))


@pytest.mark.parametrize("m", [1, 7, cpu_int4.DENSE_MIN_M])  # int4pack, then dequantize + fp32 matmul
@pytest.mark.parametrize("forced", ["argument", "env"])
def test_fallback_when_amx_is_absent(m, forced, monkeypatch):
    w_packed, scale, zero, args = quantized(48, 576, 64, False)
    if forced == "env":
        monkeypatch.setenv("QUANTKIT_INT4_KERNEL", "int4pack")
        weight, why = cpu_int4.repack(w_packed, scale, zero, 64)
    else:
        weight, why = cpu_int4.repack(w_packed, scale, zero, 64, kernel="int4pack")
    assert weight.kernel == "int4pack" and "forced" in why
    x = torch.randn(m, 576, dtype=torch.bfloat16)
    _check(cpu_int4.gemm(x, weight), x, w_packed, scale, zero, args, 64, atol_rms=2**-7)


def test_shapes_neither_kernel_takes_and_forcing_amx_on_them():
    w_packed, scale, zero, _ = quantized(40, 200, None, True)  # K % 32 != 0, N % 16 != 0
    weight, why = cpu_int4.repack(w_packed, scale, zero, None)
    assert weight is None and "use the torch twin" in why
    with pytest.raises(QuantkitError, match="AMX int4 kernel"):
        cpu_int4.repack(w_packed, scale, zero, None, kernel="amx")
    with pytest.raises(QuantkitError, match="unknown"):
        cpu_int4.repack(w_packed, scale, zero, None, kernel="gemv")
    assert "multiple of 32" in cpu_int4.shape_reason(64, 256, 16)


def test_no_ext_disables_the_kernel(monkeypatch):
    monkeypatch.setenv("QUANTKIT_NO_EXT", "1")
    assert not cpu_int4.available() and "QUANTKIT_NO_EXT" in cpu_int4.reason()


def test_nibble_layout():
    u = torch.randint(0, 16, (8, 64), dtype=torch.int32)
    words = cpu_int4._nibbles(u).to(torch.int32) & 0xFFFF  # [2, 64]
    for i in range(4):
        assert torch.equal((words >> (4 * i)) & 0xF, u[i::4])
