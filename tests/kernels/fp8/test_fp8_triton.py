"""The Triton fp8 kernels (`kernels/fp8_gemm.py`; under TRITON_INTERPRET=1 without a GPU)
against the torch twin `reference.fp8_gemm`.

`quantize_fp8_per_token` must equal the torch computation bit for bit (scales with
`torch.equal`, fp8 values compared as raw bytes): it is one IEEE division and one rounding
to nearest even, and the kernel does both exactly.

GEMM tolerances (per activation dtype): the fp8 operands are identical and their products
exact, so only the order of the fp32 sums differs, plus one ulp of the final rounding to x's
dtype. fp32 gets 1e-3 rather than ~1e-5 because Hopper's fp8 tensor cores accumulate with a
narrower mantissa between the fp32 promotions (every BLOCK_K products); under the
interpreter the error is ~1e-6.

| x dtype | rtol | atol |
|---|---|---|
| float16 | 2e-3 (~2 ulp) | 2e-3 |
| bfloat16 (GPU only) | 1.6e-2 (~2 ulp) | 1e-2 |
| float32 | 1e-3 | 1e-3 |

bfloat16 is not tested under the interpreter: its fp32 -> bf16 conversion truncates instead
of rounding (and its `tl.dot` on bf16 returns garbage), so the output would be off by an ulp
for reasons that do not exist on a GPU, where the bf16 cases run.
"""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

import torch  # noqa: E402

from quantkit.kernels.fp8 import triton as kmod  # noqa: E402
from quantkit.kernels.fp8 import twin as reference  # noqa: E402
from quantkit.kernels.fp8.triton import fp8_gemm, quantize_fp8_per_token  # noqa: E402
from quantkit.primitives import compute_qparams, quantize  # noqa: E402
from quantkit.scheme import QuantArgs  # noqa: E402

DEVICE = "cpu" if kmod.INTERPRET else "cuda"
TOL = {
    torch.float16: dict(rtol=2e-3, atol=2e-3),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2),
    torch.float32: dict(rtol=1e-3, atol=1e-3),
}
DTYPES = [torch.float16, torch.float32] + ([] if kmod.INTERPRET else [torch.bfloat16])
N, K = 40, 96  # not multiples of the tiles


def make_x(shape, dtype=torch.float32, seed=1):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype).to(DEVICE)


def make_weight(strategy: str, n=N, k=K, seed=0):
    """(w_fp8 [n, k], w_scale [n, 1] per channel or [1] per tensor), as a checkpoint holds them."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * (1 + 3 * torch.rand(n, 1, generator=gen))
    args = QuantArgs(num_bits=8, type="float", strategy=strategy, group_size=None)
    scale, _ = compute_qparams(w, args)
    return quantize(w, scale, None, args).to(DEVICE), scale.to(DEVICE)


def torch_quantize(x: torch.Tensor):
    """What `reference.fp8_gemm` does to x when x_scale is None."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12) / 448.0
    return (xf / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn), scale


def assert_same_fp8(a: torch.Tensor, b: torch.Tensor):
    assert a.dtype == b.dtype == torch.float8_e4m3fn
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_quantize_per_token_is_bit_exact(dtype):
    rows = torch.logspace(-6, 3, 33)[:, None]  # tiny to large rows: subnormal fp8 values included
    x = (make_x((33, 1000)) * rows.to(DEVICE)).to(dtype)
    x[0] = 0  # an all-zero row: scale 1e-12 / 448
    x[1, :4] = torch.tensor([0.0, -0.0, 1e-30, -1e-30])
    q, scale = quantize_fp8_per_token(x)
    expected_q, expected_scale = torch_quantize(x)
    assert scale.dtype == torch.float32 and scale.shape == (33, 1)
    assert torch.equal(scale, expected_scale)
    assert_same_fp8(q, expected_q)


