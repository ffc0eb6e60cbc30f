"""Loss-guided Hessians: the streaming backward pass against autograd on the whole model, the
weighted Hessian against its formula, GPTQ with them against plain GPTQ, and the commands."""

import json

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

import quantkit
from quantkit.calibration import guided
from quantkit.calibration.gptq import quantize_weight
from quantkit.calibration.registry import METHODS
from quantkit.calibration.runner import run_blocks
from quantkit.errors import QuantkitError
from quantkit.models.arch import arch_for
from quantkit.pipeline.quantize import Calibration, quantize
from quantkit.scheme import preset

torch.set_num_threads(1)


def ids(n=6, seq=24, seed=0):
    return torch.randint(0, 320, (n, seq), generator=torch.Generator().manual_seed(seed))


def whole_model_weights(model, samples, groups, names):
    """The twin: one autograd pass through the whole model, output gradients kept by hooks."""
    grads = {n: [] for n in names}
    modules = dict(model.named_modules())

    def keep(name):
        def hook(module, args, out):
            out.register_hook(lambda g: grads[name].append(g))  # returns None: the output stays

        return hook

    hooks = [modules[n].register_forward_hook(keep(n)) for n in names]
    logits = model(samples).logits
    logits, labels = logits[:, :-1].reshape(-1, logits.shape[-1]), samples[:, 1:].reshape(-1)
    loss = nn.functional.cross_entropy(logits, labels, reduction="sum")
    loss.backward()
    for h in hooks:
        h.remove()
    out = {}
    for n, (g,) in grads.items():
        g2 = g.reshape(-1, g.shape[-1]).square()
        b = guided.group_bounds(g.shape[-1], groups)
        w = torch.stack([g2[:, b[k] : b[k + 1]].mean(-1) for k in range(groups)], -1)
        out[n] = w / w.mean(0)
    return out


@pytest.mark.parametrize("tie", [False, True])
def test_block_by_block_gradients_equal_autograd_on_the_whole_model(tmp_path, tie):
    from conftest import make_tiny_model

    model = AutoModelForCausalLM.from_pretrained(make_tiny_model(tmp_path / "m", tie=tie)).eval()
    spec = arch_for(model.config)
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and ".layers." in n]
    samples = ids()
    got = guided.loss_gradients(model, spec, samples, 3, names, batch_size=4, spill=tmp_path)
    want = whole_model_weights(model, samples, 3, names)
    assert set(got) == set(names)
    for n in names:
        assert got[n].shape == (samples.numel(), 3)
        torch.testing.assert_close(got[n], want[n], rtol=1e-4, atol=1e-6)  # fp32 sums in another order
    assert not list(tmp_path.glob("quantkit-gradients-*"))  # the block inputs kept on disk are gone


@pytest.mark.parametrize("tie", [False, True])
def test_fisher_gradients_equal_autograd_on_the_whole_model(tmp_path, tie):
    """∇ log p(y|h) at every block's output, labels drawn from the model row by row with the
    same generator: the streaming pass against one autograd pass through the whole model."""
    from conftest import make_tiny_model

    model = AutoModelForCausalLM.from_pretrained(make_tiny_model(tmp_path / "m", tie=tie)).eval()
    spec = arch_for(model.config)
    samples, draws = ids(), 3
    got = guided.fisher_gradients(model, spec, samples, draws, seed=5, batch_size=4, spill=tmp_path)
    outs = []

    def keep(module, args, out):
        outs.append(out[0] if isinstance(out, tuple) else out)

    hooks = [b.register_forward_hook(keep) for b in model.model.layers]
    logp = model(samples).logits.float().log_softmax(-1)  # [rows, seq, vocab]
    for h in hooks:
        h.remove()
    generator = torch.Generator().manual_seed(5)
    y = torch.stack([torch.multinomial(r.detach().exp(), draws, replacement=True, generator=generator) for r in logp])
    picked = logp.gather(-1, y)  # [rows, seq, draws]
    want = [torch.autograd.grad(picked[..., d].sum(), outs, retain_graph=True) for d in range(draws)]
    assert len(got) == len(outs)
    for i, per_batch in enumerate(got):
        g = torch.cat(per_batch, 1)  # [draws, rows, seq, hidden]
        assert g.shape == (draws, *outs[i].shape)
        # fp32 sums in another order; 1e-4 of the largest gradient
        torch.testing.assert_close(g, torch.stack([w[i] for w in want]), rtol=1e-4, atol=1e-4 * g.abs().max().item())
    assert not list(tmp_path.glob("quantkit-gradients-*"))


