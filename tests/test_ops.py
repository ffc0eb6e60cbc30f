"""The dispatcher: auto takes the torch twin on the CPU, triton forces the kernel (run in
the interpreter here), and both agree."""

import pytest
import torch

from quantkit import ops
from quantkit.errors import QuantkitError
from quantkit.kernels import reference


def cache_case():
    g = torch.Generator().manual_seed(0)
    k_cache = torch.randn(4, 16, 2, 16, generator=g)
    v_cache = torch.randn(4, 16, 2, 16, generator=g)
    q = torch.randn(2, 4, 16, generator=g)
    tables = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    lens = torch.tensor([20, 9], dtype=torch.int32)
    return q, k_cache, v_cache, tables, lens


def test_auto_on_cpu_agrees_with_the_twin_and_triton():
    # on a CPU, auto takes the batched torch path of kernels/cpu_attention.py (fp32 softmax
    # as the twin, summed in another order: 2e-5)
    q, kc, vc, tables, lens = cache_case()
    auto = ops.paged_attention(q, kc, vc, tables, lens, 0.25)
    torch.testing.assert_close(auto, reference.paged_attention(q, kc, vc, tables, lens, 0.25), rtol=2e-5, atol=2e-5)
    pytest.importorskip("triton")
    torch.testing.assert_close(
        ops.paged_attention(q, kc, vc, tables, lens, 0.25, backend="triton"), auto, rtol=2e-5, atol=2e-5
    )


def test_unknown_backend():
    q, kc, vc, tables, lens = cache_case()
    with pytest.raises(QuantkitError, match="backend 'cuda' is unknown"):
        ops.paged_attention(q, kc, vc, tables, lens, 0.25, backend="cuda")
