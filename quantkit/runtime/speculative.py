"""Speculative decoding: propose a few tokens cheaply, check them all in one target forward.

    llm = LLM("smollm2-135m", speculative_config={"method": "ngram", "num_speculative_tokens": 4})

A decoding sequence that speculates with k draft tokens runs its last token and the k drafts
as one prefill-style chunk of k + 1 tokens at its context (the chunked-prefill path over the
paged cache), so the target gives logits at all k + 1 positions in the same step as the other
sequences' prefills and decodes. The agreeing prefix of the drafts is kept plus one token of
the target's own (`verify_greedy`, `verify_sampled`), and the scheduler frees the KV blocks of
rejected positions (`BlockManager.truncate`). Proposers: `ngram_propose` (prompt lookup, no
model) and `DraftModel` (`quantkit.runtime.draft`). The number of drafts adapts per sequence
(`AdaptiveK`) and speculation stops while the batch is large (`disable_by_batch_size`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import torch

from quantkit.errors import QuantkitError

KEYS = {
    "method",
    "model",
    "num_speculative_tokens",
    "prompt_lookup_max",
    "prompt_lookup_min",
    "disable_by_batch_size",
    "adaptive",
}
METHODS = ("ngram", "draft_model")
DEFAULT_DISABLE_BY_BATCH_SIZE = 8  # CPU decode turns compute-bound around here (docs/speculative.md)


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """vLLM's `speculative_config`: `method` "ngram" (prompt lookup) or "draft_model" (a `model`
    sharing the target's tokenizer), `num_speculative_tokens` drafts at most per step, the
    n-gram sizes tried (longest first), `disable_by_batch_size` running sequences at which
    speculation pauses, and whether k adapts per sequence."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    model: str | None = None
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE
    adaptive: bool = True


def _positive(config: dict, key: str, default: int) -> int:
    value = config.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise QuantkitError(f"speculative_config {key} must be an integer >= 1, got {value!r}.")
    return value


def parse_speculative_config(value: dict | str | None) -> SpeculativeConfig | None:
    """A `SpeculativeConfig` from a dict or its JSON text (None: no speculation)."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise QuantkitError(
                f"--speculative-config is not valid JSON ({e.msg}); give an object like "
                '\'{"method": "ngram", "num_speculative_tokens": 4}\'.'
            ) from None
    if not isinstance(value, dict):
        raise QuantkitError(f"speculative_config must be a JSON object, got {type(value).__name__}.")
    unknown = sorted(set(value) - KEYS)
    if unknown:
        raise QuantkitError(f"speculative_config has unknown keys {unknown}; the keys are {sorted(KEYS)}.")
    method = value.get("method", "draft_model" if "model" in value else None)
    if method not in METHODS:
        raise QuantkitError(f"speculative_config method must be one of {METHODS} (or give a model), got {method!r}.")
    if method == "draft_model" and not isinstance(value.get("model"), str):
        raise QuantkitError("speculative_config needs a draft model (a path or built-in name) for method draft_model.")
    if method == "ngram" and "model" in value:
        raise QuantkitError("speculative_config method ngram takes no model; drop it or use method draft_model.")
    if "num_speculative_tokens" not in value:
        raise QuantkitError("speculative_config needs num_speculative_tokens (the drafts per step, e.g. 4).")
    lo, hi = _positive(value, "prompt_lookup_min", 2), _positive(value, "prompt_lookup_max", 4)
    if lo > hi:
        raise QuantkitError(f"speculative_config prompt_lookup_min ({lo}) exceeds prompt_lookup_max ({hi}).")
    adaptive = value.get("adaptive", True)
    if not isinstance(adaptive, bool):
        raise QuantkitError(f"speculative_config adaptive must be true or false, got {adaptive!r}.")
    return SpeculativeConfig(
        method,
        _positive(value, "num_speculative_tokens", 0),
        hi,
        lo,
        value.get("model"),
        _positive(value, "disable_by_batch_size", DEFAULT_DISABLE_BY_BATCH_SIZE),
        adaptive,
    )


def ngram_propose(tokens: list[int], k: int, lookup_min: int, lookup_max: int) -> list[int]:
    """Prompt lookup: for n from `lookup_max` down to `lookup_min`, find the most recent earlier
    occurrence of the last n tokens in `tokens` (prompt + output so far) and propose the (up
    to) k tokens that followed it; [] when no suffix recurs."""
    L = len(tokens)
    for n in range(min(lookup_max, L - 1), lookup_min - 1, -1):
        suffix = tokens[L - n :]
        for start in range(L - n - 1, -1, -1):  # most recent first; never the suffix itself
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def verify_greedy(argmax: list[int], drafts: list[int]) -> list[int]:
    """Greedy verification: `argmax` [k + 1] are the target's choices after the last token and
    after each draft; keep the drafts while they agree, then the target's next token."""
    out = []
    for x, want in zip(drafts, argmax):
        if x != want:
            break
        out.append(x)
    return out + [argmax[len(out)]]


