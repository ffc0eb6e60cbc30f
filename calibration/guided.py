"""Loss-guided Hessians (GuidedQuant, Kim et al., ICML 2025).

GPTQ minimises each linear's output error ‖ΔW·X‖², every token and every output channel
counting alike. What the model's loss feels of an output error Δy at token t is, to first
order, Σ_j g_tj·Δy_tj with g = ∂loss/∂y; its expectation (the Fisher, diagonal over output
channels) weighs each channel's squared error by g_tj². Split the linear's output channels
into `groups` contiguous groups and average g² within each: group k's rows are then
quantized under H_k = 2/n · Σ_t w_tk·x_t·x_tᵀ, w_tk the mean of g_tj² over the group's
channels j at token t (scaled to mean 1 over the tokens).

`loss_gradients` gets every w from one backward pass of the float model over the
calibration rows (loss: the next-token cross-entropy of the rows themselves), block by
block like the calibration runner: a forward pass keeps each block's inputs on disk, then
the blocks run backward from the last, each loaded, run again with its input requiring a
gradient, and released. `hessians` is the runner's reducer that folds a linear's inputs
into its groups' H_k (see `calibration.hooks.reduce_inputs`).

`fisher_gradients` runs the same pass from another head: for labels drawn from the float
model's own next-token distribution (not the data's), it keeps ∇_h log p(y|h) at every
block's output h, whose outer products estimate the Fisher that mixed precision's
sensitivity weighs a block's output change by (`pipeline.mixed`).
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from quantkit.calibration.hooks import by_args, reduce_inputs
from quantkit.calibration.method import QParams
from quantkit.calibration.runner import BlockInputs, capture_block_inputs
from quantkit.errors import QuantkitError
from quantkit.malloc import trim_freed_memory
from quantkit.models.arch import ArchSpec, get_module
from quantkit.primitives import compute_qparams
from quantkit.progress import Track, no_progress


def check_dense(spec: ArchSpec, model_name) -> None:
    """Refuse a mixture of experts: an expert sees only its routed tokens, whose loss weights
    this module does not align."""
    if spec.moe is not None:
        raise QuantkitError(
            f"guided Hessians are for dense models; {model_name} has mixture-of-experts blocks: drop --guided."
        )


def gradient_rows(samples: int, rows: int) -> int:
    """How many of `samples` calibration rows (the first) the loss gradients are taken on, for
    the option `guided_rows` (0: all)."""
    return samples if rows <= 0 else min(rows, samples)


def group_bounds(out: int, groups: int) -> list[int]:
    """The first row of each of `groups` contiguous groups of `out` output channels, and out."""
    return [out * k // groups for k in range(groups + 1)]


def channel_means(g: torch.Tensor, groups: int) -> torch.Tensor:
    """g [..., out] → [tokens, groups]: the mean of g² over each group's channels."""
    g2 = g.detach().float().reshape(-1, g.shape[-1]).square()
    b = group_bounds(g.shape[-1], groups)
    return torch.stack([g2[:, b[k] : b[k + 1]].mean(-1) for k in range(groups)], -1)


def loss_gradients(
    model: nn.Module,
    spec: ArchSpec,
    samples: torch.Tensor,
    groups: int,
    names: list[str],
    batch_size: int = 8,
    load: Callable[[nn.Module, str], None] = lambda module, prefix: None,
    release: Callable[[nn.Module], None] = lambda module: None,
    head_weight: Callable[[], torch.Tensor] | None = None,
    track: Track = no_progress,
    spill: Path | None = None,
    device: str | torch.device = "cpu",
) -> dict[str, torch.Tensor]:
    """full linear name → w [tokens, groups] (fp32, mean 1 per group; tokens in the order of
    `samples` [rows, seq], row by row) for each linear of `names`, from the gradients of the
    next-token cross-entropy of `samples` under the float model.

    `load(module, prefix)` fills a module's weights before it runs and `release(module)`
    drops them after (the streaming pipeline's; the defaults leave the model as it is);
    the embeddings must be loaded already (capture). `head_weight()` gives the output
    projection [vocab, hidden] (default: the model's lm_head). Each block's inputs are kept
    in `spill` (a folder; default: a temporary one) between the forward and the backward pass.
    Blocks run on `device`; the weights returned are on the CPU."""
    found: dict[str, list[torch.Tensor]] = {n: [] for n in names}

    def head(x, ids, norm, weight, softcap):
        return _head_gradient(x, ids, norm, weight, softcap)[None]

    def watch(i: int, block: nn.Module, prefix: str) -> list:
        inside = {f"{prefix}.{k}": m for k, m in block.named_modules() if f"{prefix}.{k}" in found}
        return [m.register_forward_hook(_keep_gradient(found[k], groups)) for k, m in inside.items()]

    _stream_backward(model, spec, samples, head, batch_size, load, release, head_weight, track, spill, device, watch)
    return _normalised({k: [c.cpu() for c in v] for k, v in found.items()})


