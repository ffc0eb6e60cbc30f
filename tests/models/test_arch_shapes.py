"""The architecture descriptions' linear shapes (`ArchSpec.shapes`, `block_shapes`), read
from config.json alone, against the modules of a tiny model of each family."""

from __future__ import annotations

import json

import pytest
from conftest import FAMILIES, make_family_model

from quantkit.models.arch import arch_for, block_shapes, get_module, sparse_layers
from quantkit.models.loading import open_float_model


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_block_shapes_are_the_models(tmp_path, family):
    path = make_family_model(tmp_path / family, family)
    config = json.loads((path / "config.json").read_text())
    model, *_ = open_float_model(str(path))
    spec = arch_for(model.config)
    sparse = sparse_layers(config)
    for i, block in enumerate(get_module(model, spec.blocks)):
        modules = {n: get_module(block, n) for n in spec.for_block(block).linears}
        assert block_shapes(spec, config, sparse[i]) == {n: (m.out_features, m.in_features) for n, m in modules.items()}
    assert any(sparse) == (spec.moe is not None)