def test_quantize_rounds_ties_to_even():
    """Every positive e4m3 value, the midpoints between neighbours (ties) and their float32
    neighbours, both signs; 448 in the row makes the scale exactly 1."""
    grid = torch.arange(0, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    mids = (grid[:-1] + grid[1:]) / 2
    around = torch.cat([torch.nextafter(mids, torch.zeros_like(mids)), torch.nextafter(mids, grid[1:])])
    v = torch.cat([grid, mids, around, torch.tensor([448.0])])
    x = torch.cat([v, -v])[None].to(DEVICE)
    q, scale = quantize_fp8_per_token(x)
    assert scale.item() == 1.0
    assert_same_fp8(q, torch_quantize(x)[0])


@pytest.mark.parametrize("w_strategy", ["channel", "tensor"])
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m", [1, 3, 16, 33])
def test_fp8_gemm_matches_the_twin(m, dtype, static, w_strategy):
    w_fp8, w_scale = make_weight(w_strategy)
    x = make_x((m, K), dtype) * 3
    x_scale = None
    if static:  # a calibrated per-tensor scale, a little small so that some values clamp
        args = QuantArgs(8, "float", strategy="tensor", group_size=None)
        x_scale = compute_qparams(x.cpu(), args)[0].to(DEVICE) / 1.5
    y = fp8_gemm(x, w_fp8, w_scale, x_scale)
    assert y.shape == (m, N) and y.dtype == dtype
    torch.testing.assert_close(y, reference.fp8_gemm(x, w_fp8, w_scale, x_scale), **TOL[dtype])


def test_leading_dimensions_and_a_non_contiguous_x():
    w_fp8, w_scale = make_weight("channel")
    x = make_x((K, 3, 2), torch.float16).permute(2, 1, 0)  # [2, 3, K], not contiguous
    y = fp8_gemm(x, w_fp8, w_scale)
    assert y.shape == (2, 3, N)
    torch.testing.assert_close(y, reference.fp8_gemm(x, w_fp8, w_scale), **TOL[torch.float16])
    q, scale = quantize_fp8_per_token(x)
    assert q.shape == (2, 3, K) and scale.shape == (2, 3, 1)
    assert fp8_gemm(x[:0], w_fp8, w_scale).shape == (0, 3, N)


def _bad_args():
    """(id, changes to the good arguments, words the message must contain)."""
    f8 = torch.float8_e4m3fn
    return [
        ("x-width", dict(x=make_x((2, 64))), "x must be [..., 96]"),
        ("x-dtype", dict(x=make_x((2, K)).to(torch.int32)), "x must be float16"),
        ("w-dtype", dict(w_fp8=torch.zeros(N, K, dtype=torch.float16, device=DEVICE)), "w_fp8 must be float8_e4m3fn"),
        ("w_scale-shape", dict(w_scale=torch.ones(N, 2, device=DEVICE)), "w_scale must be float [40, 1]"),
        ("x_scale-shape", dict(x_scale=torch.ones(2, 1, device=DEVICE)), "x_scale must be a float [1]"),
        ("w-shape", dict(w_fp8=torch.zeros(N, K, device=DEVICE).to(f8)[None]), "w_fp8 must be float8_e4m3fn [out, in]"),
    ]


@pytest.mark.parametrize("case", _bad_args(), ids=lambda c: c[0])
def test_bad_arguments_name_what_is_wrong(case):
    _, changes, words = case
    w_fp8, w_scale = make_weight("channel")
    args = dict(x=make_x((2, K)), w_fp8=w_fp8, w_scale=w_scale, x_scale=None) | changes
    with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
        fp8_gemm(**args)


def test_refuses_cpu_tensors_outside_the_interpreter(monkeypatch):
    monkeypatch.setattr(kmod, "INTERPRET", False)
    w_fp8, w_scale = make_weight("channel")
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        fp8_gemm(make_x((2, K)).cpu(), w_fp8.cpu(), w_scale.cpu())
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        quantize_fp8_per_token(make_x((2, K)).cpu())
