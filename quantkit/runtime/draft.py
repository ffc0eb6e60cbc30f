"""The draft-model proposer: a small causal LM sharing the target's tokenizer proposes k tokens
greedily, one forward per token, over its own paged KV cache.

The draft is loaded by the engine's loader (`runtime.loader.load`), so a quantkit INT4
checkpoint of the target can draft for the float target ("self-draft"). Its KV lives in its
own `ModelRunner`'s cache tensors with the target's number of blocks and block size, indexed
by the target's block tables: one block manager, one allocator, and every block the target
holds for a sequence holds the draft's KV of the same positions. Its memory is its weights plus
`kv_bytes_per_block(draft config)` × the target's blocks (`docs/speculative.md`).

`computed[seq_id]` counts the leading positions whose draft KV is written. Each proposal first
runs the positions the draft has not seen (the prompt the first time; the tokens accepted since
its last proposal otherwise) as one chunk ending at the sequence's last token, whose logits give
the first draft, then k - 1 one-token steps. After a verify step only positions below the target's
`num_computed_tokens` hold accepted tokens, so the count is cut to that. A preemption frees the
sequence's blocks (`Sequence.kv_resets` moves) and the draft starts over. Prefix-cache hits are
recomputed by the draft too (the block may have been filled while nobody speculated).
"""

from __future__ import annotations

import torch

from quantkit.errors import QuantkitError
from quantkit.models.loading import check_causal_lm, load_tokenizer, resolve_model
from quantkit.runtime.loader import load
from quantkit.runtime.model_runner import Batch, ModelRunner, check_supported


def check_same_vocab(target_tokenizer, draft_tokenizer, target_config, draft_config, name: str) -> None:
    """Refuse a draft whose tokenizer or vocabulary size differs from the target's."""
    if draft_tokenizer.get_vocab() != target_tokenizer.get_vocab():
        raise QuantkitError(
            f"the draft model {name} has another tokenizer than the target; a draft must share the "
            "target's tokenizer (for example an INT4 checkpoint of the target, or a smaller model of its family)."
        )
    if draft_config.vocab_size != target_config.vocab_size:
        raise QuantkitError(
            f"the draft model {name} has {draft_config.vocab_size} logits per token and the target "
            f"{target_config.vocab_size}; use a draft with the target's vocabulary size."
        )


class DraftModel:
    """Proposes greedy drafts (so the proposal is deterministic: a point mass for the
    rejection-sampling rule)."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.computed: dict[int, tuple[int, int]] = {}  # seq_id -> (kv_resets, positions written)

    @classmethod
    def for_target(cls, llm, config) -> DraftModel:
        """The draft of `config.model` for the engine `llm`, in the target's dtype, with a KV
        cache of the target's blocks."""
        path = resolve_model(config.model)
        draft_config = check_causal_lm(path)
        check_same_vocab(llm.tokenizer, load_tokenizer(path), llm.model.config, draft_config, config.model)
        model = load(path, llm.runner.dtype)
        check_supported(model)
        bm = llm.block_manager
        return cls(ModelRunner(model, bm.num_blocks, bm.block_size, llm.runner.backend, llm.runner.max_num_seqs))

    def plan(self, seq, k: int) -> int:
        return k

    def forget(self, seq_id: int) -> None:
        self.computed.pop(seq_id, None)

    def propose(self, seqs: list) -> dict[int, tuple[list[int], None]]:
        """{seq_id: (seq.num_lookahead greedy drafts, None)} for `seqs`."""
        chunks = []
        for seq in seqs:
            resets, done = self.computed.get(seq.seq_id, (seq.kv_resets, 0))
            done = 0 if resets != seq.kv_resets else min(done, seq.num_computed_tokens)
            chunks.append((seq, done, seq.token_ids[done:]))
        drafts = {s.seq_id: [t] for s, t in zip(seqs, self._run(chunks))}
        for step in range(1, max(s.num_lookahead for s in seqs)):
            live = [s for s in seqs if s.num_lookahead > step]
            if not live:
                break
            tokens = self._run([(s, s.num_tokens + step - 1, [drafts[s.seq_id][-1]]) for s in live])
            for s, t in zip(live, tokens):
                drafts[s.seq_id].append(t)
        for s in seqs:  # positions up to the last draft fed in hold draft KV
            self.computed[s.seq_id] = (s.kv_resets, s.num_tokens + s.num_lookahead - 1)
        return {s.seq_id: (drafts[s.seq_id], None) for s in seqs}

    def _run(self, chunks: list) -> list[int]:
        """Greedy next tokens after each (seq, start, tokens) chunk, all run as one batch of
        prefill chunks (the one-token ones too) through the draft's runner."""
        r, bs = self.runner, self.runner.block_size
        ids, pos, slots, last = [], [], [], []
        for seq, start, tokens in chunks:
            ids += tokens
            pos += range(start, start + len(tokens))
            slots += [seq.block_table[p // bs] * bs + p % bs for p in range(start, start + len(tokens))]
            last.append(len(ids) - 1)
        width = max(len(s.block_table) for s, _, _ in chunks)
        tables = [s.block_table + [0] * (width - len(s.block_table)) for s, _, _ in chunks]

        def ints(values, dtype=torch.int64):
            return torch.tensor(values, dtype=dtype, device=r.device)

        batch = Batch(
            ints(ids),
            ints(pos),
            ints(slots),
            ints(tables, torch.int32),
            ints([start + len(t) for _, start, t in chunks], torch.int32),
            ints([len(t) for _, _, t in chunks], torch.int32),
            torch.zeros(0, 1, dtype=torch.int32, device=r.device),
            ints([], torch.int32),
            ints(last),
            len(ids),
        )
        return r.argmax(r.forward(batch)).tolist()
