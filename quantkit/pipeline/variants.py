"""The variants mixed precision's sensitivity costs (`pipeline.mixed`): for each fusion group
(unit) of one block and each candidate format, the block's outputs on its float inputs with
only that unit quantized to that format by the method, every other linear float. `alone` runs
the method's step on a copy of the block per unit and format; `shared` makes the same outputs
bit for bit from one pass over the block (round-to-nearest and GPTQ)."""

from __future__ import annotations

import contextlib

from quantkit.scheme import QuantScheme

SHARED = ("rtn", "gptq")  # methods whose units' formats `shared` makes from one pass over a block
CAPTURED = ("awq",)  # methods whose copies read their inputs captured once per block (`BlockInputs.captured`)


def alone(model, spec, scheme: QuantScheme, method, options, dtype, i, mine, wanted, inputs, kwargs, guides):
    """(unit, format, block i's outputs per batch with only that unit quantized to it) for each
    unit and format of `wanted`: the method's step on a copy of the block (AWQ's way; `shared`'s
    reference). A unit outside the attention leaves its outputs the float block's: the copies
    of such units reuse the first one's (`Replay`)."""
    import copy

    from quantkit.calibration.hooks import Replay
    from quantkit.calibration.runner import BlockInputs
    from quantkit.models.arch import get_module

    prefix, float_block = f"{spec.blocks}.{i}", get_module(model, spec.blocks)[i]
    bspec = spec.for_block(float_block)
    captured = None  # AWQ's captured inputs of the float block, for every unit and format
    if method.name in CAPTURED:
        from quantkit.calibration.awq import SEARCH_TOKENS
        from quantkit.calibration.hooks import mapping_inputs

        captured = mapping_inputs(bspec, float_block, bspec.linears, BlockInputs(inputs[i], kwargs[i]), SEARCH_TOKENS)
    attention = []  # the float attention's outputs per batch, kept by the first copy that runs it
    for unit, formats in zip(mine, wanted):
        outside = not any(n.startswith(f"{prefix}.{bspec.attention}.") for n in unit.linears)
        for name, args in formats.items():
            block = copy.deepcopy(float_block)
            others = tuple(f"{prefix}.{n}" for n in bspec.linears if f"{prefix}.{n}" not in unit.linears)
            only = scheme.replace(weights=args, overrides=(), ignore=scheme.ignore + others)
            step = method.make_step(spec, only, options, {}, dtype, None)
            step(i, prefix, block, BlockInputs(inputs[i], kwargs[i], guides, captured))
            reuse = Replay(get_module(block, bspec.attention), len(inputs[i]), attention).active() if outside else None
            with reuse or contextlib.nullcontext():
                outs = BlockInputs(inputs[i], kwargs[i]).run(block)
            yield unit, name, outs


def shared(model, spec, scheme, method, options, dtype, i, mine, wanted, inputs, kwargs, guides):
    """`alone` for round-to-nearest and GPTQ, bit for bit: GPTQ's Hessians from one
    pass over the float block, one factorisation per Hessian for all formats; each variant's
    weights swapped into the block (no copy), what it cannot change reused (`Replay`)."""
    from quantkit.calibration.hooks import Replay, targets
    from quantkit.calibration.runner import BlockInputs
    from quantkit.models.arch import get_module

    block, prefix = get_module(model, spec.blocks)[i], f"{spec.blocks}.{i}"
    bspec = spec.for_block(block)
    run = BlockInputs(inputs[i], kwargs[i], guides)
    stages = [[list(g) for g in stage] for stage in bspec.stages]
    quantized = [[t for g in stage if (t := targets(scheme, prefix, g))] for stage in stages]  # not ignored
    if method.name == "gptq":
        made = _gptq_alone(block, prefix, list(zip(quantized, wanted)), run, options, dtype)
    else:
        made = [
            {f: _rounded(block, bspec, scheme, prefix, stage, a, dtype) for f, a in formats.items()}
            for stage, formats in zip(quantized, wanted)
        ]
    # reused: the attention's outputs after it, and (dense blocks) the earlier stages' linears'
    batches = len(run.hidden)
    attention = Replay(get_module(block, bspec.attention), batches)
    before = [] if bspec.moe else [Replay(get_module(block, n), batches) for stage in stages for g in stage for n in g]
    for s, (unit, per_format) in enumerate(zip(mine, made)):
        outside = not any(n.startswith(f"{prefix}.{bspec.attention}.") for n in unit.linears)
        earlier = before[: sum(len(g) for stage in stages[:s] for g in stage)]
        for name, weights in per_format.items():
            saved = {n: get_module(block, n).weight.data.clone() for n in weights}
            try:
                for n, w in weights.items():
                    get_module(block, n).weight.data.copy_(w)
                with contextlib.ExitStack() as kept:
                    for r in [attention] * outside + earlier:
                        kept.enter_context(r.active())
                    outs = run.run(block)
            finally:
                for n, w in saved.items():
                    get_module(block, n).weight.data.copy_(w)
            yield unit, name, outs


