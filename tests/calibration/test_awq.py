import dataclasses

import pytest
import torch

from quantkit.calibration.awq import clip_inputs, clip_qparams, fold_scales, search_clip, search_scales
from quantkit.errors import QuantkitError
from quantkit.primitives import fake_quantize
from quantkit.scheme import QuantArgs

torch.set_num_threads(1)

GROUP32 = QuantArgs(num_bits=4, symmetric=True, strategy="group", group_size=32)
CHANNEL = QuantArgs(num_bits=4, symmetric=True, strategy="channel", group_size=None)
ARGS = [
    GROUP32,
    dataclasses.replace(GROUP32, symmetric=False),
    CHANNEL,
    dataclasses.replace(CHANNEL, symmetric=False),
]
IDS = ["group32-sym", "group32-asym", "channel-sym", "channel-asym"]


def _qkv(seed=0, tokens=512, ci=128, outliers=True):
    """Inputs x [tokens, ci] (with outliers: 4 channels ~25x larger, as in LLMs) and q, k, v weights."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, ci, generator=g) * (0.5 + torch.rand(ci, generator=g))
    if outliers:
        x[:, torch.randperm(ci, generator=g)[:4]] *= 25
    weights = [torch.randn(co, ci, generator=g) * 0.02 for co in (128, 64, 64)]
    return x, weights


def _rtn_loss(x, weights, args):
    ref = torch.cat([x @ w.T for w in weights], -1)
    out = torch.cat([x @ fake_quantize(w, args).T for w in weights], -1)
    return (ref - out).pow(2).mean().item()


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("args", ARGS, ids=IDS)
def test_search_scales_beats_rtn_on_activation_outliers(args, seed):
    x, weights = _qkv(seed)
    res = search_scales(x, weights, args)
    assert len(res.losses) == 20 and res.loss == min(res.losses)
    assert res.rtn_loss == res.losses[0]
    assert res.rtn_loss == pytest.approx(_rtn_loss(x, weights, args), rel=1e-4)
    assert res.alpha > 0
    assert res.loss < 0.8 * res.rtn_loss  # measured 0.21-0.69 of RTN over seeds 0-7 and these schemes
    assert res.scales.shape == (128,) and res.scales.dtype == torch.float32


@pytest.mark.parametrize("duo", [False, True], ids=["plain", "duo"])
@pytest.mark.parametrize("outliers", [False, True], ids=["gaussian", "outliers"])
@pytest.mark.parametrize("args", ARGS, ids=IDS)
def test_search_scales_never_worse_than_rtn(args, outliers, duo):
    x, weights = _qkv(seed=3, outliers=outliers)
    res = search_scales(x, weights, args, grid=10, duo=duo)
    assert res.loss <= res.rtn_loss
    assert res.rtn_loss == pytest.approx(_rtn_loss(x, weights, args), rel=1e-4)
    if duo and outliers:
        assert res.loss < 0.8 * res.rtn_loss


@pytest.mark.parametrize("args", ARGS[:2], ids=IDS[:2])
def test_folded_and_quantized_weights_reproduce_the_chosen_loss(args):
    x, weights = _qkv(seed=4)
    res = search_scales(x, weights, args)
    norm_w = torch.ones(128)
    folded = [w.clone() for w in weights]
    fold_scales(norm_w, None, folded, res.scales)
    x_folded = x * norm_w  # the norm's output after folding: x / s
    ref = torch.cat([x @ w.T for w in weights], -1)
    out = torch.cat([x_folded @ fake_quantize(w, args).T for w in folded], -1)
    assert (ref - out).pow(2).mean().item() == pytest.approx(res.loss, rel=1e-3)


def test_output_fn_of_concatenated_outputs_matches_default():
    x, weights = _qkv(seed=5)
    args = ARGS[1]
    default = search_scales(x, weights, args)
    seen = []

    def output_fn(ws):
        seen.append([w.shape for w in ws])
        return torch.cat([x @ w.T for w in ws], -1)

    res = search_scales(x, weights, args, output_fn=output_fn)
    assert len(seen) == 21 and seen[0] == [w.shape for w in weights]  # the float output once, then 20 points
    assert res.alpha == default.alpha
    torch.testing.assert_close(res.scales, default.scales)
    torch.testing.assert_close(torch.tensor(res.losses), torch.tensor(default.losses), rtol=1e-4, atol=0)


@pytest.mark.parametrize("duo", [False, True], ids=["plain", "duo"])
def test_zero_activation_channel_gives_finite_scales(duo):
    x, weights = _qkv(seed=6)
    x[:, 7] = 0
    weights[0][:, 9] = 0  # a dead weight column too, for duo's w_mean
    res = search_scales(x, weights, ARGS[0], duo=duo)
    assert torch.isfinite(res.scales).all() and (res.scales > 0).all()
    assert all(torch.isfinite(torch.tensor(res.losses)))
    assert res.alpha > 0
    assert res.scales[7] == res.scales.min()  # the channel clamped to SCALE_MIN gets the smallest scale
    assert res.scales.max() * res.scales.min() == pytest.approx(1, rel=1e-5)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_inputs_are_refused(bad):
    x, weights = _qkv(seed=7)
    x[3, 5] = bad
    with pytest.raises(QuantkitError, match="q_k_v.*NaN or inf"):
        search_scales(x, weights, GROUP32, name="q_k_v")
    with pytest.raises(QuantkitError, match="NaN or inf"):
        clip_inputs(x, GROUP32)


def test_bad_shapes_and_schemes_are_refused():
    x, weights = _qkv(seed=8)
    with pytest.raises(QuantkitError, match="group size 48 does not divide the input width 128 of q_k_v"):
        search_scales(x, weights, dataclasses.replace(GROUP32, group_size=48), name="q_k_v")
    with pytest.raises(QuantkitError, match="cannot read inputs of width 128"):
        search_scales(x, [weights[0], weights[1][:, :64]], GROUP32)
    fp8 = QuantArgs(num_bits=8, type="float", strategy="channel", group_size=None)
    with pytest.raises(QuantkitError, match="takes int weights per group or channel"):
        search_clip(weights[0], clip_inputs(x, GROUP32), fp8)
    with pytest.raises(QuantkitError, match="groups of 64 do not fit .* in groups of 32; make them with clip_inputs"):
        search_clip(weights[0], clip_inputs(x, dataclasses.replace(GROUP32, group_size=64)), GROUP32)


def _rmsnorm(x, w, b=None, eps=1e-6):
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w
    return y if b is None else y + b


@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
def test_fold_into_norm_keeps_the_function(with_bias):
    g = torch.Generator().manual_seed(9)
    h = torch.randn(32, 64, generator=g)
    norm_w, norm_b = 1 + torch.rand(64, generator=g), (torch.randn(64, generator=g) if with_bias else None)
    weights = [torch.randn(co, 64, generator=g) for co in (64, 32)]
    s = torch.rand(64, generator=g) * 10 + 0.1

    before = [_rmsnorm(h, norm_w, norm_b) @ w.T for w in weights]
    fold_scales(norm_w, norm_b, weights, s)
    after = [_rmsnorm(h, norm_w, norm_b) @ w.T for w in weights]
    for a, b in zip(after, before):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_fold_into_linear_keeps_the_function():
    g = torch.Generator().manual_seed(10)
    h = torch.randn(32, 48, generator=g)
    gate = torch.randn(64, 48, generator=g)
    up_w, up_b = torch.randn(64, 48, generator=g), torch.randn(64, generator=g)  # prev linear [ci, c_prev]
    down = torch.randn(40, 64, generator=g)
    s = torch.rand(64, generator=g) * 10 + 0.1

    def mlp():  # down(silu(gate(h)) * up(h)): linear in up's output, as llm-awq's up -> down balance
        return (torch.nn.functional.silu(h @ gate.T) * (h @ up_w.T + up_b)) @ down.T

    before = mlp()
    fold_scales(up_w, up_b, [down], s)
    # a sum of 64 products of size ~10 that may cancel: absolute tolerance relative to the output's size
    torch.testing.assert_close(mlp(), before, rtol=1e-5, atol=1e-6 * before.abs().max().item())


def test_fold_refuses_mismatched_shapes_and_keeps_dtype():
    v, o = torch.randn(16, 64), torch.randn(64, 64)  # grouped-query attention: v_proj 16 outputs, o_proj 64 inputs
    with pytest.raises(QuantkitError, match="cannot fold 64 AWQ scales.*v_proj"):
        fold_scales(v, None, [o], torch.ones(64))
    norm_w, w = torch.ones(64, dtype=torch.bfloat16), torch.randn(8, 64, dtype=torch.bfloat16)
    fold_scales(norm_w, None, [w], torch.full((64,), 2.0))
    assert norm_w.dtype == w.dtype == torch.bfloat16 and torch.all(norm_w == 0.5)


def _group_errors(w, q, x, gs):
    """Per (row, group) mean over tokens of the squared error of the partial dot products."""
    d = (w - q).reshape(w.shape[0], -1, gs)
    return torch.einsum("ngk,ogk->ogn", x.reshape(x.shape[0], -1, gs), d).pow(2).mean(-1)


def test_clip_inputs_score_the_partial_dot_products():
    g = torch.Generator().manual_seed(13)
    x, w = torch.randn(300, 128, generator=g), torch.randn(40, 128, generator=g)
    q = fake_quantize(w, GROUP32)
    d = (w - q).reshape(40, 4, 32).transpose(0, 1)  # [n_group, co, gs]
    moments = clip_inputs(x.reshape(3, 100, 128), GROUP32)  # any leading shape; all 300 tokens
    assert moments.gram.shape == (4, 32, 32) and moments.tokens is None
    torch.testing.assert_close(moments.error(d), _group_errors(w, q, x, 32), rtol=1e-4, atol=1e-7)
    # groups wider than max_gram_width: evenly spaced tokens, scored directly
    tokens = clip_inputs(x, GROUP32, max_gram_width=16, n_tokens=100)
    assert tokens.gram is None and tokens.tokens.shape == (4, 100, 32)
    torch.testing.assert_close(tokens.error(d), _group_errors(w, q, x[::3], 32), rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("args", ARGS, ids=IDS)
def test_clip_is_never_worse_and_helps_an_outlier(args):
    g = torch.Generator().manual_seed(11)
    x = torch.randn(256, 128, generator=g) * (0.5 + torch.rand(128, generator=g))
    w = torch.randn(96, 128, generator=g) * 0.02
    x[:, 3] *= 0.05  # a quiet input channel ...
    w[0, 3] = 0.4  # ... whose weight in row 0, group 0 is a 20-sigma outlier: cheap to clip
    ranges = search_clip(w, clip_inputs(x, args), args, batch_co=32)
    gs = args.group_size or 128
    w_g = w.reshape(96, -1, gs)
    lo0, hi0 = w_g.amin(-1).clamp(max=0), w_g.amax(-1).clamp(min=0)
    assert ranges.shape == (*hi0.shape, 2)
    lo, hi = ranges.unbind(-1)
    if args.symmetric and args.strategy == "group":
        # balanced: min-max's ±r·amax; else a full-range grid's [qmin·s, qmax·s] = r·amax on the
        # group's end of larger magnitude and 7/8 of that on the other
        balanced = lo == -hi
        assert (~balanced).any()
        big, small = torch.maximum(-lo, hi), torch.minimum(-lo, hi)
        torch.testing.assert_close(small[~balanced], big[~balanced] * 7 / 8)
        assert torch.equal((-lo > hi)[~balanced], (-lo0 > hi0)[~balanced])
        lo, hi = -big, big
    if args.symmetric:
        hi0 = torch.maximum(-lo0, hi0)
        lo0 = -hi0
        assert torch.equal(lo, -hi)
    assert (hi <= hi0).all() and (hi >= 0.55 * hi0 * (1 - 1e-6)).all()  # within the ratios 1 ... 0.55
    assert (lo >= lo0).all() and (lo <= 0.55 * lo0 * (1 - 1e-6)).all()

    err_clip = _group_errors(w, fake_quantize(w, args, *clip_qparams(w, ranges, args)), x, gs)
    err_rtn = _group_errors(w, fake_quantize(w, args), x, gs)
    assert (err_clip <= err_rtn * (1 + 1e-5)).all()
    assert hi[0, 0] < 0.7 * hi0[0, 0]
    assert err_clip[0, 0] < 0.7 * err_rtn[0, 0]  # measured 0.24-0.52 over seeds 11-14 and these schemes
    assert err_clip.mean() < 0.95 * err_rtn.mean()  # measured 0.61-0.90


def test_symmetric_groups_take_the_full_range_grid_where_it_is_better():
    # uniform weights: min-max's grid clips the larger end at 7 steps of amax / 7.5; the full
    # range puts that end on -8 (a negative scale when it is the max) at a step of amax / 8
    g = torch.Generator().manual_seed(5)
    x = torch.randn(512, 128, generator=g)
    w = torch.rand(64, 128, generator=g) * 2 - 1
    inputs = clip_inputs(x, GROUP32)
    ranges = search_clip(w, inputs, GROUP32)
    scale, zero = clip_qparams(w, ranges, GROUP32)
    err = _group_errors(w, fake_quantize(w, GROUP32, scale, zero), x, 32)
    best_balanced = None  # the search over min-max grids alone, by hand
    amax = w.reshape(64, 4, 32).abs().amax(-1)
    for r in [1 - i / 20 for i in range(10)]:
        e = _group_errors(
            w, fake_quantize(w, GROUP32, *clip_qparams(w, torch.stack((-r * amax, r * amax), -1), GROUP32)), x, 32
        )
        best_balanced = e if best_balanced is None else torch.minimum(best_balanced, e)
    assert (err <= best_balanced * (1 + 1e-5)).all()
    assert err.mean() < 0.97 * best_balanced.mean()  # measured 0.90-0.93 over seeds 0-5
    full = ranges[..., 0] != -ranges[..., 1]
    assert full.float().mean() > 0.3  # measured 0.43-0.45 over seeds 0-4
    w_g = w.reshape(64, 4, 32)
    max_is_larger = w_g.amax(-1) >= -w_g.amin(-1)
    assert torch.equal((scale < 0)[full], max_is_larger[full])  # the larger end on code -8


def test_asymmetric_clip_moves_each_end_on_its_own():
    # every group has a large positive outlier on a quiet channel and an ordinary negative side:
    # shrinking both ends together also cuts the negative side, the upper end alone does not
    g = torch.Generator().manual_seed(14)
    x = torch.randn(512, 128, generator=g)
    x[:, ::32] *= 0.05
    w = torch.randn(64, 128, generator=g) * 0.02
    w[:, ::32] = 0.3
    args = ARGS[1]
    inputs = clip_inputs(x, args)
    together, separate = search_clip(w, inputs, args, rounds=0), search_clip(w, inputs, args)
    err = lambda r: _group_errors(w, fake_quantize(w, args, *clip_qparams(w, r, args)), x, 32)  # noqa: E731
    assert (err(separate) <= err(together) * (1 + 1e-5)).all()
    assert err(separate).mean() < 0.9 * err(together).mean()  # measured 0.72
    w_g = w.reshape(64, 4, 32)
    lo_ratio, hi_ratio = separate[..., 0] / w_g.amin(-1), separate[..., 1] / w_g.amax(-1)
    assert (hi_ratio < lo_ratio - 0.1).float().mean() > 0.5  # the outlier's end shrinks further (0.62)


def test_clip_batches_are_deterministic():
    g = torch.Generator().manual_seed(12)
    x, w = torch.randn(1000, 64, generator=g), torch.randn(80, 64, generator=g)
    args = ARGS[1]
    inputs = clip_inputs(x, args)
    a = search_clip(w, inputs, args, batch_co=256)
    assert torch.equal(a, search_clip(w, inputs, args, batch_co=256))
    torch.testing.assert_close(search_clip(w, inputs, args, batch_co=16), a)


def test_clip_qparams_clamp_each_group_to_its_range():
    w = torch.tensor([[1.0, -3.0, 0.5, 2.0]])
    args = QuantArgs(num_bits=4, symmetric=False, strategy="group", group_size=2)
    ranges = torch.tensor([[[-1.5, 1.5], [0.0, 1.0]]])
    scale, zero = clip_qparams(w, ranges, args)
    torch.testing.assert_close(scale, torch.tensor([[3.0 / 15, 1.0 / 15]]))
    q = fake_quantize(w, args, scale, zero)
    assert q[0, 1] == pytest.approx(-1.6, abs=0.11) and q[0, 3] == pytest.approx(1.0)  # clamped at the grid's ends
    assert q[0, 2] == pytest.approx(0.5, abs=1 / 30)  # inside the range: rounded to nearest
    with pytest.raises(QuantkitError, match="do not fit"):
        clip_qparams(w, torch.ones(1, 2), args)


@pytest.mark.parametrize("args", ARGS, ids=IDS)
def test_search_scales_stride_scores_fewer_points_and_finds_a_single_dip(args):
    # stride 3 over 20 points scores 0, 3, ..., 18 and the points between the best one's
    # neighbours: the grid's best when the loss falls and rises once (these curves do)
    x, weights = _qkv(seed=1)
    full = search_scales(x, weights, args)
    strided = search_scales(x, weights, args, stride=3)
    scored = [i for i, v in enumerate(strided.losses) if v == v]
    assert 7 < len(scored) <= 11 and set(range(0, 20, 3)) <= set(scored)
    assert all(strided.losses[i] == full.losses[i] for i in scored)
    assert strided.alpha == full.alpha and torch.equal(strided.scales, full.scales)
    assert search_scales(x, weights, args, stride=1).losses == full.losses
    assert search_scales(x, weights, args, grid=4, stride=9).alpha == search_scales(x, weights, args, grid=4).alpha


def test_search_scales_stride_must_be_positive():
    x, weights = _qkv(seed=0)
    with pytest.raises(QuantkitError, match="stride >= 1"):
        search_scales(x, weights, GROUP32, stride=0)


def test_search_scales_forms_an_inputs_gram_once_and_again_after_it_changes(monkeypatch):
    # the sensitivity searches one captured input once per format: XᵀX is kept per tensor and
    # version, so a second search reads it, and a search after the tensor changed in place
    # forms it again (the same losses as a fresh copy's)
    from quantkit.calibration import awq

    x, weights = _qkv(seed=2)
    formed = []
    monkeypatch.setattr(awq, "_GRAMS", awq.WeakIdKeyDictionary())
    real = torch.Tensor.__matmul__

    def counted(a, b):
        formed.append(a.shape == (128, 512) and b.shape == (512, 128))
        return real(a, b)

    monkeypatch.setattr(torch.Tensor, "__matmul__", counted)
    first = search_scales(x, weights, GROUP32, stride=3)
    again = search_scales(x, weights, ARGS[1], stride=3)
    assert sum(formed) == 1 and again.losses == search_scales(x.clone(), weights, ARGS[1], stride=3).losses
    x[:, :8] *= 3
    changed = search_scales(x, weights, GROUP32, stride=3)
    assert sum(formed) == 3  # once for the clone above, once after the change
    assert changed.losses == search_scales(x.clone(), weights, GROUP32, stride=3).losses != first.losses
