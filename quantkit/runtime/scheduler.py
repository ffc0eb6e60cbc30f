"""Iteration-level continuous batching. Each step keeps the running sequences going
(decodes first, then unfinished chunked prefills), preempting the newest running sequence
when a decode finds no free block, then admits waiting sequences (priority ascending,
then first come first served) while blocks, `max_num_seqs` and the token budget allow.
A preempted sequence gives up its blocks and is recomputed later from its prompt plus
the tokens it had generated, so preemption never changes results. Pure Python."""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass, field

from quantkit.errors import QuantkitError
from quantkit.runtime.block_manager import BlockManager
from quantkit.runtime.sequence import FINISH_REASONS, Sequence, SequenceStatus


@dataclass(slots=True)
class SchedulerOutput:
    """One step. The runner first copies each (src, dst) block in `copies`, then computes
    tokens [seq.num_computed_tokens, seq.num_computed_tokens + n) for each (seq, n) in
    `prefill` and the last token of each seq in `decode`, and samples one token for each
    seq in `sampled` (prefills that reach their last token, then decodes), in that order."""

    prefill: list[tuple[Sequence, int]] = field(default_factory=list)
    decode: list[Sequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)
    sampled: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(n for _, n in self.prefill) + len(self.decode)

    @property
    def is_empty(self) -> bool:
        return not self.prefill and not self.decode