def _gptq_alone(block, prefix: str, units, inputs, options, scale_dtype, log=None) -> list[dict]:
    """Mixed precision's sensitivity by GPTQ: for each (stage, formats) of `units` (a pass of
    the float block's `spec.stages` and name -> QuantArgs), format name -> {linear name:
    fake-quantized weight}, each what `gptq.gptq_step` makes of that stage quantized alone in that
    format, the rest of the block float, bit for bit: every stage reads the float block's
    activations, so one pass over the calibration batches gathers every Hessian (guided ones
    with `options.guided`), and each Hessian is factored once for all formats
    (`gptq.quantize_weights`). The block is left as it was."""
    import torch

    from quantkit.calibration import gptq, guided
    from quantkit.calibration.hooks import reduce_each
    from quantkit.models.arch import get_module

    firsts, adds, tokens = {}, {}, guided.calibration_tokens(inputs)
    for stage, _ in units:
        for names in stage:
            firsts[names[0]] = get_module(block, names[0])
            fulls = [f"{prefix}.{n}" for n in names]
            adds[names[0]] = (
                guided.hessians(guided.stacked(inputs.guides, fulls), tokens)
                if options.guided
                else gptq.accumulate_hessian
            )
    with torch.no_grad():
        states = reduce_each(block, firsts, inputs, adds, prefix)
        found = []
        for stage, formats in units:
            made = {f: {} for f in formats}
            for names in stage:
                state = states.pop(names[0])
                hs = guided.estimate(state, tokens) if options.guided else [state]
                hs = [gptq.finite(H, f"{prefix}.{names[0]}") for H in hs]
                _gptq_part(block, names, hs, formats, made, options, scale_dtype, log, prefix)
            found.append(made)
    return found


def _gptq_part(block, names, hs, formats, made, options, scale_dtype, log, prefix):
    # the linears `names` stacked (they share their Hessians), their rows in len(hs) groups
    # each under its own Hessian (one: plain GPTQ), for every format at once; a per-tensor
    # format quantizes each linear alone, under the mean of the groups' Hessians
    import torch

    from quantkit.calibration.gptq import quantize_with
    from quantkit.calibration.guided import in_groups
    from quantkit.models.arch import get_module

    def run(weight, outs, parts, picked, label):
        out = {f: torch.empty_like(weight) for f in picked}
        for rows, H in in_groups(outs, parts):
            results = quantize_with(options, weight[rows], H, list(picked.values()), scale_dtype, log, label)
            for f, r in zip(picked, results):
                out[f][rows] = r.weight
        return out

    linears = [get_module(block, n) for n in names]
    outs = [lin.out_features for lin in linears]
    grouped = {f: a for f, a in formats.items() if a.strategy != "tensor"}
    if grouped:
        label = f"{prefix}.{'+'.join(names)}"
        for f, w in run(torch.cat([lin.weight.data for lin in linears]), outs, hs, grouped, label).items():
            made[f].update(zip(names, w.split(outs)))
    tensor = {f: a for f, a in formats.items() if a.strategy == "tensor"}
    for name, lin in zip(names, linears) if tensor else ():
        for f, w in run(lin.weight.data, [lin.out_features], [sum(hs) / len(hs)], tensor, f"{prefix}.{name}").items():
            made[f][name] = w


def _rounded(block, bspec, scheme, prefix, stage, args, dtype) -> dict:
    """linear name -> its weight rounded to nearest in `args`, as `rtn_step` rounds a stage
    (NVFP4: one weight global scale per fusion group)."""
    from quantkit.calibration import fp4, rtn
    from quantkit.models.arch import get_module

    names = [n for g in stage for n in g]
    shared = fp4.weight_global_scales(bspec, scheme.replace(weights=args, overrides=()), prefix, block, names)
    return {n: rtn.quantize_weight(get_module(block, n).weight.data, args, dtype, shared.get(n))[0] for n in names}
