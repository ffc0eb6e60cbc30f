import json

import pytest
import torch

import quantkit
from quantkit.errors import QuantkitError
from quantkit.pipeline.quantize import quantize
from quantkit.scheme import preset


@pytest.fixture(scope="module")
def checkpoint(tiny_llama, tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt") / "q"
    quantize(str(tiny_llama), preset("w4a16-asym").with_group_size(32), out)
    return out


def test_float_model_loads_through_transformers(tiny_llama):
    model = quantkit.load(tiny_llama)
    assert type(model.model.layers[0].mlp.up_proj) is torch.nn.Linear
    assert not model.training


def test_no_parameter_left_on_meta(checkpoint):
    model = quantkit.load(checkpoint)
    assert all(t.device.type == "cpu" for t in [*model.parameters(), *model.buffers()])


def test_truncated_checkpoint(checkpoint, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(checkpoint, bad)
    f = bad / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(QuantkitError, match="unreadable or truncated"):
        quantkit.load(bad)


def test_missing_tensors(checkpoint, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad"
    shutil.copytree(checkpoint, bad)
    tensors = load_file(bad / "model.safetensors")
    tensors.pop("model.layers.1.mlp.down_proj.weight_scale")
    save_file(tensors, bad / "model.safetensors")
    with pytest.raises(QuantkitError, match="lacks .*down_proj.weight_scale"):
        quantkit.load(bad)


def test_other_formats_are_refused_by_name(checkpoint, tmp_path):
    import shutil

    other = tmp_path / "awq"
    shutil.copytree(checkpoint, other)
    config = json.loads((other / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        QuantkitError, match="'bitsandbytes' checkpoint .* quantkit loads compressed-tensors pack-quantized"
    ):
        quantkit.load(other)


def test_fp32_on_cpu_takes_the_avx_int4_kernel(checkpoint):
    """fp32 activations (what the engine runs on CPUs without native bf16) take the AVX2/AVX-512
    kernel where it runs; its logits equal the twin's within fp32 summation order."""
    from quantkit.kernels.int4 import avx
    from quantkit.runtime.qlinear import PackedInt4Linear

    if avx.choose_isa()[0] is None:
        pytest.skip(f"the AVX int4 kernel does not run here: {avx.choose_isa()[1]}")
    model = quantkit.load(checkpoint)
    ids = torch.randint(0, 320, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        fast = model(ids).logits
        linears = [m for m in model.modules() if isinstance(m, PackedInt4Linear)]
        assert linears and all(m.kernel.name == "int4 AVX2/AVX-512 (quantkit C++)" for m in linears)
        assert "it takes bfloat16" in linears[0].kernel.why  # the AMX kernel, passed over
        for m in linears:
            m.prepare(torch.float32, "cpu", backend="torch")
        torch.testing.assert_close(fast, model(ids).logits, rtol=1e-4, atol=1e-4)


def test_bf16_on_cpu_takes_a_cpu_int4_kernel(checkpoint):
    from quantkit.kernels.int4.cpp import Int4Weight

    model = quantkit.load(checkpoint)
    ids = torch.randint(0, 320, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(ids).logits
        model.to(torch.bfloat16)
        fast = model(ids).logits.float()
    up = model.model.layers[0].mlp.up_proj
    assert up.kernel.name in ("int4 AMX (quantkit C++)", "int4pack (torch CPU)")
    assert isinstance(up.runtime_weight, Int4Weight) and (up.kernel.why is None) == (up.runtime_weight.kernel == "amx")
    # bf16 activations and scales against the fp32 twin: a bf16-sized difference, no more
    assert (fast - ref).pow(2).mean().sqrt() < 0.03 * ref.pow(2).mean().sqrt()


@pytest.mark.parametrize("method", ["rtn", "gptq", "awq"])
def test_int8_per_channel_weights_load_as_transformers_reads_them(tiny_llama, tiny_corpus, tmp_path, method):
    from transformers import AutoModelForCausalLM

    from quantkit.calibration.method import Calibration
    from quantkit.kernels.int4 import avx
    from quantkit.runtime.qlinear import PackedInt8Linear

    quantize(str(tiny_llama), preset("w8a16"), tmp_path / "q", method, Calibration(str(tiny_corpus), 4, 32))
    ids = torch.randint(0, 320, (2, 12), generator=torch.Generator().manual_seed(0))
    ours = quantkit.load(tmp_path / "q")
    with torch.no_grad():
        theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "q").eval()(ids).logits  # compressed-tensors
        torch.testing.assert_close(ours(ids).logits, theirs, rtol=1e-5, atol=1e-5)
        down = ours.model.layers[0].mlp.down_proj
        # fp32 activations: the AVX kernel where it runs, else torch's int8-weight GEMM
        fast = "int8 AVX2/AVX-512 (quantkit C++)" if avx.choose_isa()[0] else "int8pack (torch CPU)"
        assert isinstance(down, PackedInt8Linear) and down.kernel.name == fast
        # the dequantize-once path (other devices, other layouts) computes the same
        x = torch.randn(3, down.in_features)
        fast = down(x)
        with pytest.MonkeyPatch.context() as m:
            m.setattr("quantkit.kernels.int8.int8pack.int8_unsupported", lambda *_: "not here")
            m.setattr("quantkit.kernels.int4.avx.choose_isa", lambda isa=None: (None, "no AVX"))
            kernel = down.prepare(x.dtype, "cpu")
            why = "int8 AVX2/AVX-512 (quantkit C++): no AVX; int8pack (torch CPU): not here"
            assert (kernel.name, kernel.why) == ("dequantized once (F.linear)", why)
        torch.testing.assert_close(down(x), fast, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "saved, native, runs",
    [
        (torch.float32, True, torch.bfloat16),
        (torch.float32, False, torch.float32),
        (torch.float16, True, torch.bfloat16),
        (torch.float16, False, torch.float32),
        (torch.bfloat16, True, torch.bfloat16),
        (torch.bfloat16, False, torch.bfloat16),
    ],
)
def test_auto_dtype_follows_vllm(monkeypatch, saved, native, runs):
    from types import SimpleNamespace

    from quantkit.runtime.loader import serving_dtype

    monkeypatch.setattr("quantkit.kernels.cpu.native_bf16", lambda: native)
    dtype, note = serving_dtype(SimpleNamespace(dtype=saved), None)
    assert dtype == runs
    assert (note is None) == (runs == saved)
    if note:
        assert str(saved).removeprefix("torch.") in note and "--dtype" in note
    assert serving_dtype(SimpleNamespace(dtype=saved), torch.float16) == (torch.float16, None)  # asked for: kept


def test_engine_runs_auto_in_bf16_and_says_so(monkeypatch, tiny_llama):
    from quantkit.runtime.engine import LLM

    monkeypatch.setattr("quantkit.kernels.cpu.native_bf16", lambda: True)
    llm = LLM(str(tiny_llama), block_size=16, num_blocks=16)
    assert llm.runner.dtype == torch.bfloat16
    assert any("runs in bfloat16" in n for n in llm.notes)
    assert LLM(str(tiny_llama), dtype="float32", block_size=16, num_blocks=16).runner.dtype == torch.float32
    with pytest.raises(QuantkitError, match="dtype 'fp7' is unknown"):
        LLM(str(tiny_llama), dtype="fp7", block_size=16, num_blocks=16)
