"""The float linear (y = x · Wᵀ + b) of fp32 models on the CPU: its candidates, fastest first, the
twin last (`quantkit.kernels.choice`). `build` returns (x, weight, bias) -> y for a weight kept as
`nn.Linear` keeps it. bf16 float linears take oneDNN's prepacked GEMM instead (`kernels/cpu.py`,
bound by `quantkit.runtime.qlinear.prepack`).
"""

from __future__ import annotations

import torch

from quantkit.kernels.choice import Candidate, Problem, always, fixed
from quantkit.kernels.dense import cpp as cpu_dense
from quantkit.kernels.dense import twin as dense_twin


def _cpp_ok(p: Problem) -> tuple[bool, str]:
    if p.dtype != torch.float32:
        return False, f"its activations are {str(p.dtype)[6:]}; it takes float32"
    if cpu_dense.load() is None:
        return False, cpu_dense.reason()
    return True, ""


LINEAR = [  # (x [..., K], weight [N, K], bias [N] | None) -> y [..., N]
    Candidate("fp32 GEMV at 3-4 rows (quantkit C++), MKL otherwise", _cpp_ok, fixed(cpu_dense.linear), device="cpu"),
    Candidate("F.linear", always, fixed(dense_twin.linear), backend="torch"),
]
