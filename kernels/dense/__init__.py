"""The float linear (y = x · Wᵀ + b) of fp32 models on the CPU: its candidates, fastest first, the
twin last (`quantkit.kernels.choice`). `build` returns `bind(weight, bias) -> (x -> y)`: the
runner binds each linear once at load. bf16 float linears take oneDNN's prepacked GEMM instead
(`kernels/cpu.py`, bound by `quantkit.runtime.qlinear.prepack`).

- oneDNN on the weight reordered once (`cpu.prepack_fp32`), for engines that batch sequences
  (`Problem.max_num_seqs` > 1): on the Zen 4 EPYC 1.13-2.23× the MKL / C++ GEMV path at 8-64 rows
  and 1.25-2.61× at 2 rows, 0.76-1.06× at one row (docs/benchmarks.md). The reordered copy replaces
  the plain weight, so the binder frees the plain one (`release`).
- The C++ GEMV at 1-4 rows, MKL otherwise (`cpp.linear`): the batch-1 engine's (it reads each
  weight as one sequential stream: on the Zen 4 EPYC 1.3-4× MKL at 1-4 rows).
- `F.linear`, the twin.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from quantkit.kernels import cpu
from quantkit.kernels.choice import Candidate, Problem, always
from quantkit.kernels.dense import cpp as cpu_dense
from quantkit.kernels.dense import twin as dense_twin

Bind = Callable[[torch.Tensor, torch.Tensor | None], Callable[[torch.Tensor], torch.Tensor]]


def _fp32(p: Problem) -> tuple[bool, str]:
    if p.dtype != torch.float32:
        return False, f"its activations are {str(p.dtype)[6:]}; it takes float32"
    return True, ""


def _packed_ok(p: Problem) -> tuple[bool, str]:
    ok, why = _fp32(p)
    if not ok:
        return ok, why
    if not cpu.fp32_prepack_available():
        return False, "this torch build has no oneDNN"
    if getattr(p, "max_num_seqs", 1) <= 1:
        return False, "the engine decodes one sequence (max_num_seqs 1), where the C++ GEMV reads the weight faster"
    return True, ""


def _cpp_ok(p: Problem) -> tuple[bool, str]:
    ok, why = _fp32(p)
    return cpu_dense.available() if ok else (ok, why)


def _bind_packed(weight: torch.Tensor, bias: torch.Tensor | None):
    packed = cpu.prepack_fp32(weight)
    return lambda x: cpu.packed_linear(x, packed, bias)


def _plain(fn) -> Callable[[Problem], Bind]:
    return lambda problem: lambda weight, bias: lambda x: fn(x, weight, bias)


PACKED = "fp32 GEMM on oneDNN's reordered weight"
LINEAR = [  # build(problem) -> bind(weight [N, K], bias [N] | None) -> (x [..., K] -> y [..., N])
    Candidate(PACKED, _packed_ok, lambda problem: _bind_packed, device="cpu"),
    Candidate("fp32 GEMV at 1-4 rows (quantkit C++), MKL otherwise", _cpp_ok, _plain(cpu_dense.linear), device="cpu"),
    Candidate("F.linear", always, _plain(dense_twin.linear), backend="torch"),
]


def release(modules: list[nn.Module]) -> None:
    """Replace the weights of `modules` by meta tensors (a binder that keeps its own layout has
    read them), so the plain weights are not held twice."""
    for m in modules:
        m.weight = nn.Parameter(torch.empty_like(m.weight, device="meta"), requires_grad=False)
