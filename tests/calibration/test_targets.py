"""GPTQ's float targets (GPTAQ): the target weights against the least-squares formula, the paired
statistics against their formula on a real block, and `gptq --float-targets` end to end."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from quantkit.calibration import targets
from quantkit.calibration.hooks import capture_inputs
from quantkit.calibration.runner import BlockInputs, capture_block_inputs
from quantkit.errors import QuantkitError
from quantkit.models.arch import arch_for
from quantkit.pipeline.quantize import Calibration, quantize
from quantkit.scheme import preset

torch.set_num_threads(1)


def stats(X, Xf):
    """H and D of tokens as rows: X the quantized model's inputs, Xf the float model's."""
    n = X.shape[0]
    return 2 / n * X.T @ X, 2 / n * (Xf - X).T @ X


def test_float_weights_are_the_least_squares_fit_of_the_float_outputs():
    """Undampened, W* = argmin_Q ‖W·X̃ − Q·X‖ (torch.linalg.lstsq, in float64), and the error
    of any Q splits into W*'s own error plus ‖(W* − Q)·X‖² (the identity that lets GPTQ round W*)."""
    g = torch.Generator().manual_seed(0)
    X = torch.randn(500, 12, generator=g, dtype=torch.float64) * torch.linspace(0.2, 3, 12, dtype=torch.float64)
    Xf = X + 0.1 * torch.randn(500, 12, generator=g, dtype=torch.float64) + 0.05 * X.roll(1, 1)
    W = torch.randn(7, 12, generator=g, dtype=torch.float64)
    H, D = stats(X, Xf)
    got = targets.float_weights(W, H, D, damp=0.0)
    want = torch.linalg.lstsq(X, Xf @ W.T).solution.T  # min ‖X·Qᵀ − X̃·Wᵀ‖
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
    Q = W + 0.3 * torch.randn(7, 12, generator=g, dtype=torch.float64)
    total = (Xf @ W.T - X @ Q.T).square().sum()
    split = (Xf @ W.T - X @ got.T).square().sum() + (X @ (got - Q).T).square().sum()
    torch.testing.assert_close(total, split, rtol=1e-9, atol=0)


def test_float_weights_keep_w_where_the_inputs_agree():
    """D = 0 (the float and the quantized model feed the linear alike): W* is W, bit for bit,
    with GPTQ's damping in place; all-zero inputs leave W too."""
    g = torch.Generator().manual_seed(1)
    X, W = torch.randn(300, 16, generator=g), torch.randn(8, 16, generator=g)
    H, D = stats(X, X)
    assert torch.equal(targets.float_weights(W, H, D, damp=0.05), W)
    zeros = torch.zeros(16, 16)
    assert torch.equal(targets.float_weights(W, zeros, zeros, damp=0.05), W)


def test_float_weights_with_damping_are_the_ridge_fit():
    """Dampened by λ = damp·mean(diag H): W* = W + W·D·(H + λI)⁻¹, the float64 formula, in fp32."""
    g = torch.Generator().manual_seed(2)
    X = torch.randn(400, 10, generator=g)
    Xf = X + 0.2 * torch.randn(400, 10, generator=g)
    W = torch.randn(5, 10, generator=g)
    H, D = stats(X, Xf)
    lam = 0.05 * H.diagonal().mean()
    want = W.double() + W.double() @ D.double() @ torch.linalg.inv(H.double() + lam.double() * torch.eye(10).double())
    torch.testing.assert_close(targets.float_weights(W, H, D, damp=0.05), want.float(), rtol=1e-5, atol=1e-5)


