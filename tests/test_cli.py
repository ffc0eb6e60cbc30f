import dataclasses
import json
import subprocess
import sys
from dataclasses import dataclass
from typing import Optional

import typer
import yaml
from typer.testing import CliRunner

from quantkit import quantize
from quantkit.calibration.method import Method, option
from quantkit.calibration.registry import METHODS, weight_methods
from quantkit.cli import app, build_app
from quantkit.pipeline import options
from quantkit.pipeline.recipe import from_dict

runner = CliRunner()


def test_rtn_inspect_eval_end_to_end(tiny_llama, tiny_corpus, tmp_path):
    out = tmp_path / "q"
    r = runner.invoke(
        app, ["rtn", "--model", str(tiny_llama), "--scheme", "w4a16-asym", "--group-size", "32", "-o", str(out)]
    )
    assert r.exit_code == 0, r.output
    assert "quantized linears" in r.stdout and (out / "model.safetensors").is_file()

    r = runner.invoke(app, ["inspect", str(out), "--json", str(tmp_path / "i.json")])
    assert r.exit_code == 0, r.output
    info = json.loads((tmp_path / "i.json").read_text())
    assert len(info["quantized_modules"]) == 14 and info["ignored_modules"] == ["lm_head"]
    assert 4.0 < info["bits_per_weight"] < 6.0  # 4 bits + a scale and zero point per 32 weights
    assert info["provenance"]["algorithm"] == "rtn"

    for model in (str(tiny_llama), str(out)):
        r = runner.invoke(
            app,
            [
                "eval",
                model,
                "--ppl",
                str(tiny_corpus),
                "--seq-len",
                "64",
                "--limit",
                "3",
                "--json",
                str(tmp_path / "e.json"),
            ],
        )
        assert r.exit_code == 0, r.output
        result = json.loads((tmp_path / "e.json").read_text())
        assert result["windows"] == 3 and result["seq_len"] == 64 and result["tokens"] == 192
        assert result["dataset"] == str(tiny_corpus) and result["ppl"] > 1
        # results travel with a quantkit checkpoint (quantkit.json and its model card), not a float model
        assert result["recorded"] == (model == str(out))
    assert not (tiny_llama / "README.md").exists()
    evaluations = json.loads((out / "quantkit.json").read_text())["evaluations"]
    assert [(e["ppl"], e["limit"], e["rows"][0]["metric"]) for e in evaluations] == [(str(tiny_corpus), 3, "ppl")]
    assert evaluations[0]["rows"][0]["candidate"] == result["ppl"]
    card = (out / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: transformers\n") and "| `Linear` | int4, group 32, asymmetric |" in card
    assert f"| ppl | {result['ppl']:.4f} |" in card and f"vllm serve {out.name}" in card


def test_user_errors_exit_2_with_one_sentence(tiny_llama, tmp_path):
    cases = [
        (["rtn", "--model", "no-such-model-anywhere", "-o", str(tmp_path / "a")], "no-such-model-anywhere"),
        (["rtn", "--model", str(tiny_llama), "--scheme", "w5", "-o", str(tmp_path / "b")], "unknown scheme 'w5'"),
        (
            ["rtn", "--model", str(tiny_llama), "--group-size", "128", "-o", str(tmp_path / "c")],
            "does not divide the input width 64",
        ),
        (
            ["rtn", "--model", str(tiny_llama), "--group-size", "big", "-o", str(tmp_path / "d")],
            "--group-size 'big' is neither a positive number nor auto",
        ),
        (
            ["rtn", "--model", str(tiny_llama), "--kv-cache", "fp4", "-o", str(tmp_path / "e")],
            "KV-cache type 'fp4' is unknown; use fp8 or int8.",
        ),
        (["eval", str(tiny_llama), "--ppl", "nonsense"], "unknown dataset 'nonsense'"),
        (["eval", str(tiny_llama), "--ppl", "wiki", "--seq-len", "4096"], "exceeds the model's context of 256"),
        (["inspect", str(tmp_path / "missing")], "does not exist"),
    ]
    for argv, message in cases:
        r = runner.invoke(app, argv)
        assert r.exit_code == 2, (argv, r.output)
        assert message in " ".join(r.output.split()), (argv, r.output)
        assert "Traceback" not in r.output
    assert list(tmp_path.iterdir()) == []


def test_rtn_runs_on_its_defaults_with_an_automatic_group_size(tiny_llama, tmp_path):
    """No --group-size: 128 does not divide the tiny model's widths (64, 128), so 64 is taken and said."""
    r = runner.invoke(
        app, ["rtn", "--model", str(tiny_llama), "-o", str(tmp_path / "q"), "--json", str(tmp_path / "p.json")]
    )
    assert r.exit_code == 0, r.output
    assert "group size 64: 128 does not divide the input width 64" in " ".join(r.output.split())
    prov = json.loads((tmp_path / "p.json").read_text())
    assert prov["weights"]["group_size"] == 64 and prov["recipe"]["scheme"] == "w4a16"
    qc = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    assert qc["config_groups"]["group_0"]["weights"]["group_size"] == 64


def test_version_and_help_have_no_broken_sentences():
    from quantkit.version import __version__

    r = runner.invoke(app, ["--version"])
    assert r.exit_code == 0 and r.stdout.strip() == f"quantkit {__version__}"
    for command in app.registered_commands:
        assert "\n" not in command.help.split("\n\n")[0], command.name  # first paragraph on one line


def test_awq_gptq_export_commands(tiny_llama, tiny_corpus, tmp_path):
    common = [
        "--model",
        str(tiny_llama),
        "--group-size",
        "32",
        "--calib",
        str(tiny_corpus),
        "--samples",
        "4",
        "--seq-len",
        "32",
    ]
    r = runner.invoke(
        app,
        [
            "awq",
            *common,
            "--scheme",
            "w4a16-asym",
            "-o",
            str(tmp_path / "awq"),
            "--save-search",
            str(tmp_path / "search.safetensors"),
        ],
    )
    assert r.exit_code == 0, r.output
    assert (tmp_path / "search.safetensors").is_file() and "calibration" in r.stdout
    r = runner.invoke(app, ["gptq", *common, "--act-order", "group", "-o", str(tmp_path / "gptq")])
    assert r.exit_code == 0, r.output
    assert (
        json.loads((tmp_path / "gptq" / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"][
            "weights"
        ]["actorder"]
        == "group"
    )
    r = runner.invoke(app, ["export", str(tmp_path / "gptq"), "--format", "gptq", "-o", str(tmp_path / "exp")])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "exp" / "model.safetensors").is_file()
    for argv, message in [
        (["gptq", *common, "--act-order", "sideways", "-o", str(tmp_path / "x")], "--act-order 'sideways' is unknown"),
        (["export", str(tmp_path / "gptq"), "--format", "exl2", "-o", str(tmp_path / "x")], "export format 'exl2'"),
        (["awq", *common, "--samples", "5000", "-o", str(tmp_path / "x")], "use fewer --samples"),
    ]:
        r = runner.invoke(app, argv)
        assert r.exit_code == 2 and message in " ".join(r.output.split()), (argv, r.output)
    assert not (tmp_path / "x").exists()


def test_fp8_and_kv_commands(tiny_llama, tiny_corpus, tmp_path):
    calib = ["--calib", str(tiny_corpus), "--samples", "4", "--seq-len", "32"]
    r = runner.invoke(
        app,
        [
            "fp8",
            "--model",
            str(tiny_llama),
            "--scheme",
            "fp8",
            *calib,
            "--kv-cache",
            "fp8",
            "-o",
            str(tmp_path / "fp8"),
        ],
    )
    assert r.exit_code == 0, r.output
    assert "kv cache" in r.stdout and "static tensor activations" in " ".join(r.stdout.split())
    r = runner.invoke(app, ["rtn", "--model", str(tiny_llama), "--group-size", "32", "-o", str(tmp_path / "rtn")])
    assert r.exit_code == 0, r.output
    r = runner.invoke(
        app, ["kv", str(tmp_path / "rtn"), "--dtype", "int8", "--per-head", *calib, "-o", str(tmp_path / "kv")]
    )
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["inspect", str(tmp_path / "kv"), "--json", str(tmp_path / "i.json")])
    assert json.loads((tmp_path / "i.json").read_text())["kv_cache_scheme"]["strategy"] == "attn_head"
    r = runner.invoke(app, ["kv", str(tmp_path / "kv"), *calib, "-o", str(tmp_path / "kv2")])
    assert r.exit_code == 2 and "already has KV-cache scales" in " ".join(r.output.split())
    r = runner.invoke(
        app, ["rtn", "--model", str(tiny_llama), "--group-size", "32", "--kv-cache", "fp4", "-o", str(tmp_path / "x")]
    )
    assert r.exit_code == 2 and "KV-cache type 'fp4' is unknown" in " ".join(r.output.split())
    assert not (tmp_path / "kv2").exists() and not (tmp_path / "x").exists()


