"""Mixed precision (`quantkit.pipeline.mixed`): the knapsack choice against brute force, the
sensitivity against a direct computation with transformers, and `--target-bits` end to
end: one config group per format, the bits as inspect counts them within the target, and
the checkpoint loads in quantkit and transformers to the same logits."""

from __future__ import annotations

import contextlib
import importlib
import itertools
import json
import random

import pytest
import torch
from conftest import make_tiny_model
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

import quantkit
from quantkit.calibration import rtn
from quantkit.calibration.method import Calibration
from quantkit.cli import app
from quantkit.errors import QuantkitError
from quantkit.eval.kld import divergence
from quantkit.formats.inspect import describe
from quantkit.pipeline import mixed, variants
from quantkit.pipeline.quantize import quantize
from quantkit.scheme import preset

torch.set_num_threads(1)
IDS = torch.tensor([list(range(3, 43)), list(range(100, 140))])
CHEAPER = {"range_search": False, "refine": 0}  # GPTQ's sensitivity without range search and refinement


def random_rows(rng: random.Random, n: int) -> list[dict]:
    rows = []
    for u in range(n):
        params = rng.choice([1000, 4000, 9000])
        kld = {"int4-g128": rng.uniform(0.5, 2), "int4-g32": rng.uniform(0.1, 0.5), "int8": rng.uniform(0, 0.05)}
        kld["float"] = 0.0
        bits = {"int4-g128": 4.3, "int4-g32": 5.1, "int8": 8.1, "float": 16.0}
        rows.append({"label": f"u{u}", "params": params, "kld": kld, "bits": bits})
    return rows


def test_the_choice_is_the_best_within_the_budget():
    rng = random.Random(0)
    for trial in range(30):
        rows = random_rows(rng, 6)
        target = rng.uniform(4.4, 9.0)
        total = sum(r["params"] for r in rows)
        choice = mixed.choose(rows, target)
        assert mixed.achieved_bits(rows, choice) <= target + 1e-9
        cost = sum(r["kld"][choice[r["label"]]] for r in rows)
        best = min(  # brute force over every combination
            sum(r["kld"][c] for r, c in zip(rows, combo))
            for combo in itertools.product(*(list(r["kld"]) for r in rows))
            if sum(r["bits"][c] * r["params"] for r, c in zip(rows, combo)) <= target * total
        )
        # exact up to the budget's discretisation: the best choice may need the last few
        # of its 20,000 steps, which rounding each unit's bits up can put out of reach
        assert cost <= best + 1e-12 or mixed.achieved_bits(rows, choice) > target - 6 * target / 20000, trial


def test_more_bits_never_cost_more_and_too_few_are_refused():
    rows = random_rows(random.Random(1), 8)
    costs = [sum(r["kld"][mixed.choose(rows, t)[r["label"]]] for r in rows) for t in (4.3, 5.0, 6.0, 8.0, 16.01)]
    assert costs == sorted(costs, reverse=True) and costs[-1] == 0.0
    with pytest.raises(QuantkitError, match=r"--target-bits 4 is below what the smallest formats take \(4.300"):
        mixed.choose(rows, 4.0)


def test_the_choice_keeps_to_the_allowed_formats():
    rng = random.Random(2)
    for trial in range(20):
        rows = random_rows(rng, 6)
        target = rng.uniform(4.4, 9.0)
        allowed = mixed.allowed_formats("int4,float")
        assert allowed == ("int4-g128", "int4-g64", "int4-g32", "float")
        choice = mixed.choose(rows, target, allowed)
        assert set(choice.values()) <= set(allowed) and mixed.achieved_bits(rows, choice) <= target + 1e-9
        # the same as the choice over rows that only offer those formats
        kept = [r | {"kld": {c: k for c, k in r["kld"].items() if c in allowed}} for r in rows]
        assert choice == mixed.choose(kept, target), trial
    assert mixed.allowed_formats(["int8", " int4-g64"]) == ("int4-g64", "int8")
    assert mixed.allowed_formats(None) is None
    with pytest.raises(QuantkitError, match="'int3' is not a format --target-bits chooses; use int4"):
        mixed.allowed_formats("int4,int3")
    with pytest.raises(QuantkitError, match="at least one quantized format"):
        mixed.allowed_formats("float")
    with pytest.raises(QuantkitError, match="none of the formats int4-g64 fits u0"):
        mixed.choose(random_rows(rng, 2), 6.0, ("int4-g64",))


