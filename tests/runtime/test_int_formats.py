"""w4afp8 (int4 weights, fp8 per-token activations) and w3a16 (3-bit weights) end to end: each
weight method writes them, transformers + compressed-tensors loads them with the logits of
`quantkit.load`, and the engine's greedy tokens equal transformers' (llama3) or, for a MoE family
that transformers 5.24 cannot load as stored (Mixtral), `quantkit.load`'s."""

import json

import pytest
import torch
from conftest import make_family_model, make_tiny_model
from transformers import AutoModelForCausalLM

import quantkit
from quantkit.errors import QuantkitError
from quantkit.formats.checkpoint import read_tensors
from quantkit.formats.inspect import describe
from quantkit.pipeline.quantize import Calibration, quantize
from quantkit.runtime.engine import LLM
from quantkit.runtime.qlinear import PackedInt4Linear
from quantkit.runtime.sequence import SamplingParams
from quantkit.scheme import preset

torch.set_num_threads(1)
IDS = torch.randint(0, 320, (2, 16), generator=torch.Generator().manual_seed(0))
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
PROMPTS = [[5, 17, 33, 2, 9], list(range(40, 60))]


@pytest.fixture(scope="module")
def bf16_llama(tmp_path_factory):
    """hidden 128 / intermediate 256: whole groups of 128 (vLLM's W4A8Fp8 takes only those)."""
    path = tmp_path_factory.mktemp("models") / "llama-bf16"
    return make_tiny_model(path, dtype=torch.bfloat16, hidden_size=128, intermediate_size=256)


def hf_greedy(model, prompt, n=8):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


def logits(model):
    with torch.no_grad():
        return model(IDS).logits.float()


@pytest.mark.parametrize(
    "name, group, method",
    [("w4afp8", None, "rtn"), ("w4afp8", None, "gptq"), ("w4afp8", None, "awq"), ("w3a16", None, "rtn"),
     ("w3a16", 64, "gptq"), ("w3a16", 64, "awq")],
)  # fmt: skip
def test_transformers_reads_the_logits_of_quantkit_load(bf16_llama, tiny_corpus, tmp_path, name, group, method):
    out = tmp_path / "q"
    quantize(str(bf16_llama), preset(name).with_group_size(group), out, method, Calibration(str(tiny_corpus), 4, 32))
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "pack-quantized"
    bits = {"w4afp8": 4 + 16 / 128, "w3a16": 3 + 16 / (group or 128)}[name]  # bf16 group scales
    assert describe(str(out))["bits_per_weight"] == pytest.approx(bits, rel=2e-3)
    if method != "rtn":  # the searches chose full-range grids somewhere: negative scales on disk
        assert any((t < 0).any() for k, t in read_tensors(out).items() if k.endswith("weight_scale"))
    # float32: quantkit's int4 kernels sum in another order than transformers' float GEMM on
    # the dequantized weights; in bf16 such a rounding flips an fp8 activation now and then
    ours = quantkit.load(out, torch.float32)
    theirs = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    a, b, f = logits(ours), logits(theirs), logits(AutoModelForCausalLM.from_pretrained(bf16_llama).eval())
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    # still the float model's function, roughly (3 bits on a random tiny model: barely)
    assert not torch.equal(a, f) and (a - f).pow(2).mean() < (0.5 if name == "w4afp8" else 0.9) * f.pow(2).mean()
    if name == "w3a16":  # dequantized at load: in bf16 the same arithmetic as transformers, bit for bit
        bf16 = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16).eval()
        torch.testing.assert_close(logits(quantkit.load(out, torch.bfloat16)), logits(bf16), rtol=0, atol=0)


def test_w4afp8_quantizes_activations_per_token_in_fp8(bf16_llama, tiny_corpus, tmp_path):
    """The weights are w4a16's, bit for bit; the activations are fake-quantized (the logits differ
    from w4a16's on the same weights)."""
    for name in ("w4afp8", "w4a16"):
        quantize(str(bf16_llama), preset(name), tmp_path / name, "rtn", Calibration(str(tiny_corpus), 4, 32))
    t4, t8 = read_tensors(tmp_path / "w4a16"), read_tensors(tmp_path / "w4afp8")
    assert t4.keys() == t8.keys() and all(torch.equal(t4[k], t8[k]) for k in t4)  # the same weights on disk
    fp8 = quantkit.load(tmp_path / "w4afp8", torch.float32)
    assert isinstance(fp8.model.layers[0].self_attn.q_proj, PackedInt4Linear)
    assert fp8.model.layers[0].self_attn.q_proj.acts == preset("w4afp8").input_activations
    a, b = logits(fp8), logits(quantkit.load(tmp_path / "w4a16", torch.float32))
    assert not torch.equal(a, b) and (a - b).pow(2).mean() < 0.1 * b.pow(2).mean()  # fp8 rounding, not garbage


