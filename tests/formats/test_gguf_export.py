"""GGUF export end to end: the file the `gguf` package's reader and transformers' GGUF loader
(both independent of our packer) read back holds our block values under llama.cpp's names,
q/k rows in llama.cpp's order; the per-tensor types follow llama.cpp's rules; the
tokenizer keys match the built-in model's source GGUF; a model llama.cpp can be given
(QUANTKIT_LLAMA_CPP) loads and its logits agree."""

from __future__ import annotations

import math
import os
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from quantkit.errors import QuantkitError
from quantkit.formats import gguf, gguf_file
from quantkit.pipeline.gguf import export_gguf
from tests.conftest import (
    FAMILIES,
    TEXT,
    make_family_model,
    make_sentencepiece_tokenizer,
    make_tiny_model,
    make_tokenizer,
)

pytest.importorskip("gguf", reason="the gguf package (llama.cpp's gguf-py) is not installed")


@pytest.fixture(scope="module")
def wide_llama(tmp_path_factory):
    # rows of 256 weights, so the K-quants fill their super-blocks
    return make_tiny_model(tmp_path_factory.mktemp("m") / "wide", hidden_size=256, intermediate_size=512)


GEMMA3 = {  # llama.cpp's gemma3: every sixth layer global, attention scaled by 1/sqrt(head_dim)
    "num_hidden_layers": 6,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "query_pre_attn_scalar": 64,
    "sliding_window": 12,
    "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
    "rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
    },
}


WIDE = {  # family -> (model_type, tied, config), rows of 256 weights
    # Llama 3's scaled RoPE, its original context short enough that most frequencies are scaled
    "llama3": ("llama", False, FAMILIES["llama3"][1]),
    "qwen2": ("qwen2", False, {}),  # q/k/v biases
    # q/k norms; head_dim 128: transformers' GGUF reader rebuilds a Qwen3 config with its default
    # head_dim (it does not read attention.key_length, which llama.cpp does)
    "qwen3": ("qwen3", False, {"head_dim": 128}),
    "llama-sp": ("llama", False, {"vocab_size": 384}),  # a SentencePiece tokenizer (llama.cpp's "llama")
    # fused q/k/v and gate/up; Phi-4-mini's partial rotary (RoPE on half of each head)
    "phi3": ("phi3", False, {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}),
    "phi4-mini": (
        "phi3",
        True,
        {
            "pad_token_id": 0,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        },
    ),
    # mixtures of experts (4 experts, 2 a token): llama.cpp's llama with experts, and qwen3moe
    "mixtral": ("mixtral", False, {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None}),
    "qwen2-moe": (  # a shared expert behind a sigmoid gate; q/k/v biases
        "qwen2_moe",
        False,
        {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 256,
            "shared_expert_intermediate_size": 512,
            "mlp_only_layers": [],
            "norm_topk_prob": False,
        },
    ),
    "qwen3-moe": (
        "qwen3_moe",
        False,
        {
            "head_dim": 64,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 256,
            "norm_topk_prob": True,
        },
    ),
    "gemma2": (
        "gemma2",
        True,
        {
            "head_dim": 64,
            "query_pre_attn_scalar": 64,
            "sliding_window": 12,
            "attn_logit_softcapping": 50.0,
            "final_logit_softcapping": 30.0,
        },
    ),
    "gemma3": ("gemma3_text", True, GEMMA3),
}


@pytest.fixture(scope="module", params=["llama", *WIDE])
def wide(request, tmp_path_factory):
    """Each family GGUF export writes: (its folder, its gguf_file.Family)."""
    if request.param == "llama":
        return request.getfixturevalue("wide_llama"), gguf_file.LLAMA
    model_type, tie, config = WIDE[request.param]
    config = {"hidden_size": 256, "intermediate_size": 512, **config}
    # not named for its family: llama.cpp sets Phi-3's SentencePiece token attributes by general.name
    folder = make_tiny_model(tmp_path_factory.mktemp("m") / "tiny", model_type, tie=tie, **config)
    if request.param == "qwen2":  # Qwen2's own pre-tokenizer: llama.cpp must split the text as transformers does
        qwen2 = next(regex for regex, name in gguf_file.SPLITS.items() if name == "qwen2")
        # trained on tiny_corpus's text, whose merges then span what GPT-2's split would cut
        # (".\n\n": 4,357 of its 4,448 tokens differ under GPT-2's pre-tokenizer)
        make_tokenizer(split=qwen2, texts=["\n\n".join(TEXT * 4)]).save_pretrained(folder)
    if request.param == "llama-sp":  # a SentencePiece BPE, as Llama 2's, Mistral's and Phi-3's
        make_sentencepiece_tokenizer().save_pretrained(folder)
    return folder, gguf_file.FAMILIES[model_type]


