"""The Triton FP8 block-scaled GEMM (`kernels/fp8/block_triton.py`; under TRITON_INTERPRET=1
without a GPU) against its twin `twin.fp8_block_gemm`, and the twin against compressed-tensors'
own FP8_BLOCK code (imported here only): its weight dequantization and its dynamic per-group
activation quantization, bit for bit.

`quantize_fp8_per_group` equals the twin bit for bit (scales with `torch.equal`, fp8 bytes
compared raw). GEMM tolerances: the fp8 operands are identical and their products exact; the
kernel scales each block's fp32 partial sum once (s_x · s_w), the twin dequantizes each operand
first (one fp32 rounding per element), so the sums differ by a few fp32 ulps, plus the order of
the sums, Hopper's narrower fp8 accumulation within a 128-column block, and one ulp of the
final rounding to x's dtype:

| x dtype | rtol | atol |
|---|---|---|
| float16 | 2e-3 (~2 ulp) | 2e-3 |
| bfloat16 (GPU only) | 1.6e-2 (~2 ulp) | 1e-2 |
| float32 | 1e-3 | 1e-3 |
"""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

import torch  # noqa: E402

from quantkit.kernels.choice import Problem, choose  # noqa: E402
from quantkit.kernels.fp8 import BLOCK, twin  # noqa: E402
from quantkit.kernels.fp8 import block_triton as kmod  # noqa: E402
from quantkit.kernels.fp8.block_triton import fp8_block_gemm, quantize_fp8_per_group  # noqa: E402

DEVICE = "cpu" if kmod.INTERPRET else "cuda"
TOL = {
    torch.float16: dict(rtol=2e-3, atol=2e-3),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2),
    torch.float32: dict(rtol=1e-3, atol=1e-3),
}
DTYPES = [torch.float16, torch.float32] + ([] if kmod.INTERPRET else [torch.bfloat16])


