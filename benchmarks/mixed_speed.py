"""Mixed precision's sensitivity, block by block, beside the uniform run's step on the same block
(the method on `--rows` × 512 calibration tokens, default the CLI's 128 × 512, then the block's
forward), in CPU seconds of this process, side by side. Three comparisons (`--before`):

- `options` (the default, 2026-12-03 afternoon and evening): the sensitivity quantizing each unit
  with the method's own options against the same with `--cheaper`'s settings (default `CHEAPER`:
  GPTQ without range search and refinement passes, tried, not shipped: it changed the choice,
  and its perplexity is `mixed_choice.py`'s question; for AWQ e.g. `--cheaper grid=10 clip=false`);
  both through `variants.shared` (GPTQ, RTN) or `variants.alone` (AWQ).
- `guided` (2026-12-03 afternoon): GPTQ's step with `--guided 4` (random loss weights: the work
  does not depend on them; the gradient pass is not timed), its Hessians accumulated by addmm
  against `guided.add_weighted_gram`; the uniform column is then plain GPTQ's step.
- `rows` (2026-12-03 evening): GPTQ's per-linear work (`gptq.quantize_weight`: factorisation,
  column loop, and with `full` the range search and 2 refinement passes) at smollm2's shapes on
  random weights and inputs (4,096 tokens), one call over all rows under one Hessian against 4
  row groups each under its own (what `--guided 4` runs per linear); no model is loaded.
- `copies` (2026-12-03 morning): each unit × format quantized by the method on a copy of its
  block (`variants.alone`) against the shared pass (`variants.shared`: one Hessian per unit, one
  factorisation for all formats; for AWQ, the copies reading the block's inputs captured once),
  the outputs checked equal bit for bit.

    OMP_NUM_THREADS=1 python benchmarks/mixed_speed.py [--model smollm2-135m] [--blocks 3]
        [--methods gptq rtn] [--before options|guided|rows|copies] [--rows 128] [--cheaper KEY=VALUE ...]

The sensitivity's windows are `mixed.SENSITIVITY_WINDOWS` (8 × 256), the scheme w4a16-asym
(act-order static for GPTQ, as its command), calibration `news`, seed 0. The Fisher pass, the
same for both, is not timed here.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import time

import torch

from quantkit.calibration import guided
from quantkit.calibration.datasets import calibration_samples, load_documents
from quantkit.calibration.registry import METHODS
from quantkit.calibration.runner import BlockInputs, capture_block_inputs
from quantkit.models.arch import arch_for, get_module
from quantkit.models.loading import load_float_model, resolve_model
from quantkit.pipeline import mixed, variants
from quantkit.scheme import preset, with_actorder


def block_inputs(model, spec, tokenizer, rows: int, seq: int, blocks: int):
    """Each of the first `blocks` blocks' float inputs per batch of `rows` × `seq` news tokens."""
    samples = calibration_samples(tokenizer, load_documents("news", "calib"), rows, seq, 0)
    with torch.no_grad():
        hidden, kwargs = capture_block_inputs(model, spec, samples, 8, torch.device("cpu"))
        inputs = [hidden]
        for i in range(blocks):
            inputs.append(BlockInputs(inputs[i], kwargs[i]).run(get_module(model, spec.blocks)[i]))
    return inputs, kwargs


