"""KV-cache scales through the pipeline (--kv-cache) and the `kv` command."""

import json

import pytest
import torch

import quantkit
from quantkit.calibration.kv import kv_args
from quantkit.errors import QuantkitError
from quantkit.formats.checkpoint import read_tensors
from quantkit.pipeline.kv import add_kv_scales
from quantkit.pipeline.quantize import Calibration, quantize
from quantkit.scheme import preset

IDS = torch.randint(0, 320, (2, 16), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def int4(tiny_llama, tmp_path_factory):
    out = tmp_path_factory.mktemp("kv") / "int4"
    quantize(str(tiny_llama), preset("w4a16").with_group_size(32), out)
    return out


@pytest.mark.parametrize("dtype,per_head", [("fp8", False), ("int8", True)])
def test_pipeline_scales_equal_the_kv_command_on_the_same_checkpoint(
    tiny_llama, tiny_corpus, int4, tmp_path, dtype, per_head
):
    """The runner records K/V on its pass over each quantized block; the kv command runs the
    finished checkpoint end to end. Both see the same keys and values."""
    calib = Calibration(str(tiny_corpus), 4, 32)
    args = kv_args(dtype, per_head)
    quantize(
        str(tiny_llama), preset("w4a16").with_group_size(32).replace(kv_cache=args), tmp_path / "a", calibration=calib
    )
    add_kv_scales(str(int4), args, tmp_path / "b", calib)
    a, b = read_tensors(tmp_path / "a"), read_tensors(tmp_path / "b")
    assert set(a) == set(b)
    for layer in range(2):
        for name in ("k_scale", "v_scale"):
            key = f"model.layers.{layer}.self_attn.{name}"
            assert a[key].dtype == torch.float32 and a[key].shape == ((2,) if per_head else (1,))
            torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=0)
    qc = json.loads((tmp_path / "a" / "config.json").read_text())["quantization_config"]
    assert qc["kv_cache_scheme"]["type"] == ("float" if dtype == "fp8" else "int")
    assert qc["kv_cache_scheme"]["strategy"] == ("attn_head" if per_head else "tensor")


def test_kv_command_leaves_weights_identical(int4, tiny_corpus, tmp_path):
    add_kv_scales(str(int4), kv_args("fp8"), tmp_path / "kv", Calibration(str(tiny_corpus), 4, 32))
    before, after = read_tensors(int4), read_tensors(tmp_path / "kv")
    assert sorted(set(after) - set(before)) == [
        f"model.layers.{i}.self_attn.{n}" for i in range(2) for n in ("k_scale", "v_scale")
    ]
    for key, t in before.items():
        assert after[key].dtype == t.dtype and after[key].view(torch.uint8).equal(t.view(torch.uint8)), key
    cfg_before = json.loads((int4 / "config.json").read_text())["quantization_config"]
    cfg_after = json.loads((tmp_path / "kv" / "config.json").read_text())["quantization_config"]
    assert {k: v for k, v in cfg_after.items() if k != "kv_cache_scheme"} == {
        k: v for k, v in cfg_before.items() if k != "kv_cache_scheme"
    }


def test_loaded_checkpoint_quantizes_kv(int4, tiny_corpus, tmp_path):
    add_kv_scales(str(int4), kv_args("int8"), tmp_path / "kv", Calibration(str(tiny_corpus), 4, 32))
    plain, with_kv = quantkit.load(int4), quantkit.load(tmp_path / "kv")
    with torch.no_grad():
        a, b = plain(IDS).logits, with_kv(IDS).logits
    assert not torch.equal(a, b)
    assert (a - b).pow(2).mean() < 0.01 * a.pow(2).mean()  # int8 KV is a small change


def test_float_model_gets_a_dense_kv_checkpoint(tiny_llama, tiny_corpus, tmp_path):
    add_kv_scales(str(tiny_llama), kv_args("fp8"), tmp_path / "kv", Calibration(str(tiny_corpus), 4, 32))
    qc = json.loads((tmp_path / "kv" / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "dense" and qc["config_groups"] == {} and qc["kv_cache_scheme"]["num_bits"] == 8
    model = quantkit.load(tmp_path / "kv")
    assert model.model.layers[1].self_attn.k_scale.shape == (1,)


def test_kv_bad_input(int4, tiny_corpus, tmp_path):
    calib = Calibration(str(tiny_corpus), 4, 32)
    add_kv_scales(str(int4), kv_args("fp8"), tmp_path / "kv", calib)
    with pytest.raises(QuantkitError, match="already has KV-cache scales; pass --overwrite"):
        add_kv_scales(str(tmp_path / "kv"), kv_args("fp8"), tmp_path / "kv2", calib)
    add_kv_scales(str(tmp_path / "kv"), kv_args("int8"), tmp_path / "kv2", calib, overwrite=True)
    with pytest.raises(QuantkitError, match="KV-cache type 'int4' is unknown"):
        kv_args("int4")
    assert not (tmp_path / "kv3").exists()
