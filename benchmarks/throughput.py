"""Engine throughput of several checkpoints on the same workload, in one process, alternately.

    python benchmarks/throughput.py smollm2-135m /tmp/rtn64 /tmp/w8a8 [--rounds 2] [--threads 1]

Each path gets its own `LLM(path, dtype="bfloat16")` (prefix caching off, so every round does
the same work); the 64-request workload of `quantkit bench` (prompts 32:512 tokens, outputs
16:256, EOS ignored, greedy) runs on each in turn, `--rounds` times. Prints output tokens/s per
round, the medians and each one's ratio to the first path.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from quantkit.perf.bench import synthetic_workload
from quantkit.runtime.engine import LLM
from quantkit.runtime.sequence import SamplingParams


def engine(path: str) -> LLM:
    """The engine every throughput benchmark measures: bf16, prefix caching off (each round does the same work)."""
    return LLM(path, dtype="bfloat16", enable_prefix_caching=False)


def workload(llm: LLM):
    """The 64-request workload of `quantkit bench`: prompts 32:512 tokens, outputs 16:256."""
    return synthetic_workload(llm.tokenizer, 64, "32:512", "16:256", vocab_size=llm.model.config.vocab_size)


def run(llm: LLM, requests) -> tuple[float, int]:
    for r in requests:
        llm.add_request(r.prompt, SamplingParams(max_tokens=r.max_tokens, temperature=0, ignore_eos=True))
    start, tokens = time.perf_counter(), 0
    while llm.has_unfinished():
        tokens += len(llm.step())
    llm.outputs.clear()
    return time.perf_counter() - start, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    llms = {p: engine(p) for p in args.paths}
    requests = workload(llms[args.paths[0]])
    rates = {p: [] for p in args.paths}
    for i in range(args.rounds):
        for path, llm in llms.items():
            seconds, tokens = run(llm, requests)
            rates[path].append(tokens / seconds)
            print(f"round {i + 1} {path}: {seconds:.1f} s, {tokens / seconds:.1f} output tokens/s", flush=True)
    base = statistics.median(rates[args.paths[0]])
    for path in args.paths:
        median = statistics.median(rates[path])
        print(f"{path}: median {median:.1f} output tokens/s, {median / base:.2f}x the first")


if __name__ == "__main__":
    main()
