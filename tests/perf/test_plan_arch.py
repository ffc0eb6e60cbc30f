"""`plan` sizes a model from its config.json through the family's description
(`models/arch.py`) and the formats' byte counts (`formats/stored.py`): against a tiny model
of the family built from that config (its linears) and against the checkpoint quantkit
writes of it (every byte), for fused projections (Phi-3) and mixtures of experts."""

from __future__ import annotations

import collections
import json

import pytest
import torch
from conftest import FAMILIES, make_tiny_model

from quantkit.formats.checkpoint import read_tensors
from quantkit.models.arch import arch_for, get_module
from quantkit.models.loading import open_float_model
from quantkit.perf.plan import block_linears, param_count, weight_bytes
from quantkit.pipeline.quantize import quantize
from quantkit.scheme import preset

# widths that group 128 divides, so w4a16's preset quantizes every linear as `plan` assumes
WIDE = {"hidden_size": 128, "intermediate_size": 256, "dtype": torch.bfloat16}
MOE_WIDE = {"moe_intermediate_size": 128, "shared_expert_intermediate_size": 128}


def tiny(tmp_path, family):
    model_type, overrides = FAMILIES[family]
    overrides = overrides | {k: v for k, v in MOE_WIDE.items() if k in overrides}
    path = make_tiny_model(tmp_path / family, model_type, **overrides, **WIDE)
    return path, json.loads((path / "config.json").read_text())


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_block_linears_are_the_models(tmp_path, family):
    path, config = tiny(tmp_path, family)
    model, *_ = open_float_model(str(path))
    spec = arch_for(model.config)
    found = collections.Counter()
    for block in get_module(model, spec.blocks):
        for name in spec.for_block(block).linears:
            m = get_module(block, name)
            found[m.out_features, m.in_features] += 1
    assert {(o, i): n for o, i, n, _ in block_linears(config)} == dict(found)
    assert param_count(config) == sum(p.numel() for p in model.parameters())
    if family == "phi3":  # the fused projections: q, k, v in one, gate and up in one
        heads, kv_heads, hd = config["num_attention_heads"], config["num_key_value_heads"], 128 // 4
        assert found[(heads + 2 * kv_heads) * hd, 128] == found[2 * 256, 128] == config["num_hidden_layers"]


@pytest.mark.parametrize("family", ["phi3", "qwen2-moe"])
@pytest.mark.parametrize("scheme", ["w4a16", "fp8-dynamic"])
def test_weight_bytes_are_the_checkpoints(tmp_path, family, scheme):
    path, config = tiny(tmp_path, family)
    quantize(str(path), preset(scheme), tmp_path / "q", "rtn" if scheme == "w4a16" else "fp8")
    written = sum(t.numel() * t.element_size() for t in read_tensors(tmp_path / "q").values())
    assert weight_bytes(config, scheme) == written
