"""W8A8 linears on the CPU against the engine's bf16 path, at smollm2-135m's shapes, one thread.

    OMP_NUM_THREADS=1 python benchmarks/w8a8_cpu.py [--rounds 7] [--ms 1,16,64,256,2048]

Each cell is the median over --rounds interleaved rounds of the mean time of one call (bf16
activations in, bf16 out, as the engine runs them), in milliseconds of the thread's CPU time
(`time.thread_time`: with one thread oneDNN computes on the calling thread, and time the
thread spends switched out for other jobs does not count). The candidates:

- bf16: oneDNN's matmul on the weight reordered once (`ops.float_gemm_cpu`), the float path;
- int_mm: per-token quantization in torch ops, `torch._int_mm` (oneDNN, weight not prepacked),
  both scales applied in fp32;
- onednn+torch: `onednn.qlinear_pointwise` on a weight prepacked once (`qlinear_prepack`),
  quantization and row scaling in torch ops (`onednn.prepack_w8a8(..., elementwise=False)`);
- onednn+C++: the same GEMM with the C++ quantization and row scaling (`kernels/int8/w8a8.cpp`),
  what `Int8Linear` runs;
- gemm only: `qlinear_pointwise` alone on already-quantized activations (the floor).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from quantkit.kernels import cpu
from quantkit.kernels.int8 import onednn
from quantkit.kernels.int8.int_mm import quantize_per_token

SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]  # fused qkv, o, fused gate/up, down


def candidates(k: int, n: int) -> dict:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=g)
    scale = w.abs().amax(1, keepdim=True) / 127.5
    w_int8 = torch.round(w / scale).clamp(-128, 127).to(torch.int8)
    bf16 = cpu.prepack_bf16(w.bfloat16())
    fused = onednn.prepack_w8a8(w_int8, scale, inexact_ok=True)  # timed even where its sums saturate
    plain = onednn.prepack_w8a8(w_int8, scale, elementwise=False, inexact_ok=True)
    w_t, s_w = w_int8.t(), scale.reshape(1, n)
    q_fixed = quantize_per_token(torch.randn(max(ARGS.ms), k, generator=g))[0]

    def int_mm(x):
        q, s = quantize_per_token(x)
        return (torch._int_mm(q, w_t).float() * s * s_w).bfloat16()

    def gemm_only(x):
        q = q_fixed[: x.shape[0]]
        return torch.ops.onednn.qlinear_pointwise(
            q, 1.0, 0, plain.packed, plain.scales, plain.zero_points, None, 1.0, 0, torch.bfloat16, "none", [], ""
        )

    found = {
        "bf16": lambda x: cpu.packed_linear(x, bf16),
        "int_mm": int_mm,
        "onednn+torch": lambda x: onednn.w8a8_gemm_cpu(x, plain),
    }
    if fused.elementwise is not None:
        found["onednn+C++"] = lambda x: onednn.w8a8_gemm_cpu(x, fused)
    found["gemm only"] = gemm_only
    return found


def mean_call(fn, x, n: int) -> float:
    start = time.thread_time()
    for _ in range(n):
        fn(x)
    return (time.thread_time() - start) / n


def main() -> None:
    torch.set_num_threads(1)
    from quantkit.malloc import keep_freed_memory

    keep_freed_memory()  # as the engine does
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread, load average {os.getloadavg()[0]:.2f}")
    print("| K→N | M | " + " | ".join(candidates(64, 64)) + " | best W8A8 vs bf16 |")
    print("|---|---|" + "---|" * (len(candidates(64, 64)) + 1))
    for k, n in SHAPES:
        fns = candidates(k, n)
        for m in ARGS.ms:
            x = torch.randn(m, k).bfloat16()
            calls = min(200, max(3, int(2e8 / (m * k * n))))
            times = {name: [] for name in fns}
            for fn in fns.values():
                fn(x)
            for _ in range(ARGS.rounds):
                for name, fn in fns.items():
                    times[name].append(mean_call(fn, x, calls))
            ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
            best = min(v for name, v in ms.items() if name not in ("bf16", "gemm only"))
            cells = " | ".join(f"{v:.3f}" for v in ms.values())
            print(f"| {k}→{n} | {m} | {cells} | {ms['bf16'] / best:.2f}× |", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--ms", type=lambda s: [int(v) for v in s.split(",")], default=[1, 16, 64, 256, 2048])
    ARGS = parser.parse_args()
    main()
