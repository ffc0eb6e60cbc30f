"""How much an AWQ-style input-channel scale can cut a layer's output error on each weight grid.

    OMP_NUM_THREADS=1 python benchmarks/awq_grid_gain.py [--model gemma3-270m] [--linear model.layers.5.mlp.gate_proj]

One real weight W [out, in] of the built-in model and synthetic inputs X whose channels have
log-normal magnitudes m with 8 outlier channels ×30 (the activation shape AWQ targets); for each
grid, the output error ‖(Q(W·diag(s))·diag(s)⁻¹ − W)·Xᵀ‖² with s = 1 and with s = m^α over
`awq.search_scales`' default α grid (0, 1/20, ..., 19/20; it also normalises s, which min-max
scales do not feel), min-max scales (no clipping). On an integer grid with shared group scales,
scaling the salient channels up buys them precision; on a floating-point grid (fp8 e4m3) each weight's
rounding error is already relative to its own size, so scaling moves little.
"""

from __future__ import annotations

import argparse

import torch
from safetensors import safe_open

from quantkit.models.loading import resolve_model
from quantkit.primitives import compute_qparams, fake_quantize
from quantkit.scheme import preset

GRID = 20  # AWQ's default grid: α = 0, 1/20, ..., 19/20 (α = 0 is s = 1)
SCHEMES = {"fp8-block": None, "mxfp8": None, "w4a16": 128, "nvfp4a16": None, "mxfp4a16": None}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gemma3-270m")
    p.add_argument("--linear", default="model.layers.5.mlp.gate_proj")
    a = p.parse_args()
    torch.manual_seed(0)
    with safe_open(str(resolve_model(a.model) / "model.safetensors"), "pt") as f:
        W = f.get_tensor(f"{a.linear}.weight").float()
    n = W.shape[1]
    m = torch.exp(torch.randn(n))
    m[torch.randperm(n)[:8]] *= 30
    X = torch.randn(4096, n) * m

    def error(args, s):
        Ws = W * s
        return (((fake_quantize(Ws, args, *compute_qparams(Ws, args)) / s - W) @ X.T).square().mean()).item()

    print(f"{a.model} {a.linear} {tuple(W.shape)}, 4096 synthetic tokens\n")
    print("| grid | error, s = 1 | best s = m^α | α | ratio |\n|---|---|---|---|---|")
    for name, group in SCHEMES.items():
        scheme = preset(name) if group is None else preset(name).with_group_size(group)
        args = scheme.weights
        base = error(args, torch.ones(n))
        best, alpha = min((error(args, m ** (i / GRID)), i / GRID) for i in range(GRID))
        print(f"| {name} | {base:.4g} | {best:.4g} | {alpha} | {best / base:.3f} |")


if __name__ == "__main__":
    main()
