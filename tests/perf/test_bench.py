"""Benchmarks on the tiny model: reports complete and token counts exact (no timing assertions)."""

import json
import math
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from quantkit.errors import QuantkitError
from quantkit.models.loading import load_tokenizer
from quantkit.perf import bench
from quantkit.perf.bench import Request
from quantkit.runtime.engine import LLM

torch.set_num_threads(1)
KEYS = {
    "num_requests",
    "duration_s",
    "input_tokens",
    "output_tokens",
    "requests_per_s",
    "output_tokens_per_s",
    "total_tokens_per_s",
    "ttft_ms",
    "tpot_ms",
    "e2e_ms",
    "slo_ttft_ms",
    "slo_tpot_ms",
    "goodput_requests_per_s",
    "cost_per_hour",
    "cost_per_1m_output_tokens",
    "interrupted",
    "failed",
    "kv_usage_peak",
    "preemptions",
    "mode",
    "rate",
    "concurrency",
}
SLO = {"slo_ttft_ms": 1e9, "slo_tpot_ms": 1e9, "cost_per_hour": 2.0}


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama), block_size=16, num_blocks=64)


@pytest.fixture(scope="module")
def workload(tiny_llama):
    return bench.synthetic_workload(load_tokenizer(tiny_llama), 4, "8:16", "4:8", seed=0, vocab_size=320)


def check_report(report, workload, llm):
    assert KEYS <= set(report) and not report["interrupted"] and report["failed"] == 0
    assert report["num_requests"] == len(workload)
    assert report["output_tokens"] == sum(r.max_tokens for r in workload)
    assert report["input_tokens"] == sum(len(r.prompt) for r in workload)
    for key in ("ttft_ms", "tpot_ms", "e2e_ms"):
        p = report[key]
        assert 0 <= p["p50"] <= p["p90"] <= p["p95"] <= p["p99"]
    assert report["ttft_ms"]["p50"] <= report["e2e_ms"]["p99"]
    assert 0 <= report["goodput_requests_per_s"] <= report["requests_per_s"] + 1e-9
    assert report["cost_per_1m_output_tokens"] > 0
    assert 0 < report["kv_usage_peak"] <= 1 and report["preemptions"] >= 0
    assert not llm.has_unfinished() and not llm.outputs and llm.block_manager.num_free_blocks == 64


def test_workload_is_seeded_and_in_range(tiny_llama, workload):
    tokenizer = load_tokenizer(tiny_llama)
    again = bench.synthetic_workload(tokenizer, 4, "8:16", "4:8", seed=0, vocab_size=320)
    other = bench.synthetic_workload(tokenizer, 4, "8:16", "4:8", seed=1, vocab_size=320)
    assert again == workload and other != workload
    special = set(tokenizer.all_special_ids)
    for r in workload:
        assert 8 <= len(r.prompt) <= 16 and 4 <= r.max_tokens <= 8
        assert all(0 <= t < 320 and t not in special for t in r.prompt)
    assert bench.parse_range("5") == (5, 5) and bench.parse_range((2, 3)) == (2, 3)


def test_workload_file(tmp_path):
    path = tmp_path / "w.jsonl"
    path.write_text('{"prompt": "The quick fox", "max_tokens": 3}\n\n{"prompt_token_ids": [5, 6], "max_tokens": 2}\n')
    assert bench.load_workload(path) == [Request("The quick fox", 3), Request([5, 6], 2)]
    path.write_text('{"prompt": "no max tokens"}\n')
    with pytest.raises(QuantkitError, match="line 1"):
        bench.load_workload(path)
    with pytest.raises(QuantkitError, match="cannot read"):
        bench.load_workload(tmp_path / "missing.jsonl")


def test_offline(llm, workload):
    report = bench.run_offline(llm, workload, **SLO)
    check_report(report, workload, llm)
    assert report["mode"] == "offline"
    plain = bench.run(llm, workload, "offline", warmup=False)
    assert plain["goodput_requests_per_s"] is None and plain["cost_per_1m_output_tokens"] is None


def test_online_poisson_and_closed_loop(llm, workload):
    poisson = bench.run_online(llm, workload, rate=1000.0, seed=3, **SLO)
    check_report(poisson, workload, llm)
    assert poisson["mode"] == "online" and poisson["rate"] == 1000.0
    closed = bench.run(llm, workload, "online", rate=math.inf, concurrency=2, **SLO)
    check_report(closed, workload, llm)
    assert closed["concurrency"] == 2


def test_ctrl_c_reports_what_finished(llm, workload):
    def track(iterable, description="", total=None):
        for i, item in enumerate(iterable):
            if i == 1:
                raise KeyboardInterrupt
            yield item

    report = bench.run_offline(llm, workload, track)
    assert report["interrupted"] and 1 <= report["num_requests"] < len(workload)  # a step can finish several
    assert not llm.has_unfinished() and not llm.outputs and llm.block_manager.num_free_blocks == 64


