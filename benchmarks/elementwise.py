"""The engine with the C++ element-wise kernels (`kernels/elementwise/fused.cpp`: norms, add + norm,
rotary, SiLU · up) against the same engine with their torch twins, in one process, alternately.

    python benchmarks/elementwise.py [--model smollm2-135m] [--rounds 2] [--threads 1]

The 64-request workload of `quantkit bench` (prompts 32:512 tokens, outputs 16:256, EOS
ignored, greedy), bf16, prefix caching off so that every round does the same work. Prints
each round's seconds and output tokens/s, then the median ratio.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from throughput import engine, run, workload  # benchmarks/throughput.py: the engine, the workload, one pass

from quantkit.kernels import attention, elementwise

# the candidate lists whose C++ entry (`elementwise.CPP`) the twins' engine goes without
LISTS = [(elementwise, n) for n in ("RMS_NORM", "ADD_RMS_NORM", "ROPE", "SILU_MUL", "ARGMAX")] + [
    (attention, "KV_STORE")
]


def twins_engine(model: str):
    """The engine with the C++ element-wise kernels taken off their candidate lists while it loads
    (the engine chooses once, at load)."""
    saved = [(module, name, getattr(module, name)) for module, name in LISTS]
    for module, name, candidates in saved:
        setattr(module, name, [c for c in candidates if c.name != elementwise.CPP])
    try:
        return engine(model)
    finally:
        for module, name, candidates in saved:
            setattr(module, name, candidates)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    engines = {"C++": engine(args.model), "twins": twins_engine(args.model)}
    requests = workload(engines["C++"])

    rates = {"C++": [], "twins": []}
    for i in range(args.rounds):
        for name, llm in engines.items():
            seconds, tokens = run(llm, requests)
            rates[name].append(tokens / seconds)
            print(f"round {i + 1} {name:5}: {seconds:6.1f} s, {tokens / seconds:6.1f} output tokens/s")
    ratio = statistics.median(rates["C++"]) / statistics.median(rates["twins"])
    print(f"C++ / twins, median output tokens/s: {ratio:.2f}x")


if __name__ == "__main__":
    main()
