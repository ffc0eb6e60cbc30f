"""The dispatcher: auto takes the torch twin on the CPU, triton forces the kernel (run in
the interpreter here), and both agree, with and without a sliding window and a softcap;
bad windows and softcaps are refused in one sentence."""

import pytest
import torch

from quantkit import ops
from quantkit.errors import QuantkitError
from quantkit.kernels.attention import twin as attention_twin


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
    torch.testing.assert_close(
        auto, attention_twin.paged_attention(q, kc, vc, tables, lens, 0.25), rtol=2e-5, atol=2e-5
    )
    pytest.importorskip("triton")
    torch.testing.assert_close(
        ops.paged_attention(q, kc, vc, tables, lens, 0.25, backend="triton"), auto, rtol=2e-5, atol=2e-5
    )


def test_unknown_backend():
    q, kc, vc, tables, lens = cache_case()
    with pytest.raises(QuantkitError, match="backend 'cuda' is unknown"):
        ops.paged_attention(q, kc, vc, tables, lens, 0.25, backend="cuda")


def test_window_and_softcap_reach_every_backend():
    # query 0 at position 19 sees 13..19 (blocks 0 and 1), query 1 at 8 sees 2..8
    q, kc, vc, tables, lens = cache_case()
    opts = dict(window=7, softcap=5.0)
    twin = attention_twin.paged_attention(q, kc, vc, tables, lens, 0.25, None, None, 7, 5.0)
    assert not torch.allclose(twin, attention_twin.paged_attention(q, kc, vc, tables, lens, 0.25))
    torch.testing.assert_close(ops.paged_attention(q, kc, vc, tables, lens, 0.25, **opts), twin, rtol=2e-5, atol=2e-5)
    assert torch.equal(ops.paged_attention(q, kc, vc, tables, lens, 0.25, **opts, backend="torch"), twin)
    pytest.importorskip("triton")
    torch.testing.assert_close(
        ops.paged_attention(q, kc, vc, tables, lens, 0.25, **opts, backend="triton"), twin, rtol=2e-5, atol=2e-5
    )


def test_prefill_window_and_softcap_reach_every_backend():
    _, kc, vc, tables, lens = cache_case()
    q = torch.randn(12, 4, 16, generator=torch.Generator().manual_seed(1))
    query_lens = torch.tensor([8, 4], dtype=torch.int32)  # the last 8 of 20, the last 4 of 9
    args = (q, kc, vc, tables, lens, query_lens, 0.25)
    twin = attention_twin.paged_prefill(*args, window=7, softcap=5.0)
    assert not torch.allclose(twin, attention_twin.paged_prefill(*args))
    torch.testing.assert_close(ops.paged_prefill(*args, window=7, softcap=5.0), twin, rtol=2e-5, atol=2e-5)
    assert torch.equal(ops.paged_prefill(*args, window=7, softcap=5.0, backend="torch"), twin)


BAD_OPTIONS = [
    (dict(window=0), r"window must be a positive int \(the sliding window in tokens\) or None; got 0\."),
    (dict(window=-4), r"window must be a positive int .* got -4\."),
    (dict(window=2.5), r"window must be a positive int .* got 2\.5\."),
    (dict(window=True), r"window must be a positive int .* got True\."),
    (
        dict(softcap=0.0),
        r"softcap must be a finite positive number \(the attention-logit soft cap\) or None; got 0\.0\.",
    ),
    (dict(softcap=-30.0), r"softcap must be a finite positive number .* got -30\.0\."),
    (dict(softcap=float("inf")), r"softcap must be a finite positive number .* got inf\."),
    (dict(softcap=float("nan")), r"softcap must be a finite positive number .* got nan\."),
    (dict(softcap="50"), r"softcap must be a finite positive number .* got '50'\."),
]


@pytest.mark.parametrize("bad, message", BAD_OPTIONS)
@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_bad_window_or_softcap(bad, message, backend):
    q, kc, vc, tables, lens = cache_case()
    with pytest.raises(QuantkitError, match=r"^paged_attention: " + message):
        ops.paged_attention(q, kc, vc, tables, lens, 0.25, **bad, backend=backend)
    query_lens = torch.tensor([1, 1], dtype=torch.int32)
    with pytest.raises(QuantkitError, match=r"^paged_prefill: " + message):
        ops.paged_prefill(q, kc, vc, tables, lens, query_lens, 0.25, **bad, backend=backend)
