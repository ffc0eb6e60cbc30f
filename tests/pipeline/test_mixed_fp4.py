"""Mixed precision over the weight-only FP4 formats: `--target-bits` with nvfp4a16 or mxfp4a16
chooses per fusion group between that format, int8 per channel and float; the checkpoint is a
compressed-tensors `mixed-precision` one (each config group names its own format), which
transformers loads to the logits `quantkit.load` gives and the engine serves with transformers'
greedy tokens; NVFP4's global scales stay shared where vLLM fuses."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import make_tiny_model
from transformers import AutoModelForCausalLM

import quantkit
from quantkit.calibration.method import Calibration
from quantkit.errors import QuantkitError
from quantkit.formats.checkpoint import read_tensors
from quantkit.formats.inspect import describe
from quantkit.pipeline import mixed, variants
from quantkit.pipeline.quantize import quantize
from quantkit.runtime.engine import LLM
from quantkit.runtime.qlinear_float import dequantize_linear
from quantkit.runtime.sequence import SamplingParams
from quantkit.scheme import from_quantization_config, preset

torch.set_num_threads(1)
IDS = torch.randint(0, 320, (2, 16), generator=torch.Generator().manual_seed(0))
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
PROMPTS = [[5, 17, 33, 2, 9], list(range(40, 60))]
FP4 = {"nvfp4a16": ("nvfp4", "nvfp4-pack-quantized"), "mxfp4a16": ("mxfp4", "mxfp4-pack-quantized")}


@pytest.fixture(scope="module")
def bf16_llama(tmp_path_factory):
    """bf16: transformers decompresses FP4 weights to bf16, so a float32 model cannot run them there."""
    path = tmp_path_factory.mktemp("models") / "llama-bf16"
    return make_tiny_model(path, dtype=torch.bfloat16, hidden_size=128, intermediate_size=256)


def assert_engine_greedy_is_quantkit_loads(out):
    """The engine (float32) serves the checkpoint `out` with the greedy tokens of `quantkit.load`'s model."""
    llm = LLM(str(out), dtype="float32", block_size=16, num_blocks=32)
    reference = quantkit.load(out, torch.float32)
    greedy = [
        reference.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
        for p in PROMPTS
    ]
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == [
        g[0, len(p) :].tolist() for g, p in zip(greedy, PROMPTS)
    ]


def test_fp4_candidates_and_refusals():
    for name, (fmt, _) in FP4.items():
        cands = mixed.candidates(preset(name))
        assert list(cands) == [fmt, "int8", "float"] and cands[fmt] == preset(name).weights
    assert list(mixed.candidates(preset("w4a16"))) == ["int4-g128", "int4-g64", "int4-g32", "int8", "float"]
    for name in ("nvfp4", "mxfp8", "fp8-block", "w3a16"):
        with pytest.raises(QuantkitError, match="mixes int4 or weight-only FP4 schemes"):
            mixed.candidates(preset(name))
    # NVFP4 at 4.5 bits per weight (e4m3 scale per 16, global scale), MXFP4 at 4.25 (e8m0 per 32)
    unit = mixed.Unit(0, ("a",), ((256, 128),))
    assert unit.bits(preset("nvfp4a16").weights, 2) == pytest.approx(4.5, abs=1e-3)
    assert unit.bits(preset("mxfp4a16").weights, 2) == pytest.approx(4.25, abs=1e-3)


@pytest.mark.parametrize("method", ["rtn", "gptq"])
def test_shared_fp4_variants_equal_each_unit_quantized_on_a_copy(tmp_path, tiny_corpus, monkeypatch, method):
    """The sensitivity's one-pass variants round NVFP4 as the method's step does on a copy of
    the block (one weight global scale per fusion group), bit for bit."""
    from quantkit.calibration.registry import METHODS

    path = make_tiny_model(tmp_path / "m")
    calib, scheme = Calibration(str(tiny_corpus), 4, 32), preset("nvfp4a16")
    opts = METHODS[method].options()
    shared = mixed.sensitivity(str(path), scheme, calib, cache=tmp_path / "a", method=method, options=opts)
    monkeypatch.setattr(variants, "SHARED", ())
    alone = mixed.sensitivity(str(path), scheme, calib, cache=tmp_path / "b", method=method, options=opts)
    assert shared["units"] == alone["units"]
    assert all(set(r["kld"]) == {"nvfp4", "int8", "float"} for r in shared["units"])
    assert all(r["kld"]["nvfp4"] > r["kld"]["int8"] > 0 for r in shared["units"])