def test_paired_statistics_of_a_block_are_their_formula(tmp_path):
    """`reduce_paired` on a real block (the quantized one with changed weights, the float one on
    other hidden states): H and D equal the formula on each block's captured linear inputs."""
    from conftest import make_tiny_model

    model = AutoModelForCausalLM.from_pretrained(make_tiny_model(tmp_path / "m")).eval()
    spec = arch_for(model.config)
    samples = torch.randint(0, 320, (6, 16), generator=torch.Generator().manual_seed(0))
    hidden, kwargs = capture_block_inputs(model, spec, samples, 3, torch.device("cpu"))
    block = model.model.layers[0]
    import copy

    float_block = copy.deepcopy(block)
    with torch.no_grad():
        block.self_attn.o_proj.weight.mul_(1.3)  # the quantized block: its o changed, so down's inputs differ
        block.self_attn.q_proj.weight.add_(0.05)
    float_hidden = [h + 0.1 * torch.randn_like(h) for h in hidden]
    names = ["self_attn.q_proj", "mlp.down_proj"]
    for name in names:  # one linear at a time, and both in one pass below
        got = targets.reduce_paired(block, float_block, [name], BlockInputs(hidden, kwargs[0]), float_hidden)
        assert list(got) == [name]
    both = targets.reduce_paired(block, float_block, names, BlockInputs(hidden, kwargs[0]), float_hidden)
    for name in names:
        module = dict(block.named_modules())[name]
        x = capture_inputs(block, {name: module}, BlockInputs(hidden, kwargs[0]), 10**9)[name].double()
        fmodule = dict(float_block.named_modules())[name]
        xf = capture_inputs(float_block, {name: fmodule}, BlockInputs(float_hidden, kwargs[0]), 10**9)[name].double()
        H, D = stats(x, xf)
        assert D.abs().max() > 1e-3  # the two blocks do differ there
        torch.testing.assert_close(both[name][0].double(), H, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(both[name][1].double(), D, rtol=1e-5, atol=1e-6)


@pytest.fixture
def src(tmp_path):
    from conftest import make_tiny_model

    return make_tiny_model(tmp_path / "src", num_hidden_layers=3)


def weights(out):
    from safetensors.torch import load_file

    return {k: v for f in sorted(out.glob("*.safetensors")) for k, v in load_file(f).items()}


def test_gptq_with_float_targets_end_to_end(tmp_path, src, tiny_corpus):
    """Block 0's q/k/v see the same inputs in both models (D = 0), so they are plain GPTQ's;
    every later group differs; the checkpoint loads and its provenance names the option."""
    s = preset("w4a16-asym").with_group_size(32)
    c = Calibration(str(tiny_corpus), 8, 32, 0, 4)
    quantize(str(src), s, tmp_path / "plain", "gptq", c)
    prov = quantize(str(src), s, tmp_path / "float", "gptq", c, {"float_targets": True})
    assert prov["options"]["float_targets"] is True
    a, b = weights(tmp_path / "plain"), weights(tmp_path / "float")
    assert a.keys() == b.keys()
    for proj in ("q", "k", "v"):
        for part in ("weight_packed", "weight_scale", "weight_zero_point"):
            key = f"model.layers.0.self_attn.{proj}_proj.{part}"
            assert torch.equal(a[key], b[key]), key
    for name in ("model.layers.0.self_attn.o_proj", "model.layers.0.mlp.down_proj", "model.layers.2.mlp.up_proj"):
        assert not torch.equal(a[f"{name}.weight_packed"], b[f"{name}.weight_packed"]), name


def test_float_targets_refuse_guided_and_experts(tmp_path, tiny_corpus):
    from conftest import make_family_model, make_tiny_model

    c = Calibration(str(tiny_corpus), 4, 32, 0, 4)
    s = preset("w4a16-asym").with_group_size(32)
    dense = make_tiny_model(tmp_path / "dense")
    with pytest.raises(QuantkitError, match="--float-targets and --guided cannot be combined yet; drop one"):
        quantize(str(dense), s, tmp_path / "a", "gptq", c, {"float_targets": True, "guided": 2})
    moe = make_family_model(tmp_path / "moe", "qwen3-moe")
    with pytest.raises(QuantkitError, match="--float-targets is for dense models"):
        quantize(str(moe), s, tmp_path / "b", "gptq", c, {"float_targets": True})
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
