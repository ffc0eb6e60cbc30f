"""The public API, as a user imports it: quantize, evaluate, load, LLM and SamplingParams."""

from __future__ import annotations

import json

import torch
import yaml
from typer.testing import CliRunner

from quantkit import LLM, SamplingParams, evaluate, load, quantize
from quantkit.calibration.method import Calibration
from quantkit.cli import app
from quantkit.pipeline import recipe


def test_quantize_evaluate_load_and_generate(tiny_llama, tiny_corpus, tmp_path):
    out = tmp_path / "awq"
    prov = quantize(tiny_llama, out, "awq", "w4a16-asym", calibration=Calibration(str(tiny_corpus), 4, 32), grid=4)
    assert prov["algorithm"] == "awq" and prov["options"]["grid"] == 4
    assert prov["weights"]["group_size"] == 64  # auto: 128 does not divide the tiny model's width 64
    assert json.loads((out / "quantkit.json").read_text())["recipe"]["steps"] == [
        {
            "awq": {
                "grid": 4,
                "grid_stride": 1,
                "duo": False,
                "clip": True,
                "clip_rounds": 2,
                "gptq": False,
                "guided": 0,
                "guided_rows": 8,
                "module_loss": False,
                "save_search": None,
                "load_search": None,
            }
        }
    ]

    report = evaluate(out, tiny_llama, ppl=str(tiny_corpus), seq_len=32, limit=2)
    (row,) = [r for r in report["rows"] if r["metric"].startswith("ppl")]
    assert row["candidate"] > 1 and row["baseline"] > 1 and report["passed"]

    model = load(out)
    prompt = torch.tensor([[5, 17, 42, 7]])
    ids = prompt
    with torch.no_grad():
        for _ in range(6):
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    (output,) = LLM(str(out), block_size=16, num_blocks=16).generate(
        [prompt[0].tolist()], SamplingParams(max_tokens=6, temperature=0)
    )
    assert output.token_ids == ids[0, 4:].tolist()


def test_gptq_takes_the_commands_act_order_unless_told(tiny_llama, tiny_corpus, tmp_path):
    calib = Calibration(str(tiny_corpus), 4, 32)
    static = quantize(tiny_llama, tmp_path / "s", "gptq", calibration=calib)
    natural = quantize(tiny_llama, tmp_path / "n", "gptq", calibration=calib, actorder="none")
    assert static["weights"]["actorder"] == "static" and natural["weights"]["actorder"] is None


def test_quantize_builds_the_recipe_the_command_prints(monkeypatch):
    """One recipe builder: quantkit.quantize and `quantkit gptq` mean the same recipe."""
    seen = []
    monkeypatch.setattr(recipe, "run_recipe", lambda r, **kwargs: seen.append(r) or {})
    quantize(
        "smollm2-135m",
        "out/x",
        "gptq",
        "w4a16-asym",
        group_size=64,
        calibration=Calibration(samples=16),
        kv_cache="int8",
        max_shard_size="500MB",
        target_bits=4.5,
        damp=0.1,
    )
    argv = ["gptq", "--scheme", "w4a16-asym", "--group-size", "64", "--samples", "16", "--kv-cache", "int8"]
    argv += ["--max-shard-size", "500MB", "--target-bits", "4.5", "--damp", "0.1", "-o", "out/x", "--print-recipe"]
    r = CliRunner().invoke(app, argv)
    assert r.exit_code == 0, r.output
    assert seen[0].to_dict() == yaml.safe_load(r.stdout)
