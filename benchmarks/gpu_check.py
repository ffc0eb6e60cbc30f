"""One prepared check for a lent GPU: every Triton kernel of kernels/ (NVFP4 / MXFP4 and NVFP4
W4A4, fp8 block, MXFP8, int4, fp8, paged attention and the KV store) against its torch twin at
real shapes, then timed against bf16 `F.linear` (the GEMMs) or the twin (attention), with
torch.cuda events; one table. Exits 1 when any kernel disagrees with its twin or fails, else 0.

    python benchmarks/gpu_check.py                     # on the GPU (an H200: under 5 minutes)
    python benchmarks/gpu_check.py --interpret         # on the CPU, TRITON_INTERPRET=1, tiny shapes
    python benchmarks/gpu_check.py --only fp4 fp8_block
    OMP_NUM_THREADS=1 python benchmarks/gpu_check.py --cpu-twins   # the new formats' twins on the CPU
    python benchmarks/gpu_check.py --compile 80 90 100  # no GPU needed: the new kernels to cubins

GEMM shapes: Llama-3-8B's 4096 -> 4096, 4096 -> 14336 and 14336 -> 4096 at 1, 16 and 256 rows,
bf16 activations (fp16 under the interpreter, whose bf16 `tl.dot` is wrong). Tolerance: the
kernels and twins round differently (fp32 sums in another order, per-block scaling), so each
output is held to rtol 1.6e-2 with atol 1.6e-2 · rms(twin) (two bf16 ulps), the SQNR printed
beside it. The timings are medians over `--reps` calls after a warm-up (compiling and
autotuning happen in the first, checking call); "vs base" is the baseline's time over the
kernel's (above 1: the kernel is faster). Compiling and autotuning dominate the run, so rows
past `--budget` seconds (210) are skipped and counted rather than run: the newest kernels
come first.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

GPU_SHAPES = {"m": (1, 16, 256), "nk": ((4096, 4096), (14336, 4096), (4096, 14336))}
TINY_SHAPES = {"m": (1, 5), "nk": ((72, 256), (40, 384))}
PARTS = ("fp4", "fp8_block", "mxfp8", "int4", "fp8", "attention")  # the newest kernels first


class Check:
    """Runs the cases: device, dtype, timer, rows of the table, failures."""

    def __init__(self, interpret: bool, reps: int, budget_s: float):
        self.interpret, self.reps, self.budget_s = interpret, reps, budget_s
        self.device = "cpu" if interpret else "cuda"
        self.dtype = torch.float16 if interpret else torch.bfloat16
        self.shapes = TINY_SHAPES if interpret else GPU_SHAPES
        self.rows, self.failed, self.skipped, self.t0 = [], 0, 0, time.perf_counter()
        self.gen = torch.Generator().manual_seed(0)

    def randn(self, *shape, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(shape, generator=self.gen) * scale).to(self.device)

    def ms(self, fn) -> float:
        """Median milliseconds of one call (CUDA events on the GPU, a wall clock when interpreting)."""
        fn()  # warm-up: compile and autotune
        times = []
        for _ in range(self.reps if not self.interpret else 1):
            if self.interpret:
                t = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t) * 1e3)
                continue
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)

    def row(self, kernel: str, shape: str, fn, ref_fn, base_fn=None, base: str = "", timed=None) -> None:
        """Check fn() against ref_fn() (the twin), then time fn against base_fn (default: the twin);
        `timed` (kernel, base) replaces the two timed callables (e.g. without a copy). Past the
        time budget, a row is skipped (compiling and autotuning each kernel is what costs)."""
        if time.perf_counter() - self.t0 > self.budget_s:
            self.skipped += 1
            self.rows.append((kernel, shape, "skipped (budget)", "", "", "", "", ""))
            return
        try:
            out, ref = fn().float(), ref_fn().float()
            rms = ref.pow(2).mean().sqrt().item()
            err = (out - ref).abs().max().item()
            sqnr = 10 * torch.log10(ref.pow(2).sum() / (out - ref).pow(2).sum().clamp_min(1e-30)).item()
            ok = bool(torch.isclose(out, ref, rtol=1.6e-2, atol=1.6e-2 * max(rms, 1e-30)).all())
        except Exception as e:  # noqa: BLE001 - a kernel that fails is a result of the check
            print(f"{kernel} {shape}: ERROR {type(e).__name__}: {str(e).splitlines()[0][:200]}", flush=True)
            self.failed += 1
            self.rows.append((kernel, shape, "ERROR", "", "", "", "", ""))
            return
        self.failed += not ok
        timed_fn, timed_base = timed or (fn, base_fn or ref_fn)
        base = base or f"{str(self.dtype)[6:]} F.linear"
        k_ms, b_ms = self.ms(timed_fn), self.ms(timed_base)
        self.rows.append(
            (kernel, shape, "ok" if ok else "MISMATCH", f"{err:.3g}", f"{sqnr:.1f}", f"{k_ms:.4f}", f"{b_ms:.4f}", base)
        )
        print(f"{kernel} {shape}: {'ok' if ok else 'MISMATCH'} (max err {err:.3g}, SQNR {sqnr:.1f} dB)", flush=True)

    def table(self) -> str:
        head = ("kernel", "shape", "check", "max err", "SQNR dB", "kernel ms", "base ms", "vs base", "base")
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for kernel, shape, status, err, sqnr, k_ms, b_ms, base in self.rows:
            ratio = f"{float(b_ms) / float(k_ms):.2f}x" if k_ms and float(k_ms) > 0 else ""
            lines.append(f"| {kernel} | {shape} | {status} | {err} | {sqnr} | {k_ms} | {b_ms} | {ratio} | {base} |")
        return "\n".join(lines)


def gemm_cases(check: Check):
    """(m, n, k, x [m, k] in the activations' dtype) for each GEMM shape."""
    for n, k in check.shapes["nk"]:
        for m in check.shapes["m"]:
            yield m, n, k, check.randn(m, k).to(check.dtype)


def _linear(check: Check, n: int, k: int) -> torch.Tensor:
    """A dense [n, k] weight in the activations' dtype: F.linear's, the baseline."""
    return check.randn(n, k, scale=0.02).to(check.dtype)


def check_int4(check: Check) -> None:
    from quantkit.kernels.int4 import triton as kmod
    from quantkit.kernels.int4 import twin

    for m, n, k, x in gemm_cases(check):
        words = torch.randint(-(2**31), 2**31 - 1, (n, k // 8), dtype=torch.int32, generator=check.gen)
        w_packed = words.to(check.device)
        scales = (torch.rand(n, k // 128, generator=check.gen) * 0.01 + 0.001).to(check.dtype).to(check.device)
        weight = (w_packed, scales, None, 128)
        dense = _linear(check, n, k)
        check.row(
            "int4_gemm g128",
            f"{m}x{k}->{n}",
            lambda: kmod.int4_gemm(x, *weight),
            lambda: twin.int4_gemm(x, *weight),
            lambda: F.linear(x, dense),
        )


def check_fp8(check: Check) -> None:
    from quantkit.kernels.fp8 import triton as kmod
    from quantkit.kernels.fp8 import twin

    for m, n, k, x in gemm_cases(check):
        w_fp8 = check.randn(n, k, scale=100).clamp(-448, 448).to(torch.float8_e4m3fn)
        w_scale = (torch.rand(n, 1, generator=check.gen) * 1e-3 + 1e-4).to(check.device)
        dense = _linear(check, n, k)
        check.row(
            "fp8_gemm per-token",
            f"{m}x{k}->{n}",
            lambda: kmod.fp8_gemm(x, w_fp8, w_scale),
            lambda: twin.fp8_gemm(x, w_fp8, w_scale),
            lambda: F.linear(x, dense),
        )


def check_fp8_block(check: Check) -> None:
    from quantkit.kernels.fp8 import block_triton as kmod
    from quantkit.kernels.fp8 import twin

    for m, n, k, x in gemm_cases(check):
        w_fp8 = check.randn(n, k, scale=100).clamp(-448, 448).to(torch.float8_e4m3fn)
        blocks = (-(-n // 128), -(-k // 128))
        w_scale = (torch.rand(blocks, generator=check.gen) * 1e-3 + 1e-4).to(check.device)
        dense = _linear(check, n, k)
        check.row(
            "fp8_block_gemm 128x128",
            f"{m}x{k}->{n}",
            lambda: kmod.fp8_block_gemm(x, w_fp8, w_scale),
            lambda: twin.fp8_block_gemm(x, w_fp8, w_scale),
            lambda: F.linear(x, dense),
        )


def check_fp4(check: Check) -> None:
    from quantkit.kernels.fp4 import triton as kmod
    from quantkit.kernels.fp4 import twin

    for m, n, k, x in gemm_cases(check):
        packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=check.gen).to(check.device)
        nv_scales = (torch.rand(n, k // 16, generator=check.gen) * 400 + 1).to(torch.float8_e4m3fn)
        mx_scales = torch.randint(118, 124, (n, k // 32), dtype=torch.uint8, generator=check.gen)
        dense = _linear(check, n, k)
        nv = (packed, nv_scales.to(check.device), torch.tensor([2e4], device=check.device), 16)
        gx = (448 * 6 / x.float().abs().amax()).reshape(1)
        for kind, args in (
            ("nvfp4", (*nv, "nvfp4")),
            ("mxfp4", (packed, mx_scales.to(check.device), None, 32, "mxfp4")),
            ("nvfp4_w4a4", (*nv, "nvfp4_w4a4", gx)),
        ):
            check.row(
                f"fp4_gemm {kind}",
                f"{m}x{k}->{n}",
                lambda args=args: kmod.fp4_gemm(x, *args),
                lambda args=args: twin.fp4_gemm(x, *args),
                lambda: F.linear(x, dense),
            )


def check_mxfp8(check: Check) -> None:
    from quantkit.kernels.fp8 import mx_triton as kmod
    from quantkit.kernels.fp8 import twin

    for m, n, k, x in gemm_cases(check):
        w_fp8 = check.randn(n, k, scale=100).clamp(-448, 448).to(torch.float8_e4m3fn)
        scales = torch.randint(115, 121, (n, k // 32), dtype=torch.uint8, generator=check.gen).to(check.device)
        dense = _linear(check, n, k)
        check.row(
            "mxfp8_gemm (W8A16)",
            f"{m}x{k}->{n}",
            lambda: kmod.mxfp8_gemm(x, w_fp8, scales),
            lambda: twin.mxfp8_gemm(x, w_fp8, scales),
            lambda: F.linear(x, dense),
        )


def _paged(check: Check, seqs: int, kv_heads: int, dim: int, max_len: int, dtype: torch.dtype):
    """(block_tables, seq_lens, k_cache, v_cache) with seqs sequences of up to max_len tokens
    in shuffled blocks of 16, every slot written with random values."""
    block = 16
    lens = torch.randint(max_len // 4, max_len + 1, (seqs,), generator=check.gen)
    width = -(-max_len // block)
    num_blocks = seqs * width
    tables = torch.randperm(num_blocks, generator=check.gen).reshape(seqs, width).to(torch.int32)
    caches = [(torch.randn(num_blocks, block, kv_heads, dim, generator=check.gen) * 2).to(dtype) for _ in range(2)]
    return tables.to(check.device), lens.to(torch.int32).to(check.device), *(c.to(check.device) for c in caches)


def check_attention(check: Check) -> None:
    from quantkit.kernels.attention import triton as kmod
    from quantkit.kernels.attention import triton_kv_store as store
    from quantkit.kernels.attention import twin

    seqs, heads, kv_heads, dim, max_len = (4, 8, 2, 64, 80) if check.interpret else (32, 32, 8, 128, 4096)
    for cache in (check.dtype, torch.float8_e4m3fn):
        tables, lens, k_cache, v_cache = _paged(check, seqs, kv_heads, dim, max_len, cache)
        scales = (torch.tensor([0.02], device=check.device),) * 2 if cache.itemsize == 1 else (None, None)
        q = check.randn(seqs, heads, dim).to(check.dtype)
        args = (q, k_cache, v_cache, tables, lens, dim**-0.5, *scales)
        name = "fp8" if cache.itemsize == 1 else str(cache)[6:]
        check.row(
            f"paged_attention {name} cache",
            f"{seqs} seqs <= {max_len} tok, {heads}/{kv_heads} heads, d{dim}",
            lambda args=args: kmod.paged_attention(*args),
            lambda args=args: twin.paged_attention(*args),
            base="twin",
        )
        tokens = seqs * (1 if not check.interpret else 3)
        kv = [check.randn(tokens, kv_heads, dim).to(check.dtype) for _ in range(2)]
        slots = torch.randperm(k_cache.shape[0] * 16, generator=check.gen)[:tokens].to(check.device)

        def stored(fn, kv=kv, slots=slots, k_cache=k_cache, v_cache=v_cache, scales=scales):
            k2, v2 = k_cache.clone(), v_cache.clone()
            fn(*kv, k2, v2, slots, *scales)
            return torch.cat([k2.float(), v2.float()])

        in_place = (*kv, k_cache, v_cache, slots, *scales)
        check.row(
            f"kv_store {name} cache",
            f"{tokens} tokens",
            lambda stored=stored: stored(store.kv_store),
            lambda stored=stored: stored(twin.kv_store),
            base="twin",
            timed=(lambda a=in_place: store.kv_store(*a), lambda a=in_place: twin.kv_store(*a)),
        )


def cpu_twins(reps: int) -> None:
    """The new formats' twin candidates on the CPU (what runs there: the FP4 weight decoded once
    then bf16 F.linear; FP8_BLOCK's x quantized per call, then an fp32 matmul) against bf16
    F.linear, smollm2-135m's and a 2048 x 2048 shape, medians of `reps` calls; and each build."""
    from quantkit.kernels import fp4, fp8
    from quantkit.kernels.choice import Problem, choose

    def ms(fn) -> float:
        fn()
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
        return statistics.median(times)

    print("| shape | rows | bf16 F.linear ms | nvfp4 twin ms | fp8 block twin ms | builds ms (nvfp4 / fp8 block) |")
    print("|---|---|---|---|---|---|")
    for n, k in ((1536, 576), (576, 1536), (2048, 2048)):
        packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8)
        nv = dict(scales=(torch.rand(n, k // 16) * 400 + 1).to(torch.float8_e4m3fn), global_scale=torch.tensor([2e4]))
        block = dict(
            weight=(torch.randn(n, k) * 100).clamp(-448, 448).to(torch.float8_e4m3fn),
            scales=torch.rand(-(-n // 128), -(-k // 128)) * 1e-3,
        )
        t = time.perf_counter()
        nv_fn = choose(
            "fp4", fp4.CANDIDATES, Problem("cpu", torch.bfloat16, packed=packed, group_size=16, kind="nvfp4", **nv)
        ).fn
        build_nv, t = (time.perf_counter() - t) * 1e3, time.perf_counter()
        block_fn = choose("fp8 block", fp8.BLOCK, Problem("cpu", torch.bfloat16, **block)).fn
        build_block, dense = (time.perf_counter() - t) * 1e3, torch.randn(n, k).bfloat16()
        for m in (1, 16, 256):
            x = torch.randn(m, k).bfloat16()
            base, a, b = ms(lambda: F.linear(x, dense)), ms(lambda: nv_fn(x)), ms(lambda: block_fn(x))
            print(
                f"| {k} -> {n} | {m} | {base:.3f} | {a:.3f} ({base / a:.2f}x) | {b:.3f} ({base / b:.2f}x) "
                f"| {build_nv:.0f} / {build_block:.0f} |"
            )


def _compile_cases():
    """(name, JIT kernel, signature, constexprs, configs or [None], lowest compute capability)
    for every kernel this issue added, in each constexpr variant the launchers use."""
    from quantkit.kernels.fp4 import triton as fp4
    from quantkit.kernels.fp8 import block_triton as block
    from quantkit.kernels.fp8 import mx_triton as mx

    def ints(*names):
        return dict.fromkeys(names, "i32")

    gemm = ints("M", "N", "K", "M_BUCKET", "stride_xm", "stride_wn", "stride_sn", "stride_ys", "stride_ym")
    ptrs = {"w_ptr": "*u8", "s_ptr": "*u8", "gs_ptr": "*fp32", "gx_ptr": "*fp32", "y_ptr": "*bf16"}
    for kind, x, group, mx_, w4a4 in (
        ("nvfp4", "*bf16", 16, False, False),
        ("mxfp4", "*bf16", 32, True, False),
        ("nvfp4 fp32 x", "*fp32", 16, False, False),
        ("nvfp4_w4a4", "*fp16", 16, False, True),
    ):
        consts = dict(GROUP_SIZE=group, MX=mx_, W4A4=w4a4, X_IS_FP32=x == "*fp32", SPLIT_K=2)
        yield f"fp4_gemm {kind}", fp4._fp4_gemm_kernel, {"x_ptr": x, **ptrs, **gemm}, consts, fp4._configs(), 80
    sig = {"x_ptr": "*bf16", "q_ptr": "*fp16", "gx_ptr": "*fp32", **ints("K", "stride_xm", "stride_qm")}
    yield "quantize nvfp4", fp4._quantize_nvfp4_kernel, sig, {"BLOCK": 128}, [None], 80
    sig = {"x_ptr": "*bf16", "w_ptr": "*u8", "s_ptr": "*u8", "y_ptr": "*bf16", **gemm}
    yield "mxfp8_gemm", mx._mxfp8_gemm_kernel, sig, dict(X_IS_FP32=False, SPLIT_K=1), fp4._configs(), 80
    sig = {"a_ptr": "*fp8e4nv", "b_ptr": "*fp8e4nv", "as_ptr": "*fp32", "bs_ptr": "*fp32", "y_ptr": "*bf16"}
    sig |= ints(
        "M", "N", "K", "M_BUCKET", "stride_am", "stride_bn", "stride_asm", "stride_bsn", "stride_ys", "stride_ym"
    )
    yield "fp8_block_gemm", block._fp8_block_gemm_kernel, sig, dict(SCALE_BLOCK=128, SPLIT_K=2), block._configs(), 89
    sig = {"x_ptr": "*bf16", "q_ptr": "*u8", "s_ptr": "*fp32", **ints("K", "stride_xm", "stride_qm", "stride_sm")}
    yield "quantize per group", block._quantize_group_kernel, sig, {"GROUP": 128}, [None], 89


def compile_only(archs: list[int], first_config: bool) -> int:
    """Compile the new kernels to cubins for each compute capability, every autotune config (or
    the first), without a GPU (ptxas ships with triton): catches what the interpreter cannot."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    failed = 0
    for name, kernel, sig, consts, configs, lowest in _compile_cases():
        while not isinstance(kernel, JITFunction):  # the autotuner's wrapped kernel
            kernel = kernel.fn
        for arch in (a for a in archs if a >= lowest):
            for cfg in configs[:1] if first_config else configs:
                meta = consts | (cfg.kwargs if cfg else {})
                opts = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages} if cfg else {"num_warps": 4}
                src = ASTSource(
                    fn=kernel,
                    signature=sig | dict.fromkeys(meta, "constexpr"),
                    constexprs=meta,
                )
                try:
                    triton.compile(src, target=GPUTarget("cuda", arch, 32), options=opts)
                    status = "ok"
                except Exception as e:  # noqa: BLE001 - a kernel that does not compile is the result
                    failed, status = failed + 1, f"FAILED {type(e).__name__}: {str(e).splitlines()[0][:200]}"
                print(f"compile {name} sm_{arch} {cfg.kwargs if cfg else ''}: {status}", flush=True)
    print(f"{failed} failed")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--interpret", action="store_true", help="run on the CPU under TRITON_INTERPRET=1, tiny shapes")
    p.add_argument("--only", nargs="+", choices=PARTS, default=list(PARTS))
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--budget", type=float, default=210.0, help="seconds; later rows are skipped (and counted)")
    p.add_argument("--cpu-twins", action="store_true", help="time the new formats' twins on the CPU instead")
    p.add_argument("--compile", nargs="+", type=int, metavar="SM", help="only compile the new kernels for these archs")
    p.add_argument("--first-config", action="store_true", help="with --compile: the first autotune config only")
    a = p.parse_args(argv)
    if a.cpu_twins:
        cpu_twins(a.reps)
        return 0
    if a.compile:
        if os.environ.get("TRITON_INTERPRET") == "1":
            print("--compile needs TRITON_INTERPRET unset (the interpreter has no compiler)", file=sys.stderr)
            return 2
        return compile_only(a.compile, a.first_config)
    if a.interpret:
        os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported
    elif not torch.cuda.is_available():
        print("no CUDA device: run with --interpret to check the kernels on the CPU", file=sys.stderr)
        return 2
    check = Check(a.interpret, a.reps, a.budget)
    device = "CPU, TRITON_INTERPRET=1" if a.interpret else torch.cuda.get_device_name()
    print(f"gpu_check on {device}, activations {str(check.dtype)[6:]}", flush=True)
    for part in a.only:
        globals()[f"check_{part}"](check)
    print(check.table())
    ok = len(check.rows) - check.failed - check.skipped
    print(f"{ok} of {len(check.rows)} ok, {check.skipped} skipped; {time.perf_counter() - check.t0:.0f} s")
    return 1 if check.failed else 0


if __name__ == "__main__":
    sys.exit(main())
