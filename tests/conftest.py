"""Shared fixtures: tiny random models built from configs (no hub), and a tiny
byte-level BPE tokenizer trained on a few sentences."""

from __future__ import annotations

import os
from pathlib import Path

# Triton kernels run in the interpreter on machines without a GPU; triton reads this when
# a kernel is decorated, so it must be set before any kernel module is imported.
if not os.environ.get("CUDA_VISIBLE_DEVICES") and not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

TEXT = [
    "The quick brown fox jumps over the lazy dog near the river bank.",
    "Quantization maps floating point weights to a small grid of integers.",
    "A calibration set is a few hundred sentences of ordinary text.",
    "Perplexity is the exponential of the mean negative log likelihood.",
] * 8


def make_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<eos>"],
        show_progress=False,
    )
    tok.train_from_iterator(TEXT, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", model_max_length=512)


def make_tiny_model(
    path: Path, model_type: str = "llama", tie: bool = False, seed: int = 0, dtype: torch.dtype = torch.float32
) -> Path:
    """Save a random 2-block causal LM (hidden 64, MLP 128, 4 heads / 2 KV heads) with a tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        model_type,
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=tie,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    with torch.no_grad():  # a spread of weight magnitudes, like trained models, so quantization matters
        for p in model.parameters():
            p.mul_(1 + 3 * torch.rand_like(p))
    model.save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama")


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory) -> Path:
    """A .txt file (documents separated by blank lines) long enough for a few windows."""
    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    path.write_text("\n\n".join(TEXT * 4))
    return path
