"""`quantkit eval`: load a float model or a checkpoint and score it."""

from __future__ import annotations

import time

from quantkit.calibration.datasets import eval_tokens, load_documents
from quantkit.errors import QuantkitError
from quantkit.eval.perplexity import perplexity
from quantkit.models.loading import load_tokenizer, resolve_model
from quantkit.progress import Track, no_progress
from quantkit.runtime.loader import load


def evaluate(
    model_name: str,
    ppl: str = "wiki",
    seq_len: int | None = None,
    limit: int | None = None,
    batch_size: int = 1,
    track: Track = no_progress,
) -> dict:
    """Perplexity of `model_name` on the eval split of `ppl` (the papers' protocol).

    `seq_len` defaults to 2048, or the model's context if shorter."""
    path = resolve_model(model_name)
    model = load(path)
    context = getattr(model.config, "max_position_embeddings", 2048) or 2048
    seq_len = seq_len or min(2048, context)
    if seq_len > context:
        raise QuantkitError(f"--seq-len {seq_len} exceeds the model's context of {context} tokens; use at most {context}.")
    tokens = eval_tokens(load_tokenizer(path), load_documents(ppl, "eval"))
    start = time.perf_counter()
    result = perplexity(model, tokens, seq_len, limit, batch_size, track)
    return {"model": str(model_name), "dataset": ppl, **result, "eval_time_s": round(time.perf_counter() - start, 2)}
