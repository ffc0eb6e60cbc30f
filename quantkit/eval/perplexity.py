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
    "seq_len"}. Logits exist for `CHUNK` positions at a time (see `summed_nll`).
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
                total += summed_nll(model, ids)
    finally:
        model.train(was_training)
    nll = total / (n * (seq_len - 1))
    return {"ppl": math.exp(nll), "nll": nll, "tokens": n * seq_len, "windows": n, "seq_len": seq_len}


CHUNK = 256  # positions whose fp32 logits exist at once: 256 × 262k vocabulary (Gemma 3) is 268 MB


def summed_nll(model, ids: torch.LongTensor) -> float:
    """The summed next-token NLL of the windows `ids` [b, seq], in fp32: the base model's
    hidden states go through the LM head `CHUNK` positions at a time (with the config's
    final logit soft-cap), so a window × vocabulary of logits never exists at once. A model
    without a separate base model and head is scored from its full logits."""
    head, base = model.get_output_embeddings(), getattr(model, "base_model", None)
    if head is None or base is None or base is model:
        logits = model(ids).logits
        return sum(F.cross_entropy(lg[:-1].float(), row[1:], reduction="sum").item() for row, lg in zip(ids, logits))
    cap = getattr(model.config, "final_logit_softcapping", None)
    hidden = base(input_ids=ids).last_hidden_state[:, :-1]  # [b, seq - 1, hidden]
    targets = ids[:, 1:]
    total = 0.0
    for h, t in zip(hidden.split(CHUNK, dim=1), targets.split(CHUNK, dim=1)):
        logits = head(h).float()  # [b, chunk, vocab]
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        total += F.cross_entropy(logits.flatten(0, 1), t.flatten(), reduction="sum").item()
    return total
