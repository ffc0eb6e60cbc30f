"""KL divergence and top-1 agreement against the baseline: the stored top-K against full
fp32 distributions, and `quantkit eval --baseline` against transformers on the same windows."""

import json
import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from quantkit.calibration.datasets import eval_tokens, load_documents
from quantkit.cli import app
from quantkit.eval import kld
from quantkit.eval.gates import evaluate_gates
from quantkit.models.loading import load_tokenizer

torch.set_num_threads(1)
runner = CliRunner()
SEQ_LEN, LIMIT = 64, 3


def flat(output: str) -> str:
    return " ".join(output.split())


def exact(baseline: torch.Tensor, candidate: torch.Tensor) -> torch.Tensor:
    """KL(baseline ‖ candidate) per position from full logits [..., V], by torch's kl_div."""
    lb, lc = baseline.double().log_softmax(-1), candidate.double().log_softmax(-1)
    return F.kl_div(lc, lb, log_target=True, reduction="none").sum(-1)


def test_divergence_against_kl_div_and_what_fp16_storage_costs():
    g = torch.Generator().manual_seed(0)
    base = torch.randn(4, 50, 300, generator=g) * 3
    cand = base + 0.3 * torch.randn(4, 50, 300, generator=g)
    reference = exact(base, cand)
    torch.testing.assert_close(kld.divergence(base.log_softmax(-1), cand).double(), reference, rtol=1e-4, atol=1e-6)
    stored = kld.divergence(base.log_softmax(-1).half(), cand).double()  # what the Comparer reads
    assert stored.mean().item() == pytest.approx(reference.mean().item(), rel=1e-3)
    assert (stored - reference).abs().max() < 0.01
    assert kld.divergence(base.log_softmax(-1), base).abs().max() < 1e-5  # itself
    masked = base.log_softmax(-1).index_fill(-1, torch.tensor([0, 1]), float("-inf"))  # p = 0 for two tokens
    assert kld.divergence(masked, cand).isfinite().all()


def test_percentile_matches_numpy():
    values = torch.rand(1001, generator=torch.Generator().manual_seed(1)) ** 3
    for q in (0, 50, 99, 99.9, 100):
        assert kld.percentile(values, q) == pytest.approx(np.percentile(values.double().numpy(), q), rel=1e-12)


@pytest.fixture(scope="module")
def quantized(tiny_llama, tmp_path_factory):
    from quantkit.pipeline.quantize import quantize
    from quantkit.scheme import preset

    out = tmp_path_factory.mktemp("kld") / "rtn"
    quantize(str(tiny_llama), preset("w4a16").with_group_size(32), out)
    return out


def reference(candidate, baseline, corpus) -> dict:
    """kld, kld_p99 and top1_agreement of the candidate on the first LIMIT windows, from both
    models' full logits in memory (transformers loads the checkpoint through compressed-tensors)."""
    from transformers import AutoModelForCausalLM

    tokens = eval_tokens(load_tokenizer(baseline), ["\n\n".join(load_documents(str(corpus), "eval"))])
    windows = tokens[: LIMIT * SEQ_LEN].view(LIMIT, SEQ_LEN)
    with torch.no_grad():
        logits = [AutoModelForCausalLM.from_pretrained(m).eval()(windows).logits[:, :-1] for m in (baseline, candidate)]
    kl = exact(*logits).flatten()
    return {
        "kld": kl.mean().item(),
        "kld_p99": np.percentile(kl.numpy(), 99),
        "top1_agreement": (logits[0].argmax(-1) == logits[1].argmax(-1)).double().mean().item(),
    }