def test_hf_baseline_counts_own_tokens(tiny_llama, workload, llm):
    two = [Request(workload[0].prompt, 3), Request(workload[1].prompt, 5)]
    seq = bench.run_hf_baseline(str(tiny_llama), two, batch_size=1)
    assert seq["num_requests"] == 2 and seq["output_tokens"] == 8 == seq["generated_tokens"]
    static = bench.run_hf_baseline(str(tiny_llama), two, batch_size=2, dtype=torch.float32)
    assert static["output_tokens"] == 8 and static["generated_tokens"] == 2 * 5
    ours = bench.run_offline(llm, two)
    result = bench.compare(ours, hf_sequential=seq, hf_static=static)
    assert result["ratio_vs_hf_sequential"] == pytest.approx(ours["output_tokens_per_s"] / seq["output_tokens_per_s"])
    assert result["ratio_vs_hf_static"] > 0 and result["hf_static"] is static
    both = bench.compare_hf(str(tiny_llama), two, ours, static_batch_size=2)
    assert {"ratio_vs_hf_sequential", "ratio_vs_hf_static"} <= set(both)


class FakeServer(BaseHTTPRequestHandler):
    """Streams one text chunk per token, then usage, like vLLM's /v1/completions."""

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert body["stream"] and body["ignore_eos"] and self.path == "/v1/completions"
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        n = body["max_tokens"]
        for i in range(n):
            self.wfile.write(f"data: {json.dumps({'choices': [{'text': f't{i}'}]})}\n\n".encode())
            self.wfile.flush()
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": n}
        self.wfile.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n".encode())

    def log_message(self, *args):
        pass


def test_http_against_a_fake_server(workload):
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_port}"
        for kwargs in ({"rate": 1000.0}, {"concurrency": 2}):
            report = bench.run_http(url, workload, model_name="tiny", **kwargs, **SLO)
            assert report["output_tokens"] == sum(r.max_tokens for r in workload)
            assert report["input_tokens"] == sum(len(r.prompt) for r in workload)
            assert report["failed"] == 0 and report["tpot_ms"]["p50"] <= report["tpot_ms"]["p99"]
    finally:
        server.shutdown()
        server.server_close()
    with pytest.raises(QuantkitError, match="no request"):
        bench.run_http(url, workload[:1])


def test_errors_are_quantkit_errors(llm, workload, tiny_llama):
    for bad in ("0:4", "9:3", "x", "1:2:3"):
        with pytest.raises(QuantkitError):
            bench.parse_range(bad)
    with pytest.raises(QuantkitError, match="offline or online"):
        bench.run(llm, workload, "sideways")
    with pytest.raises(QuantkitError, match="rate"):
        bench.run_online(llm, workload, rate=0)
    with pytest.raises(QuantkitError, match="concurrency"):
        bench.run_online(llm, workload, concurrency=0)
    with pytest.raises(QuantkitError, match="num-requests"):
        bench.synthetic_workload(None, 0, "1:2", "1:2")
    with pytest.raises(QuantkitError, match="batch size"):
        bench.run_hf_baseline(str(tiny_llama), workload, batch_size=0)


def test_sweep_plot(llm, workload, tmp_path):
    reports = bench.sweep(llm, workload[:2], [500.0, math.inf], warmup=False)
    assert [r["rate"] for r in reports] == [500.0, math.inf]
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        with pytest.raises(QuantkitError, match="matplotlib"):
            bench.plot_sweep(reports, tmp_path / "sweep.png")
        return
    assert bench.plot_sweep(reports, tmp_path / "sweep.png").stat().st_size > 0


def test_workload_must_fit_the_context(llm):
    with pytest.raises(QuantkitError, match="context"):
        bench.run_offline(llm, [Request([5] * 200, 100)])
    with pytest.raises(QuantkitError, match="empty"):
        bench.run_online(llm, [])
    assert not llm.has_unfinished()


def test_summarize_by_hand():
    records = [
        {"prompt_tokens": 10, "output_tokens": 5, "ttft": t / 1e3, "tpot": 0.02, "e2e": 0.1 + t / 1e3}
        for t in (10, 20, 30, 40, 50)
    ] + [{"prompt_tokens": 4, "output_tokens": 1, "ttft": 0.5, "tpot": None, "e2e": 0.5}]
    r = bench.summarize(records, 2.0, slo_ttft_ms=35, slo_tpot_ms=30, cost_per_hour=3.6)
    assert r["output_tokens"] == 26 and r["input_tokens"] == 54 and r["requests_per_s"] == 3.0
    assert r["output_tokens_per_s"] == 13.0 and r["total_tokens_per_s"] == 40.0
    assert r["ttft_ms"]["p50"] == pytest.approx(35) and r["ttft_ms"]["p90"] == pytest.approx(275)
    assert r["tpot_ms"]["p99"] == pytest.approx(20)  # the one-token request has no TPOT
    assert r["goodput_requests_per_s"] == 1.5  # ttft 10, 20, 30 ms meet the 35 ms SLO
    assert r["cost_per_1m_output_tokens"] == pytest.approx(1e-3 / 13 * 1e6)
