import dataclasses

import pytest
import torch
from conftest import make_tiny_model
from transformers import AutoModelForCausalLM

from quantkit.calibration.kv import fake_quantize_kv, kv_scales
from quantkit.errors import QuantkitError
from quantkit.models.kv_cache import (
    ATTN_IMPLEMENTATION,
    calibrated_scales,
    enable,
    kv_amax,
    quantize_kv,
    record_kv_amax,
)
from quantkit.scheme import QuantArgs, preset

torch.set_num_threads(1)

FP8 = preset("kv-fp8").kv_cache
INT8 = preset("kv-int8").kv_cache
FP8_HEAD = dataclasses.replace(FP8, strategy="attn_head")
INT8_HEAD = dataclasses.replace(INT8, strategy="attn_head")


@pytest.fixture(scope="module")
def tiny_qwen2(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen2", "qwen2")


@pytest.fixture(params=["llama", "qwen2"])
def model_dir(request, tiny_llama, tiny_qwen2):
    return {"llama": tiny_llama, "qwen2": tiny_qwen2}[request.param]


def _load(path):
    return AutoModelForCausalLM.from_pretrained(path).eval()


def _ids(seed=0, batch=2, seq=24):
    return torch.randint(0, 320, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _logits(model, ids, **kw):
    with torch.no_grad():
        return model(ids, **kw).logits


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def _calibrated(model, args, ids):
    with record_kv_amax(model), torch.no_grad():
        model(ids)
    return calibrated_scales(model, args)


def test_enable_alone_changes_nothing(model_dir):
    model, ids = _load(model_dir), _ids()
    assert model.config._attn_implementation == "sdpa"
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # left padding: the mask must still reach attention
    ref, ref_masked = _logits(model, ids), _logits(model, ids, attention_mask=mask)
    enable(model)
    enable(model)  # idempotent
    assert model.config._attn_implementation == ATTN_IMPLEMENTATION
    assert all(layer.self_attn.config._attn_implementation == ATTN_IMPLEMENTATION for layer in model.model.layers)
    torch.testing.assert_close(_logits(model, ids), ref, rtol=0, atol=1e-6)
    torch.testing.assert_close(_logits(model, ids, attention_mask=mask), ref_masked, rtol=0, atol=1e-6)


def test_generation_unchanged_by_enable(tiny_qwen2):
    model, prompt = _load(tiny_qwen2), _ids(batch=1, seq=6)
    ref = model.generate(prompt, max_new_tokens=5, do_sample=False)
    enable(model)
    assert torch.equal(model.generate(prompt, max_new_tokens=5, do_sample=False), ref)


def _layer0_kv(model, ids):
    """K after rotary and V of layer 0, [batch, kv_heads, seq, head_dim], computed by hand."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    attn = model.model.layers[0].self_attn
    with torch.no_grad():
        h = model.model.layers[0].input_layernorm(model.model.embed_tokens(ids))
        positions = torch.arange(ids.shape[1]).unsqueeze(0)
        cos, sin = model.model.rotary_emb(h, position_ids=positions)
        shape = (*ids.shape, -1, attn.head_dim)
        k = attn.k_proj(h).view(shape).transpose(1, 2)
        v = attn.v_proj(h).view(shape).transpose(1, 2)
        _, k = apply_rotary_pos_emb(k, k, cos, sin)
    return h, (cos, sin), k, v


def test_recorded_amax_matches_an_independent_computation(model_dir):
    model, ids = _load(model_dir), _ids()
    _, _, k, v = _layer0_kv(model, ids)
    with record_kv_amax(model), torch.no_grad():
        model(ids[:1])
        model(ids[1:])  # running max over two batches
    amax = kv_amax(model)
    assert sorted(amax) == [0, 1]
    k_amax, v_amax = amax[0]
    assert k_amax.shape == (model.config.num_key_value_heads,) and k_amax.dtype == torch.float32
    torch.testing.assert_close(k_amax, k.abs().amax(dim=(0, 2, 3)), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(v_amax, v.abs().amax(dim=(0, 2, 3)), rtol=1e-6, atol=1e-7)


def test_recording_stops_on_exit_and_resets_on_entry(tiny_llama):
    model, ids = _load(tiny_llama), _ids()
    with record_kv_amax(model), torch.no_grad():
        model(ids[:, :4])
    first = kv_amax(model)[0][0].clone()
    _logits(model, ids * 0 + 7)  # outside the block: not recorded
    assert torch.equal(kv_amax(model)[0][0], first)
    with record_kv_amax(model):
        pass
    assert kv_amax(model) == {}


def test_a_layer_that_saw_nothing_is_named(tiny_llama):
    model = _load(tiny_llama)
    with record_kv_amax(model), torch.no_grad():
        model.model.layers[0].self_attn.quantkit_kv.recording = True
        model.model.layers[1].self_attn.quantkit_kv.recording = False
        model(_ids())
    with pytest.raises(QuantkitError, match=r"layer 1 \(model.layers.1.self_attn\) saw no tokens"):
        calibrated_scales(model, FP8)


def test_quantize_kv_applies_the_scales_exactly(model_dir):
    """Layer 0's attention under quantize_kv equals sdpa on K and V fake-quantized by hand."""
    model, ids = _load(model_dir), _ids()
    scales = _calibrated(model, INT8_HEAD, ids)
    h, pos, k, v = _layer0_kv(model, ids)
    attn = model.model.layers[0].self_attn
    kq, vq = (fake_quantize_kv(t, s, INT8_HEAD) for t, s in zip((k, v), scales[0]))
    with torch.no_grad():
        q = attn.q_proj(h).view(*ids.shape, -1, attn.head_dim).transpose(1, 2)
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        q, _ = apply_rotary_pos_emb(q, q, *pos)
        g = attn.num_key_value_groups
        o = torch.nn.functional.scaled_dot_product_attention(
            q, kq.repeat_interleave(g, 1), vq.repeat_interleave(g, 1), is_causal=True, scale=attn.scaling
        )
        expected = attn.o_proj(o.transpose(1, 2).reshape(*ids.shape, -1))
        plain = attn(h, position_embeddings=pos, attention_mask=None)[0]
        quantize_kv(model, scales, INT8_HEAD)
        got = attn(h, position_embeddings=pos, attention_mask=None)[0]
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(got, plain, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "args,bound",
    [(FP8, 0.12), (FP8_HEAD, 0.12), (INT8, 0.05), (INT8_HEAD, 0.05)],
    ids=["fp8", "fp8-head", "int8", "int8-head"],
)
def test_calibrated_quantization_changes_logits_a_little(model_dir, args, bound):
    # relative logit error measured on these random models (scales from other text):
    # fp8 5.5-6.7%, int8 1.7-2.3%
    model, ids = _load(model_dir), _ids()
    ref = _logits(model, ids)
    quantize_kv(model, _calibrated(model, args, _ids(seed=1)), args)
    assert 1e-3 < _rel(_logits(model, ids), ref) < bound


def test_huge_int8_scales_zero_the_cache(tiny_llama):
    model, ids = _load(tiny_llama), _ids()
    ref = _logits(model, ids)
    heads = model.config.num_key_value_heads
    huge = torch.full((heads,), 1e6)
    quantize_kv(model, {i: (huge, huge) for i in range(2)}, INT8_HEAD)
    assert _rel(_logits(model, ids), ref) > 0.3
    with torch.no_grad():  # V rounds to 0, so every attention output is exactly 0
        h = model.model.layers[0].input_layernorm(model.model.embed_tokens(ids))
        pos = model.model.rotary_emb(h, position_ids=torch.arange(ids.shape[1]).unsqueeze(0))
        out = model.model.layers[0].self_attn(h, position_embeddings=pos, attention_mask=None)[0]
    assert torch.equal(out, torch.zeros_like(out))


def test_scales_are_buffers_in_the_state_dict(tiny_qwen2):
    model, ids = _load(tiny_qwen2), _ids()
    quantize_kv(model, _calibrated(model, FP8_HEAD, ids), FP8_HEAD)
    sd = model.state_dict()
    for n in range(2):
        for name in ("k_scale", "v_scale"):
            t = sd[f"model.layers.{n}.self_attn.{name}"]
            assert t.dtype == torch.float32 and t.shape == (2,) and (t > 0).all()
    amax = kv_amax(model)[1][1]
    torch.testing.assert_close(sd["model.layers.1.self_attn.v_scale"], kv_scales(amax, FP8_HEAD))
    # quantize again with per-tensor scales: buffers are replaced, not duplicated
    quantize_kv(model, _calibrated(model, FP8, ids), FP8)
    assert model.state_dict()["model.layers.0.self_attn.k_scale"].shape == (1,)


def test_quantized_generation_runs_with_a_cache(tiny_qwen2):
    model, prompt = _load(tiny_qwen2), _ids(batch=1, seq=6)
    quantize_kv(model, _calibrated(model, FP8_HEAD, _ids()), FP8_HEAD)
    out = model.generate(prompt, max_new_tokens=4, do_sample=False)
    assert out.shape == (1, 10)


def test_bad_scales_and_args(tiny_llama):
    model = _load(tiny_llama)
    one = torch.ones(1)
    with pytest.raises(QuantkitError, match="no KV-cache scales for layer 1"):
        quantize_kv(model, {0: (one, one)}, FP8)
    with pytest.raises(QuantkitError, match=r"k_scale has 1 values; strategy 'attn_head' needs 2"):
        quantize_kv(model, {0: (one, one), 1: (one, one)}, FP8_HEAD)
    with pytest.raises(QuantkitError, match="8 bits"):
        quantize_kv(model, {}, QuantArgs(num_bits=4, strategy="tensor", group_size=None))
    with pytest.raises(QuantkitError, match="strategy 'channel'"):
        calibrated_scales(model, QuantArgs(num_bits=8, strategy="channel", group_size=None))


def test_kv_amax_needs_enable(tiny_llama):
    with pytest.raises(QuantkitError, match="enable"):
        kv_amax(_load(tiny_llama))


def test_unknown_architecture():
    from transformers import GPT2Config

    model = AutoModelForCausalLM.from_config(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=16))
    with pytest.raises(QuantkitError, match="architecture 'gpt2' is not supported"):
        enable(model)
    assert model.config._attn_implementation != ATTN_IMPLEMENTATION
