"""Regression gates: the comparison rules, and `quantkit eval --baseline` end to end on tiny models."""

import json
import shutil

import pytest
import torch
from typer.testing import CliRunner

from quantkit.cli import app
from quantkit.errors import QuantkitError
from quantkit.eval.gates import compare_metric, evaluate_gates
from quantkit.eval.run import evaluate

torch.set_num_threads(1)
runner = CliRunner()


def flat(output: str) -> str:
    return " ".join(output.split())


def test_recovery_and_thresholds():
    row, failure = compare_metric("wiki_cloze/acc", 0.45, 0.5, True, min_recovery=0.95)
    assert row["recovery"] == pytest.approx(0.9) and row["delta"] == pytest.approx(-0.05)
    assert row["passed"] is False and failure.startswith("wiki_cloze/acc recovered 0.9000")
    # with a perplexity bound, min_recovery leaves perplexities alone
    row, failure = compare_metric("ppl", 19.9, 19.0, False, max_ppl_increase=0.05, min_recovery=0.99)
    assert row["recovery"] == pytest.approx(19 / 19.9) and row["passed"] is True and failure is None
    row, failure = compare_metric("ppl", 20.0, 19.0, False, max_ppl_increase=0.02)
    assert row["passed"] is False and "ppl rose 5.26%" in failure and "allowed 2.00%" in failure
    row, failure = compare_metric("ppl", 20.0, 19.0, False, min_recovery=0.96)  # no ppl bound: recovery applies
    assert row["passed"] is False and failure.startswith("ppl recovered 0.9500")
    row, _ = compare_metric("wiki_wordppl/bits_per_byte", 1.1, 1.0, False, max_ppl_increase=0.5)
    assert row["passed"] is None and row["recovery"] == pytest.approx(1 / 1.1)  # not a perplexity, no bound
    assert compare_metric("x/acc", 0.2, 0.0, True, min_recovery=0.9)[0]["passed"] is True  # baseline 0
    assert compare_metric("x/acc", 0.2, None, True)[0] == {
        "metric": "x/acc",
        "baseline": None,
        "candidate": 0.2,
        "delta": None,
        "recovery": None,
        "passed": None,
    }


def test_argument_errors(tiny_llama):
    with pytest.raises(QuantkitError, match="add --baseline"):
        evaluate_gates(str(tiny_llama), min_recovery=0.9)
    with pytest.raises(QuantkitError, match="nothing to evaluate"):
        evaluate_gates(str(tiny_llama), str(tiny_llama), ppl=None)


@pytest.fixture(scope="module")
def quantized(tiny_llama, tmp_path_factory):
    from quantkit.pipeline.quantize import quantize
    from quantkit.scheme import preset

    out = tmp_path_factory.mktemp("gates") / "rtn"
    quantize(str(tiny_llama), preset("w4a16").with_group_size(32), out)
    return out


def test_gate_passes_against_itself_with_tasks(tiny_llama, tiny_corpus, tmp_path):
    report_path = tmp_path / "gate.json"
    r = runner.invoke(
        app,
        [
            "eval",
            str(tiny_llama),
            "--baseline",
            str(tiny_llama),
            "--ppl",
            str(tiny_corpus),
            "--seq-len",
            "64",
            "--limit",
            "4",
            "--tasks",
            "wiki_cloze",
            "--max-ppl-increase",
            "0%",
            "--min-recovery",
            "1",
            "--batch-size",
            "4",
            "--json",
            str(report_path),
        ],
    )
    assert r.exit_code == 0, r.output
    assert "wiki_cloze/acc_norm" in r.stdout and "recovery" in r.stdout and "FAIL" not in r.stdout
    report = json.loads(report_path.read_text())
    metrics = ["ppl", "kld", "kld_p99", "top1_agreement", "wiki_cloze/acc", "wiki_cloze/acc_norm"]
    assert [row["metric"] for row in report["rows"]] == metrics
    shared = [row for row in report["rows"] if row["metric"] not in ("kld", "kld_p99", "top1_agreement")]
    assert all(row["passed"] and row["recovery"] == 1.0 and row["delta"] == 0 for row in shared)
    assert report["failures"] == [] and report["passed"] is True
    assert report["thresholds"] == {"max_ppl_increase": 0.0, "min_recovery": 1.0, "max_kld": None, "min_top1": None}
    assert set(report["versions"]) >= {"quantkit", "torch", "transformers", "lm_eval"}
    assert report["versions"]["lm_eval"] == "0.4.13"
    assert report["seeds"]["lm_eval"]["fewshot"] == 1234 and report["seeds"]["wiki_cloze"] == 1234
    assert set(report["data_sha256"]) == {"ppl", "wiki_cloze"} and len(report["data_sha256"]["ppl"]) == 64
    for side in ("candidate", "baseline"):
        result = report["results"][side]
        assert result["docs"] == {"wiki_cloze": 4} and result["ppl"]["windows"] == 4
        assert result["data_sha256"] == report["data_sha256"]


def test_gate_fails_on_a_worse_model_and_names_the_metric(tiny_llama, quantized, tiny_corpus, tmp_path):
    ppl = {m: evaluate(str(m), str(tiny_corpus), 64, 3)["ppl"] for m in (tiny_llama, quantized)}
    worse, better = sorted(ppl, key=ppl.get, reverse=True)
    assert ppl[worse] > ppl[better] * 1.0001  # int4 rounding moves a random model's perplexity
    common = ["--ppl", str(tiny_corpus), "--seq-len", "64", "--limit", "3", "--json", str(tmp_path / "r.json")]
    r = runner.invoke(app, ["eval", str(worse), "--baseline", str(better), "--max-ppl-increase", "0.0001", *common])
    assert r.exit_code == 1, r.output
    assert "gate failed: ppl rose" in flat(r.output) and "FAIL" in r.stdout
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["passed"] is False and len(report["failures"]) == 1 and report["failures"][0].startswith("ppl rose")
    assert report["rows"][0]["candidate"] == pytest.approx(ppl[worse])
    r = runner.invoke(app, ["eval", str(better), "--baseline", str(worse), "--max-ppl-increase", "0.01%", *common])
    assert r.exit_code == 0, r.output


def test_cli_refusals(tiny_llama, tmp_path, monkeypatch):
    other = tmp_path / "other-tokenizer"
    shutil.copytree(tiny_llama, other)
    from quantkit.models.loading import load_tokenizer

    tokenizer = load_tokenizer(other)
    tokenizer.add_tokens(["<extra_token>"])
    tokenizer.save_pretrained(other)
    monkeypatch.setattr("quantkit.hub.hub_reachable", lambda: False)
    cases = [
        (["eval", str(other), "--baseline", str(tiny_llama)], "tokenizer of"),
        (["eval", str(tiny_llama), "--baseline", str(tiny_llama), "--max-ppl-increase", "two"], "write 2% or 0.02"),
        (["eval", str(tiny_llama), "--min-recovery", "0.9"], "add --baseline MODEL"),
        (["eval", str(tiny_llama), "--ppl", "none", "--tasks", "hellaswag"], "task 'hellaswag' is not built in"),
        (["eval", str(tiny_llama), "--tasks", "wiki_cloze", "--include-path", str(tmp_path / "no")], "is not a folder"),
    ]
    for argv, message in cases:
        r = runner.invoke(app, argv)
        assert r.exit_code == 2, (argv, r.output)
        assert message in flat(r.output) and "Traceback" not in r.output, (argv, r.output)
