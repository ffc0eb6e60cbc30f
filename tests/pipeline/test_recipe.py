import json
import re
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

import quantkit
from quantkit.cli import app
from quantkit.errors import QuantkitError
from quantkit.models.arch import arch_for, get_module
from quantkit.pipeline.quantize import quantize
from quantkit.pipeline.recipe import apply_set, build_scheme, from_dict, load_recipe, run_recipe
from quantkit.primitives import fake_quantize
from quantkit.scheme import QuantArgs

runner = CliRunner()
IDS = torch.randint(0, 320, (2, 20), generator=torch.Generator().manual_seed(0))
BASE = {"model": "m", "scheme": "w4a16", "steps": ["rtn"]}


def text(result) -> str:
    return " ".join(result.output.split())


def same_tensors(a, b) -> bool:
    ta, tb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    return ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)


@pytest.mark.parametrize(
    "changes, message",
    [
        (
            {"steps": ["awq", "gptq"]},
            "steps: [awq, gptq] cannot run; a recipe has one weight step (rtn, awq, gptq, autoround, fp8), "
            "optionally after smooth or rotate and before kv, or kv alone.",
        ),
        ({"steps": ["smooth", "awq"]}, "steps: smooth runs before fp8, rtn or gptq, not before awq."),
        (
            {"scheme": "w4a16", "steps": ["smooth", "rtn"]},
            "scheme: smooth balances activation against weight quantization, but 'w4a16' keeps activations "
            "in float; use w8a8 or nvfp4 or mxfp4 or w4afp8 or mxfp8.",
        ),
        ({"steps": ["kv", "rtn"]}, "steps: [kv, rtn] cannot run"),
        (
            {"steps": ["awqq"]},
            "steps[0]: 'awqq' is not allowed; use one of rtn, awq, gptq, autoround, fp8, smooth, rotate, kv",
        ),
        (
            {"steps": [{"awq": {"gird": 3}}]},
            "steps[0].awq: unknown key 'gird'; allowed keys are grid, grid_stride, duo, clip",
        ),
        ({"steps": [{"gptq": {"damp": "lots"}}]}, "steps[0].gptq.damp: 'lots' is not allowed; use a number ≥ 0."),
        ({"steps": ["rtn", {"kv": {"dtype": "fp4"}}]}, "steps[1].kv.dtype: 'fp4' is not allowed; use fp8 or int8."),
        ({"scheme": "w5"}, "scheme: unknown scheme 'w5'; use one of: w4a16, w4a16-asym"),
        (
            {"scheme": {"preset": "w4a16", "strategy": "row"}},
            "scheme.strategy: 'row' is not allowed; use tensor, channel or group.",
        ),
        (
            {"scheme": {"preset": "w4a16", "actorder": "static"}},
            "scheme.actorder: 'static' is not allowed; use null with the rtn step",
        ),
        (
            {"scheme": "fp8-dynamic"},
            "scheme: the rtn step cannot make float-quantized weights; use w4a16 or w4a16-asym",
        ),
        ({"scheme": None}, "scheme is missing; the rtn step needs one"),
        ({"steps": ["kv"]}, "scheme: a recipe whose only step is kv keeps the model's weights; drop scheme."),
        (
            {"scheme": {"preset": "w4a16", "overrides": [{"targets": "down_proj", "group_size": 32}]}},
            "scheme.overrides[0].targets: 'down_proj' is not allowed; use a regex over module names, "
            "written 're:PATTERN'",
        ),
        (
            {"scheme": {"preset": "w4a16", "overrides": [{"targets": "re:x"}]}},
            "scheme.overrides[0]: give either weight args (num_bits, type,",
        ),
        ({"calibration": {"samples": 0}}, "calibration.samples: 0 is not allowed; use a positive integer."),
        ({"eval": {"tasks": "hellaswag"}}, "eval.tasks: 'hellaswag' is not allowed; use a list of task names."),
        (
            {"evals": {}},
            "recipe: unknown key 'evals'; allowed keys are model, scheme, steps, calibration, eval, output",
        ),
        ({"model": None}, "model is missing"),
        ({"steps": [["rtn"]]}, "steps[0]: ['rtn'] is not allowed; use one of rtn, awq"),
        ({"scheme": {"preset": ["w4a16"]}}, "scheme: unknown scheme ['w4a16']"),
        ({"target_formats": ["int4"]}, "target_formats (--target-formats) goes with target_bits (--target-bits)"),
        (
            {"target_bits": 5, "target_formats": ["int3"]},
            "target_formats: 'int3' is not a format --target-bits chooses; use int4 (every group size) or int4-g128",
        ),
        ({"target_bits": 5, "target_formats": 4}, "target_formats: 4 is not allowed; use a list of formats"),
    ],
)
def test_validation_errors_name_the_key_and_the_allowed_values(changes, message):
    with pytest.raises(QuantkitError) as e:
        from_dict(BASE | changes)
    assert message in str(e.value)
    assert str(e.value).replace("e.g. ", "").count(". ") == 0 and str(e.value).endswith(".")  # one sentence