def test_sensitivity_equals_a_direct_computation(tmp_path, tiny_corpus):
    from quantkit.calibration.datasets import calibration_samples, load_documents
    from quantkit.models.loading import load_tokenizer

    path = make_tiny_model(tmp_path / "m")
    calib = Calibration(str(tiny_corpus), 4, 32)
    scheme = preset("w4a16-asym")
    result = mixed.sensitivity(str(path), scheme, calib, cache=tmp_path / "cache", estimator="exact")
    assert result["estimator"] == "exact"
    row = next(r for r in result["units"] if r["label"] == "model.layers.0.mlp.gate_proj+up_proj")
    assert set(row["kld"]) == {"int4-g64", "int4-g32", "int8", "float"}  # in 64: no groups of 128
    ids = calibration_samples(load_tokenizer(path), load_documents(str(tiny_corpus), "calib"), 4, 32, 0)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        base = model(ids).logits.log_softmax(-1)
        for name in ("gate_proj", "up_proj"):
            w = getattr(model.model.layers[0].mlp, name).weight
            w.copy_(rtn.quantize_weight(w, mixed.candidates(scheme)["int4-g32"])[0])
        direct = divergence(base, model(ids).logits).mean().item()
    assert row["kld"]["int4-g32"] == pytest.approx(direct, rel=1e-4)
    assert row["kld"]["int8"] < row["kld"]["int4-g32"] < row["kld"]["int4-g64"]
    # cached: the same answer without measuring again
    assert mixed.sensitivity(str(path), scheme, calib, cache=tmp_path / "cache", estimator="exact") == result


@pytest.mark.parametrize(
    "method, options, cheaper",
    [("awq", {}, {}), ("gptq", {}, {}), ("gptq", {"guided": 2}, {}), ("gptq", {}, CHEAPER)],
)
def test_sensitivity_by_the_method_equals_quantizing_that_group_alone(
    tmp_path, tiny_corpus, monkeypatch, method, options, cheaper
):
    """A unit's cost by AWQ or GPTQ (guided Hessians too) is that of a checkpoint the pipeline
    made with only that unit quantized (the same windows and options, `SENSITIVITY_CHEAPER`'s
    settings in place, calibrate both), read back by transformers."""
    from quantkit.calibration.datasets import calibration_samples, load_documents
    from quantkit.calibration.registry import METHODS
    from quantkit.models.loading import load_tokenizer

    path = make_tiny_model(tmp_path / "m")
    calib = Calibration(str(tiny_corpus), 4, 32)
    scheme = preset("w4a16")  # symmetric: transformers reads it
    opts = METHODS[method].options(**options)
    monkeypatch.setattr(mixed, "SENSITIVITY_CHEAPER", cheaper)
    cache = tmp_path / "cache"
    result = mixed.sensitivity(str(path), scheme, calib, cache=cache, method=method, options=opts, estimator="exact")
    assert result["method"] == method
    rtn_costs = mixed.sensitivity(str(path), scheme, calib, cache=cache, estimator="exact")["units"]
    assert all(v >= 0 for r in result["units"] for v in r["kld"].values())
    # the method removes some of round-to-nearest's error, summed over the groups
    for c in ("int4-g64", "int4-g32"):
        assert sum(r["kld"][c] for r in result["units"]) < sum(r["kld"][c] for r in rtn_costs)
    row = next(r for r in result["units"] if r["label"] == "model.layers.1.mlp.gate_proj+up_proj")
    others = tuple(n for r in result["units"] for n in r["linears"] if n not in row["linears"])
    alone = scheme.replace(weights=mixed.candidates(scheme)["int4-g32"], ignore=scheme.ignore + others)
    replaced = {k: v for k, v in cheaper.items() if hasattr(opts, k)}
    quantize(str(path), alone, tmp_path / "q", method, calib, {**options, **replaced})
    ids = calibration_samples(load_tokenizer(path), load_documents(str(tiny_corpus), "calib"), 4, 32, 0)
    with torch.no_grad():
        base = AutoModelForCausalLM.from_pretrained(path).eval()(ids).logits.log_softmax(-1)
        quantized = AutoModelForCausalLM.from_pretrained(tmp_path / "q").eval()(ids).logits
    assert row["kld"]["int4-g32"] == pytest.approx(divergence(base, quantized).mean().item(), rel=1e-3)


