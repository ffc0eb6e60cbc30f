"""Speculative decoding against plain decoding on the CPU, side by side in one run.

    OMP_NUM_THREADS=1 python benchmarks/speculative.py [--model smollm2-135m] [--articles 6]
                                                      [--tokens 128] [--dtype bfloat16] [--k 4]

1. Input-grounded, batch 1: news articles (the built-in `news` set) behind an instruction to
   repeat them with light edits, in the model's chat template; greedy, --tokens tokens; the
   engine with the n-gram proposer against the same engine without, request by request
   interleaved. Prints p50 TPOT of each, the ratio, the acceptance rate and how many outputs
   are token-for-token equal (bf16: the k + 1-token verify chunk may round a near-tie the
   other way, so equality is counted, not assumed; the tests check it in fp32).
2. Free continuation, batch 1: news openings (--chars characters) continued greedily, the
   engine with an INT4 checkpoint of the target as its draft (--int4: made with
   `quantkit rtn -m MODEL -o DIR` when missing) against the same engine without.
3. Load: 64 concurrent free-continuation requests (news openings, --load-tokens tokens each),
   plain against n-gram with the default batch-size switch (speculation off at 8 running
   sequences) and against n-gram forced on; output tokens/s of each.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from calibration.datasets import load_documents  # noqa: E402
from quantkit.runtime.engine import LLM  # noqa: E402
from quantkit.runtime.sequence import SamplingParams  # noqa: E402

INSTRUCTION = "Repeat the following news article word for word, fixing only obvious typos:\n\n"


def grounded_prompts(llm: LLM, n: int, chars: int) -> list[list[int]]:
    docs = [d for d in load_documents("news") if len(d) > chars][:n]
    tok = llm.tokenizer
    texts = [
        tok.apply_chat_template(
            [{"role": "user", "content": INSTRUCTION + d[:chars]}], tokenize=False, add_generation_prompt=True
        )
        for d in docs
    ]
    return [tok.encode(t, add_special_tokens=False) for t in texts]


def one(llm: LLM, prompt: list[int], tokens: int):
    return llm.generate([prompt], SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))[0]


def side_by_side(base: LLM, spec: LLM, prompts: list[list[int]], tokens: int) -> dict:
    one(base, prompts[0][::-1], 4), one(spec, prompts[0][::-1], 4)  # warm up kernels
    tpot = {"none": [], "speculative": []}
    equal = 0
    before = spec.speculator.stats.copy()
    for p in prompts:
        a, b = one(base, p, tokens), one(spec, p, tokens)
        tpot["none"].append(a.tpot)
        tpot["speculative"].append(b.tpot)
        equal += a.token_ids == b.token_ids
    stats = spec.speculator.stats.since(before).as_dict()
    p50 = {k: 1000 * statistics.median(v) for k, v in tpot.items()}
    return {
        "p50_tpot_ms": p50,
        "speedup": p50["none"] / p50["speculative"],
        "equal_outputs": f"{equal}/{len(prompts)}",
        "speculative": stats,
    }


def load(engines: dict[str, LLM], prompts: list[list[int]], tokens: int, repeats: int) -> dict:
    """Output tokens/s of each engine on all `prompts` at once, the median of `repeats` rounds
    that take the engines in turn (no prefix-cache hits: each round shifts the prompts)."""
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    rates = {name: [] for name in engines}
    for llm in engines.values():
        llm.generate([prompts[0][::-1]], SamplingParams(max_tokens=2, ignore_eos=True))
    for r in range(repeats):
        batch = [[r + 1] + p for p in prompts]
        for name, llm in engines.items():
            t0 = time.perf_counter()
            outs = llm.generate(batch, params)
            rates[name].append(sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0))
    return {name: {"output_tokens_per_s": statistics.median(v), "rounds": v} for name, v in rates.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--articles", type=int, default=6)
    ap.add_argument("--chars", type=int, default=1200, help="Characters of each article in the prompt.")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--load-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--int4", type=Path, default=Path("/tmp/spec_rtn"), help="INT4 self-draft checkpoint.")
    ap.add_argument("--repeats", type=int, default=3, help="Rounds of the load part.")
    ap.add_argument("--only-load", action="store_true", help="Skip the batch-1 parts.")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ngram = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    kw = {"dtype": args.dtype, "kv_cache_memory": 1 << 30}
    base = LLM(args.model, **kw)
    report = {"machine": torch.backends.cpu.get_cpu_capability(), "threads": args.threads, "dtype": args.dtype}
    tok, docs = base.tokenizer, load_documents("news")
    if not args.only_load:
        batch1(args, base, ngram, kw, report, docs)
    openings = [tok.encode(d[:400], add_special_tokens=False)[:96] for d in docs[: args.concurrency]]
    engines = {
        "none": base,
        "ngram, switch at 8": LLM(args.model, **kw, speculative_config=ngram),
        "ngram, always on": LLM(args.model, **kw, speculative_config={**ngram, "disable_by_batch_size": 1 << 20}),
        "none, a second engine": LLM(args.model, **kw),  # the harness's noise: two identical engines
    }
    report["load"] = load(engines, openings, args.load_tokens, args.repeats)
    print(json.dumps(report["load"], indent=1), flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


def batch1(args, base: LLM, ngram: dict, kw: dict, report: dict, docs: list[str]) -> None:
    spec = LLM(args.model, **kw, max_num_seqs=1, speculative_config=ngram)
    report["grounded"] = side_by_side(base, spec, grounded_prompts(base, args.articles, args.chars), args.tokens)
    print("grounded, ngram:", json.dumps(report["grounded"], indent=1), flush=True)
    del spec
    tok = base.tokenizer
    if not (args.int4 / "config.json").exists():
        subprocess.run(
            [sys.executable, "-m", "quantkit.cli", "rtn", "-m", args.model, "-o", str(args.int4)], check=True
        )
    draft = LLM(
        args.model, **kw, max_num_seqs=1, speculative_config={"model": str(args.int4), "num_speculative_tokens": args.k}
    )
    free = [tok.encode(d[: args.chars], add_special_tokens=False) for d in docs[100 : 100 + args.articles]]
    report["free_int4_draft"] = side_by_side(base, draft, free, args.tokens)
    print("free continuation, INT4 self-draft:", json.dumps(report["free_int4_draft"], indent=1), flush=True)
    del draft


if __name__ == "__main__":
    main()
