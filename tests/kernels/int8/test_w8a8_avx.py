"""The AVX2 / AVX-512 VNNI W8A8 kernel (`quantkit.kernels.int8.avx`) against the twin
(`kernels/int8/twin.py`: x fake-quantized per token, an fp32 matmul with the dequantized weight).

Tolerance. Both ISAs sum the int8 x int8 products exactly in int32 (AVX2: `vpmaddwd` on int16,
no saturation; AVX-512: `vpdpbusd` on u = q + 128 with 128 sum w taken back per channel), so:

- where the math is exact (per-token scale 1: rows whose max |x| is 127.5, integer x; weight
  scale 1; |sums| < 2^24), y equals the int64 product q_x · q_wᵀ exactly (`torch.equal`),
  including the extreme operands -128 x -128 and 127 x -128;
- against the fp32 twin only the fp32 rounding of the twin's own sums and of the two scale
  products differ: rtol 1e-5, atol 1e-5 · max |y| (as tests/kernels/int8/test_int8_gemm.py).

Every M crosses the micro-kernel's row blocks (6 on AVX2, 8 on AVX-512: partial last blocks, the
single-block GEMV schedule at M <= 8); N and K are never multiples of the tile (16 / 32 channels)
or the k-word (2 / 4). The AVX-512 variant is skipped where the CPU lacks AVX-512 VNNI;
everything is skipped where the extension cannot be built.
"""

from __future__ import annotations

import pytest
import torch

from quantkit.errors import QuantkitError
from quantkit.kernels import cpu_ext
from quantkit.kernels.choice import Problem, choose
from quantkit.kernels.int8 import W8A8, onednn
from quantkit.kernels.int8 import avx as w8a8_avx
from quantkit.kernels.int8 import twin as int8_twin
from quantkit.kernels.int8.int_mm import quantize_per_token

LEVEL = w8a8_avx.isa_level()
pytestmark = pytest.mark.skipif(LEVEL == 0, reason=f"no AVX W8A8 kernel: {w8a8_avx.EXTENSION.reason()}")
ISAS = [
    "avx2",
    pytest.param("avx512", marks=pytest.mark.skipif(LEVEL < 2, reason="this CPU has no AVX-512 VNNI")),
]
ROWS = [1, 3, 6, 7, 8, 9, 17, 64, 130]
SHAPES = [(96, 40), (101, 33), (3, 17), (576, 70), (1536, 37)]  # (k, n)


def make(n: int, k: int, seed: int, per_tensor: bool = False):
    gen = torch.Generator().manual_seed(seed)
    w_int8 = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen)
    w_int8[0, :] = -128  # the extreme weight, against the extreme activations below
    scale = torch.rand(1 if per_tensor else n, 1, generator=gen) * 0.01 + 1e-3
    return w_int8, scale.reshape(1) if per_tensor else scale


def make_x(m: int, k: int, seed: int) -> torch.Tensor:
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed))
    x[:, 0] *= 30  # an outlier channel, as LLM activations have
    if m > 2:
        x[1] = 0  # an all-zero token (scale 1, q = 0)
        x[2] = -x[2].abs()  # a row whose max |x| is negative: q reaches -128
    return x


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("k, n", SHAPES)
def test_matches_the_twin(isa, m, k, n):
    w_int8, scale = make(n, k, seed=m)
    weight, why = w8a8_avx.repack(w_int8, scale, isa=isa)
    assert weight is not None and weight.isa == isa, why
    x = make_x(m, k, seed=k + m)
    y = w8a8_avx.gemm(x, weight)
    ref = int8_twin.int8_gemm(x, w_int8, scale)
    assert y.dtype == torch.float32 and y.shape == (m, n)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("m, k, n", [(1, 7, 5), (9, 101, 33), (20, 1023, 70)])
def test_int32_sums_are_exact(isa, m, k, n):
    w_int8, _ = make(n, k, seed=k)
    x = torch.randint(-127, 128, (m, k), generator=torch.Generator().manual_seed(m)).float()
    x[:, -1] = 127.5  # max |x| 127.5: scale exactly 1, q = x (127.5 -> 127 by the clamp)
    x[0, :-1] = -127.5  # q = -128 (half to even), times w = -128 in row 0 of the weight
    weight, why = w8a8_avx.repack(w_int8, torch.ones(n), isa=isa)
    assert weight is not None, why
    q, s = quantize_per_token(x)
    assert torch.equal(s, torch.ones(m, 1)) and int(q.min()) == -128
    exact = (q.long() @ w_int8.long().t()).float()  # |sums| <= 1023 * 2^14 < 2^24: exact in fp32
    assert torch.equal(w8a8_avx.gemm(x, weight), exact)


