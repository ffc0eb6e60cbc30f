import pytest
from compressed_tensors.quantization import QuantizationConfig

from quantkit.errors import QuantkitError
from quantkit.scheme import PRESETS, QuantArgs, from_quantization_config, preset, to_quantization_config


@pytest.mark.parametrize("name", list(PRESETS))
def test_presets_round_trip_through_quantization_config(name):
    scheme = PRESETS[name]
    qc = to_quantization_config(scheme)
    parsed = from_quantization_config(qc)
    assert parsed.format == scheme.format
    assert parsed.kv_cache == scheme.kv_cache
    if scheme.weights is not None:
        (got,) = parsed.schemes
        assert got.weights == scheme.weights
        assert got.input_activations == scheme.input_activations


@pytest.mark.parametrize("name", list(PRESETS))
def test_compressed_tensors_accepts_our_config(name):
    qc = to_quantization_config(PRESETS[name])
    parsed = QuantizationConfig.model_validate(qc)
    assert parsed.format == PRESETS[name].format
    for group in parsed.config_groups.values():
        assert group.weights.num_bits == PRESETS[name].weights.num_bits


def test_preset_formats():
    assert preset("w4a16").format == "pack-quantized"
    assert preset("w4a16-asym").weights.symmetric is False
    assert preset("fp8-dynamic").format == "float-quantized"
    assert preset("fp8-dynamic").input_activations.dynamic is True
    assert preset("kv-int8").kv_cache.type == "int"


def test_group_size_and_ignore():
    s = preset("w4a16").with_group_size(64)
    assert s.weights.group_size == 64 and preset("w4a16").weights.group_size == 128
    assert s.is_ignored("lm_head") and not s.is_ignored("model.layers.0.mlp.up_proj")
    assert s.replace(ignore=("re:.*mlp.*",)).is_ignored("model.layers.0.mlp.up_proj")
    with pytest.raises(QuantkitError, match="no groups"):
        preset("fp8").with_group_size(64)


def test_bad_input_is_one_sentence():
    with pytest.raises(QuantkitError, match="unknown scheme 'w3'; use one of: w4a16"):
        preset("w3")
    with pytest.raises(QuantkitError, match="strategy"):
        QuantArgs(strategy="rows")
    with pytest.raises(QuantkitError, match="quant_method 'gptq'"):
        from_quantization_config({"quant_method": "gptq"})


def test_reads_another_tools_config():
    qc = {  # as llm-compressor writes it, with extra keys we ignore
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "format": "pack-quantized",
                "weights": {
                    "num_bits": 4,
                    "type": "int",
                    "symmetric": True,
                    "strategy": "group",
                    "group_size": 128,
                    "dynamic": False,
                    "actorder": "weight",
                    "observer": "mse",
                    "scale_dtype": None,
                },
            }
        },
        "ignore": ["lm_head", "re:.*gate$"],
        "kv_cache_scheme": None,
        "version": "0.12.2",
    }
    ckpt = from_quantization_config(qc)
    assert ckpt.scheme_for("model.layers.0.self_attn.q_proj").weights.group_size == 128
    assert ckpt.scheme_for("lm_head") is None
    assert ckpt.scheme_for("model.layers.0.mlp.gate") is None
    assert ckpt.schemes[0].weights.actorder == "weight"


def test_a_fitted_w4afp8_group_says_vllm_will_not_load_it():
    """vLLM's W4A8Fp8 kernel takes group 128 only: a w4afp8 group fitted below it says so;
    a w4a16 one does not (vLLM's WNA16 kernels take any group)."""
    from quantkit.scheme import fit_group_size

    widths = {"model.layers.0.mlp.down_proj": 576}
    for name, warned in (("w4afp8", True), ("w4a16", False)):
        scheme, notes = fit_group_size(preset(name).replace(auto_group_size=True), widths)
        assert scheme.weights.group_size == 64 and len(notes) == 1
        assert ("vLLM will not load this checkpoint" in notes[0]) == warned
