"""The Triton FP4-weight GEMM (`kernels/fp4/triton.py`; under TRITON_INTERPRET=1 without a GPU)
against its torch twin, and the twin against compressed-tensors' own decode (imported here only,
to prove the layout: nibble order, E2M1 values, the E4M3 scale over the global scale, E8M0).

The kernel and the twin decode the same weight bit for bit (fp32, then one rounding to x's
dtype; `test_the_kernel_decodes_every_code_and_scale_exactly` shows it through an identity x), so
the GEMM differs only in the order of the fp32 sums and the final rounding to x's dtype:

| x dtype | rtol | atol |
|---|---|---|
| float16 | 2e-3 (~2 ulp) | 2e-3 |
| bfloat16 (GPU only) | 1.6e-2 (~2 ulp) | 1e-2 |
| float32 | 1e-5 | 1e-4 |
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
TOL = {
    torch.float16: dict(rtol=2e-3, atol=2e-3),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2),
    torch.float32: dict(rtol=1e-5, atol=1e-4),
}
DTYPES = [torch.float16, torch.float32] + ([] if kmod.INTERPRET else [torch.bfloat16])
GROUP = {"nvfp4": 16, "mxfp4": 32}


def make_weight(kind: str, n: int, k: int, seed: int = 0):
    """(packed, scales, global_scale): random codes; scales as a quantizer would store them."""
    gen = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
    groups = k // GROUP[kind]
    if kind == "nvfp4":
        scales = (torch.rand(n, groups, generator=gen) * 400 + 1).to(torch.float8_e4m3fn)
        global_scale = torch.tensor([448 * 6 / 3.5])
    else:
        scales = torch.randint(120, 131, (n, groups), dtype=torch.uint8, generator=gen)
        global_scale = None
    return tuple(t.to(DEVICE) if t is not None else None for t in (packed, scales, global_scale))


def make_x(shape, dtype, seed=1):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype).to(DEVICE)


@pytest.mark.parametrize("kind", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m,n,k", [(1, 40, 96), (3, 8, 64), (33, 72, 160)])
def test_fp4_gemm_matches_the_twin(kind, dtype, m, n, k):
    """N and K not multiples of the tiles (BLOCK_N 32, BLOCK_K 64 in the interpreter)."""
    weight = make_weight(kind, n, k)
    x = make_x((m, k), dtype)
    y = fp4_gemm(x, *weight, GROUP[kind], kind)
    assert y.shape == (m, n) and y.dtype == dtype
    torch.testing.assert_close(y, twin.fp4_gemm(x, *weight, GROUP[kind], kind), **TOL[dtype])


@pytest.mark.parametrize("kind", ["nvfp4", "mxfp4"])
def test_the_kernel_decodes_every_code_and_scale_exactly(kind):
    """y = I · Wᵀ = W in fp32: every E2M1 code, every finite positive E4M3 scale (subnormals
    included) or a wide range of E8M0 exponents, equal to the twin's decode bit for bit."""
    n, k = 128, 64
    packed = (torch.arange(n * k // 2) % 256).to(torch.uint8).reshape(n, k // 2)  # all 256 code pairs
    groups = k // GROUP[kind]
    if kind == "nvfp4":
        scales = (torch.arange(n * groups) % 0x7F).to(torch.uint8).view(torch.float8_e4m3fn).reshape(n, groups)
        global_scale = torch.tensor([0.75])
    else:
        low, high = (1, 250) if kmod.INTERPRET else (64, 190)  # no subnormal products on a GPU
        scales = (low + torch.arange(n * groups) % (high - low)).to(torch.uint8).reshape(n, groups)
        global_scale = None
    weight = [t.to(DEVICE) if t is not None else None for t in (packed, scales, global_scale)]
    y = fp4_gemm(torch.eye(k, device=DEVICE), *weight, GROUP[kind], kind)
    assert torch.equal(y, twin.dequantize_fp4(*weight, GROUP[kind], kind).t())


def test_leading_dimensions_and_a_non_contiguous_x():
    weight = make_weight("nvfp4", 40, 96)
    x = make_x((96, 3, 2), torch.float16).permute(2, 1, 0)  # [2, 3, 96], not contiguous
    y = fp4_gemm(x, *weight, 16, "nvfp4")
    assert y.shape == (2, 3, 40)
    torch.testing.assert_close(y, twin.fp4_gemm(x, *weight, 16, "nvfp4"), **TOL[torch.float16])
    assert fp4_gemm(x[:0], *weight, 16, "nvfp4").shape == (0, 3, 40)


def _bad_args():
    """(id, changes to the good nvfp4 arguments, words the message must contain)."""
    packed, scales, gs = make_weight("nvfp4", 40, 96)
    return [
        ("x-width", dict(x=make_x((2, 64), torch.float32)), "x must be [..., 96]"),
        ("x-dtype", dict(x=make_x((2, 96), torch.float32).to(torch.int32)), "x must be float16"),
        ("packed-dtype", dict(packed=packed.to(torch.int32)), "packed must be uint8"),
        ("group", dict(group_size=32), "nvfp4 takes group_size 16"),
        ("scales-dtype", dict(scales=scales.float()), "scales must be float8_e4m3fn [40, 6]"),
        ("scales-shape", dict(scales=scales[:, :3]), "scales must be float8_e4m3fn [40, 6]"),
        ("no-global", dict(global_scale=None), "global_scale must be a float [1] for nvfp4"),
        ("kind", dict(kind="fp4"), "kind must be one of nvfp4, mxfp4"),
    ]


@pytest.mark.parametrize("case", _bad_args(), ids=lambda c: c[0])
def test_bad_arguments_name_what_is_wrong(case):
    _, changes, words = case
    packed, scales, gs = make_weight("nvfp4", 40, 96)
    args = dict(x=make_x((2, 96), torch.float32), packed=packed, scales=scales, global_scale=gs)
    args |= dict(group_size=16, kind="nvfp4") | changes
    with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
        fp4_gemm(**args)


def test_refuses_cpu_tensors_outside_the_interpreter(monkeypatch):
    monkeypatch.setattr(kmod, "INTERPRET", False)
    packed, scales = (t.cpu() for t in make_weight("mxfp4", 8, 64)[:2])
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        fp4_gemm(torch.zeros(2, 64), packed, scales, None, 32, "mxfp4")


@pytest.mark.parametrize("kind", ["nvfp4", "mxfp4"])
def test_the_candidates(kind):
    """On the CPU the twin's candidate runs (the weight decoded once, F.linear), saying the
    Triton kernel needs a GPU; backend "triton" takes the kernel wherever the tensors are."""
    packed, scales, gs = make_weight(kind, 40, 96)
    fields = dict(packed=packed, scales=scales, global_scale=gs, group_size=GROUP[kind], kind=kind)
    x = make_x((5, 96), torch.float32)
    expected = twin.fp4_gemm(x, packed, scales, gs, GROUP[kind], kind)
    if DEVICE == "cpu":
        choice = choose("fp4 GEMM", CANDIDATES, Problem("cpu", torch.float32, **fields))
        assert choice.name.startswith("fp4 twin") and "needs a GPU" in choice.why
        torch.testing.assert_close(choice.fn(x), expected, rtol=1e-5, atol=1e-4)
    choice = choose("fp4 GEMM", CANDIDATES, Problem(DEVICE, torch.float32, backend="triton", **fields))
    assert choice.name == "fp4_gemm (Triton)"
    torch.testing.assert_close(choice.fn(x), expected, **TOL[torch.float32])


# The twin against compressed-tensors' own code (the layout on disk)


def test_e2m1_and_nibble_order_match_compressed_tensors():
    helpers = pytest.importorskip("compressed_tensors.compressors.nvfp4.helpers")
    values = torch.tensor(twin.E2M1 + tuple(-v for v in twin.E2M1))
    grid = values[torch.randint(0, 16, (6, 32), generator=torch.Generator().manual_seed(3))]
    packed = helpers.pack_fp4_to_uint8(grid)
    assert torch.equal(twin.e2m1(twin.unpack_fp4(packed)), grid)
    codes = torch.arange(256, dtype=torch.uint8).reshape(8, 32)  # every byte
    theirs = helpers.unpack_fp4_from_uint8(codes, 8, 64, dtype=torch.float32)
    assert torch.equal(twin.e2m1(twin.unpack_fp4(codes)), theirs)
    assert torch.equal(twin.e2m1(twin.unpack_fp4(codes)).signbit(), theirs.signbit())  # -0.0 too


def test_e8m0_matches_compressed_tensors():
    mx_utils = pytest.importorskip("compressed_tensors.compressors.mx_utils")
    e = torch.arange(255, dtype=torch.uint8)  # 255 is NaN in E8M0 (compressed-tensors gives inf)
    assert torch.equal(twin.e8m0(e), mx_utils.decompress_mx_scale(e).float())
    assert twin.e8m0(torch.tensor([255], dtype=torch.uint8)).isnan().all()


@pytest.mark.parametrize("kind", ["nvfp4", "mxfp4"])
def test_the_twin_decodes_compressed_tensors_checkpoints(kind):
    """compressed-tensors compresses a weight (its NVFP4 / MXFP4 preset), then decompresses it to
    bf16; the twin's fp32 decode of the stored tensors, rounded to bf16, is the same bit for bit."""
    ct = pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor

    n, k, g = 24, 128, GROUP[kind]
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(5)) * torch.logspace(-2, 1, n)[:, None]
    scheme = ct.quantization.preset_name_to_scheme(kind.upper(), ["Linear"])
    amax = w.reshape(n, -1, g).abs().amax(-1)
    if kind == "nvfp4":
        compressor, gs = NVFP4PackedCompressor, (448 * 6 / w.abs().amax()).reshape(1)
        state = dict(weight=w, weight_scale=amax / 6 * gs, weight_global_scale=gs)
    else:
        compressor = MXFP4PackedCompressor
        state = dict(weight=w, weight_scale=2.0 ** torch.floor(torch.log2(amax / 4)))
    stored = compressor.compress(state, scheme)
    theirs = compressor.decompress(stored, scheme)["weight"]
    mine = twin.dequantize_fp4(
        stored["weight_packed"], stored["weight_scale"], stored.get("weight_global_scale"), g, kind
    )
    assert theirs.dtype == torch.bfloat16
    assert torch.equal(mine.to(torch.bfloat16), theirs)


@pytest.mark.parametrize("kind", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("split_k", [2, 3])
def test_split_k(kind, split_k):
    """Split-K (taken for few rows on a GPU): fp32 partial sums over interleaved K tiles, added."""
    weight = make_weight(kind, 40, 320)  # 5 K tiles of 64
    x = make_x((3, 320), torch.float32)
    y = kmod._launch(x, *weight, GROUP[kind], kind, split_k)
    torch.testing.assert_close(y, twin.fp4_gemm(x, *weight, GROUP[kind], kind), **TOL[torch.float32])