def cpu(fn) -> tuple[float, object]:
    start = time.process_time()
    out = fn()
    return time.process_time() - start, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--blocks", type=int, default=3)
    parser.add_argument("--methods", nargs="+", default=["gptq"])
    parser.add_argument("--before", choices=tuple(HEADS), default="options")
    parser.add_argument("--rows", type=int, default=128, help="the uniform step's calibration rows of 512 tokens")
    parser.add_argument("--cheaper", nargs="*", default=None, help="`--before options`: the options left out")
    a = parser.parse_args()
    cheaper = CHEAPER if a.cheaper is None else dict(map(setting, a.cheaper))
    if a.before == "rows":
        return _rows()
    model, tokenizer, _ = load_float_model(resolve_model(a.model), owned=True)
    dtype = model.dtype
    model.float()
    spec = arch_for(model.config)
    found = mixed.units(model, spec)
    small = block_inputs(model, spec, tokenizer, *mixed.SENSITIVITY_WINDOWS, a.blocks)
    full = block_inputs(model, spec, tokenizer, a.rows, 512, a.blocks)
    print(f"| method | block | uniform step, {a.rows} × 512 (CPU s) | {' | '.join(HEADS[a.before])} | before / after |")
    print("|---|---|---|---|---|---|")
    for name in a.methods:
        method = METHODS[name]
        scheme = with_actorder(preset("w4a16-asym").with_group_size(64), "static" if method.actorder else None)
        options, cands = method.options(), mixed.candidates(scheme)
        totals = [0.0, 0.0, 0.0]
        for i in range(a.blocks):
            mine = [u for u in found if u.block == i]
            wanted = [{n: x for n, x in cands.items() if x is not None and u.fits(x)} for u in mine]
            args = (model, spec, scheme, method, options, dtype, i, mine, wanted, small[0], small[1], None)
            uniform = _uniform(method, spec, scheme, options, dtype, model, i, full)
            if a.before == "guided":
                before, after = _guided(method, spec, scheme, options, dtype, model, i, full)
            elif a.before == "copies":
                before, after = _copies(name, args)
            else:
                before, after = _options(name, args, cheaper)
            for k, t in enumerate((uniform, before, after)):
                totals[k] += t
            print(f"| {name} | {i} | {uniform:.1f} | {before:.1f} | {after:.1f} | {before / after:.2f} |", flush=True)
        u, b, s = totals
        print(f"| {name} | all {a.blocks} | {u:.1f} | {b:.1f} ({b / u:.2f}×) | {s:.1f} ({s / u:.2f}×) | {b / s:.2f} |")


HEADS = {
    "options": ("the method's options (CPU s)", "with --cheaper's (CPU s)"),
    "copies": ("copies (CPU s)", "shared (CPU s)"),
    "rows": ("one call, all rows (CPU s)", "4 row groups, 4 Hessians (CPU s)"),
    "guided": ("--guided 4, Hessians by addmm (CPU s)", "--guided 4, by upper blocks (CPU s)"),
}


def _uniform(method, spec, scheme, options, dtype, model, i, full, guides=None) -> float:
    """CPU s of the method's step on a copy of block i (its inputs `full`), then the block's forward."""
    block = copy.deepcopy(get_module(model, spec.blocks)[i])
    inputs = BlockInputs(full[0][i], full[1][i], guides)
    step = method.make_step(spec, scheme, options, {}, dtype, None)
    with torch.no_grad():
        return cpu(lambda: (step(i, f"{spec.blocks}.{i}", block, inputs), inputs.run(block)))[0]


def _guided(method, spec, scheme, options, dtype, model, i, full) -> tuple[float, float]:
    """CPU s of GPTQ's step with 4 loss-guided Hessians per linear, the Hessians accumulated by
    addmm (before) and by `guided.add_weighted_gram` (after). The loss weights are random: the
    work does not depend on them, and the gradient pass (the same for both) is not timed."""
    prefix, generator = f"{spec.blocks}.{i}", torch.Generator().manual_seed(0)
    tokens = sum(h.shape[0] * h.shape[1] for h in full[0][i])
    linears = spec.for_block(get_module(model, spec.blocks)[i]).linears
    guides = {f"{prefix}.{n}": torch.rand(tokens, 4, generator=generator) + 0.5 for n in linears}
    options = dataclasses.replace(options, guided=4)
    kept = guided.add_weighted_gram

    def addmm(H, x, w, beta, alpha):
        H.mul_(beta).addmm_(x.T * w, x, alpha=alpha)

    guided.add_weighted_gram = addmm
    try:
        before = _uniform(method, spec, scheme, options, dtype, model, i, full, guides)
    finally:
        guided.add_weighted_gram = kept
    return before, _uniform(method, spec, scheme, options, dtype, model, i, full, guides)


