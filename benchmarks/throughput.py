"""Engine throughput of several checkpoints on the same workload, in one process, alternately.

    python benchmarks/throughput.py smollm2-135m /tmp/rtn64 /tmp/w8a8 [--rounds 2] [--threads 1]
        [--dtype bfloat16|float32] [--isa native|avx2]

Each path gets its own `LLM(path, dtype=...)` (prefix caching off, so every round does the same
work); the 64-request workload of `quantkit bench` (prompts 32:512 tokens, outputs 16:256, EOS
ignored, greedy) runs on each in turn, `--rounds` times. Prints output tokens/s per round (wall
and the process's CPU time, which other jobs on shared cores disturb less), the medians and each
one's ratio to the first path. --isa avx2 re-runs the script with quantkit's kernels and torch's
forced to AVX2 (the proxy of benchmarks/decode.py).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch

from quantkit.perf.bench import synthetic_workload
from quantkit.runtime.engine import LLM
from quantkit.runtime.sequence import SamplingParams

AVX2_ENV = {
    "QUANTKIT_ISA": "avx2",
    "ATEN_CPU_CAPABILITY": "avx2",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
}


def engine(path: str, dtype: str = "bfloat16") -> LLM:
    """The engine every throughput benchmark measures: prefix caching off (each round does the same work)."""
    return LLM(path, dtype=dtype, enable_prefix_caching=False)


def workload(llm: LLM):
    """The 64-request workload of `quantkit bench`: prompts 32:512 tokens, outputs 16:256."""
    return synthetic_workload(llm.tokenizer, 64, "32:512", "16:256", vocab_size=llm.model.config.vocab_size)


def run(llm: LLM, requests) -> tuple[float, float, int]:
    """Wall seconds, CPU seconds and output tokens of one pass of the workload."""
    for r in requests:
        llm.add_request(r.prompt, SamplingParams(max_tokens=r.max_tokens, temperature=0, ignore_eos=True))
    start, cpu, tokens = time.perf_counter(), time.process_time(), 0
    while llm.has_unfinished():
        tokens += len(llm.step())
    llm.outputs.clear()
    return time.perf_counter() - start, time.process_time() - cpu, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--isa", choices=("native", "avx2"), default="native")
    args = parser.parse_args()
    if args.isa == "avx2" and os.environ.get("QUANTKIT_ISA") != "avx2":
        sys.exit(subprocess.run([sys.executable, *sys.argv], env={**os.environ, **AVX2_ENV}).returncode)
    torch.set_num_threads(args.threads)
    print(f"{args.dtype}, {'forced AVX2 (a proxy)' if args.isa == 'avx2' else 'native ISA'}", flush=True)
    llms = {p: engine(p, args.dtype) for p in args.paths}
    requests = workload(llms[args.paths[0]])
    rates = {p: [] for p in args.paths}
    cpu_rates = {p: [] for p in args.paths}
    for i in range(args.rounds):
        for path, llm in llms.items():
            seconds, cpu, tokens = run(llm, requests)
            rates[path].append(tokens / seconds)
            cpu_rates[path].append(tokens / cpu)
            print(
                f"round {i + 1} {path}: {seconds:.1f} s ({cpu:.1f} CPU-s), {tokens / seconds:.1f} output tokens/s "
                f"({tokens / cpu:.1f} per CPU-s)",
                flush=True,
            )
    base, cpu_base = statistics.median(rates[args.paths[0]]), statistics.median(cpu_rates[args.paths[0]])
    for path in args.paths:
        median, cpu_median = statistics.median(rates[path]), statistics.median(cpu_rates[path])
        print(
            f"{path}: median {median:.1f} output tokens/s, {median / base:.2f}x the first; "
            f"per CPU-s {cpu_median:.1f}, {cpu_median / cpu_base:.2f}x"
        )


if __name__ == "__main__":
    main()
