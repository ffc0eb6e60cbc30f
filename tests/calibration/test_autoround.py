"""AutoRound (calibration/autoround.py): round-to-nearest at the start and never worse than it,
the STE path against the exact codes, the float targets, a packed checkpoint, the command."""

import dataclasses
import json

import pytest
import torch
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

import quantkit
from quantkit.calibration import autoround
from quantkit.calibration.autoround import BlockData, Rounding, learn_block
from quantkit.calibration.registry import METHODS
from quantkit.calibration.runner import capture_block_inputs, run_blocks
from quantkit.cli import app
from quantkit.models.arch import arch_for
from quantkit.pipeline.quantize import pack_model
from quantkit.primitives import compute_qparams, fake_quantize, quantize
from quantkit.scheme import preset

torch.set_num_threads(1)
SCHEMES = ["w4a16", "w4a16-asym", "nvfp4a16", "mxfp4a16"]


def calibration_ids(n=8, seq=32, seed=0):
    return torch.randint(0, 320, (n, seq), generator=torch.Generator().manual_seed(seed))


def scheme_of(name):
    s = preset(name)
    return s.with_group_size(32) if name.startswith("w4") else s


def run(path, algorithm, scheme, **options):
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    spec = arch_for(model.config)
    results, method = {}, METHODS[algorithm]
    step = method.make_step(spec, scheme, method.options(**options), results, torch.float32)
    run_blocks(model, spec, step, calibration_ids(), batch_size=4)
    return model, results


def block_data(path, name, full=False):
    """Block 0 of the tiny model, its captured inputs and its float outputs, and a Rounding per linear."""
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    spec = arch_for(model.config)
    hidden, kwargs = capture_block_inputs(model, spec, calibration_ids(), 4, torch.device("cpu"))
    block = model.model.layers[0]
    targets = autoround._float_outputs(block, hidden, kwargs[0])
    args = scheme_of(name).weights
    roundings = {
        n: Rounding(block.get_submodule(n).weight.data, args, full=full) for n in spec.for_block(block).linears
    }
    return block, roundings, BlockData(hidden, kwargs[0], targets)


@pytest.mark.parametrize("name", SCHEMES)
def test_no_steps_is_round_to_nearest_bit_for_bit(tiny_llama, name):
    scheme = scheme_of(name)
    ar_model, ar = run(tiny_llama, "autoround", scheme, iters=0, grid="minmax")
    rtn_model, rtn = run(tiny_llama, "rtn", scheme)
    assert ar.keys() == rtn.keys() and len(ar) == 14
    for key in ar:
        for f in ("scale", "zero_point", "global_scale"):
            a, b = getattr(ar[key], f), getattr(rtn[key], f)
            assert (a is None and b is None) or torch.equal(a, b), (key, f)
    for (k, a), b in zip(ar_model.state_dict().items(), rtn_model.state_dict().values()):
        assert torch.equal(a, b), k


def reference_full_range(W, group_size):
    """The reference's symmetric int4 round to nearest (auto-round's `quant_tensor_sym` at v = 0,
    min_scale = max_scale = 1), written out: scale = ±max(wmax, |wmin|) / 8, + when |wmin| is
    strictly larger; codes round(W / scale) clamped to [-8, 7]."""
    g = W.reshape(W.shape[0], -1, group_size)
    wmax, wmin_abs = g.amax(-1).clamp(min=0), -g.amin(-1).clamp(max=0)
    scale = (2 * (wmax < wmin_abs).int() - 1) * torch.maximum(wmax, wmin_abs) / 8
    return (torch.round(g / scale[..., None]).clamp(-8, 7) * scale[..., None]).reshape(W.shape), scale


