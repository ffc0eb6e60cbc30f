"""What a method's runner step observes of a block: which of its linears are targeted,
which mappings apply, the inputs its linears and modules receive on the calibration
batches (captured whole, reduced as they go, or replayed from an earlier pass), and a
module's output with candidate weights swapped in. Forward hooks only; no math."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from quantkit.calibration.runner import BlockInputs
from quantkit.errors import QuantkitError
from quantkit.models.arch import ArchSpec, Mapping, get_module
from quantkit.scheme import QuantScheme


class _Stop(Exception):
    pass


def targets(scheme: QuantScheme, prefix: str, names) -> list[str]:
    """The linears of `names` (inside the block at `prefix`) that `scheme` does not ignore."""
    return [name for name in names if not scheme.is_ignored(f"{prefix}.{name}")]


def weight_args(scheme: QuantScheme, prefix: str, name: str):
    """The weight args the linear `name` of the block at `prefix` is quantized with: the
    scheme's, or those of the override (per-module scheme) that targets it."""
    return scheme.scheme_for(f"{prefix}.{name}").weights


def by_args(scheme: QuantScheme, prefix: str, names) -> dict:
    """`names` split by the weight args each is quantized with (args -> names, in order)."""
    parts = {}
    for name in names:
        parts.setdefault(weight_args(scheme, prefix, name), []).append(name)
    return parts


def owner(spec: ArchSpec, name: str) -> str:
    """The first linear of the sequential group `name` is in (the group reads one input)."""
    return next(g[0] for g in spec.sequential if name in g)


@dataclass
class Balance:
    """One AWQ/SmoothQuant mapping as it applies to a block: the rows of the previous op
    that feed the linears (views, so folding writes into the model) and its norm offset."""

    mapping: Mapping
    prev_weight: torch.Tensor  # norm [ci] or linear rows [ci, c_prev]
    prev_bias: torch.Tensor | None
    linears: list[nn.Linear]
    offset: float = 0.0  # the norm scales by (offset + weight)
    readers: list[torch.Tensor] = ()  # float weights [*, ci] that also read prev's output (a router)


def mappings(spec: ArchSpec, block: nn.Module, names: list[str]):
    """A `Balance` for each AWQ/SmoothQuant mapping of the table that targets some of
    `names` and whose shapes allow it (not v → o under grouped-query attention)."""
    for m in spec.awq:
        linears = [get_module(block, n) for n in m.linears if n in names]
        if not linears:
            continue
        prev = get_module(block, m.prev)
        weight, bias = prev.weight.data, getattr(prev, "bias", None)
        if m.prev_rows is not None:  # a fused projection: only some of its outputs feed the linears
            rows = _rows(spec, block, prev, m.prev_rows)
            weight, bias = weight[rows], None if bias is None else bias.data[rows]
        if weight.shape[0] != linears[0].in_features:
            continue
        readers = [get_module(block, r).weight.data for r in m.readers]
        yield Balance(m, weight, bias, linears, 0.0 if isinstance(prev, nn.Linear) else spec.norm_offset, readers)


def mapping_input(spec: ArchSpec, m: Mapping) -> str:
    """The module whose captured input a mapping's scales are searched on (see `mapping_inputs`)."""
    return m.input or owner(spec, m.linears[0])


def mapping_inputs(spec: ArchSpec, block: nn.Module, names: list[str], inputs: BlockInputs, max_tokens: int):
    """`capture_inputs` for the input each sequential group of `names` reads, keyed by the
    group's first linear, and for every mapping that reads its own (a sparse MLP's input)."""
    extra = [m.input for m in spec.awq if m.input and any(n in names for n in m.linears)]
    keys = dict.fromkeys([owner(spec, n) for n in names] + extra)
    return capture_inputs(block, {k: get_module(block, k) for k in keys}, inputs, max_tokens)


def scaled_inputs(spec: ArchSpec, feats: dict, m: Mapping, scales: torch.Tensor) -> None:
    """After a mapping's scales are folded: its linears' captured inputs are divided by them."""
    for key in dict.fromkeys([mapping_input(spec, m)] + [owner(spec, n) for n in m.linears]):
        if key in feats:
            feats[key] = feats[key] / scales