def fisher_gradients(
    model: nn.Module,
    spec: ArchSpec,
    samples: torch.Tensor,
    draws: int = 4,
    seed: int = 0,
    batch_size: int = 8,
    track: Track = no_progress,
    spill: Path | None = None,
    device: str | torch.device = "cpu",
) -> list[list[torch.Tensor]]:
    """g[i][b] [draws, batch, seq, hidden] (fp32, on the CPU): for every block i and batch b of
    `samples` [rows, seq], the gradients ∇_h log p(y_t | h) of the float model's next-token
    log-probability with respect to block i's output h, for `draws` labels y_t per token
    drawn from the float model's own distribution at that token (a generator seeded with
    `seed`, row by row). E_y[g gᵀ] is the Fisher of the output distribution with respect to
    h, so KL(p ‖ p with h + δ) ≈ ½·E_y[(g·δ)²] for a small change δ (`pipeline.mixed`).
    One backward pass, block by block, as `loss_gradients` (the model loaded whole)."""
    out: list[list[torch.Tensor]] = [[] for _ in get_module(model, spec.blocks)]
    generator = torch.Generator().manual_seed(seed)

    def head(x, ids, norm, weight, softcap):
        return _sampled_gradient(x, norm, weight, softcap, draws, generator)

    def keep(i: int, block: nn.Module, prefix: str, grads: list[torch.Tensor]) -> None:
        out[i] = [g.cpu() for g in grads]

    _stream_backward(model, spec, samples, head, batch_size, track=track, spill=spill, device=device, at_output=keep)
    return out


def _stream_backward(
    model,
    spec,
    samples,
    head,
    batch_size,
    load=lambda module, prefix: None,
    release=lambda module: None,
    head_weight=None,
    track=no_progress,
    spill=None,
    device="cpu",
    watch=lambda i, block, prefix: [],
    at_output=lambda i, block, prefix, grads: None,
) -> None:
    # the float model forward block by block (each block's inputs kept on disk), `head` for the
    # gradients at the last block's output ([draws, b, seq, hidden] per batch), then back block
    # by block: `at_output` sees each block's output gradients, `watch` hooks its modules
    blocks = get_module(model, spec.blocks)
    device = torch.device(device)
    hidden, kwargs = capture_block_inputs(model, spec, samples, batch_size, device)
    n = len(blocks)
    with tempfile.TemporaryDirectory(dir=spill, prefix="quantkit-gradients-") as tmp:
        steps = iter(track(range(2 * n + 1), "loss gradients (blocks forward, then back)", 2 * n + 1))
        with torch.no_grad():
            for i, block in enumerate(blocks):
                next(steps)
                torch.save(hidden, Path(tmp) / f"{i}.pt")
                load(block, f"{spec.blocks}.{i}")
                hidden = BlockInputs(hidden, kwargs[i]).run(block.to(device))
                release(block.to("cpu"))
                trim_freed_memory()
        next(steps)
        grads = _output_gradients(
            model, spec, hidden, samples.split(batch_size), load, release, head_weight, device, head
        )
        del hidden
        for i in reversed(range(n)):
            next(steps)
            prefix = f"{spec.blocks}.{i}"
            at_output(i, blocks[i], prefix, grads)
            load(blocks[i], prefix)
            hooks = watch(i, blocks[i], prefix)
            try:
                _block_backward(blocks[i].to(device), Path(tmp) / f"{i}.pt", kwargs[i], grads, device)
            finally:
                for hook in hooks:
                    hook.remove()
            release(blocks[i].to("cpu"))
            trim_freed_memory()  # the backward pass's temporaries (see quantkit.malloc)


def _output_gradients(model, spec, hidden, rows, load, release, head_weight, device, head) -> list[torch.Tensor]:
    # the gradients at the last block's output, [draws, b, seq, hidden] per batch of `hidden`
    final_norm = get_module(model, spec.final_norm)
    softcap = getattr(model.config, "final_logit_softcapping", None)
    load(final_norm, spec.final_norm)
    weight = head_weight() if head_weight is not None else get_module(model, spec.lm_head).weight
    norm = final_norm.to(device)
    grads = [head(h, r, norm, weight.to(device), softcap) for h, r in zip(hidden, rows)]
    release(final_norm.to("cpu"))
    return grads