def test_no_steps_on_the_full_grid_is_the_references_round_to_nearest(tiny_llama):
    """The default grid at `iters` 0: every linear's weights and scales are the reference's
    formula's (some scales negative), and quantkit rtn's min-max grid has more weight error."""
    float_model = AutoModelForCausalLM.from_pretrained(tiny_llama).eval()
    model, results = run(tiny_llama, "autoround", scheme_of("w4a16"), iters=0)
    assert len(results) == 14
    err = {"full": 0.0, "minmax": 0.0}
    for name, q in results.items():
        W = float_model.get_submodule(name).weight.data
        ref, ref_scale = reference_full_range(W, 32)
        torch.testing.assert_close(q.scale, ref_scale, rtol=0, atol=0)
        torch.testing.assert_close(model.get_submodule(name).weight.data, ref, rtol=0, atol=0)
        assert q.zero_point is None and (q.scale < 0).any() and (q.scale > 0).any()
        err["full"] += (ref - W).pow(2).sum().item()
        err["minmax"] += (fake_quantize(W, scheme_of("w4a16").weights) - W).pow(2).sum().item()
    assert err["full"] < 0.95 * err["minmax"]


@pytest.mark.parametrize("name, full", [(n, False) for n in SCHEMES] + [("w4a16", True)])
def test_learned_rounding_never_loses_to_round_to_nearest(tiny_llama, name, full):
    block, roundings, data = block_data(tiny_llama, name, full)
    found = learn_block(block, roundings, data, iters=30, batch=2)
    assert len(found.losses) == 30 and found.losses[0] == pytest.approx(found.rtn_loss, rel=0.5)
    assert found.loss <= found.rtn_loss
    if name.startswith("w4"):  # the int grids learn clips too: a clear gain on 30 steps
        assert found.loss < 0.9 * found.rtn_loss
    weights = {f"{n}.weight": r.final(torch.float32)[0] for n, r in roundings.items()}
    assert autoround._full_loss(block, weights, data) == pytest.approx(found.loss, rel=1e-4)


def test_each_pass_draws_every_calibration_row_once(tiny_llama):
    """A step's rows come from all batches (8 rows in 2 batches of 4 here), as the reference's
    index sampler draws them: a shuffle of every row, taken `batch` at a time."""
    _, _, data = block_data(tiny_llama, "w4a16")
    draws = autoround._draws(data, 4, torch.Generator().manual_seed(0))
    for _ in range(3):
        a, b = next(draws), next(draws)
        assert sorted(a + b) == [(j, r) for j in range(2) for r in range(4)]
    assert {j for j, _ in a} | {j for j, _ in b} == {0, 1}
    assert len(next(autoround._draws(data, 20, torch.Generator()))) == 8  # at most every row


