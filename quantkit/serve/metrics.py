"""Prometheus metrics of the server, on their own registry (so two servers in one process,
as in the tests, do not collide). The engine thread records requests and engine state;
the app counts errors."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
)


class Metrics:
    """All times in seconds, measured from when the server accepted the request."""

    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.ttft = Histogram(
            "quantkit_time_to_first_token_seconds", "Time to first token.", registry=r, buckets=LATENCY_BUCKETS
        )
        self.itl = Histogram(
            "quantkit_inter_token_latency_seconds",
            "Time between two tokens of a request (TPOT).",
            registry=r,
            buckets=LATENCY_BUCKETS,
        )
        self.e2e = Histogram(
            "quantkit_e2e_request_latency_seconds",
            "Request latency, accepted to finished.",
            registry=r,
            buckets=LATENCY_BUCKETS,
        )
        self.queue_time = Histogram(
            "quantkit_queue_time_seconds", "Time from accepted to first scheduled.", registry=r, buckets=LATENCY_BUCKETS
        )
        self.running = Gauge("quantkit_num_requests_running", "Sequences holding KV blocks.", registry=r)
        self.waiting = Gauge("quantkit_num_requests_waiting", "Sequences waiting to be scheduled.", registry=r)
        self.kv_usage = Gauge("quantkit_kv_cache_usage_ratio", "Fraction of KV blocks in use.", registry=r)
        self.prompt_tokens = Counter("quantkit_prompt_tokens", "Prompt tokens of accepted requests.", registry=r)
        self.generation_tokens = Counter("quantkit_generation_tokens", "Generated tokens.", registry=r)
        self.prefix_cache_hits = Counter(
            "quantkit_prefix_cache_hits", "Prompt tokens served from the prefix cache.", registry=r
        )
        self.preemptions = Counter("quantkit_num_preemptions", "Sequences preempted for lack of KV blocks.", registry=r)
        self.requests = Counter(
            "quantkit_requests", "Finished requests by finish reason.", ["finish_reason"], registry=r
        )
        self.errors = Counter(
            "quantkit_request_errors", "Requests answered with an error, by kind.", ["kind"], registry=r
        )
        self.spec_drafts = Counter(
            "vllm:spec_decode_num_drafts", "Speculative verify steps (one per speculating sequence).", registry=r
        )
        self.spec_draft_tokens = Counter("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed.", registry=r)
        self.spec_accepted_tokens = Counter(
            "vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.", registry=r
        )
        self.spec_accepted_per_pos = Counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by position in the draft.",
            ["position"],
            registry=r,
        )
        self._seen = {"hits": 0, "preemptions": 0, "drafts": 0, "draft_tokens": 0, "accepted": 0}
        self._seen_pos: list[int] = []

    def engine_state(self, llm, waiting_outside: int = 0) -> None:
        """Gauges and cumulative engine counters; call from the engine thread."""
        sched, bm = llm.scheduler, llm.block_manager
        self.running.set(len(sched.running))
        self.waiting.set(len(sched.waiting) + waiting_outside)
        self.kv_usage.set(bm.usage)
        for key, counter, value in [
            ("hits", self.prefix_cache_hits, bm.prefix_cache_hits),
            ("preemptions", self.preemptions, sched.num_preemptions),
        ]:
            if value > self._seen[key]:
                counter.inc(value - self._seen[key])
            self._seen[key] = value
        if getattr(llm, "speculator", None) is not None:
            self._spec_state(llm.speculator.stats)

    def _spec_state(self, stats) -> None:
        for key, counter, value in [
            ("drafts", self.spec_drafts, stats.num_drafts),
            ("draft_tokens", self.spec_draft_tokens, stats.num_draft_tokens),
            ("accepted", self.spec_accepted_tokens, stats.num_accepted_tokens),
        ]:
            if value > self._seen[key]:
                counter.inc(value - self._seen[key])
            self._seen[key] = value
        self._seen_pos += [0] * (len(stats.accepted_per_pos) - len(self._seen_pos))
        for pos, value in enumerate(stats.accepted_per_pos):
            if value > self._seen_pos[pos]:
                self.spec_accepted_per_pos.labels(str(pos)).inc(value - self._seen_pos[pos])
                self._seen_pos[pos] = value

    def finished(self, output, accepted: float, finish_reason: str) -> None:
        """A request ended; `output` is its RequestOutput, times on the perf_counter clock."""
        self.requests.labels(finish_reason).inc()
        if finish_reason == "abort":
            return
        if output.finish_time is not None:
            self.e2e.observe(max(0.0, output.finish_time - accepted))
        if output.first_token_time is not None:
            self.ttft.observe(max(0.0, output.first_token_time - accepted))
        for a, b in zip(output.token_times, output.token_times[1:]):
            self.itl.observe(b - a)

    def render(self) -> bytes:
        return generate_latest(self.registry)
