"""torch's CPU int4pack / int8pack paths against the torch twin.

Tolerances. The reference is the twin computed in fp32 on the same bf16-rounded inputs
(x and scales in bf16), so what is left is the kernel's own rounding: its bf16 output
(half an ulp, 2^-9 relative) and, asymmetric, the zero term -z·s rounded to bf16 (at most
2^-9 · 8 · s per weight). We allow rtol = 2^-7 (two bf16 ulps) plus atol = 2^-7 · rms(ref),
and ask for SQNR >= 50 dB (measured ~55). With fp32 scales, which the repack rounds to bf16,
torch's bf16 tolerance: rtol = atol/rms(ref) = 1.6e-2, SQNR >= 45 dB (measured ~52).
"""

from __future__ import annotations

import pytest
import torch
from int4_cases import quantized

from quantkit.errors import QuantkitError
from quantkit.kernels.int4 import twin as int4_twin
from quantkit.kernels.int4.int4pack import int4_gemm_cpu, repack_int4_cpu, supports
from quantkit.kernels.int8.int8pack import int8_gemm_cpu, repack_int8_cpu, supports_int8
from quantkit.packing import pack
from quantkit.primitives import compute_qparams, quantize
from quantkit.primitives import sqnr as sqnr_db
from quantkit.scheme import QuantArgs

BF16_TIGHT = dict(rtol=2**-7, rms_atol=2**-7, sqnr=50.0)
BF16_LOOSE = dict(rtol=1.6e-2, rms_atol=1.6e-2, sqnr=45.0)


def _check(y, ref, rtol, rms_atol, sqnr):
    assert y.dtype == torch.bfloat16 and y.shape == ref.shape
    rms = ref.pow(2).mean().sqrt().item()
    torch.testing.assert_close(y.float(), ref, rtol=rtol, atol=rms_atol * rms)
    assert sqnr_db(ref, y.float()) >= sqnr


