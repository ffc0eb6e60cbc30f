"""Batch-1 decode of a bf16 model and its int4 checkpoint on the CPU, side by side in one
run, each against the memory-bandwidth ceiling.

    python benchmarks/decode.py [--model smollm2-135m] [--int4 /tmp/rtn64 [DIR ...]] [--tokens 64] [--repeats 5]
                                [--threads 1] [--dtype bfloat16|float32] [--isa native|avx2]

--int4 names int4 checkpoints, each timed beside the float model in the same run (e.g. one
with its float lm_head and one made with `--lm-head int8`); a missing first folder is made first
with RTN (w4a16, group 64, as `quantkit rtn -m MODEL --scheme w4a16 --group-size 64 -o DIR`). Both run through the
engine in --dtype (bf16; float32 is what the engine runs on CPUs without native bf16, such as
AVX2-only EPYCs) (`LLM(..., max_num_seqs=1)`: one request, a 32-token prompt, --tokens
greedy tokens); decode tokens/s is 1 / TPOT, the median of --repeats runs interleaved
between the two models; "CPU ms / token" is the same from this thread's CPU time (robust to
other jobs on the machine; see `decode_tps`). Weight bytes per token: every linear as the runner reads it
(bf16 weights, or torch's int4pack nibbles with their bf16 scales) plus lm_head. Ceiling
tokens/s = copy bandwidth / weight bytes per token, with the copy bandwidth measured in the
same run (`Tensor.copy_` of 256 MB, bytes read + written, as STREAM counts; a pure read
stream is no faster on the machines we use, so the ceiling is generous).

--isa avx2 re-runs the script with the int4 kernel forced to its AVX2 code (QUANTKIT_ISA=avx2) and
torch's own kernels to AVX2 (ATEN_CPU_CAPABILITY, MKL_ENABLE_INSTRUCTIONS, ONEDNN_MAX_CPU_ISA): a
proxy for an AVX2-only CPU on an AVX-512 one. The attention and element-wise C++ kernels keep the
build machine's vectors, so it is not a whole AVX2 machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import nn

from quantkit.perf.kernels import copy_bandwidth
from quantkit.runtime.engine import LLM
from quantkit.runtime.qlinear import Fp8Linear, PackedInt4Linear, PackedInt8Linear, PrepackedLinear
from quantkit.runtime.sequence import SamplingParams

PROMPT = list(range(1000, 1032))
AVX2_ENV = {
    "QUANTKIT_ISA": "avx2",
    "ATEN_CPU_CAPABILITY": "avx2",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
}


def linear_bytes(module: nn.Module) -> int:
    """Weight bytes one call of a (fused) linear reads."""
    tensors = []
    if isinstance(module, (PackedInt4Linear, PackedInt8Linear)):
        if module.runtime_weight is not None:
            return module.runtime_weight.nbytes
        tensors = [module.weight_packed, module.weight_scale]
    elif isinstance(module, Fp8Linear):
        tensors = [module.weight, module.weight_scale]
    elif isinstance(module, (nn.Linear, PrepackedLinear)):
        tensors = [module.weight]  # bf16, reordered for oneDNN or not: the same bytes
    if not tensors:
        raise TypeError(f"cannot count the weight bytes of {type(module).__name__}; fuse_linears made it?")
    return sum(t.numel() * t.element_size() for t in tensors)


def weight_bytes_per_token(llm: LLM) -> int:
    return sum(linear_bytes(m) for m in llm.runner.linears)  # the blocks' (fused) linears and lm_head


def decode_tps(llm: LLM, tokens: int) -> tuple[float, float]:
    """(tokens/s from the engine's TPOT, tokens/s from this thread's CPU time): the CPU time of
    `tokens` tokens less that of one (the prompt and the first token), per token after the first.
    On a machine shared with other jobs the CPU time does not count the time the thread waited
    for a core (at one torch thread every op runs on this thread)."""
    params = lambda n: SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)  # noqa: E731
    start = time.thread_time()
    llm.generate([PROMPT], params(1))
    first, start = time.thread_time() - start, time.thread_time()
    out = llm.generate([PROMPT], params(tokens))[0]
    return 1 / out.tpot, (tokens - 1) / (time.thread_time() - start - first)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--int4", type=Path, nargs="+", default=[Path("/tmp/rtn64")])
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--isa", choices=("native", "avx2"), default="native")
    a = p.parse_args()
    if a.isa == "avx2" and os.environ.get("QUANTKIT_ISA") != "avx2":
        argv = [sys.executable, __file__, *sys.argv[1:]]
        sys.exit(subprocess.run(argv, env={**os.environ, **AVX2_ENV}).returncode)
    dtype = getattr(torch, a.dtype)
    if a.threads:
        torch.set_num_threads(a.threads)
    if not a.int4[0].exists():
        from quantkit.pipeline.quantize import quantize
        from quantkit.scheme import preset

        quantize(a.model, preset("w4a16").with_group_size(64), a.int4[0])
    models = {a.dtype: LLM(a.model, dtype=dtype, max_num_seqs=1)}
    for path in a.int4:
        models[f"int4 {path.name}"] = LLM(str(path), dtype=dtype, max_num_seqs=1)
    for llm in models.values():
        decode_tps(llm, 4)  # warm up: builds the int4pack weights and fills caches
    samples = {name: [] for name in models}
    for _ in range(a.repeats):
        for name, llm in models.items():
            samples[name].append(decode_tps(llm, a.tokens))
    copy = copy_bandwidth(256, 5)["GB/s"]
    rows, tps, cpu = [], {}, {}
    for name, llm in models.items():
        tps[name], nbytes = statistics.median(s[0] for s in samples[name]), weight_bytes_per_token(llm)
        cpu[name] = statistics.median(s[1] for s in samples[name])
        ceiling = copy * 1e9 / nbytes
        rows.append(
            f"| {name} | {nbytes / 1e6:.1f} | {tps[name]:.1f} | {1e3 / tps[name]:.1f} | {1e3 / cpu[name]:.1f} "
            f"| {ceiling:.0f} | {100 * tps[name] / ceiling:.0f}% |"
        )
    isa = "forced AVX2 (a proxy)" if a.isa == "avx2" else "native ISA"
    print(
        f"{a.model}, batch 1, {a.tokens} tokens after a {len(PROMPT)}-token prompt, {a.dtype}, {isa}, "
        f"{torch.get_num_threads()} thread(s), median of {a.repeats}; copy bandwidth {copy:.1f} GB/s (read + write)\n"
    )
    for name, llm in models.items():
        print(f"{name}: " + ("; ".join(llm.notes) or "every kernel the fastest candidate"))
    head = (
        "| checkpoint | weight MB / token | decode tok/s | ms / token | CPU ms / token | ceiling tok/s | of ceiling |"
    )
    print(head)
    print("|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    for name in list(models)[1:]:
        print(
            f"\n{name} / {a.dtype} decode speed: {tps[name] / tps[a.dtype]:.2f}x "
            f"(by CPU time per token: {cpu[name] / cpu[a.dtype]:.2f}x)"
        )


if __name__ == "__main__":
    main()
