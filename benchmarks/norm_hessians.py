"""Trial, not shipped (docs/benchmarks.md, "FP8 block-wise on gemma3: where the increase is"):
GPTQ with the Hessians of the linears whose outputs an RMSNorm divides (Gemma 3's o_proj and
down_proj, before its post-attention and post-feedforward norms) weighted per token by
1 / mean(y²), y = W·x the float output: to first order the loss sees each token's output
error divided by that output's root mean square.

    OMP_NUM_THREADS=1 python benchmarks/norm_hessians.py gptq -m gemma3-270m --scheme fp8-block ... -o OUT

`NORM_HESSIANS=o_proj,down_proj` (the default) names the linears by suffix; every other
Hessian is GPTQ's own."""

from __future__ import annotations

import os
import sys

import torch

import quantkit.calibration.gptq as gptq
from quantkit.cli import app

KINDS = tuple(os.environ.get("NORM_HESSIANS", "o_proj,down_proj").split(","))
shipped = gptq.reduce_inputs


def weighted(W: torch.Tensor):
    """`accumulate_hessian`'s running average, each token weighted by 1 / mean((W·x)²)."""

    def add(H, x, n):
        x = x.reshape(-1, x.shape[-1]).float()  # x [t, in]
        ms = (x @ W.T.float()).pow(2).mean(-1)
        w = 1.0 / ms.clamp_min(1e-4 * ms.median().clamp_min(1e-30))
        if H is None:
            H, n = torch.zeros(x.shape[1], x.shape[1], device=x.device), 0.0
        total = n + w.sum().item()  # the weights seen so far stand for the token count
        return torch.addmm(H, (x * w[:, None]).T, x, beta=n / total, alpha=2 / total), total

    return add


def reduce_inputs(block, linear, inputs, name, add, replay=None):
    if name.endswith(KINDS) and add is gptq.accumulate_hessian:
        add = weighted(linear.weight.detach())
    return shipped(block, linear, inputs, name, add, replay)


if __name__ == "__main__":
    gptq.reduce_inputs = reduce_inputs
    app(sys.argv[1:])
