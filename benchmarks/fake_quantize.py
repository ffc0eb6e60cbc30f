"""`primitives.fake_quantize` of int groups (the broadcast fp32 path) against the general
quantize -> dequantize path it replaces, side by side in one process: CPU microseconds per call
on one weight, with fp32 and bf16 scales, and a check that both give the same values.

    OMP_NUM_THREADS=1 python benchmarks/fake_quantize.py [--rows 256] [--cols 1536] [--group-size 64]
    ATEN_CPU_CAPABILITY=avx2 OMP_NUM_THREADS=1 python benchmarks/fake_quantize.py   # the AVX2 path
"""

from __future__ import annotations

import argparse
import time

import torch

from quantkit import primitives
from quantkit.scheme import QuantArgs


def per_call(fn, calls: int) -> float:
    fn()
    start = time.process_time()
    for _ in range(calls):
        fn()
    return (time.process_time() - start) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--cols", type=int, default=1536)
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--calls", type=int, default=200)
    a = parser.parse_args()
    args = QuantArgs(num_bits=4, symmetric=False, strategy="group", group_size=a.group_size)
    x = torch.randn(a.rows, a.cols, generator=torch.Generator().manual_seed(0))
    print(f"CPU capability {torch.backends.cpu.get_cpu_capability()}, weight {a.rows} x {a.cols}, asym g{a.group_size}")
    print("| scale dtype | general (us) | broadcast (us) | general / broadcast | same values |")
    print("|---|---|---|---|---|")
    for dtype in (torch.float32, torch.bfloat16):
        scale, zero = primitives.compute_qparams(x, args, dtype)

        def general():
            q = primitives.quantize(x, scale, zero, args)
            return primitives.dequantize(q, scale, zero, args, dtype=x.dtype)

        def broadcast():
            return primitives.fake_quantize(x, args, scale, zero)

        same = torch.equal(general(), broadcast())
        g, b = per_call(general, a.calls), per_call(broadcast, a.calls)
        print(f"| {dtype} | {g:.0f} | {b:.0f} | {g / b:.1f}x | {same} |")


if __name__ == "__main__":
    main()
