import pytest
import torch
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.quantization.lifecycle.forward import fake_quantize as ct_fake_quantize

from quantkit.errors import QuantkitError
from quantkit.primitives import (
    FP8_MAX,
    check_group_size,
    compute_qparams,
    dequantize,
    fake_quantize,
    quantize,
    sqnr,
)
from quantkit.scheme import QuantArgs

INT_ARGS = [
    QuantArgs(4, symmetric=True, strategy="group", group_size=32),
    QuantArgs(4, symmetric=False, strategy="group", group_size=32),
    QuantArgs(4, symmetric=True, strategy="channel", group_size=None),
    QuantArgs(4, symmetric=False, strategy="channel", group_size=None),
    QuantArgs(8, symmetric=True, strategy="tensor", group_size=None),
    QuantArgs(8, symmetric=False, strategy="group", group_size=64),
]
FP8_ARGS = [QuantArgs(8, "float", strategy=s, group_size=None) for s in ("tensor", "channel", "token")]


def weight(out=48, inp=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, inp, generator=g) * 0.05
    w[:, 3] *= 20  # an outlier input channel
    return w


@pytest.mark.parametrize("args", INT_ARGS + FP8_ARGS, ids=str)
def test_quantize_dequantize_quantize_is_exact(args):
    w = weight()
    scale, zero = compute_qparams(w, args)
    q = quantize(w, scale, zero, args)
    again = quantize(dequantize(q, scale, zero, args), scale, zero, args)
    assert torch.equal(q.view(torch.int8), again.view(torch.int8))
    if args.type == "int":
        assert q.dtype == torch.int8 and q.min() >= args.qmin and q.max() <= args.qmax
    else:
        assert q.dtype == torch.float8_e4m3fn


@pytest.mark.parametrize("args", INT_ARGS + FP8_ARGS, ids=str)
def test_fake_quantize_is_idempotent(args):
    w = weight()
    once = fake_quantize(w, args)
    scale, zero = compute_qparams(w, args)
    assert torch.equal(fake_quantize(once, args, scale, zero), once)


def test_symmetric_int4_formula():
    w = torch.tensor([[-1.5, 0.2, 0.75, 1.0]])
    args = QuantArgs(4, strategy="channel", group_size=None)
    scale, zero = compute_qparams(w, args)
    assert zero is None and scale.item() == pytest.approx(1.5 / 7.5)
    assert quantize(w, scale, zero, args).tolist() == [[-8, 1, 4, 5]]  # round(0.75/0.2)=round(3.75)=4


def test_asymmetric_int4_formula():
    w = torch.tensor([[0.1, 0.4, 1.6]])  # min widened to 0
    args = QuantArgs(4, symmetric=False, strategy="channel", group_size=None)
    scale, zero = compute_qparams(w, args)
    assert scale.item() == pytest.approx(1.6 / 15)
    assert zero.item() == -8
    assert quantize(w, scale, zero, args).tolist() == [[-7, -4, 7]]


@pytest.mark.parametrize("args", INT_ARGS[:4], ids=str)
def test_matches_compressed_tensors_grid(args):
    """Same qparams in, same fake-quantized values out as compressed-tensors."""
    w = weight()
    scale, zero = compute_qparams(w, args)
    ct_args = QuantizationArgs(
        num_bits=args.num_bits, symmetric=args.symmetric, strategy=args.strategy, group_size=args.group_size
    )
    ct_zero = zero if zero is not None else torch.zeros_like(scale, dtype=torch.int8)
    ours = fake_quantize(w, args, scale, zero)
    theirs = ct_fake_quantize(w, scale, ct_zero, ct_args)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-7)


def test_fp8_scales_and_token_strategy():
    x = weight(6, 32)
    args = QuantArgs(8, "float", strategy="token", group_size=None)
    scale, zero = compute_qparams(x, args)
    assert zero is None and scale.shape == (6, 1)
    torch.testing.assert_close(scale[:, 0], x.abs().amax(dim=1) / FP8_MAX)


def test_sqnr_floors():
    """Single-layer accuracy floors (dB) on a gaussian weight with one outlier channel."""
    w = weight(256, 256)
    floors = {
        "int4 g32 sym": (INT_ARGS[0], 15.5),
        "int4 g32 asym": (INT_ARGS[1], 19.0),
        "int8 tensor": (INT_ARGS[4], 20.0),
        "int8 g64 asym": (INT_ARGS[5], 40.0),
        "fp8 channel": (FP8_ARGS[1], 34.0),
    }
    for name, (args, floor) in floors.items():
        assert sqnr(w, fake_quantize(w, args)) > floor, name
    # grouping pays: finer groups, lower error
    coarse = sqnr(w, fake_quantize(w, INT_ARGS[2]))
    assert sqnr(w, fake_quantize(w, INT_ARGS[0])) > coarse + 3


def test_act_order_groups():
    w = weight(8, 64)
    args = QuantArgs(4, symmetric=False, strategy="group", group_size=16)
    g_idx = torch.arange(64).flip(0) // 16  # columns in reverse order
    wp = w[:, torch.arange(64).flip(0)]
    scale, zero = compute_qparams(wp, args)  # groups over the permuted order
    q = quantize(w, scale, zero, args, g_idx)
    assert torch.equal(q, quantize(wp, scale, zero, args)[:, torch.arange(64).flip(0)])


def test_zero_group_and_scale_dtype():
    w = torch.zeros(4, 32)
    for sym in (True, False):
        args = QuantArgs(4, symmetric=sym, group_size=32)
        scale, zero = compute_qparams(w, args, torch.bfloat16)
        assert scale.dtype == torch.bfloat16 and torch.isfinite(scale).all()
        assert torch.equal(fake_quantize(w, args, scale, zero), w)


def test_group_size_error_names_layer_and_fits():
    check_group_size("x", 576, 64)
    with pytest.raises(
        QuantkitError,
        match=r"group size 128 does not divide the input width 576 of "
        r"model.layers.0.mlp.up_proj; use one of 16, 32, 64",
    ):
        check_group_size("model.layers.0.mlp.up_proj", 576, 128)


GROUPED = [a for a in INT_ARGS if a.strategy != "tensor"] + [QuantArgs(3, symmetric=False)]


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("args", GROUPED, ids=str)
def test_fake_quantize_int_fast_path_is_dequantize_of_quantize(args, x_dtype, scale_dtype):
    # the broadcast fp32 path int groups and channels take equals the general one bit for bit,
    # on min-max, shrunk and negated (full-range) scales, a zero group and values ~1e-3 to ~1e2
    x = (weight(32, 128) * torch.logspace(-2, 3, 128)).to(x_dtype)
    x[5, :64] = 0
    scale, zero = compute_qparams(x, args, scale_dtype)
    for s in (scale, (scale.float() * 0.7).to(scale_dtype), (-scale.float()).to(scale_dtype)):
        general = dequantize(quantize(x, s, zero, args), s, zero, args, dtype=x_dtype)
        fast = fake_quantize(x, args, s, zero)
        assert fast.dtype == x_dtype and torch.equal(fast, general)
