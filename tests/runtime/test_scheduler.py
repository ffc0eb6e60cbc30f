"""Scheduler: continuous batching, preemption, chunked prefill, priorities, KV waste. No torch.

A fake model stands in for the runner: it writes every computed token into a simulated
KV cache at the slot the block manager hands out, and samples sum(tokens read back from
the cache through the block table) % 97. Wrong bookkeeping (a bad prefix hit, a missing
copy-on-write, a block reused while referenced) changes its outputs."""

import random

import pytest

from quantkit.errors import QuantkitError
from quantkit.runtime.block_manager import BlockManager
from quantkit.runtime.scheduler import Scheduler, SchedulerOutput
from quantkit.runtime.sequence import SamplingParams, Sequence, SequenceStatus

MOD = 97
EOS = 0


class FakeRunner:
    def __init__(self, bm: BlockManager):
        self.bm, self.kv = bm, {}  # slot -> (position, token)

    def step(self, out: SchedulerOutput) -> list[int]:
        bs = self.bm.block_size
        for src, dst in out.copies:
            for o in range(bs):
                self.kv[dst * bs + o] = self.kv.get(src * bs + o)
        for seq, n in out.prefill + [(s, 1) for s in out.decode]:
            tokens = seq.token_ids
            for pos in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
                self.kv[self.bm.slot(seq, pos)] = (pos, tokens[pos])
        sampled = []
        for seq in out.sampled:
            context = [self.kv.get(self.bm.slot(seq, p)) for p in range(seq.num_tokens)]
            assert all(e is not None and e[0] == p for p, e in enumerate(context)), f"bad KV for {seq.seq_id}"
            sampled.append(sum(t for _, t in context) % MOD)
        return sampled


def reference(prompt: list[int], params: SamplingParams, eos: int | None = EOS) -> list[int]:
    tokens, out = list(prompt), []
    while len(out) < params.max_tokens:
        out.append(sum(tokens) % MOD)
        tokens.append(out[-1])
        if out[-1] in params.stop_token_ids or (out[-1] == eos and not params.ignore_eos):
            break
    return out


def run(sched: Scheduler, runner: FakeRunner | None = None, max_steps: int = 10_000) -> list[SchedulerOutput]:
    runner, outputs = runner or FakeRunner(sched.block_manager), []
    while sched.has_unfinished:
        assert len(outputs) < max_steps, "scheduler made no progress"
        out = sched.schedule()
        sched.postprocess(out, runner.step(out))
        sched.block_manager.assert_consistent(sched.running + sched.waiting)
        outputs.append(out)
    return outputs


def workload(seed: int, n: int, block_size: int) -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(seed)
    shared = [rng.randrange(1, MOD) for _ in range(2 * block_size + 3)]
    return [
        (
            (shared if i % 3 == 0 else []) + [rng.randrange(1, MOD) for _ in range(rng.randint(3, 12))],
            SamplingParams(max_tokens=rng.randint(5, 20)),
        )
        for i in range(n)
    ]


def assert_all_free(bm: BlockManager):
    assert bm.num_free_blocks == bm.num_blocks and all(n == 0 for n in bm.ref_counts)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preemption_and_resume_do_not_change_outputs(prefix_caching):
    requests = workload(0, 10, block_size=4)
    results = {}
    for num_blocks in (14, 1000):
        bm = BlockManager(num_blocks, block_size=4, enable_prefix_caching=prefix_caching)
        sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=32, eos_token_id=EOS)
        seqs = [Sequence(i, p, params) for i, (p, params) in enumerate(requests)]
        for seq in seqs:
            sched.add(seq)
        run(sched)
        assert_all_free(bm)
        assert all(s.is_finished and s.finish_reason in ("stop", "length") for s in seqs)
        results[num_blocks] = ([s.output_token_ids for s in seqs], sched.num_preemptions)
    (tiny, preemptions), (big, none) = results[14], results[1000]
    assert preemptions > 0 and none == 0
    assert tiny == big == [reference(p, params) for p, params in requests]


