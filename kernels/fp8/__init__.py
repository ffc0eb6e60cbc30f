"""W8A8 fp8 GEMM (e4m3 weights, activations quantized per token or with a static scale): its
candidates, fastest first, the twin last (`quantkit.kernels.choice`). A problem gives `dtype`
(the activations'), `weight` fp8 [N, K], `scales` and `input_scale` (None: dynamic)."""

from __future__ import annotations

from quantkit.kernels.choice import Candidate, Problem, always, triton_module
from quantkit.kernels.fp8 import twin as fp8_twin


def _triton_ok(p: Problem) -> tuple[bool, str]:
    return (True, "") if triton_module("fp8.triton", p) is not None else (False, "triton is not installed")


def _triton(p: Problem):
    kernel, weight = triton_module("fp8.triton", p).fp8_gemm, (p.weight, p.scales, p.input_scale)
    return lambda x: kernel(x, *weight)


def _twin(p: Problem):
    weight = (p.weight, p.scales, p.input_scale)
    return lambda x: fp8_twin.fp8_gemm(x, *weight)


CANDIDATES = [
    Candidate("fp8_gemm (Triton)", _triton_ok, _triton, device="cuda", backend="triton"),
    Candidate("fp8 twin (dequantizes on every call)", always, _twin, backend="torch"),
]
