import dataclasses

import pytest
import torch

from quantkit.formats.int_quantized import compress, param_info, unsupported
from quantkit.primitives import compute_qparams, dequantize, fake_quantize, quantize
from quantkit.scheme import QuantArgs, preset


@pytest.mark.parametrize("strategy", ["channel", "tensor"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compress_shapes_and_exact_round_trip(strategy, dtype):
    args = QuantArgs(num_bits=8, type="int", strategy=strategy, group_size=None)
    w = (torch.randn(24, 40) * 3).to(dtype)
    scale, _ = compute_qparams(w, args, dtype)
    fq = fake_quantize(w, args, scale)
    tensors = compress(fq, scale, args)
    info = param_info(24, 40, args, dtype)
    assert {k: (tuple(v.shape), v.dtype) for k, v in tensors.items()} == {
        k: (tuple(s), d) for k, (s, d) in info.items()
    }
    q = tensors["weight"]
    assert q.dtype == torch.int8 and q.min() >= -128 and q.max() <= 127
    assert torch.equal(dequantize(q, tensors["weight_scale"], None, args), fq)  # unpack: exactly the fake-quantized
    assert torch.equal(quantize(fq, scale, None, args), q)  # and back: the same ints


def test_the_preset_is_compressed_tensors_w8a8():
    w8a8 = preset("w8a8")
    assert w8a8.format == "int-quantized" and unsupported(w8a8) is None
    w, a = w8a8.weights.to_dict(), w8a8.input_activations.to_dict()
    assert {k: w[k] for k in ("num_bits", "type", "symmetric", "strategy", "dynamic")} == {
        "num_bits": 8,
        "type": "int",
        "symmetric": True,
        "strategy": "channel",
        "dynamic": False,
    }
    assert {k: a[k] for k in ("num_bits", "type", "symmetric", "strategy", "dynamic")} == {
        "num_bits": 8,
        "type": "int",
        "symmetric": True,
        "strategy": "token",
        "dynamic": True,
    }


def test_compressed_tensors_reads_the_preset_as_its_own_w8a8():
    ct = pytest.importorskip("compressed_tensors.quantization")
    from quantkit.scheme import to_quantization_config

    group = to_quantization_config(preset("w8a8"))["config_groups"]["group_0"]
    theirs = ct.preset_name_to_scheme("W8A8", ["Linear"])
    ours = ct.QuantizationScheme(targets=["Linear"], **{k: group[k] for k in ("weights", "input_activations")})
    for part in ("weights", "input_activations"):
        mine, ref = getattr(ours, part), getattr(theirs, part)
        for field in ("num_bits", "type", "symmetric", "strategy", "group_size", "dynamic"):
            assert getattr(mine, field) == getattr(ref, field), (part, field)


@pytest.mark.parametrize(
    "weights, acts, reason",
    [
        (dict(strategy="group", group_size=128), {}, "not groups of 128"),
        (dict(num_bits=4), {}, "not int4 weights"),
        (dict(symmetric=False), {}, "symmetric"),
        ({}, dict(dynamic=False, strategy="tensor"), "per token at run time"),
        (dict(actorder="group"), {}, "act-order 'group'"),
    ],
)
def test_what_w8a8_does_not_take(weights, acts, reason):
    w8a8 = preset("w8a8")
    scheme = w8a8.replace(
        weights=dataclasses.replace(w8a8.weights, **weights),
        input_activations=dataclasses.replace(w8a8.input_activations, **acts),
    )
    assert reason in unsupported(scheme)


@pytest.mark.parametrize("symmetric", [True, False])
def test_int4_stored_as_int8_repacks_to_the_same_values(symmetric):
    """Another tool's int-quantized int4 (one int8 per value, zero points [out, groups] when
    asymmetric) as pack-quantized: the same values and zero points, unpacked again."""
    from quantkit.formats.int_quantized import as_pack_quantized
    from quantkit.formats.pack_quantized import decompress_ints

    args = QuantArgs(num_bits=4, type="int", symmetric=symmetric, strategy="group", group_size=32)
    g = torch.Generator().manual_seed(0)
    q = torch.randint(-8, 8, (24, 64), generator=g, dtype=torch.int8)
    tensors = {"l.weight": q.clone(), "l.weight_scale": torch.rand(24, 2)}
    if not symmetric:
        tensors["l.weight_zero_point"] = torch.randint(-8, 8, (24, 2), generator=g, dtype=torch.int8)
    zp = tensors.get("l.weight_zero_point")
    as_pack_quantized(tensors, "l", args)
    assert "l.weight" not in tensors and tensors["l.weight_packed"].dtype == torch.int32
    values, scale, zero_point, _ = decompress_ints({k.removeprefix("l."): v for k, v in tensors.items()}, args)
    assert torch.equal(values, q) and scale is tensors["l.weight_scale"]
    assert zero_point is None if symmetric else torch.equal(zero_point, zp)
    with pytest.raises(ValueError, match="l.weight is missing"):
        as_pack_quantized({}, "l", args)
    with pytest.raises(ValueError, match="not int4 values"):
        as_pack_quantized({"l.weight": q.clone().fill_(8), "l.weight_scale": torch.rand(24, 2)}, "l", args)
