"""Rotations fused into the weights: the Hadamard constructions are orthogonal, the rotated
float model computes the same logits as the original (every dense family and the MoE
families; fp32, 1e-4 of the largest logit), the families that cannot take one are refused by
name, and a rotated W4A16 checkpoint loads in transformers as in quantkit."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import FAMILIES, make_family_model, make_tiny_model
from safetensors.torch import load_file
from torch import nn

import quantkit
from quantkit.calibration.hadamard import factors, hadamard
from quantkit.calibration.registry import RotateOptions
from quantkit.calibration.rotate import rotated_weights, rotation
from quantkit.errors import QuantkitError
from quantkit.models.arch import arch_for
from quantkit.models.loading import load_float_model, load_weights, open_float_model

IDS = torch.randint(0, 320, (2, 24), generator=torch.Generator().manual_seed(0))
ROTATABLE = [f for f, (model_type, _) in FAMILIES.items() if not model_type.startswith("gemma")]
RTOL = 1e-4  # of the largest logit: fp32 weights rotated in fp64 and rounded back to fp32


@pytest.mark.parametrize("n", [12, 20, 28, 36, 64, 96, 576, 896, 1536])
def test_hadamard_orders_are_hadamard_matrices(n):
    h, how = hadamard(n, torch.Generator().manual_seed(0))
    assert factors(n) is not None and "random" not in how
    torch.testing.assert_close(h @ h.T, torch.eye(n, dtype=torch.float64), rtol=0, atol=1e-12)
    torch.testing.assert_close(h.abs(), torch.full_like(h, n**-0.5), rtol=0, atol=1e-12)  # entries ±1/√n


def test_smollm2_hidden_size_is_paley_times_sylvester():
    assert hadamard(576, torch.Generator())[1] == "paley1(72) ⊗ sylvester(8) / √576"


def test_an_order_without_hadamard_factors_takes_a_random_orthogonal_factor():
    h, how = hadamard(18, torch.Generator().manual_seed(0))  # 18 = 9 · 2; no Hadamard of order 9
    assert factors(18) is None and how == "random-orthogonal(9) ⊗ sylvester(2) / √2"
    torch.testing.assert_close(h @ h.T, torch.eye(18, dtype=torch.float64), rtol=0, atol=1e-12)
    again, _ = hadamard(18, torch.Generator().manual_seed(0))
    assert torch.equal(h, again)  # seeded: resume rewrites the same weights


def test_random_hadamard_flips_rows_by_seed():
    q0, h0, _ = rotation("hadamard", 0, 64, 16)
    q1, _, how = rotation("random-hadamard", 1, 64, 16)
    signs = (q1 / q0)[:, 0]
    assert set(signs.tolist()) == {1.0, -1.0} and torch.equal(q1, signs[:, None] * q0)
    assert how["hidden"] == "64: random signs · sylvester(64) / √64"
    assert torch.equal(rotation("random-hadamard", 1, 64, 16)[0], q1)


def _rotated_model(path, kind="random-hadamard"):
    model, _, _, weights, dtype = open_float_model(path)
    spec = arch_for(model.config)
    served, how = rotated_weights(model, spec, weights, RotateOptions(kind=kind))
    load_weights(model, "", served, dtype)
    return model.eval(), how


@pytest.mark.parametrize("family", ROTATABLE)
def test_rotation_keeps_the_float_function(family, tmp_path):
    path = make_family_model(tmp_path / family, family)
    ref, _, _ = load_float_model(path)
    rotated, how = _rotated_model(path)
    with torch.no_grad():
        want, got = ref(IDS).logits, rotated(IDS).logits
    torch.testing.assert_close(got, want, rtol=0, atol=RTOL * want.abs().max().item())
    spec = arch_for(ref.config)
    embed = dict(ref.named_parameters())[f"{spec.embed}.weight"]
    assert (dict(rotated.named_parameters())[f"{spec.embed}.weight"] - embed).abs().max() > 0.1  # it did rotate
    norm = rotated.get_submodule(f"{spec.blocks}.0.{spec.input_norm}").weight
    assert torch.equal(norm, torch.ones_like(norm))  # folded into q/k/v


def test_tied_embeddings_are_untied(tmp_path):
    path = make_tiny_model(tmp_path / "tied", tie=True)
    ref, _, _ = load_float_model(path)
    rotated, how = _rotated_model(path, "hadamard")
    assert how["untied"] and not rotated.config.tie_word_embeddings
    assert rotated.lm_head.weight.data_ptr() != rotated.model.embed_tokens.weight.data_ptr()
    with torch.no_grad():
        want, got = ref(IDS).logits, rotated(IDS).logits
    torch.testing.assert_close(got, want, rtol=0, atol=RTOL * want.abs().max().item())


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_post_norm_families_are_refused_by_name(family, tmp_path):
    model, _, _, weights, _ = open_float_model(make_family_model(tmp_path / family, family))
    with pytest.raises(QuantkitError, match=r"rotate cannot be fused into gemma.*post-attention and post-feedforward"):
        rotated_weights(model, arch_for(model.config), weights, RotateOptions())


def test_a_norm_that_is_not_rmsnorm_is_refused_by_name(tiny_llama):
    model, _, _, weights, _ = open_float_model(tiny_llama)
    model.model.layers[1].post_attention_layernorm = nn.LayerNorm(64)
    with pytest.raises(
        QuantkitError, match=r"model\.layers\.1\.post_attention_layernorm is a LayerNorm, not an RMSNorm"
    ):
        rotated_weights(model, arch_for(model.config), weights, RotateOptions())


def test_rotated_w4a16_checkpoint_loads_in_transformers_as_in_quantkit(tmp_path):
    from transformers import AutoModelForCausalLM

    path = make_tiny_model(tmp_path / "tied", tie=True)
    prov = quantkit.quantize(path, tmp_path / "q", "rtn", "w4a16", group_size=32, rotate="hadamard")
    assert prov["transforms"]["rotate"] | {"hidden": None} == {
        "kind": "hadamard",
        "seed": 0,
        "hidden": None,
        "head": "16: sylvester(16) / √16",
        "untied": True,
    }
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    assert config["tie_word_embeddings"] is False and "lm_head" in config["quantization_config"]["ignore"]
    assert "lm_head.weight" in load_file(tmp_path / "q" / "model.safetensors")
    ours = quantkit.load(tmp_path / "q")
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "q").eval()  # compressed-tensors
    with torch.no_grad():
        torch.testing.assert_close(theirs(IDS).logits, ours(IDS).logits, rtol=1e-5, atol=1e-5)


def test_rotate_is_refused_with_target_bits(tiny_llama, tmp_path):
    with pytest.raises(QuantkitError, match="drop one of rotate and --target-bits"):
        quantkit.quantize(tiny_llama, tmp_path / "q", "rtn", rotate="hadamard", target_bits=5.0)
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("killed_in", ["load", "write_tail"])
def test_a_rotated_run_resumes_byte_identical(killed_in, tmp_path, tiny_corpus, monkeypatch):
    from quantkit.formats.checkpoint import read_tensors
    from quantkit.pipeline import stream

    src = make_tiny_model(tmp_path / "src", tie=True, num_hidden_layers=3)
    kw = {"group_size": 32, "rotate": "random-hadamard", "calibration": _calibration(tiny_corpus)}
    quantkit.quantize(src, tmp_path / "straight", "gptq", "w4a16", **kw)
    monkeypatch.setattr(stream, "COMMIT_SECONDS", 0.0)
    original = getattr(stream.BlockStream, killed_in)

    def die(self, *args):
        if killed_in == "write_tail" or args[0] == 2:
            raise KeyboardInterrupt
        return original(self, *args)

    monkeypatch.setattr(stream.BlockStream, killed_in, die)
    with pytest.raises(KeyboardInterrupt):
        quantkit.quantize(src, tmp_path / "resumed", "gptq", "w4a16", **kw)
    monkeypatch.undo()
    prov = quantkit.quantize(src, tmp_path / "resumed", "gptq", "w4a16", resume=True, **kw)
    assert prov["resumed_at_block"] == (3 if killed_in == "write_tail" else 2)
    straight, resumed = read_tensors(tmp_path / "straight"), read_tensors(tmp_path / "resumed")
    assert straight.keys() == resumed.keys() and all(torch.equal(straight[k], resumed[k]) for k in straight)


def _calibration(corpus):
    from quantkit.calibration.method import Calibration

    return Calibration(str(corpus), samples=4, seq_len=32, batch_size=4)


def test_the_rotate_flag_is_a_recipe_step_with_its_kind():
    from typer.testing import CliRunner

    from quantkit.cli import build_app

    runner = CliRunner()
    result = runner.invoke(build_app(), ["gptq", "--rotate", "random-hadamard", "--print-recipe", "-o", "out/x"])
    assert result.exit_code == 0, result.output
    assert "steps:\n- rotate:\n    kind: random-hadamard\n    seed: 0\n- gptq:" in result.stdout
    result = runner.invoke(build_app(), ["rtn", "--rotate", "givens", "--print-recipe", "-o", "out/x"])
    assert result.exit_code == 2
    assert "'givens' is not allowed; use hadamard or random-hadamard" in " ".join(result.output.split())
