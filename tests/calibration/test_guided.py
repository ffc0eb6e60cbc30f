"""Loss-guided Hessians: the streaming backward pass against autograd on the whole model, the
weighted Hessian against its formula, GPTQ with them against plain GPTQ, and the commands."""

import json

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

import quantkit
from quantkit.calibration import guided
from quantkit.calibration.gptq import quantize_weight, quantize_weights
from quantkit.calibration.registry import GUIDED_ROWS
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
    # no weight gradient was formed: the head's alone is a product the size of the logits'
    assert model.get_output_embeddings().weight.requires_grad and all(p.grad is None for p in model.parameters())
    want = whole_model_weights(model, samples, 3, names)
    assert set(got) == set(names)
    for n in names:
        assert got[n].shape == (samples.numel(), 3)
        torch.testing.assert_close(got[n], want[n], rtol=1e-4, atol=1e-6)  # fp32 sums in another order
    assert not list(tmp_path.glob("quantkit-gradients-*"))  # the block inputs kept on disk are gone


@pytest.mark.parametrize("tie,family", [(False, "llama"), (True, "llama"), (True, "gemma2")])
def test_fisher_gradients_equal_autograd_on_the_whole_model(tmp_path, tie, family):
    """∇ log p(y|h) at every block's output, labels drawn from the model row by row with the
    same generator: the streaming pass (the head's gradient in closed form) against one
    autograd pass through the whole model; gemma2 caps its logits (final_logit_softcapping)."""
    from conftest import FAMILIES, make_tiny_model

    model_type, overrides = FAMILIES[family] if family != "llama" else ("llama", {})
    model = AutoModelForCausalLM.from_pretrained(make_tiny_model(tmp_path / "m", model_type, tie=tie, **overrides))
    model = model.eval()
    spec = arch_for(model.config)
    samples, draws = ids(), 3
    got = guided.fisher_gradients(model, spec, samples, draws, seed=5, batch_size=4, spill=tmp_path)
    assert all(p.grad is None for p in model.parameters())  # no weight gradient formed
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
    w = torch.rand(25, 2)
    add, state, n = guided.hessians(w, 25), None, 0
    for chunk in x:
        state, n = add(state, chunk, n)
    assert state["rest"] is None  # gradients for every token: no plain Hessian kept
    X = torch.cat([c.reshape(-1, 8) for c in x]).double()
    for k, H in enumerate(guided.estimate(state, 25)):
        want = 2 / 25 * (X.T * w[:, k].double()) @ X
        torch.testing.assert_close(H.double(), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("subset", [5, 7, 10, 24])
def test_subset_hessian_counts_the_other_tokens_at_weight_one(subset):
    """Gradients for the first `subset` of 25 tokens (batches of 10 and 15: the subset ends
    inside a batch, at its end, or in the second): H_k = (S·G_k + R·H_rest) / n, each by its
    formula in float64; and with every weight 1 that is the plain Hessian of all tokens."""
    torch.manual_seed(0)
    x = [torch.randn(2, 5, 8), torch.randn(3, 5, 8)]
    X = torch.cat([c.reshape(-1, 8) for c in x]).double()
    w = torch.rand(subset, 3) * 2
    for weights in (w, torch.ones(subset, 3)):
        add, state, n = guided.hessians(weights, 25), None, 0
        for chunk in x:
            state, n = add(state, chunk, n)
        S, R, wd = X[:subset], X[subset:], weights.double()
        got = guided.estimate(state, 25)
        for k, H in enumerate(got):
            want = (2 * (S.T * wd[:, k]) @ S + 2 * R.T @ R) / 25
            torch.testing.assert_close(H.double(), want, rtol=1e-5, atol=1e-5)
    for H in got:  # uniform weights: the plain Hessian, whatever the subset
        torch.testing.assert_close(H.double(), 2 / 25 * X.T @ X, rtol=1e-5, atol=1e-5)


def test_subset_hessian_refuses_tokens_past_its_count():
    add = guided.hessians(torch.ones(10, 2), 10)
    state, n = add(None, torch.randn(10, 4), 0)
    with pytest.raises(ValueError, match="cover 10 of 10"):
        add(state, torch.randn(3, 4), n)
    with pytest.raises(ValueError, match="for 11 tokens"):
        guided.hessians(torch.ones(11, 2), 10)


def test_row_groups_take_the_kth_group_of_each_linear():
    got = guided.row_groups([6, 3], 3)
    assert [g.tolist() for g in got] == [[0, 1, 6], [2, 3, 7], [4, 5, 8]]
    assert [g.tolist() for g in guided.row_groups([5], 2)] == [[0, 1], [2, 3, 4]]


def test_stacked_loss_weights_are_the_linears_mean():
    a, b = torch.rand(6, 2), torch.rand(6, 2)
    assert guided.stacked({"a": a}, ["a"]) is a
    torch.testing.assert_close(guided.stacked({"a": a, "b": b}, ["a", "b"]), (a + b) / 2)


def test_stacked_linears_are_quantized_group_by_group_under_the_shared_hessians(tiny_llama):
    """q, k and v (one input) with their own loss weights: group k of each linear's rows is
    quantized under H_k, the Hessian weighted by the three linears' mean weights (the formula
    on the block's captured inputs); the groups are of one size here, so GPTQ is called once,
    on group 0's rows of q, k, v then group 1's, under H [2, in, in], and each row lands back
    in its linear."""
    from quantkit.calibration.runner import BlockInputs, capture_block_inputs

    model = AutoModelForCausalLM.from_pretrained(tiny_llama).eval()
    spec, scheme, samples = arch_for(model.config), preset("w4a16").with_group_size(32), ids(4, 32)
    hidden, kwargs = capture_block_inputs(model, spec, samples, 2, "cpu")
    block, prefix = model.model.layers[0], "model.layers.0"
    names = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]
    gen = torch.Generator().manual_seed(1)
    guides = {f"{prefix}.{n}": torch.rand(128, 2, generator=gen) * 3 for n in names}
    X = []
    hook = block.self_attn.q_proj.register_forward_pre_hook(lambda m, a: X.append(a[0].reshape(-1, a[0].shape[-1])))
    with torch.no_grad():
        for h, kw in zip(hidden, kwargs[0]):
            block(h, **kw)
    hook.remove()
    X = torch.cat(X).double()
    w = sum(guides[f"{prefix}.{n}"] for n in names).double() / 3
    floats = {n: block.get_submodule(n).weight.data.clone() for n in names}
    results, seen = {}, []

    def gptq(W, H, args, name, fixed):
        seen.append((W.clone(), H))
        return quantize_weights(W, H, [args], damp=0.01, actorder="static", range_search=True, refine=1)[0]

    inputs = BlockInputs(hidden, kwargs[0], guides)
    with torch.no_grad():
        guided.quantize_rows(block, names, prefix, inputs, None, scheme, results, torch.float32, gptq)
    assert len(seen) == 1 and seen[0][1].shape == (2, 64, 64)
    W, H = seen[0]
    for k in range(2):
        torch.testing.assert_close(H[k].double(), 2 / 128 * (X.T * w[:, k]) @ X, rtol=1e-5, atol=1e-5)
    rows = [
        floats[n][b[k] : b[k + 1]] for k in range(2) for n in names for b in [guided.group_bounds(len(floats[n]), 2)]
    ]
    assert torch.equal(W, torch.cat(rows))  # group 0 of q, k, v, then group 1
    want = gptq(W, H, scheme.weights, "", None)
    seen.clear()
    at = 0
    for k in range(2):
        for n in names:
            b = guided.group_bounds(len(floats[n]), 2)
            got = block.get_submodule(n).weight.data[b[k] : b[k + 1]]
            assert torch.equal(got, want.weight[at : at + len(got)])
            assert torch.equal(results[f"{prefix}.{n}"].scale[b[k] : b[k + 1]], want.scale[at : at + len(got)])
            at += len(got)