def make_weight(n: int, k: int, seed: int = 0):
    """(w_fp8 [n, k], w_scale [ceil(n/128), ceil(k/128)]) quantized per block from a random W
    whose blocks differ in magnitude, as FP8_BLOCK stores them."""
    gen = torch.Generator().manual_seed(seed)
    nb, kb = -(-n // 128), -(-k // 128)
    mags = torch.logspace(-2, 1, nb * kb).reshape(nb, kb)
    w = torch.randn(n, k, generator=gen) * mags.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    amax = torch.zeros(nb, kb)
    for i in range(nb):
        for j in range(kb):
            amax[i, j] = w[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128].abs().amax()
    scale = amax / 448.0
    wide = scale.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    return (w / wide).to(torch.float8_e4m3fn).to(DEVICE), scale.to(DEVICE)


def make_x(shape, dtype, seed=1):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    return (x * torch.logspace(-2, 2, shape[-1])).to(dtype).to(DEVICE)  # groups of very different ranges


def assert_same_fp8(a, b):
    assert a.dtype == b.dtype == torch.float8_e4m3fn
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("k", [128, 200, 300])
def test_quantize_per_group_is_bit_exact(dtype, k):
    x = make_x((9, k), dtype)
    x[0] = 0  # an all-zero row: every scale 1e-12 / 448
    x[1, 130:] = 0  # a zero group past the first
    q, scale = quantize_fp8_per_group(x)
    expected_q, expected_scale = twin.quantize_fp8_per_group(x)
    assert scale.shape == (9, -(-k // 128)) and scale.dtype == torch.float32
    assert torch.equal(scale, expected_scale)
    assert_same_fp8(q, expected_q)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m,n,k", [(1, 128, 128), (3, 200, 300), (17, 72, 256), (33, 260, 136)])
def test_fp8_block_gemm_matches_the_twin(dtype, m, n, k):
    """Partial weight blocks on both edges (200 x 300, 260 x 136) and N below one block."""
    w_fp8, w_scale = make_weight(n, k)
    x = make_x((m, k), dtype)
    y = fp8_block_gemm(x, w_fp8, w_scale)
    assert y.shape == (m, n) and y.dtype == dtype
    torch.testing.assert_close(y, twin.fp8_block_gemm(x, w_fp8, w_scale), **TOL[dtype])


def test_leading_dimensions_and_a_non_contiguous_x():
    w_fp8, w_scale = make_weight(40, 192)
    x = make_x((192, 3, 2), torch.float16).permute(2, 1, 0)  # [2, 3, 192], not contiguous
    y = fp8_block_gemm(x, w_fp8, w_scale)
    assert y.shape == (2, 3, 40)
    torch.testing.assert_close(y, twin.fp8_block_gemm(x, w_fp8, w_scale), **TOL[torch.float16])
    assert fp8_block_gemm(x[:0], w_fp8, w_scale).shape == (0, 3, 40)


def _bad_args():
    """(id, changes to the good arguments, words the message must contain)."""
    w_fp8, w_scale = make_weight(200, 300)
    return [
        ("x-width", dict(x=make_x((2, 64), torch.float32)), "x must be [..., 300]"),
        ("w-dtype", dict(w_fp8=w_fp8.float()), "w_fp8 must be float8_e4m3fn"),
        ("w_scale-shape", dict(w_scale=w_scale[:, :2]), "w_scale must be float [2, 3]"),
        ("w_scale-channel", dict(w_scale=torch.ones(200, 1, device=DEVICE)), "w_scale must be float [2, 3]"),
    ]


@pytest.mark.parametrize("case", _bad_args(), ids=lambda c: c[0])
def test_bad_arguments_name_what_is_wrong(case):
    _, changes, words = case
    w_fp8, w_scale = make_weight(200, 300)
    args = dict(x=make_x((2, 300), torch.float32), w_fp8=w_fp8, w_scale=w_scale) | changes
    with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
        fp8_block_gemm(**args)


def test_the_candidates():
    """On the CPU the twin's candidate runs (weight dequantized once), saying why the kernel was
    passed over; backend "triton" takes the kernel wherever the tensors are."""
    w_fp8, w_scale = make_weight(200, 300)
    x = make_x((5, 300), torch.float32)
    expected = twin.fp8_block_gemm(x, w_fp8, w_scale)
    if DEVICE == "cpu":
        choice = choose("fp8 block GEMM", BLOCK, Problem("cpu", torch.float32, weight=w_fp8, scales=w_scale))
        assert choice.name.startswith("fp8 block twin") and "needs a GPU" in choice.why
        torch.testing.assert_close(choice.fn(x), expected, rtol=1e-6, atol=1e-6)
    problem = Problem(DEVICE, torch.float32, backend="triton", weight=w_fp8, scales=w_scale)
    choice = choose("fp8 block GEMM", BLOCK, problem)
    assert choice.name == "fp8_block_gemm (Triton)"
    torch.testing.assert_close(choice.fn(x), expected, **TOL[torch.float32])


def test_the_twin_matches_compressed_tensors():
    """FP8_BLOCK's weight dequantization (partial edge blocks included) and its dynamic
    per-token, per-128-column activation quantization, from compressed-tensors' own code."""
    ct = pytest.importorskip("compressed_tensors")
    from compressed_tensors.quantization.lifecycle.forward import dequantize, fake_quantize
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp

    scheme = ct.quantization.preset_name_to_scheme("FP8_BLOCK", ["Linear"])
    w_fp8, w_scale = (t.cpu() for t in make_weight(200, 300))
    theirs = dequantize(w_fp8, w_scale, args=scheme.weights, dtype=torch.float32)
    assert torch.equal(twin.dequantize_fp8_block(w_fp8, w_scale), theirs)
    x = make_x((7, 256), torch.float32).cpu()  # compressed-tensors needs whole groups here
    scale, zero = compute_dynamic_scales_and_zp(x, scheme.input_activations, None)
    assert torch.equal(twin.quantize_fp8_per_group(x)[1], scale.reshape(7, 2))
    assert torch.equal(twin.fake_quantize_per_group(x), fake_quantize(x, scale, zero, scheme.input_activations))


@pytest.mark.parametrize("split_k", [2, 3])
def test_split_k(split_k):
    """Split-K (taken for few rows on a GPU): per-block-scaled fp32 partial sums, added."""
    w_fp8, w_scale = make_weight(72, 600)  # 10 K steps of 64 over 5 blocks, the last partial
    x = make_x((3, 600), torch.float32)
    y = kmod._launch(x, w_fp8, w_scale, split_k)
    torch.testing.assert_close(y, twin.fp8_block_gemm(x, w_fp8, w_scale), **TOL[torch.float32])