ROW_SHAPES = {"q": (576, 576), "k, v": (192, 576), "o": (576, 576), "gate, up": (1536, 576), "down": (576, 1536)}
ROW_SHAPES_PLAIN = {"q+k+v": (960, 576), "gate+up": (3072, 576)}  # what plain GPTQ quantizes in one call


def _rows() -> None:
    """CPU s of GPTQ's per-linear work, all rows under one Hessian against 4 row groups under 4."""
    from quantkit.calibration import gptq
    from quantkit.scheme import QuantArgs

    args = QuantArgs(num_bits=4, type="int", symmetric=False, strategy="group", group_size=64, actorder="static")
    g = torch.Generator().manual_seed(0)
    print(f"| linear [out, in] | work | {' | '.join(HEADS['rows'])} | 4 groups / one |")
    print("|---|---|---|---|---|")
    for name, (out, n) in {**ROW_SHAPES, **ROW_SHAPES_PLAIN}.items():
        x = torch.randn(4096, n, generator=g) * torch.rand(n, generator=g) * 3  # x [tokens, in]
        hessians = [2 * (x.T * (torch.rand(len(x), generator=g) + 0.5)) @ x / len(x) for _ in range(5)]
        w = torch.randn(out, n, generator=g) * 0.05
        for work, kw in (("full", {"range_search": True, "refine": 2}), ("column loop", {})):
            one = cpu(lambda: gptq.quantize_weight(w, hessians[4], args, 128, 0.05, **kw))[0]
            rows = [slice(k * out // 4, (k + 1) * out // 4) for k in range(4)]
            if name in ROW_SHAPES_PLAIN:
                print(f"| {name} [{out}, {n}] | {work} | {one:.3f} | — | — |", flush=True)
                continue
            four = cpu(lambda: [gptq.quantize_weight(w[r], h, args, 128, 0.05, **kw) for r, h in zip(rows, hessians)])
            print(f"| {name} [{out}, {n}] | {work} | {one:.3f} | {four[0]:.3f} | {four[0] / one:.2f} |", flush=True)


def _copies(name, args) -> tuple[float, float]:
    """CPU s of `variants.alone` (capturing on every copy) and of the shared pass, outputs checked equal."""
    fast = variants.shared if name in variants.SHARED else variants.alone
    with torch.no_grad():
        kept, variants.CAPTURED = variants.CAPTURED, ()  # before: AWQ captures on every copy
        before, old = cpu(lambda: [(u, f, o) for u, f, o in variants.alone(*args)])
        variants.CAPTURED = kept
        after, new = cpu(lambda: [(u, f, o) for u, f, o in fast(*args)])
    assert [(u, f) for u, f, _ in old] == [(u, f) for u, f, _ in new]
    assert all(torch.equal(x, y) for (_, _, a_), (_, _, b_) in zip(old, new) for x, y in zip(a_, b_))
    return before, after


CHEAPER = {"range_search": False, "refine": 0}  # the settings `--before options` tries by default


def setting(text: str) -> tuple[str, object]:
    """ "grid=10" -> ("grid", 10); true/false -> bool."""
    key, value = text.split("=", 1)
    words = {"true": True, "false": False}
    if value.lower() in words:
        return key, words[value.lower()]
    return key, float(value) if "." in value else int(value)


def _options(name, args, settings: dict) -> tuple[float, float]:
    """CPU s of the sensitivity's variants with the method's options and with `settings` (those it has)."""
    make = variants.shared if name in variants.SHARED else variants.alone
    fields = {f.name for f in dataclasses.fields(args[4])}
    cheaper = dataclasses.replace(args[4], **{k: v for k, v in settings.items() if k in fields})
    cheap = (*args[:4], cheaper, *args[5:])
    with torch.no_grad():
        before, _ = cpu(lambda: list(make(*args)))
        after, _ = cpu(lambda: list(make(*cheap)))
    return before, after


if __name__ == "__main__":
    main()