def test_newest_running_sequence_is_preempted_and_resumed():
    bm = BlockManager(num_blocks=5, block_size=4)
    sched = Scheduler(bm, eos_token_id=None)
    old = Sequence(0, [1, 2, 3, 4], SamplingParams(max_tokens=12))
    new = Sequence(1, [5, 6, 7, 8], SamplingParams(max_tokens=12))
    sched.add(old)
    sched.add(new)
    runner = FakeRunner(bm)
    while True:
        out = sched.schedule()
        if out.preempted:
            break
        sched.postprocess(out, runner.step(out))
    assert out.preempted == [new] and out.decode == [old] and not out.prefill  # nothing admitted this step
    assert sched.waiting == [new] and new.status is SequenceStatus.WAITING and new.block_table == []
    assert new.num_computed_tokens == 0 and len(new.output_token_ids) == 5  # generated tokens are kept
    assert sched.num_preemptions == 1
    sched.postprocess(out, runner.step(out))
    run(sched, runner)
    assert new.num_cached_tokens == 4  # its first block was still in the prefix cache
    assert old.output_token_ids == reference(old.prompt_token_ids, old.params, None)
    assert new.output_token_ids == reference(new.prompt_token_ids, new.params, None)
    assert_all_free(bm)


def test_priority_then_arrival_order():
    bm = BlockManager(num_blocks=64, block_size=4)
    sched = Scheduler(bm, max_num_seqs=1, eos_token_id=None)
    a, b, c = (Sequence(i, [i + 1] * 5, SamplingParams(max_tokens=2, priority=p)) for i, p in enumerate((0, 0, -1)))
    for seq in (a, b, c):
        sched.add(seq)
    order, runner = [], FakeRunner(bm)
    while sched.has_unfinished:
        out = sched.schedule()
        order += [s.seq_id for s, _ in out.prefill]
        sched.postprocess(out, runner.step(out))
    assert order == [2, 0, 1]  # c (priority -1) first although it came last; then first come first served


def test_chunked_prefill_splits_a_long_prompt():
    bm = BlockManager(num_blocks=128, block_size=16)
    sched = Scheduler(bm, max_num_batched_tokens=256, eos_token_id=None)
    prompt = [(7 * i) % MOD for i in range(1000)]
    seq = Sequence(0, prompt, SamplingParams(max_tokens=3))
    sched.add(seq)
    outputs = run(sched)
    assert [out.prefill[0][1] for out in outputs if out.prefill] == [256, 256, 256, 232]
    assert [len(out.sampled) for out in outputs] == [0, 0, 0, 1, 1, 1]
    assert len(seq.block_table) == 0 and seq.output_token_ids == reference(prompt, seq.params, None)


def test_chunked_prefill_shares_the_step_with_decodes_and_chunk_size():
    bm = BlockManager(num_blocks=256, block_size=16)
    sched = Scheduler(bm, max_num_batched_tokens=256, chunk_size=100, eos_token_id=None)
    short = Sequence(0, [3] * 10, SamplingParams(max_tokens=50))
    sched.add(short)
    runner = FakeRunner(bm)
    out = sched.schedule()
    sched.postprocess(out, runner.step(out))
    long = Sequence(1, [5] * 1000, SamplingParams(max_tokens=2))
    sched.add(long)
    out = sched.schedule()  # prefill and decode mixed in one step
    assert out.decode == [short] and out.prefill == [(long, 100)] and out.num_batched_tokens == 101
    sched.postprocess(out, runner.step(out))
    sched.chunk_size = None
    out = sched.schedule()
    assert out.decode == [short] and out.prefill == [(long, 255)]  # the decode comes out of the budget first


def test_prefix_cache_hit_through_the_scheduler():
    bm = BlockManager(num_blocks=64, block_size=16)
    sched = Scheduler(bm, eos_token_id=None)
    prefix = [(3 * i + 1) % MOD for i in range(40)]
    first = Sequence(0, prefix + [1] * 10, SamplingParams(max_tokens=4))
    sched.add(first)
    runner = FakeRunner(bm)
    run(sched, runner)
    second = Sequence(1, prefix + [2] * 10, SamplingParams(max_tokens=4))
    sched.add(second)
    out = sched.schedule()
    assert out.prefill == [(second, 18)] and second.num_cached_tokens == 32 and bm.prefix_cache_hits == 32
    sched.postprocess(out, runner.step(out))
    run(sched, runner)
    assert second.output_token_ids == reference(second.prompt_token_ids, second.params, None)
    assert_all_free(bm)


