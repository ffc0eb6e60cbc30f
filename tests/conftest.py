"""Shared fixtures: tiny random models built from configs (no hub), and a tiny
byte-level BPE tokenizer trained on a few sentences."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

# Triton kernels run in the interpreter on machines without a GPU; triton reads this when
# a kernel is decorated, so it must be set before any kernel module is imported.
if not os.environ.get("CUDA_VISIBLE_DEVICES") and not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import json

import pytest
import torch


@pytest.fixture(autouse=True)
def _auto_dtype_is_float32(monkeypatch):
    """The engine's --dtype auto runs a float32 model in bf16 on CPUs with native bf16; tests
    compare with transformers in float32, so "auto" keeps float32 here on every CPU alike
    (`tests/runtime/test_loader.py` tests both cases)."""
    monkeypatch.setattr("quantkit.kernels.cpu.native_bf16", lambda: False)


@pytest.fixture(autouse=True)
def _sensitivity_cache_of_its_own(monkeypatch, tmp_path_factory):
    """Mixed precision's sensitivity caches under the user's quantkit cache; a test's goes to a
    folder of its own (a test that sets the cache itself still does)."""
    from quantkit.pipeline import mixed

    folder = tmp_path_factory.mktemp("sensitivity")
    monkeypatch.setattr(mixed, "_cache_dir", lambda: folder)


TEXT = [
    "The quick brown fox jumps over the lazy dog near the river bank.",
    "Quantization maps floating point weights to a small grid of integers.",
    "A calibration set is a few hundred sentences of ordinary text.",
    "Perplexity is the exponential of the mean negative log likelihood.",
] * 8


def make_tokenizer(split: str | None = None, texts: list[str] = TEXT):
    """A byte-level BPE trained on `texts`; `split`: a regex splitting the text first, as Llama 3's
    and Qwen2's do."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    if split is not None:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), "isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<eos>"],
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", model_max_length=512)


def make_sentencepiece_tokenizer(texts: list[str] = TEXT, merges: int = 100):
    """A Llama-2-style tokenizer.json (what transformers makes of a SentencePiece BPE): "▁" for
    spaces and before the text, <unk> <s> </s>, the 256 <0xXX> byte-fallback tokens, then BPE
    pieces learned on `texts`; 259 + at most `merges` + the characters ids."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    learn = Tokenizer(models.BPE())
    trainer = trainers.BpeTrainer(vocab_size=merges, show_progress=False)
    learn.train_from_iterator(["\u2581" + t.replace(" ", "\u2581") for t in texts], trainer)
    learned = json.loads(learn.to_str())["model"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece, _ in sorted(learned["vocab"].items(), key=lambda kv: kv[1]):
        vocab.setdefault(piece, len(vocab))
    tok = Tokenizer(models.BPE(vocab, [tuple(m) for m in learned["merges"]], unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


# Each family's tiny config: what differs from the defaults above, kept small (head_dim 16).
FAMILIES = {
    "llama3": (
        "llama",
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            }
        },
    ),
    "mistral": ("mistral", {"sliding_window": 16}),
    "qwen2-window": ("qwen2", {"use_sliding_window": True, "sliding_window": 12, "max_window_layers": 1}),
    "qwen3": ("qwen3", {"head_dim": 16}),
    "gemma2": (
        "gemma2",
        {
            "head_dim": 16,
            "query_pre_attn_scalar": 24,
            "sliding_window": 12,
            "attn_logit_softcapping": 5.0,
            "final_logit_softcapping": 3.0,
        },
    ),
    "gemma3": (
        "gemma3_text",
        {
            "head_dim": 16,
            "query_pre_attn_scalar": 24,
            "sliding_window": 12,
            "layer_types": ["sliding_attention", "full_attention"],
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
            },
        },
    ),
    "phi3": ("phi3", {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "sliding_window": 20}),
    "phi4-mini": (  # partial rotary: RoPE on half of each head
        "phi3",
        {
            "pad_token_id": 0,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        },
    ),
    # mixtures of experts: 4 experts, 2 per token
    "mixtral": ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 16}),
    "qwen2-moe": (  # a shared expert behind a sigmoid gate, un-normalised top-k weights, a dense layer
        "qwen2_moe",
        {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 64,
            "shared_expert_intermediate_size": 96,
            "mlp_only_layers": [1],
        },
    ),
    "qwen3-moe": (
        "qwen3_moe",
        {
            "head_dim": 16,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 64,
            "norm_topk_prob": True,
        },
    ),
}
MOE_FAMILIES = ("mixtral", "qwen2-moe", "qwen3-moe")


def make_tiny_model(
    path: Path,
    model_type: str = "llama",
    tie: bool = False,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    **overrides,
) -> Path:
    """Save a random 2-block causal LM (hidden 64, MLP 128, 4 heads / 2 KV heads) with a tokenizer;
    `overrides` change the config (see FAMILIES)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        model_type,
        **{
            "vocab_size": 320,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 256,
            "tie_word_embeddings": tie,
            **overrides,
        },
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    with torch.no_grad():  # a spread of weight magnitudes, like trained models, so quantization matters
        for name, p in model.named_parameters():
            if "norm" in name and not p.any():  # Gemma's norms scale by 1 + w, with w = 0 at init
                p.normal_(0, 0.2)
            p.mul_(1 + 3 * torch.rand_like(p))
    model.save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    return path


def make_family_model(path: Path, family: str, **kwargs) -> Path:
    """A tiny model of one of FAMILIES (tied embeddings for the Gemmas, as theirs are)."""
    model_type, overrides = FAMILIES[family]
    return make_tiny_model(path, model_type, tie=model_type.startswith("gemma"), **overrides, **kwargs)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama")


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory) -> Path:
    """A .txt file (documents separated by blank lines) long enough for a few windows."""
    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    path.write_text("\n\n".join(TEXT * 4))
    return path


def shuffled_cache(seq_lens, block_size, shape, dtype, g, spare: int, width: int):
    """(block_tables int32 [n, width], k_cache, v_cache [blocks, *shape]): each sequence's blocks
    drawn at random (`g`) from a cache of its blocks plus `spare`, unused table entries -1, every
    slot holding NaN (fp8: 0x7f, int8: 127) so that a read past a sequence shows."""
    used = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(used) + spare
    order = torch.randperm(num_blocks, generator=g).tolist()
    tables = torch.full((len(seq_lens), width), -1, dtype=torch.int32)
    for i, n in enumerate(used):
        tables[i, :n] = torch.tensor(order[:n], dtype=torch.int32)
        del order[:n]
    full = (num_blocks, block_size, *shape)
    if dtype.itemsize == 1:
        k_cache = torch.full(full, 0x7F, dtype=torch.uint8).view(dtype)
    else:
        k_cache = torch.full(full, float("nan"), dtype=dtype)
    return tables, k_cache, k_cache.clone()


@contextlib.contextmanager
def built(extension):
    """A `cpu_ext.Extension`'s ops, built with QUANTKIT_NO_EXT unset for the duration; skips the
    tests only where the machine has no C++ compiler (a failed build fails them)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("QUANTKIT_NO_EXT", raising=False)
        module = extension.load()
        if module is None and extension.reason().startswith("no C++ compiler"):
            pytest.skip(extension.reason())
        assert module is not None, extension.reason()
        yield module
