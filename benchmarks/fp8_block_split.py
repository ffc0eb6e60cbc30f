"""Where fp8-block's perplexity increase comes from: the float model, the 128 x 128 weight
blocks alone (activations float), the activations alone (fp8 per token and group of 128,
weights float), and both (the checkpoint as `quantkit.load` runs it), side by side in one run.

    python benchmarks/fp8_block_split.py --model gemma3-270m --windows 8 [--checkpoint CKPT] [--by-projection]

The checkpoint is made with `quantkit fp8 --scheme fp8-block` (round to nearest) into --out
unless it is there, or --checkpoint names one (e.g. `quantkit gptq --scheme fp8-block`'s).
--by-projection adds a row per projection kind (q_proj, k_proj, ...): the checkpoint's
weights for that kind's linears alone, every other linear and every activation float.
It also lists what the checkpoint quantizes (every other module stays as the float model's:
embeddings, norms, lm_head) and the dtype the evaluation runs in."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from quantkit.eval.run import load_for_eval, text_perplexity
from quantkit.pipeline.quantize import Calibration, quantize
from quantkit.runtime.qlinear_float import FloatQDQLinear, fake_quantize_input
from quantkit.scheme import preset

ACTS = preset("fp8-block").input_activations


class WeightsOnly(nn.Module):
    """A `FloatQDQLinear`'s dequantized weight on float activations."""

    def __init__(self, m: FloatQDQLinear):
        super().__init__()
        self.weight, self.bias = m.weight, m.bias

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)


class ActsOnly(nn.Module):
    """A float linear on activations fake-quantized as fp8-block's."""

    def __init__(self, m: nn.Linear):
        super().__init__()
        self.weight, self.bias = m.weight, m.bias

    def forward(self, x):
        return F.linear(fake_quantize_input(x, ACTS, None), self.weight, self.bias)


def swap(model: nn.Module, names: list[str], make) -> None:
    for name in names:
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, make(model.get_submodule(name)))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="gemma3-270m")
    p.add_argument("--windows", type=int, default=8)
    p.add_argument("--out", type=Path, default=Path("out/fp8-block-split"))
    p.add_argument("--checkpoint", type=Path, help="an fp8-block checkpoint to split (default: RTN's, made in --out)")
    p.add_argument("--by-projection", action="store_true", help="also each projection kind's weights alone")
    a = p.parse_args()
    ckpt = a.checkpoint or a.out / "fp8-block"
    if a.checkpoint is None and not ckpt.exists():
        quantize(a.model, preset("fp8-block"), ckpt, "fp8", Calibration("news", 8, 512, 0))
    a.out.mkdir(parents=True, exist_ok=True)
    results_path = a.out / f"results-{ckpt.name}-{a.windows}.json"
    results = json.loads(results_path.read_text()) if results_path.exists() else {}
    qmodel, tokenizer = load_for_eval(str(ckpt))
    quantized = [n for n, m in qmodel.named_modules() if isinstance(m, FloatQDQLinear)]
    others = sorted(
        {type(m).__name__ for n, m in qmodel.named_modules() if n and not list(m.children())} - {"FloatQDQLinear"}
    )
    print(f"{len(quantized)} linears quantized, e.g. {quantized[:7]}; every other leaf module is float: {others}")
    print(f"evaluation dtype: {next(qmodel.parameters()).dtype}")

    def run(name: str, model: nn.Module) -> None:
        if name not in results:
            start = time.perf_counter()
            with torch.no_grad():
                ppl = text_perplexity(model, tokenizer, "wiki", 2048, a.windows)["ppl"]
            results[name] = {"ppl": ppl, "eval_s": time.perf_counter() - start}
            results_path.write_text(json.dumps(results, indent=2))
        print(name, results[name], flush=True)

    run("fp8-block (weights and activations)", qmodel)
    swap(qmodel, quantized, WeightsOnly)
    run("weights only (128 x 128 blocks)", qmodel)
    weights = {n: qmodel.get_submodule(n).weight for n in quantized}
    del qmodel  # one model in memory at a time (gemma3's logits alone take 2 GiB a window)
    fmodel = load_for_eval(a.model)[0]
    run("float", fmodel)
    kinds = sorted({n.rpartition(".")[2] for n in quantized}) if a.by_projection else []
    for kind in kinds:  # the checkpoint's weights for one kind of projection, the rest float
        mine = [n for n in quantized if n.endswith("." + kind)]
        kept = {n: fmodel.get_submodule(n).weight for n in mine}
        for n in mine:
            fmodel.get_submodule(n).weight = weights[n]
        run(f"weights only, {kind} alone", fmodel)
        for n in mine:
            fmodel.get_submodule(n).weight = kept[n]
    del weights
    swap(fmodel, quantized, ActsOnly)
    run("activations only (fp8, per token and 128 columns)", fmodel)
    base = results["float"]["ppl"]
    print(f"\n| {a.model} | wiki ppl ({a.windows} x 2048) | vs float |\n|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['ppl']:.4f} | {100 * (r['ppl'] - base) / base:+.2f}% |")


if __name__ == "__main__":
    main()