def test_gptq_of_row_groups_under_their_own_hessians_in_one_call():
    """quantize_weights with H [G, in, in] (W's rows in G equal groups) against one call per
    group: the same weights and qparams when the Hessians share their diagonal (so the
    act-order, taken from their mean diagonal, is each one's own), with the range search and
    a refinement pass; each group's errors are fed back through its own Hessian."""
    torch.manual_seed(0)
    n, r, G = 96, 12, 3
    d = torch.rand(n) + 0.5
    hs = []
    for _ in range(G):
        X = torch.randn(400, n) * torch.rand(n) * 3
        C = X.T @ X
        C = C / C.diagonal().sqrt()[:, None] / C.diagonal().sqrt()[None, :]  # unit diagonal
        hs.append(d.sqrt()[:, None] * C * d.sqrt()[None, :])
    W = torch.randn(G * r, n)
    args = preset("w4a16-asym").weights.__class__(**{**preset("w4a16-asym").weights.__dict__, "group_size": 32})
    opts = dict(block_size=32, damp=0.01, actorder="static", range_search=True, refine=1)
    got = quantize_weights(W, torch.stack(hs), [args], **opts)[0]
    for k in range(G):
        want = quantize_weights(W[k * r : (k + 1) * r], hs[k], [args], **opts)[0]
        part = slice(k * r, (k + 1) * r)
        assert (got.weight[part] == want.weight).float().mean() > 0.99, k
        torch.testing.assert_close(got.scale[part], want.scale, rtol=1e-5, atol=1e-6)
    # and not the result of one Hessian for all rows
    one = quantize_weights(W, hs[0], [args], **opts)[0]
    assert not torch.equal(one.weight[r:], got.weight[r:])


@pytest.mark.parametrize(
    "algorithm, options",
    [("gptq", {"guided": 2}), ("awq", {"gptq": True, "guided": 2}), ("gptq", {"guided": 2, "guided_rows": 2})],
)
def test_guided_checkpoint_records_it_and_loads(tiny_llama, tiny_corpus, tmp_path, algorithm, options):
    out = tmp_path / "q"
    calib = Calibration(str(tiny_corpus), 4, 32, 0)
    prov = quantize(str(tiny_llama), preset("w4a16").with_group_size(32), out, algorithm, calib, options)
    assert prov["options"]["guided"] == 2
    assert prov["options"]["guided_rows"] == options.get("guided_rows", GUIDED_ROWS)
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