@pytest.mark.parametrize(
    "method, options, dtype",
    [
        ("rtn", {}, torch.float32),
        ("gptq", {}, torch.float32),
        ("gptq", {}, torch.bfloat16),
        ("gptq", {"guided": 2}, torch.float32),
    ],
)
def test_shared_variants_equal_each_unit_quantized_on_a_copy(
    tmp_path, tiny_corpus, monkeypatch, method, options, dtype
):
    """Round-to-nearest's and GPTQ's costs from one pass over each block (one Hessian per unit,
    one factorisation for all formats, weights swapped into the float block, the attention's
    outputs reused) are those of the method's step on a copy of the block per unit and format,
    bit for bit, and so is the choice."""
    from quantkit.calibration.registry import METHODS

    path = make_tiny_model(tmp_path / "m", dtype=dtype)
    calib, scheme = Calibration(str(tiny_corpus), 4, 32), preset("w4a16-asym")
    opts = METHODS[method].options(**options)
    shared = mixed.sensitivity(str(path), scheme, calib, cache=tmp_path / "a", method=method, options=opts)
    monkeypatch.setattr(variants, "SHARED", ())
    alone = mixed.sensitivity(str(path), scheme, calib, cache=tmp_path / "b", method=method, options=opts)
    assert shared["units"] == alone["units"]
    assert len(shared["units"]) == 8 and all(len(r["kld"]) >= 4 for r in shared["units"])
    for target in (4.6, 5.0, 6.0):
        assert mixed.choose(shared["units"], target) == mixed.choose(alone["units"], target)


def test_awq_copies_reuse_the_float_attention_bit_for_bit(tmp_path, tiny_corpus, monkeypatch):
    """AWQ's copies of a block for the units outside the attention (gate/up, down) reuse the
    float attention's outputs: the costs are those of running every copy whole, bit for bit."""
    from quantkit.calibration import hooks

    path = make_tiny_model(tmp_path / "m")
    calib, scheme = Calibration(str(tiny_corpus), 4, 32), preset("w4a16-asym")
    entered, active = [], hooks.Replay.active

    def counted(self):
        entered.append(self)
        return active(self)

    monkeypatch.setattr(hooks.Replay, "active", counted)
    reused = mixed.sensitivity(str(path), scheme, calib, cache=tmp_path / "a", method="awq")
    owners = {}  # outputs list -> the Replays holding it: AWQ's copies share one per block, `shared`'s own theirs
    for r in entered:
        owners.setdefault(id(r.outputs), set()).add(id(r))
    assert sorted(len(o) for o in owners.values() if len(o) > 1) == [5, 5]  # gate/up: g64, g32; down: g128 too
    monkeypatch.setattr(hooks.Replay, "active", lambda self: contextlib.nullcontext())
    whole = mixed.sensitivity(str(path), scheme, calib, cache=tmp_path / "b", method="awq")
    assert reused["units"] == whole["units"]


def test_the_sensitivity_options_take_the_cheaper_settings_the_method_has(monkeypatch):
    """`SENSITIVITY_CHEAPER` (GPTQ without range search and refinement here) replaces only the
    options a method has, keeps the others, and a saved search is never read or written."""
    from quantkit.calibration.registry import METHODS

    shipped = mixed._search_options(METHODS["gptq"].options())  # as shipped: GPTQ's searches off
    assert (shipped.range_search, shipped.refine) == (False, 0)
    awq = mixed._search_options(METHODS["awq"].options())  # AWQ's: a strided scale grid, one clip round
    assert awq == METHODS["awq"].options(grid_stride=3, clip_rounds=1)
    monkeypatch.setattr(mixed, "SENSITIVITY_CHEAPER", {})
    assert mixed._search_options(METHODS["gptq"].options()) == METHODS["gptq"].options()
    monkeypatch.setattr(mixed, "SENSITIVITY_CHEAPER", CHEAPER)
    gptq = mixed._search_options(METHODS["gptq"].options(guided=2, damp=0.1))
    assert (gptq.range_search, gptq.refine, gptq.guided, gptq.damp) == (False, 0, 2, 0.1)
    awq = mixed._search_options(METHODS["awq"].options(gptq=True, save_search="s.safetensors"))
    assert awq == METHODS["awq"].options(gptq=True)
    assert mixed._search_options(METHODS["rtn"].options()) == METHODS["rtn"].options()