def test_generate_streams_and_reports_timings(tiny_llama):
    r = runner.invoke(app, ["generate", str(tiny_llama), "--prompt", "The quick brown fox", "--max-tokens", "5"])
    assert r.exit_code == 0, r.output
    text = " ".join(r.stdout.split())
    assert "TTFT" in text and "TPOT" in text and "tokens/s" in text and "generated" in text
    r = runner.invoke(app, ["generate", str(tiny_llama), "--prompt", "x", "--dtype", "int3"])
    assert r.exit_code == 2 and "dtype 'int3' is unknown" in " ".join(r.output.split())
    r = runner.invoke(app, ["generate", str(tiny_llama), "--prompt", "x", "--max-tokens", "0"])
    assert r.exit_code == 2 and "max_tokens must be at least 1" in " ".join(r.output.split())


def test_plan_and_bench_commands(tiny_llama, tmp_path):
    r = runner.invoke(app, ["plan", str(tiny_llama), "--gpu", "l4", "--scheme", "bf16", "--scheme", "w4a16"])
    assert r.exit_code == 0, r.output
    assert "w4a16" in r.stdout and "bf16" in r.stdout
    r = runner.invoke(app, ["plan", str(tiny_llama), "--gpu", "tpu9"])
    assert r.exit_code == 2 and "tpu9" in r.output
    argv = ["plan", str(tiny_llama), "--calibrate", "gptq", "--samples", "16", "--seq-len", "64"]
    r = runner.invoke(app, [*argv, "--gflops", "50", "--json", str(tmp_path / "p.json")])
    assert r.exit_code == 0, r.output
    assert "peak host memory" in r.stdout and "wall time" in r.stdout and "at 50 fp32 GFLOP/s" in r.stdout
    assert json.loads((tmp_path / "p.json").read_text())["samples"] == 16
    assert "resume state written" in r.stdout and "with --guided 4" in r.stdout and "with --target-bits" in r.stdout
    r = runner.invoke(app, [*argv, "--device", "cuda", "--gpu", "h200"])
    assert r.exit_code == 0 and "peak device memory" in r.stdout, r.output
    r = runner.invoke(
        app,
        [
            "bench",
            str(tiny_llama),
            "--num-requests",
            "3",
            "--input-len",
            "4:8",
            "--output-len",
            "2:4",
            "--kv-cache-memory",
            "1000000",
            "--json",
            str(tmp_path / "b.json"),
        ],
    )
    assert r.exit_code == 0, r.output
    report = json.loads((tmp_path / "b.json").read_text())
    assert report["num_requests"] == 3 and report["output_tokens"] >= 6 and report["output_tokens_per_s"] > 0
    r = runner.invoke(app, ["bench", str(tiny_llama), "--compare", "vllm"])
    assert r.exit_code == 2 and "--compare 'vllm' is unknown" in " ".join(r.output.split())


