"""Per linear: does GPTQ's range search end with less layer error than min-max ranges?

    OMP_NUM_THREADS=1 python benchmarks/gptq_range_layers.py [--model gemma3-270m] [--layers 4,12]
        [--scheme w4a16-asym] [--group-size 64] [--full-range]

With --full-range (a symmetric scheme) the two runs are the range search as shipped and the
same search without its full-range candidates (`calibration.awq._full_range` switched off for
that run): below 1, the full-range grids gain.

The float model (transformers, fp32) runs 32 news rows × 512 (seed 0); each listed block's
linears' inputs make two Hessians, one of rows 0–15 (calibration) and one of rows 16–31
(held out). Each linear is GPTQ-quantized on the calibration Hessian as `quantkit gptq` does
by default (act-order static, `GPTQOptions`' defaults: damping 0.05, 2 refinement passes), once with the range search
and once with min-max ranges, and the printed ratio is the search's layer error over min-max's,
tr((W − Q)·H·(W − Q)ᵀ) under the undamped H, on both Hessians. Below 1: the search gains.
The blocks' inputs are the float model's, not the quantized blocks' (a layer-level view).
"""

from __future__ import annotations

import argparse
import dataclasses

import torch
from transformers import AutoModelForCausalLM

from quantkit.calibration import awq
from quantkit.calibration.datasets import calibration_samples, load_documents
from quantkit.calibration.gptq import accumulate_hessian, quantize_weight
from quantkit.calibration.registry import GPTQOptions
from quantkit.models.loading import load_tokenizer, resolve_model
from quantkit.scheme import preset

ROWS, SEQ = 32, 512


def error(W: torch.Tensor, Q: torch.Tensor, H: torch.Tensor) -> float:
    D = (W - Q).double()
    return (D @ H.double() * D).sum().item()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gemma3-270m")
    p.add_argument("--layers", default="4,12", help="block indices, comma-separated")
    p.add_argument("--scheme", default="w4a16-asym")
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--full-range", action="store_true", help="the search with its full-range grids over without them")
    a = p.parse_args()
    path = resolve_model(a.model)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = calibration_samples(load_tokenizer(path), load_documents("news"), ROWS, SEQ, 0)
    layers = [int(x) for x in a.layers.split(",")]
    hessians: list[dict[str, tuple[torch.Tensor, int]]] = [{}, {}]  # (H, tokens): calibration rows, held-out rows
    half = [0]

    def hook(name):
        def record(module, args, output):
            H, n = hessians[half[0]].get(name, (None, 0))
            hessians[half[0]][name] = accumulate_hessian(H, args[0], n)

        return record

    linears = {}
    for i in layers:
        for name, module in model.model.layers[i].named_modules():
            if isinstance(module, torch.nn.Linear):
                linears[f"{i}.{name}"] = module
                module.register_forward_hook(hook(f"{i}.{name}"))
    with torch.no_grad():
        for r in range(0, ROWS, 4):
            half[0] = r // (ROWS // 2)
            model(ids[r : r + 4])
    args = dataclasses.replace(preset(a.scheme).weights, group_size=a.group_size, actorder="static")
    o = GPTQOptions()  # the command's defaults
    what = "with its full-range grids / without" if a.full_range else "/ min-max ranges"
    print(f"{a.model} {a.scheme} g{a.group_size}: layer error of the range search {what}")
    shipped, sums = awq._full_range, [0.0] * 4

    def run(W, H, search, full):
        awq._full_range = shipped if full else (lambda args: False)
        try:
            return quantize_weight(W, H, args, o.block_size, o.damp, range_search=search, refine=o.refine).weight
        finally:
            awq._full_range = shipped

    for name, module in linears.items():
        W, (calib, held) = module.weight.detach(), (h[name][0] for h in hessians)
        pair = ((True, True), (True, False)) if a.full_range else ((True, True), (False, True))
        got = [run(W, calib, search, full) for search, full in pair]
        errors = [error(W, q, H) for H in (calib, held) for q in got]
        sums = [t + e for t, e in zip(sums, errors)]
        print(f"{name:26s} calibration {errors[0] / errors[1]:.3f}  held out {errors[2] / errors[3]:.3f}", flush=True)
    print(f"{'all, summed':26s} calibration {sums[0] / sums[1]:.3f}  held out {sums[2] / sums[3]:.3f}")


if __name__ == "__main__":
    main()
