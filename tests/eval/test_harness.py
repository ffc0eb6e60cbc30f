"""The lm-eval adapter against direct torch computations on the tiny model."""

import json
import math

import pytest
import torch
from lm_eval.api.instance import Instance
from lm_eval.api.registry import get_model

from quantkit.eval.harness import QuantkitLM, cut_at, run_tasks
from quantkit.eval.perplexity import perplexity

torch.set_num_threads(1)
MAX_LENGTH = 16
TEXT = (
    "Quantization maps floating point weights to a small grid of integers. The quick brown fox jumps "
    "over the lazy dog near the river bank. A calibration set is a few hundred sentences of ordinary text."
)


@pytest.fixture(scope="module")
def lm(tiny_llama):
    return QuantkitLM(path=str(tiny_llama), batch_size=3, max_length=MAX_LENGTH)


def instances(kind, args_list):
    return [Instance(request_type=kind, doc={}, arguments=args, idx=i) for i, args in enumerate(args_list)]


def direct_logprob(model, context: list[int], continuation: list[int]) -> tuple[float, bool]:
    whole = (context + continuation)[-(MAX_LENGTH + 1) :]
    with torch.no_grad():
        logprobs = model(torch.tensor([whole[:-1]])).logits[0].float().log_softmax(-1)  # [T, vocab]
    scored = logprobs[len(whole) - 1 - len(continuation) :]
    target = torch.tensor(continuation)
    return scored[torch.arange(len(continuation)), target].sum().item(), bool((scored.argmax(-1) == target).all())


def test_registered_with_lm_eval():
    assert get_model("quantkit") is QuantkitLM


def test_loglikelihood_equals_torch(lm):
    pairs = [
        ("The quick brown", " fox"),
        ("Perplexity is the", " exponential of the mean"),
        ("", "Quantization maps"),
        (TEXT, " of integers."),
        ("A calibration set is", " a few"),
    ]  # TEXT is longer than max_length
    results = lm.loglikelihood(instances("loglikelihood", pairs))
    for (context, continuation), (logprob, greedy) in zip(pairs, results):
        if context:
            whole, ctx = lm.tok_encode(context + continuation), lm.tok_encode(context)
            ctx_ids, cont_ids = ctx, whole[len(ctx) :]
        else:
            ctx_ids, cont_ids = [lm.prefix_token_id], lm.tok_encode(continuation)
        expected, expected_greedy = direct_logprob(lm.model, ctx_ids, cont_ids)
        assert logprob == pytest.approx(expected, rel=1e-5, abs=1e-4)
        assert greedy == expected_greedy and logprob < 0


def test_rolling_total_equals_perplexity_nll(lm):
    # a prefix of TEXT whose token count is a whole number of windows, so every window is full
    text = next(TEXT[:k] for k in range(60, len(TEXT)) if len(lm.tok_encode(TEXT[:k])) == 3 * MAX_LENGTH)
    tokens = lm.tok_encode(text)
    # lm-eval's rolling windows with context 1: the prefix token + the first L tokens, then each next
    # L tokens after the last token of the window before: L + 1 tokens, L of them predicted
    windows = [[lm.prefix_token_id] + tokens[:MAX_LENGTH]] + [
        tokens[k * MAX_LENGTH - 1 : (k + 1) * MAX_LENGTH] for k in range(1, 3)
    ]
    ours = perplexity(lm.model, torch.tensor(sum(windows, [])), seq_len=MAX_LENGTH + 1)
    (total,) = lm.loglikelihood_rolling(instances("loglikelihood_rolling", [(text,)]))
    assert ours["windows"] == 3
    assert -total == pytest.approx(ours["nll"] * 3 * MAX_LENGTH, rel=1e-5)


def direct_greedy(lm, prompt: str, n: int) -> str:
    ids = lm.tok_encode(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(lm.model(torch.tensor([ids])).logits[0, -1].argmax()))
    new = ids[len(lm.tok_encode(prompt)) :]
    new = new[: new.index(lm.eot_token_id)] if lm.eot_token_id in new else new
    return lm.tokenizer.decode(new, skip_special_tokens=True)


def test_generate_until_is_greedy_and_stops_at_until_strings(lm):
    prompt = "The quick"
    assert len(lm.tok_encode(prompt)) <= MAX_LENGTH - 10  # no left truncation below
    generate = lambda *requests: lm.generate_until(instances("generate_until", requests))  # noqa: E731
    (free,) = generate((prompt, {"until": [], "max_gen_toks": 10}))
    assert free == direct_greedy(lm, prompt, 10) and len(free) >= 4, free
    assert generate((prompt, {"until": "\x00", "max_gen_toks": 2})) == [direct_greedy(lm, prompt, 2)]
    stop = free[2:4]
    assert generate((prompt, {"until": [stop], "max_gen_toks": 10})) == [free[: free.index(stop)]]
    # batched with a longer prompt (left padding) gives what each gives alone
    other = ("Perplexity is", {"until": [], "max_gen_toks": 10})
    assert generate((prompt, {"until": [], "max_gen_toks": 10}), other) == [free, generate(other)[0]]


def test_cut_at():
    assert cut_at("a. b\nc", [".", "\n"]) == "a" and cut_at("abc", []) == "abc" and cut_at("abc", [""]) == "abc"


def test_include_path_generate_task(lm, tmp_path):
    data = tmp_path / "echo.jsonl"
    data.write_text("".join(json.dumps({"q": f"Question {i}:", "a": "x"}) + "\n" for i in range(3)))
    (tmp_path / "echo.yaml").write_text(
        "task: my_echo\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: "
        + json.dumps(str(data))
        + "\noutput_type: generate_until\ntest_split: test\ndoc_to_text: q\ndoc_to_target: a\n"
        "generation_kwargs:\n  until: ['\\n']\n  max_gen_toks: 4\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n    aggregation: mean\n    higher_is_better: true\n"
    )
    report = run_tasks(lm, ["my_echo"], include_path=str(tmp_path), limit=2)
    assert set(report["metrics"]) == {"my_echo/exact_match"} and report["higher_is_better"]["my_echo/exact_match"]
    assert report["docs"] == {"my_echo": 2} and len(report["data_sha256"]["my_echo"]) == 64


def test_builtin_tasks_through_lm_eval(lm, tiny_llama):
    from quantkit.calibration.datasets import load_documents

    wide = QuantkitLM(model=lm.model, tokenizer=lm.tokenizer, batch_size=16, max_length=256)
    report = run_tasks(wide, ["wiki_cloze", "wiki_wordppl"], limit=1)
    metrics = report["metrics"]
    assert set(metrics) == {
        "wiki_cloze/acc",
        "wiki_cloze/acc_norm",
        "wiki_wordppl/word_perplexity",
        "wiki_wordppl/byte_perplexity",
        "wiki_wordppl/bits_per_byte",
    }
    assert report["docs"] == {"wiki_cloze": 1, "wiki_wordppl": 1}
    assert [report["higher_is_better"][m] for m in sorted(metrics)] == [True, True, False, False, False]
    article = load_documents("wiki", "eval")[0]
    (total,) = wide.loglikelihood_rolling(instances("loglikelihood_rolling", [(article,)]))
    n_bytes = len(article.encode())
    assert metrics["wiki_wordppl/byte_perplexity"] == pytest.approx(math.exp(-total / n_bytes), rel=1e-6)
    assert metrics["wiki_wordppl/bits_per_byte"] == pytest.approx(-total / n_bytes / math.log(2), rel=1e-6)
    assert metrics["wiki_wordppl/word_perplexity"] == pytest.approx(math.exp(-total / len(article.split())), rel=1e-6)
