"""Per linear: how far cheaper guided Hessians land from GuidedQuant's own, in its own objective.

    OMP_NUM_THREADS=1 python benchmarks/guided_rows.py [--model smollm2-135m] [--layers 2,10,20]
        [--rows 4,8,16] [--groups 4]

The float model (transformers, fp32) runs 64 news rows × 512 (seed 0, the CLI's rows); one
backward pass (`guided.loss_gradients`) gives every listed linear's loss weights on all of
them. Each linear's groups of rows are GPTQ-quantized (`GPTQOptions`' defaults, act-order
static) under each candidate Hessian, and scored by GuidedQuant's objective with the
linear's own weights on all rows: Σ_k tr((W − Q)_k·H_k·(W − Q)_kᵀ), H_k = 2/n·Σ_t w_tk·x_t·x_tᵀ
undamped. Printed: each candidate's sum over the listed linears over the reference's (the
same objective, quantized under those very H_k; below 1 is not possible but for GPTQ's
greediness), and plain GPTQ's (one Hessian, no weights). Candidates:

- stacked: the loss weights that q/k/v (and gate/up) share, their mean (`guided.stacked`), all rows;
- cv@M: stacked, gradients on the first M rows, the other rows through the plain Hessian
  (a control variate: G_k + H_all − H_S, G_k the subset's guided Hessian, H_S its plain one);
- subset@M: stacked, the first M rows' guided Hessian alone;
- diluted@M: stacked, the other rows' tokens at weight 1 ((S·G_k + R·H_rest) / n, what
  `guided.hessians` makes for `--guided-rows M`);
- transfer@M: stacked, the subset's G_k carried to all rows by T = L_all·L_S⁻¹ (Cholesky
  factors of the plain Hessians of all rows and of the subset, damped 1%): T·G_k·Tᵀ, the
  plain Hessian of all rows when every weight is 1, and positive definite.

The inputs are the float model's (a layer-level view, not the quantized stream).
"""

from __future__ import annotations

import argparse

import torch
from transformers import AutoModelForCausalLM

from quantkit.calibration import guided
from quantkit.calibration.datasets import calibration_samples, load_documents
from quantkit.calibration.gptq import quantize_weight
from quantkit.calibration.registry import GPTQOptions
from quantkit.models.arch import arch_for
from quantkit.models.loading import load_tokenizer, resolve_model
from quantkit.scheme import preset

ROWS, SEQ = 64, 512
STACKS = [["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], ["self_attn.o_proj"]]
STACKS += [["mlp.gate_proj", "mlp.up_proj"], ["mlp.down_proj"]]


def weighted(X: torch.Tensor, w: torch.Tensor) -> list[torch.Tensor]:
    """H_k = 2/n·Σ_t w_tk·x_t·x_tᵀ for each column k of w [n, groups] (X [n, in])."""
    return [2 / len(X) * (X.T * w[:, k]) @ X for k in range(w.shape[1])]


def normalised(w: torch.Tensor) -> torch.Tensor:
    return w / w.mean(0)


def candidates(X: torch.Tensor, w: torch.Tensor, rows: list[int]) -> dict[str, list[torch.Tensor]]:
    n = len(X)
    out = {"stacked": weighted(X, w)}
    for m in rows:
        s = m * SEQ
        ws, XS, XR = normalised(w[:s]), X[:s], X[s:]
        G = weighted(XS, ws)
        HS, HR = 2 / s * XS.T @ XS, 2 / (n - s) * XR.T @ XR
        out[f"cv@{m}"] = [g + (n - s) / n * (HR - HS) for g in G]
        out[f"subset@{m}"] = G
        out[f"diluted@{m}"] = [(s * g + (n - s) * HR) / n for g in G]
        H, damp = (s * HS + (n - s) * HR) / n, 0.01 * HS.diagonal().mean() * torch.eye(len(HS))
        T = torch.linalg.solve_triangular(
            torch.linalg.cholesky(HS + damp), torch.linalg.cholesky(H + damp), upper=False, left=False
        )  # T = L_all · L_S⁻¹
        out[f"transfer@{m}"] = [T @ g @ T.T for g in G]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--layers", default="2,10,20", help="block indices, comma-separated")
    p.add_argument("--rows", default="4,8,16", help="the gradient rows M of the cheaper candidates")
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--scheme", default="w4a16-asym")
    p.add_argument("--group-size", type=int, default=64)
    a = p.parse_args()
    torch.manual_seed(0)
    path = resolve_model(a.model)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    spec = arch_for(model.config)
    ids = calibration_samples(load_tokenizer(path), load_documents("news"), ROWS, SEQ, 0)
    layers, rows = [int(x) for x in a.layers.split(",")], [int(x) for x in a.rows.split(",")]
    names = [f"{spec.blocks}.{i}.{n}" for i in layers for stack in STACKS for n in stack]
    w = guided.loss_gradients(model, spec, ids, a.groups, names, batch_size=8)
    inputs: dict[str, list[torch.Tensor]] = {}
    hooks = []
    for i in layers:
        for stack in STACKS:
            full = f"{spec.blocks}.{i}.{stack[0]}"
            module = model.get_submodule(full)
            hooks.append(module.register_forward_pre_hook(lambda m, x, k=full: inputs.setdefault(k, []).append(x[0])))
    with torch.no_grad():
        for r in range(0, ROWS, 8):
            model(ids[r : r + 8])
    for h in hooks:
        h.remove()
    args = preset(a.scheme).weights
    args = args.__class__(**{**args.__dict__, "group_size": a.group_size, "actorder": "static"})
    o = GPTQOptions()
    sums: dict[str, float] = {}

    def gptq(W, H):
        return quantize_weight(W, H, args, o.block_size, o.damp, range_search=o.range_search, refine=o.refine).weight

    for i in layers:
        for stack in STACKS:
            fulls = [f"{spec.blocks}.{i}.{n}" for n in stack]
            X = torch.cat([x.reshape(-1, x.shape[-1]) for x in inputs.pop(fulls[0])]).float()
            hs = candidates(X, guided.stacked(w, fulls), rows)
            plain = 2 / len(X) * X.T @ X
            for full in fulls:
                W = model.get_submodule(full).weight.data
                own = weighted(X, w[full])
                b = guided.group_bounds(W.shape[0], a.groups)
                parts = {"own (GuidedQuant)": own, **hs, "plain GPTQ": [plain] * a.groups}
                for label, H in parts.items():
                    err = 0.0
                    for k in range(a.groups):
                        D = (W[b[k] : b[k + 1]] - gptq(W[b[k] : b[k + 1]], H[k])).double()
                        err += (D @ own[k].double() * D).sum().item()
                    sums[label] = sums.get(label, 0.0) + err
            print(f"block {i} {'+'.join(stack)} done", flush=True)
    ref = sums["own (GuidedQuant)"]
    print(f"\n{a.model} {a.scheme} g{a.group_size}, blocks {a.layers}: GuidedQuant's objective over its own")
    for label, err in sums.items():
        print(f"{label:20s} {err / ref:.4f}")


if __name__ == "__main__":
    main()
