"""Mixtures of experts (Mixtral, Qwen2-MoE, Qwen3-MoE; conftest.MOE_FAMILIES): the routing
quantkit's expert modules and engine use, the coverage rule (an expert routed too few
calibration tokens is calibrated on all of them while the block's output keeps the real
routing), one GPTQ Hessian per expert over its routed tokens, and a router skewed so that
two experts get no calibration token at all: every expert is still quantized with finite
scales, the counts are recorded and shown, the routers stay in float and the engine serves
the checkpoint. End to end runs of every method are in test_families.py."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import MOE_FAMILIES, make_family_model
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from quantkit.calibration.datasets import calibration_samples, load_documents
from quantkit.calibration.gptq import accumulate_hessian
from quantkit.calibration.hooks import reduce_each
from quantkit.calibration.runner import BlockInputs, capture_block_inputs
from quantkit.cli import app
from quantkit.formats.checkpoint import read_tensors
from quantkit.formats.inspect import describe
from quantkit.models import moe
from quantkit.models.arch import arch_for, get_module
from quantkit.models.loading import load_float_model
from quantkit.pipeline.quantize import Calibration, quantize
from quantkit.runtime.engine import LLM
from quantkit.runtime.sequence import SamplingParams
from quantkit.scheme import preset

torch.set_num_threads(1)
STARVED = (2, 3)


def skew(path, starved=STARVED):
    """Every embedding gets a large constant channel 0, and only the `starved` experts' router
    rows read it, negatively: the routers never send them a token."""
    f = path / "model.safetensors"
    t = load_file(f)
    t["model.embed_tokens.weight"][:, 0] = 50.0
    for key in [k for k in t if k.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight"))]:
        t[key][:, 0] = 0.0
        t[key][list(starved), 0] = -20.0
    save_file(t, f, metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module", params=MOE_FAMILIES)
def skewed(request, tmp_path_factory):
    return request.param, skew(make_family_model(tmp_path_factory.mktemp("moe") / request.param, request.param))


def block_inputs(path, corpus, samples=8, seq_len=32):
    model, tokenizer, _ = load_float_model(path)
    spec = arch_for(model.config)
    ids = calibration_samples(tokenizer, load_documents(str(corpus), "calib"), samples, seq_len, 0)
    hidden, kwargs = capture_block_inputs(model, spec, ids, 4, torch.device("cpu"))
    return model, spec, BlockInputs(hidden, kwargs[0])


def test_route_groups_each_experts_tokens_in_order():
    index = torch.tensor([[2, 0], [0, 3], [2, 1], [3, 2]])
    got = [(e, t.tolist(), s.tolist()) for e, t, s in moe.route(index, 5)]
    expected = []
    for e in range(5):  # the reference: scan every (token, slot)
        pairs = [(t, s) for t in range(4) for s in range(2) if index[t, s] == e]
        if pairs:
            expected.append((e, [t for t, _ in pairs], [s for _, s in pairs]))
    assert got == expected


def test_a_starved_expert_sees_every_token_while_the_output_keeps_the_routing(skewed, tiny_corpus):
    name, path = skewed
    model, spec, inputs = block_inputs(path, tiny_corpus)
    block = get_module(model, spec.blocks)[0]
    bspec = spec.for_block(block)
    counts = moe.count_tokens(block, bspec, inputs)
    tokens = sum(h.shape[0] * h.shape[1] for h in inputs.hidden)
    assert [counts[e] for e in STARVED] == [0, 0] and sum(counts) == tokens * model.config.num_experts_per_tok, name
    reference = inputs.run(block)
    seen = {e: 0 for e in range(len(counts))}
    hooks = [
        get_module(block, bspec.moe.expert(e, 0)).register_forward_pre_hook(
            lambda m, a, e=e: seen.__setitem__(e, seen[e] + a[0].shape[0])
        )
        for e in seen
    ]
    record = {}
    with moe.cover(block, spec, inputs, 1, record, "layer0"):
        covered = inputs.run(block)
    for h in hooks:
        h.remove()
    assert record == {"layer0": counts}
    assert seen == {e: tokens if e in STARVED else c for e, c in enumerate(counts)}
    for a, b in zip(covered, reference):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert not get_module(block, f"{bspec.moe.module}.experts").dense  # the rule ends with the block


def test_gptq_hessian_of_an_expert_is_over_its_routed_tokens(tiny_corpus, tmp_path):
    path = make_family_model(tmp_path / "qwen3-moe", "qwen3-moe")
    model, spec, inputs = block_inputs(path, tiny_corpus)
    block = get_module(model, spec.blocks)[0]
    bspec = spec.for_block(block)
    sparse = get_module(block, bspec.moe.module)
    xs = []
    handle = sparse.register_forward_pre_hook(lambda m, a: xs.append(a[0].reshape(-1, a[0].shape[-1])))
    inputs.run(block)
    handle.remove()
    x = torch.cat(xs)
    index = sparse.gate(x)[2]
    firsts = {bspec.moe.expert(e, 0): get_module(block, bspec.moe.expert(e, 0)) for e in range(4)}
    hessians = reduce_each(block, firsts, inputs, accumulate_hessian, "layer0")
    for e in range(4):
        routed = x[(index == e).any(-1)]
        assert routed.shape[0] > 0
        torch.testing.assert_close(
            hessians[bspec.moe.expert(e, 0)], 2 * routed.T @ routed / routed.shape[0], rtol=1e-4, atol=1e-5
        )


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_every_expert_is_quantized_counted_and_served_though_two_get_no_token(skewed, tiny_corpus, tmp_path, method):
    name, path = skewed
    out = tmp_path / "q"
    calib = Calibration(str(tiny_corpus), 8, 32, min_expert_tokens=1)
    prov = quantize(str(path), preset("w4a16-asym").with_group_size(32), out, method, calib)
    model = load_float_model(path)[0]
    spec = arch_for(model.config)
    tensors = read_tensors(out)
    ignore = json.loads((out / "config.json").read_text())["quantization_config"]["ignore"]
    sparse = [(i, spec.for_block(b)) for i, b in enumerate(get_module(model, spec.blocks)) if spec.for_block(b).moe]
    assert sparse and sorted(prov["expert_tokens"]) == [f"model.layers.{i}" for i, _ in sparse], name
    for i, bspec in sparse:
        prefix = f"model.layers.{i}"
        counts = prov["expert_tokens"][prefix]
        assert [counts[e] for e in STARVED] == [0, 0] and min(c for e, c in enumerate(counts) if e not in STARVED) > 0
        for e in range(len(counts)):
            for part in range(3):
                linear = f"{prefix}.{bspec.moe.expert(e, part)}"
                assert f"{linear}.weight_packed" in tensors and f"{linear}.weight" not in tensors, linear
                scale = tensors[f"{linear}.weight_scale"].float()
                assert torch.isfinite(scale).all() and (scale > 0).all(), linear
        router = f"{prefix}.{bspec.moe.router}"
        assert tensors[f"{router}.weight"].is_floating_point() and router in ignore
        if bspec.moe.shared_gate:
            assert f"{prefix}.{bspec.moe.shared_gate}" in ignore
    coverage = describe(str(out))["experts"]
    assert all(c["all_tokens"] == list(STARVED) for c in coverage.values())
    outputs = LLM(str(out), block_size=16, num_blocks=32).generate(
        [[5, 17, 33, 2, 9]], SamplingParams(max_tokens=4, temperature=0)
    )
    assert len(outputs[0].token_ids) >= 1
    if name == "mixtral" and method == "gptq":
        shown = CliRunner().invoke(app, ["inspect", str(out)], terminal_width=200)
        assert shown.exit_code == 0 and "expert coverage" in shown.output
        assert f"{prefix}" in shown.output and " ".join(map(str, counts)) in shown.output


def test_eval_against_the_float_model_and_serve(skewed, tiny_corpus, tmp_path):
    from fastapi.testclient import TestClient

    from quantkit.calibration.kv import kv_args
    from quantkit.serve.app import create_app
    from quantkit.serve.async_engine import AsyncEngine

    name, path = skewed
    out = tmp_path / "q"
    scheme = preset("w4a16").with_group_size(32).replace(kv_cache=kv_args("fp8"))
    quantize(str(path), scheme, out, "gptq", Calibration(str(tiny_corpus), 8, 32))
    shown = CliRunner().invoke(
        app, ["eval", str(out), "--ppl", str(tiny_corpus), "--seq-len", "32", "--limit", "4", "--baseline", str(path)]
    )
    assert shown.exit_code == 0, shown.output
    report = json.loads((out / "quantkit.json").read_text())["evaluations"][-1]
    rows = {r["metric"]: r["candidate"] for r in report["rows"]}
    assert list(rows) == ["ppl", "kld", "kld_p99", "top1_agreement"] and all(v >= 0 for v in rows.values()), name
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    want = LLM(str(out), block_size=16, num_blocks=32).generate(["The quick brown fox"], params)[0].text
    engine = AsyncEngine(LLM(str(out), block_size=16, num_blocks=32), max_queue=4)
    try:
        with TestClient(create_app(engine, "moe", None, 1 << 20)) as http:
            body = {"model": "moe", "prompt": "The quick brown fox", "max_tokens": 6, "temperature": 0}
            got = http.post("/v1/completions", json=body | {"ignore_eos": True})
    finally:
        engine.stop()
    assert got.status_code == 200 and got.json()["choices"][0]["text"] == want, name


def test_a_scheme_vllm_cannot_run_on_experts_is_named(tmp_path, tiny_corpus):
    from quantkit.pipeline.quantize import vllm_moe_note

    assert vllm_moe_note(preset("w4a16").with_group_size(32)) is None
    assert vllm_moe_note(preset("fp8-dynamic")) is None
    path = make_family_model(tmp_path / "m", "mixtral")
    notes = []
    quantize(str(path), preset("w4a16-asym").with_group_size(32), tmp_path / "q", "rtn", log=notes.append)
    assert any("the experts get asymmetric weights" in n and "use w4a16 to serve it on vLLM" in n for n in notes)
