"""The running average GPTQ's Hessian is made of, below both of its users: GPTQ
(`gptq.accumulate_hessian`, IST-DASLab/gptq's `add_batch`) and its float targets
(`targets.reduce_paired`, whose D = 2/n·Σ (x̃ − x)·xᵀ is the same average of another product)."""

from __future__ import annotations

import torch

from quantkit.errors import QuantkitError


def accumulate_hessian(
    H: torch.Tensor | None, x: torch.Tensor, n: int, left: torch.Tensor | None = None
) -> tuple[torch.Tensor, int]:
    """Fold a chunk of layer inputs x [..., in] into the running average H = 2·XᵀX / n
    (with `left` [..., in], the same tokens' other operand: 2·LEFTᵀX / n).

    H (fp32 [in, in]) is None to start a new one; n is the number of tokens already in it.
    Returns the new H (the input is not modified) and the new token count.
    """
    x = x.reshape(-1, x.shape[-1]).float()  # x [tokens, in]
    left = x if left is None else left.reshape(x.shape).float()
    t, d = x.shape
    if H is None:
        H, n = torch.zeros(d, d, device=x.device), 0
    if H.shape != (d, d):
        raise QuantkitError(f"the Hessian is {tuple(H.shape)} but the inputs have width {d}; start a new one (H=None).")
    if t == 0:
        return H, n
    total = n + t
    return torch.addmm(H, left.T, x, beta=n / total, alpha=2 / total), total  # H [in, in]
