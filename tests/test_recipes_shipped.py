"""Every recipe in recipes/ runs on a tiny model (model and calibration swapped with
--set) and makes a checkpoint quantkit.load can run."""

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import quantkit
from quantkit.cli import app
from quantkit.pipeline.recipe import load_recipe

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
SHIPPED = sorted(p.name for p in RECIPES.glob("*.yaml"))
runner = CliRunner()


def test_the_issue_s_recipes_are_shipped():
    assert {
        "w4a16-awq.yaml",
        "w4a16-gptq.yaml",
        "fp8-dynamic.yaml",
        "w4a16-awq-kv-fp8.yaml",
        "smollm2-demo.yaml",
    } <= set(SHIPPED)


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_recipe_runs_on_a_tiny_model(name, tiny_llama, tiny_corpus, tmp_path, monkeypatch):
    from quantkit.pipeline import mixed

    monkeypatch.setattr(mixed, "_cache_dir", lambda: tmp_path / "sensitivity")  # --target-bits measures
    shipped = load_recipe(RECIPES / name)
    assert shipped.model == "smollm2-135m"
    tiny = [
        f"model={tiny_llama}",
        f"calibration.dataset={tiny_corpus}",
        "calibration.samples=4",
        "calibration.seq_len=32",
    ]
    if shipped.steps[0].name == "awq":
        tiny.append("steps.0.awq.grid=4")
    if shipped.eval is not None:  # the gate runs, on the tiny corpus, with a bound a random model meets
        tiny += [f"eval.ppl={tiny_corpus}", "eval.limit=2", "eval.seq_len=32", "eval.max_ppl_increase=10"]
    r = runner.invoke(
        app, ["run", str(RECIPES / name), "-o", str(tmp_path / "q"), *[arg for s in tiny for arg in ("--set", s)]]
    )
    assert r.exit_code == 0, r.output
    prov = json.loads((tmp_path / "q" / "quantkit.json").read_text())
    weight_step = next(s.name for s in shipped.steps if s.name not in ("smooth", "rotate", "kv"))  # after transforms
    assert prov["algorithm"] == weight_step and prov["recipe"]["model"] == str(tiny_llama)
    assert (prov["kv_cache"] is not None) == any(s.name == "kv" for s in shipped.steps)
    if shipped.target_bits is not None:
        assert prov["mixed_precision"]["bits_per_weight"] <= shipped.target_bits
    model = quantkit.load(tmp_path / "q")
    with torch.no_grad():
        logits = model(torch.arange(12).reshape(1, 12)).logits
    assert logits.shape == (1, 12, 320) and torch.isfinite(logits).all()