def _block_backward(block, inputs, kwargs, grads, device) -> None:
    # runs `block` again on its saved `inputs` and back from `grads` (each [draws, b, seq,
    # hidden], replaced in place by the gradients at the block's inputs), once per draw
    for p in block.parameters():
        p.requires_grad_(False)
    for b, (h, kw) in enumerate(zip(torch.load(inputs, map_location=device), kwargs)):
        h = h.detach().requires_grad_()
        back = []
        with torch.enable_grad():
            out = block(h, **kw)
            out = out[0] if isinstance(out, tuple) else out
            for d, g in enumerate(grads[b]):
                out.backward(g, retain_graph=d < len(grads[b]) - 1)
                back.append(h.grad)
                h.grad = None
        grads[b] = torch.stack(back)


def _normalised(found: dict[str, list[torch.Tensor]]) -> dict[str, torch.Tensor]:
    missing = [k for k, v in found.items() if not v]
    if missing:
        raise ValueError(f"no gradient reached {missing[0]}")  # a linear the blocks never call: a bug, not input
    out = {}
    for k, chunks in found.items():
        w = torch.cat(chunks)  # [tokens, groups]
        out[k] = w / w.mean(0).clamp_min(torch.finfo(torch.float32).tiny)
    return out


def _keep_gradient(into: list, groups: int):
    # a forward hook that appends, once the backward pass reaches it, the group means of the
    # squared gradient of the module's output
    def hook(module, args, output):
        output.register_hook(lambda g: into.append(channel_means(g, groups)))

    return hook


def _head_gradient(h, rows, final_norm, head, softcap):
    """∂(Σ next-token cross-entropy)/∂h for the last block's output h [b, seq, hidden], one
    row at a time (the logits of a whole batch can take gigabytes)."""
    from quantkit.kernels.attention import twin as reference

    grads = []
    for x, ids in zip(h, rows):
        x = x[None].detach().requires_grad_()
        with torch.enable_grad():
            logits = reference.cap(nn.functional.linear(final_norm(x), head).float(), softcap)[0]
            loss = nn.functional.cross_entropy(logits[:-1], ids[1:].to(logits.device), reduction="sum")
            # the gradient at x alone: backward() would also form the head's [vocab, hidden]
            # weight gradient (the head's parameters require it), a third product the size of the logits'
            grads.append(torch.autograd.grad(loss, x)[0][0])
    return torch.stack(grads)


def _sampled_gradient(h, final_norm, head, softcap, draws, generator):
    """∇_h log p(y_t | h) [draws, b, seq, hidden] for the last block's output h [b, seq, hidden],
    `draws` labels y_t per token drawn from p (`generator`, on the CPU), one row at a time.

    In closed form, not by autograd through the head: with z = cap(u) the logits of u = n·Wᵀ
    (n the final norm's output), ∂log p(y)/∂u = (e_y − p)·cap'(u), so the gradient at n is
    cap'(u_y)·W_y − (p·cap'(u))·W: one [seq, vocab] × [vocab, hidden] product shared by the
    draws (autograd takes one per draw) and a row of W per draw; the norm by autograd."""
    from quantkit.kernels.attention import twin as reference

    grads, w = [], head.detach().float()  # fp32 for the products (a copy only when the head is 16-bit)
    for x in h:
        x = x.detach().requires_grad_()
        with torch.enable_grad():
            n = final_norm(x[None])[0]
        with torch.no_grad():
            u = nn.functional.linear(n.detach().to(head.dtype), head).float()  # [seq, vocab]
            p = reference.cap(u, softcap).log_softmax(-1).exp()
            y = torch.multinomial(p.cpu(), draws, replacement=True, generator=generator).to(u.device)  # [seq, draws]
            if softcap is None:
                at_n = w[y] - (p @ w)[:, None]  # [seq, draws, hidden]
            else:
                slope = 1 - torch.tanh(u / softcap).square()  # cap'(u)
                at_n = slope.gather(-1, y)[..., None] * w[y] - ((p * slope) @ w)[:, None]
            del u, p
        with torch.enable_grad():
            back = torch.autograd.grad(n, x, at_n.transpose(0, 1).to(n.dtype), is_grads_batched=True)[0]
        grads.append(back)
    return torch.stack(grads, 1)


GRAM_BLOCKS = 4  # column blocks of a guided Hessian: the products above the diagonal, 5/8 of the full one


