"""Block manager and sequence bookkeeping: ref counts, prefix caching, copy-on-write. No torch."""

import random

import pytest

from quantkit.errors import QuantkitError
from quantkit.runtime.block_manager import BlockManager
from quantkit.runtime.sequence import SamplingParams, Sequence, SequenceStatus


def computed(bm: BlockManager, seq: Sequence) -> Sequence:
    """Pretend the runner computed every token of seq, as the scheduler's postprocess records it."""
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_computed(seq)
    return seq


def allocated(bm: BlockManager, seq_id: int, tokens: list[int]) -> Sequence:
    seq = Sequence(seq_id, tokens)
    assert bm.can_allocate(seq)
    bm.allocate(seq)
    return seq


def test_sequence_properties():
    seq = Sequence(0, [5, 6, 7], SamplingParams(max_tokens=4))
    assert (seq.num_tokens, seq.last_token, seq.status, seq.is_finished) == (3, 7, SequenceStatus.WAITING, False)
    seq.output_token_ids += [8, 9]
    assert seq.token_ids == [5, 6, 7, 8, 9] and seq.last_token == 9 and seq.num_prompt_tokens == 3
    assert [seq.num_blocks_needed(b) for b in (1, 2, 5, 16)] == [5, 3, 1, 1]
    assert Sequence(1, [1]).arrival > seq.arrival
    with pytest.raises(QuantkitError, match="empty prompt"):
        Sequence(2, [])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_tokens": 0}, "max_tokens must be at least 1, got 0."),
        ({"max_tokens": 2.5}, "max_tokens must be at least 1"),
        ({"temperature": -0.1}, "temperature must be a number >= 0"),
        ({"temperature": float("nan")}, "temperature must be a number >= 0"),
        ({"top_k": -1}, "top_k must be an integer >= 0"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ({"seed": "x"}, "seed must be an integer or None"),
        ({"logprobs": -1}, "logprobs must be None or an integer >= 0"),
        ({"priority": 1.5}, "priority must be an integer"),
        ({"stop": ("ok", "")}, "stop must hold non-empty strings"),
        ({"stop_token_ids": (3, -1)}, "stop_token_ids must hold token ids"),
    ],
)
def test_sampling_params_validation(kwargs, message):
    with pytest.raises(QuantkitError, match=message):
        SamplingParams(**kwargs)


def test_sampling_params_defaults_and_normalisation():
    p = SamplingParams()
    assert (p.max_tokens, p.temperature, p.top_k, p.top_p) == (16, 1.0, 0, 1.0)
    assert (p.seed, p.logprobs, p.priority, p.ignore_eos) == (None, None, 0, False)
    assert SamplingParams(stop="\n").stop == ("\n",)
    assert SamplingParams(stop=["a", "b"], stop_token_ids=[2]).stop_token_ids == (2,)
    assert not hasattr(p, "__dict__")  # slots


def test_allocate_slots_and_free_without_leaks():
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = allocated(bm, 0, list(range(10)))  # 3 blocks
    assert len(seq.block_table) == 3 and bm.num_free_blocks == 5 and bm.usage == pytest.approx(3 / 8)
    assert [bm.slot(seq, p) for p in (0, 3, 4, 9)] == [
        seq.block_table[0] * 4,
        seq.block_table[0] * 4 + 3,
        seq.block_table[1] * 4,
        seq.block_table[2] * 4 + 1,
    ]
    assert not bm.can_allocate(Sequence(1, list(range(100, 124))))  # 6 blocks > 5 free
    with pytest.raises(RuntimeError, match="not enough free KV blocks"):
        bm.allocate(Sequence(1, list(range(100, 124))))
    bm.assert_consistent([seq])
    bm.free(seq)
    assert bm.num_free_blocks == 8 and all(n == 0 for n in bm.ref_counts) and seq.block_table == []
    with pytest.raises(RuntimeError, match="released more often"):
        seq.block_table = [0]
        bm.free(seq)


def test_append_slot_grows_by_one_block_when_full():
    bm = BlockManager(num_blocks=4, block_size=4)
    seq = computed(bm, allocated(bm, 0, [1, 2, 3, 4]))
    seq.output_token_ids.append(5)  # token 4 lands in a new block
    assert bm.can_append(seq) and bm.append_slot(seq) is None and len(seq.block_table) == 2
    seq.output_token_ids.append(6)  # fits in block 2
    assert bm.append_slot(seq) is None and len(seq.block_table) == 2 and bm.num_free_blocks == 2
    other = allocated(bm, 1, list(range(8)))  # takes the last two blocks
    seq.output_token_ids += [7, 8, 9]
    assert not bm.can_append(seq)
    bm.free(other)
    bm.free(seq)
    assert bm.num_free_blocks == 4


def test_prefix_cache_hit_on_shared_40_token_prefix():
    bm = BlockManager(num_blocks=32, block_size=16)
    prefix = list(range(1000, 1040))
    first = computed(bm, allocated(bm, 0, prefix + [1] * 10))
    assert first.num_cached_tokens == 0 and bm.prefix_cache_hits == 0
    second = allocated(bm, 1, prefix + [2] * 10)
    assert second.num_cached_tokens == 32 and bm.prefix_cache_hits == 32  # tokens, 2 full blocks
    assert second.block_table[:2] == first.block_table[:2] and second.block_table[2] != first.block_table[2]
    assert [bm.ref_counts[b] for b in second.block_table] == [2, 2, 1, 1]
    assert bm.prefix_cache_queries == 100
    bm.assert_consistent([first, second])
    bm.free(first)
    bm.free(second)
    assert bm.num_free_blocks == 32 and all(n == 0 for n in bm.ref_counts)