def test_the_documented_example_is_a_valid_recipe():
    docs = (Path(__file__).resolve().parents[2] / "docs" / "commands.md").read_text()
    section = docs[docs.index("## `quantkit run` and recipes") :]
    example = section[section.index("```yaml") + len("```yaml") : section.index("```\n", section.index("```yaml"))]
    r = from_dict(yaml.safe_load(example))
    scheme = build_scheme(r.scheme)
    assert [s.name for s in r.steps] == ["gptq", "kv"] and scheme.overrides[0].weights.group_size == 32
    assert scheme.scheme_for("model.layers.0.self_attn.q_proj") is None


def test_set_and_yaml_round_trip(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("model: m\nscheme: w4a16\nsteps: [gptq]\n")
    r = load_recipe(
        path,
        [
            "scheme.group_size=32",
            "steps.0.gptq.damp=0.1",
            "calibration.samples=4",
            "eval.limit=2",
            "model=other",
            "scheme.overrides=[{targets: 're:.*down_proj$', group_size: 64}]",
        ],
    )
    assert r.model == "other" and r.scheme.weights == {"group_size": 32} and r.steps[0].options["damp"] == 0.1
    assert r.calibration.samples == 4 and r.eval["limit"] == 2 and r.eval["ppl"] == "wiki"
    assert from_dict(yaml.safe_load(r.to_yaml())) == r
    scheme = build_scheme(r.scheme)
    assert scheme.weights.group_size == 32 and scheme.overrides[0].weights.group_size == 64
    assert scheme.scheme_for("model.layers.0.mlp.down_proj") is scheme.overrides[0]
    assert scheme.scheme_for("model.layers.0.mlp.up_proj") is scheme and scheme.scheme_for("lm_head") is None
    twice = load_recipe(
        path,
        [
            "scheme=w4a16",
            "scheme.overrides=[{targets: 're:.*mlp.*', group_size: 32}, {targets: 're:.*proj$', group_size: 64}]",
        ],
    )
    with pytest.raises(
        QuantkitError,
        match="model.layers.0.mlp.up_proj is matched by the overrides 're:.*mlp.*' and "
        "'re:.*proj\\$'; make their targets disjoint.",
    ):
        build_scheme(twice.scheme).scheme_for("model.layers.0.mlp.up_proj")
    for bad, message in [
        ("calibration", "--set 'calibration' needs the form key.path=value"),
        ("steps.3.gptq.damp=1", "--set steps.3.gptq.damp: steps has 1 entries, so it has no '3'."),
        ("model.name=x", "--set model.name: model is 'm', so it has no 'name'."),
    ]:
        with pytest.raises(QuantkitError, match=re.escape(message)):
            apply_set(yaml.safe_load(path.read_text()), bad)
    path.write_text("model: m\nsteps: [rtn\n")
    with pytest.raises(QuantkitError, match="is not valid YAML"):
        load_recipe(path)


def test_print_recipe_then_run_reproduces_the_command(tiny_llama, tmp_path):
    argv = ["rtn", "--model", str(tiny_llama), "--scheme", "w4a16-asym", "--group-size", "32"]
    r = runner.invoke(app, [*argv, "-o", str(tmp_path / "direct")])
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, [*argv, "--print-recipe"])
    assert r.exit_code == 0, r.output
    assert yaml.safe_load(r.stdout)["scheme"] == {"preset": "w4a16-asym", "group_size": 32}
    assert not (tmp_path / "direct2").exists()
    (tmp_path / "r.yaml").write_text(r.stdout)
    r = runner.invoke(app, ["run", str(tmp_path / "r.yaml"), "-o", str(tmp_path / "via-run")])
    assert r.exit_code == 0, r.output
    assert same_tensors(tmp_path / "direct", tmp_path / "via-run")

    stored = json.loads((tmp_path / "via-run" / "quantkit.json").read_text())["recipe"]
    assert stored["output"] == str(tmp_path / "via-run") and stored["steps"] == [{"rtn": {}}]
    (tmp_path / "stored.yaml").write_text(yaml.safe_dump(stored))
    r = runner.invoke(app, ["run", str(tmp_path / "stored.yaml"), "--set", f"output={tmp_path / 'again'}"])
    assert r.exit_code == 0, r.output
    assert same_tensors(tmp_path / "direct", tmp_path / "again")

    r = runner.invoke(
        app, ["run", str(tmp_path / "stored.yaml"), "--set", "scheme.group_size=128", "-o", str(tmp_path / "x")]
    )
    assert r.exit_code == 2 and "does not divide the input width 64" in text(r)
    r = runner.invoke(app, ["run", str(tmp_path / "stored.yaml"), "--set", "steps=[awq, gptq]"])
    assert r.exit_code == 2 and "steps: [awq, gptq] cannot run" in text(r)
    r = runner.invoke(app, ["rtn", "--model", str(tiny_llama)])
    assert r.exit_code == 2 and "-o/--output is missing" in text(r)
    assert not (tmp_path / "x").exists()


