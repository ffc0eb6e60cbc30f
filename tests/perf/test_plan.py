"""`quantkit plan` arithmetic against hand-computed cases from public configs."""

import math
import sys

import pytest

from quantkit.errors import QuantkitError
from quantkit.perf.plan import GPUS, kv_bytes_per_token, model_config, param_count, plan, weight_bytes

LLAMA2_7B = {
    "model_type": "llama",
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "tie_word_embeddings": False,
}
LLAMA2_70B = {
    "model_type": "llama",
    "vocab_size": 32000,
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "tie_word_embeddings": False,
}
SMOLLM2_135M = {
    "model_type": "llama",
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "tie_word_embeddings": True,
}
# widths divisible by 128: q 256x256, k/v 128x256, o 256x256, gate/up 512x256, down 256x512
SMALL = {
    "model_type": "llama",
    "vocab_size": 1000,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
SMALL_LINEAR = 256 * 256 + 2 * 128 * 256 + 256 * 256 + 3 * 512 * 256  # 589,824 weights per block
SMALL_FLOAT = 2 * 2 * 256 + 256 + 2 * 1000 * 256  # norms, final norm, embed + lm_head


def test_parameter_counts():
    assert param_count(SMOLLM2_135M) == 134_515_008
    assert param_count(LLAMA2_7B) == 6_738_415_616
    assert param_count(SMALL) == 2 * SMALL_LINEAR + SMALL_FLOAT
    # qwen2 carries q/k/v biases
    assert param_count({**SMALL, "model_type": "qwen2"}) == param_count(SMALL) + 2 * (256 + 128 + 128)


def test_kv_bytes_per_token():
    assert kv_bytes_per_token(LLAMA2_70B) == 2 * 80 * 8 * 128 * 2 == 320 * 1024
    assert kv_bytes_per_token(LLAMA2_70B, "fp8") == 160 * 1024
    assert kv_bytes_per_token(SMOLLM2_135M) == 2 * 30 * 3 * 64 * 2


def test_weight_bytes_by_hand():
    assert weight_bytes(SMALL, "bf16") == (2 * SMALL_LINEAR + SMALL_FLOAT) * 2
    # 4 bits + one 16-bit scale per 128 weights = 4.125 bits per weight, and each linear's
    # weight_shape (two int64) as pack-quantized stores it
    assert weight_bytes(SMALL, "w4a16") == 2 * SMALL_LINEAR * 4.125 / 8 + 14 * 16 + SMALL_FLOAT * 2 == 1_635_040
    # asymmetric adds a 4-bit zero point per group
    assert weight_bytes(SMALL, "w4a16-asym") == weight_bytes(SMALL, "w4a16") + 2 * SMALL_LINEAR / 128 / 2
    # fp8 per channel: 1 byte per weight + an fp32 scale per output row
    rows = 256 + 128 + 128 + 256 + 512 + 512 + 256
    assert weight_bytes(SMALL, "fp8-dynamic") == 2 * (SMALL_LINEAR + rows * 4) + SMALL_FLOAT * 2


def test_seqs_tpot_and_cost():
    bf16, w4 = plan(LLAMA2_70B, ["bf16", "w4a16"], gpu="h100-80gb", context=4096, cost_per_hour=3.6)
    assert bf16["max_seqs"] == 0 and not bf16["fits"] and bf16["tpot_ms_full"] is None  # 138 GB > 72 GB
    kv_seq = 327_680 * 4096
    assert w4["kv_bytes_per_seq"] == kv_seq
    assert w4["max_seqs"] == math.floor((80e9 * 0.9 - w4["weight_bytes"]) / kv_seq) > 0
    assert w4["tpot_ms_batch1"] == pytest.approx(w4["weight_bytes"] / 3.35e12 * 1e3)
    full = (w4["weight_bytes"] + w4["max_seqs"] * kv_seq) / 3.35e12
    assert w4["tpot_ms_full"] == pytest.approx(full * 1e3)
    assert w4["tokens_per_s_full"] == pytest.approx(w4["max_seqs"] / full)
    assert w4["usd_per_1k_output_tokens"] == pytest.approx(3.6 / 3600 / w4["tokens_per_s_full"] * 1000)
    # 7B in bf16 on an H100 at batch 1: 13.5 GB read per token, about 4 ms
    (row,) = plan(LLAMA2_7B, ["bf16"])
    assert row["tpot_ms_batch1"] == pytest.approx(6_738_415_616 * 2 / 3.35e12 * 1e3)
    assert row["cost_per_hour"] == GPUS["h100-80gb"].usd_per_hour


def test_fp8_kv_and_overrides():
    (bf16_kv,) = plan(LLAMA2_7B, ["w4a16"], gpu="l40s", context=2048)
    (fp8_kv,) = plan(LLAMA2_7B, ["w4a16"], kv_cache="fp8", gpu="l40s", context=2048)
    assert fp8_kv["kv_bytes_per_token"] * 2 == bf16_kv["kv_bytes_per_token"]
    assert fp8_kv["max_seqs"] >= 2 * bf16_kv["max_seqs"]
    (custom,) = plan(LLAMA2_7B, ["bf16"], memory=200e9, bandwidth=1e12)
    assert custom["tpot_ms_batch1"] == pytest.approx(6_738_415_616 * 2 / 1e12 * 1e3)
    (capped,) = plan(SMOLLM2_135M, ["bf16"], max_num_seqs=64)
    assert capped["max_seqs"] == 64 and plan(SMOLLM2_135M, ["bf16"])[0]["max_seqs"] > 64
    (too_big,) = plan(LLAMA2_70B, ["bf16"], gpu="l4")
    assert not too_big["weights_fit"] and not too_big["fits"] and too_big["usd_per_1k_output_tokens"] is None


def test_errors_name_the_options(tiny_llama):
    with pytest.raises(QuantkitError, match="h100-80gb"):
        plan(SMALL, ["bf16"], gpu="tpu-v9")
    with pytest.raises(QuantkitError, match="w4a16"):
        plan(SMALL, ["int3"])
    with pytest.raises(QuantkitError, match="fp8"):
        plan(SMALL, ["bf16"], kv_cache="int2")
    with pytest.raises(QuantkitError, match="intermediate_size"):
        plan({k: v for k, v in SMALL.items() if k != "intermediate_size"}, ["bf16"])
    assert param_count(model_config(str(tiny_llama))) > 0
    with pytest.raises(QuantkitError):
        model_config("/no/such/model")


def test_calibration_plan_llama2_70b_by_hand():
    from quantkit.perf.plan import LIBRARY_BYTES, calibration_plan

    config = LLAMA2_70B | {"torch_dtype": "float16"}
    r = calibration_plan(config, "gptq", samples=128, seq_len=512, gflops=1000)
    # one block: q, o 8192²; k, v 1024 × 8192; gate, up, down 28672 × 8192; two norms
    block_params = 2 * 8192**2 + 2 * 1024 * 8192 + 3 * 28672 * 8192 + 2 * 8192
    assert block_params == 855_654_400
    b = r["breakdown"]
    assert b["block_weights"] == block_params * (4 + 2)  # fp32, and the fp16 copy read from disk
    assert b["activations"] == 2 * 65_536 * 8192 * 4  # 128 × 512 tokens in and out, fp32: 4 GiB
    # down_proj's H, its permuted copy and two factors; its weight, permuted, quantized and the error
    assert b["working_set"] == 4 * 28672**2 * 4 + 4 * 8192 * 28672 * 4 == 16_911_433_728
    # a batch of 8 rows: gate, up and their product; four hidden-sized tensors; 64 heads' scores
    assert b["forward"] == 8 * 512 * (3 * 28672 + 4 * 8192) * 4 + 8 * 64 * 512**2 * 4 == 2_483_027_968
    assert b["embeddings"] == 32000 * 8192 * (4 + 2)
    assert r["host_peak_bytes"] == LIBRARY_BYTES + 5_133_926_400 + 4_294_967_296 + 16_911_433_728 + 2_483_027_968
    assert 27.2 < r["host_peak_bytes"] / 2**30 < 27.4  # 70B in 27 GiB, against 128 GiB of fp16 weights
    assert r["float_weights_bytes"] == param_count(LLAMA2_70B) * 2
    # w4a16 g128 with fp16 scales: half a byte per weight + 2 bytes per 128 + 16 per linear's
    # shape, plus the float tensors
    assert (
        r["output_bytes"]
        == 80 * (855_638_016 // 2 + 855_638_016 // 64 + 7 * 16) + (80 * 2 * 8192 + 8192 + 2 * 32000 * 8192) * 2
    )
    # the same run with blocks on a GPU: the host holds one block as read, the device the rest
    g = calibration_plan(config, "gptq", samples=128, seq_len=512, device="cuda", gflops=67_000)
    assert g["host_peak_bytes"] == LIBRARY_BYTES + 5_133_926_400
    assert g["device_peak_bytes"] == 4 * block_params + 4_294_967_296 + 16_911_433_728 + 2_483_027_968
    assert g["seconds"] < r["seconds"] / 60  # a GPU's rate


def test_calibration_plan_grows_with_width_not_depth():
    from quantkit.perf.plan import calibration_plan

    deep = calibration_plan(LLAMA2_7B | {"num_hidden_layers": 80}, "awq")
    shallow = calibration_plan(LLAMA2_7B, "awq")
    assert deep["host_peak_bytes"] == shallow["host_peak_bytes"]
    assert deep["seconds"] == pytest.approx(shallow["seconds"] * 80 / 32)
    with pytest.raises(QuantkitError, match="--calibrate 'rtn' is not planned; use awq or gptq"):
        calibration_plan(LLAMA2_7B, "rtn")


MIXTRAL_8X7B = LLAMA2_7B | {
    "model_type": "mixtral",
    "intermediate_size": 14336,
    "num_key_value_heads": 8,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
}
QWEN3_30B_A3B = {
    "model_type": "qwen3_moe",
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "tie_word_embeddings": False,
}
QWEN15_MOE_A27B = {  # a shared expert beside 60 routed ones
    "model_type": "qwen2_moe",
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "moe_intermediate_size": 1408,
    "shared_expert_intermediate_size": 5632,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "num_experts": 60,
    "num_experts_per_tok": 4,
    "tie_word_embeddings": False,
}


@pytest.mark.parametrize(
    "config, total, active",
    [(MIXTRAL_8X7B, 46.70e9, 12.88e9), (QWEN3_30B_A3B, 30.53e9, 3.35e9), (QWEN15_MOE_A27B, 14.32e9, 2.69e9)],
    ids=["mixtral-8x7b", "qwen3-30b-a3b", "qwen1.5-moe-a2.7b"],
)
def test_mixture_of_experts_parameters_match_the_model_cards(config, total, active):
    # the cards: Mixtral 46.7B (12.9B per token), Qwen3 30.5B (3.3B activated), Qwen1.5-MoE 14.3B (2.7B)
    assert param_count(config) == pytest.approx(total, rel=2e-3)
    assert param_count(config, active=True) == pytest.approx(active, rel=2e-3)
    row = plan(config, ["bf16"])[0]
    assert row["active_params"] == param_count(config, active=True)
    # batch 1 reads the top-k experts; a full batch reads them all
    assert row["tpot_ms_batch1"] == pytest.approx(weight_bytes(config, "bf16", active=True) / 3.35e12 * 1e3)
    assert weight_bytes(config, "bf16", active=True) < weight_bytes(config, "bf16") / 2


def test_dense_layers_count_and_calibration_holds_one_sparse_block():
    from quantkit.perf.plan import calibration_plan

    # Qwen's mlp_only_layers are dense: their MLP is the intermediate_size one
    half = QWEN15_MOE_A27B | {"mlp_only_layers": list(range(12))}
    dense_mlp, expert = 3 * 5632 * 2048, 3 * 1408 * 2048
    routers = 60 * 2048 + 2048  # and the shared expert's gate
    assert param_count(QWEN15_MOE_A27B) - param_count(half) == 12 * (60 * expert + dense_mlp + routers - dense_mlp)
    r = calibration_plan(MIXTRAL_8X7B | {"torch_dtype": "bfloat16"}, "gptq", samples=128, seq_len=512)
    block_params = 2 * 4096**2 + 2 * 1024 * 4096 + 8 * 3 * 14336 * 4096 + 2 * 4096 + 8 * 4096  # all 8 experts, router
    assert r["breakdown"]["block_weights"] == block_params * (4 + 2)
    # each down_proj Hessian is 14336² fp32 (822 MB): one per pass, plus the three of the one being quantized
    assert r["breakdown"]["working_set"] == 4 * 14336**2 * 4 + 4 * 4096 * 14336 * 4
    assert 16 * 2**30 < r["host_peak_bytes"] < 17 * 2**30  # a 47B model (87 GiB in bf16): one block is 8.5 GB


def test_calibration_plan_reads_the_methods_cost_model_through_the_registry(monkeypatch):
    import dataclasses

    from quantkit.calibration import registry
    from quantkit.perf.plan import calibration_plan

    calls = []

    def cost(groups, tokens, group_size, sparse_input):
        calls.append((groups, tokens, group_size, sparse_input))
        return {"working_set": 1000, "flops": 0.0, "efficiency": 0.5}

    monkeypatch.setattr(sys.modules[__name__], "_cost", cost, raising=False)
    entry = dataclasses.replace(registry.METHODS["rtn"], plan=f"{__name__}:_cost")
    monkeypatch.setitem(registry.METHODS, "rtn", entry)
    r = calibration_plan(LLAMA2_7B, "rtn", samples=2, seq_len=8, group_size=64)
    assert r["breakdown"]["working_set"] == 1000 and r["method"] == "rtn"
    (groups, tokens, group_size, sparse_input), *_ = calls
    # the sequential groups of a Llama block: q/k/v, o, gate/up, down, each read by every token
    assert groups == [(4096, 3 * 4096, 1.0), (4096, 4096, 1.0), (4096, 2 * 11008, 1.0), (11008, 4096, 1.0)]
    assert (tokens, group_size, sparse_input) == (16, 64, 0)


def test_calibration_plan_counts_the_resume_state_and_the_extra_passes(monkeypatch):
    """The resume state: a block's inputs (fp32) per commit, at most one commit per
    COMMIT_SECONDS of calibration, none after the last block; the gradient pass and the
    sensitivity are counted apart and grow with the calibration tokens."""
    from quantkit.calibration.registry import GUIDED_ROWS
    from quantkit.perf.plan import calibration_plan
    from quantkit.pipeline import stream

    r = calibration_plan(LLAMA2_7B, "gptq", samples=128, seq_len=512, gflops=100.0)
    per_commit = 128 * 512 * 4096 * 4
    res = r["resume"]
    assert res["commit_bytes"] == per_commit and res["every_block"] == 31 * per_commit
    assert res["commits"] == min(31, math.ceil(r["seconds"] / stream.COMMIT_SECONDS))
    assert res["bytes"] == res["commits"] * per_commit
    monkeypatch.setattr(stream, "COMMIT_SECONDS", 0.0)  # a commit after every block but the last
    assert calibration_plan(LLAMA2_7B, "gptq", gflops=100.0)["resume"]["bytes"] == 31 * per_commit
    half = calibration_plan(LLAMA2_7B, "gptq", samples=64, seq_len=512, gflops=100.0)
    # the gradient pass takes the first GUIDED_ROWS rows: it grows with the rows up to them only
    few = [calibration_plan(LLAMA2_7B, "gptq", samples=n, seq_len=512, gflops=100.0) for n in (4, 8)]
    assert 0 < few[0]["gradient_pass"]["seconds"] < few[1]["gradient_pass"]["seconds"]
    assert [f["gradient_pass"]["rows"] for f in few] == [4, 8] and r["gradient_pass"]["rows"] == GUIDED_ROWS
    assert 0 < half["gradient_pass"]["seconds"]
    spill = 32 * GUIDED_ROWS * 512 * 4096 * 4
    assert r["gradient_pass"]["spill_bytes"] == half["gradient_pass"]["spill_bytes"] == spill
    assert r["sensitivity"]["seconds"] == half["sensitivity"]["seconds"] > 0  # its own windows, not the samples


def test_calibration_plan_counts_float_targets_for_dense_gptq_only():
    """--float-targets (GPTQ, dense models): the float block's passes and D beside each H,
    about as many FLOPs again as plain GPTQ's block step (measured: 1.65× its CPU time on
    smollm2-135m); a float copy of the block and the float stream in memory, the float
    stream in every resume commit."""
    from quantkit.perf.plan import calibration_plan

    r = calibration_plan(SMOLLM2_135M, "gptq", samples=64, seq_len=512, gflops=100.0)
    ft = r["float_targets"]
    assert 1.3 < (r["seconds"] + ft["seconds"]) / r["seconds"] < 2.2
    assert ft["commit_bytes"] == r["resume"]["commit_bytes"] == 64 * 512 * 576 * 4
    assert ft["host_bytes"] > r["breakdown"]["block_weights"]  # a float copy and the stream
    half = calibration_plan(SMOLLM2_135M, "gptq", samples=32, seq_len=512, gflops=100.0)["float_targets"]
    assert 0 < half["seconds"] < ft["seconds"]
    assert "float_targets" not in calibration_plan(SMOLLM2_135M, "awq", gflops=100.0)
    assert "float_targets" not in calibration_plan(MIXTRAL_8X7B, "gptq", gflops=100.0)  # refused on experts


def test_draft_plan_adds_the_drafts_weights_and_kv(tiny_llama, tmp_path):
    from conftest import make_tiny_model

    from quantkit.perf.plan import draft_plan

    target = model_config(str(tiny_llama))
    d = draft_plan(target, target, "w4a16")
    assert d["kv_ratio"] == 1.0 and d["draft_kv_bytes_per_token"] == kv_bytes_per_token(target)
    assert d["draft_weight_bytes"] == weight_bytes(target, "w4a16")
    other = model_config(str(make_tiny_model(tmp_path / "v16", vocab_size=16)))
    with pytest.raises(QuantkitError, match="a draft must share the target's vocabulary"):
        draft_plan(target, other)
