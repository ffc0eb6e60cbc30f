"""bf16 float linears reordered once for oneDNN compute exactly what `F.linear` does, and
the runner holds each weight once."""

import pytest
import torch
from torch import nn

from quantkit.kernels import cpu
from quantkit.runtime.engine import LLM
from quantkit.runtime.qlinear import PrepackedLinear, prepack

needs_prepack = pytest.mark.skipif(not cpu._HAS_PREPACK, reason="torch without oneDNN bf16 (or a CPU without it)")


@needs_prepack
@pytest.mark.parametrize("bias", [False, True])
def test_prepacked_linear_is_bit_identical(bias):
    g = torch.Generator().manual_seed(0)
    linear = nn.Linear(96, 80, bias=bias).to(torch.bfloat16)
    packed = prepack(linear)
    assert isinstance(packed, PrepackedLinear)
    for shape in [(1, 96), (7, 96), (64, 96), (3, 5, 96)]:
        x = torch.randn(*shape, generator=g).to(torch.bfloat16)
        with torch.no_grad():
            assert torch.equal(packed(x), linear(x))


def test_only_bf16_cpu_linears_are_prepacked():
    fp32 = nn.Linear(16, 8)
    assert prepack(fp32) is fp32  # oneDNN's fp32 path rounds differently from F.linear
    other = nn.Identity()
    assert prepack(other) is other


@needs_prepack
def test_runner_holds_bf16_weights_once(tiny_llama):
    llm = LLM(str(tiny_llama), dtype=torch.bfloat16, block_size=16, num_blocks=16)
    assert all(isinstance(m, PrepackedLinear) for m in llm.runner.linears[:4])  # block 0's four
    block = llm.model.model.layers[0]
    assert block.self_attn.q_proj.weight.is_meta and block.mlp.down_proj.weight.is_meta
    assert not llm.model.get_input_embeddings().weight.is_meta  # still looked up
    out = llm.generate([[5, 17, 33, 2]], None)[0]
    assert len(out.token_ids) > 0