def verify_sampled(
    p: torch.Tensor, drafts: list[int], q: torch.Tensor | None, generator: torch.Generator | None
) -> list[int]:
    """Leviathan et al. 2023, Algorithm 1: accept draft x_i with probability min(1, p_i(x) /
    q_i(x)), else stop with a sample of norm(max(0, p_i - q_i)); all accepted: a sample of
    p_k. `p` [k + 1, vocab] the target's probabilities (temperature, top-k, top-p applied),
    `q` [k, vocab] the proposer's, None for a deterministic proposal (a point mass at x_i).
    The tokens then follow p exactly (`tests/runtime/test_speculative.py` checks it)."""
    out = []
    for i, x in enumerate(drafts):
        qx = 1.0 if q is None else float(q[i, x])
        u = float(torch.rand((), generator=generator))
        if u * qx < float(p[i, x]):  # u < p / q without dividing by a zero q
            out.append(x)
            continue
        point = torch.zeros_like(p[i])
        point[x] = 1.0
        residual = (p[i] - (point if q is None else q[i])).clamp_min(0)
        if float(residual.sum()) <= 0:  # p == q: any rejection is measure zero; fall back to p
            residual = p[i]
        return out + [int(torch.multinomial(residual, 1, generator=generator))]
    return out + [int(torch.multinomial(p[len(drafts)], 1, generator=generator))]


@dataclass(slots=True)
class AdaptiveK:
    """One sequence's number of drafts: grows by one after a step whose drafts were all
    accepted, shrinks by one when fewer than half were; when the running acceptance rate (an
    exponential average) drops below `floor`, where a verify step no longer pays for its
    k + 1 positions, speculation pauses for `pause` steps and restarts at k = 1."""

    k: int
    k_max: int
    rate: float = 0.5
    paused: int = 0
    floor: float = 0.2
    pause: int = 16

    def next_k(self) -> int:
        if self.paused:
            self.paused -= 1
            return 0
        return self.k

    def update(self, proposed: int, accepted: int) -> None:
        if not proposed:
            return
        self.rate = 0.7 * self.rate + 0.3 * accepted / proposed
        if accepted == proposed:
            self.k = min(self.k + 1, self.k_max)
        elif 2 * accepted < proposed:
            self.k = max(self.k - 1, 1)
        if self.rate < self.floor:
            self.k, self.paused, self.rate = 1, self.pause, 0.5