def test_awq_reads_each_blocks_inputs_captured_once(tmp_path, tiny_corpus, monkeypatch):
    """AWQ's copies read the block's linears' inputs captured once per block: the costs and the
    choice are those of capturing them on every copy, bit for bit."""
    path = make_tiny_model(tmp_path / "m")
    calib, scheme = Calibration(str(tiny_corpus), 4, 32), preset("w4a16-asym")
    once = mixed.sensitivity(str(path), scheme, calib, cache=tmp_path / "a", method="awq")
    monkeypatch.setattr(variants, "CAPTURED", ())
    every = mixed.sensitivity(str(path), scheme, calib, cache=tmp_path / "b", method="awq")
    assert once["units"] == every["units"] and len(once["units"]) == 8
    assert mixed.choose(once["units"], 5.0) == mixed.choose(every["units"], 5.0)


def test_awqs_int8_costs_are_round_to_nearests(tmp_path, tiny_corpus, monkeypatch):
    """AWQ's sensitivity measures int8 by round-to-nearest (`mixed.ROUNDED`): its int8 costs are
    RTN's and its int4 costs AWQ's, bit for bit, where measuring int8 by AWQ gives others."""
    path = make_tiny_model(tmp_path / "m")
    calib, scheme = Calibration(str(tiny_corpus), 4, 32), preset("w4a16-asym").with_group_size(32)
    shipped = mixed.sensitivity(str(path), scheme, calib, cache=tmp_path / "a", method="awq")
    rounded = mixed.sensitivity(str(path), scheme, calib, cache=tmp_path / "r", method="rtn")
    monkeypatch.setattr(mixed, "ROUNDED", {})
    full = mixed.sensitivity(str(path), scheme, calib, cache=tmp_path / "f", method="awq")
    int4 = ("int4-g64", "int4-g32")  # those the tiny model's widths take
    for s, r, f in zip(shipped["units"], rounded["units"], full["units"]):
        assert s["kld"]["int8"] == r["kld"]["int8"] and all(s["kld"][c] == f["kld"][c] for c in int4)
    assert any(s["kld"]["int8"] != f["kld"]["int8"] for s, f in zip(shipped["units"], full["units"]))


def test_fisher_estimate_equals_its_formula(tmp_path, tiny_corpus):
    """½·mean over tokens and draws of (g·δ)², with g = ∇ log p(y|h) at block 0's output for
    labels y drawn from the float model (the same generator, row by row) and δ the change of
    that output with the unit quantized, all by autograd through the whole model."""
    from quantkit.calibration.datasets import calibration_samples, load_documents
    from quantkit.models.loading import load_tokenizer

    path = make_tiny_model(tmp_path / "m")
    calib = Calibration(str(tiny_corpus), 4, 32, seed=3)
    scheme = preset("w4a16-asym")
    result = mixed.sensitivity(str(path), scheme, calib, cache=tmp_path / "cache")
    assert result["estimator"] == "fisher"
    row = next(r for r in result["units"] if r["label"] == "model.layers.0.mlp.gate_proj+up_proj")
    ids = calibration_samples(load_tokenizer(path), load_documents(str(tiny_corpus), "calib"), 4, 32, 3)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    outs = []
    hook = model.model.layers[0].register_forward_hook(
        lambda m, a, out: outs.append(out[0] if isinstance(out, tuple) else out)
    )
    logp = model(ids).logits.float().log_softmax(-1)  # [rows, seq, vocab]
    generator, d = torch.Generator().manual_seed(3), mixed.FISHER_DRAWS
    y = torch.stack([torch.multinomial(r.detach().exp(), d, replacement=True, generator=generator) for r in logp])
    picked = logp.gather(-1, y)  # [rows, seq, draws]
    g = torch.stack([torch.autograd.grad(picked[..., k].sum(), outs[0], retain_graph=True)[0] for k in range(d)])
    with torch.no_grad():
        for name in ("gate_proj", "up_proj"):
            w = getattr(model.model.layers[0].mlp, name).weight
            w.copy_(rtn.quantize_weight(w, mixed.candidates(scheme)["int4-g32"])[0])
        model(ids)
    hook.remove()
    delta = (outs[1] - outs[0]).detach()  # [rows, seq, hidden]
    direct = 0.5 * (g * delta).sum(-1).square().mean().item()
    assert row["kld"]["int4-g32"] == pytest.approx(direct, rel=1e-4)  # measured 6e-8: fp32 sums in another order


