"""Perplexity on the protocol of the AWQ and GPTQ papers, so numbers compare with theirs."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from quantkit.errors import QuantkitError
from quantkit.progress import Track, no_progress


def perplexity(
    model,
    tokens: torch.LongTensor,
    seq_len: int,
    limit: int | None = None,
    batch_size: int = 1,
    track: Track = no_progress,
) -> dict:
    """Perplexity of a causal LM (`model(input_ids).logits`) on a 1-D token stream.

    The stream is cut into non-overlapping windows of exactly `seq_len` tokens (the
    remainder is dropped; only the first `limit` windows when given), the windows run
    through the model `batch_size` at a time, and the negative log-likelihood of every
    next-token prediction (seq_len - 1 per window, computed in fp32) is averaged over all
    windows. Returns {"ppl": exp(nll), "nll", "tokens": windows * seq_len, "windows",
    "seq_len"}.
    """
    if tokens.dim() != 1:
        raise QuantkitError(
            f"perplexity needs a 1-D token stream, got shape {tuple(tokens.shape)}; flatten the tokens first."
        )
    if seq_len < 2 or batch_size < 1 or (limit is not None and limit < 1):
        raise QuantkitError(
            f"need seq_len >= 2, batch_size >= 1 and limit >= 1, got seq_len={seq_len}, "
            f"batch_size={batch_size}, limit={limit}."
        )
    n = tokens.numel() // seq_len
    if n == 0:
        raise QuantkitError(
            f"the evaluation text has {tokens.numel()} tokens, fewer than one window of "
            f"{seq_len}; use a shorter --seq-len or a larger evaluation set."
        )
    n = min(n, limit) if limit is not None else n
    windows = tokens[: n * seq_len].view(n, seq_len)
    device = next(model.parameters()).device
    starts = range(0, n, batch_size)
    total = 0.0
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            for start in track(starts, "perplexity", len(starts)):
                ids = windows[start : start + batch_size].to(device)  # [b, seq_len]
                logits = model(ids).logits  # [b, seq_len, vocab]
                for row, row_logits in zip(ids, logits):
                    total += F.cross_entropy(row_logits[:-1].float(), row[1:], reduction="sum").item()
                del logits
    finally:
        model.train(was_training)
    nll = total / (n * (seq_len - 1))
    return {"ppl": math.exp(nll), "nll": nll, "tokens": n * seq_len, "windows": n, "seq_len": seq_len}