@dataclass(slots=True)
class SpecStats:
    """Counters as vLLM's spec_decode metrics: drafts (verify steps of one sequence), draft
    tokens, accepted tokens, accepted per draft position; draft and verify seconds."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    draft_s: float = 0.0
    verify_s: float = 0.0
    steps: int = 0  # engine steps that verified drafts

    def record(self, proposed: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        self.accepted_per_pos += [0] * (proposed - len(self.accepted_per_pos))
        for i in range(accepted):
            self.accepted_per_pos[i] += 1

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_accepted_length(self) -> float | None:
        """Tokens a verify step yields on average: accepted drafts plus the target's own."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None

    def since(self, before: SpecStats) -> SpecStats:
        """What was counted after `before` (a `copy` of these stats taken earlier)."""
        per_pos = [
            a - (before.accepted_per_pos[i] if i < len(before.accepted_per_pos) else 0)
            for i, a in enumerate(self.accepted_per_pos)
        ]
        return SpecStats(
            self.num_drafts - before.num_drafts,
            self.num_draft_tokens - before.num_draft_tokens,
            self.num_accepted_tokens - before.num_accepted_tokens,
            per_pos,
            self.draft_s - before.draft_s,
            self.verify_s - before.verify_s,
            self.steps - before.steps,
        )

    def copy(self) -> SpecStats:
        return SpecStats(
            self.num_drafts,
            self.num_draft_tokens,
            self.num_accepted_tokens,
            list(self.accepted_per_pos),
            self.draft_s,
            self.verify_s,
            self.steps,
        )

    def as_dict(self) -> dict:
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "accepted_per_pos": list(self.accepted_per_pos),
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_length": self.mean_accepted_length,
            "draft_ms_per_step": 1000 * self.draft_s / self.steps if self.steps else None,
            "verify_ms_per_step": 1000 * self.verify_s / self.steps if self.steps else None,
        }


class NgramProposer:
    """Prompt lookup (`ngram_propose`), run before the scheduler so a sequence with no match
    reserves no lookahead slots."""

    def __init__(self, config: SpeculativeConfig):
        self.config = config
        self.pending: dict[int, list[int]] = {}

    def plan(self, seq, k: int) -> int:
        c = self.config
        self.pending[seq.seq_id] = drafts = ngram_propose(seq.token_ids, k, c.prompt_lookup_min, c.prompt_lookup_max)
        return len(drafts)

    def propose(self, seqs: list) -> dict[int, tuple[list[int], torch.Tensor | None]]:
        """{seq_id: (drafts, None: a deterministic proposal)} for `seqs`, each cut to its granted lookahead."""
        found = {s.seq_id: (self.pending.get(s.seq_id, [])[: s.num_lookahead], None) for s in seqs}
        self.pending.clear()
        return found

    def forget(self, seq_id: int) -> None:
        self.pending.pop(seq_id, None)


class Speculator:
    """The engine's speculative state: the proposer, each sequence's `AdaptiveK`, engine-wide
    `stats` and per-request ones (`requests[seq_id]`)."""

    def __init__(self, config: SpeculativeConfig, proposer):
        self.config, self.proposer = config, proposer
        self.stats = SpecStats()
        self.ks: dict[int, AdaptiveK] = {}
        self.requests: dict[int, SpecStats] = {}

    def plan(self, scheduler) -> None:
        """Set `num_lookahead` (the drafts wanted) on each running sequence about to decode:
        none while the batch is large, for a request asking for logprobs, or past max_tokens."""
        running = scheduler.running
        busy = len(running) + len(scheduler.waiting) >= self.config.disable_by_batch_size
        for seq in running:
            seq.num_lookahead = 0
            if busy or seq.num_tokens - seq.num_computed_tokens != 1 or seq.params.logprobs is not None:
                continue
            state = self.ks.setdefault(
                seq.seq_id, AdaptiveK(self.config.num_speculative_tokens, self.config.num_speculative_tokens)
            )
            k = state.next_k() if self.config.adaptive else self.config.num_speculative_tokens
            k = min(k, seq.params.max_tokens - len(seq.output_token_ids) - 1)
            if k > 0:
                seq.num_lookahead = self.proposer.plan(seq, k)

    def record(self, seq_id: int, proposed: int, accepted: int) -> None:
        self.stats.record(proposed, accepted)
        self.requests.setdefault(seq_id, SpecStats()).record(proposed, accepted)
        if seq_id in self.ks:
            self.ks[seq_id].update(proposed, accepted)

    def forget(self, seq_id: int) -> SpecStats | None:
        """Drop a finished request's state; returns its numbers."""
        self.ks.pop(seq_id, None)
        self.proposer.forget(seq_id)
        return self.requests.pop(seq_id, None)