def test_every_command_prints_its_recipe(tiny_llama):
    cases = [
        (
            ["awq", "--group-size", "64", "--kv-cache", "int8", "--no-clip", "--gptq"],
            lambda d: (
                d["steps"][0]["awq"]["clip"] is False
                and d["steps"][0]["awq"]["gptq"] is True
                and d["steps"][1] == {"kv": {"dtype": "int8", "per_head": False}}
            ),
        ),
        (
            ["gptq", "--act-order", "group", "--damp", "0.05"],
            lambda d: d["scheme"]["actorder"] == "group" and d["steps"][0]["gptq"]["damp"] == 0.05,
        ),
        (["gptq", "--act-order", "none"], lambda d: d["scheme"] == "w4a16"),
        (
            ["fp8", "--scheme", "fp8", "--smooth"],
            lambda d: d["scheme"] == "fp8" and d["steps"] == [{"smooth": {"grid": 10}}, {"fp8": {}}],
        ),
        (
            ["kv", "some-checkpoint", "--per-head"],
            lambda d: (
                d["model"] == "some-checkpoint"
                and d["steps"] == [{"kv": {"dtype": "fp8", "per_head": True}}]
                and "scheme" not in d
            ),
        ),
    ]
    for argv, check in cases:
        r = runner.invoke(app, [*argv, "--print-recipe", "-o", "out"])
        assert r.exit_code == 0, (argv, r.output)
        d = yaml.safe_load(r.stdout)
        assert d["output"] == "out" and check(d), (argv, d)
        assert from_dict(d).to_dict() == d


def per_module_reference(path, args_for):
    """The float model with each block linear fake-quantized with args_for(name) (None: kept)."""
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    spec = arch_for(model.config)
    for i, block in enumerate(get_module(model, spec.blocks)):
        for name in spec.linears:
            args = args_for(f"{spec.blocks}.{i}.{name}")
            if args is not None:
                lin = get_module(block, name)
                lin.weight.data = fake_quantize(lin.weight.data, args)
    return model


OVERRIDES = {
    "preset": "w4a16",
    "group_size": 32,
    "overrides": [
        {"targets": r"re:.*mlp\.down_proj$", "group_size": 64},
        {"targets": [r"re:.*layers\.1\.self_attn\.o_proj$"], "ignore": True},
    ],
}


