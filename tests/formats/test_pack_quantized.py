import pytest
import torch

from quantkit.formats.pack_quantized import compress, decompress_ints, param_info
from quantkit.packing import pack, unpack
from quantkit.primitives import compute_qparams, fake_quantize
from quantkit.scheme import QuantArgs


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


@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("strategy,group", [("group", 32), ("channel", None)])
def test_compress_decompress_is_bit_exact(sym, strategy, group):
    w = torch.randn(24, 64)
    args = QuantArgs(4, symmetric=sym, strategy=strategy, group_size=group)
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