def test_fork_copies_the_shared_last_block_on_write():
    bm = BlockManager(num_blocks=32, block_size=4)
    sched = Scheduler(bm, eos_token_id=None)
    parent = Sequence(0, [1, 2, 3, 4, 5, 6], SamplingParams(max_tokens=8))
    sched.add(parent)
    runner = FakeRunner(bm)
    out = sched.schedule()
    with pytest.raises(ValueError, match="only while decoding"):
        sched.fork(parent, seq_id=1)  # its prompt is not computed yet
    sched.postprocess(out, runner.step(out))
    child = sched.fork(parent, seq_id=1)
    assert child.block_table == parent.block_table and child.output_token_ids == parent.output_token_ids
    out = sched.schedule()
    assert len(out.copies) == 1 and out.decode == [parent, child]
    sched.postprocess(out, runner.step(out))
    assert parent.block_table[0] == child.block_table[0] and parent.block_table[1] != child.block_table[1]
    while sched.has_unfinished:
        out = sched.schedule()
        sched.postprocess(out, runner.step(out))
    assert parent.output_token_ids == child.output_token_ids == reference(parent.prompt_token_ids, parent.params, None)
    assert_all_free(bm)


def test_stop_conditions_and_finish():
    bm = BlockManager(num_blocks=64, block_size=4)
    sched = Scheduler(bm, eos_token_id=[EOS, 96])
    seqs = [
        Sequence(0, [1, 2], SamplingParams(max_tokens=5)),
        Sequence(1, [3], SamplingParams(max_tokens=5, stop_token_ids=(42,))),
        Sequence(2, [4], SamplingParams(max_tokens=5, ignore_eos=True)),
        Sequence(3, [5], SamplingParams(max_tokens=5)),
    ]
    for seq in seqs:
        sched.add(seq)
    out = sched.schedule()
    finished = sched.postprocess(out, [EOS, 42, EOS, 96])
    assert finished == seqs[:2] + seqs[3:] and [s.finish_reason for s in finished] == ["stop"] * 3
    assert seqs[2].status is SequenceStatus.RUNNING
    sched.finish(seqs[2], "stop")  # what the engine does when a stop string matches
    assert seqs[2].finish_reason == "stop" and not sched.has_unfinished
    with pytest.raises(ValueError, match="finish reason"):
        sched.finish(seqs[2], "done")
    with pytest.raises(ValueError, match="expected 0 sampled tokens"):
        sched.postprocess(sched.schedule(), [1])
    assert_all_free(bm)


def test_abort_waiting_running_and_mid_step():
    bm = BlockManager(num_blocks=16, block_size=4)
    sched = Scheduler(bm, max_num_seqs=2, eos_token_id=None)
    seqs = [Sequence(i, [i + 1] * 6, SamplingParams(max_tokens=10)) for i in range(3)]
    for seq in seqs:
        sched.add(seq)
    runner = FakeRunner(bm)
    out = sched.schedule()
    sched.postprocess(out, runner.step(out))
    assert sched.abort(2) is seqs[2] and seqs[2].finish_reason == "abort"  # still waiting
    assert sched.abort(0) is seqs[0] and seqs[0].block_table == []  # running
    assert sched.abort(0) is None
    out = sched.schedule()
    tokens = runner.step(out)
    sched.abort(1)  # arrives while the step runs
    before = list(seqs[1].output_token_ids)
    assert sched.postprocess(out, tokens) == [] and seqs[1].output_token_ids == before
    assert not sched.has_unfinished and (len(sched.waiting), len(sched.running)) == (0, 0)
    assert_all_free(bm)


def test_scheduler_rejects_what_can_never_fit():
    sched = Scheduler(BlockManager(num_blocks=4, block_size=4))
    with pytest.raises(QuantkitError, match="needs 5 KV blocks"):
        sched.add(Sequence(0, [1] * 10, SamplingParams(max_tokens=11)))
    sched.add(Sequence(1, [1] * 10, SamplingParams(max_tokens=7)))  # 16 tokens with KV: exactly 4 blocks
    with pytest.raises(QuantkitError, match="max_num_seqs must be at least 1, got 0."):
        Scheduler(BlockManager(4), max_num_seqs=0)


