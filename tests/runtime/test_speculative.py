"""Speculative decoding: config validation, the n-gram proposer, greedy outputs identical to
non-speculative ones (alone, a batch of 16, preemption, prefix caching, stops), and the
rejection-sampling rule keeping the target's distribution (chi-square)."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from quantkit.errors import QuantkitError
from quantkit.runtime.engine import LLM
from quantkit.runtime.sequence import SamplingParams
from quantkit.runtime.speculative import (
    AdaptiveK,
    SpecStats,
    ngram_propose,
    parse_speculative_config,
    verify_greedy,
    verify_sampled,
)

torch.set_num_threads(1)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
P_VALUE = 1e-3  # a chi-square test fails below this; the seeds are fixed, so the test is deterministic


@pytest.mark.parametrize(
    "config, message",
    [
        ("{not json", "not valid JSON"),
        ([1], "must be a JSON object"),
        ({"method": "eagle", "num_speculative_tokens": 2}, "method must be one of"),
        ({"method": "ngram"}, "needs num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be an integer >= 1"),
        ({**NGRAM, "prompt_lookup_min": 5}, "exceeds prompt_lookup_max"),
        ({**NGRAM, "typo": 1}, "unknown keys"),
        ({**NGRAM, "model": "smollm2-135m"}, "takes no model"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "needs a draft model"),
        ({**NGRAM, "adaptive": "yes"}, "adaptive must be true or false"),
    ],
)
def test_config_validation(config, message):
    with pytest.raises(QuantkitError, match=message):
        parse_speculative_config(config)


def test_config_parses_vllm_shapes():
    c = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 3}')
    assert (c.method, c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max) == ("ngram", 3, 2, 4)
    d = parse_speculative_config({"model": "out/int4", "num_speculative_tokens": 4})
    assert (d.method, d.model) == ("draft_model", "out/int4")
    assert parse_speculative_config(None) is None


def test_ngram_proposes_what_followed_the_longest_recent_match():
    tokens = [1, 2, 3, 9, 9, 1, 2, 3, 4, 5, 7, 1, 2, 3]
    assert ngram_propose(tokens, 3, 2, 4) == [4, 5, 7]  # "1 2 3" last seen before 4 5 7
    assert ngram_propose(tokens, 10, 2, 4) == [4, 5, 7, 1, 2, 3]  # runs up to the end
    assert ngram_propose([1, 2, 3, 4], 3, 2, 4) == []  # nothing recurs
    assert ngram_propose([5, 6, 0, 6], 2, 1, 2) == [0, 6]  # falls back to a 1-gram


def test_verify_greedy_and_adaptive_k():
    assert verify_greedy([4, 5, 6, 7], [4, 5, 9]) == [4, 5, 6]
    assert verify_greedy([4, 5, 6, 7], [4, 5, 6]) == [4, 5, 6, 7]
    assert verify_greedy([8], []) == [8]
    k = AdaptiveK(2, 4)
    k.update(2, 2)
    assert k.k == 3
    for _ in range(5):
        k.update(3, 0)
    assert k.next_k() == 0 and k.k == 1  # acceptance collapsed: paused, restarts at one draft
    s = SpecStats()
    s.record(4, 2)
    s.record(2, 2)
    assert (s.accepted_per_pos, s.acceptance_rate, s.mean_accepted_length) == ([2, 2, 0, 0], 4 / 6, 3.0)


def _chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of observed `counts` against `probs`; bins expecting fewer than 5 are pooled."""
    expected = probs.double() * counts.sum()
    small = expected < 5
    obs = torch.cat([counts[~small].double(), counts[small].double().sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = exp > 0
    stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    from conftest import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("models") / "vocab16", vocab_size=16)


def test_rejection_rule_keeps_the_target_distribution(small_vocab):
    """Leviathan et al.'s rule on a tiny random model's distributions: the first token follows
    p_0 and, given the first draft was accepted, the second follows p_1; with a point-mass
    proposal and with a proposal distribution q."""
    model = AutoModelForCausalLM.from_pretrained(small_vocab).eval()
    with torch.no_grad():
        p = torch.softmax(model(torch.tensor([[3, 7, 1, 12, 5]])).logits[0, -3:] / 0.7, -1)  # [3, 16]
    q = torch.softmax(torch.randn(2, 16, generator=torch.Generator().manual_seed(1)), -1)
    fixed = [int(p[0].argsort()[10]), 4]  # a middling first draft: many rejections, residual samples
    for proposal in (None, q):
        g, first, second = torch.Generator().manual_seed(0), torch.zeros(16), torch.zeros(16)
        for _ in range(20000):
            # a proposal distribution's drafts are drawn from it; a point mass always gives `fixed`
            drafts = fixed if proposal is None else [int(torch.multinomial(r, 1, generator=g)) for r in q]
            out = verify_sampled(p, drafts, proposal, g)
            first[out[0]] += 1
            if out[0] == drafts[0]:
                second[out[1]] += 1
        assert _chi_square_p(first, p[0]) > P_VALUE
        assert second.sum() > 100 and _chi_square_p(second, p[1]) > P_VALUE


@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_engine_sampling_keeps_the_target_distribution(small_vocab, tmp_path, proposer):
    """End to end: 2000 seeded requests whose 2nd and 3rd tokens go through verify steps (n-gram,
    or another random model of the same vocabulary as the draft); the marginal of each against
    the target's exact one (summed over the earlier tokens)."""
    from conftest import make_tiny_model

    prompt = list(range(16)) * 2  # every token recurs: the 1-gram lookup always proposes
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "disable_by_batch_size": 10000}
    if proposer == "draft":
        draft = make_tiny_model(tmp_path / "draft", vocab_size=16, seed=1)
        spec = {"model": str(draft), "num_speculative_tokens": 3, "disable_by_batch_size": 10000}
    llm = LLM(str(small_vocab), block_size=16, num_blocks=512, max_num_seqs=256, speculative_config=spec)
    params = [SamplingParams(max_tokens=3, temperature=1.0, seed=i, ignore_eos=True) for i in range(2000)]
    outs = [o.token_ids for o in llm.generate([prompt] * 2000, params)]
    assert llm.speculator.stats.num_drafts > 1000 and llm.speculator.stats.num_accepted_tokens > 0
    model = AutoModelForCausalLM.from_pretrained(small_vocab).eval()
    with torch.no_grad():
        p1 = torch.softmax(model(torch.tensor([prompt])).logits[0, -1].double(), -1)  # [16]
        two = torch.tensor([prompt + [a] for a in range(16)])
        p2 = torch.softmax(model(two).logits[:, -1].double(), -1)  # [16 (t1), 16]
        three = torch.tensor([prompt + [a, b] for a in range(16) for b in range(16)])
        p3 = torch.softmax(model(three).logits[:, -1].double(), -1).view(16, 16, 16)
    marginal2 = p1 @ p2
    marginal3 = torch.einsum("a,ab,abc->c", p1, p2, p3)
    for position, want in ((1, marginal2), (2, marginal3)):
        counts = torch.bincount(torch.tensor([o[position] for o in outs]), minlength=16).float()
        assert _chi_square_p(counts, want) > P_VALUE


