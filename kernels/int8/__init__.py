"""The int8-weight GEMMs, each a list of candidates, fastest first, the twin last
(`quantkit.kernels.choice`):

- `W8A16`: y = x · dequant(W)ᵀ from pack-quantized int8 weights. A problem gives `dtype` (the
  activations'), `ints` int8 [N, K], `scales`, `zeros` (unpacked, or None), `args` (QuantArgs)
  and `g_idx`.
- `W8A8`: x quantized to int8 per token, int32 products. A problem gives `dtype`, `weight` int8
  [N, K] and `scales` [N, 1] or [1]. oneDNN (with the C++ quantizer) comes first and runs bf16
  activations and, on a CPU with AMX-INT8, fp32 ones (faster there from 64 rows, measured in
  docs/benchmarks.md); for fp32 activations without AMX-INT8 it steps aside for the AVX2 /
  AVX-512 VNNI kernel (`avx.py`, faster there), which `QUANTKIT_ISA=avx2|avx512` also forces.
  On AVX2 without VNNI oneDNN's int8 sums saturate (`onednn.saturates`), so it refuses there
  and the AVX2 kernel takes every activation dtype.

`build` returns x -> y, with the kernel's own layout of the weight, where it makes one, as
`.weight`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from quantkit.errors import QuantkitError
from quantkit.kernels.choice import Candidate, Problem, always
from quantkit.kernels.int4 import avx as cpu_int4_avx
from quantkit.kernels.int4 import bind
from quantkit.kernels.int8 import avx as w8a8_avx
from quantkit.kernels.int8 import cpp as cpu_w8a8
from quantkit.kernels.int8 import int8pack, onednn
from quantkit.kernels.int8 import twin as int8_twin
from quantkit.primitives import dequantize


def _per_channel(p: Problem) -> str:
    return "" if p.args.symmetric and p.args.strategy == "channel" else "its weights are not symmetric per-channel"


def _avx_ok(p: Problem) -> tuple[bool, str]:
    fp32 = "" if p.dtype == torch.float32 else f"its activations are {str(p.dtype)[6:]}; it takes float32"
    why = fp32 or _per_channel(p) or cpu_int4_avx.choose_isa()[1]
    return not why, why


def _int8pack_ok(p: Problem) -> tuple[bool, str]:
    if _per_channel(p):
        return False, _per_channel(p)
    why = int8pack.int8_unsupported(*p.ints.shape)
    return not why, why or ""


def _dense(p: Problem):
    dense = dequantize(p.ints, p.scales, p.zeros, p.args, p.g_idx).to(p.dtype)
    return bind(F.linear, dense)


W8A16 = [
    Candidate(
        "int8 AVX2/AVX-512 (quantkit C++)",
        _avx_ok,
        lambda p: bind(cpu_int4_avx.gemm_int8, cpu_int4_avx.repack_int8(p.ints, p.scales)[0]),
        device="cpu",
    ),
    Candidate(
        "int8pack (torch CPU)",
        _int8pack_ok,
        lambda p: bind(int8pack.int8_gemm_cpu, int8pack.repack_int8_cpu(p.ints, p.scales)),
        device="cpu",
    ),
    Candidate("dequantized once (F.linear)", always, _dense, backend="torch"),
]


def _int_mm_ok(p: Problem) -> tuple[bool, str]:
    from quantkit.kernels.int8 import int_mm as int8_gemm

    why = int8_gemm.unsupported(*p.weight.shape, p.device)
    return not why, why or ""


def _int_mm(p: Problem):
    from quantkit.kernels.int8 import int_mm as int8_gemm

    weight, scales = p.weight, p.scales
    return lambda x: int8_gemm.int8_gemm(x, weight, scales)


def _onednn_ok(p: Problem) -> tuple[bool, str]:
    why = onednn.w8a8_unsupported(*p.weight.shape)
    return not why, why or ""


def _onednn_cpp_ok(p: Problem) -> tuple[bool, str]:
    if p.dtype == torch.float32 and _w8a8_avx_ok(p)[0]:
        return False, "for float32 activations on a CPU without AMX-INT8 the AVX W8A8 kernel is faster"
    ok, why = _onednn_ok(p)
    if ok and cpu_w8a8.load() is None:
        return False, f"its activations are quantized by torch ops: {cpu_w8a8.reason()}"
    return ok, why


def _onednn(elementwise: bool):
    return lambda p: bind(onednn.w8a8_gemm_cpu, onednn.prepack_w8a8(p.weight, p.scales, elementwise))


def _w8a8_avx_ok(p: Problem) -> tuple[bool, str]:
    # any float activations (converted to fp32 in the call); oneDNN, before it in the list, takes
    # bf16 wherever its sums are exact
    if p.scales.numel() not in (1, p.weight.shape[0]):
        return False, "its weight scales are neither per channel nor per tensor"
    if not w8a8_avx.forced() and w8a8_avx.has_amx_int8():  # before choose_isa: no build where it is not used
        return False, "this CPU has AMX-INT8, where oneDNN's int8 GEMM is faster from 64 rows (QUANTKIT_ISA forces it)"
    why = w8a8_avx.choose_isa()[1]
    return not why, why


def _w8a8_avx(p: Problem):
    weight, why = w8a8_avx.repack(p.weight, p.scales)
    if weight is None:
        raise QuantkitError(f"the AVX W8A8 kernel cannot take this weight: {why}.")
    return bind(w8a8_avx.gemm, weight)


def _twin(p: Problem):
    weight, scales = p.weight, p.scales
    return lambda x: int8_twin.int8_gemm(x, weight, scales)


W8A8 = [
    Candidate("torch._int_mm", _int_mm_ok, _int_mm, device="cuda", backend="triton"),
    Candidate("oneDNN int8 GEMM (torch CPU)", _onednn_cpp_ok, _onednn(True), device="cpu"),
    Candidate("W8A8 AVX2/AVX-512 VNNI (quantkit C++)", _w8a8_avx_ok, _w8a8_avx, device="cpu"),
    Candidate("oneDNN int8 GEMM (torch CPU), torch-op quantization", _onednn_ok, _onednn(False), device="cpu"),
    Candidate("int8 twin (dequantizes on every call)", always, _twin, backend="torch"),
]