class Scheduler:
    """`chunk_size` caps the prompt tokens one sequence computes per step (None: only the
    token budget does). `eos_token_id` (one id or several) ends a sequence unless its
    params say ignore_eos; stop strings are the engine's job (it calls `finish`)."""

    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        chunk_size: int | None = None,
        eos_token_id: int | Iterable[int] | None = None,
    ):
        for name, value in [
            ("max_num_seqs", max_num_seqs),
            ("max_num_batched_tokens", max_num_batched_tokens),
            ("chunk_size", 1 if chunk_size is None else chunk_size),
        ]:
            if value < 1:
                raise QuantkitError(f"{name} must be at least 1, got {value}.")
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.chunk_size = chunk_size
        eos = () if eos_token_id is None else (eos_token_id,) if isinstance(eos_token_id, int) else eos_token_id
        self.eos_token_ids = frozenset(eos)
        self.waiting: list[Sequence] = []  # sorted by sort_key
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        bs, total = self.block_manager.block_size, self.block_manager.num_blocks
        need = -(-(seq.num_prompt_tokens + seq.params.max_tokens - 1) // bs)
        if need > total:
            raise QuantkitError(
                f"request {seq.seq_id!r} needs {need} KV blocks for its prompt plus max_tokens but the "
                f"cache holds {total}; lower max_tokens or give the KV cache more memory."
            )
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=_key)

    def fork(self, parent: Sequence, seq_id: int) -> Sequence:
        """Start a sibling of a running sequence (parallel sampling): same tokens, shared blocks."""
        if parent.status is not SequenceStatus.RUNNING or parent.num_tokens - parent.num_computed_tokens != 1:
            raise ValueError(f"sequence {parent.seq_id} can be forked only while decoding (prompt fully computed)")
        child = Sequence(
            seq_id, parent.prompt_token_ids, parent.params, list(parent.output_token_ids), status=SequenceStatus.RUNNING
        )
        self.block_manager.fork(parent, child)
        self.running.append(child)
        return child

    def abort(self, seq_id: int) -> Sequence | None:
        for seq in self.running + self.waiting:
            if seq.seq_id == seq_id:
                self.finish(seq, "abort")
                return seq
        return None

    def finish(self, seq: Sequence, reason: str) -> None:
        """End `seq` ("stop" | "length" | "abort") and free its blocks."""
        if reason not in FINISH_REASONS:
            raise ValueError(f"finish reason must be one of {FINISH_REASONS}, got {reason!r}")
        if seq.is_finished:
            return
        (self.running if seq.status is SequenceStatus.RUNNING else self.waiting).remove(seq)
        self.block_manager.free(seq)
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self._schedule_running(out)
        if not out.preempted:  # blocks are short: let the running sequences catch up first
            self._admit(out, budget)
        out.sampled = [s for s, n in out.prefill if s.num_computed_tokens + n == s.num_tokens] + out.decode
        return out

    def postprocess(self, out: SchedulerOutput, token_ids: Iterable[int]) -> list[Sequence]:
        """Record the step's work and the tokens sampled for `out.sampled` (in that order): one
        token each, or a list (a speculating sequence's accepted drafts and the target's token,
        appended one at a time so a stop or max_tokens never overshoots); returns the sequences
        that finished."""
        token_ids = list(token_ids)
        if len(token_ids) != len(out.sampled):
            raise ValueError(f"expected {len(out.sampled)} sampled tokens, got {len(token_ids)}")
        for seq, n in out.prefill + [(s, 1) for s in out.decode]:
            if seq.status is SequenceStatus.RUNNING:  # not aborted while the step ran
                seq.num_computed_tokens += n
                self.block_manager.cache_computed(seq)
        finished = []
        for seq, tokens in zip(out.sampled, token_ids):
            if seq.status is not SequenceStatus.RUNNING:
                continue
            for j, token in enumerate([tokens] if isinstance(tokens, int) else tokens):
                if seq.status is not SequenceStatus.RUNNING:
                    break
                seq.num_computed_tokens += j > 0  # an accepted draft: its KV came with the verify pass
                self._append(seq, token)
            if seq.status is SequenceStatus.RUNNING and seq.num_lookahead:
                seq.num_lookahead = 0
                self.block_manager.truncate(seq)  # the rejected drafts' positions
                self.block_manager.cache_computed(seq)
            if seq.is_finished:
                finished.append(seq)
        return finished

    def _append(self, seq: Sequence, token: int) -> None:
        seq.output_token_ids.append(token)
        p = seq.params
        if token in p.stop_token_ids or (token in self.eos_token_ids and not p.ignore_eos):
            self.finish(seq, "stop")
        elif len(seq.output_token_ids) >= p.max_tokens:
            self.finish(seq, "length")

    def _schedule_running(self, out: SchedulerOutput) -> int:
        budget = self.max_num_batched_tokens
        self.running.sort(key=_key)  # newest (largest key) last: the first to be preempted
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.num_tokens - seq.num_computed_tokens == 1:
                if not self._make_room(seq, out):
                    break  # seq itself was the newest and got preempted
                seq.num_lookahead = self._lookahead(seq, budget, len(self.running) - i - 1)
                copy = self.block_manager.append_slot(seq, seq.num_lookahead)
                if copy is not None:
                    out.copies.append(copy)
                out.decode.append(seq)
                budget -= 1 + seq.num_lookahead
            i += 1
        for seq in self.running:  # chunked prefills carry on with what is left
            remaining = seq.num_tokens - seq.num_computed_tokens
            if remaining > 1 and budget > 0:
                out.prefill.append((seq, self._chunk(remaining, budget)))
                budget -= out.prefill[-1][1]
        return budget

    def _lookahead(self, seq: Sequence, budget: int, others: int) -> int:
        # Speculative slots never cost a preemption: grant them only while every sequence still
        # to be scheduled keeps a free block for its own next token.
        k, bm = min(seq.num_lookahead, budget - 1), self.block_manager
        while k > 0 and bm._blocks_to_append(seq, k) + others > bm.num_free_blocks:
            k -= 1
        return max(k, 0)

    def _make_room(self, seq: Sequence, out: SchedulerOutput) -> bool:
        while not self.block_manager.can_append(seq):
            victim = self.running.pop()
            self.block_manager.free(victim)
            victim.status, victim.num_lookahead = SequenceStatus.WAITING, 0
            bisect.insort(self.waiting, victim, key=_key)
            out.preempted.append(victim)
            self.num_preemptions += 1
            if victim is seq:
                return False
        return True

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        bm = self.block_manager
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not bm.can_allocate(seq):
                break  # strict order: a request that does not fit yet holds back those behind it
            self.waiting.pop(0)
            bm.allocate(seq)
            seq.status, seq.num_computed_tokens = SequenceStatus.RUNNING, seq.num_cached_tokens
            out.prefill.append((seq, self._chunk(seq.num_tokens - seq.num_computed_tokens, budget)))
            budget -= out.prefill[-1][1]
            self.running.append(seq)

    def _chunk(self, remaining: int, budget: int) -> int:
        return min(remaining, budget, self.chunk_size or remaining)


def _key(seq: Sequence) -> tuple[int, int]:
    return seq.sort_key
