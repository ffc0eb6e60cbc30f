import pytest
import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32
from compressed_tensors.quantization import QuantizationArgs, preset_name_to_scheme

from quantkit.formats.pack_quantized import compress, decompress_ints, param_info
from quantkit.packing import pack, unpack
from quantkit.primitives import compute_qparams, fake_quantize
from quantkit.scheme import QuantArgs, from_quantization_config, preset, to_quantization_config


def spec_unpack_int4(word: int) -> list[int]:
    """The layout as documented: element j of a word sits in bits [4j, 4j+4), stored as value + 8."""
    u = word & 0xFFFFFFFF
    return [((u >> (4 * j)) & 0xF) - 8 for j in range(8)]


def test_layout_matches_the_description():
    q = torch.tensor([[-8, -7, 0, 1, 2, 5, 6, 7, 3, 3, 3, 3, 3, 3, 3, -1]], dtype=torch.int8)
    words = pack(q)
    assert words.dtype == torch.int32 and words.shape == (1, 2)
    assert spec_unpack_int4(int(words[0, 0])) == [-8, -7, 0, 1, 2, 5, 6, 7]
    assert spec_unpack_int4(int(words[0, 1])) == [3, 3, 3, 3, 3, 3, 3, -1]
    # the first word by hand: nibbles (value + 8) = 0,1,8,9,10,13,14,15 from the low end
    assert int(words[0, 0]) & 0xFFFFFFFF == 0xFEDA9810


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("dim", [0, 1])
def test_pack_unpack_round_trip(bits, dim):
    g = torch.Generator().manual_seed(bits)
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1))
    q = torch.randint(lo, hi, (13, 40), generator=g, dtype=torch.int8)  # 13 rows: not a multiple of 8
    n = q.shape[dim]
    assert torch.equal(unpack(pack(q, bits, dim), n, bits, dim), q)


def test_zero_points_pack_along_output_dim():
    zp = torch.randint(-8, 8, (12, 3), dtype=torch.int8)
    packed = pack(zp, 4, dim=0)
    assert packed.shape == (2, 3)  # ceil(12 / 8) words per column
    assert spec_unpack_int4(int(packed[0, 1])) == zp[:8, 1].tolist()
    assert spec_unpack_int4(int(packed[1, 1]))[:4] == zp[8:, 1].tolist()


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("dim", [0, 1])
def test_packing_is_compressed_tensors_pack_to_int32_word_for_word(bits, dim):
    """Their dense bit stream: 3 (5, 6, 7) bits straddle words; 1, 2, 4, 8 bits never do."""
    g = torch.Generator().manual_seed(bits)
    q = torch.randint(-(1 << (bits - 1)), 1 << (bits - 1), (13, 75), generator=g).to(torch.int8)
    ours = pack(q, bits, dim)
    assert torch.equal(ours, pack_to_int32(q, bits, dim))
    assert torch.equal(unpack(ours, q.shape[dim], bits, dim), q)
    if dim == 1:  # their unpack of a dim-0 int4 tensor fails on a strided view (0.20.1)
        assert torch.equal(unpack_from_int32(ours, bits, q.shape, dim), q)


def test_int3_layout_by_hand():
    """32 values in 3 words; value 10 sits in bits 30-31 of word 0 and bit 0 of word 1."""
    q = torch.zeros(1, 32, dtype=torch.int8) - 4  # stored as 0
    q[0, 0], q[0, 10], q[0, 31] = 3, 2, -3  # stored as 7, 6 (0b110), 1
    words = pack(q, 3)
    assert words.shape == (1, 3)
    w = [int(x) & 0xFFFFFFFF for x in words[0]]
    assert w[0] == 7 | (0b10 << 30) and w[1] == 0b1 and w[2] == 1 << 29


@pytest.mark.parametrize("name, ct_name", [("w3a16", "W3A16"), ("w4afp8", "W4AFP8")])
def test_int_presets_are_compressed_tensors(name, ct_name):
    """The config group reads back as compressed-tensors' preset; both write pack-quantized
    (w4afp8: explicitly, see docs/formats.md, as vLLM's W4A8Fp8 reads weight_packed)."""
    qc = to_quantization_config(preset(name))
    group, reference = qc["config_groups"]["group_0"], preset_name_to_scheme(ct_name, ["Linear"])
    keys = ("num_bits", "type", "symmetric", "group_size", "strategy", "dynamic")
    for part in ("weights", "input_activations"):
        ref = getattr(reference, part)
        ours = QuantizationArgs.model_validate(group[part]) if group[part] else None
        assert (ours is None) == (ref is None) and (
            ref is None or all(getattr(ours, k) == getattr(ref, k) for k in keys)
        )
    assert qc["format"] == group["format"] == "pack-quantized"
    assert from_quantization_config(qc).schemes[0].input_activations == preset(name).input_activations


@pytest.mark.parametrize("bits", [4, 3])
@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("strategy,group", [("group", 32), ("channel", None)])
def test_compress_decompress_is_bit_exact(sym, strategy, group, bits):
    w = torch.randn(24, 64)
    args = QuantArgs(bits, symmetric=sym, strategy=strategy, group_size=group)
    scale, zero = compute_qparams(w, args, torch.float16)
    fq = fake_quantize(w, args, scale, zero)
    tensors = compress(fq, scale, zero, args)
    info = param_info(24, 64, args, torch.float16)
    assert {k: (tuple(v.shape), v.dtype) for k, v in tensors.items()} == {
        k: (tuple(s), d) for k, (s, d) in info.items()
    }
    q, s, z, g_idx = decompress_ints(tensors, args)
    from quantkit.primitives import quantize

    assert torch.equal(q, quantize(fq, scale, zero, args))
    assert torch.equal(s, scale) and g_idx is None
    assert (z is None) == sym and (sym or torch.equal(z, zero))