def test_overrides_reach_the_checkpoint_and_the_loaders(tiny_llama, tmp_path):
    recipe = from_dict({"model": str(tiny_llama), "scheme": OVERRIDES, "steps": ["rtn"]})
    run_recipe(recipe, tmp_path / "q")
    qc = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    groups = qc["config_groups"]
    assert groups["group_0"]["targets"] == ["Linear"] and groups["group_0"]["weights"]["group_size"] == 32
    assert groups["group_1"]["targets"] == [r"re:.*mlp\.down_proj$"]
    assert groups["group_1"]["weights"]["group_size"] == 64
    assert qc["ignore"] == ["model.layers.1.self_attn.o_proj", "lm_head"]

    g32, g64 = QuantArgs(group_size=32), QuantArgs(group_size=64)
    ref = per_module_reference(
        tiny_llama,
        lambda n: None if n == "model.layers.1.self_attn.o_proj" else g64 if n.endswith("down_proj") else g32,
    )
    ours = quantkit.load(tmp_path / "q")
    assert ours.model.layers[0].mlp.down_proj.args.group_size == 64
    assert ours.model.layers[0].mlp.up_proj.args.group_size == 32
    assert isinstance(ours.model.layers[1].self_attn.o_proj, torch.nn.Linear)
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "q").eval()  # compressed-tensors reads the groups
    with torch.no_grad():
        torch.testing.assert_close(ours(IDS).logits, ref(IDS).logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(theirs(IDS).logits, ours(IDS).logits, rtol=1e-6, atol=1e-6)


def test_gptq_and_awq_honour_overrides_and_awq_keeps_a_mapping_on_one_scheme(tiny_llama, tiny_corpus, tmp_path):
    raw = {
        "model": str(tiny_llama),
        "scheme": OVERRIDES | {"actorder": "static"},
        "steps": ["gptq"],
        "calibration": {"dataset": str(tiny_corpus), "samples": 4, "seq_len": 32},
    }
    prov = run_recipe(from_dict(raw), tmp_path / "g")
    assert prov["quantized_linears"] == 13 and prov["recipe"]["scheme"]["overrides"][0]["group_size"] == 64
    tensors = load_file(tmp_path / "g" / "model.safetensors")
    assert tensors["model.layers.0.mlp.down_proj.weight_scale"].shape == (64, 128 // 64)
    assert tensors["model.layers.0.mlp.up_proj.weight_scale"].shape == (128, 64 // 32)
    assert "model.layers.1.self_attn.o_proj.weight" in tensors
    assert quantkit.load(tmp_path / "g").model.layers[1].mlp.down_proj.args.group_size == 64

    # AWQ: down_proj alone in its up -> down mapping, so it may take other args
    prov = run_recipe(from_dict(raw | {"scheme": OVERRIDES, "steps": ["awq"]}), tmp_path / "a")
    assert prov["quantized_linears"] == 13
    tensors = load_file(tmp_path / "a" / "model.safetensors")
    assert tensors["model.layers.0.mlp.down_proj.weight_scale"].shape == (64, 128 // 64)
    assert tensors["model.layers.0.mlp.up_proj.weight_scale"].shape == (128, 64 // 32)
    # but not q_proj apart from k and v: they share the scales folded into input_layernorm
    split = OVERRIDES | {"overrides": [{"targets": r"re:.*q_proj$", "group_size": 64}]}
    with pytest.raises(QuantkitError, match="k_proj gets other weight args than .*q_proj but shares the scales folded"):
        quantize(str(tiny_llama), build_scheme(from_dict(raw | {"scheme": split}).scheme), tmp_path / "b", "awq")
    assert not (tmp_path / "b").exists()


def test_kv_alone_runs_and_records_its_recipe(tiny_llama, tiny_corpus, tmp_path):
    calib = ["--calib", str(tiny_corpus), "--samples", "4", "--seq-len", "32"]
    r = runner.invoke(app, ["kv", str(tiny_llama), "--dtype", "int8", *calib, "-o", str(tmp_path / "kv")])
    assert r.exit_code == 0, r.output
    assert "int8, one scale per layer" in text(r)
    kv = json.loads((tmp_path / "kv" / "quantkit.json").read_text())["kv_cache"]
    assert kv["recipe"]["steps"] == [{"kv": {"dtype": "int8", "per_head": False}}]
    assert kv["recipe"]["model"] == str(tiny_llama)


def test_a_failed_gate_exits_1_and_keeps_the_checkpoint(tiny_llama, tiny_corpus, tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "model": str(tiny_llama),
                "scheme": {"preset": "w4a16", "group_size": 32},
                "steps": ["rtn"],
                "eval": {"ppl": str(tiny_corpus), "limit": 2, "seq_len": 32, "min_recovery": 5.0},
            }
        )
    )
    r = runner.invoke(app, ["run", str(path), "-o", str(tmp_path / "q")])
    assert r.exit_code == 1, r.output
    assert "gate failed: ppl recovered" in text(r) and "below the required 5" in text(r)
    assert "FAIL" in r.stdout and (tmp_path / "q" / "model.safetensors").is_file()
    r = runner.invoke(app, ["run", str(path), "--set", "eval.ppl=null", "-o", str(tmp_path / "x")])
    assert r.exit_code == 2 and "eval: nothing to evaluate; give ppl" in text(r)
    assert not (tmp_path / "x").exists()


def test_awq_refuses_an_ignore_list_that_splits_a_scaled_group(tiny_llama, tiny_corpus, tmp_path):
    raw = {
        "model": str(tiny_llama),
        "scheme": {"preset": "w4a16", "group_size": 32, "ignore": ["lm_head", r"re:.*k_proj$"]},
        "steps": ["awq"],
        "calibration": {"dataset": str(tiny_corpus), "samples": 4, "seq_len": 32},
    }
    with pytest.raises(
        QuantkitError,
        match=r"model.layers.0.self_attn.k_proj is ignored but shares the scales "
        r"folded into model.layers.0.input_layernorm with self_attn.q_proj, ",
    ):
        run_recipe(from_dict(raw), tmp_path / "a")
    raw["scheme"]["ignore"] = ["lm_head", r"re:.*self_attn\.[qkv]_proj$"]  # the whole group: fine
    assert (
        run_recipe(from_dict(raw | {"steps": [{"awq": {"grid": 2, "clip": False}}]}), tmp_path / "b")[
            "quantized_linears"
        ]
        == 8
    )
