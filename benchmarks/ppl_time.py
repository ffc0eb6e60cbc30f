"""Time of `quantkit eval --ppl` for a quantized checkpoint against its float model, one process.

    OMP_NUM_THREADS=1 python benchmarks/ppl_time.py /tmp/rtn64 [--model smollm2-135m] [--limit 32]
        [--dtype float32|bfloat16] [--isa native|avx2] [--rounds 1]

Both models are loaded the way `quantkit eval` loads them (`load_for_eval`), each warmed on one
256-token window (the kernels' layouts are built on the first call), then `text_perplexity` on
wiki's first `--limit` 2048-token windows runs on each in turn, `--rounds` times. Prints wall
and CPU seconds (`time.process_time`, which other jobs on shared cores disturb less than the
wall clock) and the checkpoint's ratio to the float model; the issue's bar is ≤ 1.3×. --isa
avx2 forces quantkit's kernels and torch's to AVX2 (the proxy of benchmarks/decode.py).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

AVX2_ENV = {
    "QUANTKIT_ISA": "avx2",
    "ATEN_CPU_CAPABILITY": "avx2",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
}


def timed(model, tokenizer, limit: int | None) -> tuple[float, float, float]:
    from quantkit.eval.run import text_perplexity

    wall, cpu = time.perf_counter(), time.process_time()
    result = text_perplexity(model, tokenizer, "wiki", limit=limit)
    return time.perf_counter() - wall, time.process_time() - cpu, result["ppl"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkpoint")
    p.add_argument("--model", default="smollm2-135m", help="the float model (built-in name or folder)")
    p.add_argument("--limit", type=int, default=32, help="2048-token windows")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--isa", choices=("native", "avx2"), default="native")
    p.add_argument("--rounds", type=int, default=1)
    a = p.parse_args()
    if a.isa == "avx2" and os.environ.get("QUANTKIT_ISA") != "avx2":
        sys.exit(subprocess.run([sys.executable, *sys.argv], env={**os.environ, **AVX2_ENV}).returncode)

    import torch

    from quantkit.eval.run import load_for_eval, text_perplexity

    dtype = getattr(torch, a.dtype)
    models = {name: load_for_eval(name, dtype) for name in (a.model, a.checkpoint)}
    for model, tokenizer in models.values():
        text_perplexity(model, tokenizer, "wiki", seq_len=256, limit=1)
    isa = "forced AVX2 (a proxy)" if a.isa == "avx2" else "native ISA"
    print(f"{a.dtype}, {isa}, torch threads {torch.get_num_threads()}, wiki {a.limit} × 2048", flush=True)
    times = {name: [] for name in models}
    for i in range(a.rounds):
        for name, (model, tokenizer) in models.items():
            wall, cpu, ppl = timed(model, tokenizer, a.limit)
            times[name].append((wall, cpu))
            print(f"round {i + 1} {name}: ppl {ppl:.4f}, {wall:.1f} s wall, {cpu:.1f} CPU-s", flush=True)
    wall = {name: statistics.median(w for w, _ in t) for name, t in times.items()}
    cpu = {name: statistics.median(c for _, c in t) for name, t in times.items()}
    print(
        f"{a.checkpoint} / {a.model}: {wall[a.checkpoint] / wall[a.model]:.2f}× wall, "
        f"{cpu[a.checkpoint] / cpu[a.model]:.2f}× CPU time (bar ≤ 1.3×)"
    )


if __name__ == "__main__":
    main()
