"""The fp4 / MX / block fp8 numerics and packers against compressed-tensors' own code (the
reference vLLM and transformers read): E2M1 rounding, NVFP4 global and group scales, MX
power-of-two scales, 128x128 block scales, the fp4 nibble packing; bits per weight."""

import pytest
import torch
from compressed_tensors.compressors.mx_utils import compress_mx_scale
from compressed_tensors.compressors.nvfp4.helpers import pack_fp4_to_uint8, unpack_fp4_from_uint8
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.quantization.lifecycle.forward import fake_quantize as ct_fake_quantize
from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam
from compressed_tensors.quantization.utils.fp4_utils import cast_to_fp4

from quantkit.errors import QuantkitError
from quantkit.formats import fp4_packed, mx_quantized
from quantkit.formats.stored import linear_bytes, tensor_bytes
from quantkit.primitives import compute_qparams, fake_quantize, mx_exponent, nvfp4_global_scale, round_e2m1
from quantkit.scheme import QuantArgs, from_quantization_config, preset, to_quantization_config

G = torch.Generator().manual_seed(0)


def weight(out=48, inp=256):
    return torch.randn(out, inp, generator=G) * (1 + 3 * torch.rand(out, 1, generator=G))


def ct_args(name):
    return QuantizationArgs.model_validate(preset(name).weights.to_dict())


def test_e2m1_rounding_is_compressed_tensors_cast_to_fp4_bit_for_bit():
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    y = torch.cat([torch.linspace(-7, 7, 20001), ties, -ties, torch.tensor([0.0, -0.0, -0.1, 6.5])])
    ours, theirs = round_e2m1(y), cast_to_fp4(y.clone().clamp(-6, 6))
    assert torch.equal(ours, theirs) and torch.equal(torch.signbit(ours), torch.signbit(theirs))


def test_nvfp4_scales_and_values_are_compressed_tensors():
    w = weight()
    args = preset("nvfp4a16").weights
    gs = nvfp4_global_scale(w.abs().max())
    assert torch.equal(gs, generate_gparam(w.min(), w.max()))
    g = w.reshape(48, -1, 16)
    ct_scale, _ = calculate_qparams(g.amin(-1), g.amax(-1), ct_args("nvfp4a16"), global_scale=gs)
    ours, _ = compute_qparams(w, args)
    fp8 = torch.float8_e4m3fn  # the packer stores fp8(effective scale * gs): the same bytes as theirs
    assert torch.equal((ours * gs).to(fp8), ct_scale.to(fp8)) and torch.equal(ours, ct_scale / gs)
    expected = ct_fake_quantize(w, ct_scale, None, ct_args("nvfp4a16"), global_scale=gs)
    assert torch.equal(fake_quantize(w, args, ours), expected)


@pytest.mark.parametrize("name", ["mxfp4a16", "mxfp8"])
def test_mx_scales_and_values_are_compressed_tensors(name):
    w = weight()
    w[0, :32] = 0  # an all-zero group
    w[1, :32] *= 0.75 / w[1, :32].abs().max() * 7  # a group max with mantissa 1.75: rounds up
    args = preset(name).weights
    g = w.reshape(48, -1, 32)
    ct_scale, _ = calculate_qparams(g.amin(-1), g.amax(-1), ct_args(name))
    ours, _ = compute_qparams(w, args)
    assert torch.equal(ours, ct_scale)
    assert torch.equal(mx_exponent(ours), compress_mx_scale(ct_scale, torch.uint8))
    assert torch.equal(fake_quantize(w, args, ours), ct_fake_quantize(w, ct_scale, None, ct_args(name)))


def test_fp8_block_scales_cover_partial_blocks_as_compressed_tensors_pads():
    w = weight(200, 576)  # 576 = 4.5 blocks of 128 (smollm2's hidden width)
    args = preset("fp8-block").weights
    scale, _ = compute_qparams(w, args)
    assert scale.shape == (2, 5)
    assert scale[1, 4] == w[128:, 512:].abs().max() / 448  # the corner's partial block: its own elements
    expected = ct_fake_quantize(w, scale, None, ct_args("fp8-block"))
    assert torch.equal(fake_quantize(w, args, scale), expected)


def test_fp4_packing_is_compressed_tensors_and_round_trips():
    w = weight()
    args = preset("nvfp4a16").weights
    scale, _ = compute_qparams(w, args)
    gs = nvfp4_global_scale(w.abs().max())
    stored = fp4_packed.compress(w, scale, args, gs)
    q = round_e2m1(w / scale.repeat_interleave(16, 1))
    assert torch.equal(stored["weight_packed"], pack_fp4_to_uint8(q))
    assert torch.equal(
        fp4_packed.unpack_e2m1(stored["weight_packed"]),
        unpack_fp4_from_uint8(stored["weight_packed"], 48, 256, torch.float32),
    )
    assert stored["weight_scale"].dtype == torch.float8_e4m3fn and torch.equal(stored["weight_global_scale"], gs)
    assert torch.equal(fp4_packed.decompress(stored, args, torch.float32), fake_quantize(w, args, scale))