def _repetitive_prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    prompts = []
    for i in range(n):
        motif = torch.randint(3, 300, (2 + i % 5,), generator=g).tolist()
        prompts.append((motif * 20)[: 3 + (7 * i) % 45] + torch.randint(3, 300, (i % 4,), generator=g).tolist())
    return prompts


@pytest.fixture(scope="module")
def int4_draft(tiny_llama, tmp_path_factory):
    from quantkit.pipeline.quantize import quantize
    from quantkit.scheme import preset

    path = tmp_path_factory.mktemp("draft") / "int4"
    quantize(str(tiny_llama), preset("w4a16-asym").with_group_size(32), path)
    return path


@pytest.mark.parametrize("num_blocks", [128, 9])  # 9: preemption forced
@pytest.mark.parametrize("proposer", ["ngram", "self-draft", "int4-draft"])
def test_greedy_equals_non_speculative_in_a_batch_of_16(tiny_llama, int4_draft, num_blocks, proposer):
    prompts = _repetitive_prompts(16)
    params = [SamplingParams(max_tokens=6 + 3 * (i % 7), temperature=0, ignore_eos=True) for i in range(16)]
    kw = {"block_size": 16, "num_blocks": num_blocks, "max_num_batched_tokens": 64, "enable_prefix_caching": True}
    want = [o.token_ids for o in LLM(str(tiny_llama), **kw).generate(prompts, params)]
    config = {
        "ngram": NGRAM,
        "self-draft": {"model": str(tiny_llama), "num_speculative_tokens": 3},
        "int4-draft": {"model": str(int4_draft), "num_speculative_tokens": 3},
    }[proposer]
    spec = LLM(str(tiny_llama), **kw, speculative_config={**config, "disable_by_batch_size": 64})
    for p, w in zip(prompts[:3], want[:3]):  # alone
        assert spec.generate([p], params[0])[0].token_ids == w[: params[0].max_tokens]
    got = spec.generate(prompts, params)
    assert [o.token_ids for o in got] == want
    assert all(len(o.token_ids) == p.max_tokens and o.finish_reason == "length" for o, p in zip(got, params))
    assert spec.speculator.stats.num_accepted_tokens > 0 and got[0].spec["num_drafts"] >= 0
    assert spec.block_manager.num_free_blocks == num_blocks
    spec.block_manager.assert_consistent([])
    if num_blocks == 9:
        assert spec.scheduler.num_preemptions > 0
    if proposer == "self-draft":  # the target drafting for itself agrees (fp32; rounding may split a near-tie)
        assert spec.speculator.stats.acceptance_rate > 0.95


