"""AWQ (Lin et al., MLSys 2024): activation-aware weight quantization as pure functions.

For a group of linears that read the same input x (q, k, v all read input_layernorm's
output): `search_scales` finds per-input-channel scales s that protect the channels
with large activations, `fold_scales` divides the previous op's outputs by s and
multiplies the linears' input columns by s (the float function is unchanged), and
`search_clip` finds per-group clipping ranges whose qparams (`clip_qparams`) the
final quantization uses (or, with the `gptq` option, GPTQ rounds the scaled weights with
error feedback). The shape of mit-han-lab/llm-awq `auto_scale.py` / `auto_clip.py`
without hooks or model knowledge: the caller captures x and names the modules. The grid
is the one of `quantkit.primitives` (min-max qparams, as round-to-nearest; a symmetric int
group's clip may choose the full-range grid, `primitives.full_range_scale`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from quantkit.calibration import fp4, rtn
from quantkit.calibration.hooks import (
    capture_calls,
    mapping_input,
    mapping_inputs,
    mappings,
    module_output,
    owner,
    scaled_inputs,
    targets,
    weight_args,
)
from quantkit.calibration.method import QParams
from quantkit.calibration.registry import METHODS, GPTQOptions
from quantkit.errors import QuantkitError
from quantkit.models.arch import ArchSpec, get_module
from quantkit.primitives import (
    check_group_size,
    compute_qparams,
    fake_quantize,
    full_range_scale,
    minmax,
    qparams_from_minmax,
)
from quantkit.scheme import QuantArgs, QuantScheme, with_actorder

SCALE_MIN = 1e-4  # floor of s: channels whose activations are all zero stay finite


@dataclass(slots=True)
class ScaleResult:
    """The chosen scales (fp32 [ci]) and the search that chose them.

    alpha is the winning exponent (s = x_mean^alpha, or with duo x_mean^alpha / w_mean^(1-alpha));
    None when plain round-to-nearest (s = 1) beat every grid point, which only duo can allow.
    losses[i] is the output MSE at alpha = i / grid (NaN where a strided search did not
    score it), rtn_loss the one at s = 1, and loss the chosen one (never above rtn_loss).
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
    stride: int = 1,
) -> ScaleResult:
    """Grid-search AWQ scales for the linears `weights` ([co_i, ci] each) that all read x [..., ci].

    For alpha in {0, 1/grid, ..., (grid-1)/grid}: s = x_mean^alpha (x_mean = mean |x| per
    channel), clamped to SCALE_MIN and normalised by sqrt(max s · min s); each W becomes
    fake_quantize(W·diag(s)) / s and the loss is the MSE of the output against the float one.
    The output is the linears' concatenated outputs x·Wᵀ, or `output_fn(weights)` when given
    (it receives the effective weights in the original dtypes, e.g. to run a whole block).
    alpha = 0 is round-to-nearest, so the chosen loss is never worse than RTN's.
    With stride k > 1 the points 0, k, 2k, ... are scored first, then those between the best
    one's neighbours (about grid/k + 2(k - 1) points): the grid's best whenever the loss
    falls and rises once between those neighbours (the sensitivity's cheaper search).
    """
    given, x = x, _check(x, [w.shape for w in weights], args, name, "AWQ scale search")
    if grid < 1 or stride < 1:
        raise QuantkitError(f"the AWQ scale search of {name} needs grid and stride >= 1 (got {grid}, {stride}).")
    W = torch.cat([w.detach().float() for w in weights])  # W [co, ci]; qparams are per row: each linear as alone
    x_mean = x.abs().mean(0)  # x_mean [ci]
    w_mean = _weight_mean(W, args) if duo else None  # w_mean [ci]
    loss_of = _loss_fn(x, W, weights, output_fn, given)
    losses, scales = [math.nan] * grid, {}

    def score(i: int) -> float:
        if i not in scales:
            if duo:
                s = (x_mean.pow(i / grid) / (w_mean.pow(1 - i / grid) + SCALE_MIN)).clamp(min=SCALE_MIN)
            else:
                s = x_mean.pow(i / grid).clamp(min=SCALE_MIN)
            scales[i] = s = s / (s.max() * s.min()).sqrt()  # s [ci]
            losses[i] = loss_of(_fake_quantize(W * s, args, scale_dtype) / s)
        return losses[i]

    best = min(range(0, grid, stride), key=score)  # ties go to the smaller alpha
    best = min(range(max(0, best - stride + 1), min(grid, best + stride)), key=score)
    rtn_loss = loss_of(_fake_quantize(W, args, scale_dtype)) if duo else score(0)
    if rtn_loss < losses[best]:
        return ScaleResult(torch.ones_like(x_mean), None, losses, rtn_loss, rtn_loss)
    return ScaleResult(scales[best], best / grid, losses, rtn_loss, losses[best])


