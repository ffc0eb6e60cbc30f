"""What a GGUF file for llama.cpp holds besides the blocks: the family's metadata, tensor
names and row order as llama.cpp's convert_hf_to_gguf.py writes them, the tokenizer
(tokenizer.ggml.*) and chat template, and llama.cpp's per-tensor type choice of a file
type (`tensor_type`, after llama-quant.cpp's rules); `write` puts them in one file through
the `gguf` package's writer (written beside the target and renamed over it when complete).
"""

from __future__ import annotations

import json
import os
import re
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from quantkit.errors import QuantkitError
from quantkit.formats.gguf import TYPES, BlockType

FILE_TYPES = {"f32": 0, "q4_0": 2, "q4_1": 3, "q8_0": 7, "q4_k_m": 15, "q5_k_m": 17, "q6_k": 18}
BASE = {"q4_0": "q4_0", "q4_1": "q4_1", "q8_0": "q8_0", "q4_k_m": "q4_k", "q5_k_m": "q5_k", "q6_k": "q6_k"}
FALLBACK = {"q4_k": "q5_0", "q5_k": "q5_1", "q6_k": "q8_0"}  # rows that do not fill 256-weight super-blocks
LINEARS = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "self_attn.qkv_proj": "attn_qkv",  # Phi-3's fused projections, as llama.cpp's phi3 reads them
    "mlp.gate_up_proj": "ffn_up",  # gate rows first: llama.cpp's SwiGLU gates with the first half
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",  # Qwen2-MoE's shared expert
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",  # its sigmoid gate, [hidden] in llama.cpp, kept float
}
# a mixture of experts: each expert's linear, stacked over the experts into one 3-D tensor
# [experts, rows, cols] (Mixtral's w1/w3/w2, Qwen3-MoE's gate/up/down), and the router
EXPERTS = {
    "w1": "ffn_gate_exps",
    "w3": "ffn_up_exps",
    "w2": "ffn_down_exps",
    "gate_proj": "ffn_gate_exps",
    "up_proj": "ffn_up_exps",
    "down_proj": "ffn_down_exps",
}
_EXPERT = re.compile(r"model\.layers\.(\d+)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(\w+)\.weight")
_ROUTER = re.compile(r"model\.layers\.(\d+)\.(?:block_sparse_moe|mlp)\.gate\.weight")


@dataclass(frozen=True)
class Family:
    """How llama.cpp's converter writes one architecture: its name, its norms' names, whether
    q/k rows are interleaved for llama.cpp's RoPE (Llama) or kept (NEOX RoPE: Qwen, Gemma), what
    it adds to the norms' weights (Gemma's RMSNorm scales by 1 + w; llama.cpp's by w), whether the
    token embedding keeps only the tokenizer's rows, and for the Gemmas the layer pattern llama.cpp
    hard-codes (every `global_every`-th layer global, the others sliding-window)."""

    arch: str
    norms: dict
    interleave_rope: bool = True
    norm_shift: float = 0.0
    trim_vocab: bool = False
    global_every: int = 0


