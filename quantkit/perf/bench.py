"""Throughput and latency benchmarks: the engine offline (everything queued at once) or
online (Poisson arrivals or a closed loop of clients, in process), any OpenAI-compatible
server over HTTP, and the transformers `generate` baseline on the same workload.

Every request ignores EOS and decodes greedily, so each produces exactly its
`max_tokens`. Latencies are measured from arrival: the scheduled Poisson time online,
the moment the request is sent in a closed loop, the start offline. Ctrl-C stops a run
and reports what finished (`interrupted: true`).
"""

from __future__ import annotations

import json
import math
import os
import random
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from quantkit.errors import QuantkitError
from quantkit.progress import Track, no_progress
from quantkit.runtime.sequence import SamplingParams

PERCENTILES = (50, 90, 95, 99)


@dataclass(frozen=True, slots=True)
class Request:
    prompt: str | list[int]  # text, or token ids
    max_tokens: int


def parse_range(value: str | int | tuple[int, int]) -> tuple[int, int]:
    """ "A:B" (or "N", N, (A, B)) -> (A, B) with 1 <= A <= B."""
    try:
        parts = value.split(":") if isinstance(value, str) and ":" in value else value
        lo, hi = (int(v) for v in ((parts, parts) if isinstance(parts, (str, int)) else parts))
    except (TypeError, ValueError):
        lo = hi = 0
    if not 1 <= lo <= hi:
        raise QuantkitError(f"length range {value!r} is not A:B with 1 <= A <= B (or one number).")
    return lo, hi


def synthetic_workload(
    tokenizer, num_requests: int, input_len, output_len, seed: int = 0, vocab_size: int | None = None
) -> list[Request]:
    """`num_requests` prompts of random token ids (no special tokens), lengths uniform in
    `input_len` and `output_len` ("A:B"); the same seed gives the same workload."""
    if num_requests < 1:
        raise QuantkitError(f"--num-requests must be at least 1, got {num_requests}.")
    (a, b), (c, d) = parse_range(input_len), parse_range(output_len)
    special = set(tokenizer.all_special_ids)
    ids = [i for i in range(min(vocab_size or len(tokenizer), len(tokenizer))) if i not in special]
    rng = random.Random(seed)
    return [Request(rng.choices(ids, k=rng.randint(a, b)), rng.randint(c, d)) for _ in range(num_requests)]


def load_workload(path: str | os.PathLike) -> list[Request]:
    """A .jsonl file, one request a line: {"prompt": str} or {"prompt_token_ids": [int]}, and "max_tokens"."""
    try:
        lines = [line for line in Path(path).read_text().splitlines() if line.strip()]
    except OSError as e:
        raise QuantkitError(f"cannot read workload file {path} ({e.strerror}); check the path.") from None
    requests = []
    for n, line in enumerate(lines, 1):
        try:
            row = json.loads(line)
            prompt = row["prompt_token_ids"] if "prompt_token_ids" in row else row["prompt"]
            requests.append(Request(prompt, int(row["max_tokens"])))
        except (ValueError, KeyError, TypeError):
            raise QuantkitError(
                f'{path} line {n} is not {{"prompt" or "prompt_token_ids", "max_tokens"}} JSON; fix that line.'
            ) from None
    if not requests or any(r.max_tokens < 1 or not r.prompt for r in requests):
        raise QuantkitError(f"{path} needs at least one request, each with a non-empty prompt and max_tokens >= 1.")
    return requests


def _params(request: Request) -> SamplingParams:
    return SamplingParams(max_tokens=request.max_tokens, temperature=0, ignore_eos=True)