@pytest.mark.parametrize("method", ["rtn", "awq"])
def test_fisher_estimate_ranks_the_units_like_the_exact_kl(tmp_path, tiny_corpus, method):
    """On a tiny model the second-order estimate orders every (unit, format) like the measured
    KL (Spearman ≥ 0.95; measured 0.997-0.999 on two seeds) and is within a factor 1.5 of it
    for each (measured 0.75-1.21)."""
    from scipy.stats import spearmanr

    path = make_tiny_model(tmp_path / "m")
    calib = Calibration(str(tiny_corpus), 4, 32)
    scheme, cache = preset("w4a16-asym"), tmp_path / "cache"
    exact, fisher = (
        mixed.sensitivity(str(path), scheme, calib, cache=cache, method=method, estimator=e)["units"]
        for e in ("exact", "fisher")
    )
    pairs = [(a["kld"][c], b["kld"][c]) for a, b in zip(exact, fisher) for c in a["kld"] if c != mixed.FLOAT]
    assert len(pairs) > 20 and all(f > 0 for _, f in pairs)
    assert spearmanr(*zip(*pairs)).statistic >= 0.95
    assert all(1 / 1.5 < f / e < 1.5 for e, f in pairs)


def test_the_cache_keeps_the_estimators_apart(tmp_path, tiny_corpus):
    path = make_tiny_model(tmp_path / "m")
    calib, scheme, cache = Calibration(str(tiny_corpus), 4, 32), preset("w4a16"), tmp_path / "cache"
    from quantkit.calibration.registry import METHODS

    options = mixed._search_options(METHODS["rtn"].options())
    keys = {e: mixed._cache_key(path, scheme, calib, "rtn", options, e) for e in mixed.ESTIMATORS}
    assert len(set(keys.values())) == len(mixed.ESTIMATORS)
    got = {e: mixed.sensitivity(str(path), scheme, calib, cache=cache, estimator=e) for e in mixed.ESTIMATORS}
    assert sorted(f.stem for f in cache.glob("*.json")) == sorted(keys.values())
    assert [got[e]["estimator"] for e in mixed.ESTIMATORS] == list(mixed.ESTIMATORS)
    assert got["fisher"]["units"] != got["exact"]["units"]
    with pytest.raises(QuantkitError, match="estimator is one of fisher, exact, not 'taylor'"):
        mixed.sensitivity(str(path), scheme, calib, cache=cache, estimator="taylor")


@pytest.mark.parametrize("method", ["rtn", "awq", "gptq"])
def test_target_bits_end_to_end(tmp_path, tiny_corpus, method, monkeypatch):
    from quantkit import assets

    monkeypatch.setattr(assets, "cache_dir", lambda: tmp_path / "cache")
    path = make_tiny_model(tmp_path / "m")
    scheme = preset("w4a16")  # symmetric: transformers reads it (docs/formats.md)
    calib = Calibration(str(tiny_corpus), 4, 32)
    prov = quantize(str(path), scheme, tmp_path / "q", method, calib, target_bits=5.0)
    mp = prov["mixed_precision"]
    info = describe(str(tmp_path / "q"))
    assert mp["bits_per_weight"] <= 5.0 and info["bits_per_weight"] == pytest.approx(mp["bits_per_weight"], rel=1e-9)
    assert len(set(mp["choice"].values())) > 1  # a real mix
    groups = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]["config_groups"]
    assert len(groups) == len({c for c in mp["choice"].values() if c != "float"})
    with torch.no_grad():
        ours = quantkit.load(tmp_path / "q")(IDS).logits
        theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "q").eval()(IDS).logits  # compressed-tensors
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    shown = CliRunner().invoke(app, ["inspect", str(tmp_path / "q")], terminal_width=200)
    assert "mixed precision" in shown.output and next(iter(mp["choice"])) in shown.output


