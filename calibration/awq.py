"""AWQ (Lin et al., MLSys 2024): activation-aware weight quantization as pure functions.

For a group of linears that read the same input x (q, k, v all read input_layernorm's
output): `search_scales` finds per-input-channel scales s that protect the channels
with large activations, `fold_scales` divides the previous op's outputs by s and
multiplies the linears' input columns by s (the float function is unchanged), and
`search_clip` finds per-group clipping ranges that `apply_clip` applies before the
final quantization. The shape of mit-han-lab/llm-awq `auto_scale.py` / `auto_clip.py`
without hooks or model knowledge: the caller captures x and names the modules. The
grid is the one of `quantkit.primitives` (min-max qparams, as round-to-nearest).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from quantkit.errors import QuantkitError
from quantkit.primitives import check_group_size, compute_qparams, fake_quantize
from quantkit.scheme import QuantArgs

SCALE_MIN = 1e-4  # floor of s: channels whose activations are all zero stay finite


@dataclass(slots=True)
class ScaleResult:
    """The chosen scales (fp32 [ci]) and the search that chose them.

    alpha is the winning exponent (s = x_mean^alpha, or with duo x_mean^alpha / w_mean^(1-alpha));
    None when plain round-to-nearest (s = 1) beat every grid point, which only duo can allow.
    losses[i] is the output MSE at alpha = i / grid, rtn_loss the one at s = 1, and
    loss the chosen one (never above rtn_loss).
    """

    scales: torch.Tensor
    alpha: float | None
    losses: list[float]
    rtn_loss: float
    loss: float


@torch.no_grad()
def search_scales(
    x: torch.Tensor,
    weights: list[torch.Tensor],
    args: QuantArgs,
    grid: int = 20,
    duo: bool = False,
    output_fn: Callable[[list[torch.Tensor]], torch.Tensor] | None = None,
    scale_dtype: torch.dtype = torch.float32,
    name: str = "linears",
) -> ScaleResult:
    """Grid-search AWQ scales for the linears `weights` ([co_i, ci] each) that all read x [..., ci].

    For alpha in {0, 1/grid, ..., (grid-1)/grid}: s = x_mean^alpha (x_mean = mean |x| per
    channel), clamped to SCALE_MIN and normalised by sqrt(max s · min s); each W becomes
    fake_quantize(W·diag(s)) / s and the loss is the MSE of the output against the float one.
    The output is the linears' concatenated outputs x·Wᵀ, or `output_fn(weights)` when given
    (it receives the effective weights in the original dtypes, e.g. to run a whole block).
    alpha = 0 is round-to-nearest, so the chosen loss is never worse than RTN's.
    """
    x = _check(x, [w.shape for w in weights], args, name, "AWQ scale search")
    if grid < 1:
        raise QuantkitError(f"the AWQ scale search of {name} needs grid >= 1 (got {grid}).")
    W = torch.cat([w.detach().float() for w in weights])  # W [co, ci]; qparams are per row: each linear as alone
    x_mean = x.abs().mean(0)  # x_mean [ci]
    w_mean = _weight_mean(W, args) if duo else None  # w_mean [ci]
    loss_of = _loss_fn(x, W, weights, output_fn)

    losses, candidates = [], []
    for i in range(grid):
        alpha = i / grid
        if duo:
            s = (x_mean.pow(alpha) / (w_mean.pow(1 - alpha) + SCALE_MIN)).clamp(min=SCALE_MIN)
        else:
            s = x_mean.pow(alpha).clamp(min=SCALE_MIN)
        s = s / (s.max() * s.min()).sqrt()  # s [ci]
        losses.append(loss_of(_fake_quantize(W * s, args, scale_dtype) / s))
        candidates.append((alpha, s))
    best = min(range(grid), key=losses.__getitem__)  # ties go to the smaller alpha
    rtn_loss = loss_of(_fake_quantize(W, args, scale_dtype)) if duo else losses[0]
    if rtn_loss < losses[best]:
        return ScaleResult(torch.ones_like(x_mean), None, losses, rtn_loss, rtn_loss)
    alpha, s = candidates[best]
    return ScaleResult(s, alpha, losses, rtn_loss, losses[best])


@torch.no_grad()
def fold_scales(
    prev_weight: torch.Tensor, prev_bias: torch.Tensor | None, linear_weights: list[torch.Tensor], scales: torch.Tensor
) -> None:
    """In place: divide the previous op's output channels by s and multiply the linears' input columns by s.

    prev is a norm (weight [ci], bias [ci] or None) or a linear (weight [ci, c_prev]: its rows,
    bias [ci]). The float function is unchanged; the linears now hold W·diag(s), the weights
    `search_scales` evaluated. Work is done in fp32 and written back in each tensor's dtype.
    """
    s = scales.detach().float().flatten().to(prev_weight.device)  # s [ci]
    outs = [prev_weight.shape[0]] + ([] if prev_bias is None else [prev_bias.shape[0]])
    ins = [w.shape[1] for w in linear_weights]
    if any(n != s.numel() for n in outs + ins):
        raise QuantkitError(
            f"cannot fold {s.numel()} AWQ scales between an op with {outs[0]} outputs and linears with {ins} inputs; "
            "they must all match (a grouped-query v_proj -> o_proj pair cannot be balanced)."
        )
    shape = (-1, 1) if prev_weight.dim() == 2 else (-1,)
    prev_weight.copy_(prev_weight.float() / s.reshape(shape))
    if prev_bias is not None:
        prev_bias.copy_(prev_bias.float() / s)
    for w in linear_weights:
        w.copy_(w.float() * s)


@torch.no_grad()
def search_clip(
    w: torch.Tensor,
    x: torch.Tensor,
    args: QuantArgs,
    grid: int = 20,
    max_shrink: float = 0.5,
    n_tokens: int = 512,
    batch_co: int = 256,
    scale_dtype: torch.dtype = torch.float32,
    name: str = "linear",
) -> torch.Tensor:
    """Per (row, group) clipping range max_val (fp32 [co, n_groups]) for w [co, ci] given its inputs x [..., ci].

    As llm-awq `auto_clip_layer`: on n_tokens evenly spaced tokens of x, each ratio
    1, 1 - 1/grid, ... (int(max_shrink·grid) of them, so 1 ... 0.55 by default) clamps every
    group to ±ratio·max|w_group|, fake-quantizes it, and scores the mean squared error of
    the group's partial dot products x_g·w_g; the best ratio per group wins (ratio 1 is
    tried, so never worse than no clipping). qparams are taken in scale_dtype, as stored.
    Call it on the weights and inputs after `fold_scales`; rows go batch_co at a time.
    """
    x = _check(x, [w.shape], args, name, "AWQ clip search")
    if grid < 1 or not 0 <= max_shrink < 1 or n_tokens < 1 or batch_co < 1:
        raise QuantkitError(
            f"the AWQ clip search of {name} needs grid, n_tokens and batch_co >= 1 and 0 <= max_shrink < 1."
        )
    co, ci = w.shape
    gs = args.group_size if args.strategy == "group" else ci
    x = x[:: max(1, x.shape[0] // n_tokens)][:n_tokens]  # x [n, ci], deterministic subsample
    x = x.reshape(x.shape[0], -1, gs).transpose(0, 1)  # x [n, ci] -> [n_group, n, group_size]
    ratios = [1 - i / grid for i in range(max(1, int(max_shrink * grid)))]
    best = []
    for w_b in w.detach().float().split(batch_co):
        rows = w_b.shape[0]
        w_g = w_b.reshape(rows, -1, gs)  # w [co_b, ci] -> [co_b, n_group, group_size]
        org_max = w_g.abs().amax(dim=-1, keepdim=True)  # [co_b, n_group, 1]
        best_max, min_err = org_max.clone(), torch.full_like(org_max, float("inf"))
        for ratio in ratios:
            max_val = org_max * ratio
            q = _fake_quantize(w_g.clamp(-max_val, max_val).reshape(rows, ci), args, scale_dtype)
            diff = (w_b - q).reshape(rows, -1, gs).transpose(0, 1)  # [n_group, co_b, group_size]
            # partial dot products x_g·w_g - x_g·wq_g: [n_group, n, co_b] -> err [co_b, n_group, 1]
            err = torch.bmm(x, diff.transpose(1, 2)).pow(2).mean(dim=1).T.unsqueeze(-1)
            better = err < min_err
            min_err = torch.where(better, err, min_err)
            best_max = torch.where(better, max_val, best_max)
        best.append(best_max.squeeze(-1))
    return torch.cat(best)  # [co, n_group]


def apply_clip(w: torch.Tensor, max_val: torch.Tensor, args: QuantArgs) -> torch.Tensor:
    """w [co, ci] with each group clamped to ±max_val ([co, n_groups], from `search_clip`); a new tensor."""
    gs = args.group_size if args.strategy == "group" else w.shape[1]
    if max_val.shape != (w.shape[0], w.shape[1] // gs):
        raise QuantkitError(
            f"clip ranges of shape {tuple(max_val.shape)} do not fit a weight {tuple(w.shape)} in groups of {gs}."
        )
    m = max_val.to(w.device, torch.float32).unsqueeze(-1)  # [co, n_group, 1]
    w_g = w.float().reshape(w.shape[0], -1, gs)  # w [co, ci] -> [co, n_group, group_size]
    return w_g.clamp(-m, m).reshape(w.shape).to(w.dtype)


def _fake_quantize(w, args, scale_dtype):
    return fake_quantize(w, args, *compute_qparams(w, args, scale_dtype))


def _weight_mean(W, args):
    gs = args.group_size if args.strategy == "group" else W.shape[1]
    w_g = W.abs().reshape(W.shape[0], -1, gs)  # W [co, ci] -> [co, n_group, group_size]
    w_g = w_g / w_g.amax(dim=-1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny)
    return w_g.reshape(W.shape).mean(0)  # [ci]


def _loss_fn(x, W, weights, output_fn):
    if output_fn is None:  # concatenated outputs x·Wᵀ: with D = W - Wq, the MSE is sum((D·XᵀX) ⊙ D) / (n·co)
        gram, count = x.T @ x, x.shape[0] * W.shape[0]  # gram [ci, ci], once instead of n tokens per grid point

        def gram_loss(Wq):
            D = W - Wq  # D [co, ci]
            return ((D @ gram) * D).sum().item() / count

        return gram_loss
    ref = output_fn(list(weights)).float()
    sizes, dtypes = [w.shape[0] for w in weights], [w.dtype for w in weights]

    def loss(Wq):
        out = output_fn([q.to(dt) for q, dt in zip(Wq.split(sizes), dtypes)])
        return (ref - out.float()).pow(2).mean().item()

    return loss


def _check(x, shapes, args, name, what):
    if args.type != "int" or args.strategy not in ("group", "channel"):
        kind = f"{args.type} per {args.strategy}"
        raise QuantkitError(f"{what} of {name} takes int weights per group or channel, not {kind}.")
    ci = x.shape[-1]
    for shape in shapes:
        if len(shape) != 2 or shape[1] != ci:
            raise QuantkitError(f"{name}: a weight of shape {tuple(shape)} cannot read inputs of width {ci}.")
    if args.strategy == "group":
        check_group_size(name, ci, args.group_size)
    x = x.detach().reshape(-1, ci).float()  # x [n, ci]
    if x.shape[0] == 0:
        raise QuantkitError(f"{what} of {name} got no input tokens; calibrate on at least one sample.")
    if not torch.isfinite(x).all():
        raise QuantkitError(f"the inputs of {name} contain NaN or inf; {what} needs finite calibration activations.")
    return x