class _EngineRun:
    """Adds requests to an engine, steps it, and keeps what finished."""

    def __init__(self, llm, workload: list[Request], warmup: bool):
        if not workload:
            raise QuantkitError("the workload is empty; give at least one request.")
        longest = max(len(llm.encode(r.prompt)) + r.max_tokens for r in workload)
        if longest > llm.context:
            raise QuantkitError(
                f"a request needs {longest} tokens (prompt + output), more than the model's "
                f"context of {llm.context}; use shorter --input-len/--output-len."
            )
        if warmup:  # compile kernels and fill caches before timing (reversed: no prefix-cache hit)
            llm.generate([llm.encode(workload[0].prompt)[::-1]], SamplingParams(max_tokens=2, ignore_eos=True))
        self.llm, self.arrival, self.finished, self.records, self.peak_kv = llm, {}, set(), [], 0.0
        self.preemptions = llm.scheduler.num_preemptions
        spec = getattr(llm, "speculator", None)
        self.spec = spec.stats.copy() if spec is not None else None
        self.start = time.perf_counter()

    @property
    def in_flight(self) -> int:
        return len(self.arrival) - len(self.finished)

    def add(self, request: Request, arrival: float | None = None) -> None:
        rid = self.llm.add_request(request.prompt, _params(request))
        self.arrival[rid] = self.llm.outputs[rid].arrival_time if arrival is None else arrival

    def step(self) -> list[dict]:
        finished = [o for o in self.llm.step() if o.finish_reason is not None]
        self.peak_kv = max(self.peak_kv, self.llm.block_manager.usage)
        for o in finished:
            self.llm.outputs.pop(o.request_id, None)
            self.finished.add(o.request_id)
            t0 = self.arrival[o.request_id]
            self.records.append(
                {
                    "prompt_tokens": len(o.prompt_token_ids),
                    "output_tokens": len(o.token_ids),
                    "ttft": o.first_token_time - t0,
                    "tpot": o.tpot,
                    "e2e": o.finish_time - t0,
                }
            )
        return finished

    def drive(self, completions, track: Track, total: int, **report) -> dict:
        import torch

        interrupted = False
        try:
            for _ in track(completions, f"bench {report['mode']}", total):
                pass
        except KeyboardInterrupt:
            interrupted = True
            for rid in self.arrival.keys() - self.finished:
                self.llm.abort(rid)
                self.llm.outputs.pop(rid, None)
        preemptions = self.llm.scheduler.num_preemptions - self.preemptions
        if self.spec is not None:  # speculative decoding: acceptance and the draft/verify split
            report["speculative"] = self.llm.speculator.stats.since(self.spec).as_dict()
        return summarize(
            self.records,
            time.perf_counter() - self.start,
            interrupted=interrupted,
            kv_usage_peak=self.peak_kv,
            preemptions=preemptions,
            threads=torch.get_num_threads(),
            **report,
        )


def run_offline(llm, workload: list[Request], track: Track = no_progress, *, warmup: bool = True, **report) -> dict:
    """All requests queued at once and stepped to completion. `report` keywords
    (slo_ttft_ms, slo_tpot_ms, cost_per_hour) go to `summarize`."""
    run = _EngineRun(llm, workload, warmup)
    for request in workload:
        run.add(request, run.start)

    def completions():
        while llm.has_unfinished():
            yield from run.step()

    return run.drive(completions(), track, len(workload), mode="offline", **report)


def run_online(
    llm,
    workload: list[Request],
    rate: float = math.inf,
    concurrency: int | None = None,
    track: Track = no_progress,
    seed: int = 0,
    *,
    warmup: bool = True,
    **report,
) -> dict:
    """Requests arrive by a Poisson process at `rate` req/s (inf: all at t=0), at most
    `concurrency` in flight when given (a closed loop of that many clients when the rate
    is inf); the engine steps in this thread, new arrivals joining between steps."""
    offsets = _arrivals(len(workload), rate, concurrency, seed)
    run = _EngineRun(llm, workload, warmup)

    def completions():
        pending = deque(zip(offsets, workload))
        while pending or llm.has_unfinished():
            now = time.perf_counter() - run.start
            while pending and pending[0][0] <= now and (concurrency is None or run.in_flight < concurrency):
                offset, request = pending.popleft()
                run.add(request, run.start + offset if concurrency is None else None)
            if llm.has_unfinished():
                yield from run.step()
            elif pending:
                time.sleep(max(0.0, pending[0][0] - (time.perf_counter() - run.start)))

    return run.drive(completions(), track, len(workload), mode="online", rate=rate, concurrency=concurrency, **report)