def test_kld_and_top1_match_transformers_on_the_same_windows(tiny_llama, quantized, tiny_corpus, monkeypatch):
    expected = reference(quantized, tiny_llama, tiny_corpus)
    assert 1e-3 < expected["kld"] and expected["top1_agreement"] < 1  # int4 moves a random model
    monkeypatch.setattr("quantkit.eval.perplexity.CHUNK", 24)  # several chunks per window
    for batch_size in (1, 2):
        report = evaluate_gates(
            str(quantized), str(tiny_llama), ppl=str(tiny_corpus), seq_len=SEQ_LEN, limit=LIMIT, batch_size=batch_size
        )
        rows = {row["metric"]: row for row in report["rows"]}
        assert [row["metric"] for row in report["rows"]] == ["ppl", "kld", "kld_p99", "top1_agreement"]
        assert rows["kld"]["candidate"] == pytest.approx(expected["kld"], rel=0.01)
        assert rows["kld_p99"]["candidate"] == pytest.approx(expected["kld_p99"], rel=0.01)
        assert abs(rows["top1_agreement"]["candidate"] - expected["top1_agreement"]) <= 0.005
        assert all(row["passed"] is None and row["baseline"] is None for row in rows.values() if row["metric"] != "ppl")
        details = report["results"]["candidate"]["kld"]
        assert details["positions"] == LIMIT * (SEQ_LEN - 1)


def test_gates_through_the_cli(tiny_llama, quantized, tiny_corpus, tmp_path):
    common = ["--ppl", str(tiny_corpus), "--seq-len", str(SEQ_LEN), "--limit", "2", "--json", str(tmp_path / "r.json")]
    # a model against itself: only the baseline's fp16 rounding is left (6e-7 nats here)
    r = runner.invoke(app, ["eval", str(tiny_llama), "--baseline", str(tiny_llama), *common, "--max-kld", "1e-5"])
    assert r.exit_code == 0, r.output
    report = json.loads((tmp_path / "r.json").read_text())
    rows = {row["metric"]: row for row in report["rows"]}
    assert 0 <= rows["kld"]["candidate"] < 1e-5 and rows["kld_p99"]["candidate"] < 1e-4
    assert rows["top1_agreement"]["candidate"] == 1.0 and rows["kld"]["passed"] is True
    assert "kld" in r.stdout and "top1_agreement" in r.stdout and report["thresholds"]["max_kld"] == 1e-5

    r = runner.invoke(app, ["eval", str(quantized), "--baseline", str(tiny_llama), *common])
    assert r.exit_code == 0, r.output  # no gate: the rows are reported, nothing fails
    rows = {row["metric"]: row for row in json.loads((tmp_path / "r.json").read_text())["rows"]}
    kl, top1 = rows["kld"]["candidate"], rows["top1_agreement"]["candidate"]
    assert kl > 0 and top1 < 1

    gates = ["--max-kld", f"{kl * 0.99}", "--min-top1", f"{min(1.0, top1 + 0.01)}"]
    r = runner.invoke(app, ["eval", str(quantized), "--baseline", str(tiny_llama), *common, *gates])
    assert r.exit_code == 1, r.output
    report = json.loads((tmp_path / "r.json").read_text())
    assert [f.split(" is ")[0] for f in report["failures"]] == ["kld", "top1_agreement"]
    assert "gate failed: kld is" in flat(r.output) and "gate failed: top1_agreement is" in flat(r.output)
    assert "nats per token, more than the allowed" in flat(r.output) and "FAIL" in r.stdout

    gates = ["--max-kld", f"{kl * 1.01}", "--min-top1", f"{top1 - 0.01}"]
    r = runner.invoke(app, ["eval", str(quantized), "--baseline", str(tiny_llama), *common, *gates])
    assert r.exit_code == 0, r.output
    # every evaluation of the checkpoint went into its quantkit.json and model card
    last = json.loads((quantized / "quantkit.json").read_text())["evaluations"][-1]
    assert last["baseline"] == str(tiny_llama) and last["passed"] is True and last["limit"] == 2
    assert [row["metric"] for row in last["rows"]] == ["ppl", "kld", "kld_p99", "top1_agreement"]
    assert last["thresholds"]["max_kld"] == pytest.approx(kl * 1.01) and last["data_sha256"]["ppl"]
    card = (quantized / "README.md").read_text()
    assert f"| kld | {kl:.4f} |" in card and f"Baseline: `{tiny_llama}`." in card
    assert [row["passed"] for row in json.loads((tmp_path / "r.json").read_text())["rows"]][1:] == [True, None, True]


