"""Runner steps: the glue between the layer-by-layer runner and the pure algorithms
(rtn.py, gptq.py, awq.py). A step gets one decoder block and its calibration inputs,
quantizes the block's linears in place (to their fake-quantized values) and records
the chosen qparams by full module name. Each step says whether it needs calibration
inputs (`step.needs_data`)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from quantkit.calibration import awq, gptq, rtn, smooth
from quantkit.calibration.runner import BlockInputs, Step
from quantkit.errors import QuantkitError
from quantkit.primitives import FP8_MAX, compute_qparams, fake_quantize
from quantkit.models.arch import ArchSpec, get_module
from quantkit.scheme import QuantScheme


@dataclass
class QParams:
    """The quantization parameters an algorithm chose for one linear."""

    scale: torch.Tensor
    zero_point: torch.Tensor | None = None
    g_idx: torch.Tensor | None = None
    input_scale: torch.Tensor | None = None  # static fp8 activations


class _Stop(Exception):
    pass


def _targets(spec: ArchSpec, scheme: QuantScheme, prefix: str, group) -> list[str]:
    return [name for name in group if not scheme.is_ignored(f"{prefix}.{name}")]


def rtn_step(spec: ArchSpec, scheme: QuantScheme, scale_dtype, results: dict, log=None) -> Step:
    """Round every targeted linear of a block to nearest (no calibration data)."""

    def step(index: int, prefix: str, block: nn.Module, inputs: BlockInputs | None) -> None:
        for name in _targets(spec, scheme, prefix, spec.linears):
            linear = get_module(block, name)
            w, scale, zero = rtn.quantize_weight(linear.weight.data, scheme.weights, scale_dtype)
            linear.weight.data.copy_(w)  # in place: see quantkit.malloc
            results[f"{prefix}.{name}"] = QParams(scale, zero)

    step.needs_data = False
    return step


class Replay:
    """Reuse a finished sub-module's outputs across passes over the calibration batches:
    while active, the module's calls of the first pass run and are kept, and the calls of
    later passes (one per batch, in the same order) return the kept outputs. Only valid
    while the module's weights and inputs stay as they were."""

    def __init__(self, module: nn.Module, batches: int):
        self.module, self.batches, self.outputs, self.calls = module, batches, [], 0

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
def group_hessian(block: nn.Module, linear: nn.Linear, inputs: BlockInputs, name: str,
                  replay: Replay | None = None) -> torch.Tensor:
    """H = 2·XᵀX / n of the inputs of `linear` over all calibration batches, running the
    block (as it is now) only as far as that linear (reusing `replay`'s module outputs)."""
    H, n = None, 0

    def hook(module, args):
        nonlocal H, n
        H, n = gptq.accumulate_hessian(H, args[0], n)
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
    if H is None or n == 0:
        raise QuantkitError(f"no calibration token reached {name}; calibrate on more text.")
    if not torch.isfinite(H).all():
        raise QuantkitError(f"the calibration activations of {name} contain NaN or inf; the float model "
                            "overflows on this text (try float32 or other calibration text).")
    return H


def gptq_step(spec: ArchSpec, scheme: QuantScheme, scale_dtype, results: dict, log: Callable | None = None,
              block_size: int = 128, damp: float = 0.01) -> Step:
    """GPTQ, true-sequential inside the block: each group of linears that share an input
    (q,k,v → o → gate,up → down) is quantized on inputs recomputed after the groups
    before it were quantized. Once the attention's linears are all done, its outputs are
    computed once and reused by the later groups' passes."""
    attention = [n for n in spec.linears if n.startswith(spec.attention + ".")]

    def step(index: int, prefix: str, block: nn.Module, inputs: BlockInputs | None) -> None:
        done, replay = set(), None
        for group in spec.sequential:
            if replay is None and all(n in done for n in attention):
                replay = Replay(get_module(block, spec.attention), len(inputs.hidden))
            done.update(group)
            names = _targets(spec, scheme, prefix, group)
            if not names:
                continue
            H = group_hessian(block, get_module(block, names[0]), inputs, f"{prefix}.{names[0]}", replay)
            # the rows of linears that share H are quantized independently, so one call on
            # their stacked weights gives each one's result with one factorisation and loop
            parts = [[n] for n in names] if scheme.weights.strategy == "tensor" else [names]
            for part in parts:
                linears = [get_module(block, n) for n in part]
                r = gptq.quantize_weight(torch.cat([l.weight.data for l in linears]), H, scheme.weights, block_size,
                                         damp, scale_dtype=scale_dtype, log=log, name=f"{prefix}.{'+'.join(part)}")
                rows = [l.out_features for l in linears]
                zeros = r.zero_point.split(rows) if r.zero_point is not None else [None] * len(rows)
                for name, linear, w, scale, zero in zip(part, linears, r.weight.split(rows), r.scale.split(rows), zeros):
                    linear.weight.data.copy_(w)
                    g_idx = r.g_idx.clone() if r.g_idx is not None else None  # one tensor per linear on disk
                    results[f"{prefix}.{name}"] = QParams(scale.clone(), None if zero is None else zero.clone(), g_idx)

    step.needs_data = True
    return step


