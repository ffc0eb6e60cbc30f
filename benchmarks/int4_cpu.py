"""W4A16 on the CPU, one thread: the C++ int4 kernel (`quantkit.kernels.int4.cpp`) against
torch's int4pack kernel and a bf16 GEMM on a prepacked weight (oneDNN), bf16 activations.

    python benchmarks/int4_cpu.py [--rows 1 16 64 256 512 1024 2048] [--rounds 5] [--group G]
                                  [--asym] [--no-int4pack] [--shapes 576x960 ...] [--quick] [--cold MB]

Shapes (in -> out): smollm2-135m's linears (576 -> 960 q/k/v fused, 576 -> 3072 gate/up
fused, 1536 -> 576 down, 576 -> 576 o) and 2048 x 2048. Random int4 weights (symmetric, or
asymmetric with random zero points with --asym), group 64 where 128 does not divide the input
width, else 128 (--group to force one). The kernels are timed interleaved, --rounds times
(each a loop of enough calls to last ~20 ms), and the median is printed in ms with each one's
speed against bf16 (> 1: faster). `ours` is whatever `cpu_int4.gemm` picks for that many rows
(printed with the path it took). A last table gives ours / bf16 per shape and M.

--cold MB: each kernel cycles through enough distinct copies of its weight (bf16, int4) to
hold MB megabytes, one copy per call, so that the weight comes from memory as in a model's
decode (30 layers of smollm2-135m are ~66 MB of int4, ~250 MB of bf16); without it the
weight stays in the caches between calls.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import itertools
import platform
import statistics
import time

import torch

from quantkit.kernels import cpu
from quantkit.kernels.int4 import cpp as cpu_int4
from quantkit.packing import pack

SHAPES = [(576, 960), (576, 3072), (1536, 576), (576, 576), (2048, 2048)]  # (in, out)


def timer(fn, budget_s: float = 0.02):
    """A function that times `calls` calls of fn (calls fixed after a warm-up): ms per call, in
    CPU time of this thread, so that other jobs on the machine do not count."""
    fn()
    start, calls = time.thread_time(), 0
    while time.thread_time() - start < budget_s:
        fn()
        calls += 1
    calls = max(calls, 1)

    def once() -> float:
        t = time.thread_time()
        for _ in range(calls):
            fn()
        return (time.thread_time() - t) / calls * 1e3

    return once


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _copies(make, nbytes: int, cold_mb: float) -> list:
    """Enough results of make() to hold cold_mb megabytes (one when cold_mb is 0)."""
    return [make() for _ in range(max(1, -(-int(cold_mb * 2**20) // nbytes)))]


def _clone(weight: cpu_int4.Int4Weight) -> cpu_int4.Int4Weight:
    if weight.kernel == "int4pack":
        return weight  # torch's int4pack object is opaque; it stays warm
    return dataclasses.replace(
        weight, nibbles=weight.nibbles.clone(), scales=weight.scales.clone(), zs=weight.zs.clone()
    )


def bench_shape(
    k: int, n: int, rows: list[int], rounds: int, group: int | None, asym: bool, int4pack: bool, cold_mb: float = 0
) -> list[dict]:
    torch.manual_seed(0)
    g = group or (64 if k % 128 else 128)
    q = torch.randint(-8, 8, (n, k), dtype=torch.int8)
    w_packed, scales = pack(q), (torch.rand(n, k // g) * 0.01 + 0.001).to(torch.bfloat16)
    zeros = torch.randint(-2, 3, (n, k // g), dtype=torch.int8) if asym else None
    z = zeros.float().repeat_interleave(g, dim=1) if asym else 0.0
    dense = ((q.float() - z) * scales.float().repeat_interleave(g, dim=1)).to(torch.bfloat16)
    prepacked = cpu.prepack_bf16(dense)
    packed4 = int4pack.repack_int4_cpu(w_packed, scales, zeros, g) if int4pack else None
    ours, _ = cpu_int4.repack(w_packed, scales, zeros, g)
    bf16s = itertools.cycle(
        _copies(lambda: cpu.prepack_bf16(dense), 2 * n * k, cold_mb) if prepacked is not None else [None]
    )
    ourss = itertools.cycle(_copies(lambda: _clone(ours), ours.nbytes, cold_mb))
    out = []
    for m in rows:
        x = torch.randn(m, k, dtype=torch.bfloat16)
        impls = {
            "bf16": timer(
                (lambda: cpu.packed_linear(x, next(bf16s))) if prepacked is not None else (lambda: x @ dense.t())
            ),
            "ours": timer(lambda: cpu_int4.gemm(x, next(ourss))),
        }
        if packed4 is not None:
            impls["int4pack"] = timer(lambda: int4pack.int4_gemm_cpu(x, packed4))
        times = {name: [] for name in impls}
        for _ in range(rounds):
            for name, once in impls.items():
                times[name].append(once())
        ms = {name: statistics.median(t) for name, t in times.items()}
        row = dict(k=k, n=n, m=m, group=g, kernel=_path(ours, m), **ms)
        out.append(row)
        i4 = f"{ms['int4pack']:.3f} | {ms['bf16'] / ms['int4pack']:.2f}×" if "int4pack" in ms else "– | –"
        print(
            f"| {k}→{n} | {m} | {ms['bf16']:.3f} | {ms['ours']:.3f} | {i4} "
            f"| **{ms['bf16'] / ms['ours']:.2f}×** | {row['kernel']} |",
            flush=True,
        )
    return out


def _path(weight: cpu_int4.Int4Weight, m: int) -> str:
    if weight.kernel == "int4pack":
        return "int4pack" if m < cpu_int4.DENSE_MIN_M else "dequant + fp32"
    return cpu_int4.amx_path(weight, m)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 256, 512, 1024, 2048])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--group", type=int, default=None)
    p.add_argument("--asym", action="store_true", help="asymmetric weights (random zero points)")
    p.add_argument("--no-int4pack", action="store_true", help="leave torch's int4pack out (slow at many rows)")
    p.add_argument("--shapes", nargs="+", default=None, help="in x out, e.g. 576x3072")
    p.add_argument("--quick", action="store_true", help="2048 x 2048 only, 3 rounds")
    p.add_argument("--cold", type=float, default=0, metavar="MB", help="cycle through MB of weight copies per kernel")
    a = p.parse_args()
    torch.set_num_threads(1)
    shapes = [(2048, 2048)] if a.quick else SHAPES
    if a.shapes:
        shapes = [tuple(int(v) for v in s.split("x")) for s in a.shapes]
    kernel = "AMX" if cpu_int4.available() else f"torch's int4pack ({cpu_int4.reason()})"
    print(
        f"W4A16 CPU GEMM, {datetime.date.today()}, torch {torch.__version__}, {cpu_name()}, 1 thread, "
        f"{'asymmetric' if a.asym else 'symmetric'} weights, "
        f"{f'weights from memory ({a.cold:g} MB per kernel)' if a.cold else 'weights in cache'}; ours: {kernel}\n"
    )
    print("| in→out | M | bf16 prepacked ms | ours ms | int4pack ms | int4pack vs bf16 | ours vs bf16 | ours ran |")
    print("|---|---|---|---|---|---|---|---|")
    rows = []
    for k, n in shapes:
        rows += bench_shape(k, n, a.rows, 3 if a.quick else a.rounds, a.group, a.asym, not a.no_int4pack, a.cold)
    print("\nours / bf16 speed (> 1: ours faster)\n")
    print("| in→out | " + " | ".join(f"M={m}" for m in a.rows) + " |")
    print("|---|" + "---|" * len(a.rows))
    for k, n in shapes:
        ratios = [r["bf16"] / r["ours"] for r in rows if (r["k"], r["n"]) == (k, n)]
        print(f"| {k}→{n} | " + " | ".join(f"{v:.2f}" for v in ratios) + " |")


if __name__ == "__main__":
    main()
