"""quantkit autoround block by block: round to nearest against the learned rounding, on the
calibration rows it trained on and on held-out rows, so overfitting shows.

    OMP_NUM_THREADS=1 python benchmarks/autoround_heldout.py [--iters 8] [--batch 4] [--rows 16]
        [--seq-len 256] [--blocks 6] [--grid minmax|full]

smollm2-135m, w4a16 symmetric g64. 2 × --rows `news` rows (seed 0): the first --rows train
(`learn_block`, as `quantkit autoround` runs it: the quantized block on the quantized model's
inputs against the float block on the float model's inputs), the rest are held out. Prints, per
block, the block-output MSE of round to nearest and of the kept rounding on both sets, and each
block's step losses; the quantized stream continues with the kept rounding.
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import AutoModelForCausalLM

from quantkit.calibration.autoround import BlockData, Rounding, _float_outputs, _full_loss, learn_block
from quantkit.calibration.datasets import calibration_samples, load_documents
from quantkit.calibration.hooks import targets, weight_args
from quantkit.calibration.runner import run_blocks
from quantkit.models.arch import arch_for, get_module
from quantkit.models.loading import load_tokenizer, resolve_model
from quantkit.scheme import preset


class Stop(Exception):
    pass


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=8)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--rows", type=int, default=16, help="training rows (as many again are held out)")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--blocks", type=int, default=6)
    p.add_argument("--grid", choices=("full", "minmax"), default="minmax")
    a = p.parse_args()
    path = resolve_model("smollm2-135m")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    spec, scheme = arch_for(model.config), preset("w4a16").with_group_size(64)
    rows = calibration_samples(load_tokenizer(path), load_documents("news", "calib"), 2 * a.rows, a.seq_len, 0)
    train_batches = a.rows // 8
    state = {"float": None, "sums": [0.0] * 4}

    def step(index, prefix, block, inputs) -> None:
        if index >= a.blocks:
            raise Stop
        fin = inputs.hidden if state["float"] is None else state["float"]
        outs = state["float"] = _float_outputs(block, fin, inputs.kwargs)
        names = targets(scheme, prefix, spec.for_block(block).linears)
        rs = {
            n: Rounding(get_module(block, n).weight.data, weight_args(scheme, prefix, n), full=a.grid == "full")
            for n in names
        }
        k = train_batches
        train = BlockData(inputs.hidden[:k], inputs.kwargs[:k], outs[:k])
        held = BlockData(inputs.hidden[k:], inputs.kwargs[k:], outs[k:])

        def held_loss() -> float:
            with torch.no_grad():
                return _full_loss(block, {f"{n}.weight": r.weight() for n, r in rs.items()}, held)

        held_rtn = held_loss()
        found = learn_block(block, rs, train, a.iters, None, None, a.batch, index)
        held_kept = held_loss()
        values = [found.rtn_loss, found.loss, held_rtn, held_kept]
        state["sums"] = [s + v for s, v in zip(state["sums"], values)]
        print(
            f"block {index:2d}: train RTN {values[0]:.4g} kept {values[1]:.4g} ({values[1] / values[0] - 1:+.1%}), "
            f"held-out RTN {values[2]:.4g} kept {values[3]:.4g} ({values[3] / values[2] - 1:+.1%}); "
            f"step losses {' '.join(f'{x:.3g}' for x in found.losses)}",
            flush=True,
        )
        for n, r in rs.items():
            get_module(block, n).weight.data.copy_(r.final(torch.float32)[0])

    start = time.process_time()
    try:
        run_blocks(model, spec, step, rows, 8)
    except Stop:
        pass
    s = state["sums"]
    print(f"sum over blocks: train {s[1] / s[0] - 1:+.2%}, held-out {s[3] / s[2] - 1:+.2%}; ", end="")
    print(f"{time.process_time() - start:.0f} CPU-s")


if __name__ == "__main__":
    main()
