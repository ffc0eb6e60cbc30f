"""The Triton W4A16 GEMM (`kernels/int4_gemm.py`; under TRITON_INTERPRET=1 without a GPU)
against its torch twin `reference.int4_gemm`.

Tolerances (per activation dtype): the kernel dequantizes exactly like the twin (one
rounding to the scales' dtype), so only the summation order of the fp32 accumulator differs,
plus at most one ulp when the result is rounded to x's dtype.

| x dtype | rtol | atol |
|---|---|---|
| float16 | 2e-3 (~2 ulp) | 2e-3 |
| bfloat16 (GPU only) | 1.6e-2 (~2 ulp) | 1e-2 |
| float32 | 1e-5 | 1e-4 (sums of ~K terms of size ~10) |

bfloat16 is not tested under the interpreter: its `tl.dot` on bf16 operands returns garbage
(numpy has no bf16) and its fp32 -> bf16 conversion truncates instead of rounding, so the
launcher refuses bf16 there; on a GPU the bf16 cases run.
"""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

import torch  # noqa: E402

from quantkit.kernels.int4 import triton as kmod  # noqa: E402
from quantkit.kernels.int4 import twin as reference  # noqa: E402
from quantkit.kernels.int4.triton import int4_gemm  # noqa: E402
from quantkit.packing import pack  # noqa: E402
from quantkit.primitives import compute_qparams, quantize  # noqa: E402
from quantkit.scheme import QuantArgs  # noqa: E402

DEVICE = "cpu" if kmod.INTERPRET else "cuda"
TOL = {
    torch.float16: dict(rtol=2e-3, atol=2e-3),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2),
    torch.float32: dict(rtol=1e-5, atol=1e-4),
}
DTYPES = [torch.float16, torch.float32] + ([] if kmod.INTERPRET else [torch.bfloat16])
WEIGHTS = {  # id: (N, K, group_size, symmetric, act-order); N and K are not multiples of the tiles
    "g32-asym": (40, 96, 32, False, False),
    "g64-sym": (40, 128, 64, True, False),
    "g128-asym": (40, 256, 128, False, False),
    "channel-asym": (40, 96, None, False, False),
    "channel-sym": (40, 96, None, True, False),
    "g32-actorder-asym": (40, 96, 32, False, True),
    "g64-actorder-sym": (40, 128, 64, True, True),
}


def make_weight(n, k, group_size, symmetric, act_order, scale_dtype, seed=0):
    """(w_packed, scales, zeros, g_idx) of a random [n, k] weight, as a checkpoint holds them."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * (1 + 3 * torch.rand(n, 1, generator=gen))
    args = QuantArgs(
        num_bits=4, symmetric=symmetric, strategy="group" if group_size else "channel", group_size=group_size
    )
    g_idx = None
    cols = torch.arange(k)
    if act_order:  # every group holds group_size columns, scattered over the row
        g_idx = (torch.randperm(k, generator=gen) // group_size).to(torch.int32)
        cols = torch.argsort(g_idx, stable=True)
    scales, zeros = compute_qparams(w[:, cols], args, scale_dtype)  # groups of the sorted columns
    if symmetric:  # every other row mirrored: the negative scales a full-range grid may store
        scales = torch.where(torch.arange(n)[:, None] % 2 == 1, -scales, scales)
    q = quantize(w, scales, zeros, args, g_idx)
    to = lambda t: None if t is None else t.to(DEVICE)  # noqa: E731
    return to(pack(q)), to(scales), to(zeros), to(g_idx)


def make_x(shape, dtype, seed=1):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("weight", WEIGHTS.values(), ids=WEIGHTS.keys())
@pytest.mark.parametrize("m", [1, 3, 16, 33])
def test_int4_gemm_matches_the_twin(m, weight, dtype):
    n, k, group_size, symmetric, act_order = weight
    w_packed, scales, zeros, g_idx = make_weight(n, k, group_size, symmetric, act_order, dtype)
    x = make_x((m, k), dtype)
    y = int4_gemm(x, w_packed, scales, zeros, group_size, g_idx)
    assert y.shape == (m, n) and y.dtype == dtype
    torch.testing.assert_close(y, reference.int4_gemm(x, w_packed, scales, zeros, group_size, g_idx), **TOL[dtype])


@pytest.mark.parametrize(
    "x_dtype, scale_dtype", [(torch.float32, torch.float16), (torch.float16, torch.float32)], ids=["x32-s16", "x16-s32"]
)
def test_scales_in_another_dtype_than_x(x_dtype, scale_dtype):
    w_packed, scales, zeros, _ = make_weight(40, 96, 32, False, False, scale_dtype)
    x = make_x((5, 96), x_dtype)
    torch.testing.assert_close(
        int4_gemm(x, w_packed, scales, zeros, 32), reference.int4_gemm(x, w_packed, scales, zeros, 32), **TOL[x_dtype]
    )


def test_leading_dimensions_and_a_non_contiguous_x():
    w_packed, scales, zeros, g_idx = make_weight(40, 96, 32, False, True, torch.float16)
    x = make_x((96, 3, 2), torch.float16).permute(2, 1, 0)  # [2, 3, 96], not contiguous
    y = int4_gemm(x, w_packed, scales, zeros, 32, g_idx)
    assert y.shape == (2, 3, 40)
    torch.testing.assert_close(y, reference.int4_gemm(x, w_packed, scales, zeros, 32, g_idx), **TOL[torch.float16])
    assert int4_gemm(x[:0], w_packed, scales, zeros, 32, g_idx).shape == (0, 3, 40)


@pytest.mark.parametrize("split_k", [2, 3])
@pytest.mark.parametrize("m", [1, 5])
def test_split_k(m, split_k):
    """Split-K (chosen by the launcher for small M on a GPU) gives the twin's result too."""
    w_packed, scales, zeros, g_idx = make_weight(40, 256, 64, False, True, torch.float16)
    x = make_x((m, 256), torch.float16)
    y = kmod._launch(x, w_packed, scales, zeros, 64, g_idx, split_k)
    assert y.dtype == torch.float16
    torch.testing.assert_close(y, reference.int4_gemm(x, w_packed, scales, zeros, 64, g_idx), **TOL[torch.float16])


