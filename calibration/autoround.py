"""AutoRound (Cheng et al., "Optimize Weight Rounding via Signed Gradient Descent", arXiv
2309.05516): per decoder block, learn each weight's rounding offset V ∈ [-0.5, 0.5] and each
group's clip factors (α on the group's max, β on its min, in [CLIP_MIN, 1]) by signed
gradient descent on the block's output error against the float block:

    W' = s · (clamp(⌊W / s + V⌉ + z) − z),  s, z = qparams(β · min W, α · max W)

with ⌊·⌉ passed straight through (STE), the loss the MSE of the quantized block's output
against the float block's, `iters` steps of size lr (default 1/iters, decayed linearly to 0)
on sign(∇), `batch` calibration rows per step, and the iterate with the lowest step loss
kept. It starts at V = 0, α = β = 1: round-to-nearest on its grid (`iters` 0 returns it).

The symmetric int grid is the reference's by default ("full range", as llama.cpp's Q4_0):
s = m / qmin with m the end of [β · min W, α · max W] of larger magnitude (the max on a
tie), so m lands exactly on the lowest code (−8 at 4 bits) and s is negative when m is the
max; codes −8..7 and W' = s · q as compressed-tensors' symmetric format stores them. Its
step is max|W| / 8 where the min-max grid of `quantkit.primitives` (`grid="minmax"`, quantkit
rtn's, bit for bit at `iters` 0) has max|W| / 7.5: on smollm2's linears (g64) the full grid's
round-to-nearest has 16% less weight error. Asymmetric grids are the primitives' (min-max
qparams); rounding is half-to-even; the final weights are `primitives.dequantize` of the
learned integer codes. FP4 / MX groups
(nvfp4a16, mxfp4a16) learn V only: their scales are cast to fp8 or a power of two, which
has no gradient to follow.

What the block sees (as the reference implementation does): the quantized block runs on
the inputs the runner gives it (the previous blocks quantized) and is scored against the
float block's output on the float model's own inputs, a second stream of hidden states
this step keeps from block to block (`runner.FloatStream`, saved with a resumable run's state).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.func import functional_call

from quantkit.calibration import fp4
from quantkit.calibration.hooks import targets, weight_args
from quantkit.calibration.method import Calibration, QParams
from quantkit.calibration.registry import AutoRoundOptions
from quantkit.calibration.runner import FloatStream
from quantkit.models.arch import ArchSpec, get_module
from quantkit.primitives import (
    _expand,
    dequantize,
    full_range_scale,
    minmax,
    qparams_from_minmax,
    round_e2m1,
)
from quantkit.scheme import QuantArgs, QuantScheme

CLIP_MIN = 0.5  # the clip factors α, β stay in [CLIP_MIN, 1]


def _ste(y: torch.Tensor, rounded: torch.Tensor) -> torch.Tensor:
    """`rounded` forward, identity backward (straight-through)."""
    return y + (rounded - y).detach()


class Rounding:
    """One linear's learnable rounding: its float weight W [out, in] (fp32), V [out, in] and
    the clip factors α, β (shaped like the scale; fixed at 1 for the FP4 / MX grids). `full`:
    a symmetric int grid is `full_range_scale`'s, else the primitives' min-max one."""

    def __init__(
        self,
        weight: torch.Tensor,
        args: QuantArgs,
        global_scale: torch.Tensor | None = None,
        scale_dtype: torch.dtype = torch.float32,
        full: bool = False,
    ):
        self.W, self.args, self.global_scale = weight.detach().float(), args, global_scale
        self.scale_dtype = scale_dtype
        self.lo, self.hi = minmax(self.W, args)  # [out, n_groups] each
        self.V = torch.zeros_like(self.W, requires_grad=True)
        self.clips = args.type == "int" and not args.is_mx
        self.alpha = torch.ones_like(self.hi, requires_grad=self.clips)
        self.beta = torch.ones_like(self.lo, requires_grad=self.clips)
        self.full = full and self.clips and args.symmetric

    def params(self) -> list[torch.Tensor]:
        return [self.V, self.alpha, self.beta] if self.clips else [self.V]

    def _soft_qparams(self):
        # fp32 scale and zero point as `qparams_from_minmax`, differentiable in α, β
        a = self.args
        if not self.clips:
            with torch.no_grad():
                return qparams_from_minmax(self.lo, self.hi, a, torch.float32, self.global_scale)[0], None
        lo, hi = (self.beta * self.lo).clamp(max=0), (self.alpha * self.hi).clamp(min=0)
        if self.full:
            scale = full_range_scale(lo, hi, a, self.scale_dtype)
        else:
            scale = torch.maximum(-lo, hi) / ((a.qmax - a.qmin) / 2) if a.symmetric else (hi - lo) / (a.qmax - a.qmin)
            scale = torch.where(scale > torch.finfo(self.scale_dtype).tiny, scale, torch.ones_like(scale))
        scale = _ste(scale, scale.to(self.scale_dtype).float())  # the stored scale's rounding
        if a.symmetric:
            return scale, None
        z = a.qmin - lo / scale
        return scale, _ste(z, torch.round(z)).clamp(a.qmin, a.qmax)

    def weight(self) -> torch.Tensor:
        """The fake-quantized weight [out, in] fp32, differentiable in V, α, β."""
        a = self.args
        scale, zero = self._soft_qparams()
        s = _expand(scale, self.W, a, None)
        y = self.W / s + self.V
        if a.is_fp4:
            return _ste(y, round_e2m1(y)) * s
        z = 0 if zero is None else _expand(zero, self.W, a, None)
        q = _ste(y + z, torch.round(y + z)).clamp(a.qmin, a.qmax)
        return (q - z) * s

    @torch.no_grad()
    def step(self, lr: float, clip_lr: float) -> None:
        """One signed-gradient step, then V back into [-0.5, 0.5] and α, β into [CLIP_MIN, 1]."""
        self.V.sub_(lr * self.V.grad.sign()).clamp_(-0.5, 0.5)
        for p in self.params()[1:]:
            p.sub_(clip_lr * p.grad.sign()).clamp_(CLIP_MIN, 1.0)
        for p in self.params():
            p.grad = None

    def state(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.params()]

    @torch.no_grad()
    def load(self, state: list[torch.Tensor]) -> None:
        for p, v in zip(self.params(), state):
            p.copy_(v)

    @torch.no_grad()
    def final(self, dtype: torch.dtype):
        """(fake-quantized weight in `dtype`, scale, zero point or None): the learned codes
        on the grid of `primitives` (or the full-range one), with qparams from the clipped
        ranges (scale in the `scale_dtype` given at construction)."""
        a, lo, hi = self.args, self.beta * self.lo, self.alpha * self.hi
        if self.full:
            scale, zero = full_range_scale(lo, hi, a, self.scale_dtype).to(self.scale_dtype), None
        else:
            scale, zero = qparams_from_minmax(lo, hi, a, self.scale_dtype, self.global_scale)
        y = self.W / _expand(scale.float(), self.W, a, None)  # as `primitives.quantize`, plus V
        if a.is_fp4:
            q = round_e2m1(y + self.V)
        else:
            if zero is not None:
                y = y + _expand(zero.float(), self.W, a, None)
            q = torch.round(y + self.V).clamp(a.qmin, a.qmax).to(torch.int8)
        return dequantize(q, scale, zero, a, None, dtype), scale, zero


@dataclass(slots=True)
class BlockData:
    """What one block is trained on, per calibration batch: the inputs it runs on
    ([rows, seq, hidden]), its keyword arguments, and the float targets it is scored against."""

    hidden: list[torch.Tensor]
    kwargs: list[dict]
    targets: list[torch.Tensor]


@dataclass(slots=True)
class Learned:
    """What `learn_block` returns: the loss of round-to-nearest and of the kept iterate (the
    MSE of the block's output over every calibration row), and the step losses."""

    rtn_loss: float
    loss: float
    losses: list[float]


def _draws(data: BlockData, batch: int, g: torch.Generator):
    """Endless steps' rows, (batch, row) pairs: the next `batch` of a shuffle of every
    calibration row, a new shuffle when fewer are left (so each pass sees each row once)."""
    rows = [(j, r) for j, h in enumerate(data.hidden) for r in range(h.shape[0])]
    batch, queue = min(batch, len(rows)), []
    while True:
        if len(queue) < batch:
            queue = [rows[k] for k in torch.randperm(len(rows), generator=g).tolist()]
        yield sorted(queue[:batch])
        queue = queue[batch:]


def _gather(data: BlockData, picked: list[tuple[int, int]]):
    """(inputs, keyword arguments, targets) of the rows `picked` ((batch, row) pairs), which
    may come from several calibration batches: per-row tensors are taken from each row's own
    batch; what a batch shares by all its rows (positions, a causal mask) is the first's,
    the same for every batch of rows of one length."""
    by_batch: dict[int, list[int]] = {}
    for j, r in picked:
        by_batch.setdefault(j, []).append(r)
    parts = [(j, torch.tensor(rows)) for j, rows in by_batch.items()]
    sizes = [data.hidden[j].shape[0] for j, _ in parts]

    def pick(values: list):
        first = values[0]
        if isinstance(first, torch.Tensor):
            per_row = first.dim() and max(sizes) > 1 and all(v.shape[0] == n for v, n in zip(values, sizes))
            return torch.cat([v.index_select(0, i) for v, (_, i) in zip(values, parts)]) if per_row else first
        if isinstance(first, (tuple, list)):
            return type(first)(pick([v[k] for v in values]) for k in range(len(first)))
        return first

    h = torch.cat([data.hidden[j].index_select(0, i) for j, i in parts])
    target = torch.cat([data.targets[j].index_select(0, i) for j, i in parts])
    kwargs = [data.kwargs[j] for j, _ in parts]
    return h, {k: pick([kw[k] for kw in kwargs]) for k in kwargs[0]}, target


def _output(block: nn.Module, weights: dict[str, torch.Tensor], h: torch.Tensor, kw: dict) -> torch.Tensor:
    out = functional_call(block, weights, (h,), kw, strict=False)
    return out[0] if isinstance(out, tuple) else out


def _full_loss(block: nn.Module, weights: dict, data: BlockData) -> float:
    with torch.no_grad():
        total = sum(
            (_output(block, weights, h, kw).float() - t).pow(2).sum().item()
            for h, kw, t in zip(data.hidden, data.kwargs, data.targets)
        )
    return total / sum(t.numel() for t in data.targets)


def learn_block(
    block: nn.Module,
    roundings: dict[str, Rounding],
    data: BlockData,
    iters: int = 200,
    lr: float | None = None,
    clip_lr: float | None = None,
    batch: int = 8,
    seed: int = 0,
) -> Learned:
    """Learn the `roundings` (linear name in `block` -> `Rounding`) by `iters` signed-gradient
    steps on the MSE of the block's output against `data.targets`, each step on the next
    `batch` rows of a shuffle of all calibration rows, across batches, shuffled again when
    they run out (`seed`; the reference's index sampler). The kept iterate is the one whose step
    loss was lowest; if over all rows it scores worse than round-to-nearest (V = 0, α = β =
    1), round-to-nearest is kept, so the result is never worse on the calibration rows. The
    roundings are left holding the kept parameters; the block itself is not modified."""
    lr = 1.0 / max(iters, 1) if lr is None else lr
    clip_lr = lr if clip_lr is None else clip_lr
    frozen = [p for p in block.parameters() if p.requires_grad]
    for p in frozen:
        p.requires_grad_(False)  # no gradient for anything but V, α, β
    start = {n: r.state() for n, r in roundings.items()}
    g = torch.Generator().manual_seed(seed)
    draws = _draws(data, batch, g)
    best, best_state, losses = float("inf"), start, []
    try:
        with torch.enable_grad():
            for t in range(iters):
                h, kw, target = _gather(data, next(draws))
                weights = {f"{name}.weight": r.weight().to(h.dtype) for name, r in roundings.items()}
                loss = (_output(block, weights, h, kw).float() - target).pow(2).mean()
                losses.append(loss.item())
                if losses[-1] < best:
                    best, best_state = losses[-1], {n_: r.state() for n_, r in roundings.items()}
                loss.backward()
                decay = 1.0 - t / iters  # linear decay to 0
                for r in roundings.values():
                    r.step(lr * decay, clip_lr * decay)
    finally:
        for p in frozen:
            p.requires_grad_(True)
    return _keep(block, roundings, data, start, best_state, losses)


def _keep(block, roundings, data, start, best_state, losses) -> Learned:
    # the best iterate, unless round-to-nearest scores lower over every calibration row
    def weights(state):
        for n, r in roundings.items():
            r.load(state[n])
        with torch.no_grad():
            return {f"{n}.weight": r.weight().to(data.hidden[0].dtype) for n, r in roundings.items()}

    rtn_loss = _full_loss(block, weights(start), data)
    loss = _full_loss(block, weights(best_state), data) if best_state is not start else rtn_loss
    if loss > rtn_loss:
        for n, r in roundings.items():
            r.load(start[n])
        loss = rtn_loss
    return Learned(rtn_loss, loss, losses)


@torch.no_grad()
def _float_outputs(block: nn.Module, hidden: list[torch.Tensor], kwargs: list[dict]) -> list[torch.Tensor]:
    return [_output(block, {}, h, kw).float() for h, kw in zip(hidden, kwargs)]


def autoround_step(
    spec: ArchSpec, scheme: QuantScheme, options, results: dict, scale_dtype, log: Callable | None = None
):
    """Runner step: learn the rounding of every targeted linear of a block on its
    calibration inputs (see the module docstring), then write the rounded weights in place."""
    stream = FloatStream()

    def step(index: int, prefix: str, block: nn.Module, inputs) -> None:
        block_spec = spec.for_block(block)
        names = targets(scheme, prefix, block_spec.linears)
        shared = fp4.weight_global_scales(block_spec, scheme, prefix, block, names)
        outputs = _float_outputs(block, stream.inputs(index, inputs.hidden), inputs.kwargs)
        stream.advance(index, outputs)
        full = options.grid == "full"
        roundings = {
            n: Rounding(
                get_module(block, n).weight.data, weight_args(scheme, prefix, n), shared.get(n), scale_dtype, full
            )
            for n in names
        }
        data = BlockData(inputs.hidden, inputs.kwargs, outputs)
        found = learn_block(block, roundings, data, options.iters, options.lr, options.clip_lr, options.batch, index)
        if log is not None:
            log(f"{prefix}: block output MSE {found.loss:.3g} (round-to-nearest {found.rtn_loss:.3g})")
        for name, r in roundings.items():
            linear = get_module(block, name)
            w, scale, zero = r.final(linear.weight.dtype)
            linear.weight.data.copy_(w)
            results[f"{prefix}.{name}"] = QParams(scale, zero, global_scale=shared.get(name))
        fp4.record_input_global_scales(block_spec, scheme, prefix, block, names, inputs, results)

    step.state = stream.state  # the float stream travels with a resumable run's commits
    step.restore = stream.restore
    return step


def plan_cost(groups: list[tuple[int, int, float]], tokens: int, group_size: int, sparse_input: int) -> dict:
    """What AutoRound adds to calibrating one block, for `plan`, at its defaults (200 steps of 8
    rows; rows of the default 512 tokens, since the cost model is not told the row length):
    per step the block's forward and backward (about 3 forwards' matmuls) on the step's rows,
    and two forwards over every row to compare the kept iterate with round-to-nearest;
    working set: the fp32 weights, V, its gradient and the kept iterate, per linear."""
    o = AutoRoundOptions()
    step_tokens = min(tokens, o.batch * Calibration.seq_len)
    per_token = sum(2 * i * out * share for i, out, share in groups)
    working = sum(4 * 4 * i * out for i, out, _ in groups)
    flops = (o.iters * 3 * step_tokens + 2 * tokens) * per_token
    return {"working_set": working, "flops": flops, "efficiency": PLAN_EFFICIENCY}


# measured on smollm2 (2026-12-03, the 2-core EPYC, one thread): 1.94 CPU s per step of 8 x 512
# tokens, 3 x 2 x 4096 x 3.4M = 84 GFLOP: 43 GFLOP/s, against the 120 GFLOP/s of GPTQ's fit
PLAN_EFFICIENCY = 0.36
