"""The output projection (lm_head) quantized too (`--lm-head int8|int4`), opt-in: round to nearest,
int8 per output channel or int4 in groups of up to 128 (the kind vLLM's CPU build runs),
symmetric, weight-only, written `pack-quantized` as a config group of
its own whose target is the head's name (compressed-tensors' layout for a quantized lm_head, as
llm-compressor writes it when `lm_head` is left out of `ignore`). A model whose head is tied to
its input embeddings is untied in the checkpoint: the embeddings stay float, the head is stored
quantized, and `tie_word_embeddings` becomes false.

Why: at batch 1 a decode step reads every weight once, and a small model's float head is most
of what an INT4 checkpoint reads (smollm2-135m: 113 of 180 MB in fp32); int8 per channel
stores it in a quarter of fp32's bytes (half of bf16's)."""

from __future__ import annotations

from quantkit.calibration.method import QParams
from quantkit.errors import QuantkitError
from quantkit.primitives import compute_qparams
from quantkit.scheme import QuantArgs, QuantScheme

HEAD_ARGS = {
    "int8": QuantArgs(num_bits=8, type="int", symmetric=True, strategy="channel", group_size=None),
    # groups of 128, or the largest power of two below that divides the hidden size (`fit_group_size`)
    "int4": QuantArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=128),
}


def head_scheme(kind: str | None, scheme: QuantScheme, name: str, target_bits) -> QuantScheme:
    """`scheme` with the head `name` quantized as `kind` (None: as it is): taken out of the
    ignore list and given a config group of its own."""
    if kind is None:
        return scheme
    if kind not in HEAD_ARGS:
        raise QuantkitError(f"--lm-head {kind!r} is unknown; use {' or '.join(HEAD_ARGS)}.")
    if target_bits is not None:
        raise QuantkitError("--lm-head goes without --target-bits (mixed precision chooses the body's formats only).")
    head = QuantScheme(name, HEAD_ARGS[kind], targets=(name,), ignore=(), auto_group_size=kind == "int4")
    if scheme.format != head.format:
        raise QuantkitError(
            f"--lm-head {kind} stores the head {head.format}, and scheme {scheme.name!r} is {scheme.format}; "
            "use it with a weight-only int scheme (w4a16, w4a16-asym, w8a16)."
        )
    ignore = tuple(p for p in scheme.ignore if p != name)
    return scheme.replace(ignore=ignore, overrides=(*scheme.overrides, head))


def quantized_head(scheme: QuantScheme, name: str) -> QuantScheme | None:
    """The head's own scheme when `scheme` quantizes it (`head_scheme`), else None."""
    found = scheme.scheme_for(name)
    return found if found is not None and name in found.targets else None


def head_qparams(weight, scheme: QuantScheme, scale_dtype) -> QParams:
    """Round-to-nearest qparams of the head's [vocab, hidden] weight (min-max per channel)."""
    scale, zero_point = compute_qparams(weight, scheme.weights, scale_dtype)
    return QParams(scale=scale, zero_point=zero_point)
