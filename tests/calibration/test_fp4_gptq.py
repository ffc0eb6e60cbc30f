"""GPTQ (and AWQ's clip search) on the fp4 grids (NVFP4: e2m1 with fp8 group scales under a global scale; MXFP4: e2m1
with power-of-two group scales): the column loop rounds with the format's own quantizer, so
with an identity Hessian it returns round-to-nearest exactly (`primitives`, itself checked
against compressed-tensors), and under a real Hessian it lowers the output error; stacked
q/k/v share one NVFP4 global scale."""

import pytest
import torch

from quantkit.calibration.gptq import accumulate_hessian, quantize_weight
from quantkit.primitives import compute_qparams, fake_quantize, nvfp4_global_scale
from quantkit.scheme import preset

ARGS = {name: preset(name).weights for name in ("nvfp4a16", "mxfp4a16")}


def _layer(seed=0, tokens=512, d=128, out=96):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(tokens, 32, generator=g) @ torch.randn(32, d, generator=g) / 4
    X += 0.5 * torch.randn(tokens, d, generator=g)
    X[:, :4] *= 8
    return X, torch.randn(out, d, generator=g) * 0.02


@pytest.mark.parametrize("name", ARGS)
def test_identity_hessian_equals_rtn(name):
    args = ARGS[name]
    W = torch.randn(64, 128, generator=torch.Generator().manual_seed(1)) * 0.05
    res = quantize_weight(W, torch.eye(128), args, damp=0.3, refine=1)
    assert torch.equal(res.weight, fake_quantize(W, args))
    assert torch.equal(res.scale, compute_qparams(W, args)[0])
    assert (res.global_scale is not None) == (name == "nvfp4a16")


@pytest.mark.parametrize("actorder", [None, "static"])
@pytest.mark.parametrize("name", ARGS)
def test_gptq_beats_rtn_on_output_error(name, actorder):
    # measured 0.36-0.40 (nvfp4 and mxfp4, act-order none or static) over seeds 0-3
    args = ARGS[name]
    X, W = _layer()
    H, _ = accumulate_hessian(None, X, 0)
    res = quantize_weight(W, H, args, actorder=actorder, refine=2)
    rtn = fake_quantize(W, args)
    ratio = ((W - res.weight) @ X.T).norm() / ((W - rtn) @ X.T).norm()
    assert ratio < 0.7


def test_stacked_linears_share_the_nvfp4_global_scale():
    X, W = _layer()
    H, _ = accumulate_hessian(None, X, 0)
    W[:32] *= 4  # "q" has the largest weights: its global scale is the stack's
    res = quantize_weight(W, H, ARGS["nvfp4a16"])
    assert torch.equal(res.global_scale, nvfp4_global_scale(W[:32].abs().max()))
    fp8 = (res.scale * res.global_scale).to(torch.float8_e4m3fn).float()
    assert fp8.max() <= 448 and torch.equal(res.scale, fp8 / res.global_scale)  # the stored fp8 scales, exactly


@pytest.mark.parametrize("name", ["nvfp4a16", "mxfp4a16"])
def test_awq_clip_search_on_the_fp4_grid_never_loses_to_rtn(name):
    from quantkit.calibration.awq import clip_inputs, clip_qparams, search_clip

    args = ARGS[name]
    X, W = _layer()
    W[:, 7] *= 6  # a column of outliers, worth clipping
    inputs = clip_inputs(X, args)
    gs = nvfp4_global_scale(W.abs().max()) if name == "nvfp4a16" else None
    ranges = search_clip(W, inputs, args, grid=10, global_scale=gs)  # scored under the global scale it is stored with
    q = fake_quantize(W, args, *clip_qparams(W, ranges, args, global_scale=gs))
    rtn = fake_quantize(W, args, *compute_qparams(W, args, global_scale=gs))
    assert ((W - q) @ X.T).norm() <= ((W - rtn) @ X.T).norm()


@pytest.mark.parametrize("name", ARGS)
def test_gptq_range_search_on_the_fp4_grid(name):
    """GPTQ's range search (each group's range searched under its block of H when the group
    starts) on the fp4 grids: less output error than min-max ranges, and NVFP4's scales are
    still the fp8 ones stored under the weight's global scale."""
    args = ARGS[name]
    X, W = _layer(seed=2)
    W[:, 7] *= 6  # a column of outliers, worth clipping
    H, _ = accumulate_hessian(None, X, 0)
    plain = quantize_weight(W, H, args, actorder="static", refine=0)
    searched = quantize_weight(W, H, args, actorder="static", refine=0, range_search=True)
    err = {k: ((W - r.weight) @ X.T).norm() for k, r in (("plain", plain), ("searched", searched))}
    assert err["searched"] < 0.97 * err["plain"], err
    if name == "nvfp4a16":
        gs = searched.global_scale
        assert torch.equal(gs, nvfp4_global_scale(W.abs().max()))
        fp8 = (searched.scale * gs).to(torch.float8_e4m3fn).float()
        assert torch.equal(searched.scale, fp8 / gs)
