"""The server with speculative decoding: answers equal the offline non-speculative engine's,
the usage block carries the request's draft counts, and /metrics has vLLM's spec_decode
counters adding up to the engine's."""

import httpx
import torch
from test_server import NAME, counters, running

from quantkit.runtime.engine import LLM
from quantkit.runtime.sequence import SamplingParams
from quantkit.serve.async_engine import AsyncEngine

torch.set_num_threads(1)
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
PROMPT = [245, 104, 289, 245, 104, 289, 245, 104, 289, 245, 104, 289, 17]


def test_usage_and_spec_decode_counters(tiny_llama):
    want = LLM(str(tiny_llama), block_size=16, num_blocks=64).generate(
        [PROMPT], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    )[0]
    llm = LLM(str(tiny_llama), block_size=16, num_blocks=64, speculative_config=SPEC)
    with running(AsyncEngine(llm), api_key=None) as url:
        body = {"model": NAME, "prompt": PROMPT, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
        assert r["choices"][0]["text"] == want.text
        spec = r["usage"]["speculative"]
        stats = llm.speculator.stats
        assert spec == {
            "num_drafts": stats.num_drafts,
            "num_draft_tokens": stats.num_draft_tokens,
            "num_accepted_tokens": stats.num_accepted_tokens,
        }
        assert stats.num_drafts > 0
        c = counters(url)
        assert c[("vllm:spec_decode_num_drafts_total", ())] == stats.num_drafts
        assert c[("vllm:spec_decode_num_draft_tokens_total", ())] == stats.num_draft_tokens
        assert c[("vllm:spec_decode_num_accepted_tokens_total", ())] == stats.num_accepted_tokens
        per_pos = [
            c.get(("vllm:spec_decode_num_accepted_tokens_per_pos_total", (("position", str(i)),)), 0)
            for i in range(len(stats.accepted_per_pos))
        ]
        assert per_pos == stats.accepted_per_pos