def test_torch_int4pack_convention():
    """w = (u - 8) * S[k // G, n, 0] + S[k // G, n, 1], u the unsigned nibble."""
    torch.manual_seed(0)
    n, k, g = 32, 128, 64
    u = torch.randint(0, 16, (n, k), dtype=torch.int32)
    sz = torch.stack([torch.rand(k // g, n) + 0.5, torch.randn(k // g, n)], dim=-1).to(torch.bfloat16)
    x = torch.randn(3, k, dtype=torch.bfloat16)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(u, 1)
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, g, sz)
    cols = torch.arange(k) // g
    w = (u.float() - 8) * sz[..., 0].float().t()[:, cols] + sz[..., 1].float().t()[:, cols]
    _check(y, x.float() @ w.t(), **BF16_TIGHT)


@pytest.mark.parametrize("m", [1, 7, 64])
@pytest.mark.parametrize("k, group_size", [(256, 32), (256, 64), (256, 128), (576, 64), (576, 32)])
@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
def test_int4_matches_twin(m, k, group_size, symmetric):
    w_packed, scale, zero, _ = quantized(k, k, group_size, symmetric)
    x = torch.randn(m, k, dtype=torch.bfloat16)
    y = int4_gemm_cpu(x, repack_int4_cpu(w_packed, scale, zero, group_size))
    ref = int4_twin.int4_gemm(x.float(), w_packed, scale.float(), zero, group_size)
    _check(y, ref, **BF16_TIGHT)


@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
def test_int4_per_channel_runs_as_groups(symmetric):
    w_packed, scale, zero, _ = quantized(64, 576, None, symmetric)  # scale [64, 1]
    x = torch.randn(7, 576, dtype=torch.bfloat16)
    weight = repack_int4_cpu(w_packed, scale, zero, None)
    assert weight.group_size == 64 and weight.scales_and_zeros.shape == (9, 64, 2)
    _check(int4_gemm_cpu(x, weight), int4_twin.int4_gemm(x.float(), w_packed, scale.float(), zero, None), **BF16_TIGHT)


def test_int4_fp32_scales_and_fp32_activations():
    w_packed, scale, zero, _ = quantized(128, 256, 64, False, scale_dtype=torch.float32)
    x = torch.randn(2, 3, 256)  # fp32, leading dims
    y = int4_gemm_cpu(x, repack_int4_cpu(w_packed, scale, zero, 64))
    assert y.dtype == torch.float32 and y.shape == (2, 3, 128)
    ref = int4_twin.int4_gemm(x.to(torch.bfloat16).float(), w_packed, scale, zero, 64)
    _check(y.to(torch.bfloat16), ref, **BF16_LOOSE)


@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
def test_int4_act_order(symmetric):
    k, g = 256, 64
    torch.manual_seed(1)
    order = torch.randperm(k)
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[order] = (torch.arange(k) // g).to(torch.int32)  # GPTQ "group" act-order
    args = QuantArgs(num_bits=4, symmetric=symmetric, group_size=g)
    w = torch.randn(64, k)
    scale, zero = compute_qparams(w[:, order], args, torch.bfloat16)  # groups in visiting order
    w_packed = pack(quantize(w, scale, zero, args, g_idx))
    assert supports(64, k, g, g_idx)
    weight = repack_int4_cpu(w_packed, scale, zero, g, g_idx)
    x = torch.randn(5, k, dtype=torch.bfloat16)
    _check(
        int4_gemm_cpu(x, weight), int4_twin.int4_gemm(x.float(), w_packed, scale.float(), zero, g, g_idx), **BF16_TIGHT
    )


@pytest.mark.parametrize(
    "n, k, group_size, ok",
    [
        (64, 256, 32, True),
        (64, 256, 256, True),
        (48, 256, 64, True),
        (16, 32, 32, True),
        (64, 576, 64, True),
        (64, 576, None, True),  # per channel: groups of 64
        (40, 256, 64, False),  # out % 16 != 0
        (64, 576, 128, False),
        (64, 128, 256, False),  # group does not divide in
        (64, 256, 16, False),
        (64, 512, 512, False),  # group not in 32/64/128/256
        (64, 200, None, False),  # per channel, no group divides 200
    ],
)
def test_supports(n, k, group_size, ok):
    assert supports(n, k, group_size) is ok


def test_rejected_shapes_raise_and_uneven_act_order_is_rejected():
    k, g = 256, 64
    interleaved = (torch.arange(k) % (k // g)).to(torch.int32)  # 4 groups of 64: sorts into place
    uneven = interleaved.clone()
    uneven[0] = 1  # group 0 has 63 columns, group 1 65: fine for the twin, not for the kernel
    assert supports(64, k, g, interleaved) and not supports(64, k, g, uneven)
    w_packed, scale, zero, _ = quantized(64, k, g, True)
    with pytest.raises(QuantkitError, match="CPU int4 kernel"):
        repack_int4_cpu(w_packed, scale, zero, g, uneven)
    w_packed, scale, zero, _ = quantized(40, k, g, True)
    with pytest.raises(QuantkitError, match="out % 16"):
        repack_int4_cpu(w_packed, scale, zero, g)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_int8_matches_dequantized_matmul(dtype):
    torch.manual_seed(0)
    w = torch.randint(-127, 128, (96, 256), dtype=torch.int8)
    s = (torch.rand(96, 1) + 0.5) / 127
    x = torch.randn(2, 5, 256, dtype=dtype)
    y = int8_gemm_cpu(x, repack_int8_cpu(w, s))
    assert y.dtype == dtype and y.shape == (2, 5, 96)
    ref = x.float() @ (w.float() * s.to(dtype).float()).t()
    _check(y.to(torch.bfloat16), ref, **BF16_TIGHT)


def test_int8_supports():
    assert supports_int8(40, 256) and supports_int8(64, 48)
    assert not supports_int8(64, 100) and not supports_int8(64, 8)  # K % 16 != 0 crashes torch
    with pytest.raises(QuantkitError, match="K % 16"):
        repack_int8_cpu(torch.zeros(64, 100, dtype=torch.int8), torch.ones(64))