def _bad_args():
    """(id, changes to the good arguments, words the message must contain)."""
    return [
        ("x-width", dict(x=make_x((2, 64), torch.float16)), "x's last dimension is 64"),
        ("x-dtype", dict(x=make_x((2, 96), torch.float16).to(torch.int32)), "x must be float16"),
        ("w-dtype", dict(w_packed=torch.zeros(40, 12, dtype=torch.int64, device=DEVICE)), "w_packed must be int32"),
        ("group-size", dict(group_size=40), "group_size 40 does not divide the input width 96"),
        (
            "scales-shape",
            dict(scales=torch.ones(40, 2, dtype=torch.float16, device=DEVICE)),
            "scales must be float [40, 3]",
        ),
        ("zeros-dtype", dict(zeros=torch.zeros(40, 3, dtype=torch.int32, device=DEVICE)), "zeros must be int8 [40, 3]"),
        ("g_idx-shape", dict(g_idx=torch.zeros(95, dtype=torch.int32, device=DEVICE)), "g_idx must be int32 [96]"),
    ]


@pytest.mark.parametrize("case", _bad_args(), ids=lambda c: c[0])
def test_bad_arguments_name_what_is_wrong(case):
    _, changes, words = case
    w_packed, scales, zeros, _ = make_weight(40, 96, 32, False, False, torch.float16)
    args = (
        dict(x=make_x((2, 96), torch.float16), w_packed=w_packed, scales=scales, zeros=zeros, group_size=32, g_idx=None)
        | changes
    )
    with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
        int4_gemm(**args)


def test_refuses_cpu_tensors_outside_the_interpreter(monkeypatch):
    monkeypatch.setattr(kmod, "INTERPRET", False)
    w_packed, scales, zeros, _ = make_weight(40, 96, 32, False, False, torch.float16)
    x = make_x((2, 96), torch.float16).cpu()
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        int4_gemm(x, w_packed.cpu(), scales.cpu(), zeros.cpu(), 32)


@pytest.mark.skipif(not kmod.INTERPRET, reason="bf16 runs on a GPU")
def test_refuses_bf16_under_the_interpreter():
    w_packed, scales, zeros, _ = make_weight(40, 96, 32, False, False, torch.bfloat16)
    with pytest.raises(ValueError, match="bfloat16 x is not supported under TRITON_INTERPRET=1"):
        int4_gemm(make_x((2, 96), torch.bfloat16), w_packed, scales, zeros, 32)
