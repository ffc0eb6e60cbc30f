"""Perplexity on the protocol of the AWQ and GPTQ papers, so numbers compare with theirs."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

from quantkit.errors import QuantkitError
from quantkit.kernels.attention import twin as reference
from quantkit.progress import Track, no_progress

# observe(first window, ids [b, seq], first position, fp32 logits [b, chunk, vocab]): called
# for every chunk of predicted positions, e.g. by quantkit.eval.kld
Observe = Callable[[int, torch.LongTensor, int, torch.Tensor], None]


def perplexity(
    model,
    tokens: torch.LongTensor,
    seq_len: int,
    limit: int | None = None,
    batch_size: int = 1,
    track: Track = no_progress,
    observe: Observe | None = None,
) -> dict:
    """Perplexity of a causal LM (`model(input_ids).logits`) on a 1-D token stream.

    The stream is cut into non-overlapping windows of exactly `seq_len` tokens (the
    remainder is dropped; only the first `limit` windows when given), the windows run
    through the model `batch_size` at a time, and the negative log-likelihood of every
    next-token prediction (seq_len - 1 per window, computed in fp32) is averaged over all
    windows. Returns {"ppl": exp(nll), "nll", "tokens": windows * seq_len, "windows",
    "seq_len"}. Logits exist for `CHUNK` positions at a time (see `summed_nll`); each chunk
    is also handed to `observe` (see `Observe`) when given.
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
                seen = None if observe is None else functools.partial(observe, start, ids)
                total += summed_nll(model, ids, seen)
    finally:
        model.train(was_training)
    nll = total / (n * (seq_len - 1))
    return {"ppl": math.exp(nll), "nll": nll, "tokens": n * seq_len, "windows": n, "seq_len": seq_len}


CHUNK = 256  # positions whose fp32 logits exist at once: 256 × 262k vocabulary (Gemma 3) is 268 MB


def summed_nll(model, ids: torch.LongTensor, observe: Callable[[int, torch.Tensor], None] | None = None) -> float:
    """The summed next-token NLL of the windows `ids` [b, seq], in fp32, from `head_logits`
    (so a window × vocabulary of logits never exists at once); `observe(first position,
    logits)` sees every chunk."""
    total = 0.0
    for position, logits in head_logits(model, ids):
        targets = ids[:, position + 1 : position + 1 + logits.shape[1]]  # [b, chunk]
        total += F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum").item()
        if observe is not None:
            observe(position, logits)
    return total


def head_logits(model, ids: torch.LongTensor) -> Iterator[tuple[int, torch.Tensor]]:
    """(first position, fp32 logits [b, ≤CHUNK, vocab]) for the predicting positions
    0 … seq - 2 of the windows `ids` [b, seq]: the base model's hidden states go through the
    LM head `CHUNK` positions at a time, with the config's final logit soft-cap. A model
    without a separate base model and head is cut from its full logits."""
    head, base = model.get_output_embeddings(), getattr(model, "base_model", None)
    if head is None or base is None or base is model:
        logits = model(ids).logits[:, :-1]
        for position in range(0, logits.shape[1], CHUNK):
            yield position, logits[:, position : position + CHUNK].float()
        return
    cap = getattr(model.config, "final_logit_softcapping", None)
    hidden = base(input_ids=ids).last_hidden_state[:, :-1]  # [b, seq - 1, hidden]
    for position in range(0, hidden.shape[1], CHUNK):
        logits = head(hidden[:, position : position + CHUNK]).float()  # [b, chunk, vocab]
        logits = reference.cap(logits, cap)
        yield position, logits
