import pytest
import torch

from quantkit.formats.float_quantized import compress, param_info
from quantkit.primitives import compute_qparams, dequantize, fake_quantize
from quantkit.scheme import preset


@pytest.mark.parametrize("name", ["fp8-dynamic", "fp8"])
def test_compress_shapes_and_exact_values(name):
    args = preset(name).weights
    w = torch.randn(24, 40)
    scale, _ = compute_qparams(w, args)
    fq = fake_quantize(w, args, scale)
    static = name == "fp8"
    tensors = compress(fq, scale, args, torch.tensor(0.5) if static else None)
    info = param_info(24, 40, args, static)
    assert {k: (tuple(v.shape), v.dtype) for k, v in tensors.items()} == {
        k: (tuple(s), d) for k, (s, d) in info.items()
    }
    assert torch.equal(dequantize(tensors["weight"], tensors["weight_scale"], None, args), fq)
