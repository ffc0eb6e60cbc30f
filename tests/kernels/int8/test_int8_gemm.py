"""The W8A8 int8 GEMMs against the torch twin `int8_twin.int8_gemm` (Q(x) · dequant(W)ᵀ in fp32).

`quantize_per_token` must give the primitives' int8 values and scales exactly: it is the
same division and round-half-to-even. Both fast paths multiply the same int8 operands, so
their int32 sums are exact; what differs from the twin is where the scales are applied and
the output rounding:

| path | x dtype | tolerance against the twin (fp32) |
|---|---|---|
| `int8_gemm` (`torch._int_mm`) | float32 | assert_close rtol 1e-5, atol 1e-5 · max abs(y): the twin's fp32 sums round |
| oneDNN (`w8a8_gemm_cpu`) | float32 | same |
| oneDNN (`w8a8_gemm_cpu`) | bfloat16 | SQNR ≥ 40 dB (oneDNN rounds its output to bf16, and again after the row scale) |
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from quantkit import ops
from quantkit.errors import QuantkitError
from quantkit.kernels import cpu_ext
from quantkit.kernels.int8 import onednn
from quantkit.kernels.int8 import twin as int8_twin
from quantkit.kernels.int8.int_mm import cpu_exact, int8_gemm, quantize_per_token, unsupported
from quantkit.primitives import compute_qparams, fake_quantize, quantize, sqnr
from quantkit.scheme import QuantArgs

N, K = 40, 96  # not multiples of any tile
MS = [1, 3, 16, 17, 64, 255]  # 1 (decode) and rows that are not multiples of 8
TOKEN = int8_twin.INT8_TOKEN


def make_weight(strategy: str = "channel", n: int = N, k: int = K, seed: int = 0):
    """(w_int8 [n, k], w_scale [n, 1] per channel or [1] per tensor), as a checkpoint holds them."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * (1 + 3 * torch.rand(n, 1, generator=gen))
    args = QuantArgs(num_bits=8, type="int", strategy=strategy, group_size=None)
    scale, _ = compute_qparams(w, args)
    return quantize(w, scale, None, args), scale