_PLAIN_NORMS = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
_QK_NORMS = {"self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
_GEMMA_NORMS = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
LLAMA = Family("llama", _PLAIN_NORMS)
QWEN2 = Family("qwen2", _PLAIN_NORMS, interleave_rope=False)
QWEN3 = Family("qwen3", {**_PLAIN_NORMS, **_QK_NORMS}, interleave_rope=False)
QWEN3MOE = Family("qwen3moe", {**_PLAIN_NORMS, **_QK_NORMS}, interleave_rope=False)
QWEN2MOE = Family("qwen2moe", _PLAIN_NORMS, interleave_rope=False)
PHI3 = Family("phi3", _PLAIN_NORMS, interleave_rope=False)
GEMMA2 = Family("gemma2", _GEMMA_NORMS, interleave_rope=False, norm_shift=1.0, global_every=2)
GEMMA3 = Family(
    "gemma3", {**_GEMMA_NORMS, **_QK_NORMS}, interleave_rope=False, norm_shift=1.0, trim_vocab=True, global_every=6
)
# HF model_type -> how llama.cpp writes it
FAMILIES = {
    "llama": LLAMA,
    "mistral": LLAMA,
    "qwen2": QWEN2,
    "qwen3": QWEN3,
    "phi3": PHI3,
    "mixtral": LLAMA,  # llama.cpp's llama with experts
    "qwen2_moe": QWEN2MOE,
    "qwen3_moe": QWEN3MOE,
    "gemma2": GEMMA2,
    "gemma3_text": GEMMA3,
}


def check_family(config) -> Family:
    """How llama.cpp writes a transformers config's family, or a one-sentence refusal."""
    family = FAMILIES.get(config.model_type)
    if family is None:
        raise QuantkitError(
            f"GGUF export writes the families {', '.join(FAMILIES)} so far, not {config.model_type!r}; "
            "export a compressed-tensors checkpoint instead."
        )
    return family


def gguf_name(hf: str, family: Family = LLAMA) -> str | None:
    """llama.cpp's name of a parameter of `family` (None: not written)."""
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    if hf in fixed:
        return fixed[hf]
    if hf == "lm_head.weight":
        return "output.weight"
    if m := _EXPERT.fullmatch(hf):
        return f"blk.{m.group(1)}.{EXPERTS[m.group(3)]}.weight" if m.group(3) in EXPERTS else None
    if m := _ROUTER.fullmatch(hf):
        return f"blk.{m.group(1)}.ffn_gate_inp.weight"
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)", hf)
    if m:
        short = LINEARS.get(m.group(2)) or (family.norms.get(m.group(2)) if m.group(3) == "weight" else None)
        if short:
            return f"blk.{m.group(1)}.{short}.{m.group(3)}"
    return None


def expert_index(hf: str) -> int | None:
    """The expert a parameter belongs to (None: not an expert's)."""
    m = _EXPERT.fullmatch(hf)
    return int(m.group(2)) if m else None


def experts(config) -> int:
    return getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None) or 0


