"""Does GPTQ gain from seeing the activations as they are served (fp8-block: fp8 per token and
group of 128)? Two trials, neither shipped (docs/benchmarks.md, "FP8 block-wise on gemma3:
where the increase is").

    OMP_NUM_THREADS=1 python benchmarks/served_acts.py layers [--layers 4,12] [--scheme fp8-block]
    OMP_NUM_THREADS=1 python benchmarks/served_acts.py run gptq -m gemma3-270m --scheme fp8-block ... -o OUT

`layers`: the float model (transformers, fp32) on 32 news rows × 512 (seed 0); each listed
block's linears quantized by GPTQ (damping 0.05, 2 refinement passes, act-order static) on
the Hessian of rows 0–15's inputs as they are (x) and as served (x~, fake-quantized), each
scored on rows 16–31 by the served error E‖W·x − Q·x~‖² over round to nearest's; the
activations' own share is the same error with Q = W.

`run ARGS`: `quantkit ARGS` with GPTQ's step wrapped so that every targeted linear of the
block being calibrated reads fake-quantized activations (a forward pre-hook), as the engine
serves them: the Hessians, the float targets' statistics and the stream passed to the next
block all see them (the float copy of `--float-targets` does not)."""

from __future__ import annotations

import argparse
import sys

import torch

from quantkit.runtime.qlinear_float import fake_quantize_input
from quantkit.scheme import preset


def layers(argv: list[str]) -> None:
    from transformers import AutoModelForCausalLM

    from quantkit.calibration.datasets import calibration_samples, load_documents
    from quantkit.calibration.gptq import quantize_weight
    from quantkit.models.loading import load_tokenizer, resolve_model
    from quantkit.primitives import fake_quantize

    p = argparse.ArgumentParser()
    p.add_argument("--model", default="gemma3-270m")
    p.add_argument("--layers", default="4,12")
    p.add_argument("--scheme", default="fp8-block")
    a = p.parse_args(argv)
    scheme, rows, seq = preset(a.scheme), 32, 512
    path = resolve_model(a.model)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = calibration_samples(load_tokenizer(path), load_documents("news"), rows, seq, 0)
    stats: list[dict] = [{}, {}]  # per half: name -> [Σ x xᵀ, Σ x x~ᵀ, Σ x~ x~ᵀ, tokens], float64
    half = [0]

    def record(name):
        def hook(module, args, output):
            x = args[0].reshape(-1, args[0].shape[-1])
            xq = fake_quantize_input(x, scheme.input_activations, None).double()
            x = x.double()
            s = stats[half[0]].setdefault(name, [0, 0, 0, 0])
            s[0], s[1], s[2], s[3] = s[0] + x.T @ x, s[1] + x.T @ xq, s[2] + xq.T @ xq, s[3] + x.shape[0]

        return hook

    linears = {}
    for i in (int(v) for v in a.layers.split(",")):
        for n, m in model.model.layers[i].named_modules():
            if isinstance(m, torch.nn.Linear):
                linears[f"{i}.{n}"] = m
                m.register_forward_hook(record(f"{i}.{n}"))
    with torch.no_grad():
        for r in range(0, rows, 4):
            half[0] = r // (rows // 2)
            model(ids[r : r + 4])

    def served(W, Q, s):  # E‖W·x − Q·x~‖² per token, from the held-out sums
        H, C, Hq, n = s
        W, Q = W.double(), Q.double()
        return ((W @ H * W).sum() - 2 * (W @ C * Q).sum() + (Q @ Hq * Q).sum()).item() / n

    args, totals = scheme.weights, [0.0] * 4
    print(f"{a.model} {a.scheme}: served error over round to nearest's (held-out rows)")
    print(f"{'linear':22s} GPTQ on H(x)  GPTQ on H(x~)  activations alone")
    for name, m in linears.items():
        W, (calib, held) = m.weight.detach(), (h[name] for h in stats)
        H, Hq = (2 * calib[0] / calib[3]).float(), (2 * calib[2] / calib[3]).float()
        errors = [
            served(W, fake_quantize(W, args), held),
            served(W, quantize_weight(W, H, args, 128, 0.05, refine=2).weight, held),
            served(W, quantize_weight(W, Hq, args, 128, 0.05, refine=2).weight, held),
            served(W, W, held),
        ]
        totals = [t + e for t, e in zip(totals, errors)]
        show(name, errors)
    show("all, summed", totals)


def show(name: str, errors: list[float]) -> None:
    ratios = [e / errors[0] for e in errors[1:]]
    print(f"{name:22s} {ratios[0]:12.3f} {ratios[1]:14.3f} {ratios[2]:18.3f}", flush=True)


def run(argv: list[str]) -> None:
    import quantkit.calibration.gptq as gptq
    from quantkit.calibration.hooks import targets
    from quantkit.cli import app

    shipped = gptq.gptq_step

    def served_step(spec, scheme, options, results, scale_dtype, log=None):
        inner, acts = shipped(spec, scheme, options, results, scale_dtype, log), scheme.input_activations

        def step(index, prefix, block, inputs):
            names = targets(scheme, prefix, spec.for_block(block).linears)
            mine = {id(block.get_submodule(n)) for n in names}  # not the float copy's (--float-targets)

            def quantize_input(module, args):
                if id(module) in mine:
                    return (fake_quantize_input(args[0], acts, None), *args[1:])

            hooks = [block.get_submodule(n).register_forward_pre_hook(quantize_input) for n in names]
            try:
                return inner(index, prefix, block, inputs)
            finally:
                for hook in hooks:
                    hook.remove()

        for attr in ("state", "restore"):
            if hasattr(inner, attr):
                setattr(step, attr, getattr(inner, attr))
        return step

    gptq.gptq_step = served_step
    app(argv)


if __name__ == "__main__":
    {"layers": layers, "run": run}[sys.argv[1]](sys.argv[2:])