def _read(path: Path):
    """transformers' GGUF loader on `path` (no padding id: it would rebuild Phi-3's default, 32000,
    past a tiny vocabulary)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32, pad_token_id=None
    )


def _file_values(path: Path, model, family) -> dict[str, torch.Tensor]:
    """{HF name of `model`: the value a GGUF file holds for it}, decoded by the gguf package
    (llama.cpp's gguf-py, not our packer): an expert's slice of its stacked tensor, q/k rows back
    in transformers' order. transformers' GGUF loader reads no mixture of experts."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    file = {t.name: torch.from_numpy(dequantize(t.data, t.tensor_type).copy()) for t in GGUFReader(path).tensors}
    heads = {"attn_q": model.config.num_attention_heads, "attn_k": model.config.num_key_value_heads}
    out = {}
    for name, p in model.state_dict().items():
        gname = gguf_file.gguf_name(name, family)
        if gname not in file:
            continue
        value = file[gname]
        if (expert := gguf_file.expert_index(name)) is not None:
            value = value[expert]
        short = gname.split(".")[-2]
        if family.interleave_rope and short in heads:
            value = value[torch.argsort(gguf_file.rope_rows(len(value), heads[short]))]
        out[name] = value.reshape(p.shape)
    return out


def _moe(folder: Path):
    """A mixture of experts as the export reads it: quantkit's loader, one linear per expert."""
    from quantkit.models.loading import load_float_model

    model = load_float_model(str(folder), owned=True)[0].float()
    return model if gguf_file.experts(model.config) else None


def _from_file(source: Path, path: Path):
    """The source model's architecture holding the values a GGUF file's tensors decode to (read by
    transformers' GGUF loader, which undoes llama.cpp's row order and norm offsets; a mixture of
    experts by `_file_values`); transformers rebuilds a Gemma 3 config from a GGUF file with its
    own defaults, hence the source's config."""
    from transformers import AutoModelForCausalLM

    if (moe := _moe(source)) is not None:
        family = gguf_file.FAMILIES[moe.config.model_type]
        with torch.no_grad():
            for name, value in _file_values(path, moe, family).items():
                moe.get_parameter(name).copy_(value)
        return moe
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    state = _read(path).state_dict()
    with torch.no_grad():
        for name, p in model.state_dict().items():
            if name in state:
                p[: len(state[name])].copy_(state[name])  # a trimmed embedding fills its first rows
    return model


def test_rope_rows_interleave_each_heads_halves():
    assert gguf_file.rope_rows(8, 2).tolist() == [0, 2, 1, 3, 4, 6, 5, 7]


def test_q4_k_m_types_follow_llama_cpp():
    t = lambda name, cols=576: gguf_file.tensor_type("q4_k_m", name, cols, 32, True, False)  # noqa: E731
    assert t("token_embd.weight") == "q8_0"  # tied output, rows not a multiple of 256
    assert t("token_embd.weight", 512) == "q6_k"
    assert t("blk.0.attn_v.weight", 512) == "q6_k" and t("blk.5.attn_v.weight", 512) == "q4_k"
    assert t("blk.6.ffn_down.weight", 512) == "q6_k" and t("blk.7.ffn_down.weight", 512) == "q4_k"
    assert t("blk.7.attn_q.weight") == "q5_0"  # Q4_K's fallback
    assert gguf_file.tensor_type("q4_0", "blk.0.ffn_down.weight", 512, 32, True, True) == "q4_1"
    assert gguf_file.tensor_type("q4_0", "blk.0.ffn_down.weight", 512, 32, True, False) == "q4_0"
    # a fused qkv counts as an attn_v; an expert's ffn_down as an ffn_down; the router stays float
    assert t("blk.0.attn_qkv.weight", 512) == "q6_k" and t("blk.6.ffn_down_exps.weight", 512) == "q6_k"
    assert t("blk.3.ffn_gate_inp.weight", 512) == "f32"
    # 8 experts (Mixtral): attn_v and attn_k in Q8_0, attn_output in Q5_K (llama-quant.cpp)
    eight = lambda name, ft="q4_k_m": gguf_file.tensor_type(ft, name, 512, 32, False, False, experts=8)  # noqa: E731
    assert (
        eight("blk.5.attn_v.weight") == eight("blk.5.attn_k.weight") == eight("blk.5.attn_v.weight", "q4_0") == "q8_0"
    )
    assert eight("blk.5.attn_output.weight") == "q5_k" and eight("blk.5.attn_output.weight", "q5_k_m") == "q5_k"
    assert eight("blk.5.attn_q.weight") == "q4_k"


@pytest.mark.parametrize("file_type", list(gguf_file.FILE_TYPES))
def test_the_file_holds_our_values_under_llama_cpp_names(wide, tmp_path, file_type):
    from transformers import AutoModelForCausalLM

    folder, family = wide
    path = tmp_path / "m.gguf"
    chosen = export_gguf(str(folder), path, file_type, method="rtn")
    source = _moe(folder)
    if source is None:
        source = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        state = _read(path).state_dict()
    else:
        state = _file_values(path, source, family)
    written = 0
    for name, w in source.state_dict().items():
        gname = gguf_file.gguf_name(name, family)
        if gname is None or gname not in chosen:
            continue
        if (gguf_file.expert_index(name) or 0) > 0:  # one tensor holds all experts: counted once
            written -= 1
        kind = chosen[gname]
        want = w if kind == "f32" else gguf.dequantize(gguf.choose(w, gguf.TYPES[kind]))
        if family.norm_shift and gname.endswith("norm.weight"):  # written as w + 1, read back as (w + 1) - 1
            torch.testing.assert_close(state[name], want, rtol=0, atol=1e-6)
        else:
            assert torch.equal(state[name], want), name
        written += 1
    factors = gguf_file.rope_factors(source.config)  # Llama 3's RoPE: one tensor more, not a weight
    assert written + (factors is not None) == len(chosen)  # every tensor of the file was compared
    if factors is not None:
        from gguf import GGUFReader

        stored = next(t for t in GGUFReader(path).tensors if t.name == "rope_freqs.weight")
        assert chosen["rope_freqs.weight"] == "f32" and np.array_equal(stored.data, factors)
    if family is gguf_file.GEMMA3:  # its four norms a block and q/k norms, no RoPE row order
        assert {"blk.0.post_attention_norm.weight", "blk.0.post_ffw_norm.weight", "blk.0.attn_q_norm.weight"} <= set(
            chosen
        )
    down = "ffn_down_exps" if gguf_file.experts(source.config) else "ffn_down"
    if file_type == "q4_k_m" and family is gguf_file.LLAMA:
        assert chosen[f"blk.1.{down}.weight"] == "q6_k" and chosen[f"blk.0.{down}.weight"] == "q4_k"
        assert chosen["blk.1.attn_q.weight"] == "q4_k"
    if down == "ffn_down_exps":  # one stacked tensor per layer and kind, [experts, rows, cols]; the router float
        from gguf import GGUFReader

        shapes = {t.name: list(reversed(t.shape.tolist())) for t in GGUFReader(path).tensors}
        first = next(
            w for n, w in source.state_dict().items() if gguf_file.gguf_name(n, family) == "blk.0.ffn_down_exps.weight"
        )
        assert (
            shapes["blk.0.ffn_down_exps.weight"] == [4, *first.shape] and chosen["blk.0.ffn_gate_inp.weight"] == "f32"
        )


def test_calibrated_export_is_closer_to_the_float_model(wide, tiny_corpus, tmp_path):
    from transformers import AutoModelForCausalLM

    from quantkit.calibration.datasets import calibration_samples, load_documents
    from quantkit.calibration.gguf import GGUFOptions
    from quantkit.calibration.method import Calibration
    from quantkit.models.loading import load_float_model

    folder, _ = wide
    calib = Calibration(dataset=str(tiny_corpus), samples=8, seq_len=64)
    tokenizer = load_float_model(str(folder))[1]
    ids = calibration_samples(tokenizer, load_documents(calib.dataset, "calib"), 8, 64)  # the text calibrated on
    base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)(ids).logits.log_softmax(-1)
    kl = {}
    runs = {
        "rtn": ("rtn", None),
        "gptq": ("gptq", GGUFOptions(awq=False)),
        "static": ("gptq", GGUFOptions(static=True, actorder=True, outliers=10.0, awq=False)),
        "awq": ("gptq", None),  # the default
    }
    for label, (method, options) in runs.items():
        path = tmp_path / f"{label}.gguf"
        export_gguf(str(folder), path, "q4_0", method=method, calibration=calib, options=options)
        got = _from_file(folder, path)
        logp = got(ids).logits.log_softmax(-1)
        kl[label] = (base.exp() * (base - logp)).sum(-1).mean().item()  # KL(float || file) per token
    assert max(kl["gptq"], kl["static"], kl["awq"]) < kl["rtn"], kl


