"""Float targets for GPTQ (GPTAQ: Li et al., "GPTAQ: Efficient Finetuning-Free Quantization
for Asymmetric Calibration", ICML 2025).

GPTQ fits a linear's quantized weights Q to the linear's own float output on the inputs X
the quantized model gives it (every earlier linear already quantized): min ‖(W − Q)·X‖².
What the quantized model is scored against is the float model, whose linear sees other
inputs X̃. With H = X·Xᵀ and D = (X̃ − X)·Xᵀ (tokens as columns), the least-squares weights
for the float output from the quantized inputs are

    W* = W·X̃·Xᵀ·(X·Xᵀ)⁻¹ = W + W·D·H⁻¹,   and   ‖W·X̃ − Q·X‖² = ‖W·X̃ − W*·X‖² + ‖(W* − Q)·X‖²

for every Q, so GPTQ run on W* under the same H minimises the error against the float
model's output over Q; the first term is what no weights can remove. Where the inputs agree
(block 0's first linears) D = 0 and W* = W.

`reduce_paired` gathers H and D (each `hessian.accumulate_hessian`'s running average) in one pass
over the calibration batches: each batch runs through a float copy of the block on the float
model's hidden states and through the block as it is now on the quantized model's
(`hooks.observe_pairs`). `float_weights` is W*, with H dampened as GPTQ dampens it, so that
W* = W exactly when D = 0. `FloatTargets` is what GPTQ's step keeps for them: the float
model's hidden states from block to block (`runner.FloatStream`, saved with a resumable run's
state) and, within a block, its float copy.
"""

from __future__ import annotations

import contextlib
import copy

import torch
from torch import nn

from quantkit.calibration.hessian import accumulate_hessian
from quantkit.calibration.hooks import Replay, observe_pairs
from quantkit.calibration.runner import BlockInputs, FloatStream
from quantkit.errors import QuantkitError
from quantkit.models.arch import get_module


def reduce_paired(
    block: nn.Module, float_block: nn.Module, names: list[str], inputs: BlockInputs, float_hidden, replays=()
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """name -> (H, D) [in, in] fp32 for each linear of `names` (their inputs independent of
    each other): H = 2/n·Σ x·xᵀ of its inputs x in `block` on `inputs`, D = 2/n·Σ (x̃ − x)·xᵀ
    with x̃ its input in `float_block` on `float_hidden`, over the n calibration tokens."""
    state: dict[str, tuple] = {}

    def observe(name, x_float, x):
        x = x.reshape(-1, x.shape[-1]).float()
        H, D, n = state.get(name) or (None, None, 0)
        D, _ = accumulate_hessian(D, x, n, left=x_float.reshape(x.shape).float() - x)
        H, total = accumulate_hessian(H, x, n)
        state[name] = (H, D, total)

    observe_pairs(block, float_block, names, inputs, float_hidden, observe, replays)
    missing = [n for n in names if n not in state]
    if missing:
        raise QuantkitError(f"no calibration token reached {missing[0]}; calibrate on more text.")
    return {name: (H, D) for name, (H, D, _) in state.items()}


def float_weights(W: torch.Tensor, H: torch.Tensor, D: torch.Tensor, damp: float) -> torch.Tensor:
    """W* = W + W·D·(H + λI)⁻¹ [out, in] in W's dtype, λ = damp·mean(diag H) (GPTQ's damping)."""
    mean = H.diagonal().mean()
    if not mean > 0:  # inputs all zero: nothing to fit
        return W
    dtype = torch.promote_types(W.dtype, torch.float32)  # fp32 math for bf16/fp16 weights
    Hd = H.to(dtype) + damp * mean * torch.eye(H.shape[0], device=H.device, dtype=dtype)
    L, info = torch.linalg.cholesky_ex(Hd)
    if info.item() != 0:
        raise QuantkitError("the float targets' Hessian cannot be factored; raise --damp.")
    shift = torch.cholesky_solve((W.to(dtype) @ D.to(dtype)).T, L).T  # W·D·Hd⁻¹ (Hd symmetric)
    return (W.to(dtype) + shift).to(W.dtype)


class FloatTargets:
    """GPTQ's float targets in its runner step: `start` a block (its float copy, taken before it is
    quantized, and the float model's inputs to it), `attention_done` once the block's attention
    linears are quantized (the float attention's outputs are then replayed as the quantized
    one's are), `hessians` for each chunk of linear groups (their weights moved to W* first),
    and `finish` (the float block's outputs, the next block's float inputs)."""

    def __init__(self):
        self.stream = FloatStream()
        self.state, self.restore = self.stream.state, self.stream.restore  # a resumable run's
        self.block = self.hidden = self.replay = None

    def start(self, index: int, block: nn.Module, inputs: BlockInputs) -> None:
        self.block, self.replay = copy.deepcopy(block), None
        self.hidden = self.stream.inputs(index, inputs.hidden)

    def attention_done(self, attention: str, batches: int) -> None:
        self.replay = Replay(get_module(self.block, attention), batches)

    def hessians(self, block, prefix: str, chunk: list[list[str]], inputs, replay, damp: float, finite) -> dict:
        """First linear of each group of `chunk` -> its H (`finite(H, full name)` checked), each
        group's weights moved to W* in place."""
        replays = [r for r in (replay, self.replay) if r is not None]
        paired = reduce_paired(block, self.block, [names[0] for names in chunk], inputs, self.hidden, replays)
        hessians = {}
        for names in chunk:
            H, D = paired[names[0]]
            hessians[names[0]] = H = finite(H, f"{prefix}.{names[0]}")
            for name in names:
                linear = get_module(block, name)
                linear.weight.data.copy_(float_weights(linear.weight.data, H, D, damp))
        return hessians

    def finish(self, index: int, kwargs: list[dict]) -> None:
        with self.replay.active() if self.replay is not None else contextlib.nullcontext():
            self.stream.advance(index, BlockInputs(self.hidden, kwargs).run(self.block))
        self.block = self.hidden = self.replay = None