def test_target_formats_keep_the_checkpoint_to_int4(tmp_path, tiny_corpus, monkeypatch):
    from quantkit import assets

    monkeypatch.setattr(assets, "cache_dir", lambda: tmp_path / "cache")
    path = make_tiny_model(tmp_path / "m")
    calib = ["--calib", str(tiny_corpus), "--samples", "4", "--seq-len", "32"]
    common = ["rtn", "-m", str(path), "--scheme", "w4a16", "--target-bits", "6", *calib]
    r = CliRunner().invoke(app, [*common, "-o", str(tmp_path / "all")])
    assert r.exit_code == 0, r.output
    prov = json.loads((tmp_path / "all" / "quantkit.json").read_text())
    assert "int8" in prov["mixed_precision"]["choice"].values()  # else the test proves nothing
    r = CliRunner().invoke(app, [*common, "-o", str(tmp_path / "q"), "--target-formats", "int4,float"])
    assert r.exit_code == 0, r.output
    prov = json.loads((tmp_path / "q" / "quantkit.json").read_text())
    mp = prov["mixed_precision"]
    assert mp["formats"] == ["int4-g128", "int4-g64", "int4-g32", "float"]
    assert set(mp["choice"].values()) <= set(mp["formats"]) and mp["bits_per_weight"] <= 6
    assert prov["recipe"]["target_formats"] == mp["formats"]  # the recipe names them one by one
    groups = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]["config_groups"]
    assert {g["weights"]["num_bits"] for g in groups.values()} == {4}


def test_the_sensitivity_command_and_refusals(tmp_path, tiny_corpus, monkeypatch):
    from quantkit import assets

    monkeypatch.setattr(assets, "cache_dir", lambda: tmp_path / "cache")
    path = make_tiny_model(tmp_path / "m")
    calib = ["--calib", str(tiny_corpus), "--samples", "4", "--seq-len", "32"]
    r = CliRunner().invoke(
        app,
        ["sensitivity", str(path), *calib, "--json", str(tmp_path / "s.json"), "--plot", str(tmp_path / "s.png")],
        env={"COLUMNS": "250"},
    )
    assert r.exit_code == 0, r.output
    rows = json.loads((tmp_path / "s.json").read_text())["units"]
    assert len(rows) == 2 * 4 and (tmp_path / "s.png").stat().st_size > 0
    assert "rtn, fisher" in r.output
    e = CliRunner().invoke(app, ["sensitivity", str(path), *calib, "--exact", "--json", str(tmp_path / "e.json")])
    assert e.exit_code == 0 and json.loads((tmp_path / "e.json").read_text())["estimator"] == "exact", e.output
    worst = max(rows, key=lambda x: max(v for k, v in x["kld"].items() if k.startswith("int4")))["label"]
    assert r.output.index(worst) < min(r.output.index(x["label"]) for x in rows if x["label"] != worst)
    r = CliRunner().invoke(app, ["sensitivity", str(path), "--method", "fp8", *calib], env={"COLUMNS": "250"})
    assert r.exit_code == 2 and "by rtn, awq, gptq or autoround, not fp8" in r.output
    r = CliRunner().invoke(app, ["fp8", "-m", str(path), "-o", str(tmp_path / "f"), "--target-bits", "5"])
    assert r.exit_code == 2 and "No such option" in r.output
    r = CliRunner().invoke(app, ["rtn", "-m", str(path), "-o", str(tmp_path / "r"), "--target-bits", "3", *calib])
    assert r.exit_code == 2 and "is below what the smallest formats take" in r.output
    assert not (tmp_path / "r").exists()
    r = CliRunner().invoke(app, ["rtn", "-m", str(path), "-o", str(tmp_path / "r"), "--target-formats", "int4", *calib])
    assert r.exit_code == 2 and "goes with target_bits (--target-bits)" in r.output
    r = CliRunner().invoke(
        app, ["rtn", "-m", str(path), "-o", str(tmp_path / "r"), "--target-bits", "5", "--target-formats", "int5"]
    )
    assert r.exit_code == 2 and "'int5' is not a format" in r.output
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("family", ["llama3", "phi3", "gemma3", "qwen2-moe"])
def test_shape_rows_equal_the_units_of_the_built_model(tmp_path, family):
    """`shape_rows` (config.json alone) gives the same units, parameters and bits per format as
    the units of the built model, which `sensitivity` measures: so the budget check before
    measuring is the one the knapsack makes after."""
    from conftest import make_family_model

    from quantkit.models.arch import arch_for
    from quantkit.models.loading import check_causal_lm, empty_model

    path = make_family_model(tmp_path / family, family)
    config = check_causal_lm(path)
    model, dtype = empty_model(config)
    found = mixed.units(model, arch_for(config))
    for scheme in (preset("w4a16"), preset("w4a16-asym")):
        cands = mixed.candidates(scheme)
        rows = mixed.shape_rows(str(path), scheme)
        assert [r["linears"] for r in rows] == [list(u.linears) for u in found]
        assert [r["params"] for r in rows] == [u.params for u in found]
        want = [{n: u.bits(a, dtype.itemsize) for n, a in cands.items() if u.fits(a)} for u in found]
        assert [r["bits"] for r in rows] == want