def test_several_candidates_against_one_baseline_scored_once(tiny_llama, quantized, tiny_corpus, tmp_path, monkeypatch):
    """`quantkit eval A B --baseline M`: M is scored once, and each candidate's report equals
    what a run of its own gives; a gate failing for one of them exits 1 and names it."""
    from quantkit.eval import gates

    scope = dict(ppl=str(tiny_corpus), seq_len=SEQ_LEN, limit=2)
    alone = [evaluate_gates(str(m), str(tiny_llama), **scope) for m in (quantized, tiny_llama)]
    measured = []
    measure = gates.measure
    monkeypatch.setattr(gates, "measure", lambda model, *a, **k: measured.append(model) or measure(model, *a, **k))
    reports = gates.evaluate_many([str(quantized), str(tiny_llama)], str(tiny_llama), **scope)
    assert measured == [str(tiny_llama), str(quantized), str(tiny_llama)]  # the baseline once, first
    for report, one in zip(reports, alone):
        assert report["candidate"] == one["candidate"] and report["rows"] == one["rows"]
    assert reports[0]["rows"][1]["candidate"] > 1e-3 and reports[1]["rows"][1]["candidate"] < 1e-5  # kld

    common = ["--ppl", str(tiny_corpus), "--seq-len", str(SEQ_LEN), "--limit", "2", "--json", str(tmp_path / "r.json")]
    kl = reports[0]["rows"][1]["candidate"]
    r = runner.invoke(app, ["eval", str(quantized), str(tiny_llama), "--baseline", str(tiny_llama), *common])
    assert r.exit_code == 0, r.output
    written = json.loads((tmp_path / "r.json").read_text())
    assert [w["candidate"] for w in written] == [str(quantized), str(tiny_llama)]
    assert [w["rows"] for w in written] == [one["rows"] for one in alone]
    gate = ["--max-kld", f"{kl / 2}"]
    r = runner.invoke(app, ["eval", str(quantized), str(tiny_llama), "--baseline", str(tiny_llama), *common, *gate])
    assert r.exit_code == 1, r.output
    assert f"gate failed: {quantized}: kld is" in flat(r.output) and flat(r.output).count("gate failed") == 1

    r = runner.invoke(app, ["eval", str(quantized), str(tiny_llama), *common])  # perplexity only: one table each
    assert r.exit_code == 0, r.output
    written = json.loads((tmp_path / "r.json").read_text())
    assert [w["ppl"] for w in written] == [one["results"]["candidate"]["metrics"]["ppl"] for one in alone]
    assert f"perplexity of {quantized}" in flat(r.output) and f"perplexity of {tiny_llama}" in flat(r.output)


def test_one_compute_dtype_for_every_model(tiny_llama, tiny_corpus, tmp_path):
    """`--dtype float32` computes an fp16 export in fp32: against the same weights stored in
    fp32 it is then exact (the same perplexity; KL within the fp16 storage of the baseline's
    log-probabilities), where in its own dtype it is not."""
    half, up = tmp_path / "half", tmp_path / "up"
    shutil.copytree(tiny_llama, half)
    AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float16).save_pretrained(half)
    shutil.copytree(half, up)
    AutoModelForCausalLM.from_pretrained(half, dtype=torch.float32).save_pretrained(up)
    scope = dict(ppl=str(tiny_corpus), seq_len=SEQ_LEN, limit=2)
    own = evaluate_gates(str(half), str(up), **scope)
    one = evaluate_gates(str(half), str(up), **scope, dtype=torch.float32)
    assert own["dtype"] is None and one["dtype"] == "float32"
    ppl, kld = one["rows"][0], one["rows"][1]
    assert ppl["candidate"] == ppl["baseline"] and kld["candidate"] < 1e-5  # the fp16-stored log-probs
    assert own["rows"][0]["candidate"] != own["rows"][0]["baseline"]
    r = runner.invoke(
        app,
        [
            "eval",
            str(half),
            "--ppl",
            str(tiny_corpus),
            "--seq-len",
            str(SEQ_LEN),
            "--limit",
            "2",
            "--dtype",
            "float32",
            "--json",
            str(tmp_path / "p.json"),
        ],
    )
    assert r.exit_code == 0, r.output
    written = json.loads((tmp_path / "p.json").read_text())
    assert written["ppl"] == ppl["baseline"] and written["dtype"] == "float32"


