import dataclasses
import json
import shutil

import pytest
import torch
from conftest import make_tiny_model
from safetensors.torch import save_file
from typer.testing import CliRunner

import quantkit
from quantkit.cli import app
from quantkit.errors import QuantkitError
from quantkit.formats.checkpoint import read_tensors
from quantkit.formats.interop import export, read_int4
from quantkit.pipeline.quantize import Calibration, quantize
from quantkit.primitives import dequantize
from quantkit.scheme import preset

KINDS = ("sym", "asym", "channel", "actorder")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory, tiny_corpus):
    """compressed-tensors checkpoints of an fp16 tiny model (fp16 scales, which AWQ and GPTQ
    store as they are): symmetric and asymmetric RTN in groups of 32, asymmetric RTN per
    output channel, and GPTQ with act-order groups."""
    root = tmp_path_factory.mktemp("interop")
    model = make_tiny_model(root / "fp16-model", dtype=torch.float16)
    asym = preset("w4a16-asym").with_group_size(32)

    def weights(**changes):
        return asym.replace(weights=dataclasses.replace(asym.weights, **changes))

    quantize(str(model), preset("w4a16").with_group_size(32), root / "sym", "rtn")
    quantize(str(model), asym, root / "asym", "rtn")
    quantize(str(model), weights(strategy="channel", group_size=None), root / "channel", "rtn")
    quantize(str(model), weights(actorder="group"), root / "actorder", "gptq", Calibration(str(tiny_corpus), 4, 32))
    return {kind: root / kind for kind in KINDS}


def linears(path):
    return dict(read_int4(path).linears())


def assert_same_linears(a, b):
    assert a.keys() == b.keys() and len(a) == 14
    for name in a:
        for x, y in zip(a[name], b[name]):
            assert (x is None and y is None) or torch.equal(x, y), name


@pytest.mark.parametrize("kind", KINDS)
def test_round_trips_between_every_pair_are_bit_exact(ckpts, tmp_path, kind):
    ct = ckpts[kind]
    others = ("gptq",) if kind == "actorder" else ("awq", "gptq")  # AWQ has no act-order
    for fmt in others:
        export(ct, tmp_path / fmt, fmt)
        export(tmp_path / fmt, tmp_path / f"{fmt}-ct", "compressed-tensors")
        original, back = read_tensors(ct), read_tensors(tmp_path / f"{fmt}-ct")
        assert original.keys() == back.keys()
        assert all(torch.equal(original[k], back[k]) for k in original)  # every packed word, scale and zero
        assert_same_linears(linears(ct), linears(tmp_path / fmt))
    if kind != "actorder":
        export(tmp_path / "awq", tmp_path / "awq-gptq", "gptq")
        export(tmp_path / "gptq", tmp_path / "gptq-awq", "awq")
        for fmt, via in (("awq", "gptq-awq"), ("gptq", "awq-gptq")):
            a, b = read_tensors(tmp_path / fmt), read_tensors(tmp_path / via)
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ct_args = read_int4(ct).args
    for fmt in others:
        args = read_int4(tmp_path / fmt).args
        assert (args.symmetric, args.strategy, args.group_size, args.actorder) == (
            ct_args.symmetric,
            ct_args.strategy,
            ct_args.group_size,
            ct_args.actorder,
        )


def spec_dequantize_awq(qweight, qzeros, scales, group_size):
    """W [out, in] from the AutoAWQ GEMM description: nibble k of word c holds column
    8c + (0, 2, 4, 6, 1, 3, 5, 7)[k]; w = (q - z) * s."""
    order = (0, 2, 4, 6, 1, 3, 5, 7)

    def unpack(p):
        u = p.to(torch.int64) & 0xFFFFFFFF
        out = torch.empty(p.shape[0], p.shape[1] * 8, dtype=torch.int64)
        for k in range(8):
            out[:, [8 * c + order[k] for c in range(p.shape[1])]] = (u >> (4 * k)) & 0xF
        return out

    q, z = unpack(qweight), unpack(qzeros).repeat_interleave(group_size, 0)
    return ((q - z).float() * scales.float().repeat_interleave(group_size, 0)).t()