@pytest.mark.parametrize("isa", ISAS)
def test_per_tensor_scale_other_dtypes_and_leading_shapes(isa):
    w_int8, scale = make(24, 40, seed=3, per_tensor=True)
    weight, why = w8a8_avx.repack(w_int8, scale, isa=isa)
    assert weight is not None, why
    x = make_x(6, 40, seed=5).reshape(2, 3, 40)
    ref = int8_twin.int8_gemm(x, w_int8, scale)
    y = w8a8_avx.gemm(x, weight)
    assert y.shape == (2, 3, 24)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    yb = w8a8_avx.gemm(x.bfloat16(), weight)
    assert yb.dtype == torch.bfloat16
    rb = int8_twin.int8_gemm(x.bfloat16().float(), w_int8, scale)
    torch.testing.assert_close(yb.float(), rb, rtol=1e-2, atol=1e-2 * rb.abs().max().item())  # bf16 output
    assert w8a8_avx.gemm(torch.empty(0, 40), weight).shape == (0, 24)


def test_user_mistakes_raise_one_sentence():
    w_int8, scale = make(24, 40, seed=0)
    weight, _ = w8a8_avx.repack(w_int8, scale, isa="avx2")
    with pytest.raises(QuantkitError, match="x has 41 features, the weight takes 40"):
        w8a8_avx.gemm(torch.randn(2, 41), weight)
    with pytest.raises(QuantkitError, match="'sse' is unknown; use avx2 or avx512"):
        w8a8_avx.repack(w_int8, scale, isa="sse")
    assert w8a8_avx.repack(w_int8.float(), scale)[0] is None
    assert "N or 1 scales" in w8a8_avx.repack(w_int8, scale[:3])[1]


def test_without_the_extension_it_says_why(monkeypatch):
    monkeypatch.setenv("QUANTKIT_NO_EXT", "1")
    w_int8, scale = make(24, 40, seed=0)
    assert w8a8_avx.repack(w_int8, scale) == (None, "disabled by QUANTKIT_NO_EXT=1")


@pytest.mark.parametrize("amx, forced", [(True, False), (True, True), (False, False)])
def test_the_chooser_takes_it_for_fp32_without_amx_or_when_forced(monkeypatch, amx, forced):
    monkeypatch.setattr(w8a8_avx, "has_amx_int8", lambda: amx)
    monkeypatch.setattr(cpu_ext, "ISA_ENV", "avx2" if forced else "")
    monkeypatch.setattr(onednn, "saturates", lambda: False)
    w_int8, scale = make(40, 96, seed=0)
    choice = choose("W8A8 int8 GEMM", W8A8, Problem("cpu", torch.float32, weight=w_int8, scales=scale))
    onednn_name, ours = W8A8[1].name, W8A8[2].name
    if amx and not forced:
        assert (choice.name, choice.why) == (onednn_name, None)
    else:
        assert choice.name == ours and "the AVX W8A8 kernel is faster" in choice.why
        x = make_x(5, 96, seed=1)
        ref = int8_twin.int8_gemm(x, w_int8, scale)
        torch.testing.assert_close(choice.fn(x), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    bf16 = choose("W8A8 int8 GEMM", W8A8, Problem("cpu", torch.bfloat16, weight=w_int8, scales=scale))
    assert (bf16.name, bf16.why) == (onednn_name, None)  # bf16 activations: oneDNN where its sums are exact


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_where_onednn_saturates_the_chooser_takes_it_for_every_dtype(monkeypatch, dtype):
    monkeypatch.setattr(w8a8_avx, "has_amx_int8", lambda: False)
    monkeypatch.setattr(onednn, "saturates", lambda: True)
    w_int8, scale = make(40, 96, seed=0)
    choice = choose("W8A8 int8 GEMM", W8A8, Problem("cpu", dtype, weight=w_int8, scales=scale))
    assert choice.name == W8A8[2].name
    if dtype == torch.bfloat16:
        assert "saturate in int16: its sums are not exact" in choice.why
    x = make_x(5, 96, seed=1).to(dtype)
    y = choice.fn(x)
    ref = int8_twin.int8_gemm(x.float(), w_int8, scale)
    assert y.dtype == dtype  # bf16: the fp32 result rounded once
    rtol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(y.float(), ref, rtol=rtol, atol=1e-5 * ref.abs().max().item())