def test_refusals(tiny_llama, tiny_corpus):
    cases = [
        (
            ["eval", str(tiny_llama), "--dtype", "fp8"],
            "dtype 'fp8' is unknown; use one of auto, float32, bfloat16, float16.",
        ),
        (["eval", str(tiny_llama), "--max-kld", "0.1"], "add --baseline MODEL"),
        (["eval", str(tiny_llama), "--baseline", str(tiny_llama), "--min-top1", "90"], "at most 1 (e.g. 0.9), got 90"),
        (["eval", str(tiny_llama), "--baseline", str(tiny_llama), "--max-kld", "-1"], "--max-kld must be at least 0"),
        (
            [
                "eval",
                str(tiny_llama),
                "--baseline",
                str(tiny_llama),
                "--ppl",
                "none",
                "--tasks",
                "wiki_cloze",
                "--max-kld",
                "1",
            ],
            "give --ppl TEXT",
        ),
    ]
    for argv, message in cases:
        r = runner.invoke(app, argv)
        assert r.exit_code == 2, (argv, r.output)
        assert message in flat(r.output) and "Traceback" not in r.output, (argv, r.output)


def test_no_rows_without_a_baseline_or_a_perplexity_text(tiny_llama, tiny_corpus):
    report = evaluate_gates(str(tiny_llama), ppl=str(tiny_corpus), seq_len=SEQ_LEN, limit=1)
    assert [row["metric"] for row in report["rows"]] == ["ppl"] and "kld" not in report["results"]["candidate"]


def test_temporary_folder_is_removed(tiny_llama, tiny_corpus, tmp_path, monkeypatch):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    report = evaluate_gates(str(tiny_llama), str(tiny_llama), ppl=str(tiny_corpus), seq_len=SEQ_LEN, limit=1)
    assert report["results"]["candidate"]["kld"]["positions"] == SEQ_LEN - 1 and list(tmp_path.iterdir()) == []


def test_final_logit_soft_cap_is_applied_to_both_sides(tmp_path, tiny_corpus, monkeypatch):
    """Gemma 2's final soft-cap: the chunked head gives the KL of the model's own logits."""
    from conftest import make_family_model

    base, cand = (make_family_model(tmp_path / f"gemma2-{seed}", "gemma2", seed=seed) for seed in (0, 1))
    expected = reference(cand, base, tiny_corpus)
    monkeypatch.setattr("quantkit.eval.perplexity.CHUNK", 24)
    report = evaluate_gates(str(cand), str(base), ppl=str(tiny_corpus), seq_len=SEQ_LEN, limit=LIMIT)
    rows = {row["metric"]: row["candidate"] for row in report["rows"]}
    assert rows["kld"] == pytest.approx(expected["kld"], rel=0.01)
    assert abs(rows["top1_agreement"] - expected["top1_agreement"]) <= 0.005


def test_a_full_disk_limits_the_comparison_to_the_windows_stored(tiny_llama, quantized, tiny_corpus, monkeypatch):
    """The disk holds the baseline's first window only: KL covers that window, perplexity all."""
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    calls = []

    def disk_usage(path):
        calls.append(path)
        return usage(0, 0, 2**40 if len(calls) <= 1 else 0)  # room for the first chunk only

    monkeypatch.setattr(kld.shutil, "disk_usage", disk_usage)
    report = evaluate_gates(str(quantized), str(tiny_llama), ppl=str(tiny_corpus), seq_len=SEQ_LEN, limit=LIMIT)
    details = report["results"]["candidate"]["kld"]
    assert LIMIT > 1 and details["windows"] == 1 and details["positions"] == SEQ_LEN - 1
    assert report["results"]["candidate"]["ppl"]["windows"] == LIMIT
    expected = reference(quantized, tiny_llama, tiny_corpus)
    assert details["kld"] != pytest.approx(expected["kld"], rel=1e-6)  # not all windows: a different mean