@dataclass(frozen=True)
class HalfOptions:
    strength: int = option(3, "How hard to round (a dummy).", min=1)
    gentle: bool = option(False, "Round gently (a dummy).")


def params(app, name: str) -> dict:
    return {p.name: p for p in typer.main.get_command(app).commands[name].params}


def test_a_registered_method_gets_its_command_flags_help_and_recipe_step(monkeypatch, tiny_llama, tmp_path):
    """A weight method registered with its options: `quantkit half` without touching the CLI."""
    entry = Method(
        "half",
        "Half: a dummy method that rounds to nearest.",
        HalfOptions,
        "weights",
        "quantkit.calibration.rtn:rtn_step",
        "pack-quantized",
        needs_data=lambda scheme, o: False,
        default_scheme="w4a16",
    )
    monkeypatch.setitem(METHODS, "half", entry)
    app = build_app()
    command = typer.main.get_command(app).commands["half"]
    assert command.help == entry.summary
    flags = params(app, "half")
    assert flags["strength"].default == 3 and flags["strength"].help == "How hard to round (a dummy)."
    assert flags["gentle"].opts == ["--gentle"] and flags["gentle"].secondary_opts == ["--no-gentle"]
    assert {"scheme", "group_size", "target_bits", "max_shard_size", "resume", "kv_cache"} <= set(flags)
    assert "act_order" not in flags and "smooth" not in flags  # act-order schemes; smooth.before names the methods

    r = runner.invoke(app, ["half", "--strength", "5", "--gentle", "--print-recipe", "-o", "out"])
    assert r.exit_code == 0, r.output
    assert yaml.safe_load(r.stdout)["steps"] == [{"half": {"strength": 5, "gentle": True}}]
    r = runner.invoke(app, ["half", "--strength", "0", "-o", str(tmp_path / "x")])
    assert r.exit_code == 2 and "steps[0].half.strength: 0 is not allowed; use a positive integer." in r.output

    argv = ["half", "--model", str(tiny_llama), "--group-size", "32", "-o", str(tmp_path / "q")]
    r = runner.invoke(app, [*argv, "--json", str(tmp_path / "p.json")])
    assert r.exit_code == 0, r.output
    prov = json.loads((tmp_path / "p.json").read_text())
    assert prov["algorithm"] == "half" and prov["options"] == {"strength": 3, "gentle": False}
    assert "half" not in params(build_app(), "rtn") and not (tmp_path / "x").exists()


