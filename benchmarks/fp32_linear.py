"""The fp32 float linear's candidates side by side: MKL (`F.linear`), the C++ GEMV at 1-4 rows
(`dense.cpp.gemv`; with MKL above 4 rows, what an engine of one sequence runs) and oneDNN's GEMM on a
weight reordered once (`cpu.prepack_fp32`, what a batching engine runs), on smollm2's shapes,
weights from memory, beside the core's read bandwidth (a sum over 512 MB) and copy bandwidth.

    OMP_NUM_THREADS=1 python benchmarks/fp32_linear.py [--rows 1 2 3 4 8 64] [--isa native|avx2]

Each shape's weight is copied until ~96 MB (so a call reads it from memory, not the cache), and
each candidate runs over the copies; thread CPU time, median of 3. Prints each candidate's GB/s of
weight read and the GEMV's speed over MKL's and oneDNN's. --isa avx2 re-runs the script with
quantkit's and torch's kernels forced to AVX2 (the proxy of benchmarks/decode.py).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

AVX2_ENV = {"QUANTKIT_ISA": "avx2", "ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
AVX2_ENV["ONEDNN_MAX_CPU_ISA"] = "AVX2"
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
    big = torch.randn(128 * 2**20)  # 512 MB
    read = big.numel() * 4 / per_call(lambda x, w: x.sum(), big, [None])
    copy = 2 * big.numel() * 4 / per_call(lambda x, w: w.copy_(x), big, [torch.empty_like(big)])
    del big
    isa = cpp.isa()[0]
    where = "forced AVX2 (a proxy)" if a.isa == "avx2" else "native ISA"
    print(f"{where} (C++ GEMV: {isa}), 1 thread, thread CPU time")
    print(f"read bandwidth (sum over 512 MB) {read / 1e9:.1f} GB/s, copy (read + written) {copy / 1e9:.1f} GB/s\n")
    print("| K→N | rows | MKL GB/s | C++ GEMV GB/s | oneDNN reordered GB/s | GEMV ÷ MKL | GEMV ÷ oneDNN |")
    print("|---|---|---|---|---|---|---|")
    for k, n in SHAPES:
        plain = [torch.randn(n, k) for _ in range(max(2, int(96e6 // (n * k * 4))))]
        packed = [cpu.prepack_fp32(w) for w in plain]
        size = n * k * 4
        for rows in a.rows:
            x = torch.randn(rows, k)
            mkl = per_call(lambda x, w: torch.nn.functional.linear(x, w), x, plain)
            onednn = per_call(lambda x, w: cpu.packed_linear(x, w), x, packed)
            line = f"| {k}→{n} | {rows} | {size / mkl / 1e9:.1f} | "
            if rows <= cpp.ROWS[1] and isa:
                gemv = per_call(lambda x, w: cpp.gemv(x, w), x, plain)
                line += f"{size / gemv / 1e9:.1f} | {size / onednn / 1e9:.1f} | "
                line += f"{mkl / gemv:.2f}× | {onednn / gemv:.2f}× |"
            else:
                line += f"— | {size / onednn / 1e9:.1f} | | |"
            print(line, flush=True)


if __name__ == "__main__":
    main()
