"""The sampler: its argmax (C++ and the two-level torch path) against torch's, and sampling."""

import pytest
import torch

from quantkit import ops
from quantkit.kernels.elementwise.cpp import torch_argmax
from quantkit.runtime.sampling import Sampler
from quantkit.runtime.sequence import SamplingParams


@pytest.mark.parametrize("shape", [(64, 49152), (3, 1000), (5, 320), (2, 1024), (4, 2049), (1, 151936)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_is_torchs_first_maximum(shape, dtype):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(0)).to(dtype)
    x[0] = 0  # a row of ties: the first index
    if shape[0] > 1:
        x[1, -1] = 100  # the maximum in the last (maybe short) chunk
    if shape[0] > 2:
        x[2, 5] = x[2, shape[1] - 3] = 50  # two equal maxima in different chunks: the first
    assert torch.equal(torch_argmax(x), x.float().argmax(-1))
    assert torch.equal(ops.argmax(x), x.float().argmax(-1))


def test_greedy_rows_take_the_argmax():
    logits = torch.randn(6, 3000).bfloat16()
    tokens, records = Sampler().sample(logits, [(i, SamplingParams(temperature=0)) for i in range(6)])
    assert tokens == logits.float().argmax(-1).tolist() and records == [None] * 6
