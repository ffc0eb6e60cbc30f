"""`--lm-head int8`: the output projection quantized too (round to nearest, int8 per channel),
untied from the embeddings; quantkit and transformers (compressed-tensors) load it alike."""

import dataclasses
import json

import pytest
import torch
from test_quantize import fake_quantized_reference
from transformers import AutoModelForCausalLM

import quantkit
from quantkit.errors import QuantkitError
from quantkit.pipeline.head import HEAD_ARGS
from quantkit.pipeline.quantize import quantize
from quantkit.primitives import fake_quantize
from quantkit.runtime.qlinear import PackedInt4Linear, PackedInt8Linear
from quantkit.scheme import preset

IDS = torch.randint(0, 320, (2, 20), generator=torch.Generator().manual_seed(0))


def reference(path, scheme, head_args):
    """The float model, untied, its block linears rounded as `scheme` and its head as `head_args`."""
    model = fake_quantized_reference(path, scheme)
    head = model.get_output_embeddings()
    head.weight = torch.nn.Parameter(fake_quantize(head.weight.data.clone(), head_args))
    return model


@pytest.mark.parametrize("tie, kind", [(True, "int8"), (False, "int8"), (True, "int4")])
def test_quantized_head_loads_to_the_fake_quantized_model(tmp_path, tie, kind):
    from conftest import make_tiny_model

    path = make_tiny_model(tmp_path / "m", model_type="qwen2", tie=tie)
    scheme = preset("w4a16").with_group_size(32)
    quantize(str(path), scheme, tmp_path / "q", lm_head=kind)
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    qc = config["quantization_config"]
    assert config["tie_word_embeddings"] is False and "lm_head" not in qc["ignore"]
    head_group = [g for g in qc["config_groups"].values() if g["targets"] == ["lm_head"]]
    head_args = HEAD_ARGS[kind]
    if kind == "int4":  # groups of 128 do not divide the hidden size 64: fitted to 64
        head_args = dataclasses.replace(head_args, group_size=64)
    assert len(head_group) == 1 and head_group[0]["weights"] == head_args.to_dict()
    assert head_group[0]["format"] == "pack-quantized"
    model = quantkit.load(tmp_path / "q")
    assert isinstance(model.lm_head, PackedInt8Linear if kind == "int8" else PackedInt4Linear)
    assert model.model.embed_tokens.weight.dtype == torch.float32  # the embeddings stay float
    ref = reference(path, scheme, head_args)
    with torch.no_grad():
        ours = model(IDS).logits
        torch.testing.assert_close(ours, ref(IDS).logits, rtol=1e-5, atol=1e-5)
        # compressed-tensors (through transformers) reads the same quantized head
        theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "q").eval()
        assert not theirs.config.tie_word_embeddings
        torch.testing.assert_close(theirs(IDS).logits, ours, rtol=1e-5, atol=1e-5)


def test_engine_decodes_with_the_int8_head(tmp_path):
    from conftest import make_tiny_model

    from quantkit.runtime.engine import LLM
    from quantkit.runtime.sequence import SamplingParams

    path = make_tiny_model(tmp_path / "m", tie=True)
    quantize(str(path), preset("w4a16").with_group_size(32), tmp_path / "q", lm_head="int8")
    llm = LLM(str(tmp_path / "q"), dtype="float32", block_size=16, num_blocks=16)
    out = llm.generate([IDS[0].tolist()], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    ids = IDS[:1]
    model = quantkit.load(tmp_path / "q", torch.float32)
    with torch.no_grad():
        for _ in range(8):  # greedy, one token at a time, through the module
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert out.token_ids == ids[0, 20:].tolist()


def test_bad_head_options_are_refused(tiny_llama, tmp_path):
    out = tmp_path / "q"
    with pytest.raises(QuantkitError, match="unknown"):
        quantize(str(tiny_llama), preset("w4a16").with_group_size(32), out, lm_head="int3")
    with pytest.raises(QuantkitError, match="weight-only int scheme"):
        quantize(str(tiny_llama), preset("w8a8"), out, lm_head="int8")
    with pytest.raises(QuantkitError, match="target-bits"):
        quantize(str(tiny_llama), preset("w4a16").with_group_size(32), out, lm_head="int8", target_bits=4.5)
    assert not out.exists()
