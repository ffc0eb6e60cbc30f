"""The element-wise steps of a decoder block and the greedy sampler's argmax: each operation's
candidates, fastest first, the twin last (`quantkit.kernels.choice`).

A problem gives `dtype` (the activations') and `dtypes`, the other operands' dtypes (a norm's
weight, the rotary tables); the C++ kernels take operands of one dtype on the CPU.
"""

from __future__ import annotations

from quantkit.kernels.choice import Candidate, Problem, always, fixed
from quantkit.kernels.elementwise import cpp as cpu_fused
from quantkit.kernels.elementwise import twin as elementwise_twin

CPP = "quantkit C++"


def _cpp_ok(p: Problem) -> tuple[bool, str]:
    other = [d for d in getattr(p, "dtypes", ()) if d != p.dtype]
    if other:
        return False, f"it takes operands of one dtype, not {p.dtype} with {other[0]}"
    if cpu_fused.load() is None:
        return False, cpu_fused.reason()
    return True, ""


def _cpp(op: str) -> Candidate:
    return Candidate(CPP, _cpp_ok, lambda p: getattr(cpu_fused.load(), op), device="cpu")


def _twin(fn) -> Candidate:
    return Candidate("torch ops", always, fixed(fn), backend="torch")


RMS_NORM = [_cpp("rms_norm"), _twin(elementwise_twin.rms_norm)]  # (x, weight, eps, gemma) -> y
ADD_RMS_NORM = [_cpp("add_rms_norm_"), _twin(elementwise_twin.add_rms_norm_)]  # (x, delta, weight, eps, gemma) -> y
ROPE = [_cpp("rope_"), _twin(elementwise_twin.rope_)]  # (x, cos, sin_signed) -> None, x in place
SILU_MUL = [_cpp("silu_mul"), _twin(elementwise_twin.silu_mul)]  # (gate_up) -> y
ARGMAX = [  # (logits [rows, vocab]) -> int64 [rows]
    _cpp("argmax"),
    Candidate("torch, two levels", always, fixed(cpu_fused.torch_argmax), device="cpu"),
    Candidate("torch argmax", always, fixed(elementwise_twin.argmax), backend="torch"),
]