def test_a_draft_with_another_vocabulary_is_refused(tiny_llama, small_vocab):
    with pytest.raises(QuantkitError, match="has 16 logits per token and the target 320"):
        LLM(str(tiny_llama), num_blocks=8, speculative_config={"model": str(small_vocab), "num_speculative_tokens": 2})


def test_stops_never_overshoot(tiny_llama):
    prompt = _repetitive_prompts(7)[6]  # its greedy output repeats: drafts get accepted
    base = LLM(str(tiny_llama), block_size=16, num_blocks=64)
    spec = LLM(str(tiny_llama), block_size=16, num_blocks=64, speculative_config={**NGRAM, "prompt_lookup_min": 1})
    full = base.generate([prompt], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))[0].token_ids
    stop_id = full[17]  # late: the repetition (and the drafts) start around token 8
    stop_text = base.tokenizer.decode(full[13:15])
    for params in [
        SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[stop_id]),
        SamplingParams(max_tokens=15, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, stop=stop_text),
    ]:
        a, b = base.generate([prompt], params)[0], spec.generate([prompt], params)[0]
        assert (b.token_ids, b.text, b.finish_reason) == (a.token_ids, a.text, a.finish_reason)
        assert len(b.token_times) == len(b.token_ids)
    assert spec.speculator.stats.num_accepted_tokens > 0


def test_seeded_sampling_repeats(tiny_llama):
    spec = LLM(str(tiny_llama), block_size=16, num_blocks=64, speculative_config=NGRAM)
    params = SamplingParams(max_tokens=12, temperature=0.8, top_k=50, seed=5, ignore_eos=True)
    prompt = _repetitive_prompts(2)[1]
    a, b = spec.generate([prompt, prompt], params)
    assert a.token_ids == b.token_ids and len(a.token_ids) == 12


@pytest.mark.smollm2
def test_smollm2_ngram_greedy_equals_plain_on_an_input_grounded_prompt():
    base = LLM("smollm2-135m", dtype="float32", num_blocks=64)
    spec = LLM("smollm2-135m", dtype="float32", num_blocks=64, speculative_config=NGRAM)
    text = "The committee met on Tuesday and agreed to extend the program for two more years."
    prompt = base.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Repeat this sentence exactly: " + text}],
        tokenize=False,
        add_generation_prompt=True,
    )
    params = SamplingParams(max_tokens=32, temperature=0)
    a, b = base.generate([prompt], params)[0], spec.generate([prompt], params)[0]
    assert b.token_ids == a.token_ids and b.finish_reason == a.finish_reason
    assert b.spec["num_accepted_tokens"] > 0


@pytest.mark.smollm2
def test_smollm2_int4_self_draft_and_ngram_equal_plain_in_a_batch_of_16(tmp_path):
    """The built-in model in fp32, its RTN INT4 checkpoint drafting for it (and n-gram), 16
    prompts of mixed lengths together, a KV cache small enough to force preemption."""
    from quantkit.pipeline.quantize import quantize
    from quantkit.scheme import preset

    draft = tmp_path / "int4"
    quantize("smollm2-135m", preset("w4a16-asym").with_group_size(64), draft)
    words = "the council voted to extend the program for two more years and the council".split()
    prompts = [" ".join(words[: 4 + i % 9] * (1 + i % 3)) for i in range(16)]
    params = [SamplingParams(max_tokens=8 + 2 * (i % 5), temperature=0, ignore_eos=True) for i in range(16)]
    kw = {"dtype": "float32", "block_size": 16, "num_blocks": 12, "max_num_batched_tokens": 128}
    plain = LLM("smollm2-135m", **kw)
    want = [o.token_ids for o in plain.generate(prompts, params)]
    assert plain.scheduler.num_preemptions > 0
    for config in (NGRAM, {"model": str(draft), "num_speculative_tokens": 4}):
        spec = LLM("smollm2-135m", **kw, speculative_config={**config, "disable_by_batch_size": 64})
        assert [o.token_ids for o in spec.generate(prompts, params)] == want
        assert spec.speculator.stats.num_accepted_tokens > 0