def test_refusals(tmp_path, wide_llama):
    with pytest.raises(QuantkitError, match="unknown GGUF type"):
        export_gguf(str(wide_llama), tmp_path / "a.gguf", "q3_k_s")
    (tmp_path / "b.gguf").write_bytes(b"x")
    with pytest.raises(QuantkitError, match="exists"):
        export_gguf(str(wide_llama), tmp_path / "b.gguf", "q8_0", method="rtn")
    shared = make_family_model(tmp_path / "q2m", "qwen2-moe")  # its layer 1 is dense
    with pytest.raises(QuantkitError, match="has experts in every layer"):
        export_gguf(str(shared), tmp_path / "c.gguf", "q8_0", method="rtn")
    gemma = make_tiny_model(tmp_path / "g1", "gemma", head_dim=16)  # Gemma 1: not written yet
    with pytest.raises(QuantkitError, match="writes the families llama, mistral, qwen2.*not 'gemma'"):
        export_gguf(str(gemma), tmp_path / "c.gguf", "q8_0", method="rtn")
    moe = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64}
    loose = make_tiny_model(tmp_path / "q3m", "qwen3_moe", head_dim=16, norm_topk_prob=False, **moe)
    with pytest.raises(QuantkitError, match="renormalises the chosen experts' weights"):
        export_gguf(str(loose), tmp_path / "c.gguf", "q8_0", method="rtn")
    dense = make_tiny_model(tmp_path / "q3d", "qwen3_moe", head_dim=16, norm_topk_prob=True, mlp_only_layers=[1], **moe)
    with pytest.raises(QuantkitError, match="has experts in every layer"):
        export_gguf(str(dense), tmp_path / "c.gguf", "q8_0", method="rtn")
    window = make_tiny_model(tmp_path / "w", "qwen2", use_sliding_window=True, sliding_window=12, max_window_layers=1)
    with pytest.raises(QuantkitError, match="qwen2 attends to the whole context"):
        export_gguf(str(window), tmp_path / "c.gguf", "q8_0", method="rtn")
    odd = make_tiny_model(tmp_path / "g", "gemma3_text", tie=True, **{**GEMMA3, "layer_types": ["full_attention"] * 6})
    with pytest.raises(QuantkitError, match="every sixth layer global"):
        export_gguf(str(odd), tmp_path / "d.gguf", "q8_0", method="rtn")
    uncapped = make_tiny_model(
        tmp_path / "g2", "gemma2", tie=True, head_dim=16, query_pre_attn_scalar=16, final_logit_softcapping=None
    )
    with pytest.raises(QuantkitError, match="caps attention and final logits"):
        export_gguf(str(uncapped), tmp_path / "d.gguf", "q8_0", method="rtn")
    scaled = make_tiny_model(tmp_path / "s", "gemma3_text", tie=True, **{**GEMMA3, "query_pre_attn_scalar": 256})
    with pytest.raises(QuantkitError, match="query_pre_attn_scalar is 256"):
        export_gguf(str(scaled), tmp_path / "e.gguf", "q8_0", method="rtn")
    linear = make_tiny_model(tmp_path / "l", rope_scaling={"rope_type": "linear", "factor": 2.0})
    with pytest.raises(QuantkitError, match="Llama 3's scaled RoPE so far, not linear"):
        export_gguf(str(linear), tmp_path / "f.gguf", "q8_0", method="rtn")
    assert [p.name for p in tmp_path.glob("*.gguf")] == ["b.gguf"] and not list(tmp_path.glob(".*partial"))


