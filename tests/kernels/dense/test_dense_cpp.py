"""The C++ fp32 GEMV (`quantkit.kernels.dense.cpp`, kernels/dense/gemv.cpp) against the float
linear's twin (`F.linear`), and its candidate entry.

Tolerance: both compute exact fp32 products and sum them in fp32 in different orders, so each
output is within rtol 1e-5 of the fp64 result plus atol 1e-5 · max Σ|x_k w_k| (a sum of K ≤ 600
terms rounds by at most K · 2⁻²⁴ of Σ|x_k w_k|; in practice far less), as is `F.linear`'s.
"""

from __future__ import annotations

import pytest
import torch
from conftest import built

from quantkit.kernels import cpu, dense
from quantkit.kernels.choice import Problem, choose
from quantkit.kernels.dense import cpp as cpu_dense
from quantkit.kernels.dense import twin as dense_twin


@pytest.fixture(scope="module")
def k():
    with built(cpu_dense.EXTENSION) as module:
        yield module


def close_to_fp64(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> None:
    want = torch.nn.functional.linear(x.double(), w.double(), None if bias is None else bias.double())
    scale = (x.double().abs() @ w.double().abs().T).amax().item() if x.numel() else 0.0
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * scale)


def isas(k) -> list[str]:
    return [name for name, level in cpu_dense.ISA_LEVEL.items() if level <= k.isa_level()]


@pytest.mark.parametrize("isa", ["avx2", "avx512"])
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
# K with and without a vector tail (8 and 16 lanes, 2 accumulators), N not a multiple of 4
# (200, 29) and (65, 53): a 2W step, a W step and scalar lanes in one row on AVX2 and AVX-512
@pytest.mark.parametrize(("n", "kdim"), [(64, 48), (37, 576), (5, 17), (130, 7), (3, 40), (200, 29), (65, 53)])
def test_gemv_matches_the_twin(k, isa, rows, n, kdim):
    if isa not in isas(k):
        pytest.skip(f"this CPU has no {isa}")
    g = torch.Generator().manual_seed(rows * 1000 + n)
    x, w = torch.randn(rows, kdim, generator=g), torch.randn(n, kdim, generator=g)
    got = cpu_dense.gemv(x, w, isa)
    assert got.shape == (rows, n) and got.dtype == torch.float32
    close_to_fp64(got, x, w)
    close_to_fp64(dense_twin.linear(x, w), x, w)  # the twin meets the same bound


def test_gemv_splits_channels_over_threads(k):
    g = torch.Generator().manual_seed(7)
    x, w = torch.randn(3, 96, generator=g), torch.randn(200, 96, generator=g)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        got = cpu_dense.gemv(x, w)
    finally:
        torch.set_num_threads(before)
    close_to_fp64(got, x, w)


@pytest.mark.parametrize("shape", [(1, 40), (2, 1, 40), (3, 40), (4, 40), (5, 40), (2, 3, 40), (0, 40)])
def test_linear_takes_any_leading_shape_and_bias(k, shape):
    g = torch.Generator().manual_seed(len(shape))
    x, w, b = torch.randn(*shape, generator=g), torch.randn(24, 40, generator=g), torch.randn(24, generator=g)
    got = cpu_dense.linear(x, w, b)
    assert got.shape == (*shape[:-1], 24)
    close_to_fp64(got.reshape(-1, 24), x.reshape(-1, 40), w, b)


def test_gemv_refuses_what_it_does_not_take(k):
    with pytest.raises(RuntimeError, match="1 to 4 rows"):
        k.gemv(torch.randn(5, 8), torch.randn(3, 8), 1)
    with pytest.raises(RuntimeError, match="features"):
        k.gemv(torch.randn(1, 8), torch.randn(3, 9), 1)
    with pytest.raises(RuntimeError, match="isa must be"):
        k.gemv(torch.randn(1, 8), torch.randn(3, 8), 3)


def test_the_candidates_take_fp32_on_the_cpu(k):
    x, w, b = torch.randn(3, 40), torch.randn(24, 40), torch.randn(24)
    chosen = choose("float linear", dense.LINEAR, Problem("cpu", torch.float32, max_num_seqs=1))
    assert chosen.name.startswith("fp32 GEMV") and "one sequence" in chosen.why
    assert torch.equal(chosen.fn(w, b)(x), cpu_dense.linear(x, w, b))
    bf16 = choose("float linear", dense.LINEAR, Problem("cpu", torch.bfloat16))
    assert bf16.name == "F.linear" and "it takes float32" in bf16.why
    forced = choose("float linear", dense.LINEAR, Problem("cpu", torch.float32, "torch", max_num_seqs=64))
    assert torch.equal(forced.fn(w, b)(x), dense_twin.linear(x, w, b))
    if cpu.fp32_prepack_available():
        batched = choose("float linear", dense.LINEAR, Problem("cpu", torch.float32, max_num_seqs=64))
        assert batched.name == dense.PACKED and batched.why is None


@pytest.mark.skipif(not cpu.fp32_prepack_available(), reason="this torch build has no oneDNN")
@pytest.mark.parametrize("shape", [(1, 576), (2, 576), (5, 576), (64, 576), (2, 3, 576), (7, 17)])
def test_the_reordered_fp32_weight_matches_the_twin(shape):
    """oneDNN's fp32 GEMM on the reordered weight: within the same fp64 bound as F.linear."""
    g = torch.Generator().manual_seed(shape[0])
    x, w, b = torch.randn(*shape, generator=g), torch.randn(96, shape[-1], generator=g), torch.randn(96, generator=g)
    fn = choose("float linear", dense.LINEAR, Problem("cpu", torch.float32, max_num_seqs=8)).fn(w, b)
    got = fn(x)
    assert got.shape == (*shape[:-1], 96)
    close_to_fp64(got.reshape(-1, 96), x.reshape(-1, shape[-1]), w, b)


def test_release_frees_the_plain_weights():
    linear = torch.nn.Linear(8, 4)
    dense.release([linear])
    assert linear.weight.device.type == "meta" and linear.weight.shape == (4, 8)
