"""Calibration on llama.cpp's block grids (GGUF export): GPTQ rounding on the type's own
grid, with each block's stored parameters chosen by `formats.gguf.choose`'s
importance-weighted search at the moment GPTQ reaches the block.

The reference is GPTQ's `fasterquant` (Frantar et al. 2022) with groups: the columns are
visited in order; when a column starts a block (32 weights; a K-quant's super-block of 256)
that block's parameters are chosen from its weights as GPTQ has updated them so far,
weighted by the Hessian's diagonal (the importance matrix of llama.cpp: the mean squared
input of each column); each column is then rounded to its nearest code and its error
spread over the columns not yet visited. Without `gptq` only the search runs (what
llama.cpp's quantizer does with an importance matrix).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import nn

from quantkit.calibration.awq import fold_scales, search_scales
from quantkit.calibration.gptq import accumulate_hessian
from quantkit.calibration.hooks import (
    Replay,
    mapping_input,
    mapping_inputs,
    mappings,
    reduce_each,
    reduce_inputs,
    scaled_inputs,
)
from quantkit.formats.gguf import Blocks, BlockType, choose, dequantize, grid, round_codes
from quantkit.models.arch import ArchSpec, get_module
from quantkit.scheme import QuantArgs


def _factor(H: torch.Tensor, damp: float) -> torch.Tensor:
    """Upper Cholesky factor of H⁻¹ (after dampening), GPTQ's Hinv."""
    H = H.clone()
    dead = torch.diag(H) == 0
    H[dead, dead] = 1
    H += damp * torch.diag(H).mean() * torch.eye(len(H), dtype=H.dtype)
    return torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)


def _cat(parts: list[Blocks], t: BlockType, q: torch.Tensor) -> Blocks:
    def cat(field):
        values = [getattr(p, field) for p in parts]
        return None if values[0] is None else torch.cat(values, dim=1)

    return Blocks(t, q, cat("d"), cat("m"), cat("sc"), cat("mn"))


@torch.no_grad()
def quantize_blocks(
    W: torch.Tensor,
    H: torch.Tensor,
    t: BlockType,
    damp: float = 0.01,
    gptq: bool = True,
    static: bool = False,
    actorder: bool = False,
    weigh: str = "diag",
) -> Blocks:
    """W [rows, cols] in type t, calibrated on H [cols, cols] (the inputs' second moment).

    `static`: every block's parameters are chosen from the float weights before GPTQ runs
    (as llama.cpp's imatrix search), and GPTQ rounds onto that fixed grid, visiting the
    columns by descending diag H with `actorder`. Otherwise each block's parameters are
    chosen when GPTQ reaches it, from the weights as updated so far, weighted by diag H
    (`weigh` "diag") or by what rounding a column costs once its error is spread,
    1 / Hinv[j, j]² of GPTQ's factor ("gptq")."""
    W = W.float().clone()
    H = H.float()
    importance = torch.diag(H).clone()
    importance += 1e-6 * importance.mean().clamp_min(1e-30)
    if not gptq:
        return choose(W, t, importance)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one column at a time: vectors too small to share between threads
    try:
        if static:
            params = choose(W, t, importance)
            s, m = grid(params)
            s = s.repeat_interleave(t.sub, -1) if s.dim() == 2 else s.expand_as(W)
            m = m.repeat_interleave(t.sub, -1) if m.dim() == 2 else m.expand_as(W)
            order = torch.argsort(torch.diag(H), descending=True) if actorder else torch.arange(W.shape[1])
            return replace(params, q=_fixed_loop(W, H, s, m, t, damp, order))
        return _column_loop(W, H, importance, t, damp, weigh)
    finally:
        torch.set_num_threads(threads)


def _fixed_loop(W, H, s, m, t: BlockType, damp: float, order: torch.Tensor) -> torch.Tensor:
    """GPTQ's column loop onto fixed grids s, m [rows, cols], the columns visited in `order`;
    the codes [rows, cols] in the original column order."""
    rows, cols = W.shape
    W[:, torch.diag(H) == 0] = 0
    W, s, m = W[:, order], s[:, order].contiguous(), m[:, order].contiguous()
    Hinv = _factor(H[order][:, order], damp)
    Q = torch.zeros(rows, cols, dtype=torch.int32)
    for i1 in range(0, cols, 128):
        i2 = min(i1 + 128, cols)
        W1, Err1, Hinv1 = W[:, i1:i2].clone(), torch.zeros(rows, i2 - i1), Hinv[i1:i2, i1:i2]
        for j in range(i2 - i1):
            w, sj, mj = W1[:, j], s[:, i1 + j], m[:, i1 + j]
            q = round_codes(w, sj, mj, t)
            value = sj * (q - t.zero).float()
            if t.offset != "none":
                value = value + mj
            Q[:, i1 + j] = q
            err = (w - value) / Hinv1[j, j]
            W1[:, j:] -= err.unsqueeze(1) * Hinv1[j, j:].unsqueeze(0)
            Err1[:, j] = err
        W[:, i2:] -= Err1 @ Hinv[i1:i2, i2:]
    out = torch.empty_like(Q)
    out[:, order] = Q
    return out


