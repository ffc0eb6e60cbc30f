"""The Triton MXFP8-weight GEMM (`kernels/fp8/mx_triton.py`; under TRITON_INTERPRET=1 without a
GPU) against its twin `twin.mxfp8_gemm`, and the twin against compressed-tensors' own MXFP8
compressor (imported here only).

The kernel and the twin decode the same weight bit for bit (e4m3 · 2^(e - 127) is exact in
fp32; `test_the_kernel_decodes_every_byte_exactly`), so only the order of the fp32 sums and the
final rounding to x's dtype differ:

| x dtype | rtol | atol |
|---|---|---|
| float16 | 2e-3 (~2 ulp) | 2e-3 |
| bfloat16 (GPU only) | 1.6e-2 (~2 ulp) | 1e-2 |
| float32 | 1e-5 | 1e-4 · max|y| |
"""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

import torch  # noqa: E402

from quantkit.kernels.choice import Problem, choose  # noqa: E402
from quantkit.kernels.fp8 import MX, twin  # noqa: E402
from quantkit.kernels.fp8 import mx_triton as kmod  # noqa: E402
from quantkit.kernels.fp8.mx_triton import mxfp8_gemm  # noqa: E402

DEVICE = "cpu" if kmod.INTERPRET else "cuda"
DTYPES = [torch.float16, torch.float32] + ([] if kmod.INTERPRET else [torch.bfloat16])


def tol(dtype, ref):
    if dtype == torch.float32:
        return dict(rtol=1e-5, atol=1e-4 * ref.abs().max().item())
    return dict(rtol=2e-3, atol=2e-3) if dtype == torch.float16 else dict(rtol=1.6e-2, atol=1e-2)


def make_weight(n: int, k: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    w_fp8 = (torch.randn(n, k, generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    scales = torch.randint(117, 123, (n, k // 32), dtype=torch.uint8, generator=gen)
    return w_fp8.to(DEVICE), scales.to(DEVICE)


def make_x(shape, dtype, seed=1):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m,n,k", [(1, 40, 96), (5, 8, 64), (33, 72, 160)])
def test_mxfp8_gemm_matches_the_twin(dtype, m, n, k):
    weight = make_weight(n, k)
    x = make_x((m, k), dtype)
    y = mxfp8_gemm(x, *weight)
    ref = twin.mxfp8_gemm(x, *weight)
    assert y.shape == (m, n) and y.dtype == dtype
    torch.testing.assert_close(y, ref, **tol(dtype, ref))


@pytest.mark.parametrize("split_k", [2, 3])
def test_split_k(split_k):
    weight = make_weight(40, 320)
    x = make_x((3, 320), torch.float32)
    ref = twin.mxfp8_gemm(x, *weight)
    torch.testing.assert_close(kmod._launch(x, *weight, split_k), ref, **tol(torch.float32, ref))


def test_the_kernel_decodes_every_byte_exactly():
    """y = I · Wᵀ = W in fp32: every finite e4m3 byte (subnormals included) times scales
    2^-20 .. 2^20, equal to the twin's decode bit for bit."""
    n, k = 64, 128
    w_fp8 = (torch.arange(n * k) % 256).to(torch.uint8)
    w_fp8 = torch.where((w_fp8 & 0x7F) == 0x7F, 0, w_fp8).view(torch.float8_e4m3fn).reshape(n, k)
    scales = (107 + torch.arange(n * k // 32) % 41).to(torch.uint8).reshape(n, k // 32)
    weight = (w_fp8.to(DEVICE), scales.to(DEVICE))
    y = mxfp8_gemm(torch.eye(k, device=DEVICE), *weight)
    assert torch.equal(y, twin.dequantize_mxfp8(*weight).t())


def _bad_args():
    w_fp8, scales = make_weight(40, 96)
    return [
        ("x-width", dict(x=make_x((2, 64), torch.float32)), "x must be [..., 96]"),
        ("w-dtype", dict(w_fp8=w_fp8.float()), "w_fp8 must be float8_e4m3fn"),
        ("scales-dtype", dict(scales=scales.float()), "scales must be uint8 E8M0 [40, 3]"),
        ("scales-shape", dict(scales=scales[:, :2]), "scales must be uint8 E8M0 [40, 3]"),
    ]


@pytest.mark.parametrize("case", _bad_args(), ids=lambda c: c[0])
def test_bad_arguments_name_what_is_wrong(case):
    _, changes, words = case
    w_fp8, scales = make_weight(40, 96)
    args = dict(x=make_x((2, 96), torch.float32), w_fp8=w_fp8, scales=scales) | changes
    with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
        mxfp8_gemm(**args)


def test_the_candidates():
    w_fp8, scales = make_weight(40, 96)
    x = make_x((5, 96), torch.float32)
    ref = twin.mxfp8_gemm(x, w_fp8, scales)
    if DEVICE == "cpu":
        choice = choose("mxfp8 GEMM", MX, Problem("cpu", torch.float32, weight=w_fp8, scales=scales))
        assert choice.name.startswith("mxfp8 twin") and "needs a GPU" in choice.why
        torch.testing.assert_close(choice.fn(x), ref, **tol(torch.float32, ref))
    choice = choose("mxfp8 GEMM", MX, Problem(DEVICE, torch.float32, backend="triton", weight=w_fp8, scales=scales))
    assert choice.name == "mxfp8_gemm (Triton)"
    torch.testing.assert_close(choice.fn(x), ref, **tol(torch.float32, ref))


def test_the_twin_decodes_compressed_tensors_checkpoints():
    """compressed-tensors compresses a weight with its MXFP8A16 preset and decompresses it; the
    twin's fp32 decode of the stored tensors, in the decompressed dtype, is the same bit for bit."""
    ct = pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.mxfp8.base import MXFP8QuantizationCompressor

    n, k = 24, 128
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(5)) * torch.logspace(-2, 1, n)[:, None]
    scheme = ct.quantization.preset_name_to_scheme("MXFP8A16", ["Linear"])
    amax = w.reshape(n, -1, 32).abs().amax(-1)
    state = dict(weight=w, weight_scale=2.0 ** (torch.floor(torch.log2(amax)) - 8))
    stored = MXFP8QuantizationCompressor.compress(state, scheme)
    assert stored["weight"].dtype == torch.float8_e4m3fn and stored["weight_scale"].dtype == torch.uint8
    theirs = MXFP8QuantizationCompressor.decompress(stored, scheme)["weight"]
    mine = twin.dequantize_mxfp8(stored["weight"], stored["weight_scale"])
    assert torch.equal(mine.to(theirs.dtype), theirs)