@pytest.mark.parametrize("name", ["nvfp4a16", "mxfp4a16"])
def test_a_fake_quantized_weight_packs_as_its_float_weight(name):
    """What RTN hands the packer is already fake-quantized: a small negative weight is -0.0
    there and must still pack as compressed-tensors packs the float weight (code -0)."""
    w = weight()
    w[:, :8] = -1e-4  # rounds to 0 in every group
    args = preset(name).weights
    scale, _ = compute_qparams(w, args)
    gs = nvfp4_global_scale(w.abs().max()) if name == "nvfp4a16" else None
    direct = fp4_packed.compress(w, scale, args, gs)["weight_packed"]
    again = fp4_packed.compress(fake_quantize(w, args, scale), scale, args, gs)["weight_packed"]
    assert torch.equal(direct, again)
    assert torch.equal(direct[:, :4], torch.full_like(direct[:, :4], 0x88))  # two -0 codes per byte


def test_mxfp8_round_trip():
    w = weight()
    args = preset("mxfp8").weights
    scale, _ = compute_qparams(w, args)
    stored = mx_quantized.compress(w, scale, args)
    assert stored["weight_scale"].dtype == torch.uint8 and stored["weight_scale"].shape == (48, 8)
    assert torch.equal(mx_quantized.decompress(stored, args, torch.float32), fake_quantize(w, args, scale))


@pytest.mark.parametrize(
    "name, fmt, bits",
    [
        ("nvfp4a16", "nvfp4-pack-quantized", 4 + 8 / 16),  # + the fp32 global scale
        ("mxfp4a16", "mxfp4-pack-quantized", 4 + 8 / 32),
        ("mxfp8", "mxfp8-quantized", 8 + 8 / 32),
        ("fp8-block", "float-quantized", 8 + 16 / 128 / 128),  # block scales in the model dtype (bf16 here)
    ],
)
def test_bits_per_weight(name, fmt, bits):
    s = preset(name)
    assert s.format == fmt
    out, inp = 256, 512
    stored = linear_bytes(fmt, out, inp, s.weights, 2)
    extra = 4 if name == "nvfp4a16" else 0
    assert stored * 8 / (out * inp) == pytest.approx(bits + extra * 8 / (out * inp))
    assert "weight_global_scale" in tensor_bytes(fmt, out, inp, s.weights, 2) or name != "nvfp4a16"


@pytest.mark.parametrize("name", ["fp8-block", "nvfp4a16", "nvfp4", "mxfp4a16", "mxfp4", "mxfp8"])
def test_config_groups_are_compressed_tensors_and_round_trip(name):
    s = preset(name)
    qc = to_quantization_config(s)
    group = qc["config_groups"]["group_0"]
    for part in ("weights", "input_activations"):
        if group[part] is not None:  # compressed-tensors reads each field back unchanged
            theirs = QuantizationArgs.model_validate(group[part])
            assert theirs.model_dump(
                exclude={"observer", "observer_kwargs", "zp_dtype"}
            ) == QuantizationArgs.model_validate(theirs.model_dump()).model_dump(
                exclude={"observer", "observer_kwargs", "zp_dtype"}
            )
    from compressed_tensors.quantization import preset_name_to_scheme

    ct_name = {"fp8-block": "FP8_BLOCK", "nvfp4a16": "NVFP4A16", "nvfp4": "NVFP4"}.get(name, name.upper())
    reference = preset_name_to_scheme(ct_name, ["Linear"])
    for part in ("weights", "input_activations"):
        ref = getattr(reference, part)
        ours = QuantizationArgs.model_validate(group[part]) if group[part] else None
        keys = ("num_bits", "type", "symmetric", "group_size", "strategy", "block_structure", "dynamic", "scale_dtype")
        assert (ours is None) == (ref is None) and (
            ref is None or all(getattr(ours, k) == getattr(ref, k) for k in keys)
        )
    back = from_quantization_config(qc).schemes[0]
    assert back.weights == s.weights and back.input_activations == s.input_activations and back.format == s.format


def test_fp4_args_are_checked():
    with pytest.raises(QuantkitError, match="groups of 16"):
        QuantArgs(4, "float", strategy="group", group_size=64)
    with pytest.raises(QuantkitError, match="block_structure"):
        QuantArgs(8, "float", strategy="block", group_size=None)
