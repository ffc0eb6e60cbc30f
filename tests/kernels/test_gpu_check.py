"""benchmarks/gpu_check.py, the prepared GPU check, smoke-tested on the CPU (TRITON_INTERPRET=1,
tiny shapes): it passes with the kernels as they are, and exits 1 with a MISMATCH row when a
kernel disagrees with its twin. Its `--compile` mode compiles the new kernels to sm_90 cubins
without a GPU (triton ships ptxas), which the interpreter cannot check."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"


@pytest.fixture
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(autouse=True)
def _interpreting():
    from quantkit.kernels.fp4 import triton as kmod

    if not kmod.INTERPRET:
        pytest.skip("a GPU is here: run benchmarks/gpu_check.py itself")


def test_the_check_passes_on_the_kernels(gpu_check, capsys):
    assert gpu_check.main(["--interpret", "--only", "fp4", "fp8_block", "--reps", "1"]) == 0
    out = capsys.readouterr().out
    assert "| fp4_gemm nvfp4 | 5x256->72 | ok |" in out and "| fp8_block_gemm 128x128 | 1x384->40 | ok |" in out
    assert "16 of 16 ok, 0 skipped" in out  # 4 shapes: nvfp4, mxfp4, nvfp4_w4a4 and fp8 block each


def test_a_mismatch_exits_1(gpu_check, capsys, monkeypatch):
    from quantkit.kernels.fp4 import triton as kmod
    from quantkit.kernels.fp4 import twin

    wrong = lambda x, *weight: twin.fp4_gemm(x, *weight) * 1.05  # noqa: E731
    monkeypatch.setattr(kmod, "fp4_gemm", wrong)
    assert gpu_check.main(["--interpret", "--only", "fp4", "--reps", "1"]) == 1
    assert "| fp4_gemm mxfp4 | 1x256->72 | MISMATCH |" in capsys.readouterr().out


def test_a_failing_kernel_exits_1(gpu_check, capsys, monkeypatch):
    from quantkit.kernels.fp8 import block_triton as kmod

    def broken(*args):
        raise ValueError("fp8_block_gemm: broken on purpose.")

    monkeypatch.setattr(kmod, "fp8_block_gemm", broken)
    assert gpu_check.main(["--interpret", "--only", "fp8_block", "--reps", "1"]) == 1
    assert "ERROR ValueError: fp8_block_gemm: broken on purpose." in capsys.readouterr().out


def test_rows_past_the_budget_are_skipped_and_counted(gpu_check, capsys):
    assert gpu_check.main(["--interpret", "--only", "fp8_block", "--budget", "0"]) == 0
    out = capsys.readouterr().out
    assert "| fp8_block_gemm 128x128 | 1x256->72 | skipped (budget) |" in out and "0 of 4 ok, 4 skipped" in out


def test_the_new_kernels_compile_for_hopper():
    """Every new kernel in each variant its launcher uses, the first autotune config, to an sm_90
    cubin (`--compile 80 90 100` without --first-config covers every config: ~6 minutes here)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"TRITON_DEFAULT_FP_FUSION": "1"}
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--compile", "90", "--first-config"], env=env, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert run.stdout.count(": ok") == 8 and "0 failed" in run.stdout