def as_int_quantized(packed, out):
    """`packed` (a pack-quantized w4afp8 checkpoint) as compressed-tensors 0.20.1 writes the same
    scheme when left to infer its format (llm-compressor's W4AFP8): int-quantized, one int8 per
    int4 value in `weight`, fp32 group scales."""
    from safetensors.torch import save_file

    from quantkit.packing import unpack

    out.mkdir()
    for f in packed.iterdir():
        if f.suffix != ".safetensors":
            (out / f.name).write_bytes(f.read_bytes())
    tensors = read_tensors(packed)
    for key in [k for k in tensors if k.endswith(".weight_packed")]:
        name = key.removesuffix(".weight_packed")
        shape = tensors.pop(f"{name}.weight_shape").tolist()
        tensors[f"{name}.weight"] = unpack(tensors.pop(key), shape[1], 4)
        tensors[f"{name}.weight_scale"] = tensors[f"{name}.weight_scale"].float()
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    qc = config["quantization_config"]
    for group in [qc, *qc["config_groups"].values()]:
        group["format"] = "int-quantized"
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_int_quantized_w4afp8_is_repacked_at_load(bf16_llama, tiny_corpus, tmp_path):
    """Another tool's W4AFP8 (int-quantized) loads to the logits of the same weights packed, and
    to transformers' on it; a value out of int4's range is named, not taken for a missing tensor."""
    quantize(str(bf16_llama), preset("w4afp8"), tmp_path / "q", "rtn", Calibration(str(tiny_corpus), 4, 32))
    other = as_int_quantized(tmp_path / "q", tmp_path / "int")
    stored = read_tensors(other)["model.layers.0.mlp.down_proj.weight"]
    assert stored.dtype == torch.int8 and stored.shape == (128, 256) and stored.abs().max() <= 8
    ours = quantkit.load(other, torch.float32)
    assert isinstance(ours.model.layers[0].mlp.down_proj, PackedInt4Linear)
    a = logits(ours)
    torch.testing.assert_close(a, logits(quantkit.load(tmp_path / "q", torch.float32)), rtol=1e-5, atol=1e-5)
    theirs = AutoModelForCausalLM.from_pretrained(other, dtype=torch.float32).eval()
    torch.testing.assert_close(a, logits(theirs), rtol=1e-4, atol=1e-4)

    from safetensors.torch import save_file

    tensors = read_tensors(other)
    tensors["model.layers.0.mlp.down_proj.weight"][0, 0] = 9
    save_file(tensors, other / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(QuantkitError, match="is int-quantized with int4 weights, but .*down_proj.weight is not int4"):
        quantkit.load(other)


@pytest.mark.parametrize("name", ["w4afp8", "w3a16"])
@pytest.mark.parametrize("family", ["llama3", "mixtral"])
def test_engine_greedy_equals_transformers(tmp_path, tiny_corpus, name, family):
    path = make_family_model(tmp_path / "m", family, dtype=torch.bfloat16, hidden_size=128, intermediate_size=256)
    out = tmp_path / "q"
    calibration = Calibration(str(tiny_corpus), 8, 32, min_expert_tokens=1)
    quantize(str(path), preset(name), out, "gptq" if family == "llama3" else "rtn", calibration)
    llm = LLM(str(out), dtype="float32", block_size=16, num_blocks=32)
    note = "fake-quantized per token" if name == "w4afp8" else "dequantized to float32 at load"
    assert any(note in n for n in llm.notes), llm.notes
    if family == "mixtral":  # transformers 5.24 fuses the experts and converts their tensors otherwise
        reference = quantkit.load(out, torch.float32)  # (docs/formats.md): the stored tensors, as stored
        expert = reference.get_submodule("model.layers.0.block_sparse_moe.experts.1.w3")
        assert isinstance(expert, PackedInt4Linear) == (name == "w4afp8")
    else:
        reference = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == [hf_greedy(reference, p) for p in PROMPTS]