def _column_loop(
    W: torch.Tensor, H: torch.Tensor, importance: torch.Tensor, t: BlockType, damp: float, weigh: str = "diag"
) -> Blocks:
    rows, cols = W.shape
    W[:, torch.diag(H) == 0] = 0
    Hinv = _factor(H, damp)
    if weigh == "gptq":
        importance = Hinv.diagonal().pow(-2)
    Q = torch.zeros(rows, cols, dtype=torch.int32)
    parts: list[Blocks] = []
    step = max(128, t.block)
    for i1 in range(0, cols, step):
        i2 = min(i1 + step, cols)
        W1, Err1, Hinv1 = W[:, i1:i2].clone(), torch.zeros(rows, i2 - i1), Hinv[i1:i2, i1:i2]
        for j in range(i2 - i1):
            if j % t.block == 0:  # a block starts: its parameters from the weights as they are now
                part = choose(W1[:, j : j + t.block], t, importance[i1 + j : i1 + j + t.block])
                parts.append(part)
                s, m = (x.repeat_interleave(t.sub, -1) if x.dim() == 2 else x.expand(rows, t.block) for x in grid(part))
            k = j % t.block
            w = W1[:, j]
            q = round_codes(w, s[:, k], m[:, k], t)
            value = s[:, k] * (q - t.zero).float()
            if t.offset != "none":
                value = value + m[:, k]
            Q[:, i1 + j] = q
            err = (w - value) / Hinv1[j, j]
            W1[:, j:] -= err.unsqueeze(1) * Hinv1[j, j:].unsqueeze(0)
            Err1[:, j] = err
        W[:, i2:] -= Err1 @ Hinv[i1:i2, i2:]
    return _cat(parts, t, Q)


def _split(b: Blocks, rows: list[int]) -> list[Blocks]:
    def part(x):
        return [None] * len(rows) if x is None else x.split(rows)

    fields = zip(b.q.split(rows), part(b.d), part(b.m), part(b.sc), part(b.mn))
    return [Blocks(b.type, *f) for f in fields]


@dataclass(frozen=True)
class GGUFOptions:
    """How `gguf_step` calibrates (see `quantize_blocks`)."""

    gptq: bool = True
    damp: float = 0.01
    static: bool = False
    actorder: bool = False
    weigh: str = "diag"
    outliers: float = (
        0.0  # > 0: tokens whose input norm passes this × the median left out of H (hurt; see typical_tokens)
    )
    # fold AWQ scales (searched on AWQ_PROXY's grid) into the block first; measured in llama.cpp
    # (docs/benchmarks.md), Q4_0 KL from f32 0.213 -> 0.120 on smollm2-135m
    awq: bool = True
    awq_tokens: int = 4096  # captured input tokens per group the AWQ search scores on


# the grid AWQ's scale search rounds on: int4 asymmetric in groups of 32, close to every
# 4- and 5-bit GGUF type's (a block of 32, or a K-quant's sub-block of 32, with its own range)
AWQ_PROXY = QuantArgs(num_bits=4, symmetric=False, strategy="group", group_size=32)


def fold_awq(
    spec: ArchSpec,
    block: nn.Module,
    names: list[str],
    inputs,
    tokens: int,
    label: str = "",
    outliers: float = 0.0,
    keep: frozenset = frozenset(),
) -> None:
    """AWQ's scales for each mapping of the block that feeds `names` (norm → q/k/v, norm →
    gate/up, up → down, v → o where shapes allow), searched on AWQ_PROXY and folded into the
    float weights (the previous op divided, the linears' columns multiplied: exact in float).
    A mapping that would change a linear of `keep` (as one of its linears or as the op it
    divides) is left out."""
    feats = mapping_inputs(spec, block, names, inputs, tokens)
    for b in mappings(spec, block, names):
        if keep.intersection([*b.mapping.linears, b.mapping.prev]):
            continue
        x = typical_tokens(feats[mapping_input(spec, b.mapping)], outliers)
        weights = [lin.weight.data for lin in b.linears]
        scales = search_scales(x, weights, AWQ_PROXY, name=f"{label}.{b.mapping.prev}").scales
        scaled_inputs(spec, feats, b.mapping, scales)
        fold_scales(b.prev_weight, b.prev_bias, weights + list(b.readers), scales, b.offset)


