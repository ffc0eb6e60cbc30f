import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from quantkit.errors import QuantkitError
from quantkit.eval.perplexity import perplexity

SEQ_LEN = 32


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=256,
        max_position_embeddings=128,
    )
    return LlamaForCausalLM(config).float().eval()


@pytest.fixture(scope="module")
def tokens():
    return torch.randint(0, 256, (5 * SEQ_LEN + 7,), generator=torch.Generator().manual_seed(1))


def reference_ppl(model, tokens, n_windows):
    with torch.no_grad():
        losses = [
            model(w[None], labels=w[None]).loss.item() for w in tokens[: n_windows * SEQ_LEN].view(n_windows, SEQ_LEN)
        ]
    return math.exp(sum(losses) / len(losses))


@pytest.mark.parametrize("batch_size,limit,windows", [(1, None, 5), (3, None, 5), (3, 2, 2), (2, 9, 5)])
def test_matches_plain_loop(model, tokens, batch_size, limit, windows):
    calls = []

    def track(iterable, description, total):
        calls.append((description, total))
        return iterable

    out = perplexity(model, tokens, SEQ_LEN, limit=limit, batch_size=batch_size, track=track)
    assert out["ppl"] == pytest.approx(reference_ppl(model, tokens, windows), rel=1e-5)
    assert out["nll"] == pytest.approx(math.log(out["ppl"]))
    assert (out["windows"], out["tokens"], out["seq_len"]) == (windows, windows * SEQ_LEN, SEQ_LEN)
    assert calls == [("perplexity", math.ceil(windows / batch_size))]
    assert 200 < out["ppl"] < 330  # an untrained model is close to uniform over 256 tokens


def test_too_few_tokens(model, tokens):
    with pytest.raises(QuantkitError, match=f"{SEQ_LEN - 1} tokens, fewer than one window of {SEQ_LEN}"):
        perplexity(model, tokens[: SEQ_LEN - 1], SEQ_LEN)


@pytest.mark.parametrize("family", ["gemma2", "qwen3"])
def test_chunked_nll_equals_the_full_logits(family, tmp_path, monkeypatch):
    """The LM head runs a few positions at a time (with Gemma 2's final soft-cap) and sums to
    what the model's own full logits give."""
    from conftest import make_family_model
    from transformers import AutoModelForCausalLM

    from quantkit.eval import perplexity as ppl

    model = AutoModelForCausalLM.from_pretrained(make_family_model(tmp_path / family, family)).eval()
    ids = torch.randint(0, 320, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(ids).logits.float()
        full = sum(
            torch.nn.functional.cross_entropy(lg[:-1], row[1:], reduction="sum").item() for row, lg in zip(ids, logits)
        )
        monkeypatch.setattr(ppl, "CHUNK", 7)
        assert ppl.summed_nll(model, ids) == pytest.approx(full, rel=1e-5)