def rope_rows(rows: int, heads: int) -> torch.Tensor:
    """Row order of q/k in llama.cpp: within each head, HF's two halves (x₀…x_{d/2−1},
    y₀…y_{d/2−1}) become interleaved pairs (x₀ y₀ x₁ y₁ …), as convert_hf_to_gguf.py permutes."""
    dim = rows // heads
    return torch.arange(rows).reshape(heads, 2, dim // 2).transpose(1, 2).reshape(rows)


def _more_bits(i: int, n: int) -> bool:
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def tensor_type(file_type: str, name: str, cols: int, n_layer: int, tied: bool, imatrix: bool, experts: int = 0) -> str:
    """The block type llama.cpp's quantizer gives tensor `name` (llama.cpp's name) of a
    `file_type` file: the output (or a tied token embedding) in Q6_K, attn_v (or a fused qkv)
    and ffn_down (an expert's too) of the layers `use_more_bits` picks in Q6_K for *_k_m, Q4_1
    for the first eighth of ffn_down in a Q4_0 file calibrated with an importance matrix; in a
    model of 8 experts attn_v and attn_k in Q8_0 and, for q4_k_m, attn_output in Q5_K; a
    router in float32; then the fallback of a row that does not fill 256-weight super-blocks
    (Q4_K → Q5_0, Q5_K → Q5_1, Q6_K → Q8_0)."""
    if file_type == "f32" or "ffn_gate_inp" in name:
        return "f32"
    new = BASE[file_type]
    layer = int(name.split(".")[1]) if name.startswith("blk.") else -1
    eight = experts == 8
    if name == "output.weight" or (tied and name == "token_embd.weight"):
        if cols % TYPES[new].block:
            new = "q8_0"
        elif new != "q8_0":
            new = "q6_k"
    elif name.endswith(("attn_v.weight", "attn_qkv.weight")):  # llama.cpp counts a fused qkv as an attn_v
        if file_type in ("q4_k_m", "q5_k_m") and _more_bits(layer, n_layer):
            new = "q6_k"
        if eight:
            new = "q8_0"
    elif name.endswith("attn_k.weight") and eight:
        new = "q8_0"
    elif name.endswith("attn_output.weight") and eight and file_type == "q4_k_m":
        new = "q5_k"
    elif "ffn_down" in name:
        if file_type in ("q4_k_m", "q5_k_m") and _more_bits(layer, n_layer):
            new = "q6_k"
        elif file_type == "q4_0" and imatrix and layer < n_layer // 8:
            new = "q4_1"
    if cols % TYPES[new].block:
        new = FALLBACK.get(new, new)
    if cols % TYPES[new].block:
        return "f32"
    return new


def _rope(config, family: Family) -> tuple[dict, dict]:
    """(sliding layers', global layers') RoPE parameters; other scaled RoPEs than Llama 3's are refused."""
    rope = getattr(config, "rope_parameters", None) or {}
    local, full = (
        (rope.get("sliding_attention", {}), rope.get("full_attention", {})) if family is GEMMA3 else (rope, rope)
    )
    kinds = {local.get("rope_type", "default"), full.get("rope_type", "default")}
    if kinds != {"default"} and not (family is LLAMA and kinds == {"llama3"}):
        raise QuantkitError(
            f"GGUF export writes plain RoPE and Llama 3's scaled RoPE so far, not {'/'.join(sorted(kinds))}; "
            "export a compressed-tensors checkpoint instead."
        )
    return local, full


def check_computes_the_same(config, family: Family, head_dim: int) -> None:
    """A one-sentence refusal where llama.cpp's architecture would compute something else than
    transformers: its attention pattern, scale and soft-caps, its expert weighting."""

    def other(what: str) -> QuantkitError:
        return QuantkitError(f"llama.cpp's {family.arch} {what}, so llama.cpp would compute another model.")

    if getattr(config, "use_sliding_window", False):
        raise other("attends to the whole context and this model uses a sliding window")
    if family.global_every:
        every, n = family.global_every, config.num_hidden_layers
        pattern = ["full_attention" if i % every == every - 1 else "sliding_attention" for i in range(n)]
        if list(config.layer_types) != pattern:
            raise other(
                f"makes every {'sixth' if every == 6 else 'second'} layer global; this model's layer_types differ"
            )
        if config.query_pre_attn_scalar != head_dim:
            raise other(
                f"scales attention by 1/sqrt(head_dim {head_dim}); this model's query_pre_attn_scalar is "
                f"{config.query_pre_attn_scalar}"
            )
    if family is GEMMA2 and not (config.attn_logit_softcapping and config.final_logit_softcapping):
        raise other("caps attention and final logits (50 and 30 when unset); this model leaves one uncapped")
    if family is GEMMA3 and getattr(config, "attn_logit_softcapping", None):
        raise other("does not cap attention logits; this model does")
    if experts(config):
        if family is QWEN3MOE and not config.norm_topk_prob:
            raise other("renormalises the chosen experts' weights; this model's norm_topk_prob is false")
        if family is QWEN2MOE and config.norm_topk_prob:
            raise other("does not renormalise the chosen experts' weights; this model's norm_topk_prob is true")
        if getattr(config, "mlp_only_layers", None) or getattr(config, "decoder_sparse_step", 1) != 1:
            raise other("has experts in every layer; this model has dense ones")


def metadata(config, family: Family) -> dict:
    """The `{arch}.*` keys llama.cpp's converter writes for `config`, or a one-sentence refusal
    where llama.cpp would compute something else than transformers."""
    arch = family.arch
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    local, full = _rope(config, family)
    check_computes_the_same(config, family, head_dim)
    theta = full.get("rope_theta") or getattr(config, "rope_theta", None) or 10000.0
    meta = {
        f"{arch}.context_length": ("uint32", config.max_position_embeddings),
        f"{arch}.embedding_length": ("uint32", config.hidden_size),
        f"{arch}.block_count": ("uint32", config.num_hidden_layers),
        f"{arch}.feed_forward_length": ("uint32", config.intermediate_size),
        f"{arch}.attention.head_count": ("uint32", heads),
        f"{arch}.attention.head_count_kv": ("uint32", config.num_key_value_heads or heads),
        f"{arch}.attention.layer_norm_rms_epsilon": ("float32", config.rms_norm_eps),
        f"{arch}.rope.freq_base": ("float32", float(theta)),
    }
    if family is LLAMA:
        meta[f"{arch}.vocab_size"] = ("uint32", config.vocab_size)
        meta[f"{arch}.rope.dimension_count"] = ("uint32", head_dim)
    elif family is PHI3:  # RoPE on the first partial_rotary_factor of each head
        partial = full.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None) or 1.0)
        original = full.get("original_max_position_embeddings") or getattr(
            config, "original_max_position_embeddings", config.max_position_embeddings
        )
        meta[f"{arch}.rope.dimension_count"] = ("uint32", int(partial * config.hidden_size) // heads)
        meta[f"{arch}.rope.scaling.original_context_length"] = ("uint32", original)
        # written as llama.cpp's converter writes it; llama.cpp runs Phi-3 with full attention
        meta[f"{arch}.attention.sliding_window"] = ("uint32", getattr(config, "sliding_window", None) or 0)
    else:
        meta[f"{arch}.attention.key_length"] = ("uint32", head_dim)
        meta[f"{arch}.attention.value_length"] = ("uint32", head_dim)
    if family.global_every:
        meta[f"{arch}.attention.sliding_window"] = ("uint32", config.sliding_window)
        if family is GEMMA3:
            meta[f"{arch}.rope.freq_base_swa"] = ("float32", float(local.get("rope_theta", 10_000.0)))
    if n_experts := experts(config):
        meta[f"{arch}.expert_count"] = ("uint32", n_experts)
        meta[f"{arch}.expert_used_count"] = ("uint32", config.num_experts_per_tok)
        if family in (QWEN2MOE, QWEN3MOE):
            meta[f"{arch}.expert_feed_forward_length"] = ("uint32", config.moe_intermediate_size)
        if family is QWEN2MOE:
            meta[f"{arch}.expert_shared_feed_forward_length"] = ("uint32", config.shared_expert_intermediate_size)
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(config, key, None):
            meta[f"{arch}.{key}"] = ("float32", float(getattr(config, key)))
    return meta


def rope_factors(config) -> np.ndarray | None:
    """`rope_freqs.weight` of a Llama 3 scaled RoPE (None for plain RoPE): what llama.cpp
    divides each rotary frequency by, as Meta's rule (transformers' `llama3` rope type) scales
    it: 1 for wavelengths under original context / high_freq_factor, `factor` above original
    context / low_freq_factor, and between them the smooth interpolation of the two."""
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type") != "llama3":
        return None
    heads = config.num_attention_heads
    dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    base = rope.get("rope_theta") or getattr(config, "rope_theta", 10000.0)
    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    factor, low, high = rope.get("factor", 8.0), rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    context = rope.get("original_max_position_embeddings", 8192)
    wavelen = 2 * np.pi / freqs
    smooth = (context / wavelen - low) / (high - low)
    mid = 1 / ((1 - smooth) / factor + smooth)
    out = np.where(wavelen < context / high, 1.0, np.where(wavelen > context / low, factor, mid))
    return out.astype(np.float32)


def source_tokenizer(path: Path) -> dict:
    """Every tokenizer.* key of a GGUF file, as `write` takes them: a model converted from a
    GGUF file (the built-in models) is given back its own tokenizer, SentencePiece or BPE."""
    from gguf import GGUFReader, GGUFValueType

    meta = {}
    for key, field in GGUFReader(path).fields.items():
        if not key.startswith("tokenizer."):
            continue
        kinds = [t.name.lower() for t in field.types]
        if kinds[0] == GGUFValueType.ARRAY.name.lower():
            meta[key] = (kinds[1] + "s", field.contents())
        else:
            meta[key] = (kinds[0], field.contents())
    return meta


# the split regexes of tokenizer.json that llama-vocab.cpp runs (adapted) under these names
_WORDS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|"
_REST = r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
SPLITS = {_WORDS + r"\p{N}{1,3}" + _REST: "llama-bpe", _WORDS + r"\p{N}" + _REST: "qwen2"}


def _pre_tokenizer(spec: dict | None) -> str | None:
    """llama.cpp's pre-tokenizer name (tokenizer.ggml.pre) of a tokenizer.json pre_tokenizer, when
    known: GPT-2's and SmolLM's byte-level splits, Llama 3's and Qwen2's regex before a byte level."""
    if not spec:
        return None
    parts = spec.get("pretokenizers") if spec.get("type") == "Sequence" else [spec]
    kinds = [(p.get("type"), p.get("individual_digits"), p.get("use_regex")) for p in parts]
    if kinds == [("ByteLevel", None, True)]:
        return "gpt-2"  # llama-vocab.cpp spells the GPT-2 pre-tokenizer with a hyphen
    if kinds == [("Digits", True, None), ("ByteLevel", None, True)]:
        return "smollm"
    if kinds == [("Split", None, None), ("ByteLevel", None, False)] and parts[0].get("behavior") == "Isolated":
        return SPLITS.get(parts[0].get("pattern", {}).get("Regex"))
    return None


def tokenizer_metadata(folder: Path, tokenizer, pre: str | None = None, vocab_size: int | None = None) -> dict:
    """tokenizer.ggml.* and tokenizer.chat_template of a byte-level BPE tokenizer (the
    tokenizer.json of `folder`): tokens in id order, their types (3 control: a special added
    token; 4 user-defined: another added token; 1 normal), merges, special ids. `pre`
    overrides the pre-tokenizer name read from tokenizer.json."""
    path = Path(folder) / "tokenizer.json"
    if not path.is_file():
        raise QuantkitError(f"{folder} has no tokenizer.json; GGUF export needs a fast (byte-level BPE) tokenizer.")
    spec = json.loads(path.read_text())
    model = spec.get("model", {})
    space_prefix = _space_prefix(spec) if model.get("type") == "BPE" and model.get("byte_fallback") else None
    if space_prefix is not None:
        return _sentencepiece_metadata(folder, spec, tokenizer, vocab_size or len(tokenizer), space_prefix)
    pre = pre or _pre_tokenizer(spec.get("pre_tokenizer"))
    if model.get("type") != "BPE" or pre is None:
        raise QuantkitError(
            f"GGUF export writes byte-level BPE tokenizers with a GPT-2 or SmolLM pre-tokenizer so far; "
            f"{folder}'s is a {model.get('type')} tokenizer with pre-tokenizer "
            f"{json.dumps(spec.get('pre_tokenizer'))[:80]}."
        )
    vocab = dict(model["vocab"])
    types = dict.fromkeys(vocab.values(), 1)
    _add_added(spec, vocab, types)
    # one token per embedding row (`vocab_size`, padded as llama.cpp's converter pads); tokens a
    # tokenizer class adds when loaded (Qwen2's <|endoftext|>) are not in tokenizer.json
    size = vocab_size or max(vocab.values()) + 1
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    meta = {
        "tokenizer.ggml.model": ("string", "gpt2"),
        "tokenizer.ggml.pre": ("string", pre),
        "tokenizer.ggml.tokens": ("strings", _token_list(folder, vocab, size)),
        "tokenizer.ggml.token_type": ("int32s", [types.get(i, 5) for i in range(size)]),  # 5: unused (padding)
        "tokenizer.ggml.merges": ("strings", merges),
        "tokenizer.ggml.add_bos_token": ("bool", _adds_bos(tokenizer)),
        "tokenizer.ggml.add_space_prefix": ("bool", False),
    }
    return meta | _special_ids(tokenizer, size)


def _add_added(spec: dict, vocab: dict, types: dict) -> None:
    """Put tokenizer.json's added tokens into `vocab` (text -> id) and `types` (id -> token
    type): 3 (control) for a special one, 4 (user-defined) for another."""
    for added in spec.get("added_tokens", []):
        vocab[added["content"]] = added["id"]
        types[added["id"]] = 3 if added.get("special") else 4


def _token_list(folder: Path, vocab: dict, size: int) -> list[str]:
    """The tokens in id order, one per embedding row (`size`; the ids no token has: [PADn])."""
    if max(vocab.values()) >= size:
        raise QuantkitError(
            f"{folder}'s tokenizer has ids up to {max(vocab.values())}, beyond the embedding's {size} rows; "
            "llama.cpp needs one row per token."
        )
    tokens = [f"[PAD{i}]" for i in range(size)]
    for text, i in vocab.items():
        tokens[i] = text
    return tokens


def _special_ids(tokenizer, size: int) -> dict:
    """bos/eos/unknown/padding ids that have an embedding row, and the chat template."""
    meta = {}
    for key, value in (
        ("bos", tokenizer.bos_token_id),
        ("eos", tokenizer.eos_token_id),
        ("unknown", tokenizer.unk_token_id),
        ("padding", tokenizer.pad_token_id),
    ):
        if value is not None and value < size:
            meta[f"tokenizer.ggml.{key}_token_id"] = ("uint32", value)
    if getattr(tokenizer, "chat_template", None):
        meta["tokenizer.chat_template"] = ("string", tokenizer.chat_template)
    return meta


def _space_prefix(spec: dict) -> bool | None:
    """For a SentencePiece-style tokenizer.json (spaces written as "▁", by a normalizer or a
    Metaspace pre-tokenizer): whether it puts a "▁" before the text; None: not one."""
    parts = []
    for key in ("normalizer", "pre_tokenizer"):
        part = spec.get(key) or {}
        parts += part.get("normalizers") or part.get("pretokenizers") or [part]
    if any(p.get("type") == "Metaspace" for p in parts):
        return next(p.get("prepend_scheme", "always") != "never" for p in parts if p.get("type") == "Metaspace")
    if any(p.get("type") == "Replace" and p.get("content") == "\u2581" for p in parts):
        return any(p.get("type") == "Prepend" and p.get("prepend") == "\u2581" for p in parts)
    return None


def _sentencepiece_metadata(folder: Path, spec: dict, tokenizer, size: int, space_prefix: bool) -> dict:
    """tokenizer.ggml.* of a SentencePiece BPE (Llama 2, Mistral, Phi-3: "▁" for spaces, byte
    fallback) as llama.cpp's "llama" tokenizer reads it: tokens with scores, the score of a token
    being minus the rank of the first merge that makes it (llama.cpp merges the highest-scoring
    pair first, as the BPE merges the lowest rank), types 6 for the <0xXX> byte tokens and 2
    for <unk>."""
    model = spec["model"]
    vocab = dict(model["vocab"])
    scores = dict.fromkeys(vocab.values(), 0.0)
    for rank, merge in enumerate(model.get("merges", [])):
        made = vocab.get("".join(merge.split(" ") if isinstance(merge, str) else merge))
        if made is not None and scores[made] == 0.0:
            scores[made] = -float(rank + 1)
    types = {i: 6 if re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", t) else 1 for t, i in vocab.items()}
    if model.get("unk_token") in vocab:
        types[vocab[model["unk_token"]]] = 2
    _add_added(spec, vocab, types)
    scores.update({added["id"]: 0.0 for added in spec.get("added_tokens", [])})
    meta = {
        "tokenizer.ggml.model": ("string", "llama"),
        "tokenizer.ggml.pre": ("string", "default"),
        "tokenizer.ggml.tokens": ("strings", _token_list(folder, vocab, size)),
        "tokenizer.ggml.scores": ("float32s", [scores.get(i, -1000.0) for i in range(size)]),
        "tokenizer.ggml.token_type": ("int32s", [types.get(i, 5) for i in range(size)]),
        "tokenizer.ggml.add_bos_token": ("bool", _adds_bos(tokenizer)),
        "tokenizer.ggml.add_space_prefix": ("bool", space_prefix),
    }
    return meta | _special_ids(tokenizer, size)


def _adds_bos(tokenizer) -> bool:
    ids = tokenizer("a")["input_ids"]
    return bool(ids) and tokenizer.bos_token_id is not None and ids[0] == tokenizer.bos_token_id


def write(path: Path, arch: str, name: str, file_type: str, metadata: dict, tensors) -> None:
    """One GGUF file: general.* and `metadata` (key -> (kind, value)), then `tensors`, an
    iterable of (name, array, block type or None for float32). Written beside `path`
    under a hidden name and renamed over it when complete."""
    import gguf

    with _atomic_writer(path, arch) as writer:
        writer.add_name(name)
        writer.add_type("model")
        writer.add_file_type(FILE_TYPES[file_type])
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        for key, (kind, value) in metadata.items():
            _add(writer, gguf, key, kind, value)
        for tname, array, btype in tensors:
            _add_tensor(writer, gguf, tname, array, btype)


def write_imatrix(path: Path, arch: str, stats: dict, dataset: str, chunks: int, chunk_size: int) -> None:
    """An importance matrix as llama-imatrix writes it (GGUF, general.type "imatrix"): for
    each llama.cpp tensor name, `<name>.in_sum2` (Σ x² of each input column, float32
    [1, cols]) and `<name>.counts` (tokens, [1, 1]); `stats` is {name: (sums, tokens)}, and
    llama-quantize --imatrix reads the file."""
    with _atomic_writer(path, arch) as writer:
        writer.add_type("imatrix")
        writer.add_array("imatrix.datasets", [dataset])
        writer.add_uint32("imatrix.chunk_count", chunks)
        writer.add_uint32("imatrix.chunk_size", chunk_size)
        for name in sorted(stats):
            sums, tokens = stats[name]
            writer.add_tensor(f"{name}.in_sum2", sums.float().reshape(1, -1).numpy())
            writer.add_tensor(f"{name}.counts", np.full((1, 1), float(tokens), dtype=np.float32))


@contextmanager
def _atomic_writer(path: Path, arch: str):
    """A `gguf.GGUFWriter` on a hidden sibling of `path`; when the block completes, the header,
    metadata and tensors are written and the file renamed over `path` (nothing is left
    half-written either way)."""
    import gguf

    path = Path(path)
    tmp = path.with_name(f".{path.name}.partial")
    writer = gguf.GGUFWriter(str(tmp), arch)
    try:
        yield writer
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file(progress=False)
        writer.close()
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _add(writer, gguf, key: str, kind: str, value) -> None:
    """`kind`: a GGUFValueType's name in lower case ("uint32", "string"), or that name with an s
    for an array of them ("strings", "int32s", "float32s")."""
    v = gguf.GGUFValueType
    if kind.endswith("s"):  # no scalar type's name ends in s
        writer.add_key_value(key, value, v.ARRAY, sub_type=v[kind[:-1].upper()])
    else:
        writer.add_key_value(key, value, v[kind.upper()])


def _add_tensor(writer, gguf, name: str, array: np.ndarray, btype: BlockType | None) -> None:
    if btype is None:
        writer.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))
    else:
        writer.add_tensor(name, array, raw_dtype=gguf.GGMLQuantizationType(btype.ggml))
