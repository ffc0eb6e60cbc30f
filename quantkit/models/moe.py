"""Mixture-of-experts blocks as quantkit holds them: one nn.Linear per expert projection,
under the names the checkpoints use (`block_sparse_moe.experts.N.w1`, `mlp.experts.N.gate_proj`),
where transformers 5 fuses the experts into 3-D parameters. Every linear-by-name tool of
quantkit (streaming loads, the methods, packing, `quantkit.load`) then sees an expert as
one more linear, and vLLM loads the checkpoint's per-expert tensors as it always has.

`install` swaps transformers' fused experts module for `Experts` (same call: hidden
states, top-k indices, top-k weights) and, for Mixtral, registers the sparse MLP under its
checkpoint name. `Experts.dense` is calibration's coverage rule: those experts also run on
every token, for their statistics only; the output keeps the real routing."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from quantkit.models.arch import ArchSpec, MoE, get_module


class Expert(nn.Module):
    """One expert: down(act(gate(x)) * up(x)), its linears named as in the checkpoints."""

    def __init__(self, names: tuple[str, str, str], hidden: int, intermediate: int, act_fn, like: torch.Tensor):
        super().__init__()
        self.names = names
        kw = {"bias": False, "device": like.device, "dtype": like.dtype}
        for name, (i, o) in zip(names, [(hidden, intermediate), (hidden, intermediate), (intermediate, hidden)]):
            self.add_module(name, nn.Linear(i, o, **kw))
        self.act_fn = act_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up, down = (getattr(self, n) for n in self.names)
        return down(self.act_fn(gate(x)) * up(x))


def route(top_k_index: torch.Tensor, num_experts: int) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """(expert, its tokens, their top-k slots) for every expert routed any token, in expert
    order, tokens ascending; top_k_index int [T, k]."""
    k = top_k_index.shape[1]
    order = torch.argsort(top_k_index.flatten(), stable=True)  # token-major entries, grouped by expert
    counts = torch.bincount(top_k_index.flatten(), minlength=num_experts).tolist()
    start = 0
    for expert, count in enumerate(counts[:num_experts]):
        if count:
            picked = order[start : start + count]
            yield expert, picked // k, picked % k
        start += count


class Experts(nn.ModuleList):
    """The experts of a sparse MLP, called as transformers' fused module is:
    forward(hidden [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H], the weighted
    sum of each token's experts (one GEMM per routed expert, added in expert order)."""

    def __init__(self, experts):
        super().__init__(experts)
        self.dense: frozenset[int] = frozenset()  # calibration: run on every token, for statistics

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        return mix(hidden_states, top_k_index, top_k_weights, self, self.dense)


def mix(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, experts, dense=frozenset()):
    """Σ over each token's top-k experts of weight · expert(token), hidden [T, H] -> [T, H]:
    each routed expert called once on its tokens (`route`), the outputs added in expert
    order. An expert in `dense` is called on every token (its hooks see them all) and gives
    its routed rows."""
    out = torch.zeros_like(hidden)
    routed = {e: (tokens, slots) for e, tokens, slots in route(top_k_index, len(experts))}
    for e in sorted(routed.keys() | dense):
        if e in dense:
            y = experts[e](hidden)
            if e not in routed:
                continue
            y = y[routed[e][0]]
        else:
            y = experts[e](hidden[routed[e][0]])
        tokens, slots = routed[e]
        out.index_add_(0, tokens, (y * top_k_weights[tokens, slots, None]).to(out.dtype))
    return out


def install(model: nn.Module, spec: ArchSpec) -> None:
    """Give every sparse block of `model` per-expert linears (the fused weights split into
    them, or left on the meta device when they are there) under the checkpoint's names."""
    moe = spec.moe
    if moe is None:
        return
    for block in get_module(model, spec.blocks):
        if moe.alias is not None and moe.alias in block._modules:  # the checkpoint's name, the forward's alias
            module = block._modules.pop(moe.alias)
            block._modules[moe.module] = module
            block.__dict__[moe.alias] = module
        sparse = get_module(block, moe.module)
        fused = getattr(sparse, "experts", None)
        if fused is None or isinstance(fused, Experts):
            continue
        sparse.experts = _split(fused, moe)


def _split(fused: nn.Module, moe: MoE) -> Experts:
    gate_up, down = fused.gate_up_proj, fused.down_proj  # [E, 2I, H], [E, H, I]
    n, hidden, intermediate = down.shape[0], down.shape[1], down.shape[2]
    experts = []
    for e in range(n):
        expert = Expert(moe.names, hidden, intermediate, fused.act_fn, down)
        if not down.is_meta:
            with torch.no_grad():
                for name, w in zip(moe.names, (gate_up[e, :intermediate], gate_up[e, intermediate:], down[e])):
                    getattr(expert, name).weight.copy_(w)
        experts.append(expert)
    return Experts(experts)


@torch.no_grad()
def count_tokens(block: nn.Module, spec: ArchSpec, inputs) -> list[int]:
    """Tokens the router sends each expert over the calibration batches (`BlockInputs`),
    running the block only as far as its experts."""
    experts = get_module(block, f"{spec.moe.module}.experts")
    counts = torch.zeros(len(experts), dtype=torch.int64)

    class Stop(Exception):
        pass

    def hook(module, args):
        counts.add_(torch.bincount(args[1].flatten().cpu(), minlength=len(experts))[: len(experts)])
        raise Stop

    handle = experts.register_forward_pre_hook(hook)
    try:
        for h, kw in zip(inputs.hidden, inputs.kwargs):
            with contextlib.suppress(Stop):
                block(h, **kw)
    finally:
        handle.remove()
    return counts.tolist()


@contextlib.contextmanager
def cover(block: nn.Module, spec: ArchSpec, inputs, min_tokens: int, record: dict, prefix: str):
    """While active, a sparse block's experts routed fewer than `min_tokens` calibration
    tokens (never fewer than one) run on every token for their statistics; the routing
    counts go into record[prefix]. A dense block, or no calibration data: nothing to do."""
    spec = spec.for_block(block)
    if spec.moe is None or inputs is None:
        yield
        return
    experts = get_module(block, f"{spec.moe.module}.experts")
    counts = count_tokens(block, spec, inputs)
    record[prefix] = counts
    experts.dense = frozenset(e for e, c in enumerate(counts) if c < max(1, min_tokens))
    try:
        yield
    finally:
        experts.dense = frozenset()
