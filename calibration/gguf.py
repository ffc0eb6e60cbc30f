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

import torch
from torch import nn

from quantkit.calibration.gptq import accumulate_hessian
from quantkit.calibration.hooks import reduce_each
from quantkit.formats.gguf import Blocks, BlockType, choose, dequantize, grid, round_codes
from quantkit.models.arch import ArchSpec, get_module


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
def quantize_blocks(W: torch.Tensor, H: torch.Tensor, t: BlockType, damp: float = 0.01, gptq: bool = True) -> Blocks:
    """W [rows, cols] in type t, calibrated on H [cols, cols] (the inputs' second moment)."""
    W = W.float().clone()
    H = H.float()
    importance = torch.diag(H).clone()
    importance += 1e-6 * importance.mean().clamp_min(1e-30)
    if not gptq:
        return choose(W, t, importance)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one column at a time: vectors too small to share between threads
    try:
        return _column_loop(W, H, importance, t, damp)
    finally:
        torch.set_num_threads(threads)


def _column_loop(W: torch.Tensor, H: torch.Tensor, importance: torch.Tensor, t: BlockType, damp: float) -> Blocks:
    rows, cols = W.shape
    W[:, torch.diag(H) == 0] = 0
    Hinv = _factor(H, damp)
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


def gguf_step(spec: ArchSpec, types: Callable[[str], BlockType | None], results: dict, gptq: bool, damp: float = 0.01):
    """Runner step: each group of linears that read one input (q/k/v, o, gate/up, down) is
    calibrated on inputs recomputed after the groups before it were quantized; each linear
    gets `types(full name)` (None: left in float) and is left at its quantized values, its
    `Blocks` in results[full name]."""

    def step(index: int, prefix: str, block: nn.Module, inputs) -> None:
        for stage in spec.for_block(block).stages:
            firsts = {names[0]: get_module(block, names[0]) for names in stage}
            hessians = reduce_each(block, firsts, inputs, accumulate_hessian, prefix)
            for names in stage:
                H = hessians.pop(names[0])
                for name in names:
                    t = types(f"{prefix}.{name}")
                    if t is None:
                        continue
                    linear = get_module(block, name)
                    b = quantize_blocks(linear.weight.data, H, t, damp, gptq)
                    linear.weight.data.copy_(dequantize(b).to(linear.weight.dtype))
                    results[f"{prefix}.{name}"] = b

    return step