def close(actual: torch.Tensor, ref: torch.Tensor) -> None:
    """fp32 against the twin: the twin's fp32 sums round, the int32 ones do not (see the table)."""
    torch.testing.assert_close(actual, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


def make_x(shape, seed: int = 1) -> torch.Tensor:
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    x[..., 3] *= 20  # an outlier channel, as LLM activations have
    return x


def test_quantize_per_token_is_the_primitives():
    x = make_x((37, K))
    x[5] = 0  # an all-zero token
    q, s = quantize_per_token(x)
    ps, _ = compute_qparams(x, TOKEN)
    assert torch.equal(q, quantize(x, ps, None, TOKEN)) and q.dtype == torch.int8
    assert torch.equal(s[torch.arange(37) != 5], ps[torch.arange(37) != 5])
    assert not q[5].any()
    assert torch.equal(x, make_x((37, K)).index_fill_(0, torch.tensor([5]), 0))  # x itself is left alone


@pytest.mark.parametrize("strategy", ["channel", "tensor"])
def test_twin_is_fake_quantized_matmul(strategy):
    w_int8, w_scale = make_weight(strategy)
    x = make_x((5, K))
    args = QuantArgs(num_bits=8, type="int", strategy=strategy, group_size=None)
    from quantkit.primitives import dequantize

    expected = fake_quantize(x, TOKEN) @ dequantize(w_int8, w_scale, None, args).t()
    torch.testing.assert_close(int8_twin.int8_gemm(x, w_int8, w_scale), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.skipif(unsupported(N, K, "cpu") is not None, reason="torch._int_mm is not exact on this CPU")
@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("strategy", ["channel", "tensor"])
def test_int_mm_path_matches_the_twin(m, strategy):
    w_int8, w_scale = make_weight(strategy)
    x = make_x((m, K))
    close(int8_gemm(x, w_int8, w_scale), int8_twin.int8_gemm(x, w_int8, w_scale))


@pytest.mark.skipif(onednn.w8a8_unsupported(N, K) is not None, reason="no oneDNN int8 linear in this torch")
@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("strategy", ["channel", "tensor"])
def test_onednn_path_matches_the_twin(m, strategy):
    w_int8, w_scale = make_weight(strategy)
    weight = onednn.prepack_w8a8(w_int8, w_scale)
    x = make_x((m, K))
    ref = int8_twin.int8_gemm(x, w_int8, w_scale)
    close(onednn.w8a8_gemm_cpu(x, weight), ref)
    y = onednn.w8a8_gemm_cpu(x.bfloat16(), weight)
    assert y.dtype == torch.bfloat16 and y.shape == (m, N)
    assert sqnr(int8_twin.int8_gemm(x.bfloat16().float(), w_int8, w_scale), y.float()) > 40


@pytest.mark.skipif(onednn.w8a8_unsupported(N, K) is not None, reason="no oneDNN int8 linear in this torch")
def test_onednn_path_takes_any_leading_shape_and_other_widths():
    w_int8, w_scale = make_weight(n=24, k=40)  # K not a multiple of 16
    weight = onednn.prepack_w8a8(w_int8, w_scale)
    x = make_x((2, 3, 40))
    y = onednn.w8a8_gemm_cpu(x, weight)
    assert y.shape == (2, 3, 24)
    close(y, int8_twin.int8_gemm(x, w_int8, w_scale))
    with pytest.raises(QuantkitError, match="x has 41 features, the weight takes 40"):
        onednn.w8a8_gemm_cpu(torch.randn(2, 41), weight)


def test_dispatcher_backends():
    w_int8, w_scale = make_weight()
    x = make_x((7, K))
    ref = int8_twin.int8_gemm(x, w_int8, w_scale)
    assert torch.equal(ops.int8_gemm(x, w_int8, w_scale), ref)  # auto on the CPU: the twin
    assert torch.equal(ops.int8_gemm(x, w_int8, w_scale, backend="torch"), ref)
    close(ops.int8_gemm(x, w_int8, w_scale, backend="triton"), ref)
    with pytest.raises(QuantkitError, match="backend 'cuda' is unknown"):
        ops.int8_gemm(x, w_int8, w_scale, backend="cuda")


def test_launcher_refuses_bad_inputs_in_one_sentence():
    w_int8, w_scale = make_weight()
    with pytest.raises(QuantkitError, match=r"int8_gemm takes x \[..., 96\]"):
        int8_gemm(torch.randn(3, 95), w_int8, w_scale)
    with pytest.raises(QuantkitError, match="int8 \\[N, K\\] weight"):
        int8_gemm(torch.randn(3, K), w_int8.float(), w_scale)
    assert "multiples of 8" in unsupported(41, 96, "cuda")
    assert unsupported(41, 96, "cpu") is None if cpu_exact() else "saturate in int16" in unsupported(41, 96, "cpu")


def _ext():
    from quantkit.kernels.int8 import cpp as cpu_w8a8

    ops_ = cpu_w8a8.load()
    if ops_ is None:
        pytest.skip(f"the W8A8 C++ kernels are unavailable: {cpu_w8a8.reason()}")
    return ops_


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m, k", [(1, 576), (5, 40), (33, 1536)])
def test_cpp_quantization_is_the_torch_one_bit_for_bit(dtype, m, k):
    ext = _ext()
    x = make_x((m, k)).to(dtype)
    x[m // 2] = 0  # an all-zero token: scale 1 there (the torch path's is tiny), zeros either way
    q, s = ext.quantize_per_token(x)
    tq, ts = quantize_per_token(x)
    keep = torch.arange(m) != m // 2
    assert torch.equal(q, tq) and torch.equal(s[keep], ts[keep]) and not q[m // 2].any()


def test_cpp_row_scaling_rounds_like_torch():
    ext = _ext()
    y = (torch.randn(7, 45) * 100).bfloat16()
    s = torch.rand(7, 1) * 3
    expected = (y.float() * s).bfloat16()
    ext.scale_rows_(y, s)
    assert torch.equal(y, expected)


@pytest.mark.skipif(onednn.w8a8_unsupported(N, K) is not None, reason="no exact oneDNN int8 linear here")
@pytest.mark.parametrize("m", MS)
def test_onednn_path_with_and_without_the_cpp_passes(m):
    _ext()
    w_int8, w_scale = make_weight()
    fused, plain = onednn.prepack_w8a8(w_int8, w_scale), onednn.prepack_w8a8(w_int8, w_scale, elementwise=False)
    assert fused.elementwise is not None and plain.elementwise is None
    x = make_x((m, K))
    assert torch.equal(onednn.w8a8_gemm_cpu(x, fused), onednn.w8a8_gemm_cpu(x, plain))  # fp32: identical
    ref = int8_twin.int8_gemm(x.bfloat16().float(), w_int8, w_scale)
    assert sqnr(ref, onednn.w8a8_gemm_cpu(x.bfloat16(), fused).float()) > 40


SATURATES = "from quantkit.kernels.int8 import int_mm, onednn; print(onednn.saturates(), int_mm.cpu_exact())"
EXACT_ISAS = {"avx512bw", "avx512_vnni", "avx_vnni", "amx_int8"}  # oneDNN sums exactly with any of them


@pytest.mark.skipif(onednn.w8a8_unsupported(N, K, inexact_ok=True) is not None, reason="no oneDNN int8 linear")
@pytest.mark.skipif("avx2" not in cpu_ext._cpu_flags().split(), reason="not an AVX2 CPU")
def test_onednn_saturates_on_avx2_and_is_exact_beyond():
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2"}  # what an AVX2-only CPU runs
    capped = subprocess.run([sys.executable, "-c", SATURATES], env=env, capture_output=True, text=True, check=True)
    assert capped.stdout.split()[-2:] == ["True", "False"]  # oneDNN's qlinear and torch._int_mm alike
    if EXACT_ISAS & set(cpu_ext._cpu_flags().split()) and "ONEDNN_MAX_CPU_ISA" not in os.environ:
        assert not onednn.saturates() and cpu_exact()


@pytest.mark.skipif(onednn.w8a8_unsupported(N, K, inexact_ok=True) is not None, reason="no oneDNN int8 linear")
def test_where_onednn_saturates_it_refuses_in_one_sentence(monkeypatch):
    monkeypatch.setattr(onednn, "saturates", lambda: True)
    w_int8, w_scale = make_weight()
    assert "saturate in int16" in onednn.w8a8_unsupported(N, K)
    with pytest.raises(QuantkitError, match="cannot run here: on this CPU .* not exact; use another W8A8 kernel"):
        onednn.prepack_w8a8(w_int8, w_scale)
    assert onednn.prepack_w8a8(w_int8, w_scale, inexact_ok=True).out_features == N  # benchmarks time it anyway