def test_llama3_rope_factors_scale_transformers_frequencies_as_llama_cpp_divides_them(tmp_path):
    # transformers' llama3 inverse frequencies = the plain ones / llama.cpp's rope_freqs
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = AutoConfig.for_model("llama", hidden_size=256, num_attention_heads=4, **WIDE["llama3"][2])
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    dim = 64
    plain = 1.0 / (config.rope_parameters["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    factors = torch.from_numpy(gguf_file.rope_factors(config)).double()
    torch.testing.assert_close(plain / factors, scaled.double(), rtol=1e-5, atol=0)
    assert factors.min() == 1.0 and factors.max() == 8.0 and ((factors > 1) & (factors < 8)).any()
    assert gguf_file.rope_factors(AutoConfig.for_model("llama")) is None


@pytest.mark.smollm2
def test_tokenizer_keys_match_the_source_gguf():
    from gguf import GGUFReader

    from quantkit import assets
    from quantkit.models.loading import load_tokenizer, resolve_model

    folder = resolve_model("smollm2-135m")
    source = GGUFReader(assets.fetch("smollm2-135m.gguf")).fields
    # the converted tokenizer.json no longer names its pre-tokenizer: the builder is given the source's
    pre = source["tokenizer.ggml.pre"].contents()
    ours = gguf_file.tokenizer_metadata(folder, load_tokenizer(folder), pre, vocab_size=49152)
    for key, (_, value) in ours.items():
        assert source[key].contents() == value, key
    assert {k for k in source if k.startswith("tokenizer.")} == set(ours)


def test_a_source_files_tokenizer_is_written_back_as_it_was(wide_llama, tmp_path):
    # what a built-in model (converted from a GGUF file) gets: every tokenizer.* key of its source,
    # whatever its type (SentencePiece files carry float32 scores; here added to a BPE file's keys)
    from gguf import GGUFReader

    first = tmp_path / "a.gguf"
    export_gguf(str(wide_llama), first, "f32", method="rtn")
    meta = gguf_file.source_tokenizer(first)
    meta["tokenizer.ggml.scores"] = ("float32s", [-float(i) for i in range(len(meta["tokenizer.ggml.tokens"][1]))])
    second = tmp_path / "b.gguf"
    gguf_file.write(second, "llama", "b", "f32", meta, [])
    assert gguf_file.source_tokenizer(second) == meta
    fields = GGUFReader(second).fields
    assert fields["tokenizer.ggml.scores"].contents()[:3] == [0.0, -1.0, -2.0]
    assert fields["tokenizer.ggml.model"].contents() == "gpt2"


def _llama_cpp(name: str) -> Path:
    folder = os.environ.get("QUANTKIT_LLAMA_CPP")
    if not folder or not (Path(folder) / name).is_file():
        pytest.skip(f"llama.cpp's {name} is not built here; set QUANTKIT_LLAMA_CPP to its folder to run this.")
    return Path(folder) / name


@pytest.mark.parametrize("file_type", list(gguf_file.FILE_TYPES))
def test_llama_cpp_perplexity_agrees_with_transformers_on_our_values(wide, tiny_corpus, tmp_path, file_type):
    # llama-perplexity scores the second half of each window of --ctx tokens: the logits at
    # positions ctx/2 .. ctx-2 against the tokens after them (ctx/2 - 1 tokens; no BOS: the
    # tokenizer adds none); the same windows in transformers, from the same file's values.
    # llama.cpp rounds activations to 8 bits for quantized weights (q8_0 / q8_K dot products): on
    # the tiny Llama, whose perplexity (~3,500) passes its vocabulary's 320, that moved it by 0.6-3.3%
    # (q6_k the most, its q8_K activations share one scale per 256), hence 4%; on the tiny Gemma 3
    # by at most 0.3%; f32 agrees within 1e-3 on every family. In a mixture of experts a rounded
    # activation can also change which experts a token is routed to: Qwen3-MoE's q6_k moved 4.4%,
    # hence 6% for the mixtures.
    from quantkit.models.loading import load_tokenizer

    folder, _ = wide
    tool = _llama_cpp("llama-perplexity")
    path = tmp_path / "m.gguf"
    export_gguf(str(folder), path, file_type, method="rtn")
    text = tiny_corpus.read_text()
    ctx, chunks = 64, 4
    # the running estimate after chunk `chunks` ("[4]3565.9946,"), more chunks being asked for:
    # llama.cpp's logger is asynchronous and the last lines (and "Final estimate") are not always
    # written before the process exits (seen in 1 of about 140 runs with one chunk more: run again)
    cmd = [str(tool), "-m", str(path), "-f", str(tiny_corpus), "-c", str(ctx), "--chunks", str(chunks + 2), "-t", "1"]
    for _ in range(3):
        done = subprocess.run(cmd, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-2000:]
        found = re.findall(rf"\[{chunks}\]([\d.]+),", done.stdout + done.stderr)
        if found:
            break
    theirs = float(found[0])
    ids = torch.tensor(load_tokenizer(folder)(text)["input_ids"][: ctx * chunks]).reshape(chunks, ctx)
    model = _from_file(folder, path)
    with torch.no_grad():
        logp = model(ids).logits.log_softmax(-1)
    first = ctx // 2
    nll = -logp[:, first:-1].gather(-1, ids[:, first + 1 :, None]).mean()
    quantized = 0.06 if gguf_file.experts(model.config) else 0.04
    assert theirs == pytest.approx(math.exp(nll.item()), rel=quantized if file_type != "f32" else 1e-3)


def test_llama_cpp_generates_from_our_file(wide, tmp_path):
    tool = _llama_cpp("llama-simple")
    path = tmp_path / "m.gguf"
    export_gguf(str(wide[0]), path, "q4_k_m", method="rtn")
    done = subprocess.run(  # a random model's tokens need not decode to UTF-8
        [str(tool), "-m", str(path), "-n", "8", "hello"], capture_output=True, text=True, errors="replace"
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "hello" in done.stdout


def test_the_cli_writes_a_calibrated_file(wide_llama, tiny_corpus, tmp_path):
    from typer.testing import CliRunner

    from quantkit.cli import build_app

    out = tmp_path / "m.gguf"
    args = ["export", str(wide_llama), "--format", "gguf", "--type", "q4_k_m", "-o", str(out)]
    r = CliRunner().invoke(build_app(), [*args, "--calib", str(tiny_corpus), "--samples", "4", "--seq-len", "32"])
    assert r.exit_code == 0, r.output
    assert "gptq" in r.output and out.is_file()
    assert "gptq after AWQ's scales" in r.output
    r = CliRunner().invoke(build_app(), [*args, "--method", "awq"])
    assert r.exit_code == 2 and "unknown GGUF method 'awq'" in r.output
    r = CliRunner().invoke(build_app(), [*args, "--overwrite", "--imatrix-out", str(tmp_path / "i.gguf")])
    assert r.exit_code == 2 and "add --no-awq" in r.output and "Traceback" not in r.output


def test_the_importance_matrix_file_holds_the_calibration_inputs_squares(wide_llama, tiny_corpus, tmp_path):
    from gguf import GGUFReader
    from transformers import AutoModelForCausalLM

    from quantkit.calibration.datasets import calibration_samples, load_documents
    from quantkit.calibration.method import Calibration
    from quantkit.models.loading import load_float_model

    calib = Calibration(dataset=str(tiny_corpus), samples=8, seq_len=64)
    path, imatrix = tmp_path / "m.gguf", tmp_path / "imatrix.gguf"
    export_gguf(str(wide_llama), path, "q4_0", method="imatrix", calibration=calib, imatrix_out=imatrix)
    # block 0's q/k/v read the embeddings' norm, which no quantized weight precedes
    model = AutoModelForCausalLM.from_pretrained(wide_llama, dtype=torch.float32)
    ids = calibration_samples(load_float_model(str(wide_llama))[1], load_documents(calib.dataset, "calib"), 8, 64)
    seen = []
    model.model.layers[0].self_attn.q_proj.register_forward_pre_hook(lambda m, a: seen.append(a[0]))
    with torch.no_grad():
        model(ids)
    x = torch.cat(seen).reshape(-1, 256)
    reader = GGUFReader(imatrix)
    tensors = {t.name: torch.from_numpy(t.data.copy()).reshape(-1) for t in reader.tensors}
    assert reader.fields["general.type"].contents() == "imatrix"
    assert reader.fields["imatrix.chunk_count"].contents() == 8
    for name in ("attn_q", "attn_k", "attn_v"):
        torch.testing.assert_close(tensors[f"blk.0.{name}.weight.in_sum2"], (x * x).sum(0), rtol=1e-4, atol=1e-6)
        assert tensors[f"blk.0.{name}.weight.counts"].tolist() == [len(x)]
    assert "blk.1.ffn_down.weight.in_sum2" in tensors and tensors["blk.1.ffn_down.weight.in_sum2"].numel() == 512
    with pytest.raises(QuantkitError, match="comes from calibration"):
        export_gguf(str(wide_llama), tmp_path / "r.gguf", "q4_0", method="rtn", imatrix_out=tmp_path / "r.imatrix")
    # llama.cpp's quantizer reads it
    tool = _llama_cpp("llama-quantize")
    f32 = tmp_path / "f32.gguf"
    export_gguf(str(wide_llama), f32, "f32", method="rtn")
    args = [str(tool), "--imatrix", str(imatrix), str(f32), str(tmp_path / "q.gguf"), "Q4_0", "1"]
    done = subprocess.run(args, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert re.search(r"loaded 14 importance matrix entries from .* computed on 8 chunks", done.stdout), done.stdout


def test_the_pre_tokenizer_is_named_for_llama_cpp(wide, tmp_path):
    from gguf import GGUFReader

    folder, family = wide
    path = tmp_path / "m.gguf"
    export_gguf(str(folder), path, "f32", method="rtn")
    pre = GGUFReader(path).fields["tokenizer.ggml.pre"].contents()
    sentencepiece = GGUFReader(path).fields["tokenizer.ggml.model"].contents() == "llama"
    assert pre == ("qwen2" if family is gguf_file.QWEN2 else "default" if sentencepiece else "gpt-2")
    llama3 = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": next(r for r, n in gguf_file.SPLITS.items() if n == "llama-bpe")},
         "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
    ]}  # fmt: skip
    assert gguf_file._pre_tokenizer(llama3) == "llama-bpe"
    llama3["pretokenizers"][0]["pattern"]["Regex"] = r"\s+"
    assert gguf_file._pre_tokenizer(llama3) is None


def test_llama_cpp_tokenizes_as_transformers(wide, tiny_corpus, tmp_path):
    # llama-tokenize (printf, not the asynchronous logger) on the corpus and on text with digits,
    # contractions, non-ASCII bytes (byte fallback) and runs of spaces and newlines
    from quantkit.models.loading import load_tokenizer

    folder, _ = wide
    tool = _llama_cpp("llama-tokenize")
    path = tmp_path / "m.gguf"
    export_gguf(str(folder), path, "f32", method="rtn")
    text = tiny_corpus.read_text()[:2000] + "\n\nIt's 2026: café, naïve — 42 apples!\n  two  spaces\tand a tab."
    (tmp_path / "t.txt").write_text(text)
    done = subprocess.run(
        [str(tool), "-m", str(path), "-f", str(tmp_path / "t.txt"), "--ids", "--log-disable"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    theirs = [int(i) for i in re.findall(r"\d+", done.stdout.strip().splitlines()[-1])]
    assert theirs == load_tokenizer(folder)(text)["input_ids"]
