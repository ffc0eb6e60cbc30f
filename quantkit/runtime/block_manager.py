"""Paged KV-cache bookkeeping: which physical block holds which tokens of which sequence.
Pure Python (no torch); the model runner turns block tables into slot indices.

Blocks are reference counted so sequences can share them: a prefix-cache hit or a fork
(parallel sampling) adds a reference, and a write into a shared block first copies it
(copy-on-write). Prefix caching: once every token of a FULL block has its KV computed,
the block is registered under the chain hash hash((previous block's hash, its token
ids)); a later sequence whose leading blocks match reuses them and skips computing
those tokens. A freed block keeps its hash in the free pool and can still be hit until
it is handed out again (blocks without a hash are reused first, then the least
recently freed)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from quantkit.errors import QuantkitError
from quantkit.runtime.sequence import Sequence


class BlockManager:
    """`num_blocks` KV blocks of `block_size` tokens. `prefix_cache_hits` and
    `prefix_cache_queries` count tokens (reused, and looked up at allocation)."""

    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise QuantkitError(
                f"the KV cache needs at least one block of at least one token, got "
                f"num_blocks={num_blocks}, block_size={block_size}."
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self._hash: list[int | None] = [None] * num_blocks
        self._tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self._cached: dict[int, int] = {}  # chain hash -> block id
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # handed out from the front
        self.prefix_cache_hits = 0
        self.prefix_cache_queries = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by some sequence."""
        return 1 - len(self._free) / self.num_blocks

    def free_block_ids(self) -> list[int]:
        return list(self._free)

    def slot(self, seq: Sequence, position: int) -> int:
        """Index of token `position` of `seq` in the flat [num_blocks * block_size] cache."""
        return seq.block_table[position // self.block_size] * self.block_size + position % self.block_size

    def can_allocate(self, seq: Sequence) -> bool:
        return self._blocks_to_take(seq, self._lookup(seq)) <= len(self._free)

    def allocate(self, seq: Sequence) -> None:
        """Give `seq` blocks for all its current tokens, reusing prefix-cache hits, and set
        `seq.num_cached_tokens` to the number of tokens whose KV it need not compute."""
        assert not seq.block_table, f"sequence {seq.seq_id} already holds blocks"
        hits = self._lookup(seq)
        if self._blocks_to_take(seq, hits) > len(self._free):
            raise RuntimeError(f"not enough free KV blocks for sequence {seq.seq_id}; ask can_allocate first")
        for block in hits:
            if self.ref_counts[block] == 0:
                del self._free[block]
            self.ref_counts[block] += 1
        fresh = [self._take() for _ in range(seq.num_blocks_needed(self.block_size) - len(hits))]
        seq.block_table = hits + fresh
        seq.num_cached_tokens = len(hits) * self.block_size
        self.prefix_cache_hits += seq.num_cached_tokens
        self.prefix_cache_queries += seq.num_tokens

    def can_append(self, seq: Sequence, lookahead: int = 0) -> bool:
        return self._blocks_to_append(seq, lookahead) <= len(self._free)

    def append_slot(self, seq: Sequence, lookahead: int = 0) -> tuple[int, int] | None:
        """Make room for `seq`'s last token and `lookahead` speculative positions after it: new
        blocks past the last one, and a private copy of a shared last block that the last token
        goes into. Returns the (src, dst) block copy the runner must do before writing, or None."""
        table, bs = seq.block_table, self.block_size
        assert len(table) >= -(-(seq.num_tokens - 1) // bs), "append_slot called twice for a token?"
        copy = None
        if seq.num_tokens <= len(table) * bs and self.ref_counts[table[-1]] > 1:
            last = table[-1]
            table[-1] = self._take()
            self.ref_counts[last] -= 1
            copy = last, table[-1]
        while len(table) * bs < seq.num_tokens + lookahead:
            table.append(self._take())
        return copy

    def truncate(self, seq: Sequence) -> None:
        """Free the blocks past `seq`'s computed tokens (rejected speculative positions); they
        were never full of computed KV, so none is in the prefix cache."""
        keep = -(-seq.num_computed_tokens // self.block_size)
        for block in reversed(seq.block_table[keep:]):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self._free[block] = None
                if self._hash[block] is None:
                    self._free.move_to_end(block, last=False)
        del seq.block_table[keep:]

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Let `child` share all of `parent`'s blocks (parallel sampling)."""
        for block in parent.block_table:
            self.ref_counts[block] += 1
        child.block_table = list(parent.block_table)
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_cached_tokens = parent.num_cached_tokens

    def free(self, seq: Sequence) -> None:
        """Drop `seq`'s references; its KV is gone (num_computed_tokens = 0)."""
        for block in reversed(seq.block_table):  # tail blocks are evicted before the shared prefix
            if self.ref_counts[block] <= 0:
                raise RuntimeError(f"block {block} released more often than it was taken")
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self._free[block] = None
                if self._hash[block] is None:
                    self._free.move_to_end(block, last=False)
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.kv_resets += 1

    def cache_computed(self, seq: Sequence) -> None:
        """Register the full blocks of `seq` whose KV is now computed, so later requests hit them."""
        if not self.enable_prefix_caching:
            return
        bs, table = self.block_size, seq.block_table
        end = start = min(seq.num_computed_tokens // bs, len(table))
        while start > 0 and self._hash[table[start - 1]] is None:  # hashed blocks form a prefix
            start -= 1
        if start == end:
            return
        tokens, h = seq.token_ids, self._hash[table[start - 1]] if start else None
        for i in range(start, end):
            block, block_tokens = table[i], tuple(tokens[i * bs : (i + 1) * bs])
            h = hash((h, block_tokens))
            self._hash[block], self._tokens[block] = h, block_tokens
            self._cached.setdefault(h, block)

    def assert_consistent(self, seqs: Iterable[Sequence]) -> None:
        """Raise AssertionError unless ref counts match the block tables of `seqs` (all live
        sequences) and no block is both free and referenced. For tests and debugging."""
        counts = [0] * self.num_blocks
        for seq in seqs:
            for block in seq.block_table:
                counts[block] += 1
        assert counts == self.ref_counts, "ref counts do not match the block tables"
        assert set(self._free) == {b for b, n in enumerate(counts) if n == 0}, "free list != unreferenced blocks"
        assert all(self._hash[b] == h for h, b in self._cached.items()), "prefix-cache index is stale"

    def _lookup(self, seq: Sequence) -> list[int]:
        # Cached blocks matching seq's leading full blocks, never the block holding its last
        # token: that token must be computed to produce logits.
        if not self.enable_prefix_caching:
            return []
        bs, tokens, hits, h = self.block_size, seq.token_ids, [], None
        for i in range((len(tokens) - 1) // bs):
            block_tokens = tuple(tokens[i * bs : (i + 1) * bs])
            h = hash((h, block_tokens))
            block = self._cached.get(h)
            if block is None or self._tokens[block] != block_tokens:
                break
            hits.append(block)
        return hits

    def _blocks_to_take(self, seq: Sequence, hits: list[int]) -> int:
        reused_free = sum(1 for b in hits if self.ref_counts[b] == 0)
        return seq.num_blocks_needed(self.block_size) - len(hits) + reused_free

    def _blocks_to_append(self, seq: Sequence, lookahead: int) -> int:
        table, bs = seq.block_table, self.block_size
        copy = seq.num_tokens <= len(table) * bs and self.ref_counts[table[-1]] > 1
        return max(0, -(-(seq.num_tokens + lookahead) // bs) - len(table)) + copy

    def _take(self) -> int:
        if not self._free:
            raise RuntimeError("out of KV blocks; ask can_allocate / can_append first")
        block, _ = self._free.popitem(last=False)
        h = self._hash[block]
        if h is not None:  # evict it from the prefix cache
            if self._cached.get(h) == block:
                del self._cached[h]
            self._hash[block] = self._tokens[block] = None
        self.ref_counts[block] = 1
        return block
