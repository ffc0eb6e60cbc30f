import json

import pytest
import torch

from quantkit.errors import QuantkitError
from quantkit.formats.checkpoint import read_tensors
from quantkit.formats.gptq import to_gptq
from quantkit.formats.interop import export
from quantkit.formats.pack_quantized import decompress_ints
from quantkit.pipeline.quantize import Calibration, quantize
from quantkit.primitives import dequantize
from quantkit.scheme import from_quantization_config, preset


def spec_dequantize(qweight, qzeros, scales, g_idx):
    """Written from the GPTQ v1 layout description, not from our packer: input row r of
    output column c sits in qweight[r // 8, c] bits 4(r % 8)..; zeros are stored minus one."""
    in_f, out_f = qweight.shape[0] * 8, qweight.shape[1]
    w = torch.empty(out_f, in_f)
    for r in range(in_f):
        q = (qweight[r // 8].to(torch.int64) & 0xFFFFFFFF) >> (4 * (r % 8)) & 0xF
        g = int(g_idx[r])
        z = ((qzeros[g].to(torch.int64) & 0xFFFFFFFF).repeat_interleave(8) >> (4 * (torch.arange(out_f) % 8)) & 0xF) + 1
        w[:, r] = (q - z).float() * scales[g].float()
    return w


@pytest.mark.parametrize("name,actorder", [("w4a16", None), ("w4a16-asym", None), ("w4a16", "group")])
def test_export_matches_the_layout_description(tiny_llama, tiny_corpus, tmp_path, name, actorder):
    import dataclasses

    scheme = preset(name).with_group_size(32)
    scheme = scheme.replace(weights=dataclasses.replace(scheme.weights, actorder=actorder))
    quantize(str(tiny_llama), scheme, tmp_path / "ct", "gptq", Calibration(str(tiny_corpus), 4, 32))
    export(tmp_path / "ct", tmp_path / "gptq", "gptq")
    qc = json.loads((tmp_path / "gptq" / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "gptq" and qc["checkpoint_format"] == "gptq" and qc["bits"] == 4
    assert qc["group_size"] == 32 and qc["sym"] == scheme.weights.symmetric and qc["desc_act"] == (actorder == "group")
    options = json.loads((tmp_path / "ct" / "quantkit.json").read_text())["options"]
    assert qc["damp_percent"] == options["damp"]  # what GPTQ ran with
    ct, gq = read_tensors(tmp_path / "ct"), read_tensors(tmp_path / "gptq")
    args = (
        from_quantization_config(json.loads((tmp_path / "ct" / "config.json").read_text())["quantization_config"])
        .schemes[0]
        .weights
    )
    m = "model.layers.1.mlp.down_proj"
    assert gq[f"{m}.qweight"].shape == (128 // 8, 64) and gq[f"{m}.scales"].dtype == torch.float16
    q, scale, zero, g_idx = decompress_ints(
        {k.rsplit(".", 1)[1]: v for k, v in ct.items() if k.startswith(m + ".")}, args
    )
    ours = dequantize(q, scale.half().float(), zero, args, g_idx)
    theirs = spec_dequantize(gq[f"{m}.qweight"], gq[f"{m}.qzeros"], gq[f"{m}.scales"], gq[f"{m}.g_idx"])
    assert torch.equal(ours, theirs)
    assert "model.embed_tokens.weight" in gq and f"{m}.weight_packed" not in gq


def test_zero_point_zero_is_refused():
    q = torch.zeros(8, 8, dtype=torch.int8)
    with pytest.raises(QuantkitError, match="zero point of 0"):
        to_gptq(q, torch.ones(8, 1), torch.full((8, 1), -8, dtype=torch.int8), None, None, "layer")


def test_export_refuses_a_float_model(tiny_llama, tmp_path):
    with pytest.raises(QuantkitError, match="not a compressed-tensors pack-quantized checkpoint"):
        export(tiny_llama, tmp_path / "x", "gptq")
    assert not (tmp_path / "x").exists()


def test_weights_from_another_method_claim_no_damping(tiny_llama, tmp_path):
    quantize(str(tiny_llama), preset("w4a16").with_group_size(32), tmp_path / "rtn")
    export(tmp_path / "rtn", tmp_path / "gptq", "gptq")
    qc = json.loads((tmp_path / "gptq" / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "gptq" and "damp_percent" not in qc