def _rows(spec: ArchSpec, block: nn.Module, prev: nn.Linear, which: str) -> slice:
    """The output rows of a fused q/k/v ("v") or gate/up ("up") projection."""
    out = prev.out_features
    if which == "up":
        return slice(out // 2, out)
    attention = get_module(block, spec.attention)
    values = attention.config.num_key_value_heads * attention.head_dim
    return slice(out - values, out)


class Replay:
    """Reuse a finished sub-module's outputs across passes over the calibration batches:
    while active, the module's calls of the first pass run and are kept, and the calls of
    later passes (one per batch, in the same order) return the kept outputs. Only valid
    while the module's weights and inputs stay as they were. `outputs`: a list of kept outputs
    shared with other Replays of modules that compute the same (copies of one block)."""

    def __init__(self, module: nn.Module, batches: int, outputs: list | None = None):
        self.module, self.batches, self.calls = module, batches, 0
        self.outputs = [] if outputs is None else outputs

    @contextlib.contextmanager
    def active(self):
        forward = self.module.forward

        def replay(*args, **kwargs):
            i, self.calls = self.calls % self.batches, self.calls + 1
            if len(self.outputs) <= i:
                self.outputs.append(forward(*args, **kwargs))
            return self.outputs[i]

        self.module.forward = replay
        try:
            yield
        finally:
            del self.module.forward


@torch.no_grad()
def reduce_inputs(
    block: nn.Module, linear: nn.Linear, inputs: BlockInputs, name: str, add: Callable, replay: Replay | None = None
):
    """Fold the inputs of `linear` over all calibration batches into `state = add(state, x, n)`
    (n: tokens seen so far), running the block (as it is now) only as far as that linear
    and reusing `replay`'s module outputs. Returns the final state."""
    state, n = None, 0

    def hook(module, args):
        nonlocal state, n
        state, n = add(state, args[0], n)
        raise _Stop

    handle = linear.register_forward_pre_hook(hook)
    try:
        with replay.active() if replay else contextlib.nullcontext():
            for h, kw in zip(inputs.hidden, inputs.kwargs):
                try:
                    block(h, **kw)
                except _Stop:
                    pass
    finally:
        handle.remove()
    if state is None or n == 0:
        raise QuantkitError(f"no calibration token reached {name}; calibrate on more text.")
    return state


@torch.no_grad()
def reduce_each(
    block: nn.Module,
    linears: dict[str, nn.Linear],
    inputs: BlockInputs,
    add: Callable | dict[str, Callable],
    prefix: str,
    replay=None,
):
    """`reduce_inputs` for several linears whose inputs do not depend on each other (one
    pass of `spec.stages`), in one pass over the calibration batches: name -> state. `add`
    is one reducer for all, or name -> its own."""
    states = {name: (None, 0) for name in linears}
    adds = add if isinstance(add, dict) else dict.fromkeys(linears, add)

    def observe(name, x):
        state, n = states[name]
        states[name] = adds[name](state, x, n)

    with replay.active() if replay else contextlib.nullcontext():
        observe_inputs(block, linears, inputs, observe)
    for name, (state, n) in states.items():
        if state is None or n == 0:
            raise QuantkitError(f"no calibration token reached {prefix}.{name}; calibrate on more text.")
    return {name: state for name, (state, _) in states.items()}


@torch.no_grad()
def observe_inputs(block: nn.Module, linears: dict[str, nn.Linear], inputs: BlockInputs, observe) -> None:
    """Run the block on every calibration batch, calling observe(name, x) with the input
    x of each named linear."""
    hooks = [
        module.register_forward_pre_hook(lambda m, args, name=name: observe(name, args[0]))
        for name, module in linears.items()
    ]
    try:
        inputs.run(block)
    finally:
        for h in hooks:
            h.remove()


@torch.no_grad()
def observe_pairs(
    block: nn.Module, float_block: nn.Module, names: list[str], inputs: BlockInputs, float_hidden, observe, replays=()
) -> None:
    """For every calibration batch, run `float_block` on the float model's hidden states
    `float_hidden` and `block` on `inputs.hidden`, each only as far as the linears `names`
    (whose inputs do not depend on each other), and call observe(name, x_float, x) with each
    named linear's input in the one and in the other. The `replays` are active throughout."""

    def reach(module, h, kw) -> dict[str, torch.Tensor]:
        seen = {}

        def hook(name):
            def keep(m, args):
                seen[name] = args[0]
                if len(seen) == len(names):
                    raise _Stop

            return keep

        hooks = [get_module(module, n).register_forward_pre_hook(hook(n)) for n in names]
        try:
            module(h, **kw)
        except _Stop:
            pass
        finally:
            for handle in hooks:
                handle.remove()
        return seen

    with contextlib.ExitStack() as stack:
        for replay in replays:
            stack.enter_context(replay.active())
        for h, hf, kw in zip(inputs.hidden, float_hidden, inputs.kwargs):
            xf, x = reach(float_block, hf, kw), reach(block, h, kw)
            for name in names:
                if name in x:
                    observe(name, xf[name], x[name])


def capture_inputs(block: nn.Module, linears: dict[str, nn.Linear], inputs: BlockInputs, max_tokens: int):
    """Inputs [tokens, in] of each named linear over the calibration batches, run through
    the block as it is now; evenly spaced tokens, at most about `max_tokens` of them."""
    total = sum(h.shape[0] * h.shape[1] for h in inputs.hidden)
    stride = max(1, total // max_tokens)
    seen: dict[str, list[torch.Tensor]] = {name: [] for name in linears}
    observe_inputs(
        block, linears, inputs, lambda name, x: seen[name].append(x.reshape(-1, x.shape[-1])[::stride].float())
    )
    for name, chunks in seen.items():
        if not chunks or sum(c.shape[0] for c in chunks) == 0:
            raise QuantkitError(f"no calibration token reached {name}; calibrate on more text.")
    return {name: torch.cat(chunks) for name, chunks in seen.items()}


@torch.no_grad()
def capture_calls(block: nn.Module, modules: dict[str, nn.Module], inputs: BlockInputs, max_tokens: int):
    """The (args, kwargs) each named module receives on the first calibration batches,
    at least `max_tokens` tokens' worth (whole sequences, so attention can run on them)."""
    calls = {name: [] for name in modules}
    hooks = [
        m.register_forward_pre_hook(lambda mod, a, kw, name=name: calls[name].append((a, dict(kw))), with_kwargs=True)
        for name, m in modules.items()
    ]
    try:
        seen = 0
        for h, kw in zip(inputs.hidden, inputs.kwargs):
            if seen >= max_tokens:
                break
            block(h, **kw)
            seen += h.shape[0] * h.shape[1]
    finally:
        for h in hooks:
            h.remove()
    return calls


def module_output(module: nn.Module, linears: list[nn.Linear], calls: list):
    """output_fn(weights): `module`'s output [tokens, out] on its captured `calls` with the
    linears' weights swapped for the candidates."""

    def output_fn(weights: list[torch.Tensor]) -> torch.Tensor:
        saved = [lin.weight.data for lin in linears]
        for lin, w in zip(linears, weights):
            lin.weight.data = w
        try:
            outs = [module(*args, **kwargs) for args, kwargs in calls]
            outs = [o[0] if isinstance(o, tuple) else o for o in outs]  # attention returns (output, weights)
            return torch.cat([o.reshape(-1, o.shape[-1]) for o in outs])
        finally:
            for lin, w in zip(linears, saved):
                lin.weight.data = w

    return output_fn


def input_amax(block: nn.Module, linears: dict[str, nn.Linear], inputs: BlockInputs) -> dict[str, torch.Tensor]:
    """max |x| over all calibration tokens of each named linear's input."""
    amax = {name: None for name in linears}

    def observe(name, x):
        m = x.detach().abs().amax().float()
        amax[name] = m if amax[name] is None else torch.maximum(amax[name], m)

    observe_inputs(block, linears, inputs, observe)
    for name, value in amax.items():
        if value is None:
            raise QuantkitError(f"no calibration token reached {name}; calibrate on more text.")
        if not torch.isfinite(value):
            raise QuantkitError(
                f"the calibration activations of {name} contain NaN or inf; try other calibration text."
            )
    return amax
