"""W4A16 (and W8A16) with fp32 activations on the CPU, one thread: the AVX kernels of
`quantkit.kernels.int4.avx` against fp32 `F.linear` on the dense weight, side by side.

    python benchmarks/int4_avx.py [--isa avx2|avx512] [--rows 1 2 4 8 16 64 256] [--rounds 5]
                                  [--group 64] [--sym] [--shapes 576x960 ...] [--cold MB] [--int8]

Shapes (in -> out): smollm2-135m's linears (576 -> 960 q/k/v fused, 576 -> 576 o, 576 -> 3072
gate/up fused, 1536 -> 576 down) and 2048 x 2048; random int4 weights, group 64, asymmetric
(--sym: symmetric). Each kernel is timed interleaved with the others, --rounds times (each a
loop of ~20 ms of this thread's CPU time), and the median is printed in ms with fp32 / ours
(> 1: ours faster), once with the weights warm (the same copy every call, so it stays in the
caches) and once cold (each call takes the next of enough copies to fill --cold MB, default 64,
so that the weight comes from memory as in a model's decode; note that a CPU whose L3 holds more
than that serves them from L3). --int8 adds the int8 kernel (per-channel symmetric) and torch's
`_weight_int8pack_mm` (the engine's W8A16 path, up to 8 rows: it is slow above).

--isa avx2 re-runs this script in a subprocess with QUANTKIT_ISA=avx2, ATEN_CPU_CAPABILITY=avx2,
MKL_ENABLE_INSTRUCTIONS=AVX2 and ONEDNN_MAX_CPU_ISA=AVX2 set before torch is imported, so that
the fp32 baseline runs AVX2 code too (a proxy for an AVX2-only CPU: same caches and memory).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import itertools
import os
import statistics
import subprocess
import sys

AVX2_ENV = {
    "QUANTKIT_ISA": "avx2",
    "ATEN_CPU_CAPABILITY": "avx2",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
}
SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576), (2048, 2048)]  # (in, out)


def _cycle(make, nbytes: int, cold_mb: float):
    """An endless cycle over enough results of make() to hold cold_mb megabytes (one if 0)."""
    return itertools.cycle([make() for _ in range(max(1, -(-int(cold_mb * 2**20) // nbytes)))])


def bench_shape(k: int, n: int, a) -> list[dict]:
    import torch
    import torch.nn.functional as F
    from int4_cpu import timer  # benchmarks/int4_cpu.py, imported once QUANTKIT_ISA is set

    from quantkit.kernels.int4 import avx as cpu_int4_avx
    from quantkit.packing import pack

    torch.manual_seed(0)
    g = a.group
    q = torch.randint(-8, 8, (n, k), dtype=torch.int8)
    scales = (torch.rand(n, k // g) * 0.01 + 0.001).to(torch.bfloat16)
    zeros = None if a.sym else torch.randint(-2, 3, (n, k // g), dtype=torch.int8)
    z = 0.0 if a.sym else zeros.float().repeat_interleave(g, dim=1)
    dense = (q.float() - z) * scales.float().repeat_interleave(g, dim=1)
    w4, why = cpu_int4_avx.repack(pack(q), scales, zeros, g)
    assert w4 is not None, why
    q8, s8 = torch.randint(-127, 128, (n, k), dtype=torch.int8), torch.rand(n) * 0.01
    w8, _ = cpu_int4_avx.repack_int8(q8, s8)
    out = []
    for cold in (0.0, a.cold):
        denses = _cycle(dense.clone, 4 * n * k, cold)
        w4s = _cycle(lambda: dataclasses.replace(w4, words=w4.words.clone()), w4.nbytes, cold)
        w8s = _cycle(lambda: dataclasses.replace(w8, q=w8.q.clone()), w8.nbytes, cold)
        q8s = _cycle(lambda: (q8.clone(), s8), n * k, cold)
        for m in a.rows:
            x = torch.randn(m, k)
            impls = {
                "fp32": timer(lambda: F.linear(x, next(denses))),
                "int4": timer(lambda: cpu_int4_avx.gemm(x, next(w4s))),
            }
            if a.int8:
                impls["int8"] = timer(lambda: cpu_int4_avx.gemm_int8(x, next(w8s)))
                if m <= 8:
                    impls["int8pack"] = timer(lambda: torch._weight_int8pack_mm(x, *next(q8s)))
            times = {name: [] for name in impls}
            for _ in range(a.rounds):
                for name, once in impls.items():
                    times[name].append(once())
            ms = {name: statistics.median(t) for name, t in times.items()}
            row = dict(k=k, n=n, m=m, cold=cold > 0, **ms)
            out.append(row)
            cells = [f"{ms['fp32']:.3f}", f"{ms['int4']:.3f}", f"**{ms['fp32'] / ms['int4']:.2f}×**"]
            if a.int8:
                cells += [f"{ms['int8']:.3f}", f"{ms['fp32'] / ms['int8']:.2f}×"]
                cells += (
                    [f"{ms['int8pack']:.3f}", f"{ms['fp32'] / ms['int8pack']:.2f}×"] if "int8pack" in ms else ["–", "–"]
                )
            print(f"| {k}→{n} | {'cold' if cold else 'warm'} | {m} | " + " | ".join(cells) + " |", flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--isa", choices=["avx2", "avx512"], default=None, help="avx2: re-run with AVX2 forced everywhere")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 64, 256])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--group", type=int, default=64)
    p.add_argument("--sym", action="store_true", help="symmetric int4 weights (default: random zero points)")
    p.add_argument("--shapes", nargs="+", default=None, help="in x out, e.g. 576x3072")
    p.add_argument("--cold", type=float, default=64, metavar="MB", help="MB of weight copies for the cold runs")
    p.add_argument("--int8", action="store_true", help="also the int8 kernel and torch's int8pack")
    a = p.parse_args()
    if a.isa == "avx2" and os.environ.get("QUANTKIT_ISA") != "avx2":
        argv = [sys.executable, __file__, *sys.argv[1:]]
        sys.exit(subprocess.run(argv, env={**os.environ, **AVX2_ENV}).returncode)
    if a.isa == "avx512":
        os.environ["QUANTKIT_ISA"] = "avx512"  # before cpu_int4_avx reads it
    import torch
    from int4_cpu import cpu_name

    from quantkit.kernels.int4 import avx as cpu_int4_avx

    torch.set_num_threads(1)
    isa, why = cpu_int4_avx.choose_isa()
    assert isa is not None, why
    shapes = [tuple(int(v) for v in s.split("x")) for s in a.shapes] if a.shapes else SHAPES
    forced = (
        " (AVX2 forced on this CPU: a proxy for an AVX2-only one)" if os.environ.get("QUANTKIT_ISA") == "avx2" else ""
    )
    print(
        f"fp32-activation int4 GEMM, {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, "
        f"torch {torch.__version__} (ATen {torch.backends.cpu.get_cpu_capability()}), {cpu_name()}, 1 thread, "
        f"ours: {isa}{forced}, "
        f"group {a.group} {'symmetric' if a.sym else 'asymmetric'}, cold = {a.cold:g} MB of weight copies\n"
    )
    head = "| in→out | weights | M | fp32 ms | int4 ms | int4 vs fp32 |"
    if a.int8:
        head += " int8 ms | int8 vs fp32 | int8pack ms | int8pack vs fp32 |"
    print(head + "\n|" + "---|" * (head.count("|") - 1))
    rows = []
    for k, n in shapes:
        rows += bench_shape(k, n, a)
    for cold in (False, True):
        print(f"\nint4 / fp32 speed, weights {'cold' if cold else 'warm'} (> 1: int4 faster)\n")
        print("| in→out | " + " | ".join(f"M={m}" for m in a.rows) + " |\n|---|" + "---|" * len(a.rows))
        for k, n in shapes:
            r = [x["fp32"] / x["int4"] for x in rows if (x["k"], x["n"], x["cold"]) == (k, n, cold)]
            print(f"| {k}→{n} | " + " | ".join(f"{v:.2f}" for v in r) + " |")


if __name__ == "__main__":
    main()
