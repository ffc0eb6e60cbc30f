"""The model runner: fused q/k/v and gate/up linears compute what the separate ones did,
and its logits on quantized checkpoints against `quantkit.load`'s reference model."""

import pytest
import torch
from torch import nn

import quantkit
from quantkit.kernels import attention
from quantkit.kernels.choice import Problem, choose
from quantkit.pipeline.quantize import quantize
from quantkit.runtime.engine import LLM, _slots
from quantkit.runtime.model_runner import Batch
from quantkit.runtime.qlinear import fuse_linears
from quantkit.runtime.sequence import SamplingParams
from quantkit.scheme import preset

torch.set_num_threads(1)
PROMPTS = [[5, 17, 33, 2, 9], list(range(40, 80)), [7] * 23, [100, 101], list(range(200, 233))]


@pytest.fixture(scope="module")
def checkpoints(tiny_llama, tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpts")
    quantize(str(tiny_llama), preset("w4a16-asym").with_group_size(32), out / "int4")
    quantize(str(tiny_llama), preset("fp8-dynamic"), out / "fp8", "fp8")
    return {"int4": out / "int4", "fp8": out / "fp8", "float": tiny_llama}


def qkv(model):
    attn = model.model.layers[0].self_attn
    return [attn.q_proj, attn.k_proj, attn.v_proj]


@pytest.mark.parametrize("kind", ["float", "int4", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_linears_compute_the_concatenation(checkpoints, kind, dtype):
    model = quantkit.load(checkpoints[kind], dtype=dtype)
    mods = qkv(model)
    x = torch.randn(7, 64, generator=torch.Generator().manual_seed(0)).to(dtype)
    with torch.no_grad():
        want = torch.cat([m(x) for m in mods], dim=-1)
        fused = fuse_linears(mods)
        assert type(fused) is type(mods[0])
        torch.testing.assert_close(fused(x), want, rtol=0, atol=0)
        torch.testing.assert_close(torch.cat([m(x) for m in mods], dim=-1), want, rtol=0, atol=0)  # still work
    if kind == "float":  # the originals now view the fused weight: nothing stored twice
        ptr = fused.weight.untyped_storage().data_ptr()
        assert all(m.weight.untyped_storage().data_ptr() == ptr for m in mods)


def test_fused_linears_with_some_biases():
    torch.manual_seed(0)
    mods = [nn.Linear(8, 4, bias=True), nn.Linear(8, 2, bias=False), nn.Linear(8, 3, bias=True)]
    x = torch.randn(5, 8)
    with torch.no_grad():
        want = torch.cat([m(x) for m in mods], dim=-1)
        torch.testing.assert_close(fuse_linears(mods)(x), want)


def test_linears_that_cannot_be_fused():
    assert fuse_linears([nn.Linear(8, 4), nn.Linear(6, 4)]) is None  # different inputs


def test_slots_span_blocks():
    assert _slots([7, 2, 9], 14, 35, 16) == [*range(7 * 16 + 14, 8 * 16), *range(32, 48), *range(144, 147)]
    assert _slots([3], 5, 6, 16) == [53]


def runner_logits(llm: LLM, prompt: list[int]) -> torch.Tensor:
    """Logits at every position of one prompt prefilled into a fresh engine's blocks 0, 1, ..."""
    n, bs = len(prompt), llm.runner.block_size
    none, table = torch.zeros(0, 1, dtype=torch.int32), torch.arange(-(-n // bs), dtype=torch.int32)[None]
    lens = torch.tensor([n], dtype=torch.int32)
    batch = Batch(
        torch.tensor(prompt), torch.arange(n), torch.arange(n), table, lens, lens, none, none[:, 0], torch.arange(n), n
    )
    return llm.runner.forward(batch).float()


@pytest.mark.parametrize("kind", ["int4", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_logits_and_greedy_tokens_match_the_reference_model(checkpoints, kind, dtype, monkeypatch):
    """Our runner (fused linears, paged cache, CPU attention path) against the module tree
    of `quantkit.load` run by transformers: logits within 1e-5 (fp32) or 1e-2 (bf16) of
    the reference's RMS, and 32 greedy tokens identical, each prompt alone, on all five
    prompts in fp32 and at least four in bf16 (measured: 5/5 for both kinds); batched, in
    fp32 on all five. In bf16 a batch changes the GEMMs' rounding, and this untrained
    model has near ties (batched bf16 matched on 4/5 prompts for int4, 2/5 for fp8). In bf16
    the runner's attention takes the torch path (SDPA, transformers' arithmetic; the C++
    candidates are taken off the lists): the C++ kernel attends in fp32, 5-6% RMS of logits
    away from transformers' bf16 on this random model (which is itself 6-11% from fp32), and
    is held to the twins in tests/kernels/attention/test_attention_cpp.py."""
    if dtype == torch.bfloat16:
        for name in ("DECODE", "PREFILL"):
            torch_only = [c for c in getattr(attention, name) if not c.name.startswith("quantkit C++")]
            monkeypatch.setattr(attention, name, torch_only)
    llm = LLM(str(checkpoints[kind]), dtype=dtype, block_size=16, num_blocks=64)
    reference = quantkit.load(checkpoints[kind], dtype=dtype)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    for prompt in PROMPTS:
        with torch.inference_mode():
            want = reference(torch.tensor([prompt])).logits[0].float()
        error = (runner_logits(llm, prompt) - want).pow(2).mean().sqrt()
        assert error <= tolerance * want.pow(2).mean().sqrt()
    greedy = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    with torch.inference_mode():
        want = [
            reference.generate(
                torch.tensor([p]), max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0
            )[0, len(p) :].tolist()
            for p in PROMPTS
        ]
    alone = [llm.generate([p], greedy)[0].token_ids for p in PROMPTS]
    assert sum(a == w for a, w in zip(alone, want)) >= (5 if dtype == torch.float32 else 4)
    if dtype == torch.float32:
        assert [o.token_ids for o in llm.generate(PROMPTS, greedy)] == want


class _LayerNormLike(nn.Module):
    """A weight and an eps, but not an RMSNorm: the runner must keep calling it."""

    def __init__(self, n):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(n)), 1e-5

    def forward(self, x):
        return nn.functional.layer_norm(x, x.shape[-1:], self.weight, None, self.eps)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norms_and_activations_are_recognised_at_load(dtype):
    from transformers.activations import ACT2FN
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from quantkit.runtime.model_runner import _Norm, _silu

    like = torch.empty(0, dtype=dtype)

    def pick(op, candidates, **shapes):
        return choose(op, candidates, Problem("cpu", dtype, **shapes)).fn

    llama, gemma, other = LlamaRMSNorm(48, eps=1e-6), Gemma3RMSNorm(48, eps=1e-6), _LayerNormLike(48)
    for m in (llama, gemma, other):
        with torch.no_grad():
            m.weight.uniform_(-1, 2, generator=torch.Generator().manual_seed(0))
        m.to(dtype)
    assert _Norm.of(llama, like, pick).fused[1:] == (1e-6, False)
    assert _Norm.of(gemma, like, pick).fused[1:] == (1e-6, True)
    assert _Norm.of(other, like, pick).fused is None
    x = torch.randn(5, 48).to(dtype)
    for m in (llama, gemma, other):  # whichever way it runs, the module's values
        norm, residual = _Norm.of(m, like, pick), x.clone()
        torch.testing.assert_close(norm(x), m(x), rtol=1e-2 if dtype == torch.bfloat16 else 1e-6, atol=1e-5)
        out = norm.add_(residual, x)
        assert torch.equal(residual, x + x)
        torch.testing.assert_close(out, m(x + x), rtol=1e-2 if dtype == torch.bfloat16 else 1e-6, atol=1e-5)
    assert _silu(ACT2FN["silu"], like) and _silu(nn.SiLU(), like)
    assert not _silu(ACT2FN["gelu_pytorch_tanh"], like)