def on_grid(w: torch.Tensor, t: BlockType) -> bool:
    """Whether type t's own search reproduces w exactly: a model that was itself dequantized
    from this type (a re-quantization), where no scaling can bring w closer to the float model
    and AWQ's folding would only move it off the grid (gemma3-270m's built-in weights are a
    Q4_K_M file's: at Q4_K_M, q, k, v, gate and up, its Q5_0 and Q8_0 linears)."""
    w = w.float()
    return bool((dequantize(choose(w, t)) - w).abs().max() <= 1e-6 * w.abs().max())


def typical_tokens(x: torch.Tensor, ratio: float) -> torch.Tensor:
    """The rows of x [..., c] (as [tokens, c]) whose norm is at most `ratio` × the median
    token norm: without the attention sink's massive activations (the first token's input
    to a late down_proj can be 40× the others' and hold most of H). Measured on smollm2
    Q4_0 (with `static` and `actorder`): llama.cpp's KL 2.3× worse than without it, the sink
    itself being what later tokens' attention reads; kept for narrower uses, off by default."""
    x = x.reshape(-1, x.shape[-1])
    if ratio <= 0:
        return x
    norms = x.float().norm(dim=-1)
    return x[norms <= ratio * norms.median()]


def gguf_step(
    spec: ArchSpec,
    types: Callable[[str], BlockType | None],
    results: dict,
    options: GGUFOptions,
    stats: dict | None = None,
):
    """Runner step: each group of linears that read one input (q/k/v, o, gate/up, down) is
    calibrated on inputs recomputed after the groups before it were quantized; each linear
    gets `types(full name)` (None: left in float) and is left at its quantized values, its
    `Blocks` in results[full name]. Linears of one group and type are quantized as one
    stacked weight (their rows are independent), sharing one factorisation of H. With
    `stats`, stats[full name] = (Σ x² per input column, tokens) of the tokens H holds:
    llama.cpp's importance matrix."""
    o = options

    def add(state, x, n):
        H, n = accumulate_hessian(None if state is None else state[0], typical_tokens(x, o.outliers), n)
        return (H, n), n

    def step(index: int, prefix: str, block: nn.Module, inputs) -> None:
        bspec = spec.for_block(block)
        if o.awq:
            names = [n for n in bspec.linears if types(f"{prefix}.{n}") is not None]
            keep = frozenset(n for n in names if on_grid(get_module(block, n).weight.data, types(f"{prefix}.{n}")))
            fold_awq(bspec, block, names, inputs, o.awq_tokens, prefix, o.outliers, keep)
        attention = [n for n in bspec.linears if n.startswith(bspec.attention + ".")]
        done, replay = set(), None
        for stage in bspec.stages:
            if replay is None and all(n in done for n in attention):  # the attention's outputs are final
                replay = Replay(get_module(block, bspec.attention), len(inputs.hidden))
            done.update(n for names in stage for n in names)
            if len(stage) == 1:  # the block runs only as far as the group's input
                first = stage[0][0]
                H = reduce_inputs(block, get_module(block, first), inputs, f"{prefix}.{first}", add, replay)
                hessians = {first: H}
            else:
                firsts = {names[0]: get_module(block, names[0]) for names in stage}
                hessians = reduce_each(block, firsts, inputs, add, prefix, replay)
            for names in stage:
                H, tokens = hessians.pop(names[0])
                if stats is not None:  # H = 2 XᵀX / tokens
                    stats.update({f"{prefix}.{n}": (H.diagonal() * tokens / 2, tokens) for n in names})
                by_type: dict[BlockType, list[str]] = {}
                for name in names:
                    t = types(f"{prefix}.{name}")
                    if t is not None:
                        by_type.setdefault(t, []).append(name)
                for t, same in by_type.items():
                    linears = [get_module(block, n) for n in same]
                    W = torch.cat([lin.weight.data for lin in linears])
                    b = quantize_blocks(W, H, t, o.damp, o.gptq, o.static, o.actorder, o.weigh)
                    for name, lin, part in zip(same, linears, _split(b, [lin.out_features for lin in linears])):
                        lin.weight.data.copy_(dequantize(part).to(lin.weight.dtype))
                        results[f"{prefix}.{name}"] = part

    return step
