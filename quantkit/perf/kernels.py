"""Kernel benchmark: `quantkit bench kernels --device cpu|cuda [--quick]` prints a
markdown table; `run_cpu` / `run_gpu` return its rows (lists of dicts) for other code.

CPU: dense fp32 and bf16 GEMM, the torch twin of int4_gemm (fp32) and torch's int4pack kernel
(`kernels/cpu.py`), timed side by side with interleaved repetitions (median of the timed runs
after a warm-up), plus a memory-copy bandwidth to read the weight bandwidths against.
GPU: each Triton kernel is first checked against its twin, then timed with
`triton.testing.do_bench` against cuBLAS bf16 (`torch.matmul`) or SDPA. Speed lives here,
never in unit tests.
"""

from __future__ import annotations

import datetime
import importlib
import math
import platform
import statistics
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from quantkit.kernels.attention import twin as attention_twin
from quantkit.kernels.fp8 import twin as fp8_twin
from quantkit.kernels.int4 import int4pack
from quantkit.kernels.int4 import twin as int4_twin
from quantkit.packing import unpack
from quantkit.primitives import dequantize, sqnr
from quantkit.scheme import QuantArgs

HBM_TBPS = 4.8  # H200 HBM3e peak, the yardstick of the attention rows


def _device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        return f"{names[0]} ({len(names)} logical cores)" if names else platform.processor()
    except OSError:
        return platform.processor() or platform.machine()


def header(device: str) -> str:
    """One line: date, torch version, device name, threads."""
    return (
        f"kernel benchmark, {datetime.date.today().isoformat()}, torch {torch.__version__}, "
        f"{_device_name(device)}, {torch.get_num_threads()} torch threads"
    )


def _fmt(v) -> str:
    if v is None:
        return ""
    if isinstance(v, bool):
        return "yes" if v else "NO"
    if isinstance(v, float):
        return f"{v:.0f}" if abs(v) >= 100 else f"{v:.3g}"
    return str(v)


