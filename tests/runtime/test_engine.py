"""The engine against transformers' generate: greedy tokens identical (fp32), alone and
batched, through preemption and prefix caching; quantized checkpoints and KV caches."""

import pytest
import torch
from transformers import AutoModelForCausalLM

import quantkit
from quantkit.errors import QuantkitError
from quantkit.runtime.engine import LLM
from quantkit.runtime.sequence import SamplingParams

torch.set_num_threads(1)
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
PROMPTS = [[5, 17, 33, 2, 9], list(range(40, 80)), [7] * 23, [100, 101], list(range(200, 233))]


def hf_greedy(model, prompt, n=10):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def reference(tiny_llama):
    model = AutoModelForCausalLM.from_pretrained(tiny_llama).eval()
    return [hf_greedy(model, p) for p in PROMPTS]


def test_greedy_matches_transformers_alone_and_batched(tiny_llama, reference):
    llm = LLM(str(tiny_llama), block_size=16, num_blocks=64)
    batched = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in batched] == reference
    assert all(o.finish_reason == "length" for o in batched)
    for prompt, ref in zip(PROMPTS, reference):
        assert llm.generate([prompt], GREEDY)[0].token_ids == ref
    assert llm.block_manager.num_free_blocks == 64  # nothing leaked


def test_preemption_and_chunked_prefill_do_not_change_results(tiny_llama, reference):
    llm = LLM(
        str(tiny_llama), block_size=16, num_blocks=7, max_num_batched_tokens=24
    )  # 24 < 40: long prompts go in chunks
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == reference
    # five 14-token prompts fit one block each, but growing to 24 tokens they need ten
    short = [list(range(i, i + 14)) for i in (3, 30, 60, 90, 120)]
    model = AutoModelForCausalLM.from_pretrained(tiny_llama).eval()
    assert [o.token_ids for o in llm.generate(short, GREEDY)] == [hf_greedy(model, p) for p in short]
    assert llm.scheduler.num_preemptions > 0 and llm.block_manager.num_free_blocks == 7


def test_prefix_cache_hits_and_same_tokens(tiny_llama):
    llm = LLM(str(tiny_llama), block_size=16, num_blocks=64)
    shared = list(range(10, 50))
    first = llm.generate([shared + [1, 2]], GREEDY)[0].token_ids
    second = llm.generate([shared + [3, 4]], GREEDY)[0].token_ids
    assert llm.block_manager.prefix_cache_hits >= 32
    cold = LLM(str(tiny_llama), block_size=16, num_blocks=64, enable_prefix_caching=False)
    assert cold.generate([shared + [3, 4]], GREEDY)[0].token_ids == second
    assert first != second


def test_qwen2_bias_and_gqa(tmp_path):
    from conftest import make_tiny_model

    path = make_tiny_model(tmp_path / "qwen", model_type="qwen2", tie=True)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    llm = LLM(str(path), block_size=16, num_blocks=32)
    assert [o.token_ids for o in llm.generate(PROMPTS[:3], GREEDY)] == [hf_greedy(model, p) for p in PROMPTS[:3]]


def test_int4_checkpoint_matches_its_reference_model(tiny_llama, tmp_path):
    from quantkit.pipeline.quantize import quantize
    from quantkit.scheme import preset

    quantize(str(tiny_llama), preset("w4a16-asym").with_group_size(32), tmp_path / "q")
    reference = quantkit.load(tmp_path / "q")
    llm = LLM(str(tmp_path / "q"), block_size=16, num_blocks=64)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == [hf_greedy(reference, p) for p in PROMPTS]


@pytest.mark.parametrize("dtype", ["fp8", "int8"])
def test_quantized_kv_cache_matches_fake_quantized_attention(tiny_llama, tiny_corpus, tmp_path, dtype):
    """The engine stores K/V in fp8/int8; the reference model fake-quantizes them in
    attention with the same scales: same greedy tokens on most prompts."""
    from quantkit.calibration.kv import kv_args
    from quantkit.pipeline.kv import add_kv_scales
    from quantkit.pipeline.quantize import Calibration

    add_kv_scales(str(tiny_llama), kv_args(dtype), tmp_path / "kv", Calibration(str(tiny_corpus), 4, 32))
    llm = LLM(str(tmp_path / "kv"), block_size=16, num_blocks=64)
    assert llm.runner.k_cache[0].dtype == (torch.float8_e4m3fn if dtype == "fp8" else torch.int8)
    reference = quantkit.load(tmp_path / "kv")
    got = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    want = [hf_greedy(reference, p) for p in PROMPTS]
    assert sum(g == w for g, w in zip(got, want)) >= 4  # rounding of the same values: ties may differ