def _arrivals(n: int, rate: float, concurrency: int | None, seed: int) -> list[float]:
    if not rate > 0 or (concurrency is not None and concurrency < 1):
        raise QuantkitError(f"need --rate > 0 (or inf) and --concurrency >= 1, got {rate} and {concurrency}.")
    if math.isinf(rate):
        return [0.0] * n
    rng, t, offsets = random.Random(seed), 0.0, []
    for _ in range(n):
        offsets.append(t)
        t += rng.expovariate(rate)
    return offsets


def run(
    llm,
    workload: list[Request],
    mode: str = "offline",
    rate: float = math.inf,
    concurrency: int | None = None,
    track: Track = no_progress,
    seed: int = 0,
    **report,
) -> dict:
    """`run_offline` or `run_online` by `mode`."""
    if mode == "offline":
        return run_offline(llm, workload, track, **report)
    if mode == "online":
        return run_online(llm, workload, rate, concurrency, track, seed, **report)
    raise QuantkitError(f"unknown bench mode {mode!r}; use offline or online.")


def _percentiles(values: list[float]) -> dict:
    """Milliseconds: mean and p50/p90/p95/p99 (linear interpolation), None when empty."""
    v = sorted(x * 1e3 for x in values)
    if not v:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}}

    def at(p):
        k = (len(v) - 1) * p / 100
        lo = math.floor(k)
        return v[lo] + (v[min(lo + 1, len(v) - 1)] - v[lo]) * (k - lo)

    return {"mean": sum(v) / len(v), **{f"p{p}": at(p) for p in PERCENTILES}}


def summarize(
    records: list[dict],
    duration: float,
    slo_ttft_ms: float | None = None,
    slo_tpot_ms: float | None = None,
    cost_per_hour: float | None = None,
    **info,
) -> dict:
    """The report of finished requests (`records`: prompt_tokens, output_tokens, and
    ttft/tpot/e2e in seconds, tpot None for one-token outputs) over `duration` seconds."""
    duration = max(duration, 1e-9)
    out_tokens = sum(r["output_tokens"] for r in records)
    in_tokens = sum(r["prompt_tokens"] for r in records)
    good = [
        r
        for r in records
        if (slo_ttft_ms is None or r["ttft"] * 1e3 <= slo_ttft_ms)
        and (slo_tpot_ms is None or r["tpot"] is None or r["tpot"] * 1e3 <= slo_tpot_ms)
    ]
    return {
        "num_requests": len(records),
        "duration_s": duration,
        "input_tokens": in_tokens,
        "output_tokens": out_tokens,
        "requests_per_s": len(records) / duration,
        "output_tokens_per_s": out_tokens / duration,
        "total_tokens_per_s": (in_tokens + out_tokens) / duration,
        "ttft_ms": _percentiles([r["ttft"] for r in records]),
        "tpot_ms": _percentiles([r["tpot"] for r in records if r["tpot"] is not None]),
        "e2e_ms": _percentiles([r["e2e"] for r in records]),
        "slo_ttft_ms": slo_ttft_ms,
        "slo_tpot_ms": slo_tpot_ms,
        "goodput_requests_per_s": None if slo_ttft_ms is None and slo_tpot_ms is None else len(good) / duration,
        "cost_per_hour": cost_per_hour,
        "cost_per_1m_output_tokens": cost_per_hour / 3600 / (out_tokens / duration) * 1e6
        if cost_per_hour is not None and out_tokens
        else None,
        "interrupted": False,
        "failed": 0,
        "kv_usage_peak": None,
        "preemptions": None,
        "rate": None,
        "concurrency": None,
        **info,
    }


def _load_hf(model: str, dtype, device: str):
    from transformers import AutoModelForCausalLM

    from quantkit.models.loading import load_tokenizer, resolve_model

    path = resolve_model(model)
    tokenizer = load_tokenizer(path)
    try:
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or "auto").to(device).eval()
    except Exception as e:
        raise QuantkitError(f"transformers cannot load {path} for the baseline ({type(e).__name__}: {e}).") from None
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id or 0
    return hf, tokenizer, pad