@pytest.mark.parametrize("seed", range(8))
def test_random_add_step_abort_finish_keeps_invariants(seed):
    rng = random.Random(seed)
    bm = BlockManager(rng.choice([12, 20, 48]), block_size=4, enable_prefix_caching=seed % 4 != 3)
    sched = Scheduler(
        bm,
        max_num_seqs=rng.choice([2, 4, 8]),
        max_num_batched_tokens=rng.choice([8, 16, 64]),
        chunk_size=rng.choice([None, 5]),
        eos_token_id=EOS,
    )
    runner, prefixes = FakeRunner(bm), [[rng.randrange(1, MOD) for _ in range(rng.randint(4, 10))] for _ in range(3)]
    seqs, cut_short, next_id = [], set(), 0
    for step in range(1500):
        adding = step < 250
        if adding and rng.random() < 0.3:
            prompt = rng.choice(prefixes) + [rng.randrange(1, MOD) for _ in range(rng.randint(0, 5))]
            params = SamplingParams(max_tokens=rng.randint(1, 12), priority=rng.randint(0, 1))
            seqs.append(Sequence(next_id, prompt, params))
            sched.add(seqs[-1])
            next_id += 1
        live = sched.running + sched.waiting
        if live and rng.random() < 0.04:
            cut_short.add(sched.abort(rng.choice(live).seq_id).seq_id)
        elif sched.running and rng.random() < 0.04:
            seq = rng.choice(sched.running)
            sched.finish(seq, "stop")
            cut_short.add(seq.seq_id)
        elif adding and sched.running and rng.random() < 0.05 and len(sched.running) < sched.max_num_seqs:
            parent = rng.choice(sched.running)
            if parent.num_tokens - parent.num_computed_tokens == 1:
                seqs.append(sched.fork(parent, next_id))
                next_id += 1
        out = sched.schedule()
        sched.postprocess(out, runner.step(out))
        assert all(n >= 0 for n in bm.ref_counts)
        bm.assert_consistent(sched.running + sched.waiting)
        assert all(not s.block_table for s in sched.waiting)
        if not adding and (not sched.has_unfinished or seed % 2):  # odd seeds abort whatever is left
            for seq in sched.running + sched.waiting:
                cut_short.add(sched.abort(seq.seq_id).seq_id)
            break
    assert not sched.has_unfinished and all(s.is_finished for s in seqs)
    assert_all_free(bm)
    for seq in seqs:
        expected = reference(seq.prompt_token_ids, seq.params)
        if seq.seq_id in cut_short:
            assert seq.output_token_ids == expected[: len(seq.output_token_ids)]
        else:
            assert seq.output_token_ids == expected


@pytest.mark.parametrize("num_blocks", [2048, 1024])  # 1024: the pool runs short and sequences get preempted
def test_kv_memory_waste_under_4_percent(num_blocks, capsys):
    rng = random.Random(0)
    bm = BlockManager(num_blocks=num_blocks, block_size=16)
    sched = Scheduler(bm, max_num_seqs=64, max_num_batched_tokens=2048)
    for i in range(200):
        prompt = [rng.randrange(1, 32000) for _ in range(rng.randint(32, 512))]
        sched.add(Sequence(i, prompt, SamplingParams(max_tokens=rng.randint(16, 256), ignore_eos=True)))
    ratios, slots_total, tokens_total = [], 0, 0
    while sched.has_unfinished:
        out = sched.schedule()
        slots = (bm.num_blocks - bm.num_free_blocks) * bm.block_size  # physical slots referenced by a sequence
        tokens = sum(s.num_tokens for s in sched.running)
        ratios.append(1 - tokens / slots)
        slots_total, tokens_total = slots_total + slots, tokens_total + tokens
        sched.postprocess(out, [7] * len(out.sampled))
    waste = sum(ratios) / len(ratios)
    with capsys.disabled():
        print(
            f"\nKV waste, {num_blocks} blocks: mean over {len(ratios)} steps {waste:.2%}, "
            f"slot-weighted {1 - tokens_total / slots_total:.2%}, max {max(ratios):.2%}, "
            f"preemptions {sched.num_preemptions}"
        )
    assert waste < 0.04
    assert_all_free(bm)
