"""FP8 block-wise, NVFP4, MXFP4 and MXFP8 checkpoints end to end: RTN writes them, transformers
+ compressed-tensors loads them with the same logits as `quantkit.load` (bf16: transformers'
decompression makes bf16 weights, so a float32 model cannot run them there), the engine
serves them dequantized at load (greedy tokens equal to transformers'), and the NVFP4 global
scales vLLM needs shared are shared (q/k/v, gate/up, each expert's w1/w3; the input global
scale of all the experts of a MoE layer)."""

import json

import pytest
import torch
from conftest import make_family_model, make_tiny_model
from transformers import AutoModelForCausalLM

import quantkit
from quantkit.formats import fp4_packed
from quantkit.formats.checkpoint import read_tensors
from quantkit.formats.inspect import describe
from quantkit.pipeline.quantize import Calibration, quantize
from quantkit.runtime.engine import LLM
from quantkit.runtime.sequence import SamplingParams
from quantkit.scheme import preset

torch.set_num_threads(1)
IDS = torch.randint(0, 320, (2, 16), generator=torch.Generator().manual_seed(0))
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
PROMPTS = [[5, 17, 33, 2, 9], list(range(40, 60))]
BITS = {"nvfp4": 4.5, "mxfp4": 4.25, "mxfp8": 8.25, "fp8-block": 8.0}  # `quantkit inspect`: scales included
SCHEMES = ["nvfp4a16", "nvfp4", "mxfp4a16", "mxfp4", "mxfp8", "fp8-block"]


@pytest.fixture(scope="module")
def bf16_llama(tmp_path_factory):
    """hidden 128 so fp8-block's activation groups of 128 fit (transformers refuses a partial one)."""
    path = tmp_path_factory.mktemp("models") / "llama-bf16"
    return make_tiny_model(path, dtype=torch.bfloat16, hidden_size=128, intermediate_size=256)


def _quantize(src, name, out, corpus):
    method = "fp8" if name == "fp8-block" else "rtn"
    return quantize(str(src), preset(name), out, method, Calibration(str(corpus), 4, 32))


def hf_greedy(model, prompt, n=8):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("name", SCHEMES)
def test_transformers_logits_and_engine_greedy_equal_ours(bf16_llama, tiny_corpus, tmp_path, name):
    out = tmp_path / "q"
    _quantize(bf16_llama, name, out, tiny_corpus)
    fmt = json.loads((out / "config.json").read_text())["quantization_config"]["format"]
    assert fmt == preset(name).format
    assert describe(str(out))["bits_per_weight"] == pytest.approx(BITS[name.removesuffix("a16")], rel=2e-3)
    ours = quantkit.load(out, torch.bfloat16)
    theirs = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16).eval()
    float_model = AutoModelForCausalLM.from_pretrained(bf16_llama).eval()
    with torch.no_grad():
        a, b, f = ours(IDS).logits.float(), theirs(IDS).logits.float(), float_model(IDS).logits.float()
    torch.testing.assert_close(a, b, rtol=0, atol=0)  # same bf16 arithmetic, bit for bit
    assert not torch.equal(a, f) and (a - f).pow(2).mean() < 0.5 * f.pow(2).mean()
    # the engine in fp32 (in bf16 its fused GEMMs and paged attention round otherwise than
    # transformers' modules, which fp4 activations amplify into a different token now and then)
    # against transformers' generate on the same dequantized weights
    llm = LLM(str(out), dtype="float32", block_size=16, num_blocks=32)
    assert any("dequantized to float32 at load" in n for n in llm.notes)
    reference = quantkit.load(out, torch.float32)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == [hf_greedy(reference, p) for p in PROMPTS]


def test_nvfp4_global_scales_are_shared_where_vllm_fuses(bf16_llama, tiny_corpus, tmp_path):
    _quantize(bf16_llama, "nvfp4", tmp_path / "q", tiny_corpus)
    t = read_tensors(tmp_path / "q")
    w = read_tensors(bf16_llama)
    for i in range(2):
        p = f"model.layers.{i}"
        for group in (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj")):
            for kind in ("weight_global_scale", "input_global_scale"):
                assert len({t[f"{p}.{n}.{kind}"].item() for n in group}) == 1, (p, group, kind)
            # the smallest of the members' own scales (448 * 6 / the group's largest |w|)
            amax = max(w[f"{p}.{n}.weight"].float().abs().max() for n in group)
            assert t[f"{p}.{group[0]}.weight_global_scale"].item() == pytest.approx(448 * 6 / amax.item(), rel=1e-6)
        assert t[f"{p}.mlp.down_proj.weight_global_scale"] != t[f"{p}.mlp.up_proj.weight_global_scale"]


def test_moe_nvfp4_shares_expert_scales_and_serves(tmp_path, tiny_corpus):
    path = make_family_model(tmp_path / "m", "mixtral", dtype=torch.bfloat16)
    out = tmp_path / "q"
    quantize(str(path), preset("nvfp4"), out, "rtn", Calibration(str(tiny_corpus), 8, 32, min_expert_tokens=1))
    t = read_tensors(out)
    experts = sorted({k.split(".experts.")[1].split(".")[0] for k in t if ".experts." in k}, key=int)
    for i in range(2):
        p = f"model.layers.{i}.block_sparse_moe.experts"
        for e in experts:  # w1 (gate) and w3 (up) of each expert: one weight global scale
            assert torch.equal(t[f"{p}.{e}.w1.weight_global_scale"], t[f"{p}.{e}.w3.weight_global_scale"])
        for part in ("w1", "w3", "w2"):  # one input global scale for all the experts of the layer
            assert len({t[f"{p}.{e}.{part}.input_global_scale"].item() for e in experts}) == 1
        assert t[f"{p}.0.w1.input_global_scale"] == t[f"{p}.0.w3.input_global_scale"]
    ours = quantkit.load(out, torch.bfloat16)
    expert = ours.get_submodule("model.layers.0.block_sparse_moe.experts.1.w3")
    stored = {
        k.rsplit(".", 1)[1]: v for k, v in t.items() if k.startswith("model.layers.0.block_sparse_moe.experts.1.w3.")
    }
    assert torch.equal(expert.weight, fp4_packed.decompress(stored, preset("nvfp4").weights, torch.bfloat16))
    llm = LLM(str(out), dtype="float32", block_size=16, num_blocks=32)
    reference = [hf_greedy(quantkit.load(out, torch.float32), p) for p in PROMPTS]
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == reference


@pytest.mark.parametrize(
    "method, name",
    [
        ("gptq", "nvfp4"),
        ("gptq", "mxfp4a16"),
        ("gptq", "fp8-block"),
        ("gptq", "mxfp8"),
        ("awq", "nvfp4a16"),
        ("awq", "mxfp4"),
    ],
)
def test_gptq_and_awq_checkpoints_load_in_transformers(bf16_llama, tiny_corpus, tmp_path, method, name):
    out = tmp_path / "q"
    quantize(str(bf16_llama), preset(name), out, method, Calibration(str(tiny_corpus), 4, 32))
    t = read_tensors(out)
    if name.startswith("nvfp4"):  # shared by q/k/v (GPTQ: quantized stacked; AWQ: after the scales are folded)
        assert len({t[f"model.layers.0.self_attn.{n}_proj.weight_global_scale"].item() for n in "qkv"}) == 1
    assert ("model.layers.1.mlp.down_proj.input_global_scale" in t) == (name == "nvfp4")
    ours = quantkit.load(out, torch.bfloat16)
    theirs = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        torch.testing.assert_close(ours(IDS).logits, theirs(IDS).logits, rtol=0, atol=0)