def _hf_generate(hf, prompts: list[list[int]], n: int, pad: int):
    import torch

    width = max(map(len, prompts))  # left-padded to the longest prompt
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=hf.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=hf.device)
    with torch.inference_mode():
        out = hf.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=pad
        )
    return out[:, width:]  # [batch, n]


def _hf_run(hf, tokenizer, pad, workload: list[Request], batch_size: int, track: Track) -> dict:
    import torch

    prompts = [
        r.prompt if isinstance(r.prompt, list) else tokenizer.encode(r.prompt, add_special_tokens=False)
        for r in workload
    ]
    _hf_generate(hf, prompts[:1], 2, pad)  # warm up
    batches = [range(i, min(i + batch_size, len(workload))) for i in range(0, len(workload), batch_size)]
    done = output_tokens = generated = 0
    interrupted, start = False, time.perf_counter()
    try:
        for batch in track(batches, f"hf batch {batch_size}", len(batches)):
            n = max(workload[i].max_tokens for i in batch)  # the whole batch runs to its longest output
            generated += _hf_generate(hf, [prompts[i] for i in batch], n, pad).numel()
            output_tokens += sum(workload[i].max_tokens for i in batch)
            done += len(batch)
    except KeyboardInterrupt:
        interrupted = True
    duration = max(time.perf_counter() - start, 1e-9)
    return {
        "batch_size": batch_size,
        "num_requests": done,
        "output_tokens": output_tokens,
        "generated_tokens": generated,
        "duration_s": duration,
        "requests_per_s": done / duration,
        "output_tokens_per_s": output_tokens / duration,
        "interrupted": interrupted,
        "threads": torch.get_num_threads(),
    }


def run_hf_baseline(
    model: str,
    workload: list[Request],
    batch_size: int = 1,
    dtype=None,
    device: str = "cpu",
    track: Track = no_progress,
) -> dict:
    """transformers `generate` (greedy) on the workload: one request at a time
    (batch_size 1) or static left-padded batches, each running to its longest output;
    only each request's own `max_tokens` count as output. Keys: batch_size,
    num_requests, output_tokens, generated_tokens (padding included), duration_s,
    requests_per_s, output_tokens_per_s, interrupted, threads (torch's)."""
    if batch_size < 1:
        raise QuantkitError(f"the baseline batch size must be at least 1, got {batch_size}.")
    return _hf_run(*_load_hf(model, dtype, device), workload, batch_size, track)


def compare(ours: dict, **baselines: dict) -> dict:
    """{"ratio_vs_<name>": ours / baseline output tokens/s, "<name>": baseline} per baseline."""
    result = {}
    for name, base in baselines.items():
        theirs = base["output_tokens_per_s"]
        result[f"ratio_vs_{name}"] = ours["output_tokens_per_s"] / theirs if theirs else None
        result[name] = base
    return result


def compare_hf(
    model: str,
    workload: list[Request],
    ours: dict,
    dtype=None,
    device: str = "cpu",
    static_batch_size: int = 16,
    track: Track = no_progress,
) -> dict:
    """`compare` against transformers one request at a time and in static batches:
    keys ratio_vs_hf_sequential, ratio_vs_hf_static, hf_sequential, hf_static."""
    if static_batch_size < 1:
        raise QuantkitError(f"the baseline batch size must be at least 1, got {static_batch_size}.")
    loaded = _load_hf(model, dtype, device)
    return compare(
        ours,
        hf_sequential=_hf_run(*loaded, workload, 1, track),
        hf_static=_hf_run(*loaded, workload, static_batch_size, track),
    )


