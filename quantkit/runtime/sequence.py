"""A request as the engine tracks it: sampling parameters, status, tokens, and where its
KV lives. Shared by the block manager and the scheduler; pure Python (no torch)."""

from __future__ import annotations

import enum
import itertools
import math
from dataclasses import dataclass, field

from quantkit.errors import QuantkitError

FINISH_REASONS = ("stop", "length", "abort")
_arrivals = itertools.count()


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise QuantkitError(message)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclass(slots=True)
class SamplingParams:
    """How to pick tokens for one request and when to stop. temperature=0 is greedy,
    top_k=0 and top_p=1.0 switch those filters off, `stop` strings are matched by the
    engine on the decoded text, and lower `priority` values are scheduled first."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # return the top-n log-probabilities per token
    priority: int = 0

    def __post_init__(self):
        _check(
            _is_int(self.max_tokens) and self.max_tokens >= 1,
            f"max_tokens must be at least 1, got {self.max_tokens!r}.",
        )
        _check(
            _is_number(self.temperature) and self.temperature >= 0,
            f"temperature must be a number >= 0 (0 means greedy), got {self.temperature!r}.",
        )
        _check(
            _is_int(self.top_k) and self.top_k >= 0,
            f"top_k must be an integer >= 0 (0 turns it off), got {self.top_k!r}.",
        )
        _check(_is_number(self.top_p) and 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p!r}.")
        _check(self.seed is None or _is_int(self.seed), f"seed must be an integer or None, got {self.seed!r}.")
        _check(
            self.logprobs is None or (_is_int(self.logprobs) and self.logprobs >= 0),
            f"logprobs must be None or an integer >= 0, got {self.logprobs!r}.",
        )
        _check(_is_int(self.priority), f"priority must be an integer, got {self.priority!r}.")
        self.stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        _check(
            all(isinstance(s, str) and s for s in self.stop), f"stop must hold non-empty strings, got {self.stop!r}."
        )
        self.stop_token_ids = tuple(self.stop_token_ids)
        _check(
            all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
            f"stop_token_ids must hold token ids (integers >= 0), got {self.stop_token_ids!r}.",
        )


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued, or preempted and waiting to be recomputed; holds no blocks
    RUNNING = "running"  # holds KV blocks for all its tokens
    FINISHED = "finished"  # see Sequence.finish_reason


@dataclass(slots=True, eq=False)
class Sequence:
    """One request. `block_table[i]` is the physical KV block holding tokens
    [i * block_size, (i + 1) * block_size); the KV of the first `num_computed_tokens`
    tokens is written, and the first `num_cached_tokens` of those came from the prefix
    cache. While it speculates, its table also covers `num_lookahead` draft positions.
    `arrival` orders requests of equal priority (first come, first served)."""

    seq_id: int
    prompt_token_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort" once FINISHED
    block_table: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0
    num_computed_tokens: int = 0
    num_lookahead: int = 0  # speculative decoding: draft tokens wanted, then the slots granted, this step
    kv_resets: int = 0  # times its blocks were freed (preemption): a draft model's KV of it is gone
    arrival: int = field(default_factory=lambda: next(_arrivals))

    def __post_init__(self):
        self.prompt_token_ids = list(self.prompt_token_ids)
        _check(
            len(self.prompt_token_ids) > 0, f"request {self.seq_id!r} has an empty prompt; give it at least one token."
        )

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def last_token(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def sort_key(self) -> tuple[int, int]:
        """Scheduling order: priority ascending, then arrival."""
        return (self.params.priority, self.arrival)

    def num_blocks_needed(self, block_size: int) -> int:
        """Blocks that hold all of this sequence's current tokens."""
        return -(-self.num_tokens // block_size)