def test_weighted_hessian_is_the_formula_over_batches():
    torch.manual_seed(0)
    x = [torch.randn(2, 5, 8), torch.randn(3, 5, 8)]
    w = [torch.rand(25, 2), torch.rand(25, 2)]
    add, state, n = guided.hessians(w), None, 0
    for chunk in x:
        state, n = add(state, chunk, n)
    X = torch.cat([c.reshape(-1, 8) for c in x]).double()
    for wl, hs in zip(w, state):
        for k, H in enumerate(hs):
            want = 2 / 25 * (X.T * wl[:, k].double()) @ X
            torch.testing.assert_close(H.double(), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("width", [3, 13, 64])
def test_weighted_gram_by_upper_blocks_is_addmm(width):
    """`add_weighted_gram` multiplies only the blocks on and above the diagonal and mirrors the
    rest: the same H as its reference `mul_(beta).addmm_(x.T * w, x, alpha)` up to fp32 sums
    of another shape, widths that the blocks do not divide included (3 < GRAM_BLOCKS)."""
    torch.manual_seed(0)
    x, w = torch.randn(200, width), torch.rand(200)
    H = torch.randn(width, width)
    H = H + H.T
    want = H.clone().mul_(0.25).addmm_(x.T * w, x, alpha=0.75)
    guided.add_weighted_gram(H, x, w, 0.25, 0.75)
    torch.testing.assert_close(H, want, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(H, H.T, rtol=1e-5, atol=1e-4)


def test_gptq_under_a_guided_hessian_lowers_the_guided_error():
    """Rows quantized under the Hessian of tokens weighted like the loss's: their weighted
    output error is lower than GPTQ's under the plain Hessian (same grid, same options)."""
    torch.manual_seed(0)
    args = preset("w4a16-asym").with_group_size(32).weights
    X = torch.randn(2048, 64) * (torch.rand(64) + 0.3)
    X[:200, :16] *= 4  # tokens with another covariance...
    W = torch.randn(16, 64)
    w = torch.ones(2048)
    w[:200] = 20  # ...carry most of the loss
    H_plain = 2 * X.T @ X / 2048
    H_guided = 2 * (X.T * w) @ X / 2048
    plain = quantize_weight(W, H_plain, args, damp=0.01, actorder="static").weight
    guided_q = quantize_weight(W, H_guided, args, damp=0.01, actorder="static").weight

    def err(Q):
        D = W - Q
        return ((D @ H_guided) * D).sum().item()

    assert err(guided_q) < 0.9 * err(plain)  # measured 0.87


def test_guided_gptq_with_uniform_gradients_is_plain_gptq(tiny_llama):
    """With every token's weight 1, each group's Hessian is the plain one: the same weights."""
    scheme = preset("w4a16").with_group_size(32)

    def run(options, guides=None):
        model = AutoModelForCausalLM.from_pretrained(tiny_llama).eval()
        spec = arch_for(model.config)
        results, method = {}, METHODS["gptq"]
        step = method.make_step(spec, scheme, method.options(**options), results, torch.float32)
        run_blocks(model, spec, step, ids(8, 32), batch_size=4, guides=guides)
        return model, results

    plain, plain_qp = run({})
    names = [n for n, m in plain.named_modules() if isinstance(m, nn.Linear) and ".layers." in n]
    ones = {n: torch.ones(8 * 32, 2) for n in names}
    model, qp = run({"guided": 2}, ones)
    float_model = AutoModelForCausalLM.from_pretrained(tiny_llama).eval()
    inputs = {}
    for n in names:  # each linear's inputs in the float model, to score both roundings on
        hook = lambda m, args, out, n=n: inputs.__setitem__(n, args[0].reshape(-1, args[0].shape[-1]))  # noqa: E731
        float_model.get_submodule(n).register_forward_hook(hook)
    with torch.no_grad():
        float_model(ids(8, 32))
    for n in names:
        w, x = float_model.get_submodule(n).weight, inputs[n]
        a, b = plain.get_submodule(n).weight, model.get_submodule(n).weight
        # The guided Hessians sum the same products in another order (column blocks), so a
        # rounding tie may fall the other way and GPTQ's error feedback carries it along the
        # row: how many weights stay equal depends on the CPU's fp32 sums (99.5%+ with AVX-512,
        # 57% of one down_proj with MKL capped at AVX2). Both are GPTQ's answer to the same
        # Hessian, so their output errors agree (measured: within 1.2e-7 on both).
        err_a, err_b = ((a - w) @ x.T).norm(), ((b - w) @ x.T).norm()
        assert abs(err_b / err_a - 1) < 1e-3, (n, err_a, err_b)
        assert qp[n].scale.shape == plain_qp[n].scale.shape


@pytest.mark.parametrize("algorithm, options", [("gptq", {"guided": 2}), ("awq", {"gptq": True, "guided": 2})])
def test_guided_checkpoint_records_it_and_loads(tiny_llama, tiny_corpus, tmp_path, algorithm, options):
    out = tmp_path / "q"
    calib = Calibration(str(tiny_corpus), 4, 32, 0)
    prov = quantize(str(tiny_llama), preset("w4a16").with_group_size(32), out, algorithm, calib, options)
    assert prov["options"]["guided"] == 2
    assert json.loads((out / "quantkit.json").read_text())["options"]["guided"] == 2
    model = AutoModelForCausalLM.from_pretrained(out)  # compressed-tensors decompresses it
    with torch.no_grad():
        assert torch.isfinite(model(ids(1, 16)).logits).all()


def test_guided_refusals(tiny_llama, tiny_corpus, tmp_path):
    from conftest import make_family_model

    calib = Calibration(str(tiny_corpus), 4, 32, 0)
    scheme = preset("w4a16").with_group_size(32)
    with pytest.raises(QuantkitError, match="goes with --gptq"):
        quantize(str(tiny_llama), scheme, tmp_path / "a", "awq", calib, {"guided": 2})
    grouped = scheme.replace(weights=scheme.weights.__class__(**{**scheme.weights.__dict__, "actorder": "group"}))
    with pytest.raises(QuantkitError, match="act-order group"):
        quantize(str(tiny_llama), grouped, tmp_path / "b", "gptq", calib, {"guided": 2})
    moe = make_family_model(tmp_path / "moe", "mixtral")
    with pytest.raises(QuantkitError, match="dense models"):
        quantize(str(moe), scheme, tmp_path / "c", "gptq", calib, {"guided": 2})
    assert not any((tmp_path / d).exists() for d in ("a", "b", "c"))


def test_guided_fp8_blocks_keep_one_scale_per_block(tiny_llama, tiny_corpus, tmp_path):
    # guided row groups cut the 128-row blocks that share a scale: each group is quantized under
    # the float weight's block scales (before: each group took its own, and gemma3-270m scored
    # wiki 57.5 against float 28.7)
    from safetensors.torch import load_file

    from quantkit.primitives import dequantize

    out = tmp_path / "q"
    calib = Calibration(str(tiny_corpus), 4, 32, 0)
    quantize(str(tiny_llama), preset("fp8-block"), out, "gptq", calib, {"guided": 3})
    tensors = load_file(out / "model.safetensors")
    args = preset("fp8-block").weights
    for name in [k[: -len(".weight_scale")] for k in tensors if k.endswith(".weight_scale")]:
        q, scale = tensors[f"{name}.weight"], tensors[f"{name}.weight_scale"]
        rows, cols = q.shape
        assert scale.shape == (-(-rows // 128), -(-cols // 128)), name
        w = dequantize(q, scale, None, args)  # one scale per block, as written
        assert torch.isfinite(w).all() and w.abs().max() <= 448 * scale.max()
    model = quantkit.load(out, torch.float32)  # transformers refuses widths that are not whole blocks
    with torch.no_grad():
        assert torch.isfinite(model(ids(1, 16)).logits).all()


def test_gptq_with_fixed_block_scales_in_row_parts():
    """fp8 blocks with the float weight's scales fixed: with an identity Hessian every part is
    round-to-nearest under those scales, bit for bit, however the parts cut the row blocks."""
    from quantkit.primitives import dequantize
    from quantkit.primitives import quantize as to_grid

    torch.manual_seed(0)
    args = preset("fp8-block").weights
    W = torch.randn(300, 200)
    blocks, rows = guided.block_scales(W, args, torch.float32)
    assert blocks.shape == (3, 2) and rows.shape == (300, 2)
    rtn = dequantize(to_grid(W, blocks, None, args), blocks, None, args)
    bounds = [0, 70, 150, 300]  # cut rows 0-127 and 128-255
    parts = [
        quantize_weight(W[a:b], torch.eye(200), args, damp=0.0, fixed_scales=rows[a:b])
        for a, b in zip(bounds, bounds[1:])
    ]
    torch.testing.assert_close(torch.cat([p.weight for p in parts]), rtn, rtol=0, atol=0)
    torch.testing.assert_close(torch.cat([p.scale for p in parts]), rows, rtol=0, atol=0)
    X = torch.randn(512, 16) @ torch.randn(16, 200) + 0.1 * torch.randn(512, 200)  # correlated: feedback helps
    H = 2 * X.T @ X / 512
    fed = torch.cat(
        [quantize_weight(W[a:b], H, args, fixed_scales=rows[a:b]).weight for a, b in zip(bounds, bounds[1:])]
    )
    grid = to_grid(fed, blocks, None, args)
    torch.testing.assert_close(dequantize(grid, blocks, None, args), fed, rtol=0, atol=0)  # on the blocks' grid
    err = lambda V: ((V - W) @ X.T).square().sum()  # noqa: E731
    assert err(fed) < 0.5 * err(rtn), err(fed) / err(rtn)


def test_a_guided_run_of_gemma3_keeps_its_embedding_scale(tmp_path, tiny_corpus):
    # the guided pass captures the blocks' inputs a first time and releases the embeddings; the
    # second capture reloads them from the files, which hold no non-persistent buffer (Gemma's
    # embed_scale): released too, it was left on the meta device and the run stopped
    from conftest import make_family_model

    from quantkit.models.loading import release_weights

    folder = make_family_model(tmp_path / "g3", "gemma3")
    model = AutoModelForCausalLM.from_pretrained(folder)
    embed = model.get_input_embeddings()
    scale = embed.embed_scale.clone()
    release_weights(embed)
    assert embed.weight.is_meta and torch.equal(embed.embed_scale, scale)
    calib = Calibration(str(tiny_corpus), 4, 32, 0)
    prov = quantize(str(folder), preset("w4a16").with_group_size(16), tmp_path / "q", "gptq", calib, {"guided": 2})
    assert prov["options"]["guided"] == 2