def stacked(guides: dict[str, torch.Tensor], fulls: list[str]) -> torch.Tensor:
    """The loss weights [tokens, groups] the linears `fulls` (they read one input) share: the
    mean of their own (each of mean 1 per group), so that group k of every one of them is
    quantized under one Hessian H_k: one weighted product and one GPTQ call per group for
    the input, not per linear. A single linear keeps its own weights."""
    ws = [guides[f] for f in fulls]
    return ws[0] if len(ws) == 1 else torch.stack(ws).mean(0)


def hessians(w: torch.Tensor, tokens: int):
    """The reducer `state = add(state, x, n)` of `hooks.reduce_inputs` for one input's guided
    Hessians over `tokens` calibration tokens, of which the first w.shape[0] (the rows the
    loss gradients were taken on, `guided_rows`) have weights w [subset, groups]; `estimate`
    turns its final state into the groups' H_k [in, in].

    With gradients for every token, H_k = 2/n·Σ_t w_tk·x_t·x_tᵀ (`add_weighted_gram`). With
    gradients for the first S tokens only, the other R = n − S count at weight 1, the mean
    of w (which is scaled to mean 1 over the S): H_k = (S·G_k + R·H_rest) / n, G_k the
    subset's guided Hessian and H_rest the plain one of the rest, one product shared by the
    groups. Positive semi-definite, and the plain Hessian when every weight is 1. (A control
    variate, G_k + H_all − H_S, is unbiased but not definite: on smollm2 GPTQ had to damp
    most o_proj and down_proj Hessians 100 times more, docs/benchmarks.md.)"""
    subset = w.shape[0]
    if subset > tokens:
        raise ValueError(f"loss weights for {subset} tokens, but only {tokens} calibration tokens")

    def add(state, x, n):
        x = x.reshape(-1, x.shape[-1]).float()  # x [t, in]
        t, d = x.shape
        if state is None:
            rest = None if subset == tokens else torch.zeros(d, d, device=x.device)
            guided = [torch.zeros(d, d, device=x.device) for _ in range(w.shape[1])]
            state = {"guided": guided, "rest": rest, "subset": subset}
        cut = min(max(subset - n, 0), t)  # this batch's tokens inside the subset
        if cut:
            xs, ws, seen = x[:cut], w[n : n + cut].to(x.device), n + cut
            for k, H in enumerate(state["guided"]):
                add_weighted_gram(H, xs, ws[:, k], n / seen, 2 / seen)
        if cut < t:  # the tokens after the subset: the plain Hessian of the rest
            if state["rest"] is None:
                raise ValueError(f"{n + t} tokens, but the loss gradients cover {subset} of {tokens}")
            rest, before = x[cut:], max(n - subset, 0)
            seen = before + rest.shape[0]
            ones = torch.ones(rest.shape[0], device=x.device)
            add_weighted_gram(state["rest"], rest, ones, before / seen, 2 / seen)
        return state, n + t

    return add


def estimate(state: dict, tokens: int) -> list[torch.Tensor]:
    """The groups' H_k from `hessians`' final state over `tokens` tokens: G_k, or
    (S·G_k + R·H_rest) / tokens when only the first S had loss weights."""
    if state["rest"] is None:
        return state["guided"]
    share = (tokens - state["subset"]) / tokens
    return [H.mul_(1 - share).add_(state["rest"], alpha=share) for H in state["guided"]]