@pytest.mark.parametrize("kind", ("sym", "asym"))
def test_awq_export_matches_the_layout_description(ckpts, tmp_path, kind):
    export(ckpts[kind], tmp_path / "awq", "awq")
    config = json.loads((tmp_path / "awq" / "config.json").read_text())
    assert config["quantization_config"] == {
        "quant_method": "awq",
        "bits": 4,
        "group_size": 32,
        "zero_point": True,
        "version": "gemm",
        "modules_to_not_convert": ["lm_head", "model.embed_tokens"],
    }
    theirs, ours = read_tensors(tmp_path / "awq"), linears(ckpts[kind])
    args = read_int4(ckpts[kind]).args
    for name, (q, scale, zero, g_idx) in ours.items():
        w = spec_dequantize_awq(theirs[f"{name}.qweight"], theirs[f"{name}.qzeros"], theirs[f"{name}.scales"], 32)
        assert torch.equal(w, dequantize(q, scale.float(), zero, args, g_idx)), name
    assert "model.embed_tokens.weight" in theirs and "model.norm.weight" in theirs
    assert not any(k.endswith("weight_packed") for k in theirs)
    assert (tmp_path / "awq" / "tokenizer.json").is_file()


def logits(path):
    ids = torch.tensor([[1, 5, 9, 22, 40, 41, 300]])
    with torch.no_grad():
        return quantkit.load(path)(ids).logits


@pytest.mark.parametrize("kind", KINDS)
def test_load_of_awq_and_gptq_exports_gives_the_original_logits(ckpts, tmp_path, kind):
    reference = logits(ckpts[kind])
    for fmt in ("gptq",) if kind == "actorder" else ("awq", "gptq"):
        export(ckpts[kind], tmp_path / fmt, fmt)
        assert torch.equal(logits(tmp_path / fmt), reference), fmt


def test_load_reads_the_older_sidecar_config_files(ckpts, tmp_path):
    export(ckpts["asym"], tmp_path / "awq", "awq")
    config = json.loads((tmp_path / "awq" / "config.json").read_text())
    del config["quantization_config"]
    (tmp_path / "awq" / "config.json").write_text(json.dumps(config))
    (tmp_path / "awq" / "quant_config.json").write_text(
        json.dumps(  # what AutoAWQ writes
            {"zero_point": True, "q_group_size": 32, "w_bit": 4, "version": "GEMM"}
        )
    )
    assert torch.equal(logits(tmp_path / "awq"), logits(ckpts["asym"]))


def test_load_skips_the_zero_biases_older_autogptq_saves(ckpts, tmp_path):
    export(ckpts["sym"], tmp_path / "gptq", "gptq")
    tensors = read_tensors(tmp_path / "gptq")
    tensors["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(64, dtype=torch.float16)
    save_file(tensors, tmp_path / "gptq" / "model.safetensors")
    assert torch.equal(logits(tmp_path / "gptq"), logits(ckpts["sym"]))
    tensors["model.layers.0.self_attn.q_proj.bias"][3] = 1.0  # a real bias the model has no place for
    save_file(tensors, tmp_path / "gptq" / "model.safetensors")
    with pytest.raises(QuantkitError, match="has unexpected"):
        quantkit.load(tmp_path / "gptq")


def test_trivial_g_idx_with_desc_act_imports_without_act_order(ckpts, tmp_path):
    export(ckpts["sym"], tmp_path / "gptq", "gptq")
    config_path = tmp_path / "gptq" / "config.json"
    config = json.loads(config_path.read_text())
    config["quantization_config"]["desc_act"] = True
    config_path.write_text(json.dumps(config))
    args = read_int4(tmp_path / "gptq").args
    assert args.actorder is None and args.symmetric
    assert read_int4(ckpts["actorder"]).args.actorder == "group"


def with_quantization_config(src, dst, qc):
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = qc
    (dst / "config.json").write_text(json.dumps(config))
    return dst


LOADS = (
    "quantkit loads compressed-tensors pack-quantized (int4, int8; int4 on fp8 activations, w4afp8; other widths "
    "dequantized at load), compressed-tensors float-quantized (fp8), "
    "compressed-tensors int-quantized (W8A8 int8; int4 on fp8 activations, repacked at load), "
    "compressed-tensors float-quantized block (fp8 128x128), "
    "nvfp4-pack-quantized, mxfp4-pack-quantized, mxfp8-quantized (dequantized at load), "
    "compressed-tensors mixed-precision (config groups of the formats above), AutoAWQ GEMM (int4), GPTQ v1 (int4)."
)


@pytest.mark.parametrize(
    "qc,reason",
    [
        ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "is a 'bitsandbytes' checkpoint"),
        ({"quant_method": "exl2", "bits": 4.0}, "is a 'exl2' checkpoint from another tool"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 32, "checkpoint_format": "gptq_v2"}, "format 'gptq_v2'"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 32, "checkpoint_format": "marlin"}, "format 'marlin'"),
        ({"quant_method": "gptq", "bits": 8, "group_size": 32}, "with 8-bit weights"),
        ({"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemv"}, "'gemv' layout"),
        ({"quant_method": "compressed-tensors", "format": "mxfp6-pack-quantized"}, "in format 'mxfp6-pack-quantized'"),
    ],
)
def test_load_refuses_other_formats_in_one_sentence(ckpts, tmp_path, qc, reason):
    path = with_quantization_config(ckpts["sym"], tmp_path / "x", qc)
    with pytest.raises(QuantkitError) as e:
        quantkit.load(path)
    message = str(e.value)
    assert message.startswith(str(path)) and reason in message and message.endswith(LOADS)