@torch.no_grad()
def fold_scales(
    prev_weight: torch.Tensor,
    prev_bias: torch.Tensor | None,
    linear_weights: list[torch.Tensor],
    scales: torch.Tensor,
    offset: float = 0.0,
) -> None:
    """In place: divide the previous op's output channels by s and multiply the linears' input columns by s.

    prev is a norm (weight [ci], bias [ci] or None) or a linear (weight [ci, c_prev]: its rows,
    bias [ci]). A norm that scales by (offset + weight), as Gemma's do with offset 1, gets
    weight (offset + weight) / s - offset. The float function is unchanged; the linears now
    hold W·diag(s), the weights `search_scales` evaluated. Work is done in fp32 and written
    back in each tensor's dtype.
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
    prev_weight.copy_((prev_weight.float() + offset) / s.reshape(shape) - offset)
    if prev_bias is not None:
        prev_bias.copy_(prev_bias.float() / s)
    for w in linear_weights:
        w.copy_(w.float() * s)


@dataclass(slots=True)
class ClipInputs:
    """What `search_clip` scores a weight error d [n_group, co, group_size] with: the mean over
    tokens of the squared error of each group's partial dot product x_g·d_g, [co, n_group].

    gram (fp32 [n_group, gs, gs]) holds per-group second moments G_g = x_gᵀ·x_g / n of all
    captured tokens: d_g·G_g·d_gᵀ is that mean exactly, for gs products per weight instead of
    n. Groups wider than the tokens worth keeping (per-channel schemes on wide layers) keep
    evenly spaced tokens instead (fp32 [n_group, n, gs]), as llm-awq does for every layer.
    """

    gram: torch.Tensor | None
    tokens: torch.Tensor | None
    group_size: int

    def error(self, d: torch.Tensor) -> torch.Tensor:
        if self.gram is not None:
            return (torch.bmm(d, self.gram) * d).sum(-1).T
        return torch.bmm(self.tokens, d.transpose(1, 2)).pow(2).mean(1).T  # [n_group, n, co] -> [co, n_group]


@torch.no_grad()
def clip_inputs(
    x: torch.Tensor, args: QuantArgs, name: str = "linear", max_gram_width: int = 512, n_tokens: int = 512
) -> ClipInputs:
    """`ClipInputs` of the inputs x [..., ci] of linears quantized with `args`: second moments
    of every token when the groups are at most max_gram_width wide, else n_tokens evenly
    spaced tokens."""
    ci = x.shape[-1]
    x = _check(x, [], args, name, "AWQ clip search")  # x [n, ci]
    gs = args.group_size if args.strategy in ("group", "tensor_group") else ci
    if gs > max_gram_width:
        x = x[:: max(1, x.shape[0] // n_tokens)][:n_tokens]
    xg = x.reshape(x.shape[0], -1, gs).transpose(0, 1)  # [n_group, n, group_size]
    if gs > max_gram_width:
        return ClipInputs(None, xg.contiguous(), gs)
    return ClipInputs(torch.bmm(xg.transpose(1, 2), xg) / x.shape[0], None, gs)


@torch.no_grad()
def search_clip(
    w: torch.Tensor,
    inputs: ClipInputs,
    args: QuantArgs,
    grid: int = 20,
    max_shrink: float = 0.5,
    rounds: int = 2,
    batch_co: int = 256,
    scale_dtype: torch.dtype = torch.float32,
    name: str = "linear",
    global_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per (row, group) clipping range [lo, hi] (fp32 [co, n_groups, 2]) for w [co, ci] whose
    inputs are summed up in `inputs` (from `clip_inputs`).

    A candidate range quantizes each group with min-max qparams of [lo, hi] (what clamping
    to it and rounding to nearest gives) and is scored by the mean squared error of the
    group's partial dot products (`ClipInputs.error`). The ratios are 1, 1 - 1/grid, ... (int(max_shrink·grid)
    of them, so 1 ... 0.55 by default). First both ends shrink together by each ratio
    (llm-awq's `auto_clip`); then, for an asymmetric scheme, `rounds` rounds of coordinate
    descent: the upper end alone over the ratios with the lower end as chosen so far, then the
    lower end alone. A symmetric int scheme's range is ±amax, and it also tries the full-range
    grid (`full_range_scale`) of the group's own [min, max] shrunk by each ratio: a finer step
    with the lowest code on the group's end of larger magnitude (a negative scale when that end
    is the max), stored in the same format; its range is the one it clamps to, [qmin·s, qmax·s]
    in order, never balanced (`clip_qparams`). Each group keeps its best candidate; the first is
    the unclipped min-max range, so the error never exceeds round-to-nearest's.
    qparams are taken in scale_dtype, as stored (NVFP4: under `global_scale`, the fusion
    group's, as they will be; None: each candidate's own). Rows go batch_co at a time.
    """
    if grid < 1 or not 0 <= max_shrink < 1 or rounds < 0 or batch_co < 1:
        raise QuantkitError(
            f"the AWQ clip search of {name} needs grid and batch_co >= 1, rounds >= 0 and 0 <= max_shrink < 1."
        )
    _check_args(args, [w.shape], w.shape[-1], name, "AWQ clip search")
    co, ci = w.shape
    gs = args.group_size if args.strategy in ("group", "tensor_group") else ci
    if inputs.group_size != gs:
        raise QuantkitError(
            f"{name}: clip inputs summed in groups of {inputs.group_size} do not fit a weight "
            f"{tuple(w.shape)} in groups of {gs}; make them with clip_inputs and the same args."
        )
    ratios = [1 - i / grid for i in range(max(1, int(max_shrink * grid)))]
    out = []
    for W in w.detach().float().split(batch_co):  # W [co_b, ci]
        lo0, hi0 = minmax(W, args)  # [co_b, n_group]
        lo0, hi0 = lo0.clamp(max=0), hi0.clamp(min=0)
        signed = (lo0, hi0)
        if args.symmetric:
            hi0 = torch.maximum(-lo0, hi0)
            lo0 = -hi0

        def error(lo, hi):  # [co_b, n_group]
            d = W - fake_quantize(W, args, *_range_qparams(lo, hi, args, scale_dtype, global_scale))
            return inputs.error(d.reshape(W.shape[0], -1, gs).transpose(0, 1))  # d [n_group, co_b, group_size]

        best = [lo0, hi0, error(lo0, hi0)]

        def keep(lo, hi):
            err = error(lo, hi)
            better = err < best[2]
            for i, new in enumerate((lo, hi, err)):
                best[i] = torch.where(better, new, best[i])

        for r in ratios[1:]:
            keep(lo0 * r, hi0 * r)
        if _full_range(args):
            for r in ratios:
                s = full_range_scale(signed[0] * r, signed[1] * r, args, scale_dtype).to(scale_dtype).float()
                keep(torch.minimum(args.qmin * s, args.qmax * s), torch.maximum(args.qmin * s, args.qmax * s))
        for _ in range(0 if args.symmetric else rounds):
            lo = best[0]
            for r in ratios:
                keep(lo, hi0 * r)
            hi = best[1]
            for r in ratios:
                keep(lo0 * r, hi)
        out.append(torch.stack(best[:2], -1))
    return torch.cat(out)  # [co, n_group, 2]


