"""W8A8 with fp32 activations on the CPU, one thread: the W8A8 candidates against fp32 `F.linear`
on the dequantized weight, side by side, at smollm2-135m's shapes.

    python benchmarks/w8a8_avx.py [--isa avx2|avx512] [--rows 1 8 64 256] [--rounds 5]

Candidates (int8 weights per channel, x quantized to int8 per token on every call, fp32 out):

- fp32: `F.linear` on the dense fp32 weight (the float model's linear);
- onednn: oneDNN's int8 GEMM on a prepacked weight with the C++ quantizer
  (`onednn.w8a8_gemm_cpu`, the `W8A8` candidate before `kernels/int8/avx.py`);
- avx: the quantkit AVX2 / AVX-512 VNNI W8A8 kernel (`kernels/int8/avx.py`), when it loads.

Each is timed interleaved with the others, --rounds times (each a loop of ~20 ms of this
thread's CPU time), and the median is printed in ms with fp32 / candidate (> 1: faster), and
each int8 candidate's error against the exact W8A8 result (the twin, `kernels/int8/twin.py`):
‖y − twin‖ / ‖twin‖ on x with four outlier channels (×20), as LLM activations have. An exact
kernel shows ~1e-7 (fp32 rounding); oneDNN on AVX2 without VNNI saturates int16 pair sums
(`onednn.saturates`) and shows far more: it runs here anyway (`inexact_ok`), to be timed.

--isa avx2 re-runs this script in a subprocess with QUANTKIT_ISA=avx2, ATEN_CPU_CAPABILITY=avx2,
MKL_ENABLE_INSTRUCTIONS=AVX2 and ONEDNN_MAX_CPU_ISA=AVX2 set before torch is imported, so that
fp32 and oneDNN run AVX2 code too (a proxy for an AVX2-only CPU: same caches and memory).
"""

from __future__ import annotations

import argparse
import datetime
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
SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]  # (in, out): qkv fused, o, gate/up fused, down


def candidates(k: int, n: int) -> tuple[dict, object]:
    """(name -> fn(x) for one [n, k] per-channel int8 weight, the exact W8A8 function of it)."""
    import torch
    import torch.nn.functional as F

    from quantkit.kernels.int8 import onednn, twin

    g = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=g)
    scale = w.abs().amax(1, keepdim=True) / 127.5
    w_int8 = torch.round(w / scale).clamp(-128, 127).to(torch.int8)
    dense = w_int8.float() * scale
    packed = onednn.prepack_w8a8(w_int8, scale, inexact_ok=True)
    found = {"fp32": lambda x: F.linear(x, dense), "onednn": lambda x: onednn.w8a8_gemm_cpu(x, packed)}
    exact = lambda x: twin.int8_gemm(x, w_int8, scale)  # noqa: E731
    from quantkit.kernels.int8 import avx

    weight, why = avx.repack(w_int8, scale)
    if weight is not None:
        found["avx"] = lambda x: avx.gemm(x, weight)
    else:
        print(f"(no avx candidate: {why})")
    return found, exact


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--isa", choices=["avx2", "avx512"], default=None, help="avx2: re-run with AVX2 forced everywhere")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64, 256])
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args()
    if a.isa == "avx2" and os.environ.get("QUANTKIT_ISA") != "avx2":
        argv = [sys.executable, __file__, *sys.argv[1:]]
        sys.exit(subprocess.run(argv, env={**os.environ, **AVX2_ENV}).returncode)
    if a.isa == "avx512":
        os.environ["QUANTKIT_ISA"] = "avx512"
    import torch
    from int4_cpu import cpu_name, timer  # benchmarks/int4_cpu.py

    torch.set_num_threads(1)
    forced = (
        " (AVX2 forced on this CPU: a proxy for an AVX2-only one)" if os.environ.get("QUANTKIT_ISA") == "avx2" else ""
    )
    print(
        f"fp32-activation W8A8, {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, torch {torch.__version__} "
        f"(ATen {torch.backends.cpu.get_cpu_capability()}), {cpu_name()}, 1 thread{forced}\n"
    )
    from quantkit.kernels.int8 import onednn

    print(f"oneDNN's int8 sums saturate here: {onednn.saturates()}\n")
    names = None
    for k, n in SHAPES:
        fns, exact = candidates(k, n)
        if names is None:
            names = [name for name in fns if name != "fp32"]
            cols = " | ".join(f"{v} ms | fp32 / {v} | {v} error" for v in names)
            head = "| in→out | M | fp32 ms | " + cols + " |"
            print(head + "\n|" + "---|" * (head.count("|") - 1))
        for m in a.rows:
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
            x[:, :4] *= 20  # outlier channels
            ref = exact(x)
            err = {v: ((fns[v](x) - ref).norm() / ref.norm()).item() for v in names}
            impls = {name: timer(lambda fn=fn: fn(x)) for name, fn in fns.items()}
            times = {name: [] for name in impls}
            for _ in range(a.rounds):
                for name, once in impls.items():
                    times[name].append(once())
            ms = {name: statistics.median(t) for name, t in times.items()}
            cells = [f"{ms['fp32']:.4f}"]
            cells += [f"{ms[v]:.4f} | **{ms['fp32'] / ms[v]:.2f}×** | {err[v]:.1e}" for v in names]
            print(f"| {k}→{n} | {m} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