@torch.no_grad()
def _observe_inputs(block: nn.Module, linears: dict[str, nn.Linear], inputs: BlockInputs, observe) -> None:
    """Run the block on every calibration batch, calling observe(name, x) with the input
    x of each named linear."""
    hooks = [module.register_forward_pre_hook(lambda m, args, name=name: observe(name, args[0]))
             for name, module in linears.items()]
    try:
        inputs.run(block)
    finally:
        for h in hooks:
            h.remove()


def capture_inputs(block: nn.Module, linears: dict[str, nn.Linear], inputs: BlockInputs, max_tokens: int):
    """Inputs [tokens, in] of each named linear over the calibration batches, run through
    the block as it is now; evenly spaced tokens, at most about `max_tokens` of them."""
    total = sum(h.shape[0] * h.shape[1] for h in inputs.hidden)
    stride = max(1, total // max_tokens)
    seen: dict[str, list[torch.Tensor]] = {name: [] for name in linears}
    _observe_inputs(block, linears, inputs,
                    lambda name, x: seen[name].append(x.reshape(-1, x.shape[-1])[::stride].float()))
    for name, chunks in seen.items():
        if not chunks or sum(c.shape[0] for c in chunks) == 0:
            raise QuantkitError(f"no calibration token reached {name}; calibrate on more text.")
    return {name: torch.cat(chunks) for name, chunks in seen.items()}


def _mappings(spec: ArchSpec, block: nn.Module, names: list[str]):
    """(mapping, previous op, targeted linears) for each AWQ/SmoothQuant mapping of the
    table that targets some of `names` and whose shapes allow it (not v → o under
    grouped-query attention)."""
    for m in spec.awq:
        linears = [get_module(block, n) for n in m.linears if n in names]
        prev = get_module(block, m.prev)
        if linears and not (isinstance(prev, nn.Linear) and prev.out_features != linears[0].in_features):
            yield m, prev, linears


def _group_inputs(spec: ArchSpec, block: nn.Module, names: list[str], inputs: BlockInputs, max_tokens: int):
    """capture_inputs for the input each sequential group of `names` reads, keyed by the
    group's first linear."""
    return capture_inputs(block, {n: get_module(block, n) for n in {_owner(spec, n) for n in names}},
                          inputs, max_tokens)


def _owner(spec: ArchSpec, name: str) -> str:
    """The first linear of the sequential group `name` is in (the group reads one input)."""
    return next(g[0] for g in spec.sequential if name in g)


@torch.no_grad()
def _capture_calls(block: nn.Module, modules: dict[str, nn.Module], inputs: BlockInputs, max_tokens: int):
    """The (args, kwargs) each named module receives on the first calibration batches,
    at least `max_tokens` tokens' worth (whole sequences, so attention can run on them)."""
    calls = {name: [] for name in modules}
    hooks = [m.register_forward_pre_hook(lambda mod, a, kw, name=name: calls[name].append((a, dict(kw))),
                                         with_kwargs=True) for name, m in modules.items()]
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


def _module_output(module: nn.Module, linears: list[nn.Linear], calls: list):
    """output_fn for the AWQ search: `module`'s output on its captured calls with the
    linears' weights swapped for the candidates."""

    def output_fn(weights: list[torch.Tensor]) -> torch.Tensor:
        saved = [l.weight.data for l in linears]
        for l, w in zip(linears, weights):
            l.weight.data = w
        try:
            outs = [module(*args, **kwargs) for args, kwargs in calls]
            outs = [o[0] if isinstance(o, tuple) else o for o in outs]  # attention returns (output, weights)
            return torch.cat([o.reshape(-1, o.shape[-1]) for o in outs])
        finally:
            for l, w in zip(linears, saved):
                l.weight.data = w

    return output_fn


def awq_step(spec: ArchSpec, scheme: QuantScheme, scale_dtype, results: dict, log: Callable | None = None,
             grid: int = 20, duo: bool = False, clip: bool = True, search_tokens: int = 16384,
             module_loss: bool = False, module_tokens: int = 4096, loaded: dict | None = None,
             record: dict | None = None) -> Step:
    """AWQ: per mapping (norm → q,k,v; v → o when shapes allow; norm → gate,up; up → down)
    search activation-aware scales and fold them into the previous op, then search
    per-group clipping ranges for each linear (q and k too: on smollm2 that measured better)
    and quantize with them. With `loaded` (a saved search) nothing is searched and no
    calibration data is needed; `record` collects the search for saving."""
    args = scheme.weights

    def step(index: int, prefix: str, block: nn.Module, inputs: BlockInputs | None) -> None:
        names = _targets(spec, scheme, prefix, spec.linears)
        feats = _group_inputs(spec, block, names, inputs, search_tokens) if loaded is None else {}
        inspected = {m.inspect: get_module(block, m.inspect) for m in spec.awq if m.inspect and module_loss}
        calls = _capture_calls(block, inspected, inputs, module_tokens) if loaded is None and inspected else {}
        for m, prev, linears in _mappings(spec, block, names):
            key = f"{prefix}.{m.prev}.awq_scales"
            if loaded is not None:
                if key not in loaded:
                    raise QuantkitError(f"the saved AWQ search has no scales for {prefix}.{m.prev}; "
                                        "it was made for another model or scheme.")
                scales = loaded[key].float()
            else:
                x = feats[_owner(spec, m.linears[0])]
                output_fn = _module_output(inspected[m.inspect], linears, calls[m.inspect]) \
                    if m.inspect in inspected else None
                scales = awq.search_scales(x, [l.weight.data for l in linears], args, grid, duo, output_fn,
                                           scale_dtype=scale_dtype, name=f"{prefix}.{m.prev}").scales
                feats[_owner(spec, m.linears[0])] = x / scales
            awq.fold_scales(prev.weight.data, getattr(prev, "bias", None), [l.weight.data for l in linears], scales)
            if record is not None:
                record[key] = scales
        summed = {}  # per input: what the clip search scores with
        for name in names:
            linear, full = get_module(block, name), f"{prefix}.{name}"
            w, ranges = linear.weight.data, None
            if clip:
                if loaded is not None:
                    ranges = loaded.get(f"{full}.awq_clip")
                    if ranges is not None and ranges.dim() != 3:
                        raise QuantkitError(f"the saved AWQ search has clip maxima for {full} from an older quantkit "
                                            "(it now saves [lo, hi] ranges); search again without --load-search.")
                else:
                    owner = _owner(spec, name)
                    if owner not in summed:
                        summed[owner] = awq.clip_inputs(feats[owner], args, name=full)
                    ranges = awq.search_clip(w, summed[owner], args, scale_dtype=scale_dtype, name=full)
            if ranges is None:
                q, scale, zero = rtn.quantize_weight(w, args, scale_dtype)
            else:
                scale, zero = awq.clip_qparams(w, ranges, args, scale_dtype)
                q = fake_quantize(w, args, scale, zero)
                if record is not None:
                    record[f"{full}.awq_clip"] = ranges
            w.copy_(q)  # in place: see quantkit.malloc
            results[full] = QParams(scale, zero)

    step.needs_data = loaded is None
    return step


def input_amax(block: nn.Module, linears: dict[str, nn.Linear], inputs: BlockInputs) -> dict[str, torch.Tensor]:
    """max |x| over all calibration tokens of each named linear's input."""
    amax = {name: None for name in linears}

    def observe(name, x):
        m = x.detach().abs().amax().float()
        amax[name] = m if amax[name] is None else torch.maximum(amax[name], m)

    _observe_inputs(block, linears, inputs, observe)
    for name, value in amax.items():
        if value is None:
            raise QuantkitError(f"no calibration token reached {name}; calibrate on more text.")
        if not torch.isfinite(value):
            raise QuantkitError(f"the calibration activations of {name} contain NaN or inf; try other calibration text.")
    return amax


def fp8_step(spec: ArchSpec, scheme: QuantScheme, scale_dtype, results: dict, log: Callable | None = None,
             smooth_grid: int = 0, search_tokens: int = 2048) -> Step:
    """FP8 e4m3 weights (amax / 448 per channel or tensor) and, for static activations,
    a per-tensor input scale from the max |x| each linear sees on the calibration set
    (observed after the block's weights are quantized). With `smooth_grid` > 0, first
    migrate activation outliers into the weights (SmoothQuant, α searched on that grid)
    for every mapping of the architecture table whose shapes allow it."""
    acts = scheme.input_activations
    static = acts is not None and not acts.dynamic

    def smooth_block(prefix: str, block: nn.Module, names: list[str], inputs: BlockInputs) -> None:
        feats = _group_inputs(spec, block, names, inputs, search_tokens)
        for m, prev, linears in _mappings(spec, block, names):
            x = feats[_owner(spec, m.linears[0])]
            r = smooth.search_smooth_scales(x, [l.weight.data for l in linears], scheme.weights, acts,
                                            smooth_grid, name=f"{prefix}.{m.prev}")
            awq.fold_scales(prev.weight.data, getattr(prev, "bias", None), [l.weight.data for l in linears], r.scales)
            feats[_owner(spec, m.linears[0])] = x / r.scales

    def step(index: int, prefix: str, block: nn.Module, inputs: BlockInputs | None) -> None:
        names = _targets(spec, scheme, prefix, spec.linears)
        if smooth_grid:
            smooth_block(prefix, block, names, inputs)
        for name in names:
            linear = get_module(block, name)
            scale, _ = compute_qparams(linear.weight.data, scheme.weights, torch.float32)
            linear.weight.data.copy_(fake_quantize(linear.weight.data, scheme.weights, scale))
            results[f"{prefix}.{name}"] = QParams(scale)
        if static:
            amax = input_amax(block, {f"{prefix}.{n}": get_module(block, n) for n in names}, inputs)
            for full, value in amax.items():
                results[full].input_scale = (value.clamp_min(1e-12) / FP8_MAX).reshape(1)

    step.needs_data = static or smooth_grid > 0
    return step


STEPS = {"rtn": rtn_step, "gptq": gptq_step, "awq": awq_step, "fp8": fp8_step}
