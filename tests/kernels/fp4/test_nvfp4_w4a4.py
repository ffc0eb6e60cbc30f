"""NVFP4 W4A4 (`fp4_gemm(..., kind="nvfp4_w4a4", input_global_scale=...)`; under
TRITON_INTERPRET=1 without a GPU): the activations quantized to NVFP4 per 16 columns over a
static global scale, against the twin, and the twin's activation quantization against
compressed-tensors' own (imported here only).

The quantization kernel writes q · s8 in fp16 (exact: 2 + 4 significant bits) and equals the
twin's parts bit for bit. The GEMM multiplies q_x · s8_x by q_w · s8_w (exact products in fp16,
fp32 sums) and divides by both global scales at the end, where the twin multiplies the
fake-quantized operands (q · s8 / gs, one fp32 rounding each) in fp32: a few fp32 ulps apart,
plus the order of the sums and the final rounding to x's dtype:

| x dtype | rtol | atol |
|---|---|---|
| float16 | 2e-3 (~2 ulp) | 2e-3 |
| bfloat16 (GPU only) | 1.6e-2 (~2 ulp) | 1e-2 |
| float32 | 1e-4 | 1e-4 · max|y| |
"""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

import torch  # noqa: E402

from quantkit.kernels.choice import Problem, choose  # noqa: E402
from quantkit.kernels.fp4 import CANDIDATES, twin  # noqa: E402
from quantkit.kernels.fp4 import triton as kmod  # noqa: E402
from quantkit.kernels.fp4.triton import fp4_gemm  # noqa: E402

DEVICE = "cpu" if kmod.INTERPRET else "cuda"
DTYPES = [torch.float16, torch.float32] + ([] if kmod.INTERPRET else [torch.bfloat16])
KIND = "nvfp4_w4a4"


def tol(dtype, ref):
    if dtype == torch.float32:
        return dict(rtol=1e-4, atol=1e-4 * ref.abs().max().item())
    return dict(rtol=2e-3, atol=2e-3) if dtype == torch.float16 else dict(rtol=1.6e-2, atol=1e-2)


def make_weight(n: int, k: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
    scales = (torch.rand(n, k // 16, generator=gen) * 400 + 1).to(torch.float8_e4m3fn)
    return packed.to(DEVICE), scales.to(DEVICE), torch.tensor([448 * 6 / 3.5], device=DEVICE)


def make_x(shape, dtype, seed=1):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * torch.logspace(-1, 1, shape[-1])
    return x.to(dtype).to(DEVICE)


def input_scale(x: torch.Tensor) -> torch.Tensor:
    """A calibrated global input scale, as the preset's static_minmax observer would store it."""
    return (448 * 6 / x.float().abs().amax()).reshape(1).to(DEVICE)


def test_activation_quantization_is_bit_exact():
    """Zero groups (scale 0.125), tiny ones (subnormal or zero FP8 scales), clamped scales (448),
    and a row whose scale is exactly 1 so its values fall on every E2M1 tie."""
    x = make_x((6, 64), torch.float32) * 3
    x[0] = 0
    x[1, :16] = 1e-30
    x[2, 16:32] *= 1e4
    ties = torch.tensor(
        [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, -6.0]
    )
    x[3, :16] = ties.to(DEVICE)
    gx = torch.tensor([1.0], device=DEVICE)
    q, s8 = twin.nvfp4_activation_parts(x, gx)
    assert s8[3, 0] == 1.0 and s8[0, 0] == 0.125
    expected = (q.unflatten(-1, (-1, 16)) * s8[..., None]).flatten(-2)
    assert torch.equal(kmod._quantize_activations(x, gx).float(), expected)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m,n,k", [(1, 40, 96), (5, 8, 64), (33, 72, 160)])
def test_w4a4_gemm_matches_the_twin(dtype, m, n, k):
    weight = make_weight(n, k)
    x = make_x((m, k), dtype)
    gx = input_scale(x)
    y = fp4_gemm(x, *weight, 16, KIND, gx)
    ref = twin.fp4_gemm(x, *weight, 16, KIND, gx)
    assert y.shape == (m, n) and y.dtype == dtype
    torch.testing.assert_close(y, ref, **tol(dtype, ref))


def test_split_k():
    weight = make_weight(40, 320)
    x = make_x((3, 320), torch.float32)
    gx = input_scale(x)
    ref = twin.fp4_gemm(x, *weight, 16, KIND, gx)
    torch.testing.assert_close(kmod._launch(x, *weight, 16, KIND, 2, gx), ref, **tol(torch.float32, ref))


def test_the_input_global_scale_is_required_and_only_for_w4a4():
    packed, scales, gs = make_weight(8, 64)
    x = make_x((2, 64), torch.float32)
    with pytest.raises(ValueError, match="input_global_scale must be a float"):
        fp4_gemm(x, packed, scales, gs, 16, KIND)
    with pytest.raises(ValueError, match="input_global_scale must be a float"):
        fp4_gemm(x, packed, scales, gs, 16, "nvfp4", torch.ones(1, device=DEVICE))


def test_the_candidates():
    packed, scales, gs = make_weight(40, 96)
    x = make_x((5, 96), torch.float32)
    gx = input_scale(x)
    fields = dict(packed=packed, scales=scales, global_scale=gs, group_size=16, kind=KIND, input_global_scale=gx)
    ref = twin.fp4_gemm(x, packed, scales, gs, 16, KIND, gx)
    if DEVICE == "cpu":
        choice = choose("fp4 GEMM", CANDIDATES, Problem("cpu", torch.float32, **fields))
        assert choice.name.startswith("fp4 twin")
        torch.testing.assert_close(choice.fn(x), ref, rtol=1e-6, atol=1e-6)
    choice = choose("fp4 GEMM", CANDIDATES, Problem(DEVICE, torch.float32, backend="triton", **fields))
    assert choice.name == "fp4_gemm (Triton)"
    torch.testing.assert_close(choice.fn(x), ref, **tol(torch.float32, ref))


def test_the_twin_quantizes_activations_as_compressed_tensors():
    """The NVFP4 preset's input_activations through compressed-tensors' own dynamic scales and
    fake quantization (fp32 x), bit for bit; and its E2M1 rounding on a fine grid with ties."""
    ct = pytest.importorskip("compressed_tensors")
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp
    from compressed_tensors.quantization.utils.fp4_utils import cast_to_fp4

    args = ct.quantization.preset_name_to_scheme("NVFP4", ["Linear"]).input_activations
    x = torch.randn(9, 256, generator=torch.Generator().manual_seed(2)) * torch.logspace(-4, 2, 9)[:, None]
    x[0, :16] = 0
    gx = (448 * 6 / x.abs().amax()).reshape(1) * 3  # some scales clamp at 448
    scale, zero = compute_dynamic_scales_and_zp(x, args, None, global_scale=gx)
    assert torch.equal(twin.nvfp4_activation_parts(x, gx)[1], scale)
    assert torch.equal(twin.quantize_nvfp4_activations(x, gx), fake_quantize(x, scale, zero, args, global_scale=gx))
    grid = torch.arange(-2400, 2401) / 400  # steps of 1/400: every tie of the E2M1 grid on it, exactly
    assert torch.equal(twin.round_e2m1(grid), cast_to_fp4(grid.clone()))
