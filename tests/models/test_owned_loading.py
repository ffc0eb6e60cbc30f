"""Calibration loads the float model into its own memory (not file-mapped); the model is
the one transformers' from_pretrained builds."""

import torch
from transformers import AutoModelForCausalLM

from quantkit.models.loading import load_float_model


def test_owned_load_equals_from_pretrained(tiny_llama):
    ours, _, _ = load_float_model(tiny_llama, owned=True)
    reference = AutoModelForCausalLM.from_pretrained(tiny_llama).eval()
    assert ours.state_dict().keys() == reference.state_dict().keys()
    for (name, a), b in zip(ours.state_dict().items(), reference.state_dict().values()):
        assert a.dtype == b.dtype and torch.equal(a, b), name
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(ours(ids).logits, reference(ids).logits)
    if ours.config.tie_word_embeddings:
        assert ours.lm_head.weight is ours.get_input_embeddings().weight