def to_markdown(rows: list[dict]) -> str:
    """A markdown table whose columns are the union of the rows' keys, in order."""
    cols = list(dict.fromkeys(k for r in rows for k in r))
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(_fmt(r.get(c)) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


# ---------------------------------------------------------------- CPU


def _median_ms(fns: dict, reps: int, min_sample_s: float = 0.01) -> dict[str, float]:
    """Median ms per call of each fn, repetitions interleaved across fns (noisy machines)."""
    inner = {}
    for name, fn in fns.items():  # warm-up, then enough calls per sample to pass min_sample_s
        fn()
        t = time.perf_counter()
        fn()
        inner[name] = max(1, math.ceil(min_sample_s / max(time.perf_counter() - t, 1e-7)))
    samples = {name: [] for name in fns}
    for _ in range(max(reps, 5)):
        for name, fn in fns.items():
            t = time.perf_counter()
            for _ in range(inner[name]):
                fn()
            samples[name].append((time.perf_counter() - t) / inner[name] * 1e3)
    return {name: statistics.median(s) for name, s in samples.items()}


def copy_bandwidth(mb: int = 256, reps: int = 5) -> dict:
    """`Tensor.copy_` of `mb` MB; GB/s counts bytes read plus bytes written (as STREAM does)."""
    src = torch.ones(mb * 2**20 // 4)
    dst = torch.empty_like(src)
    ms = _median_ms({"copy": lambda: dst.copy_(src)}, reps, min_sample_s=0)["copy"]
    return {
        "kernel": "memcpy",
        "impl": "Tensor.copy_",
        "weight_MB": float(mb),
        "ms": ms,
        "GB/s": 2 * mb * 2**20 / ms / 1e6,
    }


def _dense(w_packed: torch.Tensor, scales: torch.Tensor, group: int) -> torch.Tensor:
    """The symmetric int4 weight as a dense [N, K] tensor in scales' dtype."""
    q = unpack(w_packed, w_packed.shape[1] * 8)
    return dequantize(q, scales, None, QuantArgs(num_bits=4, group_size=group))


def _cpu_cases(m: int, k: int, group: int) -> dict[str, tuple]:
    """name -> (fn, weight bytes per call) for one [m, k] x [k, k]ᵀ product."""
    n = k
    w_packed = torch.randint(-(2**31), 2**31 - 1, (n, k // 8), dtype=torch.int32)  # any word is valid
    scales = torch.rand(n, k // group) * 0.01 + 0.005
    w = _dense(w_packed, scales, group)  # [n, k] fp32
    w_bf16 = w.to(torch.bfloat16)
    x = torch.randn(m, k)
    x_bf16 = x.to(torch.bfloat16)
    packed = int4pack.repack_int4_cpu(w_packed, scales, None, group)
    return {
        "dense fp32": (lambda: x @ w.t(), w.numel() * 4),
        "dense bf16": (lambda: x_bf16 @ w_bf16.t(), w.numel() * 2),
        "twin int4 (fp32)": (
            lambda: int4_twin.int4_gemm(x, w_packed, scales, None, group),
            w_packed.numel() * 4 + scales.numel() * 4,
        ),
        "int4pack bf16": (lambda: int4pack.int4_gemm_cpu(x_bf16, packed), packed.nbytes),
    }


def run_cpu(
    quick: bool = False,
    ms: tuple[int, ...] | None = None,
    sizes: tuple[int, ...] | None = None,
    reps: int | None = None,
    copy_mb: int | None = None,
) -> list[dict]:
    """Rows of the CPU table: per (M, K=N) the four implementations, then one memcpy row.

    Group 64 where K = 576, 128 otherwise (symmetric int4). `ms` / `sizes` / `reps` / `copy_mb`
    override the defaults (full: M 1/8/64, K 576/2048/4096, 7 reps, 256 MB; quick: M 1/8,
    K 576/2048, 5 reps, 64 MB). vs_fp32 / vs_bf16: time of that dense GEMM / this row's time.
    """
    ms = ms or ((1, 8) if quick else (1, 8, 64))
    sizes = sizes or ((576, 2048) if quick else (576, 2048, 4096))
    reps = max(reps or (5 if quick else 7), 5)
    copy = copy_bandwidth(copy_mb or (64 if quick else 256), reps)
    rows = []
    with torch.inference_mode():
        for k in sizes:
            group = 64 if k % 128 else 128
            for m in ms:
                cases = _cpu_cases(m, k, group)
                t = _median_ms({name: fn for name, (fn, _) in cases.items()}, reps)
                for name, (_, nbytes) in cases.items():
                    gbps = nbytes / t[name] / 1e6
                    rows.append(
                        {
                            "kernel": "gemm",
                            "impl": name,
                            "M": m,
                            "K=N": k,
                            "group": group,
                            "ms": t[name],
                            "weight_MB": nbytes / 2**20,
                            "GB/s": gbps,
                            "%copy": 100 * gbps / copy["GB/s"],
                            "vs_fp32": t["dense fp32"] / t[name],
                            "vs_bf16": t["dense bf16"] / t[name],
                        }
                    )
    return rows + [copy]


# ---------------------------------------------------------------- GPU


@dataclass(frozen=True)
class GpuSizes:
    """Shapes of the GPU run (defaults: the H200 targets)."""

    k: int = 8192  # K = N of both GEMMs
    group: int = 128
    int4_ms: tuple[int, ...] = (1, 16, 64, 1024)
    fp8_ms: tuple[int, ...] = (16, 1024, 4096)
    seqs: int = 32
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    context: int = 4096
    block_size: int = 16
    dtype: torch.dtype = torch.bfloat16  # activations, unquantized KV and the dense baselines


class _Run:
    """Shared state of one GPU run: device, timer, clock, deadline, rows."""

    def __init__(self, device: str, budget_s: float):
        self.device, self.t0, self.budget_s, self.rows = device, time.perf_counter(), budget_s, []

    def log(self, msg: str) -> None:
        print(f"[{time.perf_counter() - self.t0:6.1f}s] {msg}", flush=True)

    def out_of_time(self, what: str) -> bool:
        late = time.perf_counter() - self.t0 > self.budget_s
        if late:
            self.log(f"skipped {what}: past the {self.budget_s:.0f}s budget")
        return late

    def ms(self, fn) -> float:
        if self.device == "cuda":
            from triton.testing import do_bench

            return do_bench(fn, warmup=10, rep=40, return_mode="median")
        return _median_ms({"fn": fn}, 5)["fn"]

    def check(self, name: str, fn, ref: torch.Tensor) -> dict:
        """Run fn, compare with ref (bf16 tolerance: rtol 1.6e-2, atol 1.6e-2 · rms(ref))."""
        try:
            out = fn().float()
        except Exception as e:  # a kernel that refuses a shape is a result, not a crash of the run
            self.log(f"  {name}: ERROR {type(e).__name__}: {str(e).splitlines()[0][:200]}")
            return {"ok": False}
        ref = ref.float()
        db = sqnr(ref, out)
        try:
            torch.testing.assert_close(out, ref, rtol=1.6e-2, atol=1.6e-2 * ref.pow(2).mean().sqrt().item())
            ok, why = True, ""
        except AssertionError as e:
            ok, why = False, " " + " ".join(str(e).split("\n")[1:3])
        self.log(f"  check {name}: {'ok' if ok else 'FAILED'}, SQNR {db:.1f} dB{why}")
        return {"ok": ok, "sqnr_dB": db}


TRITON_MODULES = {"int4_gemm": "int4.triton", "fp8_gemm": "fp8.triton", "paged_attention": "attention.triton"}


def _load(name: str, impls: dict | None, run: _Run):
    if impls is not None:
        return impls.get(name)
    try:
        return getattr(importlib.import_module(f"quantkit.kernels.{TRITON_MODULES[name]}"), name)
    except Exception as e:  # noqa: BLE001 - a missing or broken module skips that kernel only
        run.log(f"note: skipping {name}: {type(e).__name__}: {e}")
        return None


def _target(speedup: float, target: float | None) -> dict:
    return {"target": f">={target}x" if target else None, "met": speedup >= target if target else None}


def _pct_hbm(nbytes: int, ms: float) -> float:
    return 100 * nbytes / ms / 1e9 / HBM_TBPS  # bytes/ms / 1e9 = TB/s


def _gpu_int4(run: _Run, s: GpuSizes, kernel) -> None:
    dev, k, g = run.device, s.k, s.group
    w_packed = torch.randint(-(2**31), 2**31 - 1, (k, k // 8), dtype=torch.int32, device=dev)
    scales = (torch.rand(k, k // g, device=dev) * 0.01 + 0.005).to(s.dtype)
    zeros = torch.randint(-8, 8, (k, k // g), dtype=torch.int8, device=dev)
    w_dense = _dense(w_packed, scales, g)  # [N, K]
    nbytes = w_packed.numel() * 4 + scales.numel() * scales.element_size()
    for m in s.int4_ms:
        if run.out_of_time(f"int4 M={m}"):
            return
        x = torch.randn(m, k, device=dev, dtype=s.dtype)
        row = {"kernel": "int4_gemm", "shape": f"M={m} K=N={k} g{g}"}
        row |= run.check(
            f"int4 sym M={m}",
            lambda: kernel(x, w_packed, scales, None, g),
            int4_twin.int4_gemm(x.float(), w_packed, scales.float(), None, g),
        )
        if m == s.int4_ms[0]:
            run.check(
                f"int4 asym M={m}",
                lambda: kernel(x, w_packed, scales, zeros, g),
                int4_twin.int4_gemm(x.float(), w_packed, scales.float(), zeros, g),
            )
        if "sqnr_dB" in row:
            t, t_ref = run.ms(lambda: kernel(x, w_packed, scales, None, g)), run.ms(lambda: x @ w_dense.t())
            row |= {
                "ms": t,
                "cuBLAS_ms": t_ref,
                "speedup": t_ref / t,
                **_target(t_ref / t, 3.0 if m <= 16 else None),
                "TFLOP/s": 2 * m * k * k / t / 1e9,
                "GB/s": nbytes / t / 1e6,
                "%HBM": _pct_hbm(nbytes, t),
            }
            run.log(f"  int4 M={m}: {t:.4f} ms vs cuBLAS {t_ref:.4f} ms ({t_ref / t:.2f}x)")
        run.rows.append(row)


def _gpu_fp8(run: _Run, s: GpuSizes, kernel) -> None:
    dev, k = run.device, s.k
    w = torch.randn(k, k, device=dev) * 0.02
    w_scale = w.abs().amax(dim=1, keepdim=True) / fp8_twin.FP8_MAX  # [N, 1] fp32
    w_fp8 = (w / w_scale).to(torch.float8_e4m3fn)
    w_dense = (w_fp8.float() * w_scale).to(s.dtype)
    scale_b = w_scale.reshape(1, -1).contiguous()
    for m in s.fp8_ms:
        if run.out_of_time(f"fp8 M={m}"):
            return
        x = torch.randn(m, k, device=dev, dtype=s.dtype)
        row = {"kernel": "fp8_gemm", "shape": f"M={m} K=N={k} dyn/token"}
        row |= run.check(
            f"fp8 dynamic M={m}", lambda: kernel(x, w_fp8, w_scale), fp8_twin.fp8_gemm(x.float(), w_fp8, w_scale)
        )
        if m == s.fp8_ms[0]:
            x_scale = x.float().abs().amax().reshape(1) / fp8_twin.FP8_MAX
            run.check(
                f"fp8 static M={m}",
                lambda: kernel(x, w_fp8, w_scale, x_scale),
                fp8_twin.fp8_gemm(x.float(), w_fp8, w_scale, x_scale),
            )
        if "sqnr_dB" in row:
            t, t_ref = run.ms(lambda: kernel(x, w_fp8, w_scale)), run.ms(lambda: x @ w_dense.t())
            row |= {
                "ms": t,
                "cuBLAS_ms": t_ref,
                "speedup": t_ref / t,
                **_target(t_ref / t, 1.5 if m >= 1024 else None),
                "TFLOP/s": 2 * m * k * k / t / 1e9,
            }
            try:  # informative: cuBLAS fp8 with rowwise scales, x already quantized (not counted)
                xs = x.float().abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / fp8_twin.FP8_MAX
                xq = (x.float() / xs).to(torch.float8_e4m3fn)
                row["cuBLAS_fp8_ms"] = run.ms(
                    lambda: torch._scaled_mm(xq, w_fp8.t(), scale_a=xs, scale_b=scale_b, out_dtype=s.dtype)
                )
            except Exception as e:  # noqa: BLE001 - optional baseline
                run.log(f"  (no torch._scaled_mm baseline: {str(e).splitlines()[0][:120]})")
            run.log(f"  fp8 M={m}: {t:.4f} ms vs cuBLAS {t_ref:.4f} ms ({t_ref / t:.2f}x)")
        run.rows.append(row)


def _gpu_attention(run: _Run, s: GpuSizes, kernel) -> None:
    dev, bs = run.device, s.block_size
    blocks_per_seq = -(-s.context // bs)
    n_blocks = s.seqs * blocks_per_seq
    block_tables = torch.randperm(n_blocks, device=dev).reshape(s.seqs, blocks_per_seq).to(torch.int32)
    seq_lens = (s.context - torch.arange(s.seqs, device=dev) * 37 % bs).to(torch.int32)  # ragged tails
    k = torch.randn(n_blocks, bs, s.kv_heads, s.head_dim, device=dev, dtype=s.dtype)
    v = torch.randn_like(k)
    q = torch.randn(s.seqs, s.heads, s.head_dim, device=dev, dtype=s.dtype)
    scale = s.head_dim**-0.5
    tokens = int(seq_lens.sum())
    # SDPA on the same K/V, contiguous and un-paged: [seqs, kv_heads, context, d]
    k_sdpa = k[block_tables.long()].reshape(s.seqs, -1, s.kv_heads, s.head_dim).transpose(1, 2).contiguous()
    v_sdpa = v[block_tables.long()].reshape(s.seqs, -1, s.kv_heads, s.head_dim).transpose(1, 2).contiguous()
    q_sdpa = q.unsqueeze(2)
    try:
        t_sdpa = run.ms(lambda: F.scaled_dot_product_attention(q_sdpa, k_sdpa, v_sdpa, scale=scale, enable_gqa=True))
    except Exception as e:  # noqa: BLE001 - no GQA in this SDPA backend: time it on K/V repeated per query head
        run.log(f"  (SDPA without enable_gqa: {str(e).splitlines()[0][:120]})")
        rep = s.heads // s.kv_heads
        k_sdpa, v_sdpa = k_sdpa.repeat_interleave(rep, 1), v_sdpa.repeat_interleave(rep, 1)
        t_sdpa = run.ms(lambda: F.scaled_dot_product_attention(q_sdpa, k_sdpa, v_sdpa, scale=scale))
    for cache in ("dense", "fp8"):
        if run.out_of_time(f"paged attention {cache}"):
            return
        if cache == "dense":
            kc, vc, ks, vs = k, v, None, None
        else:
            ks = (k.float().abs().amax() / fp8_twin.FP8_MAX).reshape(1)
            vs = (v.float().abs().amax() / fp8_twin.FP8_MAX).reshape(1)
            kc, vc = (k.float() / ks).to(torch.float8_e4m3fn), (v.float() / vs).to(torch.float8_e4m3fn)
        args = (q, kc, vc, block_tables, seq_lens, scale, ks, vs)
        row = {
            "kernel": "paged_attention",
            "shape": f"{s.seqs}x{s.context} ctx, {s.heads}/{s.kv_heads} heads, d{s.head_dim}, {str(kc.dtype)[6:]} KV",
        }
        row |= run.check(f"paged attention {cache}", lambda: kernel(*args), attention_twin.paged_attention(*args))
        if "sqnr_dB" in row:
            t = run.ms(lambda: kernel(*args))
            kv_bytes = 2 * tokens * s.kv_heads * s.head_dim * kc.element_size()
            row |= {
                "ms": t,
                "sdpa_ms": t_sdpa,
                "speedup": t_sdpa / t,
                "GB/s": kv_bytes / t / 1e6,
                "%HBM": _pct_hbm(kv_bytes, t),
            }
            run.log(f"  paged attention {cache}: {t:.4f} ms, {kv_bytes / t / 1e6:.0f} GB/s (SDPA {t_sdpa:.4f} ms)")
        run.rows.append(row)


def run_gpu(
    quick: bool = False,
    sizes: GpuSizes | None = None,
    impls: dict | None = None,
    device: str = "cuda",
    budget_s: float = 170.0,
) -> list[dict]:
    """Check each Triton kernel against its twin, then time it; returns the rows.

    `impls` maps "int4_gemm" / "fp8_gemm" / "paged_attention" to launchers (default: import
    `quantkit.kernels.<op>.triton`, skipping a missing module with a note). `device="cpu"` with
    small `sizes` runs the same code on the CPU (a smoke test of the bench itself). Sections
    left when `budget_s` has passed are skipped with a note. The paged cache follows
    `kernels/paged_attention.py`: [num_blocks, block_size, kv_heads, head_dim].
    """
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("run_gpu needs CUDA; use --device cpu.")
    s = sizes or (GpuSizes(int4_ms=(1, 1024), fp8_ms=(1024,)) if quick else GpuSizes())
    run = _Run(device, budget_s)
    torch.manual_seed(0)
    with torch.inference_mode():
        for name, section in (("int4_gemm", _gpu_int4), ("fp8_gemm", _gpu_fp8), ("paged_attention", _gpu_attention)):
            kernel = _load(name, impls, run)
            if kernel is None or run.out_of_time(name):
                run.rows.append({"kernel": name, "shape": "skipped"})
                continue
            run.log(f"{name} ...")
            try:
                section(run, s, kernel)
            except Exception as e:  # noqa: BLE001 - report, then go on with the next kernel
                run.log(f"  {name} section FAILED: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
                run.rows.append({"kernel": name, "shape": "section failed", "ok": False})
            if device == "cuda":
                torch.cuda.empty_cache()
    run.log("done")
    return run.rows
