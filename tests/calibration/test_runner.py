import torch
from transformers import AutoModelForCausalLM

from quantkit.calibration.runner import run_blocks
from quantkit.models.arch import arch_for, get_module
from quantkit.primitives import fake_quantize
from quantkit.scheme import QuantArgs


def block_inputs_of_full_forward(model, spec, ids):
    seen = []
    hooks = [
        b.register_forward_pre_hook(
            lambda m, a, kw: seen.append((a[0] if a else kw["hidden_states"]).clone()), with_kwargs=True
        )
        for b in get_module(model, spec.blocks)
    ]
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    return seen


def test_runner_feeds_each_block_what_the_model_would(tiny_llama):
    model = AutoModelForCausalLM.from_pretrained(tiny_llama).eval()
    spec = arch_for(model.config)
    ids = torch.randint(0, 320, (6, 24), generator=torch.Generator().manual_seed(0))
    expected = block_inputs_of_full_forward(model, spec, ids)
    got = []

    def step(i, prefix, block, inputs):
        assert prefix == f"model.layers.{i}"
        got.append(torch.cat(inputs.hidden))

    run_blocks(model, spec, step, ids, batch_size=4)
    assert len(got) == 2
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_quantized_block_outputs_propagate(tiny_llama):
    """After a quantizing step, block 1 sees block 0's quantized outputs: the same as a
    forward through the fully fake-quantized model."""
    model = AutoModelForCausalLM.from_pretrained(tiny_llama).eval()
    spec = arch_for(model.config)
    args = QuantArgs(4, symmetric=False, group_size=32)
    ids = torch.randint(0, 320, (3, 16), generator=torch.Generator().manual_seed(1))
    got = []

    def step(i, prefix, block, inputs):
        got.append(torch.cat(inputs.hidden))
        for name in spec.linears:
            lin = get_module(block, name)
            lin.weight.data = fake_quantize(lin.weight.data, args)

    run_blocks(model, spec, step, ids, batch_size=2)
    expected = block_inputs_of_full_forward(model, spec, ids)  # model is now fully quantized
    torch.testing.assert_close(got[1], expected[1], rtol=1e-5, atol=1e-5)
    float_model = AutoModelForCausalLM.from_pretrained(tiny_llama).eval()
    assert not torch.allclose(got[1], block_inputs_of_full_forward(float_model, spec, ids)[1], atol=1e-4)


def test_runner_without_data_visits_every_block(tiny_llama):
    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    visited = []
    run_blocks(model, arch_for(model.config), lambda i, p, b, inputs: visited.append((i, inputs)))
    assert visited == [(0, None), (1, None)]
