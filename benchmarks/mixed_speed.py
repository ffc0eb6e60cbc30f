"""Mixed precision's sensitivity, block by block: each unit × format quantized by the method on a
copy of its block (`variants.alone`, the code before 2026-12-03) against the shared pass
(`variants.shared`: one Hessian per unit, one factorisation for all formats; for AWQ, the copies
reading the block's inputs captured once), beside the
uniform run's step on the same block (the method on the CLI's default 128 × 512 calibration
tokens, then the block's forward), in CPU seconds of this process, side by side.

    OMP_NUM_THREADS=1 python benchmarks/mixed_speed.py [--model smollm2-135m] [--blocks 3]
        [--methods gptq rtn]

The sensitivity's windows are `mixed.SENSITIVITY_WINDOWS` (8 × 256), the scheme w4a16-asym
(act-order static for GPTQ, as its command), calibration `news`, seed 0. Both paths' outputs are
checked equal, bit for bit. The Fisher pass, the same for both, is not timed here.
"""

from __future__ import annotations

import argparse
import copy
import time

import torch

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
    a = parser.parse_args()
    model, tokenizer, _ = load_float_model(resolve_model(a.model), owned=True)
    dtype = model.dtype
    model.float()
    spec = arch_for(model.config)
    found = mixed.units(model, spec)
    small = block_inputs(model, spec, tokenizer, *mixed.SENSITIVITY_WINDOWS, a.blocks)
    full = block_inputs(model, spec, tokenizer, 128, 512, a.blocks)
    print("| method | block | uniform step, 128 × 512 (CPU s) | copies (CPU s) | shared (CPU s) | copies / shared |")
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
            fast = variants.shared if name in variants.SHARED else variants.alone
            with torch.no_grad():
                kept, variants.CAPTURED = variants.CAPTURED, ()  # before: AWQ captures on every copy
                before, old = cpu(lambda: [(u, f, o) for u, f, o in variants.alone(*args)])
                variants.CAPTURED = kept
                after, new = cpu(lambda: [(u, f, o) for u, f, o in fast(*args)])
            assert [(u, f) for u, f, _ in old] == [(u, f) for u, f, _ in new]
            assert all(torch.equal(x, y) for (_, _, a_), (_, _, b_) in zip(old, new) for x, y in zip(a_, b_))
            block = copy.deepcopy(get_module(model, spec.blocks)[i])
            inputs = BlockInputs(full[0][i], full[1][i])
            step = method.make_step(spec, scheme, options, {}, dtype, None)
            with torch.no_grad():
                uniform, _ = cpu(lambda: (step(i, f"{spec.blocks}.{i}", block, inputs), inputs.run(block)))
            for k, t in enumerate((uniform, before, after)):
                totals[k] += t
            print(f"| {name} | {i} | {uniform:.1f} | {before:.1f} | {after:.1f} | {before / after:.2f} |", flush=True)
        u, b, s = totals
        print(f"| {name} | all {a.blocks} | {u:.1f} | {b:.1f} ({b / u:.2f}×) | {s:.1f} ({s / u:.2f}×) | {b / s:.2f} |")


if __name__ == "__main__":
    main()