def test_last_prompt_token_is_never_cached():
    bm = BlockManager(num_blocks=16, block_size=16)
    a = computed(bm, allocated(bm, 0, list(range(32))))  # exactly two full blocks, both registered
    b = allocated(bm, 1, list(range(32)))
    assert b.num_cached_tokens == 16  # block 2 holds the last token: recomputed, in a block of its own
    assert b.block_table[0] == a.block_table[0] and b.block_table[1] != a.block_table[1]
    c = allocated(bm, 2, list(range(33)))
    assert c.num_cached_tokens == 32 and c.num_cached_tokens < c.num_tokens
    d = allocated(bm, 3, list(range(16)))
    assert d.num_cached_tokens == 0


def test_blocks_are_registered_only_once_computed():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = allocated(bm, 0, list(range(20)))
    a.num_computed_tokens = 6  # a chunked prefill: only block 0 is complete
    bm.cache_computed(a)
    assert allocated(bm, 1, list(range(20))).num_cached_tokens == 4
    computed(bm, a)
    assert allocated(bm, 2, list(range(20))).num_cached_tokens == 16


def test_freed_blocks_hit_until_reused():
    bm = BlockManager(num_blocks=6, block_size=4)
    a = computed(bm, allocated(bm, 0, list(range(9))))  # 3 blocks, 2 full ones registered
    a_table = list(a.block_table)
    bm.free(a)
    assert bm.num_free_blocks == 6
    b = allocated(bm, 1, list(range(9)))
    assert b.num_cached_tokens == 8 and b.block_table[:2] == a_table[:2]
    bm.free(b)
    hits = bm.prefix_cache_hits
    filler = allocated(bm, 2, list(range(100, 124)))  # all 6 blocks: evicts the cached ones
    bm.free(filler)
    c = allocated(bm, 3, list(range(9)))
    assert c.num_cached_tokens == 0 and bm.prefix_cache_hits == hits
    bm.free(c)
    assert bm.num_free_blocks == 6


def test_unhashed_free_blocks_are_reused_before_cached_ones():
    bm = BlockManager(num_blocks=6, block_size=4)
    a = computed(bm, allocated(bm, 0, list(range(9))))  # blocks 0, 1 hashed, block 2 partial
    hashed = set(a.block_table[:2])
    bm.free(a)
    b = allocated(bm, 1, list(range(50, 62)))  # 3 fresh blocks: never-hashed ones go first
    assert hashed.isdisjoint(b.block_table)
    c = allocated(bm, 2, list(range(9)))
    assert c.num_cached_tokens == 8 and set(c.block_table[:2]) == hashed


def test_prefix_caching_off():
    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=False)
    computed(bm, allocated(bm, 0, list(range(20))))
    assert allocated(bm, 1, list(range(20))).num_cached_tokens == 0 and bm.prefix_cache_hits == 0


def test_copy_on_write_when_shared_last_block_is_appended_to():
    bm = BlockManager(num_blocks=8, block_size=4)
    parent = computed(bm, allocated(bm, 0, list(range(6))))  # block 0 full, block 1 holds 2 tokens
    child = Sequence(1, parent.prompt_token_ids)
    bm.fork(parent, child)
    assert [bm.ref_counts[b] for b in parent.block_table] == [2, 2]
    child.output_token_ids.append(99)
    src = parent.block_table[1]
    copy = bm.append_slot(child)
    assert copy == (src, child.block_table[1]) and child.block_table[1] != src
    assert child.block_table[0] == parent.block_table[0]
    assert [bm.ref_counts[b] for b in child.block_table] == [2, 1] and bm.ref_counts[src] == 1
    parent.output_token_ids.append(42)
    assert bm.append_slot(parent) is None  # its last block is private again
    bm.assert_consistent([parent, child])
    bm.free(parent)
    bm.free(child)
    assert bm.num_free_blocks == 8


def test_fork_on_full_last_block_needs_no_copy():
    bm = BlockManager(num_blocks=8, block_size=4)
    parent = computed(bm, allocated(bm, 0, list(range(8))))
    child = Sequence(1, parent.prompt_token_ids)
    bm.fork(parent, child)
    for seq in (parent, child):
        seq.output_token_ids.append(7)
        assert bm.append_slot(seq) is None
    assert parent.block_table[2] != child.block_table[2]
    bm.assert_consistent([parent, child])


@pytest.mark.parametrize("seed", range(5))
def test_random_operations_keep_ref_counts_consistent(seed):
    rng = random.Random(seed)
    bm = BlockManager(num_blocks=24, block_size=4)
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(1, 14))] for _ in range(3)]
    live: list[Sequence] = []
    for step in range(300):
        op = rng.random()
        if op < 0.3:
            seq = Sequence(step, rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(0, 6))])
            if bm.can_allocate(seq):
                bm.allocate(seq)
                seq.num_computed_tokens = seq.num_cached_tokens
                live.append(seq)
        elif op < 0.45 and live:
            parent = rng.choice(live)
            if parent.num_computed_tokens == parent.num_tokens:
                child = Sequence(1000 + step, parent.prompt_token_ids, output_token_ids=list(parent.output_token_ids))
                bm.fork(parent, child)
                live.append(child)
        elif op < 0.75 and live:  # compute the rest, then append one token
            seq = rng.choice(live)
            computed(bm, seq)
            seq.output_token_ids.append(rng.randrange(50))
            if bm.can_append(seq):
                bm.append_slot(seq)
            else:
                seq.output_token_ids.pop()
        elif live:
            bm.free(live.pop(rng.randrange(len(live))))
        assert all(n >= 0 for n in bm.ref_counts)
        bm.assert_consistent(live)
    for seq in live:
        bm.free(seq)
    assert bm.num_free_blocks == 24 and all(n == 0 for n in bm.ref_counts)
