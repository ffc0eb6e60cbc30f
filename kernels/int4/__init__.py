"""W4A16 GEMM (y = x · dequant(W)ᵀ from pack-quantized int4): its candidates, fastest first,
the twin last (`quantkit.kernels.choice`). A problem gives `dtype` (the activations') and
`weight`, the pack-quantized tensors (w_packed, scales, zeros, group_size, g_idx); `build`
returns x -> y, with the kernel's own layout of the weight, where it makes one, as `.weight`.
"""

from __future__ import annotations

import os

import torch

from quantkit.kernels.choice import Candidate, Problem, always, triton_module
from quantkit.kernels.int4 import avx as cpu_int4_avx
from quantkit.kernels.int4 import cpp as cpu_int4
from quantkit.kernels.int4 import int4pack
from quantkit.kernels.int4 import twin as int4_twin


def bind(fn, weight):
    """x -> fn(x, weight), keeping `weight` (a kernel's layout, built at load) as `.weight`."""
    run = lambda x: fn(x, weight)  # noqa: E731
    run.weight = weight
    return run


def _shape(p: Problem) -> tuple[int, int, int | None, torch.Tensor | None]:
    w_packed, scales, _, group_size, g_idx = p.weight
    return scales.shape[0], w_packed.shape[1] * 8, group_size, g_idx


def _bf16(p: Problem) -> str:
    return "" if p.dtype == torch.bfloat16 else f"its activations are {str(p.dtype)[6:]}; it takes bfloat16"


def _amx_ok(p: Problem) -> tuple[bool, str]:
    if os.environ.get("QUANTKIT_INT4_KERNEL") == "int4pack":
        return False, "QUANTKIT_INT4_KERNEL=int4pack"
    isa = os.environ.get("QUANTKIT_ISA", "").strip().lower()
    if isa in cpu_int4_avx.ISAS:  # a forced AVX path (e.g. the AVX2 one, timed on an AMX machine)
        return False, f"QUANTKIT_ISA={isa}"
    why = _bf16(p) or cpu_int4.amx_unsupported(*_shape(p))
    return not why, why


def _fp32(p: Problem) -> str:
    return "" if p.dtype == torch.float32 else f"its activations are {str(p.dtype)[6:]}; it takes float32"


def _avx_ok(p: Problem) -> tuple[bool, str]:
    why = _fp32(p) or cpu_int4_avx.unsupported(*_shape(p))
    return not why, why


def _avx(p: Problem):
    return bind(cpu_int4_avx.gemm, cpu_int4_avx.repack(*p.weight)[0])


def _int4pack_ok(p: Problem) -> tuple[bool, str]:
    why = _bf16(p) or int4pack.int4_unsupported(*_shape(p)) or ""
    return not why, why


def _amx(p: Problem):
    return bind(cpu_int4.gemm_amx, cpu_int4.repack(*p.weight, kernel="amx")[0])


def _int4pack(p: Problem):
    return bind(cpu_int4.gemm_int4pack, cpu_int4.repack(*p.weight, kernel="int4pack")[0])


def _triton_ok(p: Problem) -> tuple[bool, str]:
    return (True, "") if triton_module("int4.triton", p) is not None else (False, "triton is not installed")


def _triton(p: Problem):
    kernel, weight = triton_module("int4.triton", p).int4_gemm, p.weight
    return lambda x: kernel(x, *weight)


def _twin(p: Problem):
    weight = p.weight
    return lambda x: int4_twin.int4_gemm(x, *weight)


CANDIDATES = [
    Candidate("int4_gemm (Triton)", _triton_ok, _triton, device="cuda", backend="triton"),
    Candidate("int4 AMX (quantkit C++)", _amx_ok, _amx, device="cpu"),
    Candidate("int4 AVX2/AVX-512 (quantkit C++)", _avx_ok, _avx, device="cpu"),
    Candidate("int4pack (torch CPU)", _int4pack_ok, _int4pack, device="cpu"),
    Candidate("int4 twin (dequantizes on every call)", always, _twin, backend="torch"),
]