def _http_request(url: str, model_name: str | None, request: Request, timeout: float) -> dict:
    import urllib.request

    body = {
        "prompt": request.prompt,
        "max_tokens": request.max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    if model_name:
        body["model"] = model_name
    req = urllib.request.Request(
        url.rstrip("/") + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    start, times, usage = time.perf_counter(), [], None
    with urllib.request.urlopen(req, timeout=timeout) as response:
        for line in response:
            line = line.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            usage = chunk.get("usage") or usage
            if any(c.get("text") for c in chunk.get("choices") or ()):
                times.append(time.perf_counter())
    if not times:
        raise RuntimeError("the stream held no text")
    n = (usage or {}).get("completion_tokens") or len(times)
    prompt = (usage or {}).get("prompt_tokens") or (len(request.prompt) if isinstance(request.prompt, list) else 0)
    return {
        "prompt_tokens": prompt,
        "output_tokens": n,
        "ttft": times[0] - start,
        "tpot": (times[-1] - times[0]) / (n - 1) if n > 1 else None,
        "e2e": times[-1] - start,
    }


def run_http(
    url: str,
    workload: list[Request],
    rate: float = math.inf,
    concurrency: int | None = None,
    model_name: str | None = None,
    track: Track = no_progress,
    seed: int = 0,
    timeout: float = 600,
    **report,
) -> dict:
    """The workload against an OpenAI-compatible server's streaming /v1/completions
    (token-id prompts need a server that takes them, as vLLM does): Poisson arrivals at
    `rate`, at most `concurrency` requests open. TTFT is the first text chunk; TPOT
    spreads the rest over the completion's tokens (usage, else one per chunk)."""
    import queue

    offsets = _arrivals(len(workload), rate, concurrency, seed)
    records, errors, lock, done, stop = [], [], threading.Lock(), queue.Queue(), threading.Event()

    def send(request):
        try:
            record = _http_request(url, model_name, request, timeout)
            with lock:
                records.append(record)
        except Exception as e:  # one failed request is a datum, not the end of the run
            with lock:
                errors.append(f"{type(e).__name__}: {e}")
        finally:
            done.put(None)

    def submit():
        for offset, request in zip(offsets, workload):
            time.sleep(max(0.0, start + offset - time.perf_counter()))
            try:
                if stop.is_set():
                    return
                pool.submit(send, request)
            except RuntimeError:  # the pool shut down after Ctrl-C
                return

    pool = ThreadPoolExecutor(concurrency or min(len(workload), 256))
    start, interrupted = time.perf_counter(), False
    threading.Thread(target=submit, daemon=True).start()
    try:
        for _ in track((done.get() for _ in workload), "bench http", len(workload)):
            pass
    except KeyboardInterrupt:
        interrupted = True
        stop.set()
    pool.shutdown(wait=not interrupted, cancel_futures=True)
    duration = time.perf_counter() - start
    with lock:
        records, failed = list(records), len(errors)
    if failed and not records:
        raise QuantkitError(f"no request to {url} succeeded ({errors[0]}); check the URL and that the server is up.")
    return summarize(
        records,
        duration,
        mode="http",
        rate=rate,
        concurrency=concurrency,
        **{**report, "interrupted": interrupted, "failed": failed},
    )


def sweep(
    llm, workload: list[Request], rates: list[float], track: Track = no_progress, seed: int = 0, **report
) -> list[dict]:
    """One `run_online` report per rate."""
    return [run_online(llm, workload, rate, None, track, seed, **report) for rate in rates]


def plot_sweep(reports: list[dict], path: str | os.PathLike) -> Path:
    """A PNG of TTFT, TPOT and end-to-end latency (p50/p90/p99) against output tokens/s."""
    from quantkit import figures

    fig = figures.figure(figsize=(15, 4.5))
    x = [r["output_tokens_per_s"] for r in reports]
    for ax, key in zip(fig.subplots(1, 3), ("ttft_ms", "tpot_ms", "e2e_ms")):
        for p in ("p50", "p90", "p99"):
            ax.plot(x, [r[key][p] for r in reports], marker="o", label=p)
        for r, xi in zip(reports, x):
            ax.annotate(f"{r.get('rate')} req/s", (xi, r[key]["p50"] or 0), fontsize=7)
        ax.set(xlabel="output tokens/s", ylabel=key.replace("_ms", " (ms)"), title=key.split("_")[0].upper())
        ax.legend()
    return figures.save(fig, path)
