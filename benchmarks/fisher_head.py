"""The gradient passes' output layer, as shipped against the code before 2026-12-07 (fifth),
side by side in one process: CPU seconds of each whole pass (the blocks' backward included)
and the largest difference between the two, relative to each block's largest gradient.

- `fisher`: `guided.fisher_gradients` (mixed precision's sensitivity) with the head's gradient
  in closed form, one product shared by the draws, against autograd through the head, one
  backward per draw; on the sensitivity's windows (8 x 256).
- `loss`: `guided.loss_gradients` (`--guided`) with the gradient at the head's input alone
  (`torch.autograd.grad`) against `loss.backward()`, which also formed the head's weight
  gradient; on `--guided`'s default rows (8 x 512).

    OMP_NUM_THREADS=1 python benchmarks/fisher_head.py [--model gemma3-270m] [--pass fisher|loss]
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

from quantkit.calibration import guided
from quantkit.calibration.datasets import calibration_samples, load_documents
from quantkit.kernels.attention import twin
from quantkit.models.arch import arch_for
from quantkit.models.loading import load_float_model, resolve_model
from quantkit.pipeline.mixed import FISHER_DRAWS


def sampled_by_autograd(h, final_norm, head, softcap, draws, generator):
    """The reference: ∇_h log p(y|h) by autograd through norm, head and cap, one backward per draw."""
    grads = []
    for x in h:
        x = x[None].detach().requires_grad_()
        with torch.enable_grad():
            logp = twin.cap(nn.functional.linear(final_norm(x), head).float(), softcap)[0].log_softmax(-1)
            y = torch.multinomial(logp.detach().exp().cpu(), draws, replacement=True, generator=generator)
            picked = logp.gather(-1, y.to(logp.device))
            rows = [torch.autograd.grad(picked[:, d].sum(), x, retain_graph=d < draws - 1)[0][0] for d in range(draws)]
        grads.append(torch.stack(rows))
    return torch.stack(grads, 1)


def loss_by_backward(h, rows, final_norm, head, softcap):
    """The code before: the cross-entropy's backward(), the head's weight gradient formed too."""
    grads = []
    for x, ids in zip(h, rows):
        x = x[None].detach().requires_grad_()
        with torch.enable_grad():
            logits = twin.cap(nn.functional.linear(final_norm(x), head).float(), softcap)[0]
            nn.functional.cross_entropy(logits[:-1], ids[1:], reduction="sum").backward()
        grads.append(x.grad[0])
    head.grad = None
    return torch.stack(grads)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--pass", dest="which", default="fisher", choices=("fisher", "loss"))
    a = parser.parse_args()
    model, tokenizer, _ = load_float_model(resolve_model(a.model), owned=True)
    model.float()
    spec = arch_for(model.config)
    rows, seq = (8, 256) if a.which == "fisher" else (8, 512)
    samples = calibration_samples(tokenizer, load_documents("news", "calib"), rows, seq, 0)
    if a.which == "fisher":
        name, before = "_sampled_gradient", sampled_by_autograd
    else:
        name, before = "_head_gradient", loss_by_backward
    shipped, found = getattr(guided, name), {}
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n.endswith("down_proj")]

    def run():
        if a.which == "fisher":
            return guided.fisher_gradients(model, spec, samples, FISHER_DRAWS, 0, 8)
        return [[w] for w in guided.loss_gradients(model, spec, samples, 4, linears, 8).values()]

    print(f"| {a.model}, {a.which} pass, {rows} x {seq} tokens | CPU s |")
    print("|---|---|")
    for label, head in (("shipped", shipped), ("before", before), ("shipped, again", shipped)):
        setattr(guided, name, head)
        try:
            start = time.process_time()
            found[label] = run()
            print(f"| {label} | {time.process_time() - start:.1f} |", flush=True)
        finally:
            setattr(guided, name, shipped)
    pairs = zip(found["shipped"], found["before"])
    worst = max(((g - r).abs().max() / r.abs().max()).item() for got, ref in pairs for g, r in zip(got, ref))
    print(f"largest difference, relative to the largest value: {worst:.1e}")


if __name__ == "__main__":
    main()
