"""Every family of models/arch.py end to end on a tiny random model of it (conftest.FAMILIES):
the engine's greedy tokens equal transformers' (fp32, alone and batched, prompts longer than
the sliding windows), `quantkit.load` gives transformers' logits (float and int4, and
transformers reads the symmetric checkpoint with compressed-tensors), every method runs,
AWQ folding keeps the float function through Gemma's (1 + w) norms, Phi-3's fused
projections and the routers of the mixtures of experts (Mixtral, Qwen2-MoE with its shared
expert and a dense layer, Qwen3-MoE), and the KV-cache hooks leave the function unchanged
until they quantize."""

from __future__ import annotations

import pytest
import torch
from conftest import FAMILIES, make_family_model
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import quantkit
from quantkit.calibration import rtn
from quantkit.calibration.kv import kv_args
from quantkit.calibration.method import Calibration
from quantkit.calibration.registry import METHODS
from quantkit.calibration.runner import run_blocks
from quantkit.models import kv_cache
from quantkit.models.arch import arch_for, get_module
from quantkit.models.loading import load_float_model
from quantkit.pipeline.quantize import quantize
from quantkit.runtime.engine import LLM
from quantkit.runtime.sequence import SamplingParams
from quantkit.scheme import preset

torch.set_num_threads(1)
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
PROMPTS = [[5, 17, 33, 2, 9], list(range(40, 80)), [7] * 23, list(range(200, 233))]  # windows are 12-20
IDS = torch.tensor([list(range(3, 43)), list(range(100, 140))])


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    return request.param, make_family_model(tmp_path_factory.mktemp("families") / request.param, request.param)


def hf_greedy(model, prompt):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


def test_engine_greedy_matches_transformers_alone_and_batched(family):
    name, path = family
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    reference = [hf_greedy(model, p) for p in PROMPTS]
    llm = LLM(str(path), block_size=16, num_blocks=48)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == reference, name
    assert [llm.generate([p], GREEDY)[0].token_ids for p in PROMPTS[1:3]] == reference[1:3], name


def test_load_float_and_int4_logits_match_transformers(family, tmp_path):
    name, path = family
    ref = AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        torch.testing.assert_close(quantkit.load(path)(IDS).logits, ref(IDS).logits, rtol=1e-5, atol=1e-5)
        quantize(str(path), preset("w4a16").with_group_size(32), tmp_path / "q")
        ours = quantkit.load(tmp_path / "q")(IDS).logits
        theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "q").eval()(IDS).logits  # compressed-tensors
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    assert (ours - ref(IDS).logits).abs().max() > 1e-3  # the weights were quantized


@pytest.mark.parametrize("method", ["awq", "gptq", "fp8"])
def test_every_method_runs_and_the_engine_serves_it(family, tiny_corpus, tmp_path, method):
    name, path = family
    scheme = preset("fp8-dynamic" if method == "fp8" else "w4a16-asym").with_group_size(None if method == "fp8" else 32)
    if method == "gptq":
        scheme = scheme.replace(kv_cache=kv_args("fp8"))
    prov = quantize(str(path), scheme, tmp_path / "q", method, Calibration(str(tiny_corpus), 4, 32))
    model = load_float_model(path)[0]
    spec = arch_for(model.config)
    linears = sum(len(spec.for_block(b).linears) for b in get_module(model, spec.blocks))
    assert prov["quantized_linears"] == linears > 2 * len(spec.sequential[0]), name
    outputs = LLM(str(tmp_path / "q"), block_size=16, num_blocks=32).generate(PROMPTS[:2], GREEDY)
    assert all(len(o.token_ids) == 8 for o in outputs)
    with torch.no_grad():
        assert torch.isfinite(quantkit.load(tmp_path / "q")(IDS).logits).all()


def test_awq_folding_keeps_the_float_function(family, monkeypatch):
    name, path = family
    monkeypatch.setattr(rtn, "quantize_weight", lambda w, args, dt, gs=None: (w, torch.ones(1), None))
    model, float_model = load_float_model(path)[0], load_float_model(path)[0]  # experts one linear each
    spec, method = arch_for(model.config), METHODS["awq"]
    scheme = preset("w4a16").with_group_size(32)
    options = method.options(clip=False)
    run_blocks(model, spec, method.make_step(spec, scheme, options, {}, torch.float32), IDS.repeat(2, 1)[:, :32], 2)
    with torch.no_grad():
        torch.testing.assert_close(model(IDS).logits, float_model(IDS).logits, rtol=1e-4, atol=1e-4)
        changed = [n for (n, a), b in zip(model.named_parameters(), float_model.parameters()) if not torch.equal(a, b)]
    assert any("layernorm" in n for n in changed), name  # scales went into the norms
    if name == "phi3":  # and into the v rows of qkv_proj / the up half of gate_up_proj
        assert {"model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.mlp.gate_up_proj.weight"} <= set(changed)
    if spec.moe is not None:  # the router (and the shared expert's gate) read the scaled norm: compensated
        readers = [f"model.layers.0.{spec.moe.router}.weight"] + [
            f"model.layers.0.{spec.moe.shared_gate}.weight"
        ] * bool(spec.moe.shared_gate)
        assert set(readers) <= set(changed), name


def test_kv_hooks_keep_the_function_until_they_quantize(family):
    name, path = family
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        before = model(IDS).logits
        with kv_cache.record_kv_amax(model):
            hooked = model(IDS).logits
        torch.testing.assert_close(hooked, before, rtol=1e-5, atol=1e-5)
        assert len(kv_cache.kv_amax(model)) == model.config.num_hidden_layers, name


def test_the_engine_refuses_what_its_forward_does_not_implement(tmp_path):
    from conftest import make_tiny_model

    from quantkit.errors import QuantkitError

    path = make_tiny_model(
        tmp_path / "dyn", "llama", rope_scaling={"rope_type": "dynamic", "factor": 2.0}, layer_types=None
    )
    with pytest.raises(QuantkitError) as e:
        LLM(str(path), block_size=16, num_blocks=8)
    assert "does not implement rope_type='dynamic' of this llama model" in str(e.value)
    assert str(e.value).count(". ") == 0 and str(e.value).endswith(".")


@pytest.mark.parametrize("fmt", ["awq", "gptq"])
def test_exports_of_fused_and_sandwiched_families_load_to_the_same_logits(tmp_path_factory, fmt):
    from quantkit.formats.interop import export

    tmp = tmp_path_factory.mktemp(fmt)
    for name in ("phi3", "gemma3"):
        path = make_family_model(tmp / name, name, dtype=torch.float16)  # fp16 scales, as AWQ/GPTQ store them
        quantize(str(path), preset("w4a16").with_group_size(32), tmp / f"{name}-ct")
        export(tmp / f"{name}-ct", tmp / f"{name}-{fmt}", fmt)
        a, b = (load_file(tmp / f"{name}-{kind}" / "model.safetensors") for kind in ("ct", fmt))
        with torch.no_grad():
            torch.testing.assert_close(
                quantkit.load(tmp / f"{name}-ct", torch.float32)(IDS).logits,
                quantkit.load(tmp / f"{name}-{fmt}", torch.float32)(IDS).logits,
                rtol=0,
                atol=0,
            )
        fused = "model.layers.0.self_attn.qkv_proj" if name == "phi3" else "model.layers.0.self_attn.q_proj"
        assert f"{fused}.weight_packed" in a and f"{fused}.qweight" in b