@pytest.mark.parametrize("name, method", [("nvfp4a16", "rtn"), ("nvfp4a16", "awq"), ("mxfp4a16", "gptq")])
def test_target_bits_over_fp4_end_to_end(bf16_llama, tiny_corpus, tmp_path, monkeypatch, name, method):
    from quantkit import assets

    monkeypatch.setattr(assets, "cache_dir", lambda: tmp_path / "cache")
    out = tmp_path / "q"
    prov = quantize(str(bf16_llama), preset(name), out, method, Calibration(str(tiny_corpus), 4, 32), target_bits=6.0)
    mp = prov["mixed_precision"]
    fp4, fmt = FP4[name]
    assert {fp4, "int8"} <= set(mp["choice"].values()), mp["choice"]  # a real mix, else the test proves nothing
    assert mp["bits_per_weight"] <= 6.0
    assert describe(str(out))["bits_per_weight"] == pytest.approx(mp["bits_per_weight"], rel=1e-9)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "mixed-precision"
    assert sorted(g["format"] for g in qc["config_groups"].values()) == sorted([fmt, "pack-quantized"])
    t = read_tensors(out)
    for label, choice in mp["choice"].items():  # each fusion group stored in its format
        prefix = label.split("+")[0]  # the unit's first linear
        assert f"{prefix}.weight_packed" in t, label
        assert (f"{prefix}.weight_global_scale" in t) == (choice == "nvfp4"), (label, choice)
        if choice == "nvfp4" and "q_proj" in label:  # shared where vLLM fuses
            p = prefix.rsplit(".", 1)[0]
            assert len({t[f"{p}.{n}.weight_global_scale"].item() for n in ("q_proj", "k_proj", "v_proj")}) == 1
    # transformers (decompressing at its first forward, in bf16) has every group's weights as
    # quantkit's decoders give them, bit for bit, and those decoders' float32 weights in the float
    # model give quantkit.load's float32 logits (in bf16 quantkit's int8 kernel sums in another
    # order than transformers' GEMM on the bf16-rounded weights)
    theirs = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        theirs(IDS)
    ck = from_quantization_config(qc)
    ref = AutoModelForCausalLM.from_pretrained(bf16_llama, dtype=torch.float32).eval()
    ref.load_state_dict({k: v.float() for k, v in t.items() if k in ref.state_dict()}, strict=False)  # AWQ's norms
    for name, module in theirs.named_modules():
        if isinstance(module, torch.nn.Linear) and (s := ck.scheme_for(name)) is not None:
            stored = {k.removeprefix(f"{name}."): v for k, v in t.items() if k.startswith(f"{name}.")}
            torch.testing.assert_close(module.weight, dequantize_linear(stored, s, torch.bfloat16), rtol=0, atol=0)
            ref.get_submodule(name).weight.data.copy_(dequantize_linear(stored, s, torch.float32))
    with torch.no_grad():
        torch.testing.assert_close(quantkit.load(out, torch.float32)(IDS).logits, ref(IDS).logits, rtol=1e-4, atol=1e-4)
    assert_engine_greedy_is_quantkit_loads(out)


def test_target_formats_name_the_fp4_formats(tmp_path, tiny_corpus, monkeypatch):
    from quantkit import assets

    monkeypatch.setattr(assets, "cache_dir", lambda: tmp_path / "cache")
    path = make_tiny_model(tmp_path / "m")
    calib = Calibration(str(tiny_corpus), 4, 32)
    prov = quantize(
        str(path), preset("nvfp4a16"), tmp_path / "q", "rtn", calib, target_bits=6.0, target_formats="nvfp4,float"
    )
    assert set(prov["mixed_precision"]["choice"].values()) <= {"nvfp4", "float"}
    with pytest.raises(QuantkitError, match="none of the formats int4-g128"):
        quantize(str(path), preset("nvfp4a16"), tmp_path / "r", "rtn", calib, target_bits=6.0, target_formats="int4")
    with pytest.raises(QuantkitError, match="activations are quantized too"):
        quantize(str(path), preset("nvfp4"), tmp_path / "s", "rtn", calib, target_bits=6.0)


def test_target_bits_over_nvfp4_on_a_mixture_of_experts(tmp_path, tiny_corpus, monkeypatch):
    """Mixtral: every expert's w1/w3 one unit and every w2 one; each expert's w1 and w3 share
    their NVFP4 weight global scale where the unit is NVFP4; the engine serves the checkpoint
    with the greedy tokens of `quantkit.load`'s model."""
    from conftest import make_family_model

    from quantkit import assets

    monkeypatch.setattr(assets, "cache_dir", lambda: tmp_path / "cache")
    path = make_family_model(tmp_path / "m", "mixtral", dtype=torch.bfloat16)
    out = tmp_path / "q"
    calib = Calibration(str(tiny_corpus), 8, 32, min_expert_tokens=1)
    prov = quantize(str(path), preset("nvfp4a16"), out, "rtn", calib, target_bits=6.0)
    choice = prov["mixed_precision"]["choice"]
    assert {"nvfp4", "int8"} <= set(choice.values()), choice
    t = read_tensors(out)
    gate_up = {label: c for label, c in choice.items() if ".experts." in label and ".w1" in label}
    assert "nvfp4" in gate_up.values(), choice  # else the shared scales are not checked
    for label, c in gate_up.items():
        p = label.split(".experts.")[0] + ".experts"
        experts = sorted({k.split(".experts.")[1].split(".")[0] for k in t if k.startswith(p + ".")}, key=int)
        for e in experts:
            assert (f"{p}.{e}.w1.weight_global_scale" in t) == (c == "nvfp4"), label
            if c == "nvfp4":
                assert torch.equal(t[f"{p}.{e}.w1.weight_global_scale"], t[f"{p}.{e}.w3.weight_global_scale"])
    assert_engine_greedy_is_quantkit_loads(out)