def test_an_impossible_budget_is_refused_before_measuring(tmp_path, monkeypatch, tiny_corpus):
    """Refused from config.json alone: before the model is opened or any sensitivity measured
    (on smollm2 the refusal takes the CLI's start-up, ~4 CPU-s, where measuring took minutes)."""
    pipeline = importlib.import_module("quantkit.pipeline.quantize")  # the module, not its function
    path = make_tiny_model(tmp_path / "m")

    def measured(*args, **kwargs):
        raise AssertionError("sensitivity was measured for an impossible budget")

    def opened(*args, **kwargs):
        raise AssertionError("the model was opened for an impossible budget")

    monkeypatch.setattr(mixed, "sensitivity", measured)
    monkeypatch.setattr(pipeline, "open_float_model", opened)
    calib = Calibration(dataset=str(tiny_corpus), samples=4, seq_len=32)
    with pytest.raises(QuantkitError, match=r"--target-bits 1.5 is below what the smallest formats take \(4\.\d{3}"):
        quantize(str(path), preset("w4a16"), tmp_path / "out", "rtn", calibration=calib, target_bits=1.5)
    with pytest.raises(QuantkitError, match="none of the formats int4-g128 fits"):
        mixed.check_budget([{"label": "u", "params": 10, "kld": {}, "bits": {"int8": 8.1}}], 9.0, ("int4-g128",))
    assert not (tmp_path / "out").exists()


def test_target_estimate_reaches_the_sensitivity_and_is_checked(tmp_path, monkeypatch, tiny_corpus):
    path = make_tiny_model(tmp_path / "m")
    seen = []

    def measured(*args, estimator, **kwargs):
        seen.append(estimator)
        raise QuantkitError("measured")

    monkeypatch.setattr(mixed, "sensitivity", measured)
    calib = Calibration(dataset=str(tiny_corpus), samples=4, seq_len=32)
    for given, want in ((None, "fisher"), ("exact", "exact"), ("fisher", "fisher")):
        with pytest.raises(QuantkitError, match="measured"):
            quantkit.quantize(path, tmp_path / "o", "rtn", target_bits=5.0, target_estimate=given, calibration=calib)
        assert seen[-1] == want
    with pytest.raises(QuantkitError, match="target_estimate: .guess. is not allowed; use fisher or exact"):
        quantkit.quantize(path, tmp_path / "o", "rtn", target_bits=5.0, target_estimate="guess", calibration=calib)
    with pytest.raises(QuantkitError, match="goes with target_bits"):
        quantkit.quantize(path, tmp_path / "o", "rtn", target_estimate="exact", calibration=calib)
    r = CliRunner().invoke(
        app, ["awq", "-m", str(path), "--target-bits", "5", "--target-estimate", "exact", "--print-recipe"]
    )
    assert r.exit_code == 0 and "target_estimate: exact" in r.output