def add_weighted_gram(H: torch.Tensor, x: torch.Tensor, w: torch.Tensor, beta: float, alpha: float) -> None:
    """In place: H ← beta·H + alpha·(x·w)ᵀx for a symmetric H [in, in], x [t, in], w [t]
    (`H.mul_(beta).addmm_(x.T * w, x, alpha=alpha)`, whose reference it is). The product is
    symmetric, so only the blocks on and above the diagonal of `GRAM_BLOCKS` × `GRAM_BLOCKS`
    are multiplied (5/8 of the products at 4 blocks) and the rest mirrored from them."""
    d = x.shape[1]
    edges = [d * k // GRAM_BLOCKS for k in range(GRAM_BLOCKS + 1)]
    for a, b in zip(edges, edges[1:]):
        if a < b:  # rows a:b, columns a: (the diagonal block and those right of it)
            H[a:b, a:].mul_(beta).addmm_((x[:, a:b] * w[:, None]).T, x[:, a:], alpha=alpha)
    for a, b in zip(edges, edges[1:]):
        H[b:, a:b] = H[a:b, b:].T


def calibration_tokens(inputs) -> int:
    """The tokens of a block's calibration batches (`runner.BlockInputs`)."""
    return sum(h.shape[:-1].numel() for h in inputs.hidden)


def row_groups(outs: list[int], groups: int) -> list[torch.Tensor]:
    """For linears of `outs` rows stacked, each group's rows in the stack: group k is the k-th
    of each linear's `groups` contiguous groups of its own rows (`group_bounds`)."""
    starts = [sum(outs[:i]) for i in range(len(outs))]
    parts = [[] for _ in range(groups)]
    for start, out in zip(starts, outs):
        b = group_bounds(out, groups)
        for k in range(groups):
            parts[k].append(torch.arange(start + b[k], start + b[k + 1]))
    return [torch.cat(p) for p in parts]


def quantize_rows(block, names, prefix, inputs, replay, scheme, results, scale_dtype, quantize):
    """The linears of `names` (they read one input) quantized group of rows by group of rows:
    group k of each linear under H_k, the guided Hessians of their shared loss weights
    (`stacked`, `hessians`), by `quantize(W, H, args, name, fixed_scales)` (GPTQ's, with its
    step's options); linears of one format are stacked, all their row groups in one call
    where the groups are of one size (`in_groups`). A per-tensor
    scale cannot differ between groups: such a linear is quantized alone under the mean of
    the Hessians; fp8 blocks, whose 128 rows share a scale that the groups' bounds may cut,
    alone too, with their scales from the float weight (`block_scales`)."""
    fulls, tokens = [f"{prefix}.{n}" for n in names], calibration_tokens(inputs)
    add = hessians(stacked(inputs.guides, fulls), tokens)
    hs = estimate(reduce_inputs(block, get_module(block, names[0]), inputs, fulls[0], add, replay), tokens)
    for args, same in by_args(scheme, prefix, names).items():
        for part in [[n] for n in same] if args.strategy in ("tensor", "block") else [same]:
            _quantize_stack(block, part, prefix, hs, args, results, scale_dtype, quantize)


def in_groups(outs: list[int], hs: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """How the row groups of linears of `outs` rows stacked (`row_groups`) are quantized
    under their Hessians `hs`: [(rows, H)], one pair with every group's rows side by side
    (group by group) and H [G, in, in] when the groups are of one size (GPTQ feeds each
    group's errors back through its own Hessian in one column loop, `gptq.quantize_weights`),
    else a pair per group."""
    groups = row_groups(outs, len(hs))
    if len(hs) > 1 and len({len(g) for g in groups}) == 1:
        return [(torch.cat(groups), torch.stack(hs))]
    return list(zip(groups, hs))


def _quantize_stack(block, part, prefix, hs, args, results, scale_dtype, quantize):
    linears = [get_module(block, n) for n in part]
    W, outs = torch.cat([lin.weight.data for lin in linears]), [lin.out_features for lin in linears]
    if args.strategy == "tensor":
        hs = [sum(hs) / len(hs)]
    blocks, fixed = block_scales(W, args, scale_dtype)
    label = f"{prefix}.{'+'.join(part)}"
    Q, scale, zero = torch.empty_like(W), None, None
    for k, (rows, H) in enumerate(in_groups(outs, hs)):
        name = label if H.dim() == 3 else f"{label} group {k}"
        r = quantize(W[rows], H, args, name, None if fixed is None else fixed[rows])
        Q[rows] = r.weight
        if args.strategy not in ("tensor", "block"):  # per row: placed as the rows are
            scale = r.scale.new_empty((W.shape[0], *r.scale.shape[1:])) if scale is None else scale
            scale[rows] = r.scale
        else:
            scale = r.scale if blocks is None else blocks  # per tensor: one group; fp8 blocks: the float weight's
        if r.zero_point is not None:
            zero = r.zero_point.new_empty((W.shape[0], *r.zero_point.shape[1:])) if zero is None else zero
            zero[rows] = r.zero_point
    split = [scale] if len(part) == 1 else scale.split(outs)
    zeros = [None] * len(part) if zero is None else zero.split(outs)
    for name, linear, q, s, z in zip(part, linears, Q.split(outs), split, zeros):
        linear.weight.data.copy_(q)
        results[f"{prefix}.{name}"] = QParams(s.clone(), None if z is None else z.clone(), None)


def block_scales(W: torch.Tensor, args, scale_dtype: torch.dtype):
    """fp8 blocks: (the min-max scales of W's row × column blocks, each row's scale per column
    block [out, column blocks]), what guided GPTQ quantizes its row groups under; (None, None)
    for other strategies. The scales come from the float weight, before GPTQ moves it."""
    if args.strategy != "block":
        return None, None
    blocks = compute_qparams(W, args, scale_dtype)[0]  # [row blocks, column blocks]
    return blocks, blocks.repeat_interleave(args.block_structure[0], 0)[: W.shape[0]]
