"""The fp32 float linear's candidates side by side: MKL / the C++ GEMV (`dense.cpp.linear`, what an
engine of one sequence runs) against oneDNN's GEMM on a weight reordered once (`cpu.prepack_fp32`,
what a batching engine runs), on smollm2's shapes, weights from memory.

    OMP_NUM_THREADS=1 python benchmarks/fp32_linear.py [--rows 1 2 3 4 8 64] [--isa native|avx2]

Each shape's weight is copied until ~96 MB (so a call reads it from memory, not the cache), and
each candidate runs over the copies; thread CPU time, median of 3. Prints the current path's
milliseconds per call and its time ÷ oneDNN's (above 1×, oneDNN on the reordered weight is faster).
--isa avx2 re-runs the script with torch's kernels forced to AVX2 (the proxy of benchmarks/decode.py).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

AVX2_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
SHAPES = [(576, 960), (576, 3072), (1536, 576), (576, 49152)]  # fused q/k/v, gate/up, down, lm_head


def per_call(fn, x, weights) -> float:
    samples = []
    for _ in range(3):
        start = time.thread_time()
        for w in weights:
            fn(x, w)
        samples.append((time.thread_time() - start) / len(weights))
    return statistics.median(samples)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 8, 64])
    p.add_argument("--isa", choices=("native", "avx2"), default="native")
    a = p.parse_args()
    if a.isa == "avx2" and os.environ.get("ATEN_CPU_CAPABILITY") != "avx2":
        sys.exit(subprocess.run([sys.executable, *sys.argv], env={**os.environ, **AVX2_ENV}).returncode)

    import torch

    from quantkit.kernels import cpu
    from quantkit.kernels.dense import cpp

    torch.set_num_threads(1)
    print(f"{'forced AVX2 (a proxy)' if a.isa == 'avx2' else 'native ISA'}, 1 thread, thread CPU time")
    print("| K→N | rows | MKL / C++ GEMV ms | ÷ oneDNN reordered |\n|---|---|---|---|")
    for k, n in SHAPES:
        plain = [torch.randn(n, k) for _ in range(max(2, int(96e6 // (n * k * 4))))]
        packed = [cpu.prepack_fp32(w) for w in plain]
        for rows in a.rows:
            x = torch.randn(rows, k)
            current = per_call(lambda x, w: cpp.linear(x, w), x, plain)
            onednn = per_call(lambda x, w: cpu.packed_linear(x, w), x, packed)
            print(f"| {k}→{n} | {rows} | {current * 1e3:.3f} | {current / onednn:.2f}× |", flush=True)


if __name__ == "__main__":
    main()