def test_export_refusals_leave_nothing_behind(ckpts, tiny_llama, tmp_path):
    export(ckpts["asym"], tmp_path / "awq", "awq")
    awq_tensors = read_tensors(tmp_path / "awq")
    name = "model.layers.0.mlp.down_proj.qzeros"
    awq_tensors[name] = awq_tensors[name] & ~0xF  # one unsigned zero point of 0
    save_file(awq_tensors, tmp_path / "awq" / "model.safetensors")
    cases = [
        (ckpts["actorder"], "awq", "uses act-order groups (g_idx), which the AWQ layout cannot store"),
        (tmp_path / "awq", "gptq", "model.layers.0.mlp.down_proj has a zero point of 0 (unsigned)"),
        (tmp_path / "awq", "awq", "is already a awq checkpoint"),
        (tiny_llama, "gptq", "is not a compressed-tensors pack-quantized checkpoint"),
        (ckpts["sym"], "exl2", "export format 'exl2' is unknown"),
    ]
    for src, fmt, message in cases:
        with pytest.raises(QuantkitError, match=message.replace("(", r"\(").replace(")", r"\)")):
            export(src, tmp_path / "out", fmt)
        assert not (tmp_path / "out").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["awq"]


def test_a_group_size_that_disagrees_with_the_tensors_is_refused(ckpts, tmp_path):
    export(ckpts["asym"], tmp_path / "awq", "awq")
    qc = json.loads((tmp_path / "awq" / "config.json").read_text())["quantization_config"]
    bad = with_quantization_config(tmp_path / "awq", tmp_path / "bad", dict(qc, group_size=64))
    with pytest.raises(QuantkitError, match=r"has \d+ scale groups for \d+ inputs, which does not match group_size 64"):
        export(bad, tmp_path / "out", "compressed-tensors")
    assert not (tmp_path / "out").exists()


def test_export_command_for_each_format(ckpts, tmp_path):
    runner = CliRunner()
    steps = [
        (ckpts["asym"], "awq", "awq"),
        (ckpts["asym"], "gptq", "gptq"),
        (tmp_path / "awq", "compressed-tensors", "from-awq"),
        (tmp_path / "gptq", "awq", "gptq-awq"),
    ]
    for src, fmt, out in steps:
        r = runner.invoke(app, ["export", str(src), "--format", fmt, "-o", str(tmp_path / out)])
        assert r.exit_code == 0, r.output
        assert f"({fmt})" in r.stdout
        qc = json.loads((tmp_path / out / "config.json").read_text())["quantization_config"]
        assert qc["quant_method"] == fmt
        provenance = json.loads((tmp_path / out / "quantkit.json").read_text())
        assert provenance["export_format"] == fmt and provenance["exported_from"] == str(src)
    a, b = read_tensors(ckpts["asym"]), read_tensors(tmp_path / "from-awq")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    r = runner.invoke(app, ["export", str(ckpts["actorder"]), "--format", "awq", "-o", str(tmp_path / "x")])
    assert r.exit_code == 2 and "cannot store" in r.output and not (tmp_path / "x").exists()


@pytest.mark.parametrize("fmt", ["awq", "gptq"])
def test_inspect_describes_other_tools_checkpoints(ckpts, tmp_path, fmt):
    from quantkit.formats.inspect import describe

    ours = describe(str(ckpts["sym"]))
    other = describe(str(export(ckpts["sym"], tmp_path / fmt, fmt)))
    assert other["quant_method"] == fmt
    assert other["quantized_modules"] == ours["quantized_modules"] and ours["quantized_modules"]
    w = other["weights"]["group_0"]
    assert (w["num_bits"], w["group_size"]) == (4, ours["weights"]["group_0"]["group_size"])
    assert other["bits_per_weight"] == pytest.approx(ours["bits_per_weight"], abs=0.6)  # fp16 scales, int32 zeros
