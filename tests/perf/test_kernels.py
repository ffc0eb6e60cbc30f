"""The benchmark runs and returns well-formed rows (no timing assertions: speed is not tested)."""

from __future__ import annotations

import torch

from quantkit.kernels.attention import twin as attention_twin
from quantkit.kernels.fp8 import twin as fp8_twin
from quantkit.kernels.int4 import twin as int4_twin
from quantkit.perf import kernels as bench

GEMM_KEYS = {"kernel", "impl", "M", "K=N", "group", "ms", "weight_MB", "GB/s", "%copy", "vs_fp32", "vs_bf16"}
IMPLS = {"dense fp32", "dense bf16", "twin int4 (fp32)", "int4pack bf16"}


def test_run_cpu_quick_rows():
    rows = bench.run_cpu(quick=True, ms=(1, 4), sizes=(256,), reps=5, copy_mb=4)
    gemm = [r for r in rows if r["kernel"] == "gemm"]
    assert len(gemm) == 2 * len(IMPLS) and {r["impl"] for r in gemm} == IMPLS
    for r in gemm:
        assert set(r) == GEMM_KEYS
        assert r["ms"] > 0 and r["GB/s"] > 0 and r["vs_fp32"] > 0 and r["vs_bf16"] > 0
    (copy,) = [r for r in rows if r["kernel"] == "memcpy"]
    assert copy["ms"] > 0 and copy["GB/s"] > 0
    table = bench.to_markdown(rows)
    assert table.splitlines()[0].startswith("| kernel | impl | M |") and "int4pack bf16" in table
    assert f"torch {torch.__version__}" in bench.header("cpu")


def test_run_gpu_code_path_on_cpu_with_the_twins():
    """The GPU run cannot be debugged on the H200: run its code on the CPU, twins as kernels."""
    sizes = bench.GpuSizes(
        k=256,
        group=64,
        int4_ms=(1, 16),
        fp8_ms=(16,),
        seqs=2,
        heads=4,
        kv_heads=2,
        head_dim=32,
        context=40,
        block_size=16,
    )
    impls = {
        "int4_gemm": int4_twin.int4_gemm,
        "fp8_gemm": fp8_twin.fp8_gemm,
        "paged_attention": attention_twin.paged_attention,
    }
    rows = bench.run_gpu(sizes=sizes, impls=impls, device="cpu")
    assert [r["kernel"] for r in rows] == ["int4_gemm"] * 2 + ["fp8_gemm"] + ["paged_attention"] * 2
    for r in rows:
        assert r["ok"] is True and r["ms"] > 0 and r["speedup"] > 0 and r["sqnr_dB"] > 30
    assert bench.run_gpu(sizes=sizes, impls={}, device="cpu")[0]["shape"] == "skipped"
    assert "paged_attention" in bench.to_markdown(rows)