def test_sampling_seeds_stops_and_logprobs(tiny_llama):
    llm = LLM(str(tiny_llama), block_size=16, num_blocks=64)
    params = SamplingParams(max_tokens=8, temperature=0.8, top_k=20, top_p=0.9, seed=7, ignore_eos=True, logprobs=3)
    a, b = llm.generate([[5, 6, 7], [5, 6, 7]], params)
    assert a.token_ids == b.token_ids  # same seed, same tokens
    c = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=8, temperature=0.8, seed=8, ignore_eos=True))[0]
    assert len(a.logprobs) == 8 and len(a.logprobs[0][1]) == 3 and a.logprobs[0][0] <= 0
    assert c.token_ids != a.token_ids or c.token_ids == a.token_ids[:0]
    first = llm.generate([[5, 6, 7]], GREEDY)[0]
    stop = llm.tokenizer.decode(first.token_ids[2:4])
    if stop.strip():
        cut = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, stop=stop))[0]
        assert cut.finish_reason == "stop" and stop not in cut.text


def test_prompt_longer_than_context(tiny_llama):
    llm = LLM(str(tiny_llama), block_size=16, num_blocks=64)
    with pytest.raises(QuantkitError, match="exceeds the model's context of 256 tokens"):
        llm.add_request(list(range(250)), SamplingParams(max_tokens=10))


@pytest.mark.parametrize("scheme", ["w4a16-asym", "fp8-dynamic"])
def test_every_op_forced_to_triton_gives_the_torch_paths_tokens(tiny_llama, tmp_path, scheme, monkeypatch):
    """The GPU path end to end before any GPU: with backend "triton" every quantized linear,
    the decode attention and the KV store run their Triton kernels (interpreted on a CPU), and
    greedy decoding gives the torch twins' tokens; the kernels the runner chose say so."""
    from quantkit.pipeline.quantize import quantize
    from quantkit.scheme import preset

    method = "fp8" if scheme.startswith("fp8") else "rtn"
    s = preset(scheme)
    quantize(str(tiny_llama), s.with_group_size(32) if method == "rtn" else s, tmp_path / "q", method)
    prompts, params = PROMPTS[:3], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    import importlib

    gemm = ("int4.triton", "int4_gemm") if method == "rtn" else ("fp8.triton", "fp8_gemm")
    launchers = dict([gemm, ("attention.triton", "paged_attention"), ("attention.triton_kv_store", "kv_store")])
    calls, modules = {}, set(launchers.values())
    for module, name in launchers.items():  # before the load, which binds the launchers
        kernel = importlib.import_module(f"quantkit.kernels.{module}")
        launcher = getattr(kernel, name)
        monkeypatch.setattr(kernel, name, lambda *a, _f=launcher, _m=name: calls.update({_m: 1}) or _f(*a))
    triton = LLM(str(tmp_path / "q"), block_size=16, num_blocks=32, backend="triton")
    chosen = {what: k.name for what, k in triton.runner.kernels}
    linear = "PackedInt4Linear" if method == "rtn" else "Fp8Linear"
    assert chosen[linear].endswith("(Triton)") and chosen["decode attention"] == chosen["KV store"] == "Triton"
    torch_path = LLM(str(tmp_path / "q"), block_size=16, num_blocks=32, backend="torch")
    assert all(k.why == "backend torch" for _, k in torch_path.runner.kernels)
    got = [o.token_ids for o in triton.generate(prompts, params)]
    assert set(calls) == modules  # each Triton launcher ran
    assert got == [o.token_ids for o in torch_path.generate(prompts, params)]
    assert all(len(t) == 4 for t in got)
