"""`quantkit eval`: load a float model or a checkpoint and score it."""

from __future__ import annotations

import hashlib
import time

from quantkit.calibration.datasets import eval_tokens, load_documents
from quantkit.errors import QuantkitError
from quantkit.eval.perplexity import Observe, perplexity
from quantkit.formats.card import record_evaluation
from quantkit.models.loading import load_tokenizer, resolve_model
from quantkit.progress import Track, no_progress
from quantkit.runtime.loader import load


def load_for_eval(model_name: str, dtype=None):
    """(model, tokenizer) of a float model or a checkpoint, as `quantkit.load` builds it."""
    path = resolve_model(model_name)
    return load(path, dtype), load_tokenizer(path)


def context_length(model) -> int:
    return getattr(model.config, "max_position_embeddings", 2048) or 2048


def window_length(model, seq_len: int | None) -> int:
    """`seq_len`, or 2048 (the model's context if shorter); longer than the context is an error."""
    context = context_length(model)
    seq_len = seq_len or min(2048, context)
    if seq_len > context:
        raise QuantkitError(
            f"--seq-len {seq_len} exceeds the model's context of {context} tokens; use at most {context}."
        )
    return seq_len


def text_perplexity(
    model,
    tokenizer,
    ppl: str = "wiki",
    seq_len: int | None = None,
    limit: int | None = None,
    batch_size: int = 1,
    track: Track = no_progress,
    observe: Observe | None = None,
) -> dict:
    """Perplexity of a loaded model on the eval split of `ppl` (the papers' protocol), with
    the dataset name and the sha256 of its text ("\\n\\n"-joined documents); `observe`
    sees every chunk of logits (see `perplexity`)."""
    seq_len = window_length(model, seq_len)
    text = "\n\n".join(load_documents(ppl, "eval"))
    result = perplexity(model, eval_tokens(tokenizer, [text]), seq_len, limit, batch_size, track, observe)
    return {"dataset": ppl, **result, "data_sha256": hashlib.sha256(text.encode()).hexdigest()}


def evaluate(
    model_name: str,
    ppl: str = "wiki",
    seq_len: int | None = None,
    limit: int | None = None,
    batch_size: int = 1,
    track: Track = no_progress,
    dtype=None,
) -> dict:
    """Perplexity of `model_name` (computing in `dtype`, default its own) on the eval split of
    `ppl` (the papers' protocol), also recorded in the checkpoint's `quantkit.json` and model
    card when it is a quantkit one.

    `seq_len` defaults to 2048, or the model's context if shorter."""
    model, tokenizer = load_for_eval(model_name, dtype)
    start = time.perf_counter()
    result = text_perplexity(model, tokenizer, ppl, seq_len, limit, batch_size, track)
    result = {"model": str(model_name), **result, "eval_time_s": round(time.perf_counter() - start, 2)}
    row = {"metric": "ppl", "baseline": None, "candidate": result["ppl"], "delta": None}
    report = {"ppl": ppl, "limit": limit, "seq_len": seq_len, "rows": [row], "passed": None}
    if dtype is not None:
        from quantkit.runtime.qlinear import dtype_name

        report["dtype"] = result["dtype"] = dtype_name(dtype)
    result["recorded"] = record_evaluation(
        resolve_model(model_name), report | {"data_sha256": {"ppl": result["data_sha256"]}}
    )
    return result