def test_a_run_option_reaches_every_quantizing_command_and_the_recipe(monkeypatch, tiny_llama, tmp_path):
    """A field added to RunOptions: a flag of each quantizing command, a recipe key, a keyword of quantize."""
    label = option(None, "A label for the run (a dummy).", kind="text")
    extended = dataclasses.make_dataclass(
        "RunOptions", [("label", Optional[str], label)], bases=(options.RunOptions,), frozen=True
    )
    monkeypatch.setattr(options, "RunOptions", extended)
    app = build_app()
    for name in weight_methods():
        assert params(app, name)["label"].help == "A label for the run (a dummy).", name
    r = runner.invoke(app, ["gptq", "--label", "first try", "--print-recipe", "-o", "out"])
    assert r.exit_code == 0, r.output
    d = yaml.safe_load(r.stdout)
    assert d["label"] == "first try" and from_dict(d).label == "first try" and from_dict(d).to_dict() == d
    r = runner.invoke(app, ["gptq", "--print-recipe", "-o", "out"])
    assert "label" not in yaml.safe_load(r.stdout)  # None is left out, as target_bits is
    prov = quantize(tiny_llama, tmp_path / "q", "rtn", group_size=32, label="api")
    assert prov["recipe"]["label"] == "api"


def test_python_m_quantkit_cli_runs_the_app():
    """benchmarks/ab_quantize.sh and ab_bench.sh call `python -m quantkit.cli`."""
    from quantkit.version import __version__

    r = subprocess.run([sys.executable, "-m", "quantkit.cli", "--version"], capture_output=True, text=True, check=True)
    assert r.stdout.strip() == f"quantkit {__version__}"


SLOW_COMMAND = """
import sys, tempfile, time
from quantkit.cli.common import command

@command
def slow():
    with tempfile.TemporaryDirectory(prefix="quantkit-kld-") as folder:
        print(folder, flush=True)
        time.sleep(60)

slow()
"""


def test_sigterm_unwinds_a_command_and_removes_its_temporary_files(tmp_path):
    # `quantkit eval --baseline` keeps gigabytes of logits in a temporary folder: a SIGTERM
    # must unwind the command as Ctrl-C does, not leave them behind.
    import os
    import signal
    from pathlib import Path

    env = {**os.environ, "TMPDIR": str(tmp_path)}  # nothing left in /tmp should the test fail
    proc = subprocess.Popen([sys.executable, "-c", SLOW_COMMAND], stdout=subprocess.PIPE, text=True, env=env)
    folder = Path(proc.stdout.readline().strip())
    assert folder.is_dir() and folder.parent == tmp_path
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    assert not folder.exists()
