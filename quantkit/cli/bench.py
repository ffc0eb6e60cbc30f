"""`quantkit bench` (serving and kernels) and `quantkit plan`: measure and plan."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from quantkit.calibration.registry import METHODS
from quantkit.cli.common import DTYPE, JSON, command, mib, new_table, out, progress, rows_table, size, write_json
from quantkit.cli.serve import SPECULATIVE, engine
from quantkit.errors import QuantkitError


def _report_rows(r: dict) -> list[tuple[str, object]]:
    def pct(d):
        return (
            " / ".join(f"{d[k]:.1f}" for k in ("p50", "p90", "p95", "p99")) if d and d.get("p50") is not None else "–"
        )

    rows = [
        ("requests", f"{r['num_requests']} ({r['input_tokens']} prompt + {r['output_tokens']} output tokens)"),
        ("duration", f"{r['duration_s']:.1f} s"),
        ("requests/s", f"{r['requests_per_s']:.3f}"),
        ("output tokens/s", f"{r['output_tokens_per_s']:.1f}"),
        ("total tokens/s", f"{r['total_tokens_per_s']:.1f}"),
        ("TTFT p50/p90/p95/p99 (ms)", pct(r["ttft_ms"])),
        ("TPOT p50/p90/p95/p99 (ms)", pct(r["tpot_ms"])),
        ("latency p50/p90/p95/p99 (ms)", pct(r["e2e_ms"])),
        ("KV usage peak / preemptions", f"{100 * (r.get('kv_usage_peak') or 0):.1f}% / {r.get('preemptions', 0)}"),
    ]
    s = r.get("speculative")
    if s and s["num_drafts"]:
        rows += [
            (
                "speculative: acceptance / mean accepted length",
                f"{s['acceptance_rate']:.1%} / {s['mean_accepted_length']:.2f}",
            ),
            (
                "speculative: draft / verify ms per step",
                f"{s['draft_ms_per_step']:.2f} / {s['verify_ms_per_step']:.2f}",
            ),
        ]
    elif s:
        rows.append(("speculative", "no drafts (the batch-size switch or no n-gram match)"))
    if r.get("goodput_requests_per_s") is not None:
        rows.append(("goodput (requests/s in SLO)", f"{r['goodput_requests_per_s']:.3f}"))
    if r.get("cost_per_1m_output_tokens") is not None:
        rows.append(("cost per 1M output tokens", f"${r['cost_per_1m_output_tokens']:.2f}"))
    return rows


def _compare_table(c: dict) -> Table:
    return rows_table(
        "against transformers (output tokens/s)",
        [
            (
                "hf, one request at a time",
                f"{c['hf_sequential']['output_tokens_per_s']:.1f} (ours ×{c['ratio_vs_hf_sequential']:.2f})",
            ),
            (
                "hf, static batches of 16",
                f"{c['hf_static']['output_tokens_per_s']:.1f} (ours ×{c['ratio_vs_hf_static']:.2f})",
            ),
        ],
    )


@command
def bench(
    model: str = typer.Argument(
        ...,
        help="Built-in name, local folder, hub id or quantkit checkpoint; or kernels, for the kernel micro-benchmark.",
    ),
    workload: Optional[Path] = typer.Option(None, help="jsonl of {prompt or prompt_token_ids, max_tokens}."),
    num_requests: int = typer.Option(64, help="Synthetic requests (without --workload)."),
    input_len: str = typer.Option("32:512", help="Prompt tokens, A:B uniform."),
    output_len: str = typer.Option("16:256", help="Output tokens, A:B uniform (EOS ignored)."),
    seed: int = typer.Option(0, help="Seed of the workload and the arrivals."),
    mode: str = typer.Option("offline", help="offline (all at once) or online (arrivals at --rate)."),
    rate: float = typer.Option(float("inf"), help="Online: Poisson arrival rate, requests/s (inf: all at once)."),
    concurrency: Optional[int] = typer.Option(None, help="Online: a closed loop of C clients instead."),
    url: Optional[str] = typer.Option(None, help="Benchmark a running OpenAI-compatible server instead."),
    slo_ttft: Optional[float] = typer.Option(None, "--slo-ttft", help="TTFT objective (ms) for goodput."),
    slo_tpot: Optional[float] = typer.Option(None, "--slo-tpot", help="TPOT objective (ms) for goodput."),
    gpu_cost_per_hour: Optional[float] = typer.Option(None, help="Machine price, for cost per 1M tokens."),
    compare: Optional[str] = typer.Option(
        None, help="hf: also run transformers (one at a time, static batches of 16)."
    ),
    dtype: str = DTYPE,
    max_num_seqs: int = typer.Option(64, help="Engine: sequences per step at most."),
    kv_cache_memory: float = typer.Option(1 << 30, help="Engine: KV-cache bytes (or a fraction of free memory)."),
    speculative_config: Optional[str] = SPECULATIVE,
    json_path: Optional[Path] = typer.Option(None, "--json", help="Also write the report here."),
    plot: Optional[Path] = typer.Option(None, help="Online: sweep rates and plot latency against throughput (PNG)."),
    device: str = typer.Option(
        "cpu",
        help="Kernels: cpu (GEMM paths against the copy bandwidth) or cuda (each "
        "Triton kernel checked against its twin, then timed).",
    ),
    quick: bool = typer.Option(False, help="Kernels: fewer shapes and repetitions."),
    threads: Optional[int] = typer.Option(None, help="Kernels: torch CPU threads (1 gives steadier numbers)."),
):
    """Throughput, TTFT, TPOT, latency percentiles, goodput and cost of serving a model;
    `quantkit bench kernels` times the kernels instead."""

    if model == "kernels":
        return _bench_kernels(device, quick, threads, json_path)

    from quantkit.models.loading import load_tokenizer, resolve_model
    from quantkit.perf import bench as b

    if compare not in (None, "hf"):
        raise QuantkitError(f"--compare {compare!r} is unknown; use hf.")
    slo = {"slo_ttft_ms": slo_ttft, "slo_tpot_ms": slo_tpot, "cost_per_hour": gpu_cost_per_hour}
    tokenizer = load_tokenizer(resolve_model(model))
    requests = (
        b.load_workload(workload)
        if workload
        else b.synthetic_workload(tokenizer, num_requests, input_len, output_len, seed)
    )
    with progress() as track:
        if url:
            report = b.run_http(url, requests, rate, concurrency, model, track, seed, **slo)
        else:
            llm = engine(
                model,
                dtype,
                kv_cache_memory=kv_cache_memory,
                max_num_seqs=max_num_seqs,
                speculative_config=speculative_config,
            )
            if plot:
                rates = [r for r in (0.5, 1, 2, 4, 8) if r < rate] + ([rate] if rate != float("inf") else [])
                reports = b.sweep(llm, requests, rates, track, seed, **slo)
                b.plot_sweep(reports, plot)
            report = b.run(llm, requests, mode, rate, concurrency, track, seed, **slo)
            if compare == "hf":
                report["compare"] = b.compare_hf(model, requests, report, llm.runner.dtype, track=track)
    if json_path:
        write_json(json_path, report)
    out.print(rows_table(f"bench {model} ({report['mode']})", _report_rows(report)))
    if report.get("compare"):
        out.print(_compare_table(report["compare"]))


def _bench_kernels(device: str, quick: bool, threads: int | None, json_path: Path | None) -> None:
    import torch

    from quantkit.perf import kernels

    if device not in ("cpu", "cuda"):
        raise QuantkitError(f"--device {device!r} is unknown; use cpu or cuda.")
    if device == "cuda" and not torch.cuda.is_available():
        raise QuantkitError("--device cuda needs a CUDA GPU and none is visible here; use --device cpu.")
    if threads:
        torch.set_num_threads(threads)
    rows = kernels.run_cpu(quick=quick) if device == "cpu" else kernels.run_gpu(quick=quick)
    write_json(json_path, {"header": kernels.header(device), "rows": rows})
    typer.echo(f"\n{kernels.header(device)}\n\n{kernels.to_markdown(rows)}")


def _plan_calibration(model, method, samples, seq_len, device, gpu, gflops, json_path) -> None:
    from quantkit.perf.plan import FP32_TFLOPS, calibration_plan, measure_gflops, model_config

    if gflops is None:
        if device == "cpu":
            gflops = measure_gflops("cpu")
        elif gpu in FP32_TFLOPS:
            gflops = FP32_TFLOPS[gpu] * 1000
        else:
            raise QuantkitError(f"no fp32 rate known for --gpu {gpu}; pass --gflops.")
    r = calibration_plan(model_config(model), method, samples, seq_len, device, gflops)
    write_json(json_path, r)
    b = r["breakdown"]
    rows = [
        ("float weights", size(r["float_weights_bytes"])),
        ("peak host memory", size(r["host_peak_bytes"])),
        ("  libraries", size(b["libraries"])),
        ("  one block in fp32", size(b["block_weights"])),
        ("  activations (block inputs, outputs)", size(b["activations"])),
        (f"  {method} working set", size(b["working_set"])),
        ("  one batch through the block", size(b["forward"])),
        ("  embeddings (while capturing)", size(b["embeddings"])),
    ]
    if device != "cpu":
        rows.append(("peak device memory", size(r["device_peak_bytes"])))
    rows += [
        ("checkpoint on disk (w4a16 g128)", size(r["output_bytes"])),
        ("wall time", f"{r['seconds'] / 60:.0f} min at {gflops:.0f} fp32 GFLOP/s"),
        (
            "resume state written",
            f"{size(r['resume']['bytes'])}: {r['resume']['commits']} commits of {size(r['resume']['commit_bytes'])} "
            f"(one a minute; after every block: {size(r['resume']['every_block'])})",
        ),
        (
            f"with --guided {r['gradient_pass']['groups']}",
            f"+{r['gradient_pass']['seconds'] / 60:.1f} min (gradient pass on {r['gradient_pass']['rows']} rows, "
            f"guided Hessians), {size(r['gradient_pass']['spill_bytes'])} spilled to disk",
        ),
        ("with --target-bits", f"+{r['sensitivity']['seconds'] / 60:.0f} min (sensitivity)"),
    ]
    if "float_targets" in r:
        ft = r["float_targets"]
        rows.append(
            (
                "with --float-targets",
                f"+{ft['seconds'] / 60:.0f} min (the float block's passes), +{size(ft['host_bytes'])} host memory, "
                f"+{size(ft['commit_bytes'])} per resume commit",
            )
        )
    out.print(rows_table(f"plan: {method} on {model}, {samples} × {seq_len} tokens, {device}", rows))


def _plan_draft(model, draft, draft_scheme, kv_cache, json_path, rows) -> None:
    from quantkit.perf.plan import draft_plan, model_config

    d = draft_plan(model_config(model), model_config(draft), draft_scheme, kv_cache)
    write_json(json_path, {"plan": rows, "draft": d})
    out.print(
        rows_table(
            f"draft {draft} ({draft_scheme}) for {model}",
            [
                ("draft weights", mib(d["draft_weight_bytes"])),
                ("draft KV per token", f"{d['draft_kv_bytes_per_token'] / 1024:.1f} KiB"),
                ("KV per token, target + draft", f"{1 + d['kv_ratio']:.2f}× the target's alone"),
            ],
        )
    )


@command
def plan(
    model: str = typer.Argument(..., help="Built-in name, local folder or hub id (only config.json is read)."),
    scheme: list[str] = typer.Option(["bf16", "w4a16", "fp8-dynamic"], help="Schemes to compare (repeatable)."),
    kv_cache: Optional[str] = typer.Option(None, help="KV-cache type: bf16, fp8 or int8."),
    gpu: str = typer.Option("h100-80gb", help="h100-80gb, a100-80gb, h200, l40s, l4, rtx4090 or cpu."),
    context: int = typer.Option(4096, help="Tokens per sequence."),
    gpu_cost_per_hour: Optional[float] = typer.Option(None, help="Overrides the table's illustrative price."),
    calibrate: Optional[str] = typer.Option(
        None,
        help="Instead: peak memory and wall time of calibrating the model with "
        + " or ".join(m.name for m in METHODS.values() if m.plan)
        + ".",
    ),
    samples: int = typer.Option(128, help="With --calibrate: calibration rows."),
    seq_len: int = typer.Option(512, help="With --calibrate: tokens per row."),
    device: str = typer.Option("cpu", help="With --calibrate: where blocks are calibrated (cpu, or cuda on --gpu)."),
    gflops: Optional[float] = typer.Option(
        None, help="With --calibrate: the device's fp32 matmul GFLOP/s (default: measured here, or --gpu's)."
    ),
    draft: Optional[str] = typer.Option(None, help="A speculative-decoding draft model: what it adds."),
    draft_scheme: str = typer.Option("bf16", help="With --draft: the draft's scheme (w4a16: an INT4 self-draft)."),
    json_path: Optional[Path] = JSON,
):
    """Memory, concurrent sequences, decode-time bounds and cost per scheme, from the config alone
    (with --calibrate: what calibrating it will take)."""
    from quantkit.perf.plan import model_config
    from quantkit.perf.plan import plan as make_plan

    if calibrate is not None:
        _plan_calibration(model, calibrate, samples, seq_len, device, gpu, gflops, json_path)
        return
    rows = make_plan(model_config(model), list(scheme), kv_cache, gpu, context, gpu_cost_per_hour)
    if draft is not None:
        _plan_draft(model, draft, draft_scheme, kv_cache, json_path, rows)
        return
    write_json(json_path, rows)
    table = new_table(
        f"plan {model} on {gpu}, {context}-token sequences, KV {kv_cache or 'bf16'}",
        (
            "scheme",
            "weights",
            "KV/token",
            "seqs that fit",
            "TPOT bound b=1",
            "TPOT bound full",
            "tokens/s full",
            "$ / 1K tokens",
        ),
    )
    for r in rows:
        table.add_row(
            r["scheme"],
            mib(r["weight_bytes"]),
            f"{r['kv_bytes_per_token'] / 1024:.1f} KiB",
            str(r["max_seqs"]),
            f"{r['tpot_ms_batch1']:.2f} ms",
            f"{r['tpot_ms_full']:.2f} ms" if r["tpot_ms_full"] is not None else "–",
            f"{r['tokens_per_s_full']:.0f}" if r["tokens_per_s_full"] is not None else "–",
            f"{r['usd_per_1k_output_tokens']:.5f}" if r["usd_per_1k_output_tokens"] is not None else "–",
        )
    out.print(table)