def test_rows_gathered_across_batches_run_as_in_their_own_batch(tiny_llama):
    """The block on rows gathered from two batches (per-row tensors from each row's batch,
    shared ones once) gives those rows' outputs of the whole batches (tolerance 1e-5)."""
    block, _, data = block_data(tiny_llama, "w4a16")
    picked = [(0, 3), (1, 0), (1, 2)]
    h, kw, target = autoround._gather(data, picked)
    expected = torch.stack([data.targets[j][r] for j, r in picked])
    assert torch.equal(target, expected) and torch.equal(h, torch.stack([data.hidden[j][r] for j, r in picked]))
    with torch.no_grad():
        torch.testing.assert_close(autoround._output(block, {}, h, kw).float(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name, full", [(n, False) for n in SCHEMES] + [("w4a16", True)])
def test_the_straight_through_weight_is_the_exact_codes(name, full):
    """`Rounding.weight` (differentiable, STE) against `final` (codes on the primitives' grid)
    for random offsets and clips: equal to a few ulps; each code moves at most one step from
    round-to-nearest's on the int grids."""
    g = torch.Generator().manual_seed(1)
    W = torch.randn(16, 64, generator=g) * (1 + 3 * torch.rand(16, 64, generator=g))
    args = scheme_of(name).weights
    r = Rounding(W, args, full=full)
    with torch.no_grad():
        r.V.copy_(torch.rand(W.shape, generator=g) - 0.5)
        if r.clips:
            r.alpha.copy_(0.5 + 0.5 * torch.rand(r.alpha.shape, generator=g))
            r.beta.copy_(0.5 + 0.5 * torch.rand(r.beta.shape, generator=g))
        soft = r.weight()
    exact, scale, zero = r.final(torch.float32)
    torch.testing.assert_close(soft, exact, rtol=1e-6, atol=1e-6)
    if r.clips:  # clips back at 1: the min-max qparams, and codes one step at most from RTN's
        with torch.no_grad():
            r.alpha.fill_(1.0), r.beta.fill_(1.0)
        exact, scale, zero = r.final(torch.float32)
        rtn_scale, rtn_zero = (reference_full_range(W, 32)[1], None) if full else compute_qparams(W, args)
        assert torch.equal(scale, rtn_scale)
        moved = quantize(exact, scale, zero, args).int() - quantize(W, rtn_scale, rtn_zero, args).int()
        assert moved.abs().max() == 1 and 0.1 < (moved != 0).float().mean() < 0.9


def test_targets_are_the_float_block_on_float_inputs(tiny_llama, monkeypatch):
    """Block 1 trains on the quantized block 0's outputs against the float model's block 1."""
    seen = []
    original = autoround.learn_block
    monkeypatch.setattr(autoround, "learn_block", lambda b, r, data, *a: seen.append(data) or original(b, r, data, *a))
    run(tiny_llama, "autoround", scheme_of("w4a16"), iters=2)
    float_model = AutoModelForCausalLM.from_pretrained(tiny_llama).eval()
    with torch.no_grad():
        states = float_model(calibration_ids(), output_hidden_states=True).hidden_states
    ref = states[2].split(4)  # the last block's float output (after the final norm), per batch of 4
    for t, h, r, fh in zip(seen[1].targets, seen[1].hidden, ref, states[1].split(4)):
        with torch.no_grad():
            torch.testing.assert_close(float_model.model.norm(t), r, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(h, fh, atol=1e-4)  # the inputs are the quantized model's


@pytest.mark.parametrize("name", ["w4a16", "w4a16-asym", "nvfp4a16"])
def test_checkpoint_loads_to_the_calibrated_model(tiny_llama, tmp_path, name):
    from quantkit.formats.checkpoint import save_checkpoint
    from quantkit.pipeline.quantize import checkpoint_config

    scheme = scheme_of(name)
    model, results = run(tiny_llama, "autoround", scheme, iters=5)
    if name == "w4a16":  # the full-range grid: negative scales survive packing and loading
        assert any((q.scale < 0).any() for q in results.values())
    tensors = pack_model(model, scheme, results, torch.float32)
    save_checkpoint(tmp_path / "q", tensors, checkpoint_config(model, scheme, results, torch.float32), {}, tiny_llama)
    loaded = quantkit.load(tmp_path / "q")
    ids = calibration_ids(2, 16, seed=3)
    with torch.no_grad():
        assert (loaded(ids).logits - model(ids).logits).pow(2).mean().item() < 1e-10


@pytest.mark.parametrize("family", ["llama", "qwen3-moe"])
def test_command_end_to_end(tiny_llama, tiny_corpus, tmp_path, family):
    from tests.conftest import make_family_model

    path = tiny_llama if family == "llama" else make_family_model(tmp_path / "moe", family)
    out = tmp_path / "q"
    argv = ["autoround", "--model", str(path), "--group-size", "32", "--calib", str(tiny_corpus)]
    argv += ["--samples", "4", "--seq-len", "32", "--iters", "3", "--batch", "2", "-o", str(out)]
    r = CliRunner().invoke(app, [*argv, "--json", str(tmp_path / "r.json")])
    assert r.exit_code == 0, r.output
    prov = json.loads((out / "quantkit.json").read_text())
    assert prov["algorithm"] == "autoround"
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["format"] == "pack-quantized"
    assert quantkit.load(out) is not None
    r = CliRunner().invoke(app, ["autoround", "--model", str(path), "--iters", "-1", "-o", str(tmp_path / "x")])
    assert r.exit_code == 2 and not (tmp_path / "x").exists(), r.output


def test_options_have_the_papers_defaults():
    o = METHODS["autoround"].options()
    assert dataclasses.asdict(o) == {"iters": 200, "lr": None, "clip_lr": None, "batch": 8, "grid": "full"}
