"""The engine chooses every kernel once, at load: no chooser runs while it decodes, what the
choices name is what runs, the notes are those choices, and a kernel added as one candidate
entry is bound, named and run."""

from collections import Counter
from dataclasses import replace

import pytest
import torch

from quantkit import ops
from quantkit.kernels import choice, elementwise
from quantkit.kernels.choice import Candidate, always, fixed
from quantkit.kernels.elementwise import twin as elementwise_twin
from quantkit.runtime.engine import LLM
from quantkit.runtime.sequence import SamplingParams

PER_CALL = ("int4_gemm", "fp8_gemm", "int8_gemm", "paged_attention", "paged_prefill", "kv_store")
PER_CALL += ("rms_norm", "add_rms_norm_", "rope_", "silu_mul", "argmax")
GREEDY = SamplingParams(max_tokens=65, temperature=0, ignore_eos=True)  # a prefill, then 64 decode steps


@pytest.fixture(scope="module")
def int4(tiny_llama, tmp_path_factory):
    from quantkit.pipeline.quantize import quantize
    from quantkit.scheme import preset

    out = tmp_path_factory.mktemp("choices") / "int4"
    quantize(str(tiny_llama), preset("w4a16-asym").with_group_size(32), out, "rtn")
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_no_kernel_is_chosen_after_load_and_the_choices_are_what_runs(int4, dtype, monkeypatch):
    chooser_calls, ran, real = Counter(), Counter(), choice.choose

    def counting(op, candidates, problem):
        chooser_calls[op] += 1
        chosen = real(op, candidates, problem)
        fn = chosen.fn

        def run(*args):
            ran[(op, chosen.name)] += 1
            return fn(*args)

        return replace(chosen, fn=run)

    monkeypatch.setattr(choice, "choose", counting)
    for name in PER_CALL:  # the per-call dispatchers choose on every call: the engine must not call them
        real_op = getattr(ops, name)
        monkeypatch.setattr(ops, name, lambda *a, _f=real_op, _n=name, **k: chooser_calls.update([_n]) or _f(*a, **k))
    llm = LLM(str(int4), dtype=dtype, block_size=16, num_blocks=64)
    assert chooser_calls  # at load, every operation was chosen
    chooser_calls.clear()
    (out,) = llm.generate([[5, 17, 33, 2, 9]], GREEDY)
    assert len(out.token_ids) == 65
    assert chooser_calls == Counter()  # 64 decode steps: no choice, no per-call dispatch
    chosen = {(k.op, k.name) for _, k in llm.runner.kernels}
    assert set(ran) == chosen  # every kernel the choices name ran, and nothing else
    decode = dict(llm.runner.kernels)["decode attention"]
    assert ran[("decode attention", decode.name)] == 64 * len(llm.runner.layers)
    for note in llm.notes:  # the notes name chosen kernels only
        assert any(f"on {name}: " in note for _, name in chosen)


def test_the_notes_are_the_choices(int4, monkeypatch):
    monkeypatch.setenv("QUANTKIT_NO_EXT", "1")
    llm = LLM(str(int4), dtype=torch.float32, block_size=16, num_blocks=64)
    kernels = dict(llm.runner.kernels)
    assert kernels["decode attention"].name == "batched torch (gathered blocks + SDPA)"
    assert kernels["PackedInt4Linear"].name == "int4 twin (dequantizes on every call)"  # fp32 activations
    expected = [
        f"8 PackedInt4Linear layers run on int4 twin (dequantizes on every call): {kernels['PackedInt4Linear'].why}.",
        "decode attention runs on batched torch (gathered blocks + SDPA): quantkit C++: disabled by QUANTKIT_NO_EXT=1.",
        "silu_mul, rms_norm, add_rms_norm_, rope_ run on torch ops: quantkit C++: disabled by QUANTKIT_NO_EXT=1.",
    ]
    assert all(note in llm.notes for note in expected), llm.notes
    assert len(llm.notes) == len({(k.name, k.why) for _, k in llm.runner.kernels if k.why})  # one per kernel and why


def test_a_kernel_added_as_one_candidate_is_bound_named_and_run(tiny_llama, monkeypatch):
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    want = LLM(str(tiny_llama), block_size=16, num_blocks=64).generate([[5, 17, 33]], greedy)[0].token_ids
    calls = []

    def dummy_silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        calls.append(gate_up.shape[0])
        return elementwise_twin.silu_mul(gate_up)

    dummy = Candidate("dummy silu", always, fixed(dummy_silu_mul))
    monkeypatch.setattr(elementwise, "SILU_MUL", [dummy, *elementwise.SILU_MUL])
    llm = LLM(str(tiny_llama), block_size=16, num_blocks=64)
    kernels = dict(llm.runner.kernels)
    assert (kernels["silu_mul"].name, kernels["silu_mul"].why) == ("dummy silu", None)
    assert llm.generate([[5, 17, 33]], greedy)[0].token_ids == want  # the twin's values, bit for bit
    assert len(calls) == 8 * len(llm.runner.layers)  # a prefill and 7 decode steps, every layer
    refusing = replace(dummy, can_implement=lambda p: (False, "it is a dummy"))
    monkeypatch.setattr(elementwise, "SILU_MUL", [refusing, *elementwise.SILU_MUL])
    llm = LLM(str(tiny_llama), block_size=16, num_blocks=64)
    silu = dict(llm.runner.kernels)["silu_mul"]
    assert f"silu_mul runs on {silu.name}: dummy silu: it is a dummy." in llm.notes
