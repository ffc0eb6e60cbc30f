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

from quantkit.kernels import dense
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


@pytest.mark.parametrize("rows", [1, 2, 3, 4])
# K with and without a vector tail, N not a multiple of 4
@pytest.mark.parametrize(("n", "kdim"), [(64, 48), (37, 576), (5, 17), (130, 7)])
def test_gemv_matches_the_twin(k, rows, n, kdim):
    g = torch.Generator().manual_seed(rows * 1000 + n)
    x, w = torch.randn(rows, kdim, generator=g), torch.randn(n, kdim, generator=g)
    got = k.gemv(x, w)
    assert got.shape == (rows, n) and got.dtype == torch.float32
    close_to_fp64(got, x, w)
    close_to_fp64(dense_twin.linear(x, w), x, w)  # the twin meets the same bound


@pytest.mark.parametrize("shape", [(1, 40), (2, 1, 40), (3, 40), (4, 40), (5, 40), (2, 3, 40), (0, 40)])
def test_linear_takes_any_leading_shape_and_bias(k, shape):
    g = torch.Generator().manual_seed(len(shape))
    x, w, b = torch.randn(*shape, generator=g), torch.randn(24, 40, generator=g), torch.randn(24, generator=g)
    got = cpu_dense.linear(x, w, b)
    assert got.shape == (*shape[:-1], 24)
    close_to_fp64(got.reshape(-1, 24), x.reshape(-1, 40), w, b)


def test_gemv_refuses_what_it_does_not_take(k):
    with pytest.raises(RuntimeError, match="1 to 4 rows"):
        k.gemv(torch.randn(5, 8), torch.randn(3, 8))
    with pytest.raises(RuntimeError, match="features"):
        k.gemv(torch.randn(1, 8), torch.randn(3, 9))


def test_the_candidate_takes_fp32_on_the_cpu(k):
    chosen = choose("float linear", dense.LINEAR, Problem("cpu", torch.float32))
    assert chosen.name.startswith("fp32 GEMV") and chosen.fn is cpu_dense.linear
    bf16 = choose("float linear", dense.LINEAR, Problem("cpu", torch.bfloat16))
    assert bf16.name == "F.linear" and "it takes float32" in bf16.why
    forced = choose("float linear", dense.LINEAR, Problem("cpu", torch.float32, "torch"))
    assert forced.fn is dense_twin.linear
