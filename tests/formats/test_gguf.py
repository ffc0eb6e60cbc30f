"""GGUF block types: pack → unpack gives back every stored integer; our dequantization
equals the `gguf` package's (llama.cpp's gguf-py) bit for bit; the parameter search is no
worse than llama.cpp's reference rounding."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from quantkit.errors import QuantkitError
from quantkit.formats import gguf
from quantkit.formats.gguf_pack import pack, unpack

quants = pytest.importorskip("gguf.quants", reason="the gguf package (llama.cpp's gguf-py) is not installed")


def _weights(rows=6, cols=512, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * 0.05
    w[1] *= 40  # a row of large weights
    w[2, :64] = 0  # an all-zero block
    w[3, 32:64] = 0.01  # a constant sub-block
    w[4] = w[4].abs()  # no negative weight
    return w


@pytest.mark.parametrize("name", list(gguf.TYPES))
def test_pack_unpack_round_trip_is_exact(name):
    t = gguf.TYPES[name]
    b = gguf.choose(_weights(), t)
    data = pack(b)
    assert data.dtype == np.uint8 and data.shape == (6, 512 // t.block * t.nbytes)
    back = unpack(t, data, 512)
    assert torch.equal(back.q, b.q)
    assert torch.equal(gguf.dequantize(back), gguf.dequantize(b))
    assert b.q.min() >= t.qmin and b.q.max() <= t.qmax


@pytest.mark.parametrize("name", list(gguf.TYPES))
def test_our_values_are_gguf_py_dequantization(name):
    t = gguf.TYPES[name]
    data = pack(gguf.choose(_weights(seed=1), t))
    theirs = quants.dequantize(data, quants.GGMLQuantizationType(t.ggml)).astype(np.float32)
    assert torch.equal(gguf.dequantize(unpack(t, data, 512)), torch.from_numpy(theirs))


@pytest.mark.parametrize("name", ["q8_0", "q4_0", "q4_1", "q5_0", "q5_1"])
def test_search_beats_llama_cpp_reference_rounding(name):
    # gguf-py's quantize is llama.cpp's reference (min-max) rounding; ours searches scales
    t = gguf.TYPES[name]
    w = _weights(rows=64, seed=2)
    w[1] /= 40
    ref = quants.dequantize(quants.quantize(w.numpy(), quants.GGMLQuantizationType(t.ggml)), t.ggml)
    ref_err = ((torch.from_numpy(ref) - w) ** 2).sum()
    ours = ((gguf.dequantize(gguf.choose(w, t)) - w) ** 2).sum()
    assert ours < ref_err


def test_importance_moves_error_to_unimportant_columns():
    t = gguf.TYPES["q4_k"]
    w = _weights(rows=32, seed=3)
    imp = torch.ones(512)
    imp[::2] = 100.0
    plain = (gguf.dequantize(gguf.choose(w, t)) - w) ** 2
    weighted = (gguf.dequantize(gguf.choose(w, t, imp)) - w) ** 2
    assert weighted[:, ::2].sum() < plain[:, ::2].sum()


def test_codes_round_to_the_nearest_grid_point():
    t = gguf.TYPES["q5_k"]
    w = _weights(seed=4)
    b = gguf.choose(w, t)
    values = gguf.dequantize(b)
    s, m = gguf.grid(b)
    s = s.repeat_interleave(t.sub, -1)
    inside = (values - w).abs() <= s / 2 * (1 + 1e-5) + 1e-7
    clamped = (b.q == t.qmin) | (b.q == t.qmax)
    assert (inside | clamped).all()


def test_a_row_that_does_not_fill_blocks_is_refused():
    with pytest.raises(QuantkitError, match="multiple of 256"):
        gguf.choose(torch.zeros(2, 576), gguf.TYPES["q4_k"])