def clip_qparams(
    w: torch.Tensor,
    ranges: torch.Tensor,
    args: QuantArgs,
    scale_dtype: torch.dtype = torch.float32,
    global_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(scale, zero point or None) for w [co, ci] from its clipping ranges [co, n_groups, 2]
    (`search_clip`): min-max qparams of [lo, hi] per group. Quantizing with them clamps each
    group to its range at the ends of the integer grid, exactly as the search scored it
    (clamping the weights first and taking min-max qparams of the result would put the
    clamped values on a rounding tie, ±7.5 steps for symmetric int4, where float noise picks
    the side). A symmetric int range that is not balanced (lo ≠ −hi) is a full-range grid's
    [qmin·s, qmax·s]: its scale s is `full_range_scale`'s, the end of larger magnitude over qmin."""
    gs = args.group_size if args.strategy in ("group", "tensor_group") else w.shape[1]
    if ranges.shape != (w.shape[0], w.shape[1] // gs, 2):
        raise QuantkitError(
            f"clip ranges of shape {tuple(ranges.shape)} do not fit a weight {tuple(w.shape)} in groups of {gs}."
        )
    lo, hi = ranges.to(w.device, torch.float32).unbind(-1)  # [co, n_group] each
    return _range_qparams(lo, hi, args, scale_dtype, global_scale)


def _range_qparams(lo, hi, args, scale_dtype, global_scale):
    # `clip_qparams` of ranges [co, n_group] each, unchecked (the search's inner loop)
    scale, zero = qparams_from_minmax(lo, hi, args, scale_dtype, global_scale)  # NVFP4: a fused group's global scale
    if _full_range(args):
        full = full_range_scale(lo, hi, args, scale_dtype).to(scale_dtype)
        scale = torch.where(lo == -hi, scale, full)
    return scale, zero


def _full_range(args: QuantArgs) -> bool:
    """Whether the clip search also tries full-range grids: symmetric int groups."""
    return args.type == "int" and args.symmetric and args.strategy == "group"


def _fake_quantize(w, args, scale_dtype):
    return fake_quantize(w, args, *compute_qparams(w, args, scale_dtype))


def _weight_mean(W, args):
    gs = args.group_size if args.strategy in ("group", "tensor_group") else W.shape[1]
    w_g = W.abs().reshape(W.shape[0], -1, gs)  # W [co, ci] -> [co, n_group, group_size]
    w_g = w_g / w_g.amax(dim=-1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny)
    return w_g.reshape(W.shape).mean(0)  # [ci]


_GRAMS = WeakIdKeyDictionary()  # a searched input tensor -> (its version, XᵀX), see `_gram`


def _gram(given: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """XᵀX [ci, ci] of x [n, ci], the search's view of the tensor `given`: formed once per
    tensor and version while it lives (mixed precision's sensitivity searches one captured
    input once per candidate format), the same product every time."""
    kept = _GRAMS.get(given)
    if kept is None or kept[0] != given._version:
        kept = _GRAMS[given] = (given._version, x.T @ x)
    return kept[1]


def _loss_fn(x, W, weights, output_fn, given):
    if output_fn is None:  # concatenated outputs x·Wᵀ: with D = W - Wq, the MSE is sum((D·XᵀX) ⊙ D) / (n·co)
        gram, count = _gram(given, x), x.shape[0] * W.shape[0]  # gram [ci, ci], once instead of n tokens per grid point

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


def _check_args(args, shapes, ci, name, what):
    if not (args.type == "int" and args.strategy in ("group", "channel")) and not args.is_fp4:
        kind = f"{args.type} per {args.strategy}"
        raise QuantkitError(f"{what} of {name} takes int weights per group or channel (or fp4), not {kind}.")
    for shape in shapes:
        if len(shape) != 2 or shape[1] != ci:
            raise QuantkitError(f"{name}: a weight of shape {tuple(shape)} cannot read inputs of width {ci}.")
    if args.strategy in ("group", "tensor_group"):
        check_group_size(name, ci, args.group_size)


def _check(x, shapes, args, name, what):
    ci = x.shape[-1]
    _check_args(args, shapes, ci, name, what)
    x = x.detach().reshape(-1, ci).float()  # x [n, ci]
    if x.shape[0] == 0:
        raise QuantkitError(f"{what} of {name} got no input tokens; calibrate on at least one sample.")
    if not torch.isfinite(x).all():
        raise QuantkitError(f"the inputs of {name} contain NaN or inf; {what} needs finite calibration activations.")
    return x


SEARCH_TOKENS = 16384  # captured inputs per sequential group that scales and clips are scored on
MODULE_TOKENS = 4096  # tokens of whole sequences that --module-loss runs the attention / MLP on


def awq_step(spec: ArchSpec, scheme: QuantScheme, options, results: dict, scale_dtype, log: Callable | None = None):
    """Runner step: per mapping (norm → q,k,v; v → o when shapes allow; norm → gate,up;
    up → down) search activation-aware scales and fold them into the previous op, then
    search per-group clipping ranges for each linear (q and k too: on smollm2 that
    measured better) and quantize with them; with `gptq`, GPTQ's step quantizes the scaled
    block instead (its range search in place of the clip search). With `load_search`
    nothing is searched and no calibration data is needed (but for GPTQ's Hessians); with
    `save_search` the search is written when the last block is done (`step.finish()`)."""
    o = options
    rounds = o.clip_rounds if o.clip else None  # the clip search's rounds; None: no clip search
    loaded = _read_search(Path(o.load_search)) if o.load_search else None
    record = {} if o.save_search else None
    rounding = None
    if o.guided and not o.gptq:
        raise QuantkitError("guided Hessians are GPTQ's (--guided goes with --gptq).")
    if o.gptq:  # GPTQ's own step on the scaled block (true-sequential, act-order static), through the registry
        gptq = METHODS["gptq"]
        ordered = with_actorder(scheme, "static")
        gopts = GPTQOptions(range_search=o.clip, guided=o.guided, guided_rows=o.guided_rows)
        rounding = gptq.make_step(spec, ordered, gopts, results, scale_dtype, log)

    def step(index: int, prefix: str, block: nn.Module, inputs) -> None:
        bspec = spec.for_block(block)
        names = targets(scheme, prefix, bspec.linears)
        feats = _features(bspec, block, names, inputs) if loaded is None else {}
        inspected = {m.inspect: get_module(block, m.inspect) for m in bspec.awq if m.inspect and o.module_loss}
        calls = capture_calls(block, inspected, inputs, MODULE_TOKENS) if loaded is None and inspected else {}
        for b in mappings(bspec, block, names):
            m, linears = b.mapping, b.linears
            key = f"{prefix}.{m.prev}.awq_scales"
            if loaded is not None:
                if key not in loaded:
                    raise QuantkitError(
                        f"the saved AWQ search has no scales for {prefix}.{m.prev}; "
                        "it was made for another model or scheme."
                    )
                scales = loaded[key].float()
            else:
                x = feats[mapping_input(bspec, m)]
                output_fn = (
                    module_output(inspected[m.inspect], linears, calls[m.inspect]) if m.inspect in inspected else None
                )
                scales = search_scales(
                    x,
                    [lin.weight.data for lin in linears],
                    weight_args(scheme, prefix, m.linears[0]),  # one for the mapping (checked by the pipeline)
                    o.grid,
                    o.duo,
                    output_fn,
                    scale_dtype=scale_dtype,
                    name=f"{prefix}.{m.prev}",
                    stride=o.grid_stride,
                ).scales
                scaled_inputs(bspec, feats, m, scales)
            fold_scales(b.prev_weight, b.prev_bias, [lin.weight.data for lin in linears] + b.readers, scales, b.offset)
            if record is not None:
                record[key] = scales
        if rounding is not None:
            rounding(index, prefix, block, inputs)
            return
        _clip_and_quantize(
            block, bspec, prefix, names, feats, inputs, loaded, record, rounds, scheme, scale_dtype, results
        )

    if record is not None:  # carried from block to block: a resumed run restores it
        step.finish = lambda: _write_search(Path(o.save_search), record)
        step.state, step.restore = lambda: dict(record), record.update
    return step


def _features(spec, block, names, inputs):
    """The search's inputs of `names` (`hooks.mapping_inputs`), or a copy of those the caller
    captured from this float block (`inputs.captured`): entries are replaced as scales fold
    (`scaled_inputs`), never changed in place."""
    return dict(inputs.captured) if inputs.captured else mapping_inputs(spec, block, names, inputs, SEARCH_TOKENS)


def _clip_and_quantize(block, bspec, prefix, names, feats, inputs, loaded, record, clip, scheme, scale_dtype, results):
    """Each linear of the block clipped (`search_clip` with `clip` rounds; None: no clip
    search) and quantized, after the scales are folded; NVFP4 global scales shared by each
    fusion group and, for `nvfp4`, the input global scales observed once the block is
    quantized (`calibration/fp4.py`)."""
    summed = {}  # per input: what the clip search scores with
    shared = fp4.weight_global_scales(bspec, scheme, prefix, block, names)  # NVFP4, after the folding
    for name in names:
        full = f"{prefix}.{name}"
        _quantize_clipped(
            block,
            bspec,
            name,
            full,
            feats,
            summed,
            loaded,
            record,
            clip,
            weight_args(scheme, prefix, name),
            scale_dtype,
            results,
            shared.get(name),
        )
    fp4.record_input_global_scales(bspec, scheme, prefix, block, names, inputs, results)


def _quantize_clipped(
    block, spec, name, full, feats, summed, loaded, record, clip, args, scale_dtype, results, gs=None
):
    linear = get_module(block, name)
    w, ranges = linear.weight.data, None
    if clip is not None:
        if loaded is not None:
            ranges = loaded.get(f"{full}.awq_clip")
            if ranges is not None and ranges.dim() != 3:
                raise QuantkitError(
                    f"the saved AWQ search has clip maxima for {full} from an older quantkit "
                    "(it now saves [lo, hi] ranges); search again without --load-search."
                )
        else:
            first = owner(spec, name)
            if (first, args) not in summed:  # the second moments depend on the group size
                summed[first, args] = clip_inputs(feats[first], args, name=full)
            ranges = search_clip(
                w, summed[first, args], args, rounds=clip, scale_dtype=scale_dtype, name=full, global_scale=gs
            )
    if ranges is None:
        q, scale, zero = rtn.quantize_weight(w, args, scale_dtype, gs)
    else:
        scale, zero = clip_qparams(w, ranges, args, scale_dtype, gs)
        q = fake_quantize(w, args, scale, zero)
        if record is not None:
            record[f"{full}.awq_clip"] = ranges
    w.copy_(q)  # in place: see quantkit.malloc
    results[full] = QParams(scale, zero, global_scale=gs)


def _read_search(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    try:
        return load_file(path)
    except Exception as e:
        raise QuantkitError(
            f"cannot read the saved search {path} ({e}); pass a file written by --save-search."
        ) from None


def _write_search(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".partial")
    save_file({k: v.contiguous() for k, v in tensors.items()}, tmp, metadata={"format": "quantkit-awq-search"})
    tmp.replace(path)


# `quantkit plan --calibrate awq`: fitted on smollm2 (64 × 512, 2026-12-01: 300 s against a
# measured 120 GFLOP/s), the run reaches this fraction of the fp32 matmul rate
PLAN_EFFICIENCY = 0.63


def plan_cost(groups: list[tuple[int, int, float]], tokens: int, group_size: int, sparse_input: int) -> dict:
    """What AWQ adds to calibrating one block, for `plan`: per group of linears that share
    an input, (in, out summed, share of the `tokens` it sees); `sparse_input`: the width of
    a sparse MLP's own input (0: dense). Working set: every group's input kept for the
    search (SEARCH_TOKENS at most), and one candidate's outputs and reference; FLOPs: XᵀX
    formed once, the default grid's scale candidates scored with it, then clipping ranges
    per group from second moments."""
    kept = min(tokens, SEARCH_TOKENS)
    working = kept * (sum(i * share for i, _, share in groups) + sparse_input) * 4
    working += 2 * kept * max(o for _, o, _ in groups) * 4
    flops = sum(2 * kept * t * i * i + 20 * 2 * o * i * i for i, o, t in groups)
    flops += sum(2 * kept * t * i * group_size + 40 * o * i * group_size for i, o, t in groups)
    return {"working_set": working, "flops": flops, "efficiency": PLAN_EFFICIENCY}
